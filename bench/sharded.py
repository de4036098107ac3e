"""Sharded mode against the single-machine index on a real set (docs/sharded.md).

For S in --shards, three placements: SmartANNS hotness from rows of the data (the build's default),
hotness from a query log (a skewed stream's earlier queries), and round-robin. Two query streams over
held-out queries: uniform, and skewed (Zipf s=1.2 over 50 k-means clusters of the queries); the log the
hotness-log build sees is drawn from other queries than the stream it is measured on. Per point:
recall@10 against the set's exact ground truth, QPS, lists / shards / PQ candidates per query, work
imbalance (max / mean PQ candidates a shard scanned: the shards' own count) and each shard's service time.

The shards run in this process (ShardedIndex local mode, a thread per shard call), so on one machine
QPS says what the split costs, not what S machines give; the shards' service times are what a
deployment divides among its nodes.

    python bench/sharded.py [--set glove] [--shards 2 4] [--queries 2000] [--out bench/results/sharded]
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

from fusionrag.retriever.build import build_index
from fusionrag.retriever.config import BuildConfig, SearchParams
from fusionrag.retriever.index import Index
from fusionrag.retriever.kmeans import kmeans
from fusionrag.retriever.sharded import ShardedIndex, build_sharded

HERE = Path(__file__).resolve().parent


def streams(queries: np.ndarray, n: int, seed: int = 0):
    """(uniform rows, skewed rows, log rows): rows of `queries`. The first half of the queries feeds the
    streams measured, the second half the log, both skewed the same way (Zipf over query clusters)."""
    rng = np.random.default_rng(seed)
    half = len(queries) // 2
    _, labels = kmeans(queries, 50, 10, np.random.default_rng(seed))
    weights = 1.0 / np.arange(1, 51) ** 1.2
    rank = rng.permutation(50)  # which cluster is hottest

    def draw(pool: np.ndarray, count: int) -> np.ndarray:
        by = {c: pool[labels[pool] == c] for c in range(50)}
        w = np.array([weights[rank[c]] if len(by[c]) else 0.0 for c in range(50)])
        pick = rng.choice(50, count, p=w / w.sum())
        return np.array([rng.choice(by[c]) for c in pick])

    uniform = rng.choice(half, min(n, half), replace=False)
    return uniform, draw(np.arange(half), n), draw(np.arange(half, len(queries)), n)


def recall_at(ids: np.ndarray, gt: np.ndarray, k: int = 10) -> float:
    return float(np.mean([len(np.intersect1d(a[a >= 0], b[:k])) / k for a, b in zip(ids, gt)]))


def measure_single(index: Index, q: np.ndarray, gt: np.ndarray) -> dict:
    index.search(q[:200], 10)  # warm
    t = time.perf_counter()
    res = index.search(q, 10)
    secs = time.perf_counter() - t
    return {"recall@10": round(recall_at(res.ids, gt), 4), "qps": round(len(q) / secs, 1),
            "lists_per_query": round(float(res.stats["centroids_probed"].mean()), 1),
            "candidates_per_query": round(float(res.stats["candidates"].mean()), 1)}


def measure_sharded(index: ShardedIndex, q: np.ndarray, gt: np.ndarray, probe: str = "ratio",
                    scale: float = 1.0) -> dict:
    index.search(q[:200], 10, probe=probe, probe_scale=scale)
    t = time.perf_counter()
    res = index.search(q, 10, probe=probe, probe_scale=scale)
    secs = time.perf_counter() - t
    cand = res.per_shard["candidates"].astype(float)
    return {"recall@10": round(recall_at(res.ids, gt), 4), "qps": round(len(q) / secs, 1),
            "lists_per_query": round(float(res.stats["lists_probed"].mean()), 1),
            "shards_per_query": round(float(res.stats["shards_probed"].mean()), 3),
            "candidates_per_query": round(float(res.stats["candidates"].mean()), 1),
            "work_imbalance": round(float(cand.max() / cand.mean()), 4),
            "candidates_per_shard": [int(x) for x in cand],
            "shard_ms_per_query": [round(1000 * s / len(q), 4) for s in res.per_shard["seconds"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="glove", help="a set of bench/datasets.py (glove, minilm, ...)")
    ap.add_argument("--shards", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--queries", type=int, default=2000, help="queries per stream")
    ap.add_argument("--learned-scales", type=float, nargs="*", default=[1.0, 2.0],
                    help="learned pruning points: probe this multiple of the predicted lists")
    ap.add_argument("--work", default=str(HERE / "work"))
    ap.add_argument("--out", default=str(HERE / "results" / "sharded"), help="writes OUT.json and OUT.md")
    ap.add_argument("--machine", default=f"{os.cpu_count()}-core VM ({platform.machine()}), shared with other jobs")
    args = ap.parse_args()

    from datasets import load, prepare

    work = Path(args.work)
    prepare(work, args.set)
    base, queries, gt, meta = load(work, args.set)
    uniform, skewed, log = streams(queries, args.queries)
    config = BuildConfig(metric=meta["metric"])
    idx_root = work / "sharded" / args.set
    shutil.rmtree(idx_root, ignore_errors=True)
    report = {"set": args.set, "count": meta["count"], "dim": meta["dim"], "metric": meta["metric"],
              "queries_per_stream": args.queries, "machine": args.machine, "load_avg_start": os.getloadavg(),
              "params": SearchParams().to_dict(), "builds": {}, "points": []}
    source = str(work / "data" / args.set / "base.fbin")

    t = time.perf_counter()
    build_index(source, idx_root / "single", config, progress=False)
    report["builds"]["single"] = round(time.perf_counter() - t, 1)
    single = Index.open(idx_root / "single")
    for stream, rows in (("uniform", uniform), ("skewed", skewed)):
        point = {"shards": 1, "placement": "single", "stream": stream, "probe": "ratio",
                 **measure_single(single, queries[rows], gt[rows])}
        report["points"].append(point)
        print(json.dumps(point), flush=True)
    single.close()

    for S in args.shards:
        variants = (("hotness-data", {}), ("hotness-log", {"sample_queries": queries[log]}),
                    ("round-robin", {"placement": "round-robin"}))
        for name, kw in variants:
            path = idx_root / f"s{S}-{name}"
            t = time.perf_counter()
            m = build_sharded(source, path, S, config, progress=False, **kw)
            report["builds"][f"s{S}-{name}"] = {
                "seconds": round(time.perf_counter() - t, 1),
                "expected_imbalance": round(m["placement"]["expected_imbalance"], 4),
                "replicated_lists": m["placement"]["replicated_lists"],
                "vectors_per_shard": [p["count"] for p in m["parts"].values()]}
            report["builds"][f"s{S}-{name}"]["probe_model"] = m.get("probe_model")
            index = ShardedIndex.open(path)
            probes = [("ratio", 1.0)] + [("learned", x) for x in args.learned_scales]
            for stream, rows in (("uniform", uniform), ("skewed", skewed)):
                for probe, scale in probes:
                    point = {"shards": S, "placement": name, "stream": stream,
                             "probe": probe if probe == "ratio" else f"learned x{scale:g}",
                             **measure_sharded(index, queries[rows], gt[rows], probe, scale)}
                    report["points"].append(point)
                    print(json.dumps(point), flush=True)
            index.close()
            shutil.rmtree(path, ignore_errors=True)
    report["load_avg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    shutil.rmtree(idx_root, ignore_errors=True)


def markdown(r: dict) -> str:
    lines = [f"# Sharded mode: {r['set']} ({r['count']:,} x {r['dim']}, {r['metric']})", "",
             f"Machine: {r['machine']}; load average {r['load_avg_start'][0]:.1f} at the start, "
             f"{r['load_avg_end'][0]:.1f} at the end. Shards in one process (local mode): QPS is what the split "
             f"costs on one machine, not what S machines give. {r['queries_per_stream']} queries per stream; "
             "default search settings. Written by `bench/sharded.py`.", "",
             "| shards | placement | stream | probe | recall@10 | QPS | lists/q | shards/q | PQ candidates/q | "
             "work max/mean | shard ms/query |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in r["points"]:
        lines.append(f"| {p['shards']} | {p['placement']} | {p['stream']} | {p['probe']} | {p['recall@10']:.4f} | "
                     f"{p['qps']:.0f} | "
                     f"{p['lists_per_query']} | {p.get('shards_per_query', 1)} | {p['candidates_per_query']} | "
                     f"{p.get('work_imbalance', 1.0)} | {', '.join(str(x) for x in p.get('shard_ms_per_query', []))} |")
    lines += ["", "Builds (seconds; expected work imbalance from the build's sample; replicated lists; vectors "
              "per shard, boundary replication and list replicas included; the probe model's training):", ""]
    for name, b in r["builds"].items():
        lines.append(f"- {name}: {b if isinstance(b, float) else json.dumps(b)}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
