"""One system, one data set, one phase, in a process of its own (so its memory is its own):

    python -m bench.harness.worker '{"phase": "build"|"search", "system": ..., "dataset": ..., ...}'

prints one JSON line. `run.py` drives it. DiskANN runs under bench/work/diskann-venv (diskannpy
pins numpy 1.25), so this file needs only numpy at import; each system's library is imported
where it is used.

What is measured:
- build: wall seconds, and the peak RSS of the build process (VmHWM).
- search: the index is loaded from disk, then for each thread count and each knob setting the
  queries are run as one batch (with pin_cores, the process is held to as many cores as threads): QPS, recall@10, process CPU seconds per query, and the bytes
  this process read from storage (/proc/self/io read_bytes: counted in submit_bio for buffered
  and O_DIRECT reads alike, so page-cache hits are not counted) divided by 4096 = pages/query.
  Memory: VmHWM is reset (/proc/self/clear_refs 5) after imports and query loading, so the
  reported peak covers loading the index and every search; `base_rss` is the process, its
  library imported, before the index is loaded, and `net` = peak - base.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.sets import load  # noqa: E402

K = 10


def status(field: str) -> int:
    """A VmRSS/VmHWM line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise KeyError("read_bytes")


def recall(ids: np.ndarray, gt: np.ndarray) -> float:
    hits = sum(len(np.intersect1d(a[a >= 0], g)) for a, g in zip(ids, gt[:, :K]))
    return hits / (len(gt) * K)


# ---- the systems: build(base_path, base, meta, out_dir, p) and open(out_dir, meta, p, threads)
# returning search(queries, knob) -> (ids, extra stats) ----

def fusionrag_build(base_path, base, meta, out, p):
    from fusionrag.retriever import BuildConfig, Index

    Index.build(str(base_path), str(out), BuildConfig(metric=meta["metric"], threads=p["build_threads"]),
                progress=False)


def fusionrag_graphnav_build(base_path, base, meta, out, p):
    """fusionrag's build with rows and queries finding their lists by the graph (BuildConfig.navigation 'graph'),
    as builds of sets with more than 3M centroid floats did before the navigation was recorded."""
    from fusionrag.retriever import BuildConfig, Index

    Index.build(str(base_path), str(out), BuildConfig(metric=meta["metric"], threads=p["build_threads"],
                                                      navigation="graph"), progress=False)


def fusionrag_open(out, meta, p, threads):
    from fusionrag.retriever import Index

    index = Index.open(str(out), buffer_bytes=p["buffer_bytes"], threads=threads, batch_size=p.get("batch_size"),
                       **p.get("engine", {}))

    def search(q, knob):
        r = index.search(q, K, **knob)
        stats = {k: float(v.mean()) for k, v in r.stats.items()}
        # What the index holds, and what a call of these queries at this knob holds at most (its search_call part)
        return r.ids, {"engine": stats, **r.info, "memory": index.memory(knob, len(q), K)}
    return search


# fusionrag at less memory: its memory/speed frontier, from which the report takes the fastest
# configuration that fits in DiskANN's measured memory. Two builds (the default; a smaller host
# tier: lists of ~40 vectors instead of ~10, so a quarter of the centroids, and at most 3 boundary
# replicas within 5% instead of 8 within 10%), each with a smaller page buffer than the default's
# raw/16. Every knob is a documented option (README "Less host memory").
LEAN_BUILD = {"centroid_ratio": 0.025, "max_replicas": 3, "replica_eps": 0.05}


def fusionrag_lean_build(base_path, base, meta, out, p):
    from fusionrag.retriever import BuildConfig, Index

    Index.build(str(base_path), str(out), BuildConfig(metric=meta["metric"], threads=p["build_threads"], **LEAN_BUILD),
                progress=False)


def with_engine(by: int = 1, **engine):
    """fusionrag_open with EngineConfig settings, and the page buffer divided by `by`."""
    def open_(out, meta, p, threads):
        return fusionrag_open(out, meta, {**p, "buffer_bytes": p["buffer_bytes"] // by, "engine": engine}, threads)
    return open_


def with_raw_budget(**engine):
    """fusionrag_open with a page buffer budget that holds the raw vectors (the set's float32 bytes, p["raw_bytes"]),
    and EngineConfig settings: raw_in_ram 'auto' then holds them in RAM (#68 item 5)."""
    def open_(out, meta, p, threads):
        return fusionrag_open(out, meta, {**p, "buffer_bytes": p["raw_bytes"], "engine": engine}, threads)
    return open_


def ivfpq_build(base_path, base, meta, out, p):
    import faiss

    faiss.omp_set_num_threads(p["build_threads"])
    n, d = base.shape
    nlist = p["nlist"]
    index = faiss.index_factory(d, f"IVF{nlist},PQ{p['pq_m']}x8,RFlat")
    rng = np.random.default_rng(0)
    train = np.ascontiguousarray(base[np.sort(rng.choice(n, min(n, 64 * nlist, 200_000), replace=False))])
    index.train(train)
    for lo in range(0, n, 1 << 18):
        index.add(np.ascontiguousarray(base[lo:lo + (1 << 18)]))
    faiss.write_index(index, str(out / "index.faiss"))


def ivfpq_open(out, meta, p, threads):
    import faiss

    faiss.omp_set_num_threads(threads)
    index = faiss.read_index(str(out / "index.faiss"))
    ivf = faiss.extract_index_ivf(index)
    refine = faiss.downcast_index(index)

    def search(q, knob):
        ivf.nprobe = knob["nprobe"]
        refine.k_factor = knob["k_factor"]
        return index.search(q, K)[1], {}
    return search


def faiss_hnsw_build(base_path, base, meta, out, p):
    import faiss

    faiss.omp_set_num_threads(p["build_threads"])
    index = faiss.IndexHNSWFlat(base.shape[1], p["hnsw_m"])
    index.hnsw.efConstruction = p["ef_construction"]
    for lo in range(0, len(base), 1 << 18):
        index.add(np.ascontiguousarray(base[lo:lo + (1 << 18)]))
    faiss.write_index(index, str(out / "index.faiss"))


def faiss_hnsw_open(out, meta, p, threads):
    import faiss

    faiss.omp_set_num_threads(threads)
    index = faiss.read_index(str(out / "index.faiss"))

    def search(q, knob):
        index.hnsw.efSearch = knob["ef"]
        return index.search(q, K)[1], {}
    return search


def hnswlib_build(base_path, base, meta, out, p):
    import hnswlib

    n, d = base.shape
    index = hnswlib.Index(space="l2", dim=d)
    index.init_index(max_elements=n, ef_construction=p["ef_construction"], M=p["hnsw_m"])
    for lo in range(0, n, 1 << 18):
        chunk = np.ascontiguousarray(base[lo:lo + (1 << 18)])
        index.add_items(chunk, np.arange(lo, lo + len(chunk)), num_threads=p["build_threads"])
    index.save_index(str(out / "index.hnswlib"))


def hnswlib_open(out, meta, p, threads):
    import hnswlib

    index = hnswlib.Index(space="l2", dim=meta["dim"])
    index.load_index(str(out / "index.hnswlib"))

    def search(q, knob):
        index.set_ef(knob["ef"])
        return index.knn_query(q, K, num_threads=threads)[0].astype(np.int64), {}
    return search


def diskann_build(base_path, base, meta, out, p):
    import diskannpy

    diskannpy.build_disk_index(
        str(base_path), "l2", str(out), complexity=p["diskann_l_build"], graph_degree=p["diskann_r"],
        search_memory_maximum=p["diskann_search_gb"], build_memory_maximum=p["diskann_build_gb"],
        num_threads=p["build_threads"], pq_disk_bytes=0, vector_dtype=np.float32)


def diskann_open(out, meta, p, threads):
    import diskannpy

    # Two scratch contexts even for one search thread: with one, diskannpy 0.7.0 deadlocks while
    # loading (ScratchStoreManager in use_medoids_data_as_centroids). batch_search sets the threads.
    index = diskannpy.StaticDiskIndex(str(out), num_threads=max(2, threads), num_nodes_to_cache=p["diskann_cache_nodes"],
                                      distance_metric="l2", vector_dtype=np.float32, dimensions=meta["dim"])

    def search(q, knob):
        r = index.batch_search(q, K, complexity=knob["L"], num_threads=threads, beam_width=knob["W"])
        return r.identifiers.astype(np.int64), {}
    return search


# fusionrag's library as a search runs it: the engine's index module (its tiers, its config's pydantic models, the
# native extension). `fusionrag.retriever` alone imports none of it since its names became lazy (d4d5660), and the
# ~20 MiB of code then counted in the net search memory (GloVe 37 -> 52 MiB, MiniLM 15 -> 30; #68 item 1,
# bench/results/peers/memory_accounting.md), where every other system's library is in the baseline.
ENGINE = "fusionrag.retriever.engine.index"

SYSTEMS = {  # name: (build, open, the library, imported before the baseline RSS is taken)
    "fusionrag": (fusionrag_build, fusionrag_open, ENGINE),
    "fusionrag-halfbuf": (None, with_engine(2), ENGINE),  # searches fusionrag's build
    "fusionrag-lean": (fusionrag_lean_build, with_engine(4), ENGINE),
    "fusionrag-lean-fullbuf": (None, with_engine(1), ENGINE),  # searches fusionrag-lean's
    # fusionrag-lean's build between the two: its memory/speed frontier has a point where lean's quarter of the
    # buffer leaves memory unused within DiskANN's (MiniLM: 10 against 12 MiB net)
    "fusionrag-lean-halfbuf": (None, with_engine(2), ENGINE),
    # The same two with the re-rank's read-ahead off (EngineConfig.rerank_prefetch): its blocks in flight, two rounds'
    # of a worker's queries, held ~1-3 MiB more at peak on MiniLM with 2 threads (the old results journal, `git show 8028390:bench/results/README.md`, stop 45)
    "fusionrag-lean-noprefetch": (None, with_engine(4, rerank_prefetch=False), ENGINE),
    "fusionrag-lean-halfbuf-noprefetch": (None, with_engine(2, rerank_prefetch=False), ENGINE),
    # fusionrag's build with the page buffer holding blocks only (EngineConfig.record_cache off)
    "fusionrag-blocks": (None, with_engine(record_cache="off"), ENGINE),
    # fusionrag's build with a page buffer never compressed (EngineConfig.buffer_compression off), as before stop 49
    "fusionrag-plain": (None, with_engine(buffer_compression="off"), ENGINE),
    "fusionrag-graphnav": (fusionrag_graphnav_build, fusionrag_open, ENGINE),
    # fusionrag's build with a budget that holds the raw vectors: held in RAM and re-ranked from there
    # (EngineConfig.raw_in_ram 'auto'), and the same budget as a page buffer over the SSD path (raw_in_ram 'off')
    "fusionrag-ram": (None, with_raw_budget(raw_in_ram="auto"), ENGINE),
    "fusionrag-rawbuf": (None, with_raw_budget(raw_in_ram="off"), ENGINE),
    "faiss-ivfpq-refine": (ivfpq_build, ivfpq_open, "faiss"),
    "faiss-hnsw": (faiss_hnsw_build, faiss_hnsw_open, "faiss"),
    "hnswlib": (hnswlib_build, hnswlib_open, "hnswlib"),
    "diskann": (diskann_build, diskann_open, "diskannpy"),
}


def build(spec) -> dict:
    work = Path(spec["work"])
    base, _, _, meta = load(work, spec["dataset"])
    out = Path(spec["index_dir"])
    out.parent.mkdir(parents=True, exist_ok=True)
    if not spec["system"].startswith("fusionrag"):  # fusionrag publishes its directory atomically, itself
        out.mkdir()
    base_path = work / "data" / spec["dataset"] / "base.fbin"
    rss0 = status("VmRSS")
    t = time.perf_counter()
    SYSTEMS[spec["system"]][0](base_path, base, meta, out, spec["params"])
    seconds = time.perf_counter() - t
    disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    record = {"build_s": seconds, "build_peak_rss": status("VmHWM"), "base_rss": rss0, "index_disk_bytes": disk}
    if (out / "manifest.json").exists():  # a fusionrag index: the PQ codes its build chose (BuildConfig.pq_bits)
        record.update(pq_codes(json.loads((out / "manifest.json").read_text())))
    return record


def pq_codes(manifest: dict) -> dict:
    """The code width a fusionrag build kept, and why (its manifest's pq_choice, where it measured)."""
    return {"pq_bits": manifest["pq"].get("bits", 8), "pq_why": (manifest.get("pq_choice") or {}).get("why")}


def return_freed_memory() -> None:
    """What `fusionrag search` and `serve` do (retriever/process.py), applied to every system alike:
    glibc hands freed blocks of 128 KiB and more back to the kernel instead of keeping the peak.
    A copy, not an import: DiskANN's worker runs in a venv without fusionrag."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD


def search(spec) -> dict:
    work = Path(spec["work"])
    base, queries, gt, meta = load(work, spec["dataset"])
    stream = np.load(spec["stream_rows"]) if spec.get("stream_rows") else {}  # run.py's stream_rows
    measured = stream["rows"] if "rows" in stream else np.arange(min(spec["queries"], len(queries)))
    nq = len(measured)
    q, gt = np.ascontiguousarray(queries[measured]), gt[measured]
    if "warm" in stream:  # a skewed stream's first queries: they warm the caches with the stream's own hot set
        warm = np.ascontiguousarray(queries[stream["warm"]])
    else:  # base rows with a little noise, never the measured queries themselves
        rng = np.random.default_rng(1)
        rows = np.sort(rng.choice(len(base), min(spec["warmup"], len(base)), replace=False))
        warm = np.asarray(base[rows]) + 0.01 * np.std(base[rows[:100]]) * rng.standard_normal((len(rows), meta["dim"]), dtype=np.float32)
        warm = warm.astype(np.float32)
        if meta["metric"] == "cosine":
            warm /= np.linalg.norm(warm, axis=1, keepdims=True)
    del base
    importlib.import_module(SYSTEMS[spec["system"]][2])
    return_freed_memory()
    results = []
    base_rss = status("VmRSS")
    reset_peak()
    allowed = sorted(os.sched_getaffinity(0))
    for threads in spec["threads"]:
        # N threads means N cores, for every system: fusionrag's pipeline runs its stages in threads of their
        # own beside its N search threads, and would otherwise take a core the others are not given.
        if spec.get("pin_cores"):
            os.sched_setaffinity(0, allowed[:threads])
        t = time.perf_counter()
        run = SYSTEMS[spec["system"]][1](Path(spec["index_dir"]), meta, spec["params"], threads)
        load_s = time.perf_counter() - t
        run(warm, spec["sweep"][len(spec["sweep"]) // 2])
        for knob in spec["sweep"]:
            rb, cpu = read_bytes(), os.times()
            t = time.perf_counter()
            ids, extra = run(q, knob)
            seconds = time.perf_counter() - t
            cpu2, rb2 = os.times(), read_bytes()
            results.append({
                "threads": threads, "knob": knob, "qps": nq / seconds, "recall": recall(ids, gt),
                "cpu_ms_per_query": 1000 * ((cpu2.user - cpu.user) + (cpu2.system - cpu.system)) / nq,
                "read_pages_per_query": (rb2 - rb) / 4096 / nq, "load_s": load_s, **extra,
            })
        del run
    peak = status("VmHWM")
    return {"queries": nq, "points": results, "search_peak_rss": peak, "base_rss": base_rss,
            "net_peak_rss": peak - base_rss}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    out = build(spec) if spec["phase"] == "build" else search(spec)
    print(json.dumps({**spec, **out}))
