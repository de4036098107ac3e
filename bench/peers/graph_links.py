"""The navigation graph's links on clustered centroids: HNSW's heuristic (alpha 1) against DiskANN's relaxed rule
(alpha > 1), with and without the reachability repair (native.Graph(alpha=, repair=)).

For each set of centroids (those of a built index: graph.bin's vectors) and each alpha, a graph is built over the
same centroids with the build's settings (M, ef_construction, seed) without the repair and measured, then repaired
(Graph.repair: the same graph, links added) and measured again, against exact search over the centroids:
- links per node on level 0 (of 2M slots), nodes reachable from the entry point, links the repair added;
- list recall: of the exact k nearest centroids of a row, the share the graph's search returns (k 1 and 32; rows
  are the set's base rows, sampled, and its queries: where build assigns rows and where queries probe);
- µs a search on one thread.
Rows are split in halves: "select" (the first, to choose alpha on) and "report" (the second, the figures to quote).

    python -m bench.peers.graph_links --index synth1m=bench/work/gpu_tier_synthetic_1000000x128 \\
        --index fashion=bench/work/idx-streams/fashion/fusionrag --out bench/results/graph_links
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK, results

from fusionrag import native  # noqa: E402

ALPHAS = [1.0, 1.1, 1.2, 1.5]
EFS = (32, 64, 128)


def level0_degrees(path: str) -> np.ndarray:
    """Links per node on level 0, read from a saved graph (native/graph.cpp's file layout)."""
    raw = np.fromfile(path, np.uint8)
    dim, m, _, _, size = (int(v) for v in raw[16:56].view(np.uint64))
    off = 64 + size + size * dim * 4
    lists = raw[off:off + size * (1 + 2 * m) * 4].view(np.uint32).reshape(size, 1 + 2 * m)
    return lists[:, 0].astype(np.int64)


def rows_of(name: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(base rows sampled, queries) of the set an index was built from."""
    if name.startswith("synth1m"):
        from fusionrag.loadtests.queryset import synthetic_vectors

        x = synthetic_vectors(1_000_000 + 2000, 128)  # bench/gpu/gpu_tier.py's set: its last 2000 rows are queries
        rows = np.random.default_rng(1).choice(1_000_000, count, replace=False)
        return np.ascontiguousarray(x[rows]), np.ascontiguousarray(x[1_000_000:1_000_000 + count])
    from bench.harness import sets

    base, queries, _, meta = sets.load_as_searched(WORK, name)
    rows = np.random.default_rng(1).choice(len(base), count, replace=False)
    return np.ascontiguousarray(base[np.sort(rows)], np.float32), np.ascontiguousarray(queries[:count], np.float32)


def list_recall(g, exact: np.ndarray, rows: np.ndarray, k: int, ef: int) -> float:
    ids, _ = g.search(rows, k, ef, 1)
    return float(np.mean([len(np.intersect1d(a, b)) / k for a, b in zip(ids[:, :k], exact[:, :k])]))


def nodewise(n: int, threads: int) -> np.ndarray:
    """0..n-1 dealt out to `threads` hands in turn, the hands laid end to end: Graph.add gives each thread one
    contiguous block of what it is given, so thread t inserts t, t + threads, ... in order, as when the pool
    handed out one node at a time."""
    return np.concatenate([np.arange(t, n, threads) for t in range(threads)])


class Reordered:
    """A graph built over centroids[perm] (its node i is centroid perm[i]), searched in the centroids' own ids."""

    def __init__(self, g, perm: np.ndarray):
        self.g, self.perm = g, perm

    def search(self, q, k, ef, threads):
        ids, d = self.g.search(q, k, ef, threads)
        return np.where(ids >= 0, self.perm[np.maximum(ids, 0)], -1), d

    def __getattr__(self, name):
        return getattr(self.g, name)


def measure(g, alpha: float, repair: bool, build_s: float, m: int, probe: dict, exact: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        g.save(f"{d}/g")
        deg = level0_degrees(f"{d}/g")
    point = {"alpha": alpha, "repair": repair, "build_s": round(build_s, 2),
             "links_mean": round(float(deg.mean()), 2), "links_max": int(deg.max()), "slots": 2 * m,
             "reachable": round(g.reachable() / g.size, 4), "repaired_links": g.repaired}
    for what, rows in probe.items():
        half = len(rows) // 2
        for label, sl in (("select", slice(0, half)), ("report", slice(half, None))):
            for ef in EFS:
                for k in (1, 32):
                    found = list_recall(g, exact[what][sl], rows[sl], k, ef)
                    point[f"{what}/{label}/ef{ef}/recall{k}"] = round(found, 4)
            q = rows[sl]
            t = time.perf_counter()
            g.search(q, 32, 64, 1)
            point[f"{what}/{label}/us_ef64"] = round((time.perf_counter() - t) / len(q) * 1e6, 1)
    return point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", action="append", required=True, help="NAME=INDEX_DIR (NAME: a bench set, or synth1m "
                    "for bench/gpu/gpu_tier.py's 1M x 128 set)")
    ap.add_argument("--rows", type=int, default=2000, help="base rows and queries per set (split in halves)")
    ap.add_argument("--out", default=str(results("peers") / "graph_links"))
    ap.add_argument("--alphas", type=float, nargs="+", default=ALPHAS)
    ap.add_argument("--orders", nargs="+", default=["built"], choices=["built", "random", "nodewise"],
                    help="the order centroids are inserted in: as the build numbered them (hierarchical k-means "
                    "leaves near ones together), a random permutation of them, or nodewise: the build's order dealt "
                    "out node by node to the threads, as Graph.add did before its threads took a block each (the "
                    "threads insert neighbours at once)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2], help="graph build threads (each a build)")
    ap.add_argument("--repeats", type=int, default=1, help="builds of each order and thread count (a build on "
                    "more than one thread differs from run to run)")
    args = ap.parse_args()
    report = {"machine": f"{os.cpu_count()}-core {platform.machine()}, {platform.processor() or 'cpu'}",
              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg_start": os.getloadavg(),
              "sets": {}}
    for spec in args.index:
        name, path = spec.split("=", 1)
        old = native.Graph.load(str(Path(path) / "graph.bin"))
        centroids = old.vectors()
        raw = np.fromfile(str(Path(path) / "graph.bin"), np.uint8)
        m, efc, seed = (int(v) for v in raw[16:56].view(np.uint64)[1:4])
        base_rows, queries = rows_of(name, args.rows)
        probe = {"rows": base_rows, "queries": queries}
        exact = {k: old.exact_search(v, 32, 2)[0] for k, v in probe.items()}
        points = []
        runs = [(o, t, r) for o in args.orders for t in args.threads
                for r in range(args.repeats if t > 1 or o == "random" else 1)]
        for order, threads, rep in runs:
            n = len(centroids)
            perm = (np.arange(n) if order == "built" or (order == "nodewise" and threads == 1)
                    else np.random.default_rng(seed + rep).permutation(n) if order == "random"
                    else nodewise(n, threads))
            for alpha in args.alphas:
                g = native.Graph(centroids.shape[1], "l2", m, efc, seed, alpha=alpha, repair=False)
                t = time.perf_counter()
                g.add(np.ascontiguousarray(centroids[perm]), threads)
                build_s = time.perf_counter() - t
                for repair in (False, True):  # the same graph, before and after its repair
                    if repair:
                        t = time.perf_counter()
                        g.repair()
                        build_s += time.perf_counter() - t
                    point = {"order": order, "threads": threads, "repeat": rep, **measure(Reordered(g, perm), alpha, repair, build_s, m, probe, exact)}
                    points.append(point)
                    print(name, json.dumps(point), flush=True)
        report["sets"][name] = {"index": path, "centroids": list(centroids.shape), "M": m, "ef_construction": efc,
                                "points": points}
    report["load_avg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report, EFS))


def markdown(r: dict, efs: list[int]) -> str:
    lines = ["# Navigation graph links: HNSW's heuristic against alpha > 1, and the reachability repair", "",
             f"Machine: {r['machine']}; started {r['started']}, load average {r['load_avg_start'][0]:.1f} at the "
             f"start, {r['load_avg_end'][0]:.1f} at the end. Written by `bench/peers/graph_links.py`. Recall k: of a row's "
             "exact k nearest centroids, the share the graph's search (beam ef) returns; rows: base rows (where a "
             "build assigns them) and queries (what they probe). Halves: select / report.", ""]
    for name, s in r["sets"].items():
        lines += [f"## {name}: {s['centroids'][0]:,} centroids x {s['centroids'][1]} (M {s['M']}, ef_construction "
                  f"{s['ef_construction']})", "",
                  "| order | threads | alpha | repair | build s | links/node (of slots) | reachable | repaired | " +
                  " | ".join(f"{w} ef{ef} r@{k} (sel / rep)" for w in ("rows", "queries") for ef in efs
                             for k in (1, 32)) + " | µs/query ef64, queries (sel / rep) |",
                  "|---|" + "---:|" * (7 + 2 * len(efs) * 2 + 1)]
        for p in s["points"]:
            cells = [f"{p[f'{w}/select/ef{ef}/recall{k}']:.3f} / {p[f'{w}/report/ef{ef}/recall{k}']:.3f}"
                     for w in ("rows", "queries") for ef in efs for k in (1, 32)]
            lines.append(f"| {p.get('order', 'built')} | {p.get('threads', 2)} | {p['alpha']} | {'yes' if p['repair'] else 'no'} | {p['build_s']} | {p['links_mean']} "
                         f"({p['slots']}) | {p['reachable']:.4f} | {p['repaired_links']} | " + " | ".join(cells) +
                         f" | {p['queries/select/us_ef64']} / {p['queries/report/us_ef64']} |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
