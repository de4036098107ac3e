"""Issue #17 through the service: the search path before (page buffer CLOCK, no pipeline) and after (the
defaults: cache by use, 'lfu', and the pipeline), measured with Locust (`fusionrag loadtest`) against a real
`fusionrag serve`, where micro-batches are small.

For each set and stream, one collection is built once (loadtests.runner.prepare: the set's base vectors and the
stream's queries with their exact top-k), then served by one `fusionrag serve` per run with the variant's flags
and loaded by `python -m fusionrag.loadtests --url`: steady USERS vector users for SECONDS. Runs alternate
A B B A … so that drift of a shared machine falls on both variants alike. The page buffer is raw vectors / 16,
as in bench/harness/runner.py. Streams come from the report half of the set's queries (bench/harness/runner.py's stream_rows).

    python -m bench.service.service_before_after [--datasets glove minilm] [--streams uniform skewed] [--rounds 2]
                                         [--variants blocks after]   # the record cache off, then on
                                         [--variants one-job-pool after]   # the native pool's one job at a time
                                         [--variants no-prefetch after]   # the re-rank's read-ahead off, then on

Results: bench/results/service/service_before_after.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bench.harness.paths import WORK, results
from bench.harness.sets import load, prepare  # noqa: E402
from bench.harness.runner import stream_rows  # noqa: E402

VARIANTS = {  # name -> `fusionrag serve` flags
    "before": ["--buffer-policy", "clock", "--no-pipeline", "--record-cache", "off", "--buffer-compression", "off"],
    "after": [],  # the defaults: --buffer-policy auto --record-cache auto --buffer-compression auto --pipeline
    "blocks": ["--record-cache", "off"],  # the defaults but the buffer holding blocks only
    "plain": ["--buffer-compression", "off"],  # the defaults but a buffer never compressed
    "no-prefetch": ["--no-rerank-prefetch"],  # the defaults but the re-rank's read-ahead
    "one-job-pool": [],  # the defaults on the native pool as it was before 2026-11-27: one job at a time
}
VARIANT_ENV = {"one-job-pool": {"FUSIONRAG_POOL_JOBS": "one"}}  # name -> the service's added environment


def build_collection(work: Path, name: str, stream: str, queries: int, data_dir: Path, k: int) -> Path:
    """The set's collection in data_dir and the stream's known queries; returns the query set's file."""
    from fusionrag.loadtests import queryset
    from fusionrag.loadtests.runner import prepare as prepare_collections

    _, q, _, meta = load(work, name)
    rows = np.load(stream_rows(work, name, stream, queries, 0))["rows"]
    qfile = data_dir.parent / f"{name}-{stream}-queries.npy"
    np.save(qfile, np.ascontiguousarray(q[rows], dtype=np.float32))
    args = SimpleNamespace(base=str(work / "data" / name / "base.fbin"), count=meta["count"], dim=meta["dim"],
                           queries=str(qfile), num_queries=len(rows), metric=meta["metric"], k=k, texts=None,
                           rag_route="separate")
    vector_qs, _, _ = prepare_collections(args, data_dir, {"vector": 1})
    qs_file = data_dir.parent / f"{name}-{stream}-queryset.json"
    queryset.save_query_set(vector_qs, qs_file)
    return qs_file


def one_run(data_dir: Path, qs_file: Path, out: Path, flags: list[str], buffer_mb: float, users: int,
            seconds: float, env: dict | None = None) -> dict:
    from fusionrag.loadtests.runner import start_service

    out.mkdir(parents=True, exist_ok=True)
    service, url = start_service(data_dir, out, ["--buffer-mb", f"{buffer_mb:.3f}", "--filter-tier", "cpu", *flags],
                                 env)
    try:
        service.wait_http(url + "/readyz", 300)
        p = subprocess.run([sys.executable, "-m", "fusionrag.loadtests", "--url", url, "--vector-query-set",
                            str(qs_file), "--out", str(out), "--users", "vector", "--shape", "steady",
                            "--max-users", str(users), "--seconds", str(seconds), "--target-recall", "0.9"],
                           capture_output=True, text=True)
    finally:
        service.stop()
    if not (out / "report.json").exists():
        raise SystemExit(f"the load test wrote no report ({p.returncode}):\n{p.stderr[-3000:]}")
    rep = json.loads((out / "report.json").read_text())
    r, m = rep["requests"]["all"], rep["service_metrics"] or {}
    return {"passed": rep["passed"], "requests": r["requests"], "failures": r["failures"], "per_s": r["per_s"],
            "latency_ms": r["latency_ms"], "recall": rep["verdict"]["mean_recall"],
            "hit_ratio": m.get("page_buffer_hit_ratio"), "ssd_pages_per_query": m.get("ssd_pages_read_per_query"),
            "queries_per_batch": m.get("queries_per_batch"), "load": os.getloadavg()[0]}


def summarize(runs: list[dict]) -> dict:
    med = lambda xs: float(np.median([x for x in xs if x is not None])) if any(x is not None for x in xs) else None  # noqa: E731
    return {"runs": len(runs), "per_s": med([r["per_s"] for r in runs]),
            "p50_ms": med([r["latency_ms"]["p50"] for r in runs]), "p99_ms": med([r["latency_ms"]["p99"] for r in runs]),
            "hit_ratio": med([r["hit_ratio"] for r in runs]), "ssd_pages_per_query": med([r["ssd_pages_per_query"] for r in runs]),
            "queries_per_batch": med([r["queries_per_batch"] for r in runs]), "recall": med([r["recall"] for r in runs]),
            "failures": sum(r["failures"] for r in runs), "all_passed": all(r["passed"] for r in runs)}


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [f"# The search path through the service, before and after #17 ({res['started']})", "",
             f"Machine: {res['machine']}; load average at start {res['load_start']}, at end {res.get('load_end')}. "
             f"`fusionrag serve --filter-tier cpu --buffer-mb raw/16`, {a['users']} steady Locust vector users for "
             f"{a['seconds']} s per run, k=10, one query per request; variants alternated A B B A, {a['rounds']} "
             "round(s); medians over a variant's runs. "
             + "; ".join(f"**{v}**: " + (f"`{' '.join(VARIANTS[v])}`" if VARIANTS[v] else "the defaults")
                         + "".join(f" with `{k}={x}`" for k, x in VARIANT_ENV.get(v, {}).items())
                         for v in res.get("variants", ["before", "after"]))
             + ". Queries: the stream drawn from the report half of the set's queries (bench/harness/runner.py --streams).", "",
             "| set | stream | variant | req/s | p50 ms | p99 ms | page-buffer hit ratio | SSD pages/query | "
             "queries/engine batch | recall@10 | failures |", "|---" * 11 + "|"]
    for key, r in res["results"].items():
        name, stream = key.split(":")
        for v in r:
            s = r[v]
            f = lambda x, nd=2: "–" if x is None else f"{x:.{nd}f}"  # noqa: E731
            lines.append(f"| {name} | {stream} | {v} | {f(s['per_s'], 1)} | {f(s['p50_ms'])} | {f(s['p99_ms'])} | "
                         f"{f(s['hit_ratio'], 3)} | {f(s['ssd_pages_per_query'])} | {f(s['queries_per_batch'], 1)} | "
                         f"{f(s['recall'], 4)} | {s['failures']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="*", default=["glove", "minilm"])
    ap.add_argument("--streams", nargs="*", default=["uniform", "skewed"], choices=["uniform", "skewed", "drifting"])
    ap.add_argument("--queries", type=int, default=2000, help="queries of each stream (known answers)")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=2, help="A B B A blocks per set and stream")
    ap.add_argument("--buffer-fraction", type=int, default=16)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=results("service"))
    ap.add_argument("--tag", default="service_before_after")
    ap.add_argument("--variants", nargs=2, default=["before", "after"], choices=list(VARIANTS), metavar="VARIANT",
                    help=f"the two variants compared, A then B (of {', '.join(VARIANTS)})")
    args = ap.parse_args()
    args.work = args.work.resolve()
    res = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()} {os.cpu_count()}-core VM",
           "load_start": [round(x, 2) for x in os.getloadavg()], "args": {k: str(v) for k, v in vars(args).items()},
           "results": {}, "raw": {}, "variants": args.variants}
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="fusionrag-service-bench-"))
    try:
        for name in args.datasets:
            prepare(args.work, name)
            _, _, _, meta = load(args.work, name)
            buffer_mb = max(1.0, meta["count"] * meta["dim"] * 4 / args.buffer_fraction / 2**20)
            for stream in args.streams:
                data_dir = scratch / f"{name}-{stream}" / "data"
                data_dir.mkdir(parents=True)
                t = time.perf_counter()
                qs_file = build_collection(args.work, name, stream, args.queries, data_dir, 10)
                print(f"{time.strftime('%H:%M:%S')} built {name}:{stream} in {time.perf_counter() - t:.0f} s", flush=True)
                a, b = args.variants
                runs = {a: [], b: []}
                order = [v for _ in range(args.rounds) for v in (a, b, b, a)]
                for i, v in enumerate(order):
                    r = one_run(data_dir, qs_file, scratch / f"{name}-{stream}" / f"run{i}-{v}", VARIANTS[v],
                                buffer_mb, args.users, args.seconds, VARIANT_ENV.get(v))
                    runs[v].append(r)
                    print(f"{time.strftime('%H:%M:%S')} {name}:{stream} {v}: {json.dumps(r)}", flush=True)
                key = f"{name}:{stream}"
                res["raw"][key] = runs
                res["results"][key] = {v: summarize(rs) for v, rs in runs.items()}
                shutil.rmtree(data_dir, ignore_errors=True)
                res["load_end"] = [round(x, 2) for x in os.getloadavg()]
                (args.out / f"{args.tag}.json").write_text(json.dumps(res, indent=1))
                (args.out / f"{args.tag}.md").write_text(markdown(res))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
