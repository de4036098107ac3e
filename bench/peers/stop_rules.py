"""Could a better candidate order or stop rule halve the pages on high-dimensional data?

    python -m bench.peers.stop_rules minilm|fashion [--queries 500]

On the real candidates of a benchmark index (nprobe 32, 200 candidates), re-orders them by the
distance to their reconstruction under other product quantizers (faiss, trained on the same
32k-vector sample size as fusionrag's build): 64 sub-spaces (as fusionrag's default), the same
after an OPQ rotation, and 128 sub-spaces (twice the bytes). For each order it reports the oracle
prefix (the fewest candidates, in that order, that hold 9 of the true top 10, and their pages in
the index's layout), Algorithm 1 replayed at several (mini-batch,
beta), and a bound rule: after k exact distances, stop at the first candidate whose PQ distance
exceeds tau times the current k-th exact distance. Not a test; results in
bench/results/peers/page_order.md.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.harness.sets import load_as_searched  # noqa: E402
from bench.harness.page_replay import oracle, pq_candidates, replay  # noqa: E402

import fusionrag.retriever as fr  # noqa: E402
from bench.harness.paths import WORK


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("set")
    ap.add_argument("--queries", type=int, default=500)
    args = ap.parse_args()
    import faiss
    X, queries, gt, meta = load_as_searched((WORK).resolve(), args.set)
    idx = fr.Index.open(WORK / "idx" / args.set / "fusionrag", threads=1)
    nq, d = args.queries, X.shape[1]
    q, cand = pq_candidates(idx, queries[:nq])
    rpb = idx.manifest["pages"]["records_per_block"]
    loc = idx.reranker.locations.astype(np.int64)  # the index's own layout
    train = X[np.random.default_rng(0).choice(len(X), min(32768, len(X)), replace=False)]

    def quantizer(m: int, opq: bool):
        t = time.perf_counter()
        dd = -(-d // m) * m
        mat = faiss.OPQMatrix(d, m, dd) if opq else None
        if mat is None and d % m:
            return None
        pq = faiss.ProductQuantizer(dd, m, 8)
        tr = train
        if mat is not None:
            mat.niter = 20
            mat.train(train)
            tr = mat.apply(train)
        pq.train(tr)
        dec = pq.decode(pq.compute_codes(mat.apply(X) if mat is not None else X))
        print(f"  PQ{m}{' + OPQ' if opq else ''} trained and applied in {time.perf_counter() - t:.0f} s", flush=True)
        return mat, dec

    def ordered(mat, dec):
        out = []
        for i in range(nq):
            c = cand[i][cand[i] >= 0]
            qq = mat.apply(q[i:i + 1]) if mat is not None else q[i:i + 1]
            ad = ((dec[c] - qq) ** 2).sum(1)
            o = np.argsort(ad, kind="stable")
            out.append((c[o], ad[o]))
        return out

    def bound(order, tau, k=10):
        pages = hits = n = 0
        for i, (c, ad) in enumerate(order):
            best, seen = {}, set()
            for b in range(len(c)):
                if len(best) >= k and ad[b] > tau * sorted(best.values())[k - 1]:
                    break
                seen.add(int(loc[c[b]] // rpb))
                best[int(c[b])] = float(((X[c[b]] - q[i]) ** 2).sum())
            top = set(sorted(best, key=lambda j: (best[j], j))[:k])
            pages, n, hits = pages + len(seen), n + len(best), hits + len(top & set(gt[i, :k].tolist()))
        return pages / nq, n / nq, hits / (nq * k)

    print(f"{args.set}: {len(X)} x {d}, {rpb} records per page, {nq} queries")
    for m, opq in ((64, False), (64, True), (128, False)):
        qz = quantizer(m, opq)
        if qz is None:
            print(f"  PQ{m}: {d} dims do not split into {m} sub-spaces")
            continue
        order = ordered(*qz)
        name = f"PQ{m}{' + OPQ' if opq else ''}"
        ids = [c for c, _ in order]
        o_pages, o_cands = oracle(gt, ids, loc, rpb)
        print(f"{name}: oracle 9/10 {o_pages:.1f} pages ({o_cands:.1f} candidates)")
        for mb, beta in ((4, 1), (4, 2), (2, 2), (1, 4)):
            print(f"  Algorithm 1, mini-batch {mb}, beta {beta}: {'%.1f pages, %.1f re-ranked, recall %.3f' % replay(X, q, gt, ids, loc, rpb, mb, beta)}")
        for tau in (0.95, 1.0, 1.05, 1.1):
            print(f"  bound rule, tau {tau}: {'%.1f pages, %.1f re-ranked, recall %.3f' % bound(order, tau)}", flush=True)


if __name__ == "__main__":
    main()
