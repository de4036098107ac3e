"""Hybrid search's fusion, one for a collection and a sharded collection: two rankings of a query (by vector and by
text) fused as a search's `fusion` says, and the fused ranking's first k documents still live, with their exact
distances to the query computed from their stored vectors."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fusionrag.retriever.collection.config import Fusion
from fusionrag.retriever.collection.fresh import distances
from fusionrag.retriever.collection.records import Hit, engine_form


def fuse(vector_ranked: list, vector_d, text_ranked: list, text_d, w: float, fusion: Fusion) -> list[tuple]:
    """Two rankings of one query (keys best first, with their distances or bm25 scores: lower is better) fused
    as `fusion` says (config.Fusion): (key, score), best first."""
    score: dict = {}
    if fusion.method == "rrf":
        for rank, r in enumerate(vector_ranked, 1):
            score[r] = (1 - w) / (fusion.k + rank)
        for rank, r in enumerate(text_ranked, 1):
            score[r] = score.get(r, 0.0) + w / (fusion.k + rank)
    else:
        for ranked, d, weight in ((vector_ranked, vector_d, 1 - w), (text_ranked, text_d, w)):
            if not len(ranked):
                continue
            d = np.asarray(d, dtype=np.float64)[:len(ranked)]
            lo, hi = float(d.min()), float(d.max())
            norm = (hi - d) / (hi - lo) if hi > lo else np.ones(len(d))
            for r, x in zip(ranked, norm.tolist()):
                score[r] = score.get(r, 0.0) + weight * x
    return sorted(score.items(), key=lambda item: -item[1])


def fused_hits(query: np.ndarray, fused: Sequence[tuple], k: int, fetch: Callable[[list], dict], metric: str,
               with_vectors: bool) -> list[Hit]:
    """The first k of a fused ranking ((key, score), best first) whose documents are still there: fetch(keys) ->
    {key: (id, text, metadata, vector)} of those live, asked for the next keys until k are found (a document
    deleted since the rankings were made is passed over, not left as a gap); each hit's distance the exact one
    from its stored vector (query: one prepared query vector), as a vector search answers it."""
    live, docs, at = [], {}, 0
    while len(live) < k and at < len(fused):
        part = fused[at:at + k - len(live)]
        at += len(part)
        got = fetch([key for key, _ in part])
        docs.update(got)
        live += [(key, sc) for key, sc in part if key in got]
    if not live:
        return []
    x = engine_form(np.stack([docs[key][3] for key, _ in live]), metric)
    d = distances(np.asarray(query, np.float32)[None, :], x, (x * x).sum(1), metric)[0]
    return [Hit(docs[key][0], float(dist), sc, docs[key][1], docs[key][2], docs[key][3] if with_vectors else None)
            for (key, sc), dist in zip(live, d.tolist())]
