"""The CPU filter tier's PQ tables, two ways, on indexes prepared by run.py (not a test):

- numpy: ProductQuantizer.luts builds one float32 (q, M, 256) array per batch, then native.scan_topn;
- in-scan: CpuFilterTier.luts defers, native.scan_topn_pq builds each query's table in the thread
  that scans it (the CPU tier's default).

Prints, per set and thread count, the wall time per query of tables + scan (best of --repeat,
batches of 64 as a search makes them), then the peak RSS (VmHWM) of a process that opens the
index and searches the queries, each way, measured as bench/harness/worker.py does (lowest of
--rss-repeat processes), with the QPS of that search (highest; default search parameters,
no warm-up, so the page buffer starts cold).

    python -m bench.pipeline.lut_scan --work bench/work --sets minilm fashion glove
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.worker import reset_peak, status  # noqa: E402
from bench.harness.paths import ROOT, WORK

K = 10


def open_index(work: Path, name: str, threads: int, tables: str):
    from fusionrag.retriever import Index

    # The page buffer run.py sizes for the set: the default 64 MiB would dwarf the tables.
    buffer = json.loads((work / "idx" / name / "fusionrag.build.json").read_text())["params"]["buffer_bytes"]
    index = Index.open(str(work / "idx" / name / "fusionrag"), threads=threads, filter_tier="cpu", batch_size=64,
                       buffer_bytes=buffer)
    if tables == "numpy":
        index.filter.tables = lambda q, pq=index.pq, metric=index.reranker.metric: pq.luts(q, metric)
    return index


def timing(work: Path, name: str, nq: int, threads: int, repeat: int) -> dict:
    index = open_index(work, name, threads, "in-scan")
    q = index.prepare_queries(np.load(work / "data" / name / "queries.npy")[:nq])
    p, cpu, pq, metric = index.params, index.filter, index.pq, index.reranker.metric
    n = max(p.rerank, K)
    batches = [(q[s:s + 64], index.nav.probe(q[s:s + 64], p)[0]) for s in range(0, len(q), 64)]
    best = {"numpy": {"total": np.inf}, "in-scan": {"total": np.inf}}
    for _ in range(repeat):  # the two ways alternate, so a busy moment hits both
        lut = scan = 0.0
        t = time.perf_counter()
        for qb, lists in batches:
            t0 = time.perf_counter()
            tables = pq.luts(qb, metric)
            t1 = time.perf_counter()
            cpu.topn(tables, lists, n)
            lut, scan = lut + t1 - t0, scan + time.perf_counter() - t1
        total = time.perf_counter() - t
        if total < best["numpy"]["total"]:
            best["numpy"] = {"total": total, "lut": lut, "scan": scan}
        lut = scan = 0.0
        t = time.perf_counter()
        for qb, lists in batches:
            cand = cpu.topn(cpu.tables(qb), lists, n)
            lut, scan = lut + cand.lut_seconds.sum(), scan + cand.seconds.sum()
        total = time.perf_counter() - t
        if total < best["in-scan"]["total"]:
            # Inside the scan the parts are thread-seconds: with 2 threads they add up to ~2x the wall.
            best["in-scan"] = {"total": total, "lut_thread_s": lut, "scan_thread_s": scan}
    us = {way: {k: round(v / len(q) * 1e6, 1) for k, v in r.items()} for way, r in best.items()}
    return {"set": name, "threads": threads, "M": pq.m, "dsub": pq.dsub, "us_per_query": us}


def peak_rss(work: Path, name: str, nq: int, threads: int, tables: str) -> dict:
    """One search process, as bench/harness/worker.py measures it: VmHWM reset after imports and queries."""
    queries = np.load(work / "data" / name / "queries.npy")[:nq]
    import fusionrag.retriever  # noqa: F401
    from fusionrag.retriever.process import return_freed_memory

    return_freed_memory()
    base = status("VmRSS")
    reset_peak()
    index = open_index(work, name, threads, tables)
    t = time.perf_counter()
    index.search(queries, K)
    qps = len(queries) / (time.perf_counter() - t)
    peak = status("VmHWM")
    return {"set": name, "threads": threads, "tables": tables, "peak_mib": round(peak / 2**20, 2),
            "net_mib": round((peak - base) / 2**20, 2), "qps": round(qps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--sets", nargs="+", default=["minilm", "fashion", "glove"])
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rss-repeat", type=int, default=3, help="processes per point; the lowest peak is kept")
    ap.add_argument("--rss", choices=["numpy", "in-scan"], help=argparse.SUPPRESS)  # one measuring process
    args = ap.parse_args()
    if args.rss:
        print(json.dumps(peak_rss(args.work, args.sets[0], args.queries, args.threads[0], args.rss)))
        return
    for name in args.sets:
        for threads in args.threads:
            print(json.dumps(timing(args.work, name, args.queries, threads, args.repeat)), flush=True)
    for name in args.sets:
        for threads in args.threads:
            for tables in ("numpy", "in-scan"):
                runs = [json.loads(subprocess.run(
                    [sys.executable, "-m", __spec__.name, "--work", str(args.work), "--sets", name, "--queries",
                     str(args.queries), "--threads", str(threads), "--rss", tables],
                    check=True, capture_output=True, text=True, cwd=ROOT).stdout) for _ in range(args.rss_repeat)]
                print(json.dumps({**min(runs, key=lambda r: r["peak_mib"]), "qps": max(r["qps"] for r in runs)}),
                      flush=True)


if __name__ == "__main__":
    main()
