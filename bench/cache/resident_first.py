"""Resident-first re-ranking (SearchParams.resident_first) on real query streams: a query's first
mini-batch also scores its later candidates whose pages are in the DRAM page buffer then, so the
top-k starts nearer its end and the stop rule ends the search after fewer SSD pages.

For each set, page buffer (1/16 of the raw vectors by default, the default lfu policy) and stream
(bench/harness/streams.py's uniform, skewed and drifting streams of 4000 queries, batches of 16, one
thread, CPU filter tier; the first quarter warms the buffer up and is not counted), a grid of search
points is run with resident_first off and on: recall@10, SSD pages per query, QPS. Per stream, the
point with the highest QPS at recall@10 >= 0.90 (and >= 0.95) is chosen on the tuning half of the
set's queries and reported, at the same point, on the other half.

    python -m bench.cache.resident_first --datasets fashion minilm glove
    python -m bench.cache.resident_first --datasets glove --append     # adds a set to the results there
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK, results

from bench.harness import streams
from bench.harness import sets

GRID = {"nprobe": (16, 32, 64), "rerank": (100, 200), "mb_beta": ((4, 1), (4, 2), (8, 2))}
TARGETS = (0.90, 0.95)


def points() -> list[dict]:
    return [{"nprobe": n, "rerank": r, "minibatch": mb, "beta": b}
            for n, r, (mb, b) in itertools.product(GRID["nprobe"], GRID["rerank"], GRID["mb_beta"])]


def run(idx_path: Path, q: np.ndarray, gt: np.ndarray, order: np.ndarray, frac: int, point: dict, rf: bool,
        batch: int, threads: int) -> dict:
    """One stream through a freshly opened index (an empty page buffer): counts after the first quarter."""
    from fusionrag.retriever import EngineConfig, Index

    raw = (idx_path / "vectors.pages").stat().st_size
    cfg = EngineConfig(buffer_bytes=raw // frac, threads=threads, filter_tier="cpu", manager_interval_s=0.0,
                       verify=False)
    index = Index.open(idx_path, cfg)
    warm = len(order) // 4
    read = buffered = counted = hits = resident = 0
    seconds = 0.0
    try:
        for lo in range(0, len(order), batch):
            rows = order[lo:lo + batch]
            t = time.perf_counter()
            r = index.search(q[rows], 10, resident_first=rf, **point)
            dt = time.perf_counter() - t
            if lo < warm:
                continue
            seconds += dt
            read += int(r.stats["pages_read"].sum())
            buffered += int(r.stats["pages_buffered"].sum())
            resident += int(r.stats["resident_scored"].sum())
            hits += sum(len(np.intersect1d(a[a >= 0], g[:10])) for a, g in zip(r.ids, gt[rows]))
            counted += len(rows)
    finally:
        index.close()
    return {"buffer": f"1/{frac}", **point, "resident_first": rf, "recall": hits / (10 * counted),
            "ssd_pages_per_query": read / counted, "hit_ratio": buffered / max(1, read + buffered),
            "resident_scored_per_query": resident / counted, "qps": counted / seconds}


def best_at(rows: list[dict], target: float) -> dict | None:
    ok = [r for r in rows if r["recall"] >= target]
    return max(ok, key=lambda r: r["qps"]) if ok else None


def key(r: dict) -> tuple:
    return (r["nprobe"], r["rerank"], r["minibatch"], r["beta"])


def markdown(result: dict) -> str:
    lines = [f"# Resident-first re-ranking ({result['date']})", "",
             f"Machine: {result['machine']}. Load average at start {result['load_start']}, at end "
             f"{result.get('load_end')} (shared VM). Filter tier: CPU, {result['threads']} thread, batches of "
             f"{result['batch']} queries, streams of {result['stream_length']} queries (bench/harness/streams.py's), "
             "the first quarter as warm-up; the page buffer's default policy when the set ran (under its heading). "
             "Each point is chosen on the "
             "tuning half of the queries (highest QPS at the recall target) and reported at the same point on "
             "the report half. SSD: pages read from the SSD per query; hit: page-buffer hit ratio of the "
             "mini-batches' pages (pages scored by resident-first are not counted as touched).", ""]
    for name, r in result["sets"].items():
        lines += [f"## {name}", "", f"Page buffer policy: {r.get('buffer_policy', 'lfu')}.", "", "| buffer | stream | target | off: point | off: recall / SSD / hit / QPS | "
                  "on: point | on: recall / SSD / hit / QPS | SSD on/off | QPS on/off |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in r["chosen"]:
            cells = []
            for side in ("off", "on"):
                x = c[side]
                if x is None:
                    cells += ["–", "–"]
                    continue
                cells += [f"{x['nprobe']}/{x['rerank']}/{x['minibatch']}/{x['beta']}",
                          f"{x['recall']:.3f} / {x['ssd_pages_per_query']:.1f} / {x['hit_ratio']:.2f} / "
                          f"{x['qps']:,.0f}"]
            ratio = ("–", "–")
            if c["off"] and c["on"]:
                ratio = (f"{c['on']['ssd_pages_per_query'] / c['off']['ssd_pages_per_query']:.2f}",
                         f"{c['on']['qps'] / c['off']['qps']:.2f}")
            lines.append(f"| {c['buffer']} | {c['stream']} | {c['target']} | " + " | ".join(cells)
                         + f" | {ratio[0]} | {ratio[1]} |")
        lines.append("")
        lines += ["Every point of the grid paired (report half, same point, on vs off), median over the points:", "",
                  "| buffer | stream | SSD pages on/off | recall on − off | QPS on/off | resident-scored per query |",
                  "|---|---|---|---|---|---|"]
        for buf, stream in sorted({(x["buffer"], x["stream"]) for x in r["runs"]["report"]}):
            pairs = {}
            for x in r["runs"]["report"]:
                if (x["buffer"], x["stream"]) == (buf, stream):
                    pairs.setdefault(key(x), {})[x["resident_first"]] = x
            pairs = [p for p in pairs.values() if len(p) == 2]
            ssd = np.median([p[True]["ssd_pages_per_query"] / p[False]["ssd_pages_per_query"] for p in pairs])
            rec = np.median([p[True]["recall"] - p[False]["recall"] for p in pairs])
            qps = np.median([p[True]["qps"] / p[False]["qps"] for p in pairs])
            scored = np.median([p[True]["resident_scored_per_query"] for p in pairs])
            lines.append(f"| {buf} | {stream} | {ssd:.3f} | {rec:+.4f} | {qps:.3f} | {scored:.1f} |")
        lines.append("")
    lines += ["Point: nprobe / rerank / minibatch / beta.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="*", default=["fashion", "minilm", "glove"])
    ap.add_argument("--fractions", nargs="*", type=int, default=[16])
    ap.add_argument("--streams", nargs="*", default=list(streams.STREAMS))
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=results("cache"))
    ap.add_argument("--tag", default="resident_first")
    ap.add_argument("--append", action="store_true", help="keep the sets of the results already there")
    args = ap.parse_args()

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()}-core VM", "threads": args.threads,
              "batch": args.batch, "stream_length": args.length, "grid": GRID,
              "load_start": [round(x, 2) for x in os.getloadavg()], "sets": {}}
    old = args.out / f"{args.tag}.json"
    if args.append and old.exists():
        before = json.loads(old.read_text())
        result["sets"] = before["sets"]
        result["runs_started"] = before.get("runs_started", [before["date"]])
    result.setdefault("runs_started", []).append(result["date"])
    for name in args.datasets:
        idx_path = streams.build(args.work, name)
        _, queries, gt, _ = sets.load(args.work, name)
        from fusionrag.retriever import Index

        index = Index.open(idx_path, filter_tier="cpu")
        q = index.prepare_queries(queries)
        index.close()
        runs = {"tune": [], "report": []}
        for half in runs:
            for sname, order in streams.half_streams(q, half, args.length).items():
                if sname not in args.streams:
                    continue
                for frac in args.fractions:
                    for point, rf in itertools.product(points(), (False, True)):
                        row = run(idx_path, q, gt, order, frac, point, rf, args.batch, args.threads)
                        row.update(half=half, stream=sname)
                        runs[half].append(row)
                        print(json.dumps(row), flush=True)
        chosen = []
        for frac, sname, target in itertools.product(args.fractions, args.streams, TARGETS):
            c = {"buffer": f"1/{frac}", "stream": sname, "target": target}
            for side, rf in (("off", False), ("on", True)):
                tune = [r for r in runs["tune"] if r["buffer"] == c["buffer"] and r["stream"] == sname
                        and r["resident_first"] == rf]
                pick = best_at(tune, target)
                c[side] = pick and next(r for r in runs["report"] if r["buffer"] == c["buffer"]
                                        and r["stream"] == sname and r["resident_first"] == rf
                                        and key(r) == key(pick))
            chosen.append(c)
        from fusionrag.retriever import EngineConfig

        result["sets"][name] = {"runs": runs, "chosen": chosen, "buffer_policy": EngineConfig().buffer_policy}
        streams.save(result, args.out, args.tag, markdown)


if __name__ == "__main__":
    main()
