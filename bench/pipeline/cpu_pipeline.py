"""Speed of the CPU tier's search path with its options on and off, in one run: the batch pipeline
(EngineConfig.pipeline: batch b+1's graph search, batch b's PQ scan and batch b-1's re-rank at once)
and the page buffer's policy (clock, lfu). Calls of 1, 16 and 256 queries, 1 and 2 threads, the
settings of each row interleaved round by round so that a shared machine's load falls on all alike.

Per row: queries/s, p50/p99 latency of a call, SSD pages read per second, recall@10 (defaults hold
>= 0.9 on these sets). Results: bench/results/cpu_pipeline.{json,md}.

    python -m bench.pipeline.cpu_pipeline --datasets glove minilm [--pin-cores --tag cpu_pipeline_pinned]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK, results

from bench.harness import sets
from bench.harness.streams import build  # noqa: E402

VARIANTS = {  # name -> EngineConfig overrides
    "clock": {"buffer_policy": "clock", "pipeline": False},
    "lfu": {"buffer_policy": "lfu", "pipeline": False},
    "lfu+pipeline": {"buffer_policy": "lfu", "pipeline": True},
}


def recall(found: np.ndarray, gt: np.ndarray, k: int = 10) -> float:
    return float(np.mean([len(np.intersect1d(a[a >= 0], b[:k])) / k for a, b in zip(found, gt)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="*", default=["glove", "minilm"])
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--calls", nargs="*", type=int, default=[1, 16, 256], help="queries per search call")
    ap.add_argument("--queries", type=int, default=1024, help="queries per (variant, round)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--buffer-fraction", type=int, default=16)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=results("pipeline"))
    ap.add_argument("--pin-cores", action="store_true",
                    help="hold the process to as many cores as threads (the pipeline's stages are threads of their own)")
    ap.add_argument("--tag", default="cpu_pipeline")
    args = ap.parse_args()
    allowed = sorted(os.sched_getaffinity(0))

    from fusionrag.retriever import EngineConfig, Index

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()}-core VM",
              "load_start": [round(x, 2) for x in os.getloadavg()], "rows": []}
    for name in args.datasets:
        idx_path = build(args.work, name)
        _, queries, gt, _ = sets.load(args.work, name)
        n = min(args.queries, len(queries))
        raw = (idx_path / "vectors.pages").stat().st_size
        for threads in args.threads:
            if args.pin_cores:
                os.sched_setaffinity(0, allowed[:threads])
            for call in args.calls:
                indexes = {v: Index.open(idx_path, EngineConfig(buffer_bytes=raw // args.buffer_fraction, threads=threads,
                                                                filter_tier="cpu", **o))
                           for v, o in VARIANTS.items()}
                q = indexes["clock"].prepare_queries(queries[:n])
                acc = {v: {"lat": [], "secs": 0.0, "pages": 0, "ids": []} for v in VARIANTS}
                for v, index in indexes.items():  # warm the buffers
                    index.search(q[:256], 10)
                for _ in range(args.rounds):
                    for v, index in indexes.items():
                        a = acc[v]
                        ids = []
                        t0 = time.perf_counter()
                        for lo in range(0, n, call):
                            t = time.perf_counter()
                            r = index.search(q[lo:lo + call], 10)
                            a["lat"].append(time.perf_counter() - t)
                            a["pages"] += int(r.stats["pages_read"].sum())
                            ids.append(r.ids)
                        a["secs"] += time.perf_counter() - t0
                        a["ids"] = np.concatenate(ids)
                for v, a in acc.items():
                    row = {"set": name, "threads": threads, "call": call, "variant": v,
                           "qps": round(n * args.rounds / a["secs"], 1),
                           "p50_ms": round(1e3 * float(np.percentile(a["lat"], 50)), 3),
                           "p99_ms": round(1e3 * float(np.percentile(a["lat"], 99)), 3),
                           "ssd_pages_per_s": round(a["pages"] / a["secs"], 1),
                           "recall10": round(recall(a["ids"], gt[:n]), 4)}
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
                for index in indexes.values():
                    index.close()
    result["load_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# CPU search path: pipeline and page-buffer policy ({result['date']})", "",
             f"Machine: {result['machine']}, shared: load average {result['load_start']} at start, "
             f"{result['load_end']} at end. Page buffer = raw vectors / {args.buffer_fraction}; default search "
             f"parameters; {args.queries} queries (or all a set has) x {args.rounds} rounds per row, variants interleaved "
             "round by round." + (" Held to as many cores as threads." if args.pin_cores else ""), "",
             "| set | threads | queries/call | variant | q/s | p50 ms | p99 ms | SSD pages/s | recall@10 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['set']} | {r['threads']} | {r['call']} | {r['variant']} | {r['qps']} | {r['p50_ms']} | "
                     f"{r['p99_ms']} | {r['ssd_pages_per_s']} | {r['recall10']} |")
    (args.out / f"{args.tag}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
