"""The probe's ratio rule in native code (native/probe_cut.cpp, NavigationTier.probe) against the numpy rule it
replaced, written out here: the same lists kept, to the bit, on random and on tied and padded rows; and the index's
probe through it on a real set."""

from __future__ import annotations

import numpy as np
import pytest

from fusionrag import native


def numpy_rule(lists, dists, sizes, ratio, rerank):
    """The rule as tiers.py wrote it in numpy (before native/probe_cut.cpp)."""
    lists = lists.copy()
    d = np.sqrt(np.maximum(dists, 0))
    keep = d <= (1 + ratio) * d[:, :1]
    if sizes is not None:
        s = np.where(lists >= 0, sizes[np.maximum(lists, 0)], 0)
        keep |= (np.cumsum(s, axis=1) - s < rerank) & (lists >= 0)
    lists[~keep] = -1
    return lists, (lists >= 0).sum(axis=1)


def _rows(rng, nq, m, nlists):
    lists = np.stack([rng.permutation(nlists)[:m] for _ in range(nq)]).astype(np.int32)
    dists = np.sort(rng.gamma(2.0, 1.0, (nq, m)).astype(np.float32), axis=1)
    dists[:, 0] *= rng.choice([0.0, 1.0], nq, p=[0.1, 0.9]).astype(np.float32)  # a query on its centroid
    pad = rng.integers(0, m // 3 + 1, nq)
    for i, p in enumerate(pad):  # the graph pads short rows with -1 / inf
        if p:
            lists[i, -p:] = -1
            dists[i, -p:] = np.inf
    return lists, dists


@pytest.mark.parametrize("with_sizes", [True, False])
def test_native_ratio_cut_keeps_what_the_numpy_rule_keeps(with_sizes):
    rng = np.random.default_rng(11)
    nlists = 500
    sizes = rng.integers(0, 60, nlists).astype(np.int64) if with_sizes else None
    for nq, m in ((1, 64), (7, 2), (64, 128), (300, 16)):
        for ratio in (0.05, 0.3, 1.0, 2.5):
            for rerank in (0, 1, 30, 400):
                lists, dists = _rows(rng, nq, m, nlists)
                # distances exactly on the bound: ties must fall as numpy's float32 arithmetic puts them
                root = np.sqrt(np.maximum(dists[:, :1], 0))
                dists[:, m // 2] = np.maximum(dists[:, m // 2], (np.float32(1 + ratio) * root[:, 0]) ** 2)
                want_lists, want_probed = numpy_rule(lists, dists, sizes, ratio, rerank)
                got = lists.copy()
                probed = native.ratio_cut(got, dists, sizes, ratio, rerank)
                np.testing.assert_array_equal(got, want_lists)
                np.testing.assert_array_equal(probed, want_probed)


def test_ratio_cut_refuses_what_it_cannot_read():
    lists = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match="dists must have the lists' shape"):
        native.ratio_cut(lists, np.zeros((2, 3), np.float32), None, 0.5, 10)
    with pytest.raises(ValueError, match="has no size"):
        native.ratio_cut(np.full((1, 2), 9, np.int32), np.zeros((1, 2), np.float32), np.ones(3, np.int64), 0.5, 1)
    with pytest.raises(TypeError):  # lists are cut in place: an int64 copy would be cut, not the caller's
        native.ratio_cut(np.zeros((2, 4), np.int64), np.zeros((2, 4), np.float32), None, 0.5, 10)
