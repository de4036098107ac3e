"""Writes to one shard of a sharded index (docs/sharded.md, "Writes"): the shard's own log and fresh tier.

A shard part's directory gains `wal.log` (the collection's log format, retriever/wal.py) at its first
write. Each record is an upsert (ids, vectors in the engine's form) or a delete (ids); a write is
appended and fsynced before the shard acknowledges it, and replayed in order when the shard is opened
again (after a crash, or when its actor is re-created from its directory). In memory:

- the fresh tier (retriever/fresh.py): vectors upserted to this shard, searched exactly;
- tombstones: the shard index's own vectors deleted or replaced since the build (a bitmap the filter
  tier skips, as a collection's tombstones are).

Ids are the index's ids: source rows for the built vectors, any non-negative int64 for new ones.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import numpy as np

from fusionrag.retriever.errors import IndexFormatError, InputError, StorageError
from fusionrag.retriever.fresh import FreshTier, FreshView
from fusionrag.retriever.wal import WriteAheadLog

WAL = "wal.log"
_HEAD = struct.Struct("<cII")  # op (b"u" upsert, b"d" delete), count, dim
UPSERT, DELETE = b"u", b"d"


def encode(op: bytes, ids: np.ndarray, vectors: np.ndarray | None = None) -> bytes:
    ids = np.ascontiguousarray(ids, dtype="<i8")
    body = ids.tobytes()
    dim = 0
    if op == UPSERT:
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        dim = vectors.shape[1]
        body += vectors.tobytes()
    return _HEAD.pack(op, len(ids), dim) + body


def decode(payload: bytes) -> tuple[bytes, np.ndarray, np.ndarray | None]:
    op, n, dim = _HEAD.unpack_from(payload)
    pos = _HEAD.size
    if op not in (UPSERT, DELETE) or len(payload) != pos + n * 8 + n * dim * 4:
        raise IndexFormatError("a shard log record is garbled")
    ids = np.frombuffer(payload, "<i8", n, pos).astype(np.int64)
    vectors = np.frombuffer(payload, "<f4", n * dim, pos + n * 8).reshape(n, dim).copy() if op == UPSERT else None
    return op, ids, vectors


class ShardWrites:
    """The log, fresh tier and tombstones of one shard part. base_ids: the global id of each vector of the
    shard's index (ascending, as global_ids.npy holds them); metric: the index's (fresh distances)."""

    def __init__(self, path, base_ids: np.ndarray, dim: int, metric: str):
        self.path = Path(path)
        self.base_ids, self.dim, self.metric = np.asarray(base_ids, dtype=np.int64), dim, metric
        self.fresh = FreshTier(dim)
        self.tomb = np.zeros((len(self.base_ids) + 7) // 8, dtype=np.uint8)
        self.deleted = 0  # base vectors tombstoned
        self._lock = threading.Lock()
        self._wal: WriteAheadLog | None = None
        self._next_lsn = 1
        self.replayed = 0
        if (self.path / WAL).exists():
            self._open_log()

    def _open_log(self) -> None:
        wal = WriteAheadLog(self.path / WAL)
        try:
            records = wal.open()
            for lsn, payload in records:
                self._apply(*decode(payload))
        except BaseException:
            wal.close()
            raise
        self._wal = wal
        self._next_lsn = (records[-1][0] + 1) if records else 1
        self.replayed = len(records)

    def _base_positions(self, ids: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.base_ids, ids)
        inside = pos < len(self.base_ids)
        hit = np.zeros(len(ids), bool)
        hit[inside] = self.base_ids[pos[inside]] == ids[inside]
        return pos[hit]

    def _apply(self, op: bytes, ids: np.ndarray, vectors: np.ndarray | None) -> None:
        for p in self._base_positions(ids).tolist():
            byte, bit = p >> 3, 1 << (p & 7)
            if not self.tomb[byte] & bit:
                self.tomb[byte] |= bit
                self.deleted += 1
        self.fresh.remove(ids.tolist())
        if op == UPSERT:
            self.fresh.add(ids, vectors)

    def write(self, op: bytes, ids, vectors=None) -> int:
        """Log (fsynced) then apply one write; returns how many of the ids were live here before."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if len(np.unique(ids)) != len(ids) or (ids < 0).any():
            raise InputError("a write's ids must be distinct non-negative integers")
        if op == UPSERT:
            vectors = np.asarray(vectors, dtype=np.float32)
            if vectors.shape != (len(ids), self.dim):
                raise InputError(f"upsert needs ({len(ids)}, {self.dim}) vectors, got {vectors.shape}")
        with self._lock:
            if self._wal is None:
                self._open_log()
            lsn = self._next_lsn
            try:
                offset = self._wal.append(lsn, encode(op, ids, vectors))
                try:
                    self._wal.sync(lsn, lambda: lsn)
                except OSError:
                    self._wal.cut(offset)
                    raise
            except OSError as e:
                raise StorageError(f"{self.path}: cannot write the shard's log: {e}") from e
            self._next_lsn += 1
            live = self.live(ids)
            self._apply(op, ids, vectors)
            return int(live.sum())

    def live(self, ids: np.ndarray) -> np.ndarray:
        """Which ids have a live version on this shard (base or fresh)."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.array([int(i) in self.fresh._slot for i in ids.tolist()], dtype=bool)
        pos = np.searchsorted(self.base_ids, ids)
        inside = pos < len(self.base_ids)
        at = np.minimum(pos, max(len(self.base_ids) - 1, 0))
        in_base = inside & (self.base_ids[at] == ids) if len(self.base_ids) else np.zeros(len(ids), bool)
        dead = (self.tomb[at >> 3] >> (at & 7).astype(np.uint8)) & 1 if len(self.base_ids) else 0
        return out | (in_base & (dead == 0))

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
            bits = np.unpackbits(self.tomb, bitorder="little")[:len(self.base_ids)].astype(bool)
            return self.base_ids[bits]

    def info(self) -> dict:
        return {"fresh": int(self.fresh.live_count), "tombstones": int(self.deleted),
                "log_bytes": int(self._wal.bytes) if self._wal else 0, "replayed": self.replayed}

    def close(self) -> None:
        if self._wal is not None:
            self._wal.close()
            self._wal = None
