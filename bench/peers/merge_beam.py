"""Where a merge's new rows start their search for lists, and at what beam (#51): a merge's new rows have no leaf of
the build's clustering to start from (build.assign_rows starts a row there); from the graph's entry point a narrow
beam leaves rows in another cluster of the data (bench/peers/scale_lists). merge._nearest starts each at the
nearest of a sample of the centroids (merge._entry_sample) instead. Here, on a bench/peers/scale_table index (by
default 3M x 128, in the cap it searches in: a third of the raw vectors), one process:

- new rows drawn as the set's rows are (the same 4,000 centres, sd 0.3, another seed), assigned to their lists
  by merge._nearest from the graph's entry point and from the sampled entries, at each beam of BEAMS: seconds per
  10,000 rows (2 threads), the share whose first list is their exact nearest centroid (brute force over every
  centroid as the merge reads them, full float32) and the share "lost" (the list found over 1.5x the nearest's
  distance, as scale_lists counts it);
- one whole incremental merge of those rows (and as many deletions) as a merge runs it, timed, so the
  assignment's share of a merge is seen; the merged generation is written beside the index and removed after.

    python -m bench.peers.merge_beam [--n 3000000] [--rows 20000]

Writes bench/results/peers/merge_beam.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.cgroups import drop_cache
from bench.harness.paths import module_argv, results
from bench.peers.scale_table import SD, centres, in_cgroup, work

OUT = results("peers")
BEAMS = (64, 128, 256, 512)  # 64: the least _nearest searches at (twice its 32 candidates), the beam before


def worker(d: Path, rows: int) -> None:
    from fusionrag.retriever.engine import merge
    from fusionrag.retriever.engine.config import BuildConfig
    from fusionrag.retriever.engine.index import Index

    idx = Index.open(d / "index")
    if idx.nav.exhaustive:
        raise SystemExit(f"{d}: this index finds its lists exactly, not by the graph: no beam to measure")
    dim = idx.dim
    c = centres(dim)
    rng = np.random.default_rng(23)
    x = (c[rng.integers(0, len(c), rows)] + SD * rng.standard_normal((rows, dim), dtype=np.float32)).astype(np.float32)
    threads = min(2, os.cpu_count() or 1)
    config = BuildConfig()
    kk = min(config.max_replicas, idx.nav.graph.size)
    cents = merge._Centroids(d / "index" / "graph.bin", dim)
    exact, exact_sq = merge._nearest_every(x, cents, 1)  # every centroid as the merge reads them
    out = {"rows": rows, "threads": threads, "max_replicas": kk, "centroids": int(len(cents)), "beams": [],
           "entry_sample": int(len(merge._entry_sample(cents)[0])), "merge_beam": merge._MERGE_BEAM}
    default = merge._MERGE_BEAM
    merge._nearest(x[:1000], cents, idx.nav.graph, idx.metric, kk, threads, False)  # warm: the graph's pages read
    for start in ("entry point", "sampled"):
        for beam in BEAMS:
            merge._MERGE_BEAM = beam
            t = time.perf_counter()
            entry = merge._entry_sample(cents) if start == "sampled" else None
            near, sqd = merge._nearest(x, cents, idx.nav.graph, idx.metric, kk, threads, False, entry)
            dt = time.perf_counter() - t
            lost = np.sqrt(np.maximum(sqd[:, 0], 0)) > 1.5 * np.sqrt(np.maximum(exact_sq[:, 0], 0))
            out["beams"].append({"start": start, "beam": beam, "s_per_10k": dt * 10_000 / rows,
                                 "nearest_found": float((near[:, 0] == exact[:, 0]).mean()),
                                 "lost": float(lost.mean())})
    merge._MERGE_BEAM = default
    dead = np.zeros(idx.count, bool)
    dead[rng.choice(idx.count, rows, replace=False)] = True
    target = d / "merge_beam_gen"
    shutil.rmtree(target, ignore_errors=True)
    try:
        t = time.perf_counter()
        stats = merge.merge_index(idx, dead, x, target, config, progress=False)
        out["merge"] = {"beam": default, "seconds": time.perf_counter() - t, "stats": stats.__dict__}
    finally:
        idx.close()
        shutil.rmtree(target, ignore_errors=True)
    print(json.dumps(out))


def report(r: dict) -> str:
    m = r["merge"]
    at = {(b["start"], b["beam"]): b for b in r["beams"]}
    assign = at[("sampled", m["beam"])]["s_per_10k"] * r["rows"] / 10_000
    lines = [f"# Where a merge's new rows start their search for lists ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m bench.peers.merge_beam --n {r['n']} --rows {r['rows']}` on this machine "
             f"({os.cpu_count()} CPUs, load {r['load_at_start'][0]:.1f} at the start, {r['load_at_end'][0]:.1f} at the "
             f"end): the [scale_table](scale_table.md) index of {r['n']:,} x {r['dim']} ({r['centroids']:,} lists), in "
             f"its search cap ({r['cap_bytes'] >> 20} MiB), {r['rows']:,} new rows of the same distribution assigned "
             f"to their lists as a merge assigns them (`merge._nearest`, {r['max_replicas']} nearest, {r['threads']} "
             "threads), their graph search started at its entry point or at the nearest of "
             f"{r['entry_sample']:,} centroids sampled evenly (`merge._entry_sample`, the time to find it included), "
             "at each beam; lost: the first list found over 1.5x the exact nearest centroid's distance.", "",
             "| start | beam | seconds per 10,000 rows | first list = exact nearest | lost |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {b['start']} | {b['beam']} | {b['s_per_10k']:.2f} | {b['nearest_found']:.3f} | {b['lost']:.2%} |"
              for b in r["beams"]]
    lines += ["", f"A whole merge of those {r['rows']:,} rows and {m['stats']['removed']:,} deletions as a merge runs "
              f"(sampled entries, beam {m['beam']}) took {m['seconds']:.1f} s ({m['stats']['splits']} splits, "
              f"{m['stats']['splits_deferred']} deferred in the cap, holding {m['stats'].get('unsplit_postings', 0):,} "
              f"postings); assigning its rows, {assign:.1f} s of it ({assign / m['seconds']:.0%}). Peak anonymous "
              f"memory of the process {r['peak_anon_bytes'] >> 20} MiB, OOM kills {r['oom_kills']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=3_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.rows)
    d = work(args.n, args.dim)
    if not (d / "index" / "manifest.json").exists():
        raise SystemExit(f"{d}: no scale_table index for {args.n:,} (python -m bench.peers.scale_table --n {args.n})")
    cap = max(int(args.n * args.dim * 4 / 3), 256 << 20)
    drop_cache(d / "index")
    load0 = os.getloadavg()
    r, run = in_cgroup(cap, module_argv(__spec__.name, "--worker", str(d), "--rows", str(args.rows)),
                       d / "merge_beam_failed.log", "merge_beam")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    got.update(n=args.n, dim=args.dim, cap_bytes=cap, load_at_start=load0, load_at_end=os.getloadavg(),
               peak_anon_bytes=run["peak_anon_bytes"], oom_kills=run["oom_kills"])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "merge_beam.json").write_text(json.dumps(got, indent=1))
    text = report(got)
    (OUT / "merge_beam.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
