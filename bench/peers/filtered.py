"""A filtered search through the index: the lists probed widened by the share a filter passes, against the same
lists an unfiltered search probes.

    python -m bench.peers.filtered SET [--index DIR] [--threads T] [--queries N] [--raw-in-ram auto|on|off]

Index.search with an exclude bitmap widens nprobe and the ratio rule's floor by 1 / the share of the vectors it
lets through (config.probe_widening); `passing=1.0` searches the lists an unfiltered search probes (what every
search did before). Filters: a random share of the vectors (0.5, 0.1, 0.03), and the vectors beyond a random
half-space's quantile (0.1, 0.03: passing vectors lie together, away from some queries). Queries: N of the set's
report half (the second; nothing here is chosen on either half). Recall@10 against brute force over the vectors
that pass; QPS of one call of all N; a one-query call's mean time over N calls; lists and SSD pages a query.
Beside it, hnswlib 0.8.0 (M 16, ef_construction 100, as the runner builds it) searched with the same filters
(knn_query's filter: a Python callable asked of each vector the search meets), at the smallest ef whose unfiltered
recall@10 on N queries of the select half reaches fusionrag's there (ef tried: 16 to 1024). Its times include the
callable's calls into Python, which a filter in C++ would not pay. --no-hnswlib leaves it out.
Results: bench/results/peers/filtered_SET.md and .json. Indexes: bench/work/idx/SET/fusionrag by default (the
runner's), else built at the default BuildConfig into bench/work/filtered/SET; hnswlib's in bench/work/filtered.
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
from bench.harness.sets import exact_knn, load_as_searched, prepare

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


def hnsw_index(x: np.ndarray, path: Path):
    """hnswlib over x (unit rows for cosine: searched by l2, the same order), built once and kept at path."""
    import hnswlib

    index = hnswlib.Index(space="l2", dim=x.shape[1])
    if path.exists():
        index.load_index(str(path), max_elements=len(x))
    else:
        index.init_index(max_elements=len(x), ef_construction=100, M=16)
        index.add_items(x, np.arange(len(x)), num_threads=os.cpu_count())
        path.parent.mkdir(parents=True, exist_ok=True)
        index.save_index(str(path))
    index.set_num_threads(1)
    return index


def hnsw_measure(index, q: np.ndarray, truth: np.ndarray, ok: np.ndarray | None) -> dict:
    flt = None if ok is None else (lambda i: bool(ok[i]))
    index.knn_query(q, 10, filter=flt)
    t = time.perf_counter()
    ids, _ = index.knn_query(q, 10, filter=flt)
    batch_s = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(len(q)):
        index.knn_query(q[i:i + 1], 10, filter=flt)
    one_s = (time.perf_counter() - t) / len(q)
    return {"recall": round(recall_at(ids.astype(np.int64), truth), 4), "qps": round(len(q) / batch_s, 1),
            "one_query_ms": round(one_s * 1e3, 3), "lists": "", "pages_read": ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("set")
    ap.add_argument("--index", type=Path, help="an index of SET (default: the runner's, else one built here)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--raw-in-ram", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--no-hnswlib", action="store_true", help="leave the peer out")
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
    half = len(queries) // 2
    unit = (lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)) if meta["metric"] == "cosine" else (lambda a: a)
    q = np.ascontiguousarray(queries[half:][:args.queries], dtype=np.float32)
    sel = np.ascontiguousarray(queries[:half][:args.queries], dtype=np.float32)
    qs = unit(q)
    index = fr.Index.open(out, fr.EngineConfig(threads=args.threads, raw_in_ram=args.raw_in_ram))
    rows = []
    try:
        truth = exact_knn(x, qs, 10)
        rows.append({"filter": "none", "share": 1.0, "probe": "unfiltered"} | measure(index, q, truth, None, None))
        print(rows[-1], flush=True)
        hnsw, ef = None, None
        if not args.no_hnswlib:  # ef: the smallest reaching fusionrag's unfiltered recall on the select half
            hnsw = hnsw_index(x, work / "filtered" / f"{args.set}.hnsw")
            sel_truth = exact_knn(x, unit(sel), 10)
            ours = recall_at(index.search(sel, 10).ids, sel_truth)
            for ef in (16, 32, 64, 128, 256, 512, 1024):
                hnsw.set_ef(ef)
                if recall_at(hnsw.knn_query(unit(sel), 10)[0].astype(np.int64), sel_truth) >= ours:
                    break
            rows.append({"filter": "none", "share": 1.0, "probe": f"hnswlib ef {ef}"}
                        | hnsw_measure(hnsw, qs, truth, None))
            print(rows[-1], flush=True)
        for label, ok in filters(x):
            sub = np.flatnonzero(ok)
            truth = sub[exact_knn(x[sub], qs, 10)]
            exclude = np.packbits(~ok, bitorder="little")
            for how, passing in (("unfiltered's", 1.0), ("widened", None)):
                rows.append({"filter": label, "share": round(float(ok.mean()), 4), "probe": how}
                            | measure(index, q, truth, exclude, passing))
                print(rows[-1], flush=True)
            if hnsw is not None:
                rows.append({"filter": label, "share": round(float(ok.mean()), 4), "probe": f"hnswlib ef {ef}"}
                            | hnsw_measure(hnsw, qs, truth, ok))
                print(rows[-1], flush=True)
        where = index.memory()["raw_vectors_bytes"] > 0
        params = index.params.to_dict()
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
             "the widening); 'widened': nprobe and the ratio rule's floor over the share passing; hnswlib: the peer "
             "beside it (its times include a Python call a vector its search meets).", "",
             "| filter | share passing | search | recall@10 | QPS (one call) | ms a one-query call | lists/q "
             "| SSD pages/q |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['filter']} | {r['share']} | {r['probe']} | {r['recall']} | {r['qps']} | {r['one_query_ms']} "
              f"| {r['lists']} | {r['pages_read']} |" for r in rows]
    (res_dir / f"filtered_{args.set}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
