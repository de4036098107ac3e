"""The native pool running several calls' jobs at once against one job at a time (FUSIONRAG_POOL_JOBS=one, the
pool before 2026-11-27), with the CPU pipeline on and off (not a test).

Index.search runs a call's internal batches as a pipeline (EngineConfig.pipeline): batch b+1's graph search,
batch b's PQ scan and batch b-1's re-rank at once, each stage in a thread of its own calling the native core on
`threads` threads. With one pool job at a time, those stages' native calls queued for the pool whenever threads
> 1, so a re-rank waiting on the SSD held every core. Per set: the report half's skewed stream (bench/harness/runner.py
--streams skewed, its warm-up first), one knob setting near recall@10 0.90 (the one bench/harness/runner.py found for
fusionrag on this stream), searched as one call of 1,000 queries on 1 and 2 threads (the process held to as many
cores, as bench/harness/runner.py does); QPS and process CPU seconds over wall seconds, the median of --repeat calls per
run, runs in fresh processes alternated A B C C B A over --rounds rounds, so a shared machine's drift falls on
every variant alike. The answers do not depend on the variant; the report checks they are the same ids.

    python -m bench.pipeline.pool_overlap [--datasets glove minilm] [--rounds 2] [--tag pool_overlap]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import ROOT, WORK, results

K = 10
SETS = {  # name -> (index directory under --work, knob near recall 0.90 on the skewed stream: results_streams_*)
    "glove": ("idx-streams/glove/fusionrag",
              {"nprobe": 128, "rerank": 200, "beta": 2, "probe_ratio": 0, "minibatch": 8}),
    "minilm": ("idx-records/minilm/fusionrag",
               {"nprobe": 64, "rerank": 100, "beta": 2, "probe_ratio": 1.0, "minibatch": 2}),
}
VARIANTS = {  # name -> (FUSIONRAG_POOL_JOBS, pipeline)
    "many jobs, pipeline": ("many", True),
    "one job, pipeline": ("one", True),
    "many jobs, no pipeline": ("many", False),
}


def worker(spec: dict) -> dict:
    from types import SimpleNamespace

    from bench.harness.sets import load
    from bench.harness.runner import params_for, stream_rows

    from fusionrag.retriever import Index

    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:spec["threads"]])
    work = Path(spec["work"])
    _, q, gt, meta = load(work, spec["set"])
    s = np.load(stream_rows(work, spec["set"], "skewed", 1000, 300))
    buffer = params_for(meta, SimpleNamespace(buffer_fraction=16))["buffer_bytes"]  # bench/harness/runner.py's default
    index = Index.open(work / SETS[spec["set"]][0], buffer_bytes=buffer, threads=spec["threads"],
                       pipeline=spec["pipeline"])
    knob = SETS[spec["set"]][1]
    index.search(q[s["warm"]], K, **knob)
    qps, util = [], []
    for _ in range(spec["repeat"]):
        c, t = os.times(), time.perf_counter()
        r = index.search(q[s["rows"]], K, **knob)
        wall, c2 = time.perf_counter() - t, os.times()
        qps.append(len(s["rows"]) / wall)
        util.append(((c2.user - c.user) + (c2.system - c.system)) / wall)
    gt_rows = gt[s["rows"], :K]
    recall = float(np.mean([len(np.intersect1d(a, g)) / K for a, g in zip(r.ids, gt_rows)]))
    return {"qps": float(np.median(qps)), "cpu_per_wall": float(np.median(util)), "recall": recall,
            "ids_sha": str(hash(r.ids.tobytes()))}


def one_run(args, name: str, threads: int, variant: str) -> dict:
    jobs, pipeline = VARIANTS[variant]
    spec = {"set": name, "threads": threads, "pipeline": pipeline, "repeat": args.repeat, "work": str(args.work)}
    env = {**os.environ, "FUSIONRAG_POOL_JOBS": jobs, "PYTHONHASHSEED": "0"}
    p = subprocess.run([sys.executable, "-m", __spec__.name, "--worker", json.dumps(spec)], capture_output=True, text=True,
                       env=env, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"worker failed ({name}, {threads} threads, {variant}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [f"# One pool job at a time against several at once ({res['started']})", "",
             f"Machine: {res['machine']}; load average at start {res['load_start']}, at end {res['load_end']}. "
             f"Skewed stream of each set's report half (1,000 queries after 300 of warm-up), one call, k={K}, "
             f"page buffer raw/16, {a['rounds']} rounds of fresh processes alternated A B C C B A, the median of "
             f"{a['repeat']} calls a run; medians over runs. `FUSIONRAG_POOL_JOBS=one`: the pool as it was "
             "(a multi-threaded native call waited for any other's job to end).", "",
             "| set | knob | threads | variant | QPS | CPU s / wall s | recall@10 | runs |", "|---|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        lines.append(f"| {row['set']} | `{json.dumps(SETS[row['set']][1])}` | {row['threads']} | {row['variant']} | "
                     f"{row['qps']:,.0f} | {row['cpu_per_wall']:.2f} | {row['recall']:.3f} | "
                     f"{', '.join(f'{x:,.0f}' for x in row['runs'])} |")
    lines += ["", "Same answers in every variant: " + ("yes" if res["same_answers"] else "**no**"), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--datasets", nargs="+", default=list(SETS), choices=list(SETS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tag", default="pool_overlap")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    res = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()} {os.cpu_count()}-core VM, shared with other jobs",
           "load_start": [round(x, 2) for x in os.getloadavg()], "args": {k: str(v) for k, v in vars(args).items()},
           "rows": []}
    names = list(VARIANTS)
    shas = set()
    for name in args.datasets:
        for threads in args.threads:
            runs: dict[str, list] = {v: [] for v in names}
            for r in range(args.rounds):
                for v in (names + names[::-1]):
                    out = one_run(args, name, threads, v)
                    runs[v].append(out)
                    shas.add((name, out["ids_sha"]))
                    print(name, threads, v, f"{out['qps']:.0f} QPS, cpu/wall {out['cpu_per_wall']:.2f}", flush=True)
            for v in names:
                rs = runs[v]
                res["rows"].append({"set": name, "threads": threads, "variant": v,
                                    "qps": float(np.median([x["qps"] for x in rs])),
                                    "cpu_per_wall": float(np.median([x["cpu_per_wall"] for x in rs])),
                                    "recall": rs[0]["recall"], "runs": [x["qps"] for x in rs]})
    res["same_answers"] = len(shas) == len(args.datasets)
    res["load_end"] = [round(x, 2) for x in os.getloadavg()]
    out = results("pipeline") / args.tag
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
