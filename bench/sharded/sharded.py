"""Sharded mode against the single-machine index on a real set (docs/sharded.md).

For S in --shards, the placements of --placements: SmartANNS hotness from rows of the data (the build's
default), hotness from a query log (a skewed stream's earlier queries), locality (regions of centroid space,
work balanced) and round-robin. Two query streams over
held-out queries: uniform, and skewed (Zipf s=1.2 over 50 k-means clusters of the queries); the log the
hotness-log build sees is drawn from other queries than the stream it is measured on. Per point:
recall@10 against the set's exact ground truth, QPS, lists / shards / PQ candidates per query, work
imbalance (max / mean PQ candidates a shard scanned: the shards' own count) and each shard's service time.

The shards run in this process (ShardedIndex local mode, a thread per shard call), so on one machine
QPS says what the split costs, not what S machines give; the shards' service times are what a
deployment divides among its nodes. Each stream is measured in two halves: "select" (its first half, to
choose settings on) and "report" (its second half, the figures to quote).

--subset N builds over the set's first N rows only (ground truth recomputed exactly over them), for runs
that must be short.

    python -m bench.sharded.sharded [--set glove] [--shards 2 4] [--queries 2000] [--out bench/results/sharded]
    python -m bench.sharded.sharded --subset 100000 --queries 1000 --placements hotness-data locality round-robin \
        --out bench/results/sharded_locality
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

from fusionrag.retriever.engine.build import build_index
from fusionrag.retriever.engine.config import BuildConfig, SearchParams
from fusionrag.retriever.engine.index import Index
from fusionrag.retriever.engine.kmeans import kmeans
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.router import ShardedIndex

from bench.harness.paths import WORK, results


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


def halves(rows: np.ndarray):
    """("select", first half), ("report", second half) of a stream's rows."""
    return (("select", rows[:len(rows) // 2]), ("report", rows[len(rows) // 2:]))


def subset_truth(base: np.ndarray, queries: np.ndarray, metric: str, k: int = 10) -> np.ndarray:
    """Exact top-k rows of `base` for every query (cosine and ip by inner product of unit / raw rows, l2 by
    distance), in chunks of queries."""
    x = base / np.linalg.norm(base, axis=1, keepdims=True) if metric == "cosine" else base
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True) if metric == "cosine" else queries
    out = np.empty((len(q), k), dtype=np.int64)
    sq = (x * x).sum(1)
    for lo in range(0, len(q), 500):
        s = q[lo:lo + 500] @ x.T
        score = -s if metric in ("cosine", "ip") else sq[None, :] - 2 * s
        top = np.argpartition(score, k, axis=1)[:, :k]
        out[lo:lo + 500] = np.take_along_axis(top, np.argsort(np.take_along_axis(score, top, 1), 1), 1)
    return out


def recall_at(ids: np.ndarray, gt: np.ndarray, k: int = 10) -> float:
    return float(np.mean([len(np.intersect1d(a[a >= 0], b[:k])) / k for a, b in zip(ids, gt)]))


def measure_single(index: Index, q: np.ndarray, gt: np.ndarray) -> dict:
    index.search(q[:200], 10)  # warm
    t = time.perf_counter()
    res = index.search(q, 10)
    secs = time.perf_counter() - t
    return {"recall@10": round(recall_at(res.ids, gt), 4), "qps": round(len(q) / secs, 1),
            "lists_per_query": round(float(res.stats["lists_probed"].mean()), 1),
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
    ap.add_argument("--set", default="glove", help="a set of bench/harness/sets.py (glove, minilm, ...)")
    ap.add_argument("--shards", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--queries", type=int, default=2000, help="queries per stream")
    ap.add_argument("--learned-scales", type=float, nargs="*", default=[1.0, 2.0],
                    help="learned pruning points: probe this multiple of the predicted lists")
    ap.add_argument("--placements", nargs="+", default=["hotness-data", "hotness-log", "locality", "round-robin"],
                    choices=["hotness-data", "hotness-log", "locality", "round-robin"])
    ap.add_argument("--subset", type=int, default=0, help="build over the first N rows only (0: all)")
    ap.add_argument("--no-single", action="store_true", help="measure the shards only, not a single index too")
    ap.add_argument("--offline-index", help="a built single index of the set: shards/query per placement from "
                    "its list -> shard maps, no shards built (writes OUT.offline.json)")
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--out", default=str(results("sharded") / "sharded"), help="writes OUT.json and OUT.md")
    ap.add_argument("--machine", default=f"{os.cpu_count()}-core VM ({platform.machine()}), shared with other jobs")
    args = ap.parse_args()

    from bench.harness.sets import load, prepare

    work = Path(args.work)
    prepare(work, args.set)
    base, queries, gt, meta = load(work, args.set)
    source = str(work / "data" / args.set / "base.fbin")
    if args.subset and args.subset < meta["count"]:
        source = np.ascontiguousarray(base[:args.subset], dtype=np.float32)
        gt = subset_truth(source, queries, meta["metric"])
        meta = {**meta, "count": args.subset}
    uniform, skewed, log = streams(queries, args.queries)
    if args.offline_index:
        return offline(Path(args.offline_index), base, queries, uniform, skewed, args.shards, Path(args.out))
    config = BuildConfig(metric=meta["metric"])
    idx_root = work / "sharded" / args.set
    shutil.rmtree(idx_root, ignore_errors=True)
    report = {"set": args.set, "count": meta["count"], "dim": meta["dim"], "metric": meta["metric"],
              "queries_per_stream": args.queries, "machine": args.machine, "load_avg_start": os.getloadavg(),
              "params": "each index's own defaults (its build's calibration: builds below)", "builds": {},
              "points": [], "subset": args.subset or None}

    if not args.no_single:
        t = time.perf_counter()
        m = build_index(source, idx_root / "single", config, progress=False)
        report["builds"]["single"] = {"seconds": round(time.perf_counter() - t, 1),
                                      "search_defaults": m.get("search_defaults")}
        single = Index.open(idx_root / "single")
        for stream, rows in (("uniform", uniform), ("skewed", skewed)):
            for half, hrows in halves(rows):
                point = {"shards": 1, "placement": "single", "stream": stream, "half": half, "probe": "ratio",
                         **measure_single(single, queries[hrows], gt[hrows])}
                report["points"].append(point)
                print(json.dumps(point), flush=True)
        single.close()

    for S in args.shards:
        variants = (("hotness-data", {}), ("hotness-log", {"sample_queries": queries[log]}),
                    ("locality", {"placement": "locality"}), ("round-robin", {"placement": "round-robin"}))
        for name, kw in [v for v in variants if v[0] in args.placements]:
            path = idx_root / f"s{S}-{name}"
            t = time.perf_counter()
            m = build_sharded(source, path, S, config, progress=False, **kw)
            report["builds"][f"s{S}-{name}"] = {
                "seconds": round(time.perf_counter() - t, 1),
                "expected_imbalance": round(m["placement"]["expected_imbalance"], 4),
                "replicated_lists": m["placement"]["replicated_lists"],
                "vectors_per_shard": [p["count"] for p in m["parts"].values()]}
            report["builds"][f"s{S}-{name}"]["probe_model"] = m.get("probe_model")
            report["builds"][f"s{S}-{name}"]["calibration"] = m.get("calibration")  # the router's defaults
            index = ShardedIndex.open(path)
            probes = [("ratio", 1.0)] + [("learned", x) for x in args.learned_scales]
            for stream, rows in (("uniform", uniform), ("skewed", skewed)):
                for half, hrows in halves(rows):
                    for probe, scale in probes:
                        point = {"shards": S, "placement": name, "stream": stream, "half": half,
                                 "probe": probe if probe == "ratio" else f"learned x{scale:g}",
                                 **measure_sharded(index, queries[hrows], gt[hrows], probe, scale)}
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


def offline(index_dir: Path, base, queries: np.ndarray, uniform: np.ndarray, skewed: np.ndarray,
            shard_counts: list[int], out: Path) -> None:
    """Without building shards: from a built single index (its navigation graph, list sizes and centroids),
    each placement's list -> shard map (as build_sharded computes it: visits of 2000 rows of the data) and the
    shards a query reaches: those of its probed lists (the ratio rule), and of its first m lists in probe
    order (what learned pruning's smaller counts probe). Replicas count as reached only if no copy's shard is
    already reached (the router sends a list to one replica)."""
    from fusionrag.retriever.sharded.placement import place_lists, sample_visits

    single = Index.open(index_dir)
    p = SearchParams()
    n_lists = single.filter.list_offsets.size - 1
    sizes = np.diff(single.filter.list_offsets)
    centroids = single.nav.graph.vectors()
    rows = np.sort(np.random.default_rng(BuildConfig().seed + 1).choice(len(base), 2000, replace=False))
    visits = sample_visits(single.nav, np.ascontiguousarray(base[rows], dtype=np.float32), n_lists, p)
    rep = {"index": str(index_dir), "lists": int(n_lists), "points": []}
    for S in shard_counts:
        for kind in ("hotness", "locality", "round-robin"):
            t = time.perf_counter()
            plan = place_lists(sizes, visits, S, kind, centroids=centroids)
            secs = time.perf_counter() - t
            for stream, srows in (("uniform", uniform), ("skewed", skewed)):
                for half, hrows in halves(srows):
                    lists, _, _ = single.nav.probe(queries[hrows], p)
                    point = {"shards": S, "placement": kind, "stream": stream, "half": half,
                             "expected_imbalance": round(plan.imbalance(S), 4), "placement_s": round(secs, 2)}
                    for m in (None, 10, 30, 87):
                        reached = []
                        for row in lists:
                            row = row[row >= 0][:m]
                            prim = set(plan.shards[row, 0].tolist())
                            two = plan.shards[row, 1]
                            for a, b in zip(plan.shards[row[two >= 0], 0], two[two >= 0]):
                                if a not in prim and b not in prim:
                                    prim.add(int(a))
                            reached.append(len(prim))
                        point["ratio" if m is None else f"first {m}"] = round(float(np.mean(reached)), 3)
                    rep["points"].append(point)
                    print(json.dumps(point), flush=True)
    single.close()
    out.with_suffix(".offline.json").write_text(json.dumps(rep, indent=1))


def markdown(r: dict) -> str:
    lines = [f"# Sharded mode: {r['set']} ({r['count']:,} x {r['dim']}, {r['metric']})", "",
             f"Machine: {r['machine']}; load average {r['load_avg_start'][0]:.1f} at the start, "
             f"{r['load_avg_end'][0]:.1f} at the end. Shards in one process (local mode): QPS is what the split "
             f"costs on one machine, not what S machines give. {r['queries_per_stream']} queries per stream; "
             f"search settings: {r['params']}. Written by `bench/sharded/sharded.py`.", "",
             (f"Built over the first {r['subset']:,} rows only (ground truth recomputed over them). "
              if r.get("subset") else "") + "Half: each stream's first (select) and second (report) half.", "",
             "| shards | placement | stream | half | probe | recall@10 | QPS | lists/q | shards/q | PQ candidates/q | "
             "work max/mean | shard ms/query |",
             "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in r["points"]:
        lines.append(f"| {p['shards']} | {p['placement']} | {p['stream']} | {p.get('half', 'all')} | {p['probe']} | "
                     f"{p['recall@10']:.4f} | "
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
