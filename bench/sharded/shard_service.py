"""What one shard's call costs at recall@10 0.90 and 0.95, and how that grows with the shard's size (not a test):
the figures docs/sharded.md's billion-vector paper rests on.

A shard part is an ordinary index, and a sharded query costs each shard it reaches one call that scans and
re-ranks the lists sent to it, after the router found the lists (navigation). So one index searched on one
thread, in batches of 64 (a router's micro-batch), gives both: the navigation's seconds (the router's share) and
the rest (the shard's share), per query.

For each index: the query set's first half chooses, the second half reports. For each target the settings are
chosen as a build's calibration chooses them (calibrate.climb: the (rerank, beta) ladder, then narrower graph
beams where the index navigates by its graph), but on the first half's queries against their ground truth; then
the second half is searched at them: after one pass to warm the page buffer (sized at 1/--buffer-fraction of the
raw vectors), the best of --passes timed passes.

    python -m bench.sharded.shard_service --sets synth100kx768 synth1mx768 --indexes bench/work/flat
    python -m bench.sharded.shard_service --sets synth100kx768 --threads 2 --out bench/results/sharded/shard_service_threads.json

--threads T also searches the report half from T threads at once, and from T processes of one thread at once, the
settings chosen as above: queries/s against one thread's (one process's), what the paper's many-thread node rests
on (the sets are built at the defaults where not there yet).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.harness.sets import load, prepare  # noqa: E402

from fusionrag.retriever.engine.calibrate import climb, recall_at  # noqa: E402
from fusionrag.retriever.engine.config import SearchParams  # noqa: E402
from bench.harness.paths import ROOT, WORK

K = 10
BATCH = 64


def search(index, q: np.ndarray, params: SearchParams | None = None):
    """One pass in batches of BATCH at params (the index's defaults: None): ids, wall seconds, and the per-query
    stats concatenated."""
    ids, stats = [], {}
    t = time.perf_counter()
    for s in range(0, len(q), BATCH):
        r = index.search(q[s:s + BATCH], K, params)
        ids.append(r.ids)
        for key, v in r.stats.items():
            stats.setdefault(key, []).append(np.asarray(v))
    wall = time.perf_counter() - t
    return np.concatenate(ids), wall, {key: np.concatenate(v) for key, v in stats.items()}


def threaded(index, q: np.ndarray, params: SearchParams, threads: int) -> float:
    """Wall seconds for q searched by `threads` threads at once, each its share (every threads-th batch of BATCH),
    as a shard's actor answers concurrent calls (ShardServer: one index, a thread per call)."""
    parts = [np.concatenate([q[s:s + BATCH] for s in range(t * BATCH, len(q), threads * BATCH)])
             for t in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda part: search(index, part, params), parts))
        return time.perf_counter() - t0


def processes_qps(work: Path, index_dir: Path, name: str, params: dict, fraction: int, passes: int,
                  processes: int) -> list[float]:
    """Queries/s of each of `processes` copies of this script searching the report half at once, one thread each,
    each with its own page buffer (--one-process): what a node's cores give without sharing one process."""
    cmd = [sys.executable, "-m", __spec__.name, "--one-process", str(work), str(index_dir), name, json.dumps(params),
           str(fraction), str(passes)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(processes)]
    return [float(json.loads(p.communicate()[0].strip().splitlines()[-1])["qps"]) for p in procs]


def one_process(work: Path, index_dir: Path, name: str, params: dict, fraction: int, passes: int) -> None:
    import fusionrag.retriever as fr

    base, queries, _, _ = load(work, name)
    n, dim = base.shape
    index = fr.Index.open(str(index_dir), threads=1, filter_tier="cpu", buffer_bytes=n * dim * 4 // fraction)
    q = np.ascontiguousarray(queries, dtype=np.float32)
    report, p = q[len(q) // 2:], SearchParams(**params)
    search(index, q[:len(q) // 2], p)  # warm, as measure() does
    search(index, report, p)
    wall = min(search(index, report, p)[1] for _ in range(passes))
    index.close()
    print(json.dumps({"qps": len(report) / wall}), flush=True)


def measure(work: Path, index_dir: Path, name: str, targets: list[float], fraction: int, passes: int,
            threads: int = 1) -> dict:
    import fusionrag.retriever as fr

    base, queries, gt, meta = load(work, name)
    n, dim = base.shape
    buffer = n * dim * 4 // fraction
    index = fr.Index.open(str(index_dir), threads=1, filter_tier="cpu", buffer_bytes=buffer)
    q = np.ascontiguousarray(queries, dtype=np.float32)
    half = len(q) // 2
    tune, report = (q[:half], gt[:half]), (q[half:], gt[half:])
    out = {"set": name, "vectors": n, "dim": dim, "lists": index.manifest["centroids"],
           "pq_m": index.pq.m, "buffer_mib": round(buffer / 2**20, 1), "queries": [half, len(q) - half],
           "ladder": [], "points": []}
    search(index, tune[0])  # the page buffer warmed on the other half
    chosen = {}
    for t in targets:  # as a build's calibration chooses (the ladder, then a narrower beam where the graph
        # navigates), on the first half's own queries against their ground truth
        tried, params = climb(lambda qq, p: search(index, qq, p)[0], tune[0], tune[1][:, :K], t,
                               graph=not index.nav.exhaustive)
        out["ladder"].append({"target": t, "tried": tried})
        print(json.dumps({"set": name, "target": t, "tried": tried}), flush=True)
        if any(r["recall"] >= t for r in tried):
            chosen[t] = params
    for t in targets:
        if t not in chosen:
            out["points"].append({"target": t, "reached": False})
            continue
        params = SearchParams(**chosen[t])
        search(index, report[0], params)  # warm
        best = None
        for _ in range(passes):
            ids, wall, st = search(index, report[0], params)
            if best is None or wall < best[1]:
                best = (ids, wall, st)
        ids, wall, st = best
        nq = len(report[0])
        us = {k: round(float(st[k].mean()) * 1e6, 1) for k in ("graph_s", "lut_s", "scan_s", "rerank_s")}
        point = {"target": t, "reached": True, "params": chosen[t],
                 "recall_report": round(recall_at(ids, report[1][:, :K]), 4), "us_per_query": round(wall / nq * 1e6, 1),
                 "stage_us": us, "lists": round(float(st["lists_probed"].mean()), 1),
                 "candidates": round(float(st["unique_candidates"].mean())),
                 "reranked": round(float(st["reranked"].mean()), 1),
                 "pages_read": round(float(st["pages_read"].mean()), 2),
                 "pages_buffered": round(float(st["pages_buffered"].mean()), 2)}
        # the router's share is the navigation; a shard's call is the rest
        point["shard_us"] = round(point["us_per_query"] - us["graph_s"], 1)
        if threads > 1:  # the same queries from `threads` threads at once: queries/s against one thread's
            threaded(index, report[0], params, threads)  # warm
            wall_t = min(threaded(index, report[0], params, threads) for _ in range(passes))
            point["threads"] = {"threads": threads, "qps": round(nq / wall_t, 1), "qps_one": round(nq / wall, 1),
                                "speedup": round(wall / wall_t, 2)}
            # and as many processes of one thread, searching at once (the engine's Python between native calls
            # shares one interpreter in a process; processes share only the machine)
            alone = processes_qps(work, index_dir, name, chosen[t], fraction, passes, 1)
            many = processes_qps(work, index_dir, name, chosen[t], fraction, passes, threads)
            point["processes"] = {"processes": threads, "qps_each": [round(x, 1) for x in many],
                                  "qps": round(sum(many), 1), "qps_one": round(alone[0], 1),
                                  "speedup": round(sum(many) / alone[0], 2)}
        out["points"].append(point)
        print(json.dumps({"set": name, **point}), flush=True)
    index.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--indexes", type=Path, default=None, help="folder of built indexes, one per set name "
                    "(default: WORK/flat)")
    ap.add_argument("--sets", nargs="+", default=["synth100kx768", "synth1mx768"])
    ap.add_argument("--targets", type=float, nargs="+", default=[0.90, 0.95])
    ap.add_argument("--buffer-fraction", type=int, default=64, help="page buffer = raw vectors / this")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="also search the report half from this many threads "
                    "at once (queries/s against one thread's)")
    ap.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    if sys.argv[1:2] == ["--one-process"]:
        w, d, name, params, fraction, passes = sys.argv[2:8]
        return one_process(Path(w), Path(d), name, json.loads(params), int(fraction), int(passes))
    args = ap.parse_args()
    root = args.indexes or args.work / "flat"
    for name in args.sets:  # a set not built yet: prepared and built at the defaults, as `fusionrag build` builds
        if not (root / name).exists():
            from fusionrag.retriever.engine.build import build_index
            from fusionrag.retriever.engine.config import BuildConfig

            prepare(args.work.resolve(), name)
            base, _, _, meta = load(args.work.resolve(), name)
            build_index(base, root / name, BuildConfig(metric=meta["metric"]), progress=False)
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "threads": args.threads, "batch": BATCH},
               "sets": [measure(args.work.resolve(), root / s, s, args.targets, args.buffer_fraction, args.passes,
                                args.threads) for s in args.sets]}
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
