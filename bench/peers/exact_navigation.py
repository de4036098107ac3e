"""Exact navigation (NavigationTier where tiers.exhaustive_is_cheap) against the graph, and against the float
copy + numpy matrix product it replaced (not a test).

Per set of centroids: microseconds a query to find the m nearest lists by
- `exact`: Graph.exact_search over the graph's SQ8 codes in place, screened by integer products first (what
  queries do now; the kernels' build, native.dot_isa(), is in the report);
- `full`: the same without the screen (exact_search(screen=False): every node's product in floats, stop 32's
  way);
- `numpy`: tiers.nearest_exhaustive over a float32 copy of the decoded centroids (stop 30's way; OpenBLAS
  picks its own threads, whatever the engine's);
- `graph`: Graph.search with beam m (graph_ef 0, the default);
in batches of 64 (the CPU tier's) on 1 and 2 threads and one query at a time, best of --repeat with the
three alternating; and the peak resident set each adds while 1,024 queries navigate in batches of 64, in a
fresh process each (VmHWM over VmRSS after loading the graph). The sets: the graphs of bench/harness/runner.py's built
indexes (bench/work/idx/*/fusionrag/graph.bin, the sets' report-half queries), and clustered synthetic
centroids of the shapes tiers.exhaustive_is_cheap was drawn on.

    python -m bench.peers.exact_navigation [--work bench/work] [--tag exact_navigation]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fusionrag.native import Graph, dot_isa
from fusionrag.retriever.engine.tiers import exhaustive_is_cheap, nearest_exhaustive

from bench.harness.graphs import engine_queries, status_kib  # noqa: E402
from bench.harness.paths import ROOT, results

SYNTHETIC = [(5208, 128), (8000, 384), (20000, 128), (32768, 96)]


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    """Centroids of clustered data: groups of about 10 around 10% as many centres."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((max(1, n // 10), dim)).astype(np.float32)
    return (centers[rng.integers(len(centers), size=n)] + 0.3 * rng.standard_normal((n, dim))).astype(np.float32)


def peak(graph_path: str, queries_path: str, method: str, m: int) -> dict:
    """In a fresh process: what navigating 1,024 queries in batches of 64 adds to the peak resident set."""
    graph = Graph.load(graph_path, quantize=True)
    q = np.load(queries_path)[:1024]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss = status_kib("VmRSS")
    copy = c_sq = None
    for lo in range(0, len(q), 64):
        if method in ("exact", "full"):
            graph.exact_search(q[lo:lo + 64], m, 2, method == "exact")
        elif method == "graph":
            graph.search(q[lo:lo + 64], m, m, 2)
        else:
            if copy is None:
                copy = graph.vectors()
                c_sq = np.einsum("ij,ij->i", copy, copy)
            nearest_exhaustive(q[lo:lo + 64], copy, m, c_sq)
    return {"peak_added_kib": status_kib("VmHWM") - rss}


def timed(fn, q: np.ndarray, batch: int) -> float:
    start = time.perf_counter()
    for lo in range(0, len(q), batch):
        fn(q[lo:lo + batch])
    return (time.perf_counter() - start) / len(q) * 1e6


def measure(name: str, graph_path: Path, q: np.ndarray, m: int, repeat: int, tmp: Path) -> dict:
    graph = Graph.load(str(graph_path), quantize=True)
    copy = graph.vectors()
    c_sq = np.einsum("ij,ij->i", copy, copy)
    m = min(m, graph.size)
    runs = {
        "exact": lambda threads: (lambda x: graph.exact_search(x, m, threads)),
        "full": lambda threads: (lambda x: graph.exact_search(x, m, threads, False)),
        "numpy": lambda threads: (lambda x: nearest_exhaustive(x, copy, m, c_sq)),
        "graph": lambda threads: (lambda x: graph.search(x, m, m, threads)),
    }
    out = {"set": name, "centroids": graph.size, "dim": graph.dim, "m": m,
           "exhaustive_is_cheap": exhaustive_is_cheap(graph.size, graph.dim), "us_per_query": {}}
    single = q[:256]
    for label, batch, threads, qs in (("batch64_1t", 64, 1, q), ("batch64_2t", 64, 2, q), ("single_1t", 1, 1, single)):
        best = {k: float("inf") for k in runs}
        for _ in range(repeat):
            for method, make in runs.items():
                best[method] = min(best[method], timed(make(threads), qs, batch))
        out["us_per_query"][label] = {k: round(v, 1) for k, v in best.items()}
    ids, _ = graph.exact_search(q, m, 2)
    full, _ = graph.exact_search(q, m, 2, False)
    ref, _ = nearest_exhaustive(q, copy, m, c_sq)
    out["exact_equals_full"] = round(float(np.mean(ids == full)), 5)
    approx, _ = graph.search(q, m, m, 2)
    out["exact_equals_numpy"] = round(float(np.mean(ids == ref)), 5)
    out["graph_overlap_with_exact"] = round(float(np.mean([len(np.intersect1d(a, b)) / m
                                                           for a, b in zip(approx, ids)])), 4)
    qpath = tmp / f"{name}.npy"
    np.save(qpath, q)
    out["peak_added_kib"] = {}
    for method in runs:
        p = subprocess.run([sys.executable, "-m", __spec__.name, "--peak", str(graph_path), str(qpath), method, str(m)],
                           capture_output=True, text=True, check=True, cwd=ROOT)
        out["peak_added_kib"][method] = json.loads(p.stdout)["peak_added_kib"]
    out["float_copy_kib"] = round((copy.nbytes + c_sq.nbytes) / 1024)
    out["graph_memory_kib"] = round(graph.memory_bytes() / 1024)
    return out


def report(rows: list[dict], meta: dict) -> str:
    lines = ["# Exact navigation: SQ8 codes in place against a float copy and numpy, and against the graph",
             "", f"`{meta['command']}`, {meta['when']}, {meta['machine']}, load average {meta['loadavg']}.", "",
             "Microseconds a query to find the m nearest lists (best of the repeats, methods alternating); "
             "`exact` is screened by integer products (kernels: " + meta["dot_isa"] + "), `full` is not; `numpy` "
             "runs OpenBLAS on its own threads whatever the column says. Peak added: KiB the peak resident "
             "set grows while 1,024 queries navigate in batches of 64 (fresh process each). `exact = full`, "
             "`exact = numpy`: the share of list ids alike, place by place.", "",
             "| set | centroids x dim | m | cheap? | batch 64, 1 thread: exact / full / numpy / graph "
             "| batch 64, 2 threads | one query, 1 thread | peak added KiB: exact / full / numpy / graph "
             "| float copy KiB | exact = full | exact = numpy | graph overlap |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        u = r["us_per_query"]
        cell = lambda d: f"{d['exact']} / {d['full']} / {d['numpy']} / {d['graph']}"  # noqa: E731
        cheap = "yes" if r["exhaustive_is_cheap"] else "no"
        lines.append(f"| {r['set']} | {r['centroids']} x {r['dim']} | {r['m']} | {cheap} "
                     f"| {cell(u['batch64_1t'])} | {cell(u['batch64_2t'])} | {cell(u['single_1t'])} "
                     f"| {cell(r['peak_added_kib'])} | {r['float_copy_kib']} | {r['exact_equals_full']} "
                     f"| {r['exact_equals_numpy']} | {r['graph_overlap_with_exact']} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="bench/work", help="bench/harness/runner.py's work folder (idx/, data/)")
    parser.add_argument("--sets", nargs="*", default=["minilm", "fashion", "glove", "synth1m"])
    parser.add_argument("--m", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--queries", type=int, default=1024, help="from the report half of each set's queries")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--synthetic", nargs="*", default=[f"{n}x{d}" for n, d in SYNTHETIC], metavar="NxDIM",
                        help="clustered synthetic centroids of these shapes (none: only the built sets)")
    parser.add_argument("--tag", default="exact_navigation")
    parser.add_argument("--peak", nargs=4, metavar=("GRAPH", "QUERIES", "METHOD", "M"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        print(json.dumps(peak(args.peak[0], args.peak[1], args.peak[2], int(args.peak[3]))))
        return
    work = Path(args.work)
    tmp = work / "exact_navigation"
    tmp.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m bench.peers.exact_navigation " + " ".join(sys.argv[1:]),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "loadavg": open("/proc/loadavg").read().split()[0], "dot_isa": dot_isa()}
    sets = []
    for name in args.sets:
        index = work / "idx" / name / "fusionrag"
        if not (index / "graph.bin").exists():
            print(f"skipping {name}: no {index / 'graph.bin'} (bench/harness/runner.py builds it)", file=sys.stderr)
            continue
        queries = np.load(work / "data" / name / "queries.npy", mmap_mode="r")
        half = queries[len(queries) // 2:][: args.queries]
        sets.append((name, index / "graph.bin", engine_queries(index, half)))
    for n, dim in (tuple(int(v) for v in shape.split("x")) for shape in args.synthetic):
        path = tmp / f"synthetic_{n}x{dim}.bin"
        if not path.exists():
            g = Graph(dim, "l2", M=16, ef_construction=200, seed=0)
            g.add(clustered(n, dim, seed=n))
            g.save(path)
        q = clustered(args.queries, dim, seed=n)  # the same centres (seed), new points
        sets.append((f"synthetic {n} x {dim}", path, q))
    rows = []
    for name, path, q in sets:
        for m in args.m:
            row = measure(name, path, np.ascontiguousarray(q, dtype=np.float32), m, args.repeat, tmp)
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta["loadavg"] += " → " + open("/proc/loadavg").read().split()[0]
    out = results("peers")
    (out / f"{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{args.tag}.md").write_text(report(rows, meta))
    print(report(rows, meta))


if __name__ == "__main__":
    main()
