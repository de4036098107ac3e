"""Would a lower bound on each candidate's exact distance let the re-rank read fewer pages? (#68 item 3)

    python -m bench.peers.rerank_bound minilm|fashion|glove [--queries 1000] [--nprobe 32] [--rerank 60] [--own]

A replay, as bench/peers/pages_levers.py's (bench/harness/page_replay.py): Algorithm 1 in numpy on the real PQ
candidates of a benchmark index (bench/work/idx/SET/fusionrag; by default nprobe 32, 60 candidates, 1000 queries;
with --own again at the index's own rerank/nprobe), exact distances from the base vectors, distinct pages per query
(loc // records per page, page buffer left out). No engine code is changed.

The lever: a candidate x with PQ reconstruction x^ (its code decoded with the index's codebooks) and residual
r = ||x - x^|| (one float per vector, computed here from pq_codes.npy) has, for a query q with ADC a = ||q - x^||^2,
exact d = ||q - x||^2 = a + r^2 - 2 <q - x^, x - x^>, so

    rigorous:   d >= (sqrt(a) - r)^2                       (Cauchy-Schwarz; the reverse triangle inequality)
    calibrated: d >= a + r^2 - 2 eps sqrt(a) r             eps: the (1 - delta) quantile of cos(q - x^, x - x^)
                                                           over the select half's candidates (queries 0..nq/2-1)

A candidate whose bound exceeds the current k-th exact distance (as it stands when its mini-batch is formed;
infinite until k are scored) is skipped: not read, not scored. Two ways to form the mini-batches:
  window: the next `minibatch` candidates in ADC order, the skipped ones left out (a mini-batch of skips leaves
          the top-k as it was and counts as stable). With the rigorous bound the top-k follows exactly the
          no-bound replay's: the same recall and stop, only fewer pages.
  fill:   the next `minibatch` candidates the bound does not skip (the stop then looks further down the list).
beta 0 re-ranks every candidate not skipped (no early stop).

All figures are on the report half (queries nq/2..nq-1). Cosine sets are l2 over unit vectors inside the engine
(manifest internal_metric "l2"), as the replay measures them; an ip index is refused. Results:
bench/results/peers/rerank_bound.md.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.harness.page_replay import pq_candidates, replay
from bench.harness.paths import WORK
from bench.harness.sets import load_as_searched

import fusionrag.retriever as fr

K = 10
SETTINGS = ((8, 2), (4, 2), (4, 1), (8, 0), (4, 0), (1, 0))  # (mini-batch, beta); (8, 2) the class defaults
DELTAS = (1e-2, 1e-3, 1e-4)


def residual_norms(idx, X: np.ndarray, step: int = 1 << 15) -> np.ndarray:
    """||x - x^|| of every vector (float64), x^ decoded from the index's codes with its codebooks."""
    pq = idx.pq
    codes = np.load(idx.path / "pq_codes.npy", mmap_mode="r")
    r = np.empty(len(X))
    for lo in range(0, len(X), step):
        r[lo:lo + step] = np.linalg.norm(X[lo:lo + step] - pq.decode(np.asarray(codes[lo:lo + step])), axis=1)
    return r


def per_query(idx, X, q, orders, loc, rpb, rnorm):
    """Per query (candidates in re-rank order): exact d, ADC a, residual r, cos(q - x^, x - x^), page."""
    pq = idx.pq
    codes = np.load(idx.path / "pq_codes.npy", mmap_mode="r")
    out = []
    for i, c in enumerate(orders):
        xh = pq.decode(np.asarray(codes[c])).astype(np.float64)
        u = q[i].astype(np.float64) - xh  # q - x^
        v = X[c].astype(np.float64) - xh  # x - x^
        a = (u * u).sum(1)
        d = ((X[c].astype(np.float64) - q[i]) ** 2).sum(1)
        r = rnorm[c]
        cos = (u * v).sum(1) / np.maximum(np.sqrt(a) * r, 1e-30)
        out.append({"c": c, "d": d, "a": a, "r": r, "cos": cos, "page": loc[c] // rpb})
    return out


def bound(p, eps):
    """Lower bound on d: a + r^2 - 2 eps sqrt(a) r (eps 1: (sqrt(a) - r)^2); none: -inf."""
    if eps is None:
        return np.full(len(p["a"]), -np.inf)
    return p["a"] + p["r"] ** 2 - 2 * eps * np.sqrt(p["a"]) * p["r"]


def replay_bound(p, lb, gt_row, mb, beta, fill, k=K):
    """One query: (pages, scored, skipped, hits@k, false skips: skipped candidates among the exact top-k of the
    whole candidate list)."""
    d, c, page, n = p["d"], p["c"], p["page"], len(p["d"])
    scored, skipped, seen = [], [], set()
    kth, prev, stable, i = np.inf, None, 0, 0
    top = set()
    while i < n:
        if fill:
            batch = []
            while i < n and len(batch) < mb:
                (skipped if lb[i] > kth else batch).append(i)
                i += 1
        else:
            window = range(i, min(i + mb, n))
            batch = [j for j in window if not lb[j] > kth]
            skipped += [j for j in window if lb[j] > kth]
            i = window.stop
        if not batch and fill:
            break
        seen.update(page[batch].tolist())
        scored += batch
        s = np.array(scored)
        o = np.lexsort((c[s], d[s]))[:k]
        top = set(c[s[o]].tolist())
        if len(s) >= k:
            kth = d[s[o[-1]]]
        stable = stable + 1 if prev is not None and top == prev else 0
        prev = top
        if beta and stable >= beta:
            break
    exact = set(c[np.lexsort((c, d))[:k]].tolist())
    false = len(exact & set(c[skipped].tolist())) if skipped else 0
    return len(seen), len(scored), len(skipped), len(top & set(gt_row[:k].tolist())), false


def run(P, gt, rows, eps, mb, beta, fill):
    """Means over the rows' queries; false_q: queries with a false skip."""
    each = np.array([replay_bound(P[i], bound(P[i], eps), gt[i], mb, beta, fill) for i in rows], dtype=float)
    pages, scored, skipped, hits, false = each.mean(0)
    return {"pages": pages, "scored": scored, "skipped": skipped, "recall": hits / K, "false": false,
            "false_q": int((each[:, 4] > 0).sum())}


def study(idx, X, queries, gt, nq, nprobe, n, rnorm, out):
    q, cand = pq_candidates(idx, queries[:nq], nprobe=nprobe, n=n)
    loc = idx.reranker.locations.astype(np.int64)
    rpb = idx.manifest["pages"]["records_per_block"]
    orders = [c[c >= 0] for c in cand]
    t = time.perf_counter()
    P = per_query(idx, X, q, orders, loc, rpb, rnorm)
    sel, rep = range(nq // 2), range(nq // 2, nq)
    # Sanity: the engine's order is the ADC order computed here; the no-bound replay is page_replay.replay's.
    inv = np.mean([np.mean(np.diff(P[i]["a"]) < -1e-4 * P[i]["a"][1:]) for i in rep if len(P[i]["a"]) > 1])
    ref = replay(X, q[nq // 2:], gt[nq // 2:], orders[nq // 2:], loc, rpb, 8, 2)
    mine = run(P, gt, rep, None, 8, 2, False)
    out(f"\n### nprobe {nprobe}, {n} candidates ({np.mean([len(o) for o in orders]):.1f} per query), "
        f"records per page {rpb}\n")
    out(f"Checks: ADC pairs out of the engine's order {inv:.4f}; no-bound replay here {mine['pages']:.2f} pages "
        f"recall {mine['recall']:.4f}, page_replay.replay {ref[0]:.2f} / {ref[2]:.4f}.\n")
    cos_sel = np.concatenate([P[i]["cos"] for i in sel])
    eps = {dl: float(np.quantile(cos_sel, 1 - dl)) for dl in DELTAS}
    cos_rep = np.concatenate([P[i]["cos"] for i in rep])
    # r against the k-th exact distance of the whole candidate list, report half
    dk = np.array([np.sort(P[i]["d"])[min(K, len(P[i]["d"])) - 1] for i in rep])
    r_rep = np.concatenate([P[i]["r"] for i in rep])
    a_rep = np.concatenate([P[i]["a"] for i in rep])
    dk_each = np.concatenate([np.full(len(P[i]["d"]), dk[j]) for j, i in enumerate(rep)])
    lb_r = np.maximum(np.sqrt(a_rep) - r_rep, 0) ** 2
    out(f"Residuals (report half's candidates): median r {np.median(r_rep):.4g}, median r^2 / d_k "
        f"{np.median(r_rep ** 2 / dk_each):.3f}, median r / sqrt(d_k) {np.median(r_rep / np.sqrt(dk_each)):.3f}, "
        f"median a / d_k {np.median(a_rep / dk_each):.3f}; the rigorous bound is above the final d_k for "
        f"{np.mean(lb_r > dk_each):.1%} of candidates (the most it could skip with d_k known from the start).\n")
    out("cos(q - x^, x - x^) quantiles, select half -> eps (its share above eps on the report half): "
        + "; ".join(f"delta {dl:g}: eps {e:.3f} ({np.mean(cos_rep > e):.2e})" for dl, e in eps.items())
        + f"; median cos {np.median(cos_sel):.3f}.\n")
    variants = [("no bound", None), ("rigorous", 1.0)] + [(f"calibrated δ {dl:g} (eps {e:.3f})", e)
                                                            for dl, e in eps.items()]
    out("| mini-batch, β | bound | window: pages | recall@10 | skipped / query | false skips (queries) "
        "| fill: pages | recall@10 | skipped / query | false skips (queries) |")
    out("|---|---|---|---|---|---|---|---|---|---|")
    for mb, beta in SETTINGS:
        for name, e in variants:
            w = run(P, gt, rep, e, mb, beta, False)
            f = run(P, gt, rep, e, mb, beta, True)
            cells = []
            for x in (w, f):
                cells += [f"{x['pages']:.2f}", f"{x['recall']:.4f}",
                          f"{x['skipped']:.1f} of {x['skipped'] + x['scored']:.1f}",
                          f"{x['false']:.4f} ({x['false_q']})" if e is not None and e < 1 else "-"]
            out(f"| {mb}, {beta} | {name} | " + " | ".join(cells) + " |")
    out(f"\n({time.perf_counter() - t:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("set")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--nprobe", type=int, default=32)
    ap.add_argument("--rerank", type=int, default=60)
    ap.add_argument("--own", action="store_true", help="also at the index's own rerank and nprobe")
    args = ap.parse_args()
    X, queries, gt, meta = load_as_searched(WORK.resolve(), args.set)
    idx = fr.Index.open(WORK / "idx" / args.set / "fusionrag", threads=1)
    if idx.manifest["internal_metric"] != "l2":
        raise SystemExit("an ip index: the l2 bounds here do not apply")

    def out(s=""):
        print(s, flush=True)

    t = time.perf_counter()
    rnorm = residual_norms(idx, X)
    out(f"## {args.set}: {len(X)} x {X.shape[1]} ({meta['metric']}, internal l2), PQ M {idx.pq.m}; residual norms "
        f"of all vectors in {time.perf_counter() - t:.1f} s: median {np.median(rnorm):.4g}, "
        f"median ||x|| {np.median(np.linalg.norm(X[:10000], axis=1)):.4g}")
    study(idx, X, queries, gt, args.queries, args.nprobe, args.rerank, rnorm, out)
    if args.own:
        study(idx, X, queries, gt, args.queries, idx.params.nprobe, idx.params.rerank, rnorm, out)


if __name__ == "__main__":
    main()
