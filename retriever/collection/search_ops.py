"""A collection's reads (Collection's part, #69): count, get, scroll, and search (vector, text, hybrid;
the main index with tombstones excluded, the fresh tier exactly, filters) over a read view of its state.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fusionrag.retriever.collection import tombstones
from fusionrag.retriever.collection.config import DEFAULT_TEXT_WEIGHT, HYBRID_DEPTH, Fusion, check_search
from fusionrag.retriever.collection.contract import in_use
from fusionrag.retriever.collection.filters import compile_filter, filter_warnings
from fusionrag.retriever.collection.fusion import fuse, fused_hits
from fusionrag.retriever.collection.generations import Generation, ReadView
from fusionrag.retriever.collection.records import QUERY_WORDS, CollectionSearch, Document, Hit
from fusionrag.retriever.collection.values import check_ids
from fusionrag.retriever.engine.config import SearchOverrides, SearchParams, resolve_params
from fusionrag.retriever.engine.pipeline import COUNT_KEYS, SECONDS_KEYS, STAT_KEYS
from fusionrag.retriever.engine.queries import PreparedQueries, prepare_queries
from fusionrag.retriever.errors import InputError


# A query's statistics before its search fills them; the engine's columns are counts (int) and seconds (float).
_NO_STATS = dict.fromkeys(STAT_KEYS, 0) | {"fresh_candidates": 0, "filtered_exact": False}


class _Reading:
    """Collection._reading's block (a class: a generator's context manager cost a search ~4 us more)."""

    __slots__ = ("coll", "snap")

    def __init__(self, coll: "SearchOps"):
        self.coll = coll

    def __enter__(self) -> ReadView:
        self.snap = self.coll._snapshot()
        return self.snap

    def __exit__(self, *exc) -> None:
        self.coll._unread(self.snap)


class SearchOps:
    """Collection's search operations: a part of Collection (api.py), whose state they use."""

    @in_use
    def count(self, filter: dict | None = None) -> int:
        """How many documents the filter passes (all of them without one)."""
        if filter is None:
            return self.store.count()
        return len(self.store.rows_where(*compile_filter(filter)))

    @in_use
    def get(self, ids: Sequence[str], with_vectors: bool = False) -> list[Document]:
        found = self.store.get(check_ids(ids, "get"), with_vectors)
        return [Document(i, found[i][0], found[i][2], found[i][1]) for i in ids if i in found]

    @in_use
    def scroll(self, limit: int, after: int = -1, filter: dict | None = None,
               with_vectors: bool = False) -> tuple[list[Document], int | None]:
        """Up to `limit` documents (those the filter passes) in internal row order past row `after`, and the row
        to continue after (None at the end). Rows are never reused and a write takes new ones: a document live
        throughout a scroll is seen once, one replaced meanwhile may be seen again (at its new row)."""
        for name, v, low in (("limit", limit, 1), ("after", after, -1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise InputError(f"{name} must be an integer >= {low}, got {v!r}")
        where = compile_filter(filter) if filter is not None else None
        found = self.store.page(int(after), int(limit) + 1, where, with_vectors)  # one more: is there a next page?
        more = len(found) > limit
        found = found[:limit]
        return [Document(i, t, v, m) for _, i, t, m, v in found], (found[-1][0] if more else None)

    def _reading(self) -> "_Reading":
        """A snapshot whose main index stays open until the block ends."""
        return _Reading(self)

    def _snapshot(self) -> ReadView:
        with self._mem_lock:
            snap = ReadView(self._main, *self._local.live_set.view())  # never written in place
            snap.main.readers += 1
        return snap

    def _unread(self, snap: ReadView) -> None:
        with self._mem_lock:
            snap.main.readers -= 1
            done = snap.main.retired and not snap.main.readers and snap.main.index is not None
        if done:
            snap.main.index.close()

    def _retire(self, main: Generation) -> bool:
        """Mark a generation no longer published (caller holds _mem_lock); True when no search reads
        it, and the caller closes its index."""
        main.retired = True
        return main.index is not None and not main.readers

    def _queries(self, vectors) -> PreparedQueries:
        """The one check of query vectors on this path, and their one normalisation: the index takes them as they are."""
        return prepare_queries(vectors, self.dim, self.metric, QUERY_WORDS)

    @in_use
    def filter_warnings(self, filter: dict) -> list[str]:
        """Why parts of a filter match nothing: each field it names that no document holds (with the stored fields
        nearest its name), or compares only with types of values that the documents do not hold it as ("3"
        against numbers, a scalar against lists); none when all can match."""
        return filter_warnings(filter, self.store.field_types, self.store.field_names)

    @in_use
    def search(self, vectors=None, k: int = 10, filter: dict | None = None,
               params: SearchParams | SearchOverrides | dict | None = None,
               with_vectors: bool = False, *, texts: Sequence[str] | None = None, mode: str = "vector",
               text_weight: float = DEFAULT_TEXT_WEIGHT, fusion: Fusion | dict | None = None,
               partial: bool = True) -> CollectionSearch:
        """Top-k of each query. mode "vector": by the query vectors; "text": by BM25 over the documents'
        texts (hits' distance is SQLite's bm25, lower is better); "hybrid": both rankings, each
        HYBRID_DEPTH deep (or k), fused as `fusion` says (reciprocal rank by default; config.Fusion) with the
        text ranking weighted text_weight (a query phrased as a question: a share of it, and its text ranking
        made without the words of questions; Fusion.query); hits' score is the fused score, their distance the
        exact vector distance. partial: a sharded collection's (whether an answer missing a down shard's lists may
        be given); a collection's answers are never partial."""
        k = check_search(k, mode, texts, vectors, text_weight)
        if fusion is not None or mode == "hybrid":  # checked whatever the mode; the default made where it is used
            fusion = Fusion.of(fusion)
        if mode != "text":
            q = self._queries(vectors)
        if mode == "hybrid" and len(texts) != len(q):
            raise InputError(f"mode 'hybrid' needs one text per query vector, got {len(texts)} for {len(q)}")
        where = compile_filter(filter) if filter is not None else None
        if mode == "text":
            return self._text_hits(texts, k, where, with_vectors)
        with self._reading() as snap:
            if mode == "vector":
                # Without fresh vectors the one part is ordered already (the engine's: best first, -1 padded).
                return self._hits(*self._search(snap, q, k, where, params), k, with_vectors,
                                  ordered=not len(snap.fresh.rows))
            depth = max(k, HYBRID_DEPTH)
            rows, dists, stats = self._search(snap, q, depth, where, params)
        return self._fused_hits(q.vectors, rows, dists, texts, depth, k, float(text_weight), fusion, where, stats,
                                with_vectors)

    def _text_hits(self, texts, k, where, with_vectors) -> CollectionSearch:
        found = [self.store.text_search(t, k, where) for t in texts]
        rows = np.full((len(texts), k), -1, np.int64)
        dists = np.full((len(texts), k), np.inf, np.float32)
        stats = []
        for i, (r, d) in enumerate(found):
            rows[i, :len(r)], dists[i, :len(r)] = r, d
            stats.append({"text_candidates": len(r)})
        return self._hits(rows, dists, stats, k, with_vectors, score=lambda d: -d)

    def _fused_hits(self, q, vec_rows, vec_d, texts, depth, k, w, fusion, where, stats,
                    with_vectors) -> CollectionSearch:
        """The vector and the text ranking of each query fused (fuse); a question's text ranking and weight as
        fusion.query says."""
        fused = []
        for i, text in enumerate(texts):
            text, wi = fusion.query(text, w)
            text_rows, text_d = self.store.text_search(text, depth, where)
            stats[i]["text_candidates"] = len(text_rows)
            # The tiers' rows arrive unsorted, each tier's `depth` best: the ranking is the `depth` nearest of all.
            order = np.argsort(vec_d[i], kind="stable")
            ranked, ranked_d = vec_rows[i][order], vec_d[i][order]
            keep = ranked >= 0
            ranked, ranked_d = ranked[keep][:depth], ranked_d[keep][:depth]
            fused.append(fuse(ranked.tolist(), ranked_d, text_rows.tolist(), text_d, wi, fusion))
        hits = [fused_hits(q[i], f, k, lambda rows: self.store.by_rows(rows, True), self.metric, with_vectors)
                for i, f in enumerate(fused)]
        return CollectionSearch(hits, stats)

    def _search(self, snap: ReadView, q: PreparedQueries, k, where, params):
        """Rows and exact distances of each query's k nearest (unsorted, padded with -1), and statistics."""
        nq = len(q)
        stats = [_NO_STATS.copy() for _ in range(nq)]
        allowed, among = None, False
        if where is not None:
            # A filter few documents pass: every one is a candidate (search_among: PQ over their codes, the best
            # re-ranked exactly), none lost to the lists probed; else the index searches with the rest excluded.
            allowed = self.store.rows_where(*where)
            among = self.config.filter_exact(len(allowed))
            for s in stats:
                s["filtered_exact"] = among
        parts_rows, parts_d = [], []
        main = snap.main
        if main.index is not None and len(main.rows) > snap.tomb_count and (allowed is None or len(allowed)):
            r, d = self._search_main(q, k, params, snap, allowed, among, stats)
            parts_rows.append(r)
            parts_d.append(d)
        fr = snap.fresh
        if len(fr.rows):  # else nothing written since the merge: fresh_candidates stays 0
            fmask = None if allowed is None else np.isin(fr.rows, allowed)
            r, d = fr.search(q.vectors, k, self.metric, fmask)
            n_fresh = int((fr.live if fmask is None else fr.live & fmask).sum())
            for s in stats:
                s["fresh_candidates"] = n_fresh
            parts_rows.append(r)
            parts_d.append(d)
        if len(parts_rows) == 1:
            return parts_rows[0], parts_d[0], stats
        if not parts_rows:
            return np.full((nq, 0), -1, np.int64), np.full((nq, 0), np.inf, np.float32), stats
        return np.concatenate(parts_rows, axis=1), np.concatenate(parts_d, axis=1), stats

    def _search_main(self, q: PreparedQueries, k, params, snap: ReadView, allowed, among: bool, stats):
        main = snap.main
        n = len(main.rows)
        if allowed is None:
            exclude, live = snap.tomb, n - snap.tomb_count
        else:
            ok = tombstones.passing(main.rows, allowed, snap.tomb)
            exclude, live = tombstones.exclusion(ok), int(ok.sum())
        if among:
            res = main.index.search_among(q, np.flatnonzero(ok), k, params)
            ids, dists = res.ids, res.distances
        else:
            # The lists probed widen by the share passing (the live rows': a filter's, the tombstones').
            passing = max(live, 1) / n
            res = main.index.search(q, k, params, exclude=exclude, passing=passing)
            ids, dists = res.ids, res.distances
            # Excluded vectors can empty the probed lists: probe them all for queries left short (ids are best
            # first, -1 padded: short where the min(k, live)-th is -1).
            short = [i for i, v in enumerate(ids[:, min(k, live) - 1].tolist()) if v < 0] if live else []
            if short:
                short = np.asarray(short)
                # Every list: the ratio rule would still cut those beyond twice the nearest one's distance.
                p = resolve_params(params, main.index.params).with_overrides(
                    nprobe=main.index.nav.graph.size, probe="ratio", probe_ratio=0.0)
                again = main.index.search(q.rows(short), k, p, exclude=exclude, passing=passing)
                ids[short], dists[short] = again.ids, again.distances
        # Python numbers, the counts' columns as one matrix and the seconds' as another (two conversions, not one a
        # column), then a query's all at once.
        st = res.stats
        tier = res.info.get("filter_tier")  # which tier served (under filter_tier auto with CUDA, the cheaper)
        if len(stats) == 1:  # one query (most calls): a number a key, half the time of the matrices below
            s = stats[0]
            for key in COUNT_KEYS:
                s[key] = int(st[key][0])
            for key in SECONDS_KEYS:
                s[key] = float(st[key][0])
            s["filter_tier"] = tier
        else:
            counts = np.array([st[key] for key in COUNT_KEYS], np.int64).T.tolist()
            seconds = np.array([st[key] for key in SECONDS_KEYS], np.float64).T.tolist()
            for s, c, sec in zip(stats, counts, seconds):
                s.update(zip(COUNT_KEYS, c))
                s.update(zip(SECONDS_KEYS, sec))
                s["filter_tier"] = tier
        # The engine pads with id -1 at distance inf (every tier): hits skip the -1 rows, whatever their distance.
        rows = main.rows.take(ids, mode="clip") if n else np.zeros(ids.shape, np.int64)  # -1 taken, then put back
        rows[ids < 0] = -1
        return rows, dists

    def _hits(self, rows: np.ndarray, dists: np.ndarray, stats, k: int, with_vectors: bool,
              score=None, ordered: bool = False) -> CollectionSearch:
        """Each query's first k live documents by distance; ordered: rows are each nearest first already."""
        cosine = score is None and self.metric == "cosine"  # the score inline: a call a hit less
        score = score or self._score
        k_all = []
        if not ordered:
            order = np.argsort(dists, axis=1, kind="stable")
            at = np.arange(len(rows))[:, None]  # indexing, not take_along_axis: a third of the time at one query
            rows, dists = rows[at, order], dists[at, order]
        rows_l = rows.tolist()
        # Each row once, as Python ints (a set, not np.unique: a few microseconds less at one query).
        docs = self.store.by_rows(list({r for qr in rows_l for r in qr if r >= 0}), with_vectors)
        get = docs.get
        for qr, qd in zip(rows_l, dists.tolist()):
            hits = []
            for r, d in zip(qr, qd):
                doc = get(r)
                if doc is None:  # padding, or deleted since the snapshot
                    continue
                hits.append(Hit(doc[0], d, 1.0 - d if cosine else score(d), doc[1], doc[2], doc[3]))
                if len(hits) == k:
                    break
            k_all.append(hits)
        return CollectionSearch(k_all, stats)

    def _score(self, d: float) -> float:
        return 1.0 - d if self.metric == "cosine" else -d
