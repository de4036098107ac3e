"""DiskANN's side of bench/peers/scale_peer.py, run by path with bench/work/diskann-venv's Python (diskannpy pins
numpy 1.25, so nothing of fusionrag is imported here): one JSON line on stdout.

    python bench/peers/diskann_worker.py build '{"base": ..., "out": ..., "build_gb": ..., "search_gb": ..., ...}'
    python bench/peers/diskann_worker.py search '{"out": ..., "queries": ..., "truth": ..., "dim": ..., ...}'

search: the index loaded, 300 noisy base rows to warm it, then each complexity L of the sweep on the tune half,
the fastest L reaching each target measured on the report half (queries 0-499 tune, 500-999 report).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

K = 10


def recall(ids: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / K for a, b in zip(ids, truth[:, :K])]))


def build(p: dict) -> dict:
    import diskannpy

    t = time.perf_counter()
    diskannpy.build_disk_index(p["base"], "l2", p["out"], complexity=p["l_build"], graph_degree=p["r"],
                               search_memory_maximum=p["search_gb"], build_memory_maximum=p["build_gb"],
                               num_threads=p["threads"], pq_disk_bytes=0, vector_dtype=np.float32)
    return {"build_s": time.perf_counter() - t}


def search(p: dict) -> dict:
    import diskannpy

    q, truth = np.load(p["queries"]), np.load(p["truth"])
    tune, report = slice(0, 500), slice(500, 1000)
    base = np.load(p["base_npy"], mmap_mode="r")
    rng = np.random.default_rng(1)
    rows = np.sort(rng.choice(len(base), 300, replace=False))
    warm = (np.asarray(base[rows]) + 0.05 * rng.standard_normal((300, base.shape[1]))).astype(np.float32)
    del base
    t = time.perf_counter()
    index = diskannpy.StaticDiskIndex(p["out"], num_threads=max(2, p["threads"]), num_nodes_to_cache=p["cache_nodes"],
                                      distance_metric="l2", vector_dtype=np.float32, dimensions=p["dim"])
    opened = time.perf_counter() - t
    index.batch_search(warm, K, complexity=64, num_threads=p["threads"], beam_width=p["w"])

    def measure(sl, L):
        qq = np.ascontiguousarray(q[sl])
        t = time.perf_counter()
        r = index.batch_search(qq, K, complexity=L, num_threads=p["threads"], beam_width=p["w"])
        s = time.perf_counter() - t
        return {"L": L, "recall@10": recall(r.identifiers.astype(np.int64), truth[sl]), "qps": len(qq) / s}

    grid = [measure(tune, L) for L in p["sweep"]]
    out = {"open_s": opened, "tune_grid": grid}
    for target in (0.90, 0.95):
        ok = [g for g in grid if g["recall@10"] >= target]
        out[f"at_{target:.2f}"] = measure(report, max(ok, key=lambda g: g["qps"])["L"]) if ok else None
    return out


if __name__ == "__main__":
    what, spec = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"build": build, "search": search}[what](spec)))
