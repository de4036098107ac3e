"""bench/harness/sets.py's embedding-like synthetic sets (synth<N>x<DIM>): what the docstring claims of them, measured
on a small one: unit rows, a low intrinsic dimension, and ground truth that brute force agrees with."""

import json

import numpy as np
import pytest

from bench.harness import sets


def _knn_float32(base, queries, k=sets.GT_K):
    """sets.exact_knn without faiss (a bench extra, not installed for the tests): float32 brute force."""
    b = np.asarray(base, np.float32)
    d = (b ** 2).sum(1)[None] - 2 * queries @ b.T
    return np.argsort(d, axis=1, kind="stable")[:, :k].astype(np.int32)


def test_latent_set(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("faiss") is None:  # a bench extra
        monkeypatch.setattr(sets, "exact_knn", _knn_float32)
    d = sets.prepare(tmp_path, "synth3kx256")
    base, queries, gt, meta = sets.load(tmp_path, "synth3kx256")
    assert base.shape == (3000, 256) and queries.shape == (1000, 256)
    assert meta["metric"] == "cosine" and json.loads((d / "meta.json").read_text())["dim"] == 256
    x = np.asarray(base, np.float64)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    # tens of directions carry the vectors, as with text embeddings: 64 of 256 hold nearly all of the variance
    s = np.linalg.svd(x - x.mean(0), compute_uv=False) ** 2
    assert s[:64].sum() / s.sum() > 0.95
    assert s[:16].sum() / s.sum() < 0.9  # and not a handful of them
    # ground truth: the nearest rows by brute force in float64 (unit rows, so L2 order is cosine order)
    q = np.asarray(queries[:50], np.float64)
    dist = (q ** 2).sum(1)[:, None] + (x ** 2).sum(1)[None] - 2 * q @ x.T
    top = np.argsort(dist, axis=1, kind="stable")[:, :10]
    agree = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top, gt[:50, :10])])
    assert agree > 0.99


def test_names(tmp_path):
    assert sets._count("1m") == 1_000_000 and sets._count("300k") == 300_000
    with pytest.raises(SystemExit, match="synth<N>x<DIM>"):
        sets.prepare(tmp_path, "nosuchset")
