"""Where a build's rows start their search for their lists: at the graph's entry point (before) or at the leaf of the
build's clustering they fell in (now; build.assign_rows), on the same data in the same run.

    python -m bench.peers.assign_start [--sets fashion glove synth-clustered] [--threads T] [--nprobe 16 32 ...]

Each set is built twice at the default BuildConfig but for calibration (off: both are searched at the same
settings), once as before (the leaves withheld from assign_rows) and once as now, into bench/work/assign_start/
(a build an earlier run finished is searched again, not rebuilt; delete its folder to rebuild).
Reported per build: build seconds, the share of rows whose own (nearest) list by exact distance holds them, the
largest list and the 99th percentile; per nprobe, on the report half of the queries (the second half; nothing is
chosen here, so the first half is not used), the two builds alternately in two rounds, the second reported:
recall@10, QPS, lists probed and PQ candidates a query. Results:
bench/results/peers/assign_start.md and .json.

synth-clustered: 200,000 x 128, 2,000 Gaussian centres (sd 0.3), 1,000 queries from the same centres: the shape of
scale_table's sets, where the entry point's search was lost for 9-11% of rows (scale_lists).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

import fusionrag.retriever as fr
from bench.harness.paths import WORK, results
from bench.harness.sets import exact_knn, load, prepare
from fusionrag.native import Graph
from fusionrag.retriever.engine import build as build_module
from fusionrag.retriever.engine.calibrate import recall_at

SYNTH = "synth-clustered"


def synthetic() -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    d = WORK / "assign_start" / SYNTH
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "gt.npy").exists():
        c = np.random.default_rng(5).standard_normal((2000, 128)).astype(np.float32)
        r = np.random.default_rng(7)
        base = c[r.integers(0, 2000, 200_000)] + 0.3 * r.standard_normal((200_000, 128), dtype=np.float32)
        q = c[r.integers(0, 2000, 1000)] + 0.3 * r.standard_normal((1000, 128), dtype=np.float32)
        np.save(d / "base.npy", base)
        np.save(d / "queries.npy", q)
        np.save(d / "gt.npy", exact_knn(base, q, 10))
    return (np.load(d / "base.npy", mmap_mode="r"), np.load(d / "queries.npy"), np.load(d / "gt.npy"),
            {"metric": "l2"})


def lists_report(index_dir: Path, base, metric: str) -> dict:
    """Share of rows in their nearest list by exact distance (l2 over the index's vectors: unit rows under cosine)."""
    cents = Graph.load(str(index_dir / "graph.bin")).vectors()
    off = np.load(index_dir / "list_offsets.npy")
    ids = np.load(index_dir / "list_ids.npy")
    sizes = np.diff(off)
    lists = np.repeat(np.arange(len(sizes)), sizes)
    x = np.asarray(base, np.float32)
    if metric == "cosine":
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
    near = build_module.nearest_rows(np.ascontiguousarray(x), np.ascontiguousarray(cents[:, :x.shape[1]]), 1)[0][:, 0]
    held = np.zeros(len(x), bool)
    held[ids[near[ids] == lists]] = True
    return {"lists": int(len(sizes)), "rows_in_nearest": round(float(held.mean()), 4), "max_list": int(sizes.max()),
            "p99_list": int(np.percentile(sizes, 99))}


def build(source, out: Path, metric: str, leaves: bool) -> float:
    shutil.rmtree(out, ignore_errors=True)
    original = build_module.assign_rows

    def withheld(graph, pq, ids, x, config, threads, centroids=None, leaves=None):
        return original(graph, pq, ids, x, config, threads, centroids, None)

    if not leaves:
        build_module.assign_rows = withheld
    try:
        t = time.perf_counter()
        fr.Index.build(source, out, fr.BuildConfig(metric=metric, calibrate=False, navigation="graph"),
                       progress=False)
        return time.perf_counter() - t
    finally:
        build_module.assign_rows = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="*", default=["fashion", "glove", SYNTH])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--nprobe", type=int, nargs="*", default=[16, 32, 64, 128, 256])
    args = ap.parse_args()
    out_rows, builds = [], []
    for name in args.sets:
        if name == SYNTH:
            base, queries, gt, meta = synthetic()
            source = WORK / "assign_start" / SYNTH / "base.npy"
        else:
            prepare(WORK, name)
            base, queries, gt, meta = load(WORK, name)
            source = WORK / "data" / name / "base.fbin"
        half = len(queries) // 2
        q, truth = queries[half:], gt[half:, :10]
        hows = ("entry point", "leaf")
        dirs = {how: WORK / "assign_start" / "index" / f"{name}-{how.replace(' ', '-')}" for how in hows}
        for how in hows:
            d = dirs[how]
            record = d.parent / f"{d.name}.build.json"  # a finished build of an earlier run is searched again
            if not (record.exists() and (d / "manifest.json").exists()):
                load_start = os.getloadavg()[0]
                seconds = build(source, d, meta["metric"], how == "leaf")
                info = {"set": name, "start": how, "build_s": round(seconds, 1),
                        "load": [load_start, os.getloadavg()[0]], **lists_report(d, base, meta["metric"])}
                record.write_text(json.dumps(info))
            builds.append(json.loads(record.read_text()))
            print(builds[-1], flush=True)
        # Both builds searched alternately in two rounds, the second reported: neither is measured on a machine
        # the other was not.
        indexes = {how: fr.Index.open(dirs[how], fr.EngineConfig(threads=args.threads)) for how in hows}
        try:
            for rnd in range(2):
                for nprobe in args.nprobe:
                    params = fr.SearchParams(nprobe=nprobe)
                    for how in hows:
                        index = indexes[how]
                        index.search(q[:50], 10, params)
                        t = time.perf_counter()
                        res = index.search(q, 10, params)
                        sec = time.perf_counter() - t
                        if rnd == 0:
                            continue
                        row = {"set": name, "start": how, "nprobe": nprobe,
                               "recall": round(recall_at(res.ids, truth), 4), "qps": round(len(q) / sec, 1),
                               "lists": round(float(res.stats["lists_probed"].mean()), 1),
                               "candidates": round(float(res.stats["candidates"].mean()), 1),
                               "load": os.getloadavg()[0]}
                        out_rows.append(row)
                        print(row, flush=True)
        finally:
            for index in indexes.values():
                index.close()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    result = {"machine": machine, "argv": sys.argv[1:], "builds": builds, "searches": out_rows}
    res_dir = results("peers")
    (res_dir / "assign_start.json").write_text(json.dumps(result, indent=1))
    lines = ["# Where a build's rows start their search for their lists: entry point (before) or own leaf (now)", "",
             f"`python -m bench.peers.assign_start {' '.join(sys.argv[1:])}` on {machine}; each set built twice in "
             "the same run at the default BuildConfig without calibration, navigation by the graph; searched on the "
             "report half of its queries at each nprobe, the rest of the search at the class defaults, the two builds "
             "alternately in two rounds (the second reported). Load averages (1 minute) at each build's start and end "
             "and at each search are in the JSON beside this file.", "",
             "| set | rows start at | build s | lists | rows in their nearest list | largest list | p99 list |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {b['set']} | {b['start']} | {b['build_s']:,.0f} | {b['lists']:,} | {b['rows_in_nearest']:.4f} | "
              f"{b['max_list']:,} | {b['p99_list']:,} |" for b in builds]
    lines += ["", "| set | rows start at | nprobe | recall@10 | QPS | lists probed | PQ candidates |",
              "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['set']} | {r['start']} | {r['nprobe']} | {r['recall']:.4f} | {r['qps']:,.0f} | {r['lists']} | "
              f"{r['candidates']:,.0f} |" for r in out_rows]
    (res_dir / "assign_start.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
