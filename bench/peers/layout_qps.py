"""What the adaptive layout (EngineConfig.record_cache 'auto') costs and buys in queries a second, against blocks
only ('off'), on one set's query stream at one operating point: each repetition opens a fresh index per mode,
searches the stream's first WARM queries, then times the next MEASURE in one call (as bench/harness/runner.py times a
stream), on 1 thread (the process held to one core, as run.py's pin_cores does) and on 2. The two modes run
back to back in each repetition, so each ratio compares runs minutes apart on the same VM; the table gives
every repetition's ratio and their median.

    python -m bench.peers.layout_qps                          # GloVe skewed, report half -> bench/results/peers/layout_qps.md
    python -m bench.peers.layout_qps --half tune --reps 4 --tag layout_qps_tune
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness.paths import ROOT, WORK, results

MODES = ("off", "auto")
# GloVe's 0.90 point of the DiskANN comparisons (bench/results/peers/results_streams_layout_glove.md)
KNOBS = {"nprobe": 128, "rerank": 200, "beta": 2, "minibatch": 8}


def one(name: str, half: str, stream: str, warm: int, measure: int, threads: int, knobs: dict) -> list[dict]:
    """Both modes, one after the other, in this process: QPS, CPU per query, recall@10 and SSD pages per query
    of the timed call, and the layout the store ended in."""
    import numpy as np

    from bench.harness import streams as cp
    from fusionrag.retriever import EngineConfig, Index

    idx, q, gt, raw = cp.built_set(WORK, name)
    rows = cp.half_streams(q, half, warm + measure)[stream]
    out = []
    for mode in MODES:
        cfg = EngineConfig(buffer_bytes=raw // 16, threads=threads, filter_tier="cpu", record_cache=mode)
        index = Index.open(idx, cfg)
        index.search(q[rows[:warm]], 10, **knobs)
        c0, t0 = time.process_time(), time.perf_counter()
        r = index.search(q[rows[warm:]], 10, **knobs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        want = gt[rows[warm:], :10]
        recall = sum(len(np.intersect1d(a, b)) for a, b in zip(r.ids, want)) / (10 * measure)
        out.append({"mode": mode, "threads": threads, "qps": measure / wall, "cpu_us": cpu / measure * 1e6,
                    "recall": recall, "pages": float(r.stats["pages_read"].mean()),
                    "layout": index.reranker.store.layout})
        index.close()
    return out


def markdown(rows: list[dict], header: str) -> str:
    md = [header, "", "| threads | rep | off QPS (pages/q, CPU µs/q) | auto QPS (pages/q, CPU µs/q, layout) | auto / off |",
          "|---|---|---|---|---|"]
    for threads in sorted({r["threads"] for r in rows}):
        ratios = []
        reps = [r for r in rows if r["threads"] == threads]
        for i in range(0, len(reps), 2):
            off, auto = reps[i], reps[i + 1]
            ratios.append(auto["qps"] / off["qps"])
            md.append(f"| {threads} | {i // 2 + 1} | {off['qps']:,.0f} ({off['pages']:.2f}, {off['cpu_us']:.0f}) | "
                      f"{auto['qps']:,.0f} ({auto['pages']:.2f}, {auto['cpu_us']:.0f}, {auto['layout']}) | "
                      f"{ratios[-1]:.3f} |")
        md.append(f"| {threads} | median | | | **{statistics.median(ratios):.3f}** |")
    recalls = sorted({round(r["recall"], 3) for r in rows})
    md += ["", f"recall@10 of the timed queries: {', '.join(str(x) for x in recalls)} (the same candidates are "
               "scored in either layout)."]
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="glove")
    ap.add_argument("--half", default="report", choices=["tune", "report"])
    ap.add_argument("--stream", default="skewed", choices=["uniform", "skewed", "drifting"])
    ap.add_argument("--warm", type=int, default=4300, help="queries searched before the timed ones")
    ap.add_argument("--measure", type=int, default=2000)
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--knobs", type=json.loads, default=KNOBS)
    ap.add_argument("--out", type=Path, default=results("peers"))
    ap.add_argument("--tag", default="layout_qps")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one repetition at this many threads
    args = ap.parse_args()
    if args.child:
        rows = one(args.dataset, args.half, args.stream, args.warm, args.measure, args.child, args.knobs)
        print(json.dumps(rows), flush=True)
        return
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for rep in range(args.reps):
        for threads in args.threads:
            # A process per repetition, held to as many cores as threads (Linux: the first ones).
            cmd = [sys.executable, "-m", __spec__.name, "--dataset", args.dataset, "--half", args.half, "--stream", args.stream,
                   "--warm", str(args.warm), "--measure", str(args.measure), "--knobs", json.dumps(args.knobs),
                   "--child", str(threads)]
            pin = ["taskset", "-c", ",".join(str(c) for c in range(threads))] if threads < (os.cpu_count() or 1) else []
            got = json.loads(subprocess.run(pin + cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout.splitlines()[-1])
            for r in got:
                print(json.dumps(r), flush=True)
            rows += got
    load = os.getloadavg()
    header = (f"# The adaptive layout against blocks only, in QPS ({start}, {os.cpu_count()}-core VM, load after "
              f"{load[0]:.1f})\n\n`python -m bench.peers.layout_qps --dataset {args.dataset} --half {args.half} --stream "
              f"{args.stream} --warm {args.warm} --measure {args.measure} --reps {args.reps}`: knobs "
              f"`{json.dumps(args.knobs)}`, buffer = raw vectors / 16, CPU filter tier; {args.warm} queries warm "
              f"the buffer, the next {args.measure} are timed in one call.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.md").write_text(markdown(rows, header))
    (args.out / f"{args.tag}.json").write_text(json.dumps({"date": start, "args": {k: v for k, v in vars(args).items()
                                                                                   if k not in ("out", "child")},
                                                           "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
