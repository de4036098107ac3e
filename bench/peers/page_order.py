"""How many pages must a query read at all, and what do the page order and page-mates change?

    python -m bench.peers.page_order SET [--index bench/work/idx/SET/fusionrag] [--queries 500]

Replays the re-rank in numpy on the real PQ candidates of a benchmark index (nprobe 32, 200
candidates in PQ order) with exact distances from the base vectors, and counts the distinct pages
each query touches (page buffer left out). Two layouts of the same buckets (each vector in the
bucket of its nearest centroid, the build's plan_layout): vectors in id order within a bucket (the
layout before layout.chain_order), and as a nearest-neighbour chain of their PQ reconstructions
(what the build does now). For each:

- "true top-10 pages": the pages holding a query's exact 10 nearest neighbours, a floor for any
  re-ranker that returns exact distances;
- "oracle 9/10": the shortest prefix of the PQ order that holds 9 of the top 10 (a stop rule that
  knew the answer), its candidates and pages;
- Algorithm 1 (mini-batch, beta) without page-mates; with the query's own later candidates on a
  page read scored (what the engine does, EngineConfig.page_mates); and with every record of a
  page read scored (it would need a slot -> id map, 4 bytes per slot of RAM, and exclude checks).

Results: bench/results/peers/page_order.md.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.harness.page_replay import oracle, pq_candidates, replay
from bench.harness.paths import WORK
from bench.harness.sets import load_as_searched

import fusionrag.retriever as fr  # noqa: E402
from fusionrag.retriever.engine.layout import chain_order, plan_layout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("set")
    ap.add_argument("--index", type=Path)
    ap.add_argument("--queries", type=int, default=500)
    args = ap.parse_args()
    X, queries, gt, meta = load_as_searched((WORK).resolve(), args.set)
    idx = fr.Index.open(args.index or WORK / "idx" / args.set / "fusionrag", threads=1, graph_sq8=False)
    C = np.ascontiguousarray(idx.nav.graph.vectors()[:, :X.shape[1]], dtype=np.float32)
    import faiss

    flat = faiss.IndexFlatL2(C.shape[1])
    flat.add(C)
    home = flat.search(X, 1)[1][:, 0]
    rpb, rb = idx.manifest["pages"]["records_per_block"], idx.manifest["pages"]["record_bytes"]
    nq = args.queries
    q, cand = pq_candidates(idx, queries[:nq])
    decoded = lambda ids: idx.pq.decode(idx.filter.codes[ids])
    orders = [c[c >= 0] for c in cand]
    print(f"{args.set}: {len(X)} x {X.shape[1]}, {rpb} records per page, {nq} queries, nprobe 32, 200 candidates")

    print("| layout | true top-10 pages | oracle 9/10: pages (candidates) | page-mates | "
          "mb 4, β 1 | mb 4, β 2 | mb 2, β 2 | mb 1, β 4 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("id order", "chain"):
        order = chain_order(home, len(C), C, decoded) if name == "chain" else None
        _, slots = plan_layout(home, len(C), rb, order)
        loc = slots.astype(np.int64)
        slot2id = np.full(loc.max() + 1 + rpb, -1, np.int64)
        slot2id[loc] = np.arange(len(loc))
        top10 = np.mean([len(np.unique(loc[gt[i, :10]] // rpb)) for i in range(nq)])
        o_pages, o_cands = oracle(gt, orders, loc, rpb)
        for mates in ("no", "candidates", "every record"):
            cells = [f"{pg:.1f} p, {sc:.0f} scored, recall {rec:.3f}" for pg, sc, rec in
                     (replay(X, q, gt, orders, loc, rpb, mb, beta, mates, slot2id)
                      for mb, beta in ((4, 1), (4, 2), (2, 2), (1, 4)))]
            print(f"| {name} | {top10:.2f} | {o_pages:.1f} ({o_cands:.1f}) | {mates} | "
                  + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
