"""Sharded mode's writes and faults on a real set (docs/sharded.md, "Writes" and "Faults").

One sharded index per --replicate value (S shards, hotness placement); shards in this process. Per index:
- healthy: recall@10 against the set's ground truth, QPS, shards per query;
- one shard down (shard 1 killed, the router failing over): the share of queries answered partially, the lists
  per query they missed, recall@10 over all queries and over the full answers alone;
- its restart from its directory: seconds;
- writes: upserts of new vectors (perturbed held-out queries) one at a time and 100 at a time (latency; each
  fsynced by every shard it goes to), then searches with those rows in the fresh tiers: QPS and shards per
  query (a shard holding fresh rows is asked every query).

    python -m bench.sharded.sharded_faults [--set glove] [--shards 3] [--replicate 0.02 0.3] [--out bench/results/sharded_faults]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np

from fusionrag.retriever.engine.config import BuildConfig
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.router import ShardedIndex

from bench.harness.paths import WORK, results


def recall_at(ids: np.ndarray, gt: np.ndarray, k: int = 10) -> float:
    if not len(ids):
        return float("nan")
    return float(np.mean([len(np.intersect1d(a[a >= 0], b[:k])) / k for a, b in zip(ids, gt)]))


def timed_search(index: ShardedIndex, q: np.ndarray):
    t = time.perf_counter()
    res = index.search(q, 10)
    return res, time.perf_counter() - t


def measure(index: ShardedIndex, q: np.ndarray, gt: np.ndarray, n: int, held: np.ndarray) -> dict:
    index.search(q[:200], 10)  # warm
    res, secs = timed_search(index, q)
    out = {"healthy": {"recall@10": round(recall_at(res.ids, gt), 4), "qps": round(len(q) / secs, 1),
                       "shards_per_query": round(float(res.stats["shards_probed"].mean()), 3)}}
    index.kill_shard(1)
    res, secs = timed_search(index, q)
    part = np.array([len(m) > 0 for m in res.missing_lists])
    out["one_shard_down"] = {
        "partial_share": round(float(part.mean()), 4),
        "missing_lists_per_partial_query": round(float(res.stats["missing_lists"][part].mean()), 2) if part.any()
        else 0.0,
        "lists_per_query": round(float(res.stats["lists_probed"].mean()), 1),
        "recall@10": round(recall_at(res.ids, gt), 4),
        "recall@10_full_answers": round(recall_at(res.ids[~part], gt[~part]), 4),
        "qps": round(len(q) / secs, 1)}
    t = time.perf_counter()
    index.restart_shard(1)
    out["restart_s"] = round(time.perf_counter() - t, 3)

    lat = []
    for i in range(200):
        t = time.perf_counter()
        index.upsert([n + i], held[i:i + 1])
        lat.append(time.perf_counter() - t)
    lat100 = []
    for lo in range(200, len(held), 100):
        t = time.perf_counter()
        index.upsert(np.arange(n + lo, n + lo + 100), held[lo:lo + 100])
        lat100.append(time.perf_counter() - t)
    out["writes"] = {"one_at_a_time_ms": {"p50": round(1000 * float(np.median(lat)), 2),
                                          "p99": round(1000 * float(np.quantile(lat, 0.99)), 2)},
                     "batch_of_100_ms": {"p50": round(1000 * float(np.median(lat100)), 2)},
                     "vectors_per_s_batched": round(100 / float(np.median(lat100)), 1),
                     "fresh_rows_per_shard": [int(x) for x in index.fresh_count]}
    res, secs = timed_search(index, q)
    top = index.search(held, 1)
    out["with_fresh_rows"] = {"qps": round(len(q) / secs, 1),
                              "shards_per_query": round(float(res.stats["shards_probed"].mean()), 3),
                              "written_found_at_1": round(float(np.mean(top.ids[:, 0] == n + np.arange(len(held)))), 4)}
    return out


def markdown(r: dict) -> str:
    lines = [f"# Sharded mode: writes and faults ({r['set']}, {r['count']} x {r['dim']}, {r['shards']} shards)", "",
             f"`bench/sharded/sharded_faults.py`, {r['queries']} queries, default settings, shards in one process, on a "
             f"{r['machine']} (load average {r['load_avg_start'][0]:.1f} at the start, {r['load_avg_end'][0]:.1f} "
             "at the end: QPS moves with it).", "",
             "| replicated lists | recall@10 | QPS | down: partial answers | missing lists per partial answer | "
             "down: recall@10 (all / full answers) | restart s | upsert 1 p50 / p99 ms | upsert 100 p50 ms | "
             "QPS with fresh rows | shards per query (before / with fresh) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["points"]:
        h, d, w, f = p["healthy"], p["one_shard_down"], p["writes"], p["with_fresh_rows"]
        lines.append(f"| {p['replicate']:.0%} ({p['replicated_lists']}) | {h['recall@10']} | {h['qps']} | "
                     f"{d['partial_share']:.1%} | {d['missing_lists_per_partial_query']} | {d['recall@10']} / "
                     f"{d['recall@10_full_answers']} | {p['restart_s']} | {w['one_at_a_time_ms']['p50']} / "
                     f"{w['one_at_a_time_ms']['p99']} | {w['batch_of_100_ms']['p50']} | {f['qps']} | "
                     f"{h['shards_per_query']} / {f['shards_per_query']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="glove")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--replicate", type=float, nargs="+", default=[0.02, 0.3])
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--writes", type=int, default=1200)
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--out", default=str(results("sharded") / "sharded_faults"))
    ap.add_argument("--machine", default=f"{os.cpu_count()}-core VM ({platform.machine()}), shared with other jobs")
    args = ap.parse_args()

    from bench.harness.sets import load, prepare

    work = Path(args.work)
    prepare(work, args.set)
    base, queries, gt, meta = load(work, args.set)
    rng = np.random.default_rng(0)
    pick = rng.permutation(len(queries))
    q, g = queries[pick[:args.queries]], gt[pick[:args.queries]]
    held = queries[pick[args.queries:args.queries + args.writes]]
    held = (held + 0.01 * rng.standard_normal(held.shape)).astype(np.float32)
    n = int(meta["count"])
    report = {"set": args.set, "count": n, "dim": meta["dim"], "shards": args.shards, "queries": len(q),
              "machine": args.machine, "load_avg_start": os.getloadavg(), "points": []}
    source = str(work / "data" / args.set / "base.fbin")
    for rep in args.replicate:
        path = work / "sharded" / f"faults-{args.set}-r{rep:g}"
        shutil.rmtree(path, ignore_errors=True)
        t = time.perf_counter()
        m = build_sharded(source, path, args.shards, BuildConfig(metric=meta["metric"]), replicate=rep,
                          probe_model=False, progress=False)
        index = ShardedIndex.open(path)
        try:
            point = {"replicate": rep, "replicated_lists": m["placement"]["replicated_lists"],
                     "build_s": round(time.perf_counter() - t, 1), **measure(index, q, g, n, held)}
        finally:
            index.close()
            shutil.rmtree(path, ignore_errors=True)
        report["points"].append(point)
        print(json.dumps(point), flush=True)
    report["load_avg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))


if __name__ == "__main__":
    main()
