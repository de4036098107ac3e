"""One shard part, opened (ShardServer): its index generations, searches of the lists it is sent, its writes
and merges, its documents. A Ray actor in Ray mode, an object in this process otherwise."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusionrag.retriever import dirlock
from fusionrag.retriever.collection import tombstones
from fusionrag.retriever.collection.config import CollectionConfig
from fusionrag.retriever.collection.generations import gen_dir_name
from fusionrag.retriever.collection.docstore import query_words
from fusionrag.retriever.collection.fresh import FreshView
from fusionrag.retriever.engine.calibrate import page_rows
from fusionrag.retriever.engine.config import BuildConfig, EngineConfig, SearchParams
from fusionrag.retriever.engine.learned_probe import exact_topk
from fusionrag.retriever.engine.queries import PreparedQueries
from fusionrag.retriever.errors import IndexFormatError
from fusionrag.retriever.sharded.actors import ray_active
from fusionrag.retriever.sharded.generations import (LIST_WRITES, NO_SPLIT_FACTOR, current_part, load_global_ids,
                                                     manifest_sha, publish)
from fusionrag.retriever.sharded.parts import SHARD_LOCK, ShardDown, merge_topk
from fusionrag.retriever.sharded.writes import DELETE, UPSERT, UPSERT_DOCS, ShardWrites

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Query path

MISSING = -2  # route(): no live shard holds the list


@dataclass(frozen=True)
class ShardReads:
    """What a shard's search is asked besides the top-k: a compiled metadata filter (filters.compile_filter) the
    answers must pass, and whether to return the answers' documents (with their vectors). exact_max: a filter at
    most this many of the shard's documents pass is answered exactly over their vectors (the collection's
    filter_exact_max, CollectionConfig)."""
    where: tuple[str, list] | None = None
    with_docs: bool = False
    with_vectors: bool = False
    exact_max: int = CollectionConfig().filter_exact_max




class _Generation:
    """One index generation of a shard, opened, and the searches reading it."""

    def __init__(self, number: int, path: Path, index, global_ids: np.ndarray):
        self.number, self.path, self.index, self.global_ids = number, path, index, global_ids
        self.readers = 0
        self.retired = False
        self.list_writes: dict[int, int] = {}  # upserts per router list that a merged generation holds


def sum_text_stats(counts: list[tuple[int, int, list[list[int]]]], n_texts: int) -> tuple[int, int, list[list[int]]]:
    """Stores' DocStore.text_stats summed: the collection's BM25 statistics (documents, tokens, per text the
    documents each query word matches)."""
    return (sum(c[0] for c in counts), sum(c[1] for c in counts),
            [[sum(words) for words in zip(*(c[2][i] for c in counts))] for i in range(n_texts)])


def best_text_hits(found: list[tuple[np.ndarray, np.ndarray]], limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Stores' (ids, bm25 scores) for one text merged: the `limit` best (lowest score, then id), a document
    that several stores hold once, with its best score."""
    best: dict[int, float] = {}
    for ids, scores in found:
        for d, sc in zip(ids.tolist(), scores.tolist()):
            if d not in best or sc < best[d]:
                best[d] = sc
    order = sorted(best.items(), key=lambda item: (item[1], item[0]))[:limit]
    return np.asarray([d for d, _ in order], np.int64), np.asarray([sc for _, sc in order], np.float64)


class ShardServer:
    """One shard part, opened: the lists it is sent, filtered and re-ranked by Index.search_lists, its
    top-k as source rows with exact distances, merged with its fresh tier's exact top-k; its writes logged
    (writes.ShardWrites); its fresh tier folded into a new generation of its index by merge()
    (sharded/generations.py). A Ray actor in Ray mode (calls in threads of its own), an object in this process else.
    Thread-safe: searches run at once, writes and merges one at a time."""

    def __init__(self, path: str, config: EngineConfig | None = None, params: SearchParams | None = None,
                 lock_wait_s: float = 0.0):
        """lock_wait_s: how long to wait for another process that has this shard open to let go of it (one being
        killed, when a shard is restarted) before refusing with ConflictError: two processes writing one shard's
        log and generations would lose acknowledged writes."""
        self.path, self.config, self.params = str(path), config, params
        self.closed = False
        self._lock = threading.Lock()  # the current generation, its writes, the readers of each
        self._write_lock = threading.RLock()  # writes, and a merge's switch to its generation
        self._merge_lock = threading.Lock()
        held = dirlock.hold(Path(path) / SHARD_LOCK, lambda holder: (
            f"{path}: this shard is already open ({holder}), and whoever opened it writes its log and generations; "
            "close or stop that one first (another router serving this index?)"), lock_wait_s)
        # Let go by close(), or when this object is collected unclosed.
        self._let_go = weakref.finalize(self, os.close, held)
        try:
            gen, rec = self._open_generation()
            try:
                self.writes = ShardWrites(path, gen.global_ids, gen.index.dim, gen.index.metric,
                                          merged_lsn=int(rec["merged_lsn"]) if rec else 0,
                                          list_writes=gen.list_writes)
            except BaseException:
                gen.index.close()
                raise
        except BaseException:
            self._let_go()
            raise
        self._gen = gen

    def _open_generation(self, path: Path | None = None) -> tuple[_Generation, dict | None]:
        from fusionrag.retriever.engine.index import Index

        gen_dir, rec = current_part(self.path) if path is None else (path, None)
        index = Index.open(gen_dir, self.config, self.params)
        try:
            ids = load_global_ids(gen_dir)
            if len(ids) != index.count:
                raise IndexFormatError(f"{gen_dir}: global_ids.npy does not hold one row per vector")
        except BaseException:
            index.close()
            raise
        gen = _Generation(int(rec["generation"]) if rec else 0, gen_dir, index, ids)
        if (gen_dir / LIST_WRITES).exists():
            gen.list_writes = {int(a): int(b) for a, b in np.load(gen_dir / LIST_WRITES).tolist()}
        return gen, rec

    @property
    def index(self):
        return self._gen.index

    @property
    def global_ids(self) -> np.ndarray:
        return self._gen.global_ids

    @contextlib.contextmanager
    def _reading(self):
        """(generation, its writes) for one call: the generation stays open until the call is done."""
        if self.closed:
            raise ShardDown(f"{self.path}: shard closed")
        with self._lock:
            g, w = self._gen, self.writes
            g.readers += 1
        try:
            yield g, w
        finally:
            with self._lock:
                g.readers -= 1
                done = g.retired and not g.readers
            if done:
                self._drop(g)

    @staticmethod
    def _drop(g: _Generation) -> None:
        """Close a generation no longer current and no longer read; a merged one's directory goes too."""
        g.index.close()
        if g.number > 0:
            shutil.rmtree(g.path, ignore_errors=True)

    def search(self, queries: np.ndarray, lists: np.ndarray, k: int, params: SearchParams,
               reads: ShardReads | None = None):
        """(ids, distances, stats, seconds, documents): ids are global ids, -1 where fewer than k. A query whose
        lists are all -1 is answered from the fresh tier alone. queries: as the router prepared them
        (ShardedIndex.prepare_queries, which checked and normalised them), searched as they are. reads: a
        compiled metadata filter only the documents it passes may answer, and whether to return the found
        ids' documents (id -> (name, text, metadata, vector or None); None when not asked)."""
        t = time.perf_counter()
        reads = reads or ShardReads()
        with self._reading() as (g, w):
            index, gids = g.index, g.global_ids
            queries = PreparedQueries(np.ascontiguousarray(getattr(queries, "vectors", queries), dtype=np.float32),
                                      index.metric)
            exclude, fresh = w.snapshot()
            nq = len(queries)
            ids = np.full((nq, k), -1, dtype=np.int64)
            dists = np.full((nq, k), np.inf, dtype=np.float32)
            stats = {"candidates": np.zeros(nq, np.int64), "reranked": np.zeros(nq, np.int64)}
            rows = np.flatnonzero((np.asarray(lists) >= 0).any(axis=1))
            fresh_ok = None
            if reads.where is not None:
                allowed = w.store.rows_where(*reads.where) if w.store is not None else np.empty(0, np.int64)
                if len(allowed) <= reads.exact_max:  # few pass: exact, over their vectors in the doc store
                    if len(allowed):
                        rows_, vecs = w.store.vectors_where(*reads.where)
                        view = FreshView(vecs, (vecs * vecs).sum(1), rows_, np.ones(len(rows_), bool))
                        ids, dists = merge_topk([view.search(queries.vectors, k, index.metric)], k)
                    docs = self._documents(g, w, np.unique(ids[ids >= 0]), reads.with_vectors) \
                        if reads.with_docs else None
                    return ids, dists, stats, time.perf_counter() - t, docs
                ok = tombstones.passing(gids, allowed, exclude)
                exclude = tombstones.exclusion(ok)
                if not ok.any():
                    rows = rows[:0]  # no vector of the index passes: its lists hold nothing to find
                fresh_ok = None if fresh is None else np.isin(fresh.rows, allowed)
            if len(rows):
                res = index.search_lists(queries.rows(rows), lists[rows], k, params, exclude)
                ids[rows] = np.where(res.ids >= 0, gids[np.maximum(res.ids, 0)], -1)
                dists[rows] = np.where(res.ids >= 0, res.distances, np.inf)
                for key in stats:
                    stats[key][rows] = res.stats[key]
            if fresh is not None:
                fi, fd = fresh.search(queries.vectors, k, index.metric, fresh_ok)
                ids, dists = merge_topk([(ids, dists), (fi, fd)], k)
            docs = self._documents(g, w, np.unique(ids[ids >= 0]), reads.with_vectors) if reads.with_docs else None
        return ids, dists, stats, time.perf_counter() - t, docs

    # -- writes --------------------------------------------------------------------------------------

    def upsert(self, ids, vectors, docs: list | None = None, lists=None) -> int:
        """Log and apply: these ids now hold these vectors (in the engine's form) in this shard's fresh tier,
        any older version here tombstoned; docs: their (name, text, metadata JSON), kept in the shard's doc store;
        lists: the router's list each was sent for (where a merge puts it). Durable when it returns; how many ids
        had a version here."""
        if self.closed:
            raise ShardDown(f"{self.path}: shard closed")
        with self._write_lock:
            return self.writes.write(UPSERT if docs is None else UPSERT_DOCS, ids, vectors, docs, lists)

    def delete(self, ids) -> int:
        if self.closed:
            raise ShardDown(f"{self.path}: shard closed")
        with self._write_lock:
            return self.writes.write(DELETE, ids)

    def merge(self, threads: int | None = None) -> dict:
        """Fold the fresh tier and the tombstones into a new generation of this shard's index (sharded/generations.py)
        and go on from it. Searches and writes go on meanwhile, on the generation before; writes logged during the
        merge are replayed onto the new one when it takes over. Returns what was merged."""
        from fusionrag.retriever.engine.merge import merge_index

        if self.closed:
            raise ShardDown(f"{self.path}: shard closed")
        t0 = time.perf_counter()
        with self._merge_lock:
            with self._reading() as (g, w):
                lsn, tomb, fresh_ids, fresh_vectors, fresh_lists, list_writes = w.state()
                dead = tombstones.dead(tomb, g.index.count)
                if not len(fresh_ids) and not dead.any():
                    return {"merged": False, "generation": g.number}
                number = g.number + 1
                out = Path(self.path) / gen_dir_name(number)
                shutil.rmtree(out, ignore_errors=True)  # what a merge cut short left
                ids = np.concatenate([g.global_ids[~dead], fresh_ids])
                order = np.argsort(ids, kind="stable")
                lists = np.load(g.path / "lists.npy") if (g.path / "lists.npy").exists() else None
                # Each vector into the list the router sent it for, and only that one: every replica of a list
                # then holds the same vectors. One sent for no list (none of its lists' shards was up) goes to
                # its nearest list here.
                local = {int(r): i for i, r in enumerate(lists)} if lists is not None else {}
                assign = np.array([local.get(r, -1) for r in fresh_lists.tolist()], dtype=np.int64)
                config = BuildConfig.from_dict(g.index.manifest.get("build_config", {})).with_overrides(
                    max_list_factor=NO_SPLIT_FACTOR, threads=threads or 0)

                def extra(wr):
                    wr.save_array("global_ids.npy", ids[order])
                    if lists is not None:
                        wr.save_array("lists.npy", lists)
                    wr.save_array(LIST_WRITES, np.array(sorted(list_writes.items()), dtype=np.int64).reshape(-1, 2))

                stats = merge_index(g.index, dead, fresh_vectors, out, config, progress=False, order=order,
                                    extra=extra, assign=assign)
            rec = {"generation": number, "dir": out.name, "manifest_sha256": manifest_sha(out),
                   "count": len(ids), "merged_lsn": lsn}
            new, _ = self._open_generation(out)
            new.number = number
            with self._write_lock:  # no write until the new generation's writes have replayed those since lsn
                try:
                    publish(Path(self.path), rec)
                    old_w = self.writes
                    old_w.close(keep_store=True)
                    w = ShardWrites(self.path, new.global_ids, new.index.dim, new.index.metric, merged_lsn=lsn,
                                    store=old_w.store, list_writes=new.list_writes)
                except BaseException:
                    new.index.close()
                    raise
                with self._lock:
                    old, self._gen, self.writes = self._gen, new, w
                    old.retired = True
                    done = not old.readers
            if done:
                self._drop(old)
            dropped = w.compact()  # the log's records the generation holds go (writes wait meanwhile)
        return {"merged": True, "log_bytes_dropped": dropped, "generation": number, "count": len(ids), "merged_lsn": lsn,
                "fresh_merged": len(fresh_ids), "removed": int(dead.sum()), "seconds": time.perf_counter() - t0,
                "merge": stats.__dict__}

    # -- documents (sharded/docs.py) ----------------------------------------------------------------

    def documents(self, ids, with_vectors: bool = False) -> dict[int, tuple]:
        """id -> (name, text, metadata, vector or None) of those of these ids live here. A vector written without
        a document (built, or upserted by id alone) is named by its id, with no text and no metadata."""
        with self._reading() as (g, w):
            return self._documents(g, w, np.asarray(ids, dtype=np.int64), with_vectors)

    @staticmethod
    def _documents(g: _Generation, w: ShardWrites, ids: np.ndarray, with_vectors: bool) -> dict[int, tuple]:
        live = ids[w.live(ids)] if len(ids) else ids
        out = w.store.by_rows(live.tolist(), with_vectors) if w.store is not None and len(live) else {}
        rest = [i for i in live.tolist() if i not in out]
        vectors = {}
        if with_vectors and rest:
            vectors = w.fresh_vectors(rest)
            built = [i for i in rest if i not in vectors]
            if built:
                vectors.update(zip(built, g.index.read_vectors(np.searchsorted(g.global_ids, built))))
        for i in rest:
            out[i] = (str(i), None, {}, vectors.get(i))
        return out

    def passing(self, where: tuple[str, list]) -> tuple[int, int]:
        """(vectors of this shard's index a compiled filter passes, not deleted or replaced since; the index's
        vectors): the router widens the lists it probes by the share the shards' sums make (Index.search's
        passing)."""
        with self._reading() as (g, w):
            exclude, _ = w.snapshot()
            n = len(g.global_ids)
            if w.store is None or not n:
                return 0, n
            return int(tombstones.passing(g.global_ids, w.store.rows_where(*where), exclude).sum()), n

    def matching(self, where: tuple[str, list]) -> np.ndarray:
        """Sorted ids of the documents here that pass a compiled filter (only documents written with their
        metadata can)."""
        with self._reading() as (_, w):
            return w.store.rows_where(*where) if w.store is not None else np.empty(0, np.int64)

    def text_stats(self, texts: list[str], counted_by=()) -> tuple[int, int, list[list[int]]]:
        """BM25's counts over this shard's documents (DocStore.text_stats), for the router to sum with those of the
        shards `counted_by`: the documents here one of them owns (a replicated list's) are left out."""
        with self._reading() as (_, w):
            return w.store.text_stats(texts, counted_by) if w.store is not None else \
                (0, 0, [[0] * len(query_words(t)) for t in texts])

    def text_search(self, texts: list[str], limit: int, where: tuple[str, list] | None,
                    stats: tuple[int, int, list[list[int]]] | None = None) -> list[tuple]:
        """Per text, (ids, bm25 scores) of the `limit` live documents here whose texts match it best, best first
        (lower is better): scored with `stats` (every shard's text_stats summed: the scores of one collection
        holding every shard's documents) or, with none, with this shard's own."""
        with self._reading() as (_, w):
            if w.store is None:
                return [(np.empty(0, np.int64), np.empty(0, np.float64)) for _ in texts]
            out = []
            for i, t in enumerate(texts):
                ids, scores = (w.store.text_search(t, limit, where) if stats is None else
                               w.store.global_bm25(t, limit, where, stats[0], stats[1], stats[2][i]))
                live = w.live(ids) if len(ids) else np.zeros(0, bool)
                out.append((ids[live], scores[live]))
            return out

    def page(self, after: int, limit: int, where: tuple[str, list] | None, with_vectors: bool) -> list[tuple]:
        """(id, name, text, metadata, vector or None) of the first `limit` documents here with id > after (those
        a compiled filter passes), in id order."""
        with self._reading() as (g, w):
            if where is not None:
                return w.store.page(after, limit, where, with_vectors) if w.store is not None else []
            ids = w.live_ids(after)[:limit]
            docs = self._documents(g, w, ids, with_vectors)
            return [(i, *docs[i]) for i in ids.tolist() if i in docs]

    def live_ids(self) -> np.ndarray:
        """Sorted ids live here: built and not deleted or replaced since, and written."""
        with self._reading() as (_, w):
            return w.live_ids()

    def exact(self, queries: np.ndarray, k: int, exclude: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global ids, distances) of each query's exact k nearest vectors live here, built (read back from the
        page file) and written (the fresh tier), -1 / inf where fewer; exclude[i]: an id query i may not return
        (-1: none). Calibration's truth, merged at the router, so that no process holds every vector."""
        with self._reading() as (g, w):
            built = np.flatnonzero(~np.isin(g.global_ids, w.tombstoned_ids()))
            fresh = w.fresh_ids().astype(np.int64)
            held = w.fresh_vectors(fresh)
            written = np.array([held[int(i)] for i in fresh], np.float32).reshape(len(fresh), g.index.dim)
            stored = page_rows(g.index)
            ids = np.concatenate([g.global_ids[built].astype(np.int64), fresh])

            def rows(pos: np.ndarray) -> np.ndarray:
                pos = np.asarray(pos, dtype=np.int64)
                out = np.empty((len(pos), g.index.dim), np.float32)
                b = pos < len(built)
                if b.any():
                    out[b] = stored(built[pos[b]])
                if not b.all():
                    out[~b] = written[pos[~b] - len(built)]
                return out

            # The pass in the order the built vectors lie in the page file, then the written ones (exact_topk).
            rows.order = np.concatenate([np.argsort(stored.slots[built], kind="stable"),
                                         np.arange(len(built), len(ids))])
            order = np.argsort(ids, kind="stable")
            exclude = np.asarray(exclude, dtype=np.int64)
            at = np.minimum(np.searchsorted(ids[order], exclude), max(len(ids) - 1, 0))
            mine = (exclude >= 0) & (ids[order][at] == exclude) if len(ids) else np.zeros(len(exclude), bool)
            skip = np.where(mine, order[at], -1)
            found, dist = exact_topk(rows, len(ids), np.asarray(queries, np.float32), k,
                                     g.index.manifest["internal_metric"], exclude=skip, distances=True)
            return np.where(found >= 0, ids[np.maximum(found, 0)], -1), dist

    def field_types(self, key: str) -> set[str]:
        with self._reading() as (_, w):
            return w.store.field_types(key) if w.store is not None else set()

    def field_names(self, limit: int) -> list[str]:
        """The metadata keys its documents hold (DocStore.field_names)."""
        with self._reading() as (_, w):
            return w.store.field_names(limit) if w.store is not None else []

    def write_state(self) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, list[str]], dict[int, int]]:
        """(ids live in the fresh tier, base ids tombstoned, (ids, names) of the documents here, upserts logged per
        router list): what the router's write maps are built from."""
        with self._reading() as (_, w):
            return w.fresh_ids(), w.tombstoned_ids(), w.named(), dict(w.list_writes)

    def where(self) -> dict:
        import os

        node = None
        if ray_active():
            import ray

            node = ray.get_runtime_context().get_node_id()
        with self._reading() as (g, w):
            mem = g.index.memory()
            # The filter tier this shard's process runs: the GPU's where CUDA shows it one (Ray leaves
            # CUDA_VISIBLE_DEVICES as the node has it for an actor that reserves no GPU), under this process's
            # gpu_budget_bytes.
            return {"pid": os.getpid(), "node_id": node, "count": g.index.count, "path": self.path,
                    "generation": g.number, "pq_tier": mem["pq_tier"], "pq_bytes": mem["pq_bytes"],
                    "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "memory": {k: v for k, v in mem.items() if k.endswith("_bytes") and isinstance(v, int)},
                    **w.info()}

    def close(self) -> None:
        self.closed = True
        with self._write_lock, self._merge_lock:
            self.writes.close()
            with self._lock:
                g = self._gen
                g.retired = True
                done = not g.readers
            self._let_go()  # nothing of this process writes the shard any more
        if done:
            g.index.close()
