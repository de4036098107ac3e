"""The re-rank's read-ahead (native.rerank(prefetch=True), issue #17) on and off, in one run: while
a round of mini-batches is scored, the blocks of each query's next mini-batch are already being read.

A small, cold page buffer (raw vectors / 64, emptied before every round, unless --keep-buffer), so the
re-rank reads from the SSD; default search parameters, the CPU filter tier. Both variants open the same
index (each its own page store, EngineConfig.rerank_prefetch off and on), and alternate round by round so
that a shared machine's load falls on both alike. --half tune|report takes the first or the second half
of a set's queries (a default is chosen on one and reported on the other).

Per row: queries/s, p50/p99 latency of a call, SSD pages read per query, of those read ahead and
left unused by early stops, recall@10, and whether the pages the store counts as read match the
bytes the block layer read for the process (/proc/self/io read_bytes; O_DIRECT only).

    python -m bench.cache.rerank_prefetch --datasets glove fashion minilm --half tune --out bench/results/cache/rerank_prefetch.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK

from bench.harness import sets
from bench.harness.streams import build  # noqa: E402


def recall(found: np.ndarray, gt: np.ndarray, k: int = 10) -> float:
    return float(np.mean([len(np.intersect1d(a[a >= 0], b[:k])) / k for a, b in zip(found, gt)]))


def read_bytes() -> int:
    """Bytes this process had the block layer read (O_DIRECT reads, io_uring's included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="*", default=["glove", "fashion"])
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--calls", nargs="*", type=int, default=[1, 16], help="queries per search call")
    ap.add_argument("--queries", type=int, default=512, help="queries per (variant, round)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--buffer-fraction", type=int, default=64)
    ap.add_argument("--keep-buffer", action="store_true", help="do not empty the page buffer before each round")
    ap.add_argument("--half", choices=["all", "tune", "report"], default="all",
                    help="the queries: all, the first half (tune) or the second (report)")
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, help="append a Markdown table here")
    args = ap.parse_args()

    from fusionrag.retriever import EngineConfig, Index

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows = []
    for name in args.datasets:
        idx_path = build(args.work, name)
        _, queries, gt, _ = sets.load(args.work, name)
        if args.half != "all":
            part = slice(0, len(queries) // 2) if args.half == "tune" else slice(len(queries) // 2, None)
            queries, gt = queries[part], gt[part]
        n = min(args.queries, len(queries))
        raw = (idx_path / "vectors.pages").stat().st_size
        for threads in args.threads:
            for call in args.calls:
                config = EngineConfig(buffer_bytes=raw // args.buffer_fraction, threads=threads, filter_tier="cpu")
                indexes = {v: Index.open(idx_path, replace(config, rerank_prefetch=v == "on")) for v in ("off", "on")}
                assert indexes["on"].reranker.prefetch and not indexes["off"].reranker.prefetch
                q = indexes["off"].prepare_queries(queries[:n])
                acc = {v: {"lat": [], "secs": 0.0, "pages": 0, "unused": 0, "ahead": 0, "io_agrees": True, "ids": None}
                       for v in indexes}
                for index in indexes.values():  # warm everything but the page buffer
                    index.search(q[:64], 10)
                for rnd in range(args.rounds):
                    for v in (["off", "on"] if rnd % 2 == 0 else ["on", "off"]):
                        index, a = indexes[v], acc[v]
                        store = index.reranker.store
                        if not args.keep_buffer:
                            store.reset_buffer()
                        before, io_before = store.stats(), read_bytes()
                        ids = []
                        t0 = time.perf_counter()
                        for lo in range(0, n, call):
                            t = time.perf_counter()
                            r = index.search(q[lo:lo + call], 10)
                            a["lat"].append(time.perf_counter() - t)
                            ids.append(r.ids)
                        a["secs"] += time.perf_counter() - t0
                        after, io_read = store.stats(), read_bytes() - io_before
                        a["io_agrees"] &= io_read == (after["blocks_read"] - before["blocks_read"]) * store.block_bytes
                        a["pages"] += after["blocks_read"] - before["blocks_read"]
                        a["ahead"] += after["read_ahead"] - before["read_ahead"]
                        a["unused"] += after["read_ahead_unused"] - before["read_ahead_unused"]
                        a["ids"] = np.concatenate(ids)
                assert np.array_equal(acc["off"]["ids"], acc["on"]["ids"]), "prefetch changed an answer"
                for v, a in acc.items():
                    total = n * args.rounds
                    row = {"set": name, "threads": threads, "call": call, "prefetch": v,
                           "qps": round(total / a["secs"], 1),
                           "p50_ms": round(1e3 * float(np.percentile(a["lat"], 50)), 2),
                           "p99_ms": round(1e3 * float(np.percentile(a["lat"], 99)), 2),
                           "pages_per_query": round(a["pages"] / total, 2),
                           "read_ahead_per_query": round(a["ahead"] / total, 2),
                           "unused_per_query": round(a["unused"] / total, 2),
                           "recall10": round(recall(a["ids"], gt[:n]), 4),
                           "proc_io_agrees": bool(a["io_agrees"]),
                           "backend": indexes[v].reranker.store.backend,
                           "direct": bool(indexes[v].reranker.store.direct)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                for index in indexes.values():
                    index.close()
    load_end = [round(x, 2) for x in os.getloadavg()]
    lines = [f"Run {started}: {platform.machine()}, {os.cpu_count()} CPUs, load average {load_start} at start, "
             f"{load_end} at end. Page buffer = raw vectors / {args.buffer_fraction}, "
             f"{'kept warm across rounds' if args.keep_buffer else 'emptied before each round'}; {args.queries} "
             f"queries (or all the set's {args.half} half has) x {args.rounds} rounds per row, on and off alternating; "
             f"I/O {rows[0]['backend']}, O_DIRECT {rows[0]['direct']}.", "",
             "| set | threads | queries/call | prefetch | q/s | p50 ms | p99 ms | SSD pages/query | read ahead/query "
             "| of those unused | recall@10 | /proc/self/io agrees |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['threads']} | {r['call']} | {r['prefetch']} | {r['qps']} | {r['p50_ms']} | "
                     f"{r['p99_ms']} | {r['pages_per_query']} | {r['read_ahead_per_query']} | {r['unused_per_query']} "
                     f"| {r['recall10']} | {'yes' if r['proc_io_agrees'] else 'no'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
