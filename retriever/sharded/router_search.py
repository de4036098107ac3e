"""The vector search of the sharded router (ShardedIndex, sharded/router.py): RouterSearch, the part of ShardedIndex
that probes, sends and merges, and ShardedResult, what a search returns.

Query path: the router finds each query's lists (as Index does), sends each shard only the lists it owns, the
queries of a batch grouped per shard (one call per shard per batch: _dispatch, each call in flight a Dispatched,
sharded/calls.py); a replicated list goes to the replica with the least outstanding work (ShardedIndex.route). Each
shard filters and re-ranks exactly as Index does (Index.search_lists) and returns its top-k with exact distances;
the router merges. A shard that does not answer is marked down and its lists sent to their other replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fusionrag.retriever.engine.config import SearchParams, resolve_params
from fusionrag.retriever.errors import InputError, UnavailableError
from fusionrag.retriever.sharded.actors import is_down
from fusionrag.retriever.sharded.calls import Dispatched, ShardCall
from fusionrag.retriever.sharded.parts import merge_topk, part_name
from fusionrag.retriever.sharded.shard import MISSING, ShardReads


@dataclass
class ShardedResult:
    ids: np.ndarray  # int64 (q, k), source rows, -1 where fewer than k
    distances: np.ndarray  # float32 (q, k), ascending, in the metric Index.search reports
    stats: dict[str, np.ndarray] = field(default_factory=dict)  # per query
    per_shard: dict[str, np.ndarray] = field(default_factory=dict)  # per shard, summed over the queries
    # Per query: the router's numbers of the probed lists no live shard could search (empty: a full answer).
    missing_lists: list[np.ndarray] = field(default_factory=list)
    missing_shards: list[int] = field(default_factory=list)  # down shards whose fresh tier went unsearched
    docs: dict[int, tuple] = field(default_factory=dict)  # id -> (name, text, metadata, vector), when asked

    @property
    def partial(self) -> bool:
        return bool(self.missing_shards) or any(len(m) for m in self.missing_lists)


class RouterSearch:
    """ShardedIndex's vector search (mixed into it: it reads the router's state and calls its shards through
    ShardedIndex's plumbing, sharded/router.py)."""

    def probe(self, q: np.ndarray, p: SearchParams, passing: float = 1.0):
        """(lists int32 (q, m), -1 where cut; their count per query): as Index probes (p.probe 'ratio', the
        distance-ratio rule, or 'learned', the router's probe model), widened by the share passing a filter."""
        lists, probed, _ = self.nav.probe(q, p, passing)
        return lists, probed

    def _passing(self, reads: ShardReads | None) -> float:
        """The share of the shards' built vectors a search's filter passes (1.0 without one), from one round to the
        live shards: each counts its own (a replicated list's vectors on both of its shards, on both sides of the
        share). Shards down are left out of the sums."""
        if reads is None or reads.where is None:
            return 1.0
        got, _ = self._round([ShardCall(s, "passing", (reads.where,)) for s in range(self.n_shards) if self.alive[s]])
        passing, total = (sum(v) for v in zip(*got.values())) if got else (0, 0)
        return max(passing, 1) / total if total else 1.0

    def _dispatch(self, q: np.ndarray, lo: int, lists: np.ndarray, k: int, p: SearchParams, fresh: bool,
                  stats: dict, per_shard: dict, missing: list[set],
                  reads: ShardReads | None = None) -> list[Dispatched]:
        """Send one batch's lists (the router's numbers, (b, m), -1 where none) to the live shards holding them,
        one call per shard; with fresh, every query also to each live shard with a fresh tier. Returns the
        calls in flight, one a shard."""
        with self._lock:
            shard, planned = self.route(lists)
            self.outstanding += planned
        miss = shard == MISSING
        for r in np.flatnonzero(miss.any(axis=1)):
            missing[lo + r].update(lists[r][miss[r]].tolist())
        calls = []
        for s in range(self.n_shards):
            on = shard == s
            # A filter's documents may be on any shard: it asks every one.
            with_fresh = fresh and self.alive[s] and (self.fresh_count[s] > 0 or
                                                      (reads is not None and reads.where is not None))
            rows = np.arange(len(lists)) if with_fresh else np.flatnonzero(on.any(axis=1))
            if not len(rows):
                continue
            width = max(1, int(on[rows].sum(axis=1).max()))
            local = np.full((len(rows), width), -1, dtype=np.int32)
            sub, sub_on = lists[rows], on[rows]
            col = np.cumsum(sub_on, axis=1) - 1
            r, c = np.nonzero(sub_on)
            replica = (self.list_shards[sub[r, c], 1] == s).astype(np.int64)
            local[r, col[r, c]] = self.list_local[sub[r, c], replica]
            stats["shards_probed"][lo + rows] += 1
            per_shard["queries"][s] += len(rows)
            per_shard["lists"][s] += int(sub_on.sum())
            per_shard["work"][s] += int(planned[s])
            extra = () if reads is None else (reads,)
            handle = self._send(ShardCall(s, "search", (q[lo + rows], local, k, p, *extra)))
            calls.append(Dispatched(s, lo + rows, handle, int(planned[s]), sub_on))
        return calls

    def _fresh_unreachable(self) -> list[int]:
        """Down shards holding fresh rows no live shard also holds. Searches call it while writes change the
        fresh rows' owners: it reads the groups of owners under _lock, which writes take to change them."""
        if self.alive.all():
            return []
        with self._lock:
            groups, alive = list(self.fresh_groups), self.alive.copy()
        return sorted({o for owners in groups if not alive[list(owners)].any() for o in owners})

    def search(self, queries, k: int = 10, params: SearchParams | None = None, probe: str | None = None,
               probe_scale: float | None = None, partial: bool = True, reads: ShardReads | None = None,
               _again: bool = True, _passing: float | None = None, **overrides) -> ShardedResult:
        """Top-k of each query over every shard's index and fresh tier, with exact distances (as Index.search
        reports them). probe, probe_scale: SearchParams' (as overrides): 'ratio' (the distance-ratio rule, as
        Index) or 'learned' (learned pruning; probe_scale x the predicted lists).
        A shard that does not answer (its actor died) is marked down and its lists are sent to their other
        replica; lists no live shard holds are reported per query (missing_lists) and, partial=False, raise
        UnavailableError instead.
        stats per query: lists_probed, shards_probed, candidates (PQ-scanned postings), reranked, missing_lists;
        per_shard: queries, lists, work (postings of the lists sent), candidates, seconds. reads: a metadata filter
        the answers must pass, and whether the shards return the answers' documents (ShardedResult.docs); the lists
        probed widen by the share of the shards' vectors it passes (Index.search's passing), counted by one round
        to the shards first."""
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"k must be a positive integer, got {k!r}")
        p = resolve_params(params, self.params).with_overrides(probe=probe, probe_scale=probe_scale, **overrides)
        q = self.prepare_queries(queries)
        nq, S = len(q), self.n_shards
        stats = {key: np.zeros(nq, dtype=np.int64) for key in ("lists_probed", "shards_probed", "candidates",
                                                                "reranked", "missing_lists")}
        per_shard = {key: np.zeros(S, dtype=np.float64 if key == "seconds" else np.int64)
                     for key in ("queries", "lists", "work", "candidates", "seconds")}
        missing: list[set] = [set() for _ in range(nq)]
        missing_shards = set(self._fresh_unreachable())
        jobs = []  # (batch slice, its lists, its calls)
        passing = self._passing(reads) if _passing is None else _passing
        for lo in range(0, nq, self.batch_size):
            sl = slice(lo, min(nq, lo + self.batch_size))
            lists, probed = self.probe(q[sl], p, passing)
            stats["lists_probed"][sl] = probed
            jobs.append((sl, lists, self._dispatch(q, lo, lists, k, p, True, stats, per_shard, missing, reads)))
        ids = np.full((nq, k), -1, dtype=np.int64)
        dists = np.full((nq, k), np.inf, dtype=np.float32)
        errors = []
        docs: dict[int, tuple] = {}
        for sl, lists, calls in jobs:
            parts = []
            n_b = sl.stop - sl.start
            while calls:
                retry = np.full_like(lists, -1)
                for call in calls:
                    s, rows = call.shard, call.rows
                    try:
                        sid, sd, sst, secs, sdocs = self._get(call.handle)
                    except Exception as e:  # noqa: BLE001 - a down shard fails over; others reported below
                        if not is_down(e):
                            errors.append((s, e))
                            continue
                        self._mark_down(s)
                        retry[rows - sl.start] = np.where(call.lists_sent, lists[rows - sl.start],
                                                          retry[rows - sl.start])
                        missing_shards.update(self._fresh_unreachable())
                        continue
                    finally:
                        with self._lock:
                            self.outstanding[s] -= call.work
                    full_ids = np.full((n_b, k), -1, dtype=np.int64)
                    full_d = np.full((n_b, k), np.inf, dtype=np.float32)
                    full_ids[rows - sl.start], full_d[rows - sl.start] = sid, sd
                    parts.append((full_ids, full_d))
                    docs.update(sdocs or {})
                    stats["candidates"][rows] += sst["candidates"]
                    stats["reranked"][rows] += sst["reranked"]
                    per_shard["candidates"][s] += int(sst["candidates"].sum())
                    per_shard["seconds"][s] += secs
                # The lists of shards that went down, to their live replicas (fresh tiers were all asked once).
                calls = (self._dispatch(q, sl.start, retry, k, p, False, stats, per_shard, missing, reads)
                         if (retry >= 0).any() else [])
            if parts:
                ids[sl], dists[sl] = merge_topk(parts, k)
        if errors:
            s, e = errors[0]
            raise UnavailableError(f"{self.path}: shard {part_name(s)} did not answer: {e}") from e
        short = np.flatnonzero((ids >= 0).sum(1) < k) if _again and reads is not None and reads.where is not None \
            else np.empty(0, np.int64)
        if len(short):
            # Vectors a filter excludes can empty the lists probed: queries left short probe every list, as a
            # collection's do (Collection._search_main), the ratio rule off (it would still cut the far ones).
            again = self.search(q[short], k, p.with_overrides(nprobe=len(self.list_shards), probe="ratio",
                                                             probe_ratio=0.0), partial=True, reads=reads, _again=False,
                                _passing=passing)
            ids[short], dists[short] = again.ids, again.distances
            docs.update(again.docs or {})
            for key in ("candidates", "reranked", "lists_probed"):
                stats[key][short] += again.stats[key]
            for i, m in zip(short.tolist(), again.missing_lists):
                missing[i] = set(m.tolist())
            missing_shards.update(again.missing_shards)
        missing_lists = [np.array(sorted(m), dtype=np.int32) for m in missing]
        stats["missing_lists"][:] = [len(m) for m in missing_lists]
        res = ShardedResult(ids, dists, stats, per_shard, missing_lists, sorted(missing_shards), docs)
        if res.partial and not partial:
            down = [part_name(s) for s in np.flatnonzero(~self.alive)]
            why = [f"{int((stats['missing_lists'] > 0).sum())} queries need posting lists no live shard holds "
                   f"({sum(map(len, missing_lists))} lists)"] if stats["missing_lists"].any() else []
            why += [f"fresh rows only {', '.join(part_name(s) for s in sorted(missing_shards))} held"] \
                if missing_shards else []
            raise UnavailableError(f"{self.path}: {'; '.join(why)}; down: {', '.join(down) or 'none'}")
        return res
