"""Queries in flight per re-rank worker (EngineConfig.rerank_inflight): whole-search QPS, the
re-rank stage's QPS alone (same PQ candidates for every point) and SSD pages per query for G in --groups, 1 and 2 threads, io_uring and the pread pool, on one built index
with a small page buffer (page file / 16). The G values run interleaved, --repeat times, on the
same queries, each run from an empty page buffer; the best run of each point is reported.

    python -m bench.cache.rerank_inflight INDEX_DIR QUERIES [--limit 1000] [--out results.json]

Also checks that the summed pages_read statistic agrees with /proc/self/io read_bytes.
"""

import argparse
import json
import os
import time

import numpy as np

from fusionrag.retriever import Index
from fusionrag.retriever.engine.pipeline import cut
from fusionrag.retriever.engine.vectors import open_vectors


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def candidates(index: Index, queries: np.ndarray) -> list[np.ndarray]:
    """The PQ candidates of each engine batch, as the search hands them to the re-ranker."""
    q = index.prepare_queries(queries)
    *_, batches = cut(q, 10, index.params, None, index.filter.batch_size)
    return [index._filter_stage(index._graph_stage(b)).candidates.ids for b in batches]


def rerank_only(index: Index, queries: np.ndarray, cands: list[np.ndarray]) -> float:
    """Seconds the re-rank stage alone takes for all queries, batch by batch as in a search."""
    index.reranker.store.reset_buffer()
    bs = index.filter.batch_size
    t = time.perf_counter()
    for i, cand in enumerate(cands):
        index.reranker.rerank(index.prepare_queries(queries[i * bs:(i + 1) * bs]), cand, 10, index.params)
    return time.perf_counter() - t


def run_once(index: Index, queries: np.ndarray, cands: list[np.ndarray], inflight: int) -> dict:
    index.reranker.inflight = inflight  # the one knob that differs between points
    rerank_s = rerank_only(index, queries, cands)
    index.reranker.store.reset_buffer()
    io0, calls0 = read_bytes(), index.reranker.store.stats()["read_calls"]
    t = time.perf_counter()
    res = index.search(queries, k=10)
    seconds = time.perf_counter() - t
    io, calls = read_bytes() - io0, index.reranker.store.stats()["read_calls"] - calls0
    read = int(res.stats["pages_read"].sum())
    return {
        "qps": len(queries) / seconds,
        "rerank_qps": len(queries) / rerank_s,
        "pages_read_per_q": read / len(queries),
        "pages_buffered_per_q": float(res.stats["pages_buffered"].sum()) / len(queries),
        "minibatches_per_q": float(res.stats["minibatches"].sum()) / len(queries),
        # Batched reads sent to the SSD: the round trips a query waits for, shared by those in flight.
        "ssd_round_trips_per_q": calls / len(queries),
        "rerank_ms_per_q": 1e3 * float(res.stats["rerank_s"].sum()) / len(queries),
        "io_agrees": io == read * index.reranker.store.block_bytes,
        "ids": res.ids,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("index_dir")
    ap.add_argument("queries")
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--groups", default="1,2,4,8,16,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--backends", default="io_uring,pread")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--buffer-fraction", type=float, default=16)
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args()

    queries = np.ascontiguousarray(open_vectors(args.queries)[: args.limit], dtype=np.float32)
    groups = [int(g) for g in args.groups.split(",")]
    pages = os.path.getsize(os.path.join(args.index_dir, "vectors.pages"))
    buffer_bytes = int(pages / args.buffer_fraction)
    print(f"{args.index_dir}: page file {pages / 2**20:.1f} MiB, buffer {buffer_bytes / 2**20:.2f} MiB, "
          f"{len(queries)} queries; load average {os.getloadavg()}")
    rows = []
    for backend in args.backends.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            index = Index.open(args.index_dir, buffer_bytes=buffer_bytes, io_backend=backend, direct_io="on",
                               threads=threads)
            index.search(queries[:200], k=10)  # warm-up: code paths, graph and PQ codes in the page cache
            cands = candidates(index, queries)
            best, reference = {}, None
            for _ in range(args.repeat):
                for g in groups:
                    r = run_once(index, queries, cands, g)
                    if reference is None:
                        reference = r["ids"]
                    assert np.array_equal(r["ids"], reference), f"G={g} changed the results"
                    if g not in best or r["qps"] > best[g]["qps"]:
                        best[g] = r
            for g in groups:
                r = {k: v for k, v in best[g].items() if k != "ids"}
                rows.append({"backend": backend, "threads": threads, "inflight": g, **r})
                print(f"{backend:>8} threads={threads} G={g:>3}: {r['qps']:7.0f} q/s, re-rank alone "
                      f"{r['rerank_qps']:7.0f} q/s, "
                      f"{r['pages_read_per_q']:6.2f} pages read/q, {r['pages_buffered_per_q']:6.2f} buffered/q, "
                      f"{r['minibatches_per_q']:5.2f} minibatches/q, {r['ssd_round_trips_per_q']:5.2f} SSD round "
                      f"trips/q, rerank {r['rerank_ms_per_q']:.3f} ms/q, "
                      f"/proc/self/io agrees: {r['io_agrees']}", flush=True)
            index.close()
    print(f"load average {os.getloadavg()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"index": args.index_dir, "queries": len(queries), "buffer_bytes": buffer_bytes,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
