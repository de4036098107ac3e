"""Writes to one shard of a sharded index (docs/sharded.md, "Writes"): a local store (retriever/collection/store.py),
the one a collection is made of, over the shard part's directory.

A shard part's directory gains `wal.log` at its first write. Each record is an upsert (ids, vectors in the
engine's form, the router's list of each, and the documents where the write carries them) or a delete (ids),
logged in the store's one format (records.StoreRecord; logs written before hold the shard's v1 format, read as
ever), group-committed before the shard acknowledges it, and replayed when the shard is opened again (after a
crash, or when its actor is re-created from its directory). In memory, the store's live set:

- the fresh tier (retriever/collection/fresh.py): vectors upserted to this shard, searched exactly;
- tombstones: the shard index's own vectors deleted or replaced since the build (a bitmap the filter
  tier skips, as a collection's tombstones are);

and the documents' names, texts and metadata (`docs.sqlite`, the doc store, retriever/collection/docstore.py, its
rows the index's ids), for the documents written with them (sharded/docs.py): made at the first such write, each
write applied to it in a transaction that records the log sequence number it applied, so replay after a crash
applies exactly the records it lacks. A write the doc store cannot hold is set aside, as a collection's is.

Ids are the index's ids: source rows for the built vectors, any non-negative int64 for new ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fusionrag.retriever.collection.docstore import DocStore
from fusionrag.retriever.collection.fresh import FreshView
from fusionrag.retriever.collection.records import StoreRecord
from fusionrag.retriever.collection.store import DOCS, WAL, LiveSet, LocalStore
from fusionrag.retriever.errors import InputError

__all__ = ["DOCS", "WAL", "UPSERT", "UPSERT_DOCS", "DELETE", "ShardWrites"]

# Ops as callers name them: an upsert, one with documents, a delete.
UPSERT, UPSERT_DOCS, DELETE = b"u", b"U", b"d"
# A document as a write carries it: (name, text or None, metadata as JSON text), and a fourth field where another
# shard counts it in BM25's statistics (a replicated list's other replica, which took the write first): that
# shard's number (DocStore.mark_text_guests).
DocFields = tuple


class ShardWrites(LocalStore):
    """The local store of one shard part: its log, fresh tier, tombstones and doc store. base_ids: the global id of
    each vector of the shard's index (ascending, as global_ids.npy holds them); metric: the index's (fresh
    distances). merged_lsn: the log's records up to it are in the index generation already (a merge folded them
    in): replayed into the doc store where it lacks them, not into the fresh tier or the tombstones (and compact()
    drops them). store: the part's doc store, already open (a new generation takes over its predecessor's).
    list_writes: the upserts per router list up to merged_lsn (what the generation recorded)."""

    def __init__(self, path, base_ids: np.ndarray, dim: int, metric: str, merged_lsn: int = 0,
                 store: DocStore | None = None, list_writes: dict[int, int] | None = None):
        path = Path(path)
        if store is None and (path / DOCS).exists():
            store = DocStore(path / DOCS, dim)
        super().__init__(path, dim, metric, f"shard {path}", legacy="shard", assigns_keys=False, store=store,
                         live=LiveSet(base_ids, dim), merged_lsn=merged_lsn)
        self.replayed = 0
        self.fresh_list: dict[int, int] = {}  # fresh id -> the router's list it was written to (-1: none known)
        self.list_writes: dict[int, int] = dict(list_writes or {})  # router list -> upserts to it this shard logged
        self.applied_hook = self._lists_applied
        try:
            if (self.path / WAL).exists():
                self.replayed = self.replay(self.open_log(), memory=True)
        except BaseException:
            self.close()
            raise

    @property
    def deleted(self) -> int:
        """Base vectors tombstoned."""
        return self.live_set.dead

    def _lists_applied(self, w: StoreRecord) -> None:
        """The router's list of each fresh id, and the upserts per router list since the build (every record,
        merged or not): a replica of a list that missed writes counts fewer than its twin (the router then reads
        the list from the twin)."""
        for i in w.keys.tolist():
            self.fresh_list.pop(i, None)
        if w.op == "upsert":
            self.fresh_list.update(zip(w.keys.tolist(), w.lists.tolist()))
            lists = w.lists[w.lists >= 0]
            for lst, n in zip(*np.unique(lists, return_counts=True)):
                self.list_writes[int(lst)] = self.list_writes.get(int(lst), 0) + int(n)

    def write(self, op: bytes, ids, vectors=None, docs: list[DocFields] | None = None, lists=None) -> int:
        """Log (fsynced) then apply one write; returns how many of the ids were live here before. docs: with
        op UPSERT_DOCS, one (name, text, metadata JSON[, the shard counting it in BM25]) per id. lists: with an
        upsert, the router's list each vector was sent for (-1: none; a merge then puts it in its nearest list
        here)."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if len(np.unique(ids)) != len(ids) or (ids < 0).any():
            raise InputError("a write's ids must be distinct non-negative integers")
        if op == DELETE:
            return self.commit(StoreRecord("delete", keys=ids))
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.shape != (len(ids), self.dim):
            raise InputError(f"upsert needs ({len(ids)}, {self.dim}) vectors, got {vectors.shape}")
        if op == UPSERT_DOCS and (docs is None or len(docs) != len(ids)):
            raise InputError("an upsert with documents needs one document per id")
        lists = np.full(len(ids), -1, np.int64) if lists is None else np.asarray(lists, np.int64).ravel()
        if lists.shape != ids.shape:
            raise InputError("an upsert needs one list per id")
        w = StoreRecord("upsert", vectors=vectors, keys=ids, lists=lists)
        if op == UPSERT_DOCS:
            w.ids, w.texts, w.metas = ([d[i] for d in docs] for i in range(3))
            guests = [int(d[3]) if len(d) == 4 else -1 for d in docs]
            w.guests = guests if any(g >= 0 for g in guests) else None
        return self.commit(w)

    def live(self, ids: np.ndarray) -> np.ndarray:
        """Which ids have a live version on this shard (base or fresh)."""
        with self.mem_lock:
            return self.live_set.live(ids)

    def snapshot(self) -> tuple[np.ndarray | None, FreshView | None]:
        """What a search reads: the tombstones (None when there are none) and the fresh tier's view (None when
        empty). The bitmap is the live set's own: it is replaced on write, never written in place."""
        with self.mem_lock:
            tomb, dead, fresh = self.live_set.view()
            return (tomb if dead else None, fresh if self.live_set.fresh.live_count else None)

    def fresh_ids(self) -> np.ndarray:
        with self.mem_lock:
            return self.live_set.fresh.live_items()[0]

    def tombstoned_ids(self) -> np.ndarray:
        with self.mem_lock:
            return self.live_set.dead_keys()

    def live_ids(self, after: int = -1) -> np.ndarray:
        """Sorted ids live on this shard (base not tombstoned, and fresh) above `after`."""
        with self.mem_lock:
            return self.live_set.live_keys(after)

    def fresh_vectors(self, ids: np.ndarray) -> dict[int, np.ndarray]:
        """id -> vector for the ids held by the fresh tier."""
        with self.mem_lock:
            return self.live_set.fresh.vectors_of(np.asarray(ids, dtype=np.int64).tolist())

    def named(self) -> tuple[np.ndarray, list[str]]:
        """(ids, names) of the documents in the doc store: what the router's name map is built from."""
        if self.store is None:
            return np.empty(0, np.int64), []
        return self.store.names()

    def info(self) -> dict:
        return {"fresh": int(self.live_set.fresh.live_count), "tombstones": int(self.deleted),
                "log_bytes": int(self.wal.bytes) if self.log_open else 0, "replayed": self.replayed,
                "documents": self.store.count() if self.store is not None else 0,
                "set_aside": self.set_aside_count}  # writes the doc store could not hold (LocalStore._set_aside)

    @property
    def last_lsn(self) -> int:
        return self.next_lsn - 1

    def state(self) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, int]]:
        """(last lsn, tombstone bitmap, fresh ids, their vectors, their router lists, upserts per router list) as
        of now, taken together: what a merge folds in. Every logged record is applied first."""
        with self.lock:
            if self.log_open:
                self.settle()
            with self.mem_lock:
                ids, vectors = self.live_set.fresh.live_items()
                lists = np.array([self.fresh_list.get(i, -1) for i in ids.tolist()], dtype=np.int64)
                return self.next_lsn - 1, self.live_set.tomb.copy(), ids, vectors, lists, dict(self.list_writes)

    def compact(self) -> int:
        """Drop the log's records up to merged_lsn, which the index generation holds (LocalStore.compact).
        Returns the bytes dropped."""
        with self.lock:
            if not self.merged_lsn:
                return 0
            return super().compact(self.merged_lsn)

    def close(self, keep_store: bool = False) -> None:
        """keep_store: the doc store stays open (handed on to the next generation's ShardWrites)."""
        with self.lock:  # a write being logged is, first
            super().close(keep_store)
