"""How many pages must a query read at all, and what do the page order and page-mates change?

    python bench/page_order.py SET [--index bench/work/idx/SET/fusionrag] [--queries 500]

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

Results: bench/results/page_order.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from datasets import load_as_searched  # noqa: E402

import fusionrag.retriever as fr  # noqa: E402
from fusionrag.retriever.engine.layout import chain_order, plan_layout  # noqa: E402


def replay(X, q, gt, orders, loc, rpb, mb, beta, mates="no", slot2id=None, k=10):
    """Algorithm 1 replayed in numpy, exact distances from X: (pages touched, records scored,
    recall@k), each a mean over queries. orders[i]: query i's candidate ids in re-rank order; a
    record's page is loc[id] // rpb. mates: "no"; "candidates" (the query's own candidates on a page
    read are scored, as EngineConfig.page_mates does); "every record" (all of a page read's records,
    from slot2id, -1 where empty)."""
    pages = hits = scored = 0
    for i, c in enumerate(orders):
        mine = set(c.tolist())
        best, prev, stable, seen = {}, None, 0, set()
        for b in range(0, len(c), mb):
            batch = c[b:b + mb]
            pg = set((loc[batch] // rpb).tolist())
            new, seen = pg - seen, seen | pg
            ids = set(batch.tolist())
            if mates != "no":
                for page in new:
                    s = slot2id[page * rpb:(page + 1) * rpb]
                    ids |= set(s[s >= 0].tolist()) & mine if mates == "candidates" else set(s[s >= 0].tolist())
            ids = np.array(sorted(ids - best.keys()))
            if len(ids):
                best.update(zip(ids.tolist(), ((X[ids] - q[i]) ** 2).sum(1).tolist()))
            top = set(sorted(best, key=lambda j: (best[j], j))[:k])
            stable = stable + 1 if prev is not None and top == prev else 0
            prev = top
            if stable >= beta:
                break
        pages += len(seen)
        scored += len(best)
        hits += len(top & set(gt[i, :k].tolist()))
    nq = len(orders)
    return pages / nq, scored / nq, hits / (nq * k)


def oracle(gt, orders, loc, rpb, need=9, k=10):
    """The shortest prefix of each order holding `need` of the true top-k (all there are, if fewer):
    (pages, candidates), means over queries."""
    pages = n = 0
    for i, c in enumerate(orders):
        pos = np.flatnonzero(np.isin(c, gt[i, :k]))
        cut = pos[min(need, len(pos)) - 1] + 1 if len(pos) else 0
        n += cut
        pages += len(np.unique(loc[c[:cut]] // rpb))
    return pages / len(orders), n / len(orders)


def pq_candidates(idx, queries: np.ndarray, nprobe: int = 32, n: int = 200):
    """(prepared queries, each one's n best PQ candidates in PQ order, -1 padded) from the index's
    own graph and filter tier."""
    q = idx.prepare_queries(np.asarray(queries))
    lists, _, _ = idx.nav.probe(q, idx.params.with_overrides(nprobe=nprobe, rerank=n))
    return q, idx.filter.topn(idx.filter.tables(q), lists, n).ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("set")
    ap.add_argument("--index", type=Path)
    ap.add_argument("--queries", type=int, default=500)
    args = ap.parse_args()
    here = Path(__file__).parent
    X, queries, gt, meta = load_as_searched((here / "work").resolve(), args.set)
    idx = fr.Index.open(args.index or here / "work" / "idx" / args.set / "fusionrag", threads=1, graph_sq8=False)
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
