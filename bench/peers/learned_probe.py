"""Learned pruning against the distance-ratio rule on a single index, at equal recall.

    python -m bench.peers.learned_probe [--datasets glove minilm fashion synth1m] [--batch 16] [--rounds 2]

Each set is built once with its probe model (BuildConfig(probe_model=True), defaults otherwise) under
bench/work/idx-learned/<set>. Both rules probe at most nprobe=256 lists (the default) and re-rank the default
200 candidates; the ratio rule sweeps probe_ratio, learned pruning its probe_scale. Every setting searches
the set's tuning half and its report half (cache_policy.half_bounds) in calls of --batch queries, one search
thread held to one core, the rules' settings alternated within each round, the best of --rounds timings kept.
For recall@10 targets 0.90 and 0.95 each rule's setting is chosen on the tuning half (the fewest PQ candidates
reaching the target) and reported on the report half: recall, lists probed, candidates scanned, SSD pages,
QPS. Not a test; results in bench/results/learned_probe.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from bench.harness.streams import half_bounds, prepare  # noqa: E402
from bench.harness.sets import load  # noqa: E402
from bench.harness.paths import WORK, results

RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5)
SCALES = (0.15, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
TARGETS = (0.90, 0.95)


def build(work: Path, name: str) -> tuple[Path, float | None]:
    from fusionrag.retriever import BuildConfig, Index

    prepare(work, name)
    out = work / "idx-learned" / name
    if (out / "manifest.json").exists():
        return out, None
    meta = json.loads((work / "data" / name / "meta.json").read_text())
    t = time.perf_counter()
    Index.build(str(work / "data" / name / "base.fbin"), str(out),
                BuildConfig(metric=meta["metric"], probe_model=True), progress=False, overwrite=True)
    return out, time.perf_counter() - t


def recall(ids: np.ndarray, gt: np.ndarray, k: int = 10) -> float:
    return float(np.mean([len(np.intersect1d(a[:k], b[:k])) / k for a, b in zip(ids, gt)]))


def run(index, q: np.ndarray, gt: np.ndarray, batch: int, params: dict) -> dict:
    ids, stats = [], {"lists_probed": [], "candidates": [], "pages_read": [], "pages_buffered": []}
    t = time.perf_counter()
    for s in range(0, len(q), batch):
        r = index.search(q[s:s + batch], 10, **params)
        ids.append(r.ids)
        for key in stats:
            stats[key].append(r.stats[key])
    seconds = time.perf_counter() - t
    out = {key: float(np.concatenate(v).mean()) for key, v in stats.items()}
    return {"recall": recall(np.concatenate(ids), gt), "lists": out["lists_probed"],
            "candidates": out["candidates"], "pages": out["pages_read"] + out["pages_buffered"],
            "qps": len(q) / seconds}


def settings() -> list[tuple[str, float, dict]]:
    return ([("ratio", r, {"probe": "ratio", "probe_ratio": r}) for r in RATIOS] +
            [("learned", s, {"probe": "learned", "probe_scale": s}) for s in SCALES])


def sweep(index, queries: np.ndarray, gt: np.ndarray, half: str, batch: int, rounds: int) -> list[dict]:
    lo, hi = half_bounds(len(queries), half)
    q, g = queries[lo:hi], gt[lo:hi]
    rows = {}
    for _ in range(rounds):
        order = settings()
        for rule, value, params in order[::2] + order[1::2]:  # the two rules interleaved
            r = run(index, q, g, batch, params)
            best = rows.get((rule, value))
            if best is None or r["qps"] > best["qps"]:
                rows[(rule, value)] = {"rule": rule, "value": value, **r}
    return [rows[(rule, value)] for rule, value, _ in settings()]


def choose(rows: list[dict], rule: str, target: float) -> dict | None:
    ok = [r for r in rows if r["rule"] == rule and r["recall"] >= target]
    return min(ok, key=lambda r: r["candidates"]) if ok else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", nargs="+", default=["glove", "minilm", "fashion"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-queries", type=int, default=2000, help="queries used per set (first N)")
    ap.add_argument("--tag", default="learned_probe")
    args = ap.parse_args()
    work = (WORK).resolve()
    from fusionrag.retriever import Index

    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    report = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "load_before": os.getloadavg(), "batch": args.batch, "rounds": args.rounds, "sets": {}}
    for name in args.datasets:
        path, built_s = build(work, name)
        _, queries, gt, meta = load(work, name)
        queries, gt = queries[:args.max_queries], gt[:args.max_queries]
        index = Index.open(path, threads=1)
        try:
            entry = {"count": meta["count"], "dim": meta["dim"], "queries": len(queries),
                     "build_s": built_s, "probe_model": index.manifest.get("probe_model"),
                     "probe_model_s": index.manifest["build_timings"].get("probe_model_s"),
                     "tune": sweep(index, queries, gt, "tune", args.batch, args.rounds),
                     "report": sweep(index, queries, gt, "report", args.batch, args.rounds)}
        finally:
            index.close()
        entry["chosen"] = {}
        for target in TARGETS:
            pick = {}
            for rule in ("ratio", "learned"):
                c = choose(entry["tune"], rule, target)
                pick[rule] = None if c is None else {
                    "value": c["value"], "tune": c,
                    "report": next(r for r in entry["report"] if r["rule"] == rule and r["value"] == c["value"])}
            entry["chosen"][str(target)] = pick
        report["sets"][name] = entry
        print(json.dumps({name: entry["chosen"]}, indent=1), flush=True)
    report["load_after"] = os.getloadavg()
    out = results("peers") / args.tag
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = ["# Learned pruning against the distance-ratio rule (single index)", "",
             f"`bench/peers/learned_probe.py`, {report['machine']}; one search thread held to one core, calls of "
             f"{report['batch']} queries, best of {report['rounds']} rounds; load average "
             f"{report['load_before'][0]:.1f} before, {report['load_after'][0]:.1f} after. nprobe 256, rerank 200 "
             "(defaults). Each rule's setting chosen on the tuning half (fewest PQ candidates reaching the target), "
             "figures from the report half.", ""]
    for name, e in report["sets"].items():
        pm = e["probe_model"] or {}
        lines += [f"## {name} ({e['count']} x {e['dim']}, {e['queries']} queries)", "",
                  f"Probe model: {pm.get('queries')} rows as queries, mean lists needed {pm.get('mean_needed', 0):.1f}, "
                  f"90th percentile {pm.get('p90_needed', 0):.0f}; trained in {e['probe_model_s'] or 0:.1f} s.", "",
                  "| target | rule | setting | recall@10 | lists | candidates | pages | QPS |",
                  "|---|---|---|---|---|---|---|---|"]
        for target, pick in e["chosen"].items():
            for rule, c in pick.items():
                if c is None:
                    lines.append(f"| {target} | {rule} | not reached | | | | | |")
                    continue
                r = c["report"]
                knob = "probe_ratio" if rule == "ratio" else "probe_scale"
                lines.append(f"| {target} | {rule} | {knob} {c['value']} | {r['recall']:.4f} | {r['lists']:.1f} | "
                             f"{r['candidates']:.0f} | {r['pages']:.1f} | {r['qps']:.0f} |")
        lines += ["", "Report half, every setting:", "",
                  "| rule | setting | recall@10 | lists | candidates | pages | QPS |", "|---|---|---|---|---|---|---|"]
        for r in e["report"]:
            lines.append(f"| {r['rule']} | {r['value']} | {r['recall']:.4f} | {r['lists']:.1f} | {r['candidates']:.0f} | "
                         f"{r['pages']:.1f} | {r['qps']:.0f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
