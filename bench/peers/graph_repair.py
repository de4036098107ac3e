"""Whole indexes built with the navigation graph's reachability repair (native.Graph's default) against the same
build without it (every Graph the build makes given repair=False), searched alike: recall@10, PQ candidates and
pages per query, QPS, over nprobe, on the two halves of each set's queries (select / report).

Sets: fashion (bench/harness/sets.py; its centroids are navigated by the graph) and synth1m (bench/gpu/gpu_tier.py's 1M x
128 clustered vectors, 2000 held-out queries). --plain DIR reuses a build made before the repair existed (the same
code otherwise) instead of building one without it.

    python -m bench.peers.graph_repair --set fashion --out bench/results/graph_repair_fashion
    python -m bench.peers.graph_repair --set synth1m --plain bench/work/gpu_tier_synthetic_1000000x128 \\
        --out bench/results/graph_repair_synth1m
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK

from fusionrag import native  # noqa: E402
from fusionrag.retriever import BuildConfig, Index  # noqa: E402
from fusionrag.retriever.engine import build as build_module  # noqa: E402


def load_set(name: str):
    """(source for Index.build, metric, queries, exact top-10)."""
    from bench.harness import sets

    if name == "synth1m":
        from fusionrag.loadtests.queryset import synthetic_vectors

        x = synthetic_vectors(1_000_000 + 2000, 128)  # as bench/gpu/gpu_tier.py makes it
        base, queries = x[:1_000_000], np.ascontiguousarray(x[1_000_000:])
        return base, "l2", queries, sets.exact_knn(base, queries, 10)
    d = sets.prepare(WORK, name)
    _, queries, gt, meta = sets.load(WORK, name)
    return str(d / "base.fbin"), meta["metric"], np.ascontiguousarray(queries, np.float32), gt[:, :10]


def build(source, metric: str, out: Path, repair: bool, threads: int) -> float:
    plain = build_module.Graph
    if not repair:
        build_module.Graph = functools.partial(native.Graph, repair=False)
    try:
        t = time.perf_counter()
        Index.build(source, str(out), BuildConfig(metric=metric, threads=threads), progress=False, overwrite=True)
        return time.perf_counter() - t
    finally:
        build_module.Graph = plain


def sweep(path: Path, queries: np.ndarray, gt: np.ndarray, nprobes: list[int]) -> tuple[list[dict], dict]:
    index = Index.open(str(path))
    g = index.nav.graph
    out = []
    half = len(queries) // 2
    for nprobe in nprobes:
        for label, sl in (("select", slice(0, half)), ("report", slice(half, None))):
            q = queries[sl]
            index.search(q, k=10, nprobe=nprobe)  # pages into the buffer, as a warm service has them
            t = time.perf_counter()
            res = index.search(q, k=10, nprobe=nprobe)
            secs = time.perf_counter() - t
            hit = np.mean([len(np.intersect1d(a, b)) / 10 for a, b in zip(res.ids, gt[sl])])
            out.append({"nprobe": nprobe, "half": label, "recall@10": round(float(hit), 4),
                        "qps": round(len(q) / secs, 1),
                        "candidates": round(float(res.stats["unique_candidates"].mean()), 1),
                        "pages": round(float(res.stats["pages_read"].mean()), 2)})
    info = {"reachable": round(g.reachable() / g.size, 4), "centroids": g.size,
            "list_sizes_p50_p99_max": [int(v) for v in np.percentile(np.diff(index.filter.list_offsets),
                                                                       [50, 99, 100])]}
    index.close()
    return out, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", required=True)
    ap.add_argument("--plain", help="an index of the set built before the repair (skips building one without it)")
    ap.add_argument("--nprobe", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--threads", type=int, default=1, help="build threads (1: the same graph links every build; "
                    "with more, the graph's inserts race and two builds differ)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    source, metric, queries, gt = load_set(args.set)
    work = WORK / "graph_repair" / args.set
    report = {"set": args.set, "queries": len(queries), "build_threads": args.threads,
              "machine": f"{os.cpu_count()}-core {platform.machine()}",
              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg_start": os.getloadavg(),
              "builds": {}, "variants": {}}
    dirs = {"plain": Path(args.plain) if args.plain else work / "plain", "repaired": work / "repaired"}
    for name, repair in (("plain", False), ("repaired", True)):
        if name == "plain" and args.plain:
            report["builds"][name] = f"reused {args.plain}"
            continue
        report["builds"][name] = round(build(source, metric, dirs[name], repair, args.threads), 1)
        print(name, "built in", report["builds"][name], "s", flush=True)
    for name, d in dirs.items():
        points, info = sweep(d, queries, gt, args.nprobe)
        report["variants"][name] = {"index": str(d), **info, "points": points}
        print(name, json.dumps(info), flush=True)
        for p in points:
            print(name, json.dumps(p), flush=True)
    report["load_avg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# Navigation graph repaired against plain HNSW links: {args.set}", "",
             f"Machine: {report['machine']}; {report['started']}, load average {report['load_avg_start'][0]:.1f} at "
             f"the start, {report['load_avg_end'][0]:.1f} at the end. `bench/peers/graph_repair.py`; default search "
             f"settings but nprobe, 2 search threads, one call per half after an untimed one; {args.threads} build "
             f"thread(s); builds: {json.dumps(report['builds'])}.", ""]
    for name, v in report["variants"].items():
        lines.append(f"- {name}: {v['centroids']:,} centroids, reachable {v['reachable']:.4f}, list sizes p50 / p99 / "
                     f"max {' / '.join(map(str, v['list_sizes_p50_p99_max']))}")
    lines += ["", "| nprobe | half | recall@10 plain / repaired | PQ candidates/q | pages/q | QPS |",
              "|---:|---|---|---|---|---|"]
    for a, b in zip(report["variants"]["plain"]["points"], report["variants"]["repaired"]["points"]):
        lines.append(f"| {a['nprobe']} | {a['half']} | {a['recall@10']:.4f} / {b['recall@10']:.4f} | "
                     f"{a['candidates']:.0f} / {b['candidates']:.0f} | {a['pages']:.1f} / {b['pages']:.1f} | "
                     f"{a['qps']:.0f} / {b['qps']:.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
