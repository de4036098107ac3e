"""The navigation graph with 8-bit centroids (EngineConfig.graph_sq8) against float32 (not a test).

For each benchmark set's built index: the graph's memory_bytes, the peak RSS a process adds by
loading it (VmHWM, measured in a fresh process each), graph search time per query on one
thread (best of --repeat, the two graphs alternating), the overlap of the top-m lists and the
error of SQ8 distances against exact ones. Run after bench/harness/runner.py has built the indexes:

    python -m bench.peers.graph_sq8 [--work bench/work] [--sets glove fashion minilm synth200k]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fusionrag.native import Graph

from bench.harness.graphs import engine_queries, status_kib
from bench.harness.paths import ROOT


def load_peak(path: str, quantize: bool) -> dict:
    """What loading adds to this (fresh) process: peak and resident KiB."""
    hwm, rss = status_kib("VmHWM"), status_kib("VmRSS")
    graph = Graph.load(path, quantize=quantize)
    return {"memory_bytes": graph.memory_bytes(), "hwm_added_kib": status_kib("VmHWM") - hwm,
            "rss_added_kib": status_kib("VmRSS") - rss}


def measure(name: str, index: Path, queries: np.ndarray, m: int, ef: int, repeat: int) -> dict:
    path = str(index / "graph.bin")
    out = {"set": name}
    for quantize in (False, True):
        p = subprocess.run([sys.executable, "-m", __spec__.name, "--peak", path, str(int(quantize))],
                           capture_output=True, text=True, check=True, cwd=ROOT)
        out["sq8" if quantize else "float"] = json.loads(p.stdout)
    flt, sq8 = Graph.load(path), Graph.load(path, quantize=True)
    q = engine_queries(index, queries)
    best = {False: float("inf"), True: float("inf")}
    for _ in range(repeat):
        for quantize, graph in ((False, flt), (True, sq8)):
            start = time.perf_counter()
            ids, dists = graph.search(q, m, ef, num_threads=1)
            best[quantize] = min(best[quantize], time.perf_counter() - start)
            if quantize:
                got, got_d = ids, dists
            else:
                want = ids
    x = flt.vectors()
    exact = ((q[:, None, :].astype(np.float64) - x[got]) ** 2).sum(-1)
    rel = np.abs(got_d - exact) / np.maximum(exact, 1e-30)
    out.update(nodes=flt.size, dim=flt.dim, queries=len(q), m=m, ef=ef,
               float_ms_per_query=round(best[False] / len(q) * 1e3, 4),
               sq8_ms_per_query=round(best[True] / len(q) * 1e3, 4),
               overlap=round(float(np.mean([len(np.intersect1d(a, b)) / m for a, b in zip(got, want)])), 4),
               dist_rel_err_median=round(float(np.median(rel)), 5),
               dist_rel_err_p99=round(float(np.percentile(rel, 99)), 5))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="bench/work", help="bench/harness/runner.py's work folder (idx/, data/)")
    parser.add_argument("--sets", nargs="+", default=["glove", "fashion", "minilm", "synth200k"])
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--m", type=int, default=256)
    parser.add_argument("--ef", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--peak", nargs=2, metavar=("GRAPH", "QUANTIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        print(json.dumps(load_peak(args.peak[0], args.peak[1] == "1")))
        return
    work = Path(args.work)
    with open("/proc/loadavg") as f:
        print(json.dumps({"loadavg": f.read().split()[:3]}))
    for name in args.sets:
        queries = np.load(work / "data" / name / "queries.npy", mmap_mode="r")[: args.queries]
        print(json.dumps(measure(name, work / "idx" / name / "fusionrag", queries, args.m, args.ef, args.repeat)))


if __name__ == "__main__":
    main()
