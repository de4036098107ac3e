"""Writes to one shard of a sharded index (docs/sharded.md, "Writes"): the shard's own log and fresh tier.

A shard part's directory gains `wal.log` (the collection's log format, retriever/collection/wal.py) at its first
write. Each record is an upsert (ids, vectors in the engine's form) or a delete (ids); a write is
appended and fsynced before the shard acknowledges it, and replayed in order when the shard is opened
again (after a crash, or when its actor is re-created from its directory). In memory:

- the fresh tier (retriever/collection/fresh.py): vectors upserted to this shard, searched exactly;
- tombstones: the shard index's own vectors deleted or replaced since the build (a bitmap the filter
  tier skips, as a collection's tombstones are);
- the documents' names, texts and metadata (`docs.sqlite`, a collection's doc store, retriever/collection/docstore.py, its
  rows the index's ids), for the documents written with them (sharded/docs.py): made at the first such write,
  each write applied to it in the write's own transaction with the log sequence number it applied, so replay
  after a crash applies exactly the records it lacks.

Ids are the index's ids: source rows for the built vectors, any non-negative int64 for new ones.
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection import tombstones
from fusionrag.retriever.collection.docstore import DocStore
from fusionrag.retriever.collection.fresh import FreshTier, FreshView
from fusionrag.retriever.collection.wal import WriteAheadLog
from fusionrag.retriever.errors import IndexFormatError, InputError, StorageError

WAL = "wal.log"
DOCS = "docs.sqlite"
_HEAD = struct.Struct("<cII")  # op, count, dim
# Ops as callers name them. In the log: b"l" an upsert (ids, vectors, the router's list of each), b"U" one with
# documents (the same, then the documents as JSON), b"d" a delete (ids); b"u", an upsert without lists, is read
# as logs from before lists were recorded hold it.
UPSERT, UPSERT_DOCS, DELETE = b"u", b"U", b"d"
_LISTED = b"l"
# A document as a write carries it: (name, text or None, metadata as JSON text), and a fourth field where another
# shard counts it in BM25's statistics (a replicated list's other replica, which took the write first): that
# shard's number (DocStore.mark_text_guests). Logs from before owners were recorded hold three.
DocFields = tuple


def encode(op: bytes, ids: np.ndarray, vectors: np.ndarray | None = None, docs: list | None = None,
           lists: np.ndarray | None = None) -> bytes:
    """lists: for an upsert, the router's list each vector went to (-1: none known)."""
    ids = np.ascontiguousarray(ids, dtype="<i8")
    body = ids.tobytes()
    dim = 0
    if op in (UPSERT, UPSERT_DOCS):
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        dim = vectors.shape[1]
        lists = np.full(len(ids), -1) if lists is None else lists
        body += vectors.tobytes() + np.ascontiguousarray(lists, dtype="<i4").tobytes()
        op = _LISTED if op == UPSERT else op
    if op == UPSERT_DOCS:
        body += json.dumps([list(d) for d in docs], ensure_ascii=False, separators=(",", ":")).encode()
    return _HEAD.pack(op, len(ids), dim) + body


def decode(payload: bytes) -> tuple[bytes, np.ndarray, np.ndarray | None, list[DocFields] | None, np.ndarray | None]:
    """(op as callers name it, ids, vectors, documents, lists: -1 where the record has none)."""
    op, n, dim = _HEAD.unpack_from(payload)
    pos = _HEAD.size
    end = pos + n * 8 + n * dim * 4 + (n * 4 if op in (_LISTED, UPSERT_DOCS) else 0)
    if op not in (UPSERT, _LISTED, UPSERT_DOCS, DELETE) or len(payload) < end or \
            (op != UPSERT_DOCS and len(payload) != end):
        raise IndexFormatError("a shard log record is garbled")
    ids = np.frombuffer(payload, "<i8", n, pos).astype(np.int64)
    vectors = np.frombuffer(payload, "<f4", n * dim, pos + n * 8).reshape(n, dim).copy() if op != DELETE else None
    lists = None
    if op != DELETE:
        lists = np.frombuffer(payload, "<i4", n, pos + n * 8 + n * dim * 4).astype(np.int64) \
            if op in (_LISTED, UPSERT_DOCS) else np.full(n, -1, np.int64)
    docs = None
    if op == UPSERT_DOCS:
        try:
            docs = [tuple(d) for d in json.loads(payload[end:])]
        except ValueError:
            raise IndexFormatError("a shard log record's documents are garbled") from None
        if len(docs) != n or not all(len(d) == 3 or (len(d) == 4 and type(d[3]) is int) for d in docs):
            raise IndexFormatError("a shard log record's documents are garbled")
    return UPSERT if op == _LISTED else op, ids, vectors, docs, lists


class ShardWrites:
    """The log, fresh tier and tombstones of one shard part. base_ids: the global id of each vector of the
    shard's index (ascending, as global_ids.npy holds them); metric: the index's (fresh distances).
    merged_lsn: the log's records up to it are in the index generation already (a merge folded them in):
    replayed into the doc store where it lacks them, not into the fresh tier or the tombstones (and compact()
    drops them). store: the part's doc store, already open (a new generation takes over its predecessor's).
    list_writes: the upserts per router list up to merged_lsn (what the generation recorded)."""

    def __init__(self, path, base_ids: np.ndarray, dim: int, metric: str, merged_lsn: int = 0,
                 store: DocStore | None = None, list_writes: dict[int, int] | None = None):
        self.path = Path(path)
        self.base_ids, self.dim, self.metric = np.asarray(base_ids, dtype=np.int64), dim, metric
        self.fresh = FreshTier(dim)
        self.tomb = tombstones.empty(len(self.base_ids))
        self.deleted = 0  # base vectors tombstoned
        self._lock = threading.Lock()  # the state searches read (snapshot) and writes change
        self._writing = threading.Lock()  # writers, one at a time: held through a write's fsync
        self._wal: WriteAheadLog | None = None
        self._next_lsn = 1
        self.replayed = 0
        self.merged_lsn = merged_lsn
        self.fresh_list: dict[int, int] = {}  # fresh id -> the router's list it was written to (-1: none known)
        self.list_writes: dict[int, int] = dict(list_writes or {})  # router list -> upserts to it this shard logged
        self.store: DocStore | None = store if store is not None else \
            DocStore(self.path / DOCS, dim) if (self.path / DOCS).exists() else None
        try:
            if (self.path / WAL).exists():
                self._open_log()
        except BaseException:
            if self.store is not None:
                self.store.close()
            raise

    def _open_log(self) -> None:
        wal = WriteAheadLog(self.path / WAL)
        try:
            records = wal.open()
            done = self.store.meta("applied_lsn") if self.store is not None else 0
            for lsn, payload in records:
                op, ids, vectors, docs, lists = decode(payload)
                if lsn > done and (self.store is not None or op == UPSERT_DOCS):
                    self._apply_store(lsn, op, ids, vectors, docs)  # a write the store had not applied
                if lsn > self.merged_lsn:
                    self._count_lists(lists)
                    self._apply(op, ids, vectors, lists)
        except BaseException:
            wal.close()
            raise
        self._wal = wal
        self._next_lsn = max(records[-1][0] + 1 if records else 1, self.merged_lsn + 1)
        self.replayed = sum(1 for lsn, _ in records if lsn > self.merged_lsn)

    def _apply_store(self, lsn: int, op: bytes, ids: np.ndarray, vectors, docs) -> None:
        """One write to the doc store, in one transaction that records its lsn: the ids' documents removed, those
        it carries inserted. The store is made at the first write that carries documents."""
        if self.store is None:
            self.store = DocStore(self.path / DOCS, self.dim, create=True)
        s = self.store
        try:
            s.begin()
            s.remove_rows(ids.tolist())
            if op == UPSERT_DOCS:
                names, texts, metas = zip(*(d[:3] for d in docs))
                s.insert(ids.tolist(), names, texts, metas, np.asarray(vectors, dtype=np.float32))
                guests = [(i, int(d[3])) for i, d in zip(ids.tolist(), docs) if len(d) == 4]
                if guests:
                    s.mark_text_guests(*zip(*guests))
            s.commit(lsn, 0)
        except BaseException:
            s.rollback()
            raise

    def _apply(self, op: bytes, ids: np.ndarray, vectors: np.ndarray | None, lists: np.ndarray | None) -> None:
        self.deleted += tombstones.mark(self.tomb, tombstones.positions(self.base_ids, ids))
        self.fresh.remove(ids.tolist())
        for i in ids.tolist():
            self.fresh_list.pop(i, None)
        if op != DELETE:
            self.fresh.add(ids, vectors)
            self.fresh_list.update(zip(ids.tolist(), lists.tolist()))

    def _count_lists(self, lists: np.ndarray | None) -> None:
        """Upserts per router list, since the build (every record, merged or not): a replica of a list that
        missed writes counts fewer than its twin (the router then reads the list from the twin)."""
        if lists is not None:
            for lst, n in zip(*np.unique(lists[lists >= 0], return_counts=True)):
                self.list_writes[int(lst)] = self.list_writes.get(int(lst), 0) + int(n)

    def write(self, op: bytes, ids, vectors=None, docs: list[DocFields] | None = None, lists=None) -> int:
        """Log (fsynced) then apply one write; returns how many of the ids were live here before. docs: with
        op UPSERT_DOCS, one (name, text, metadata JSON[, the shard counting it in BM25]) per id. lists: with an
        upsert, the router's list each vector was sent for (-1: none; a merge then puts it in its nearest list
        here)."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if len(np.unique(ids)) != len(ids) or (ids < 0).any():
            raise InputError("a write's ids must be distinct non-negative integers")
        if op in (UPSERT, UPSERT_DOCS):
            vectors = np.asarray(vectors, dtype=np.float32)
            if vectors.shape != (len(ids), self.dim):
                raise InputError(f"upsert needs ({len(ids)}, {self.dim}) vectors, got {vectors.shape}")
        if op == UPSERT_DOCS and (docs is None or len(docs) != len(ids)):
            raise InputError("an upsert with documents needs one document per id")
        if op != DELETE:
            lists = np.full(len(ids), -1, np.int64) if lists is None else np.asarray(lists, np.int64).ravel()
            if lists.shape != ids.shape:
                raise InputError("an upsert needs one list per id")
        with self._writing:  # one write at a time, in log order
            with self._lock:
                if self._wal is None:
                    self._open_log()
                lsn = self._next_lsn
                try:
                    offset = self._wal.append(lsn, encode(op, ids, vectors, docs, lists))
                except OSError as e:
                    raise StorageError(f"{self.path}: cannot write the shard's log: {e}") from e
            # The fsync outside the lock a search's snapshot takes: searches go on meanwhile, reading the state
            # before this write, which is not acknowledged yet (the lock was held through the fsync before).
            try:
                self._wal.sync(lsn, lambda: lsn)
            except BaseException as e:
                with self._lock:
                    self._wal.cut(offset)  # not acknowledged: not in the log either
                raise self._storage(e)
            with self._lock:
                try:
                    if self.store is not None or op == UPSERT_DOCS:
                        self._apply_store(lsn, op, ids, vectors, docs)
                except BaseException as e:
                    self._wal.cut(offset)
                    raise self._storage(e)
                self._next_lsn += 1
                live = self.live(ids)
                self._count_lists(lists if op != DELETE else None)
                self._apply(op, ids, vectors, lists if op != DELETE else None)
                return int(live.sum())

    def _storage(self, e: BaseException) -> BaseException:
        """An OSError as the StorageError a caller answers 507 to; anything else as it is."""
        if isinstance(e, OSError):
            err = StorageError(f"{self.path}: cannot write the shard's log: {e}")
            err.__cause__ = e
            return err
        return e

    def live(self, ids: np.ndarray) -> np.ndarray:
        """Which ids have a live version on this shard (base or fresh)."""
        ids = np.asarray(ids, dtype=np.int64)
        out = self.fresh.contains(ids)
        pos = np.searchsorted(self.base_ids, ids)
        inside = pos < len(self.base_ids)
        at = np.minimum(pos, max(len(self.base_ids) - 1, 0))
        if not len(self.base_ids):
            return out
        return out | (inside & (self.base_ids[at] == ids) & ~tombstones.dead_at(self.tomb, at))

    def snapshot(self) -> tuple[np.ndarray | None, FreshView | None]:
        """What a search reads: the tombstones (None when there are none) and the fresh tier's view."""
        with self._lock:
            return (self.tomb.copy() if self.deleted else None,
                    self.fresh.view() if self.fresh.live_count else None)

    def fresh_ids(self) -> np.ndarray:
        with self._lock:
            return self.fresh.live_items()[0]

    def tombstoned_ids(self) -> np.ndarray:
        with self._lock:
            return self.base_ids[tombstones.dead(self.tomb, len(self.base_ids))]

    def live_ids(self, after: int = -1) -> np.ndarray:
        """Sorted ids live on this shard (base not tombstoned, and fresh) above `after`."""
        with self._lock:
            bits = tombstones.dead(self.tomb, len(self.base_ids))
            fresh = self.fresh.live_items()[0]
        base = self.base_ids[~bits]
        out = np.union1d(base[base > after], fresh[fresh > after])
        return out.astype(np.int64)

    def fresh_vectors(self, ids: np.ndarray) -> dict[int, np.ndarray]:
        """id -> vector for the ids held by the fresh tier."""
        with self._lock:
            return self.fresh.vectors_of(np.asarray(ids, dtype=np.int64).tolist())

    def named(self) -> tuple[np.ndarray, list[str]]:
        """(ids, names) of the documents in the doc store: what the router's name map is built from."""
        if self.store is None:
            return np.empty(0, np.int64), []
        return self.store.names()

    def info(self) -> dict:
        return {"fresh": int(self.fresh.live_count), "tombstones": int(self.deleted),
                "log_bytes": int(self._wal.bytes) if self._wal else 0, "replayed": self.replayed,
                "documents": self.store.count() if self.store is not None else 0}

    @property
    def last_lsn(self) -> int:
        return self._next_lsn - 1

    def state(self) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, int]]:
        """(last lsn, tombstone bitmap, fresh ids, their vectors, their router lists, upserts per router list) as
        of now, taken together: what a merge folds in."""
        with self._lock:
            ids, vectors = self.fresh.live_items()
            lists = np.array([self.fresh_list.get(i, -1) for i in ids.tolist()], dtype=np.int64)
            return self._next_lsn - 1, self.tomb.copy(), ids, vectors, lists, dict(self.list_writes)

    def compact(self) -> int:
        """Drop the log's records up to merged_lsn, which the index generation holds: the doc store is made
        durable first (its commits are not fsynced: the log was what made them durable). Returns the bytes
        dropped."""
        with self._writing, self._lock:
            if self._wal is None or not self.merged_lsn:
                return 0
            if self.store is not None:
                self.store.make_durable()
            return self._wal.rewrite(lambda lsn: lsn > self.merged_lsn)

    def close(self, keep_store: bool = False) -> None:
        """keep_store: the doc store stays open (handed on to the next generation's ShardWrites)."""
        with self._writing:  # a write under way finishes first
            self._close(keep_store)

    def _close(self, keep_store: bool) -> None:
        if self._wal is not None:
            self._wal.close()
            self._wal = None
        if self.store is not None and not keep_store:
            self.store.close()
            self.store = None
