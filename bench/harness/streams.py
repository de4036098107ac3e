"""The query streams the cache and peer studies search, the sets as they prepare them, and the default build
they search (the library part of what was bench/cache/cache_policy.py; its study is bench/cache/cache_policy.py).

Streams, drawn from one half of a set's queries (the other half chooses the default):
    uniform   the queries themselves, in order
    skewed    queries drawn Zipf(1.0) over k-means clusters of the queries, uniform within a cluster,
              with repeats (as users ask the same things again)
    drifting  as skewed, but the hot clusters change half-way (the cluster ranks are reshuffled)

POLICIES names the page-buffer policies (EngineConfig overrides) the cache studies compare.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from bench.harness import sets

_PLAIN = {"pin_fraction": 0.0, "buffer_compression": "off"}  # no pinning, a buffer never compressed
POLICIES = {  # name -> EngineConfig overrides
    "clock": {**_PLAIN, "buffer_policy": "clock", "record_cache": "off"},
    "lfu": {**_PLAIN, "buffer_policy": "lfu", "record_cache": "off"},
    "clock+pin": {**_PLAIN, "buffer_policy": "clock", "pin_fraction": 0.25, "record_cache": "off"},
    "lfu+pin": {**_PLAIN, "buffer_policy": "lfu", "pin_fraction": 0.25, "record_cache": "off"},
    "auto": {**_PLAIN, "buffer_policy": "auto", "record_cache": "off"},
    "default": {},  # EngineConfig's defaults: buffer_policy auto, record_cache auto, buffer_compression auto
    # the defaults with a plain buffer, as they were before buffer_compression (stop 49)
    "plain": {"buffer_compression": "off"},
    # a share of the same bytes as a cache of single records (EngineConfig.record_cache, record_cache_share)
    "lfu+rec25": {**_PLAIN, "buffer_policy": "lfu", "record_cache": "on", "record_cache_share": 0.25},
    "lfu+rec50": {**_PLAIN, "buffer_policy": "lfu", "record_cache": "on", "record_cache_share": 0.5},
    "lfu+rec100": {**_PLAIN, "buffer_policy": "lfu", "record_cache": "on"},
    "auto+rec50": {**_PLAIN, "buffer_policy": "auto", "record_cache": "on", "record_cache_share": 0.5},
    "auto+rec100": {**_PLAIN, "buffer_policy": "auto", "record_cache": "on"},
    # the whole buffer as blocks or as records, whichever a miniature of both serves more now (record_cache 'auto'
    # since stop 43); before it, 'auto' was the byte rule alone: records where records_cache_denser, else blocks
    "adapt": {**_PLAIN, "buffer_policy": "auto", "record_cache": "auto"},
}
FRACTIONS = (64, 16, 4)
STREAMS = ("uniform", "skewed", "drifting")
REFRESH = 256  # queries between re-choices of the pinned pages
CLUSTERS = 64


def _knn_numpy(base: np.ndarray, queries: np.ndarray, k: int = sets.GT_K) -> np.ndarray:
    """Exact L2 neighbours without faiss (the sets here are small enough)."""
    out = np.empty((len(queries), k), np.int32)
    bn = (np.asarray(base, np.float32) ** 2).sum(1)
    for lo in range(0, len(queries), 256):
        q = queries[lo:lo + 256]
        d = bn[None, :] - 2 * q @ np.asarray(base, np.float32).T
        part = np.argpartition(d, k, axis=1)[:, :k]
        order = np.argsort(np.take_along_axis(d, part, 1), axis=1, kind="stable")
        out[lo:lo + 256] = np.take_along_axis(part, order, 1)
    return out


def prepare(work: Path, name: str) -> Path:
    """The set, prepared as bench/harness/runner.py does; MiniLM reuses the paragraph embeddings bench/service/hybrid.py
    made when they are there (bench/service/hybrid.py) (the same model and texts), and ground truth needs no faiss."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        sets.exact_knn = _knn_numpy
    d = work / "data" / name
    emb = work / "hybrid" / "paragraphs.npy"
    if name == "minilm" and not (d / "embeddings.npy").exists() and emb.exists():
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "embeddings.npy", np.load(emb))
    return sets.prepare(work, name)


def build(work: Path, name: str) -> Path:
    from fusionrag.retriever import BuildConfig, Index

    prepare(work, name)
    out = work / "idx" / name / "fusionrag"
    if not (out / "manifest.json").exists():
        meta = json.loads((work / "data" / name / "meta.json").read_text())
        t = time.perf_counter()
        Index.build(str(work / "data" / name / "base.fbin"), str(out), BuildConfig(metric=meta["metric"]),
                    progress=False, overwrite=True)
        print(f"{name}: built in {time.perf_counter() - t:.0f} s", flush=True)
    return out


def built_set(work: Path, name: str) -> tuple[Path, np.ndarray, np.ndarray, int]:
    """(index path, the set's queries as the index searches them, their ground truth, raw vector bytes) of one
    set's default build (build())."""
    from fusionrag.retriever import Index

    idx_path = build(work, name)
    _, queries, gt, _ = sets.load(work, name)
    index = Index.open(idx_path, filter_tier="cpu")
    q = index.prepare_queries(queries)
    index.close()
    return idx_path, q, gt, (idx_path / "vectors.pages").stat().st_size


def streams(queries: np.ndarray, length: int, seed: int) -> dict[str, np.ndarray]:
    """Row numbers into queries for each stream."""
    from fusionrag.retriever.engine.kmeans import kmeans

    rng = np.random.default_rng(seed)
    c = min(CLUSTERS, len(queries) // 4)
    _, assign = kmeans(np.ascontiguousarray(queries, np.float32), c, 10, np.random.default_rng(seed))
    members = [np.flatnonzero(assign == i) for i in range(c)]
    members = [m for m in members if len(m)]
    c = len(members)
    zipf = 1.0 / np.arange(1, c + 1)
    zipf /= zipf.sum()

    def draw(n, ranks):
        clusters = ranks[rng.choice(c, n, p=zipf)]
        return np.array([members[j][rng.integers(len(members[j]))] for j in clusters])

    ranks = rng.permutation(c)
    half = length // 2
    return {
        "uniform": np.resize(np.arange(len(queries)), length),
        "skewed": draw(length, ranks),
        "drifting": np.concatenate([draw(half, ranks), draw(length - half, rng.permutation(c))]),
    }


HALF_SEEDS = {"tune": 1, "report": 2}  # each half of a set's queries draws its streams with its own seed


def half_bounds(n: int, half: str) -> tuple[int, int]:
    """Rows [lo, hi) of a set's n queries that make its tuning half (defaults are chosen on it) or its
    report half (results are reported on it)."""
    return (0, n // 2) if half == "tune" else (n // 2, n)


def half_streams(queries: np.ndarray, half: str, length: int) -> dict[str, np.ndarray]:
    """Each stream of one half of the queries, as row numbers into all of them (streams(), drawn with the
    half's seed)."""
    lo, hi = half_bounds(len(queries), half)
    return {k: lo + v for k, v in streams(queries[lo:hi], length, HALF_SEEDS[half]).items()}


def run_stream(index, q: np.ndarray, order: np.ndarray, batch: int, pinned: bool, gt: np.ndarray | None = None) -> dict:
    """Feeds the stream in batches of `batch` queries; counts after the first quarter (recall@10 too, with gt)."""
    warm = len(order) // 4
    read = buffered = counted = cached = 0
    hits = 0
    since = 0
    for lo in range(0, len(order), batch):
        r = index.search(q[order[lo:lo + batch]], 10)
        if lo >= warm:
            read += int(r.stats["pages_read"].sum())
            buffered += int(r.stats["pages_buffered"].sum())
            cached += int(r.stats["records_cached"].sum())
            counted += len(r.ids)
            if gt is not None:
                want = gt[order[lo:lo + batch], :10]
                hits += sum(len(np.intersect1d(a, b)) for a, b in zip(r.ids, want))
        since += batch
        if pinned and since >= REFRESH:
            index.refresh_hotness()
            since = 0
    return {"hit_ratio": buffered / max(1, read + buffered), "ssd_pages_per_query": read / max(1, counted),
            "pages_per_query": (read + buffered) / max(1, counted), "records_cached_per_query": cached / max(1, counted),
            "queries": counted, **({"recall": hits / (10 * max(1, counted))} if gt is not None else {})}


def save(result: dict, out: Path, tag: str, to_markdown) -> None:
    """Writes a run's results so far, stamped with the load now: out/tag.json and out/tag.md."""
    result["load_end"] = [round(x, 2) for x in os.getloadavg()]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"{tag}.md").write_text(to_markdown(result))
