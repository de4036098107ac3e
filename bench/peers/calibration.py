"""What build-time calibration (BuildConfig.calibrate, retriever/engine/calibrate.py) chooses, and what it buys.

    python -m bench.peers.calibration SET [--index DIR] [--threads T] [--recalibrate] [--suffix S]

Builds SET at the default BuildConfig into bench/work/calibration/SET (which calibrates), or takes an index
already built (--index) and runs the same calibration on it (a build's rows, never its queries) where its
manifest has none, or always with --recalibrate (the manifest is left as it is). Then searches
each half of the set's queries (select: the first, report: the second) at the class defaults and at the settings
calibration chose: recall@10 against the set's ground truth, QPS, candidates re-ranked and SSD pages a query; then
with the raw vectors in RAM (raw_in_ram on), at the settings chosen for the SSD path and at those chosen for RAM
(calibration's search_defaults_ram). Calibration sees neither half; both are reported. Results:
bench/results/peers/calibration_SET{suffix}.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.sets import load, prepare  # noqa: E402

import fusionrag.retriever as fr  # noqa: E402
from fusionrag.retriever.engine.calibrate import calibrate, recall_at  # noqa: E402
from fusionrag.retriever.engine.config import cpu_threads  # noqa: E402
from fusionrag.retriever.engine.vectors import internal_metric  # noqa: E402
from bench.harness.paths import BENCH, WORK, results


def rung(r: dict) -> str:
    """One setting calibration tried, and the recall@10 it measured on the sampled rows."""
    knobs = " ".join(f"{k} {r[k]}" for k in ("nprobe", "rerank", "beta") if k in r)
    return f"{knobs}: {r['recall']}"


def search_halves(out: Path, where: str, settings: list, queries, gt, half: int, threads: int) -> list:
    """Each half of the queries searched at each of settings ((label, SearchParams)), the index opened with its raw
    vectors on the SSD (where 'ssd') or in RAM ('ram'): a row each."""
    rows = []
    index = fr.Index.open(out, fr.EngineConfig(threads=threads, raw_in_ram="off" if where == "ssd" else "on"))
    try:
        for name, sl in (("select", slice(0, half)), ("report", slice(half, None))):
            q, truth = queries[sl], gt[sl, :10]
            # Two rounds, the settings alternating, the second reported: the one searched second would otherwise
            # find the page buffer warmed by the first.
            for rnd, (label, params) in enumerate(settings * 2):
                index.search(q[:50], 10, params)  # warm the page buffer's policy and the threads
                t = time.perf_counter()
                res = index.search(q, 10, params)
                sec = time.perf_counter() - t
                if rnd < len(settings):
                    continue
                row = {"half": name, "raw": where, "settings": label, "params": params.to_dict(),
                       "recall": round(recall_at(res.ids, truth), 4), "qps": round(len(q) / sec, 1),
                       "reranked": round(float(res.stats["reranked"].mean()), 1),
                       "pages_read": round(float(res.stats["pages_read"].mean()), 1),
                       "lists": round(float(res.stats["lists_probed"].mean()), 1)}
                rows.append(row)
                print(row, flush=True)
    finally:
        index.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("set")
    ap.add_argument("--index", type=Path, help="an index of SET already built (default: build one)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--recalibrate", action="store_true", help="measure again even where the manifest has a "
                    "calibration (the engine's calibration of today, not the build's)")
    ap.add_argument("--suffix", default="", help="results go to calibration_SET{suffix}.md and .json")
    args = ap.parse_args()
    here = BENCH
    work = (WORK).resolve()
    prepare(work, args.set)
    base, queries, gt, meta = load(work, args.set)
    out = args.index or work / "calibration" / args.set
    built_s = None
    if not (out / "manifest.json").exists():
        t = time.perf_counter()
        fr.Index.build(work / "data" / args.set / "base.fbin", out, fr.BuildConfig(metric=meta["metric"]),
                       progress=False)
        built_s = time.perf_counter() - t
    manifest = json.loads((out / "manifest.json").read_text())
    cal = manifest.get("calibration")
    if cal is None or args.recalibrate:  # built before calibration, or asked for: the same measurement, on its rows
        bc = manifest["build_config"]
        cal = calibrate(out, lambda ids: np.asarray(base[ids], dtype=np.float32), len(base),
                        internal_metric(meta["metric"]), bc.get("calibrate_queries", 500),
                        bc.get("target_recall", 0.95), bc["seed"], cpu_threads(args.threads))
    print(json.dumps(cal), flush=True)
    rows = []
    half = len(queries) // 2
    ram = (cal.get("ram") or {}).get("params")
    for where in ("ssd", "ram"):  # the page file on the SSD (raw_in_ram off), then the raw vectors in RAM (on)
        settings = []
        if where == "ssd":
            settings = [("class defaults", fr.SearchParams())]
            if cal["params"]:  # else the same settings: a second run would only show a warmer page buffer
                settings.append(("calibrated", fr.SearchParams(**cal["params"])))
            if "nprobe" in cal["params"] and len(cal["params"]) > 1:  # the rung chosen, at the class beam
                wide = {k: v for k, v in cal["params"].items() if k != "nprobe"}
                settings.append(("calibrated, class beam", fr.SearchParams(**wide)))
        elif ram is not None:
            settings = [("calibrated (SSD's), in RAM", fr.SearchParams(**cal["params"])),
                        ("calibrated for RAM, in RAM", fr.SearchParams(**ram))]
        if settings:
            rows += search_halves(out, where, settings, queries, gt, half, args.threads)
    result = {"set": args.set, "count": int(len(base)), "dim": int(base.shape[1]), "metric": meta["metric"],
              "index": str(out.relative_to(here.resolve()) if out.is_relative_to(here.resolve()) else out),
              "build_s": built_s, "calibration": cal, "rows": rows,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load": os.getloadavg()[0]}
    res_dir = results("peers")
    (res_dir / f"calibration_{args.set}{args.suffix}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Calibration: {args.set} ({len(base):,} x {base.shape[1]}, {meta['metric']})", "",
             f"`python -m bench.peers.calibration {' '.join(sys.argv[1:])}`; {result['machine']}, load average "
             f"{result['load']:.1f} when it ended. Calibration: {cal.get('queries', 0)} {cal.get('source', '')}, "
             f"target recall@10 {cal.get('target_recall', '')}, {cal.get('seconds', '')} s; chose "
             f"{cal['params'] or 'the class defaults'}.",
             "", "Rungs tried (recall@10 on the sampled rows): "
             + ", ".join(rung(r) for r in cal.get("tried", [])), ""]
    if "ram" in cal:
        lines += [f"For the raw vectors in RAM it chose {cal['ram']['params'] or 'the class defaults'}; tried (at "
                  "beta 0, the answer RAM gives): " + ", ".join(rung(r) for r in cal["ram"]["tried"]), ""]
    lines += ["| half | raw vectors | settings | recall@10 | QPS | re-ranked/q | SSD pages/q | lists/q |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['half']} | {r['raw']} | {r['settings']} | {r['recall']} | {r['qps']} | {r['reranked']} "
              f"| {r['pages_read']} | {r['lists']} |" for r in rows]
    (res_dir / f"calibration_{args.set}{args.suffix}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
