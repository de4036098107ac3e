"""Why recall stops short of 0.95 at the largest N of scale_table (#51 item 4): the list sizes of each built index,
recall and cost at wider probe ratios (SearchParams.probe_ratio) at the widest probe the calibration tried, and how
often the navigation graph's search lands far from a row's or a query's nearest centroid.

    python -m bench.peers.scale_lists --n 10000000 20000000 [--dim 128]   (needs scale_table's rows for N)

For each N: the posting lists' sizes (mean, percentiles, how many hold over 1,000 postings and how many postings
they hold); then, in the cap scale_table searches in (a third of the raw vectors), the index's files dropped from
the page cache first, one process: 300 noisy base rows to warm, then the 500 report queries at nprobe 1024 and
each (probe ratio, rerank) of POINTS: recall@10, q/s (2 threads), lists probed, PQ candidates scanned and pages read
per query. Then navigation: 2,000 base rows and the 500 report queries searched on the index's graph at the beam the
build assigns rows with (max(32, 2 x max_replicas)) and at wider beams, against their exact nearest centroid (all
centroids, brute force): "lost" where the graph's nearest is over 1.5x the exact nearest's distance (in these
clusters, a centroid of another cluster). Writes bench/results/peers/scale_lists.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.cgroups import drop_cache
from bench.harness.paths import module_argv, results
from bench.peers.scale_table import in_cgroup, work

OUT = results("peers")
NPROBE = 1024
POINTS = [(1.0, 2400), (2.0, 2400), (2.25, 1600), (2.5, 1600), (2.5, 2400), (3.0, 2400)]  # (probe_ratio, rerank)


def list_sizes(d: Path) -> dict:
    sizes = np.diff(np.load(d / "index" / "list_offsets.npy", mmap_mode="r"))
    big = sizes > 1000
    return {"lists": int(len(sizes)), "mean": float(sizes.mean()),
            "p50_p90_p99_p999": [float(x) for x in np.percentile(sizes, [50, 90, 99, 99.9])], "max": int(sizes.max()),
            "over_1000": int(big.sum()), "postings_in_those": int(sizes[big].sum()), "postings": int(sizes.sum())}


def worker(d: Path) -> None:
    from fusionrag.retriever.engine.config import SearchParams
    from fusionrag.retriever.engine.index import Index

    q, truth = np.load(d / "queries.npy")[500:], np.load(d / "truth.npy")[500:]
    idx = Index.open(d / "index")
    threads = min(2, os.cpu_count() or 1)
    rng = np.random.default_rng(1)
    base = np.load(d / "base.npy", mmap_mode="r")
    idx.search(base[rng.integers(0, len(base), 300)] + 0.01, 10)  # warm
    out = []
    for ratio, rerank in POINTS:
        beta = {1600: 24, 2400: 32}[rerank]
        t = time.perf_counter()
        r = idx.search(q, 10, SearchParams(nprobe=NPROBE, probe_ratio=ratio, rerank=rerank, beta=beta))
        dt = time.perf_counter() - t
        hit = np.mean([len(set(a) & set(b[:10])) / 10 for a, b in zip(r.ids.tolist(), truth.tolist())])
        out.append({"probe_ratio": ratio, "rerank": rerank, "beta": beta, "recall@10": float(hit),
                    "qps": len(q) / dt, "threads": threads,
                    **{k: float(np.mean(r.stats[k])) for k in ("lists_probed", "candidates", "pages_read")}})
    nav = navigation(idx, base, q, rng)
    idx.close()
    print(json.dumps({"points": out, "navigation": nav}))


BEAMS = (32, 64, 256, 1024)


def navigation(idx, base, q: np.ndarray, rng) -> list[dict]:
    from fusionrag.retriever.engine.build import nearest_rows

    graph = idx.nav.graph  # the index's own (a second copy would not fit the cap at 20M)
    centroids = np.asarray(graph.vectors(), np.float32)
    rows = np.asarray(base[np.sort(rng.choice(len(base), 2000, replace=False))], np.float32)
    out = []
    for what, x in (("rows", rows), ("queries", q)):
        near, sqd = nearest_rows(x, centroids, 1)
        for beam in BEAMS:
            got, gsq = graph.search(x, 8, beam, min(2, os.cpu_count() or 1))
            lost = np.sqrt(np.maximum(gsq[:, 0], 0)) > 1.5 * np.sqrt(np.maximum(sqd[:, 0], 0))
            out.append({"of": what, "beam": beam, "lost": float(lost.mean()),
                        "nearest_found": float((got[:, 0] == near[:, 0]).mean())})
    return out


def run_n(n: int, dim: int) -> dict:
    d = work(n, dim)
    if not (d / "search.json").exists():
        raise SystemExit(f"{d}: no scale_table row for {n:,}")
    cap = max(int(n * dim * 4 / 3), 256 << 20)
    drop_cache(d / "index")
    load0 = os.getloadavg()
    r, run = in_cgroup(cap, module_argv(__spec__.name, "--worker", str(d)), d / "scale_lists_failed.log", "search")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return {"n": n, "cap_bytes": cap, "lists": list_sizes(d), "points": got["points"], "navigation": got["navigation"],
            "defaults": json.loads((d / "index" / "manifest.json").read_text()).get("search_defaults"),
            "peak_anon_bytes": run["peak_anon_bytes"], "load_at_start": load0, "load_at_end": os.getloadavg()}


def report(records: list[dict]) -> None:
    lines = [f"# List sizes and wider probe ratios at scale_table's largest N ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m bench.peers.scale_lists` on this machine ({os.cpu_count()} CPUs, no swap), the indexes "
             "[scale_table](scale_table.md) built (clustered synthetic, 4,000 Gaussian centres, sd 0.3), searched "
             f"in the same cap (a third of the raw vectors) at nprobe {NPROBE}, 500 report queries, 2 threads.", "",
             "| N | lists | postings a list: mean / p50 / p99 / max | lists over 1,000 postings (their postings) |",
             "|---:|---:|---|---|"]
    for r in records:
        s = r["lists"]
        lines.append(f"| {r['n']:,} | {s['lists']:,} | {s['mean']:.1f} / {s['p50_p90_p99_p999'][0]:.0f} / "
                     f"{s['p50_p90_p99_p999'][2]:.0f} / {s['max']:,} | {s['over_1000']:,} "
                     f"({s['postings_in_those'] / s['postings']:.0%} of all postings) |")
    lines += ["", "Machine load (1-minute average) at each N's start and end: " + ", ".join(
        f"{r['n']:,}: {r['load_at_start'][0]:.1f}-{r['load_at_end'][0]:.1f}" for r in records) + ".", ""]
    lines += ["| N | probe ratio | rerank | recall@10 | q/s | lists probed | PQ candidates | pages read |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        for p in r["points"]:
            lines.append(f"| {r['n']:,} | {p['probe_ratio']} | {p['rerank']} | {p['recall@10']:.3f} | {p['qps']:,.0f} | "
                         f"{p['lists_probed']:.0f} | {p['candidates']:,.0f} | {p['pages_read']:.0f} |")
    lines += ["", "Navigation: the share of rows (2,000 sampled) and report queries whose graph search at each beam lands over "
              "1.5x farther than their exact nearest centroid (lost), and the share whose nearest it finds; the build "
              "assigns rows at beam 32, a query searches at its nprobe (calibrated: 64 at 1M, 512-1,024 at 10M-20M).", "",
              "| N | of | " + " | ".join(f"beam {b}: lost / nearest" for b in BEAMS) + " |",
              "|---:|---|" + "---|" * len(BEAMS)]
    for r in records:
        for what in ("rows", "queries"):
            cells = {e["beam"]: e for e in r["navigation"] if e["of"] == what}
            lines.append(f"| {r['n']:,} | {what} | " + " | ".join(
                f"{cells[b]['lost']:.1%} / {cells[b]['nearest_found']:.3f}" for b in BEAMS) + " |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale_lists.md").write_text("\n".join(lines) + "\n")
    (OUT / "scale_lists.json").write_text(json.dumps(records, indent=1))
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="*", default=[1_000_000, 10_000_000, 20_000_000])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    report([run_n(n, args.dim) for n in args.n])


if __name__ == "__main__":
    sys.exit(main())
