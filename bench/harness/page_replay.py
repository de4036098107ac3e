"""The re-rank replayed in numpy on a built index's real PQ candidates (bench/peers/page_order.py, pages_levers.py,
stop_rules.py): the pages a query touches under a layout, the floor an oracle stop rule reaches, and the candidates."""

from __future__ import annotations

import numpy as np


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
