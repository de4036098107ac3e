"""The service on one box at 1, 8 and 64 concurrent users: `--filter-tier auto` (on a GPU box, each call to the tier
measured cheaper for its size, micro-batches held open for the GPU under load) against `--filter-tier cpu` (the same
box's CPUs alone), over the same collection, in the same run (#47: a GPU box at or above its CPU tier at every
level).

One collection is made once (synthetic clustered vectors, or --base), then for each tier a service is started on
it, warmed, and driven by Locust's closed-loop vector users at each level for --seconds; requests per second,
latency, recall and which filter tier served the queries (the service's own counter) are kept per level. The
verdict: at every level, auto's requests per second over cpu's (at least --min-ratio).

    python -m fusionrag.loadtests.levels --out levels/ [--count 1000000] [--users 1 8 64] [--seconds 20] \\
        [--server-arg=--gpu-budget-mb=8192]

Without a GPU, auto is the CPU tier: the two services are the same, and the run checks only that the study runs
(tests/loadtests/test_loadtest_levels.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from fusionrag.loadtests import runner
from fusionrag.loadtests.colocate import retrieval_phase

TIERS = ("auto", "cpu")


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="fusionrag-levels-"))
    prep_args = argparse.Namespace(base=args.base, count=args.count, dim=args.dim, queries=None,
                                   num_queries=args.num_queries, metric="l2", k=args.k, texts=None,
                                   rag_route="separate")
    levels: dict[str, dict[str, dict]] = {}
    try:
        vector_qs, _, prep = runner.prepare(prep_args, data_dir, {"vector": 1})
        for tier in TIERS:
            tier_out = out / tier
            tier_out.mkdir(parents=True, exist_ok=True)
            service, url = runner.start_service(data_dir, tier_out, [f"--filter-tier={tier}", *args.server_arg])
            try:
                service.wait_http(url + "/readyz", args.start_timeout)
                if args.warmup_seconds:  # pages cached, the tier choice measured at the sizes load makes
                    warm = argparse.Namespace(**{**vars(args), "users": max(args.users),
                                                 "seconds": args.warmup_seconds})
                    retrieval_phase(warm, url, vector_qs, tier_out, "warmup")
                levels[tier] = {}
                for users in args.users:
                    phase = argparse.Namespace(**{**vars(args), "users": users})
                    r = retrieval_phase(phase, url, vector_qs, tier_out, f"{users}-users")
                    m = r["service_metrics"]
                    levels[tier][str(users)] = {
                        "requests": r["requests"], "failures": r["failures"], "per_s": r["per_s"],
                        "latency_ms": r["latency_ms"], "recall": r["recall"],
                        "queries_by_filter_tier": m.get("queries_by_filter_tier"),
                        "queries_per_batch": m.get("queries_per_batch")}
                    print(json.dumps({"tier": tier, "users": users, **levels[tier][str(users)]}), flush=True)
            finally:
                service.stop()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    ratios = {u: (levels["auto"][u]["per_s"] / levels["cpu"][u]["per_s"]) if levels["cpu"][u]["per_s"] else None
              for u in levels["cpu"]}
    worst = min((r for r in ratios.values() if r is not None), default=None)
    failures = sum(x["failures"] for t in levels.values() for x in t.values())
    report = {"device": "cuda" if _cuda() else "cpu", "levels": levels, "auto_over_cpu": ratios,
              "auto_over_cpu_worst": worst, "min_ratio": args.min_ratio, "failures": failures,
              "passed": worst is not None and worst >= args.min_ratio and failures == 0,
              "collection": prep.get("vectors"), "seconds_per_level": args.seconds, "machine": runner.machine()}
    (out / "levels.json").write_text(json.dumps(report, indent=1))
    (out / "levels.md").write_text(markdown(report))
    return report


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def markdown(r: dict) -> str:
    lines = [f"# The service at {', '.join(r['levels']['cpu'])} users: filter_tier auto against cpu ({r['device']})", "",
             f"Collection: {r['collection']}; {r['seconds_per_level']} s a level. Verdict: "
             f"{'passed' if r['passed'] else 'NOT passed'} (auto over cpu at worst {r['auto_over_cpu_worst']}, "
             f"wanted >= {r['min_ratio']}; {r['failures']} failed requests).", "",
             "| users | auto req/s | auto p50 / p99 ms | auto served by | cpu req/s | cpu p50 / p99 ms | auto / cpu |",
             "|---|---|---|---|---|---|---|"]
    for u, c in r["levels"]["cpu"].items():
        a = r["levels"]["auto"][u]
        ratio = r["auto_over_cpu"][u]
        lines.append(f"| {u} | {a['per_s']:.1f} | {a['latency_ms'].get('p50')} / {a['latency_ms'].get('p99')} | "
                     f"{a['queries_by_filter_tier']} | {c['per_s']:.1f} | {c['latency_ms'].get('p50')} / "
                     f"{c['latency_ms'].get('p99')} | {'-' if ratio is None else f'{ratio:.2f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--users", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--seconds", type=float, default=20.0, help="length of each level")
    p.add_argument("--warmup-seconds", type=float, default=5.0)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--min-recall", type=float, default=0.5)
    p.add_argument("--base", help="vector file for the collection (default: synthetic clustered)")
    p.add_argument("--count", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--num-queries", type=int, default=500)
    p.add_argument("--server-arg", action="append", default=[], help="an argument for fusionrag serve")
    p.add_argument("--min-ratio", type=float, default=1.0, help="auto's requests/s over cpu's wanted at every level")
    p.add_argument("--start-timeout", type=float, default=600.0)
    report = run(p.parse_args(argv))
    print(json.dumps({k: report[k] for k in ("passed", "auto_over_cpu", "failures")}))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
