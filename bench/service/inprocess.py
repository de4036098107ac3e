"""Collection.search against Index.search in one process (issue 65's in-process target: the collection's answer,
texts and metadata included, at least 0.85x the index's q/s).

The collection is bench/service/chroma_http.py's (the 38,678 Python-docs paragraphs, all-MiniLM-L6-v2, cosine),
copied from bench/work/chroma_http/fusionrag-data so that nothing here writes to it; the parameters are the ones that
benchmark tuned to recall@10 0.95 (bench/results/service/chroma_http.json, else the index's defaults). The report
half's queries, one query a call, k 10, one thread: Index.search on the collection's own main index (its rows, the
query unit-normalised once beforehand) and Collection.search (hits with id, text and metadata), the two passes
alternated --rounds times over the same queries. Figures: each pass's wall time and the process's CPU time
(time.process_time, every thread: less moved by other work on a shared machine) per query, medians over rounds; the ratio is
Index's time over Collection's (1.0: the collection costs nothing beyond its index).

    python -m bench.service.inprocess [--rounds 9] [--queries 500]

Results: bench/results/service/inprocess.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK, results


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return f"{cpu}, {os.cpu_count()} cores, kernel {platform.release()}"


def main() -> None:
    from bench.harness.streams import half_bounds
    from fusionrag.retriever.collection import Collection
    from fusionrag.retriever.engine.config import SearchOverrides, resolve_params

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--queries", type=int, default=500, help="report-half queries used")
    ap.add_argument("--source", type=Path, default=WORK / "chroma_http" / "fusionrag-data" / "collections" / "docs")
    ap.add_argument("--out", type=Path, default=results("service"))
    args = ap.parse_args()
    if not args.source.exists():
        raise SystemExit(f"{args.source} is missing: run `python -m bench.service.chroma_http` first (it builds it)")
    tuned = results("service") / "chroma_http.json"
    params = json.loads(tuned.read_text())["tuning"]["fusionrag"]["chosen"] if tuned.exists() else {}
    queries = np.load(WORK / "data" / "minilm" / "queries.npy").astype(np.float32)
    lo, hi = half_bounds(len(queries), "report")
    q = queries[lo:hi][:args.queries]
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)

    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        path = Path(tmp) / "docs"
        shutil.copytree(args.source, path)
        col = Collection(path)
        index = col._main.index  # its own main index, searched alone
        sp = resolve_params(SearchOverrides.of(params), index.params)
        assert len(col.search(q[:1], 10, params=sp).hits[0][0].text or "") > 0  # hits carry their texts

        def index_pass():
            for i in range(len(q)):
                index.search(qn[i:i + 1], 10, sp)

        def collection_pass():
            for i in range(len(q)):
                col.search(q[i:i + 1], 10, params=sp)

        for f in (index_pass, collection_pass):  # warm: the lists, pages and doc rows the queries touch
            f()
        runs: dict[str, list[tuple[float, float]]] = {"index": [], "collection": []}
        for _ in range(args.rounds):
            for name, f in (("index", index_pass), ("collection", collection_pass)):
                w, c = time.perf_counter(), time.process_time()
                f()
                runs[name].append(((time.perf_counter() - w) / len(q), (time.process_time() - c) / len(q)))
        col.close()

    def med(name, j):
        return float(np.median([r[j] for r in runs[name]]))

    out = {"machine": _machine(), "load": os.getloadavg(), "params": params, "queries": len(q),
           "rounds": args.rounds, "runs": runs,
           "index_us": {"wall": med("index", 0) * 1e6, "cpu": med("index", 1) * 1e6},
           "collection_us": {"wall": med("collection", 0) * 1e6, "cpu": med("collection", 1) * 1e6}}
    out["ratio"] = {k: out["index_us"][k] / out["collection_us"][k] for k in ("wall", "cpu")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "inprocess.json").write_text(json.dumps(out, indent=1))
    md = [f"# Collection.search against Index.search in one process ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
          "",
          f"`python -m bench.service.inprocess --rounds {args.rounds}`. Machine: {out['machine']}; load average at the "
          f"end {', '.join(f'{x:.2f}' for x in out['load'])}. The chroma_http benchmark's collection (38,678 x 384 "
          f"Python-docs paragraphs, cosine), {len(q)} report-half queries one a call, k 10, params {params} "
          f"(tuned there to recall@10 0.95); passes alternated, medians of {args.rounds} rounds.",
          "",
          "| | wall us/query | process CPU us/query |", "|---|---:|---:|",
          f"| Index.search (ids) | {out['index_us']['wall']:.1f} | {out['index_us']['cpu']:.1f} |",
          f"| Collection.search (ids, texts, metadata) | {out['collection_us']['wall']:.1f} | "
          f"{out['collection_us']['cpu']:.1f} |",
          f"| **ratio Index / Collection** | **{out['ratio']['wall']:.3f}** | **{out['ratio']['cpu']:.3f}** |",
          "", "Every round: [inprocess.json](inprocess.json)."]
    (args.out / "inprocess.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
