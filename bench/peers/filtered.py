"""A filtered search through the index: the lists probed widened by the share a filter passes, against the same
lists an unfiltered search probes.

    python -m bench.peers.filtered SET [--index DIR] [--threads T] [--queries N] [--raw-in-ram auto|on|off]

Index.search with an exclude bitmap widens nprobe and the ratio rule's floor by 1 / the share of the vectors it
lets through (config.probe_widening); `passing=1.0` searches the lists an unfiltered search probes (what every
search did before). Filters: a random share of the vectors (0.5, 0.1, 0.03), and the vectors beyond a random
half-space's quantile (0.1, 0.03: passing vectors lie together, away from some queries). Queries: N of the set's
report half (the second; nothing here is chosen on either half). Recall@10 against brute force over the vectors
that pass; QPS of one call of all N; a one-query call's mean time over N calls; lists and SSD pages a query.
Results: bench/results/peers/filtered_SET.md and .json. Indexes: bench/work/idx/SET/fusionrag by default (the
runner's), else built at the default BuildConfig into bench/work/filtered/SET.
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

from bench.harness.paths import WORK, results
from bench.harness.sets import load_as_searched, prepare

import fusionrag.retriever as fr  # noqa: E402
from fusionrag.retriever.engine.calibrate import recall_at  # noqa: E402

SHARES = (0.5, 0.1, 0.03)
SPACE_SHARES = (0.1, 0.03)


def filters(x: np.ndarray, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """(label, bool mask of the vectors that pass) for each filter studied."""
    rng = np.random.default_rng(seed)
    out = [(f"random {s:g}", rng.random(len(x)) < s) for s in SHARES]
    for s in SPACE_SHARES:
        proj = x @ rng.standard_normal(x.shape[1]).astype(np.float32)
        out.append((f"half-space {s:g}", proj > np.quantile(proj, 1 - s)))
    return out


def exact_knn(x: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """Brute-force squared-L2 top-k rows of x (unit rows for cosine sets) for each query, in numpy."""
    norms = (x * x).sum(1)
    out = []
    for s in range(0, len(q), 64):
        d = norms[None, :] - 2 * (q[s:s + 64] @ x.T)
        top = np.argpartition(d, k, axis=1)[:, :k]
        out.append(np.take_along_axis(top, np.argsort(np.take_along_axis(d, top, 1), 1), 1))
    return np.vstack(out)


def measure(index, q: np.ndarray, truth: np.ndarray, exclude, passing) -> dict:
    kw = {} if passing is None else {"passing": passing}
    index.search(q, 10, exclude=exclude, **kw)  # warm: each row measured as the second pass over the same queries
    t = time.perf_counter()
    res = index.search(q, 10, exclude=exclude, **kw)
    batch_s = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(len(q)):
        index.search(q[i:i + 1], 10, exclude=exclude, **kw)
    one_s = (time.perf_counter() - t) / len(q)
    return {"recall": round(recall_at(res.ids, truth), 4), "qps": round(len(q) / batch_s, 1),
            "one_query_ms": round(one_s * 1e3, 3), "lists": round(float(res.stats["lists_probed"].mean()), 1),
            "pages_read": round(float(res.stats["pages_read"].mean()), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("set")
    ap.add_argument("--index", type=Path, help="an index of SET (default: the runner's, else one built here)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--raw-in-ram", default="auto", choices=("auto", "on", "off"))
    args = ap.parse_args()
    work = WORK.resolve()
    prepare(work, args.set)
    x, queries, _, meta = load_as_searched(work, args.set)
    out = args.index or work / "idx" / args.set / "fusionrag"
    if not (out / "manifest.json").exists():
        out = work / "filtered" / args.set
        if not (out / "manifest.json").exists():
            fr.Index.build(work / "data" / args.set / "base.fbin", out, fr.BuildConfig(metric=meta["metric"]),
                           progress=False)
    q = np.ascontiguousarray(queries[len(queries) // 2:][:args.queries], dtype=np.float32)
    qs = q / np.linalg.norm(q, axis=1, keepdims=True) if meta["metric"] == "cosine" else q
    index = fr.Index.open(out, fr.EngineConfig(threads=args.threads, raw_in_ram=args.raw_in_ram))
    rows = []
    try:
        truth = exact_knn(x, qs, 10)
        rows.append({"filter": "none", "share": 1.0, "probe": "unfiltered"} | measure(index, q, truth, None, None))
        print(rows[-1], flush=True)
        for label, ok in filters(x):
            sub = np.flatnonzero(ok)
            truth = sub[exact_knn(x[sub], qs, 10)]
            exclude = np.packbits(~ok, bitorder="little")
            for how, passing in (("unfiltered's", 1.0), ("widened", None)):
                rows.append({"filter": label, "share": round(float(ok.mean()), 4), "probe": how}
                            | measure(index, q, truth, exclude, passing))
                print(rows[-1], flush=True)
        where = index.memory()["raw_vectors_bytes"] > 0
        params = index.params.to_dict() if hasattr(index.params, "to_dict") else str(index.params)
    finally:
        index.close()
    result = {"set": args.set, "count": int(len(x)), "dim": int(x.shape[1]), "metric": meta["metric"],
              "queries": len(q), "threads": args.threads, "raw_in_ram": bool(where), "params": params, "rows": rows,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load": os.getloadavg()[0]}
    res_dir = results("peers")
    (res_dir / f"filtered_{args.set}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Filtered search: {args.set} ({len(x):,} x {x.shape[1]}, {meta['metric']})", "",
             f"`python -m bench.peers.filtered {' '.join(sys.argv[1:])}`; {result['machine']}, {args.threads} "
             f"thread(s), load average {result['load']:.1f} when it ended; raw vectors "
             f"{'in RAM' if where else 'on the SSD'}; the index's defaults {params}. {len(q)} queries of the report "
             "half. 'unfiltered's': the lists an unfiltered search probes (passing=1.0, every search before "
             "the widening); 'widened': nprobe and the ratio rule's floor over the share passing.", "",
             "| filter | share passing | lists probed | recall@10 | QPS (one call) | ms a one-query call | lists/q "
             "| SSD pages/q |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['filter']} | {r['share']} | {r['probe']} | {r['recall']} | {r['qps']} | {r['one_query_ms']} "
              f"| {r['lists']} | {r['pages_read']} |" for r in rows]
    (res_dir / f"filtered_{args.set}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
