"""Recall and cost at coarser posting lists (#51 item 5): the billion-vector plan of docs/sharded.md sizes its router
graph at lists of ~10 vectors (centroid ratio 0.1, the default); a ratio of 0.01-0.05 makes a router a tenth to a
half the size. Here, on a bench/peers/scale_table.py set (by default its largest built), the same build and search
as its rows, in the same cgroup cap, at centroid ratios 0.01, 0.02 and 0.05 beside the default's row: host bytes a
vector (the graph and the lists: what a router holds), build seconds and peak memory, and recall@10 / q/s / pages
per query at the defaults calibration chose and at the fastest points reaching 0.90 and 0.95 (chosen on the tune
half, reported on the other), as scale_table measures them.

    python -m bench.peers.coarse_lists [--n 3000000] [--ratios 0.01 0.02 0.05]

Writes bench/results/peers/coarse_lists.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench.harness.paths import WORK, results
from bench.peers.scale_table import build, search, tier_bytes, work

OUT = results("peers")


def largest(dim: int) -> int:
    built = [int(d.name.split("x")[0]) for d in (WORK / "scale").glob(f"*x{dim}") if (d / "search.json").exists()]
    if not built:
        raise SystemExit("no scale_table row is built yet (python -m bench.peers.scale_table)")
    return max(built)


def at_ratio(n: int, dim: int, ratio: float, cap: int) -> dict:
    """The set's build and search at this centroid ratio, in a directory of its own beside the set's files."""
    src = work(n, dim)
    d = src / f"ratio-{ratio:g}"
    d.mkdir(exist_ok=True)
    for name in ("base.npy", "queries.npy", "truth.npy"):
        if not (d / name).exists():
            os.symlink(src / name, d / name)
    b = build(d, n, dim, cap, ("--centroid-ratio", str(ratio)))
    s = search(d, cap)
    return {"ratio": ratio, "build": b, "tiers": tier_bytes(d / "index", n), "search": s}


def row(ratio, b, t, s) -> str:
    fmt = lambda m: "-" if not m else f"{m['recall@10']:.3f} / {m['qps']:,.0f} / {m['pages_per_query']:.1f}"  # noqa: E731
    dp = s.get("defaults_params", {})
    lists = t["host_files"]
    return (f"| {ratio:g} | {lists['graph.bin'] / b['n']:.1f} | {t['host_per_vector']:.1f} | {b['build_s']:,.0f} | "
            f"{b['peak_anon_bytes_last_run'] >> 20:,} | {dp.get('nprobe', '-')}, {dp.get('rerank', '-')} | "
            f"{fmt(s.get('defaults'))} | {fmt(s.get('at_0.90'))} | {fmt(s.get('at_0.95'))} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=0, help="a scale_table N (default: the largest searched)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.02, 0.05])
    p.add_argument("--cap-share", type=float, default=1 / 3)
    p.add_argument("--floor-mib", type=int, default=256)
    args = p.parse_args()
    n = args.n or largest(args.dim)
    cap = max(int(n * args.dim * 4 * args.cap_share), args.floor_mib << 20)
    d = work(n, args.dim)
    default = {"ratio": 0.1, "build": json.loads((d / "build.json").read_text()), "tiers": tier_bytes(d / "index", n),
               "search": json.loads((d / "search.json").read_text())}
    runs = [at_ratio(n, args.dim, r, cap) for r in args.ratios] + [default]
    lines = [f"# Coarser posting lists on {n:,} x {args.dim} ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m bench.peers.coarse_lists` on this machine ({os.cpu_count()} CPUs): the set of "
             "[scale_table](scale_table.md) at this N, each build and search alone in its cgroup cap "
             f"({cap >> 20} MiB), at the defaults but the centroid ratio (0.1 is the default's row of the table). "
             "Graph B/vec: the navigation graph a router holds, per vector; host B/vec: graph, list ids and slot map. "
             "recall@10 / q/s / pages per query on the 500 report queries; 0.90 and 0.95 at the fastest grid point "
             "reaching them on the other 500.", "",
             "| centroid ratio | graph B/vec | host B/vec | build s | build peak anon MiB | defaults (nprobe, rerank) | "
             "at defaults | at 0.90 | at 0.95 |", "|---:|---:|---:|---:|---:|---|---|---|---|"]
    runs.sort(key=lambda r: r["ratio"])
    lines += [row(r["ratio"], r["build"], r["tiers"], r["search"]) for r in runs]
    load = lambda b: f"{b['load_at_start'][0]:.1f}-{b['load_at_end'][0]:.1f}"  # noqa: E731
    lines += ["", "Machine load (1-minute average) at each build's start and end: " + ", ".join(
        f"{r['ratio']:g}: {load(r['build'])}" for r in runs) + "."]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "coarse_lists.md").write_text("\n".join(lines) + "\n")
    (OUT / "coarse_lists.json").write_text(json.dumps(runs, indent=1, default=str))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
