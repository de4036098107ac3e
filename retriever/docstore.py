"""The documents of a collection in SQLite (WAL mode): the user's id, text, metadata (JSON) and
vector of every live document, keyed by an internal row number that is never reused.

Why SQLite: one file, transactions, an index on the user's id, and JSON functions that let a
metadata filter run as one query next to the data. Commits do not fsync (synchronous=NORMAL):
the collection's own log is what makes a write durable, and the store records the last log
sequence number it applied in the same transaction as the write, so replay is exact.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import numpy as np

from fusionrag.retriever.filters import field_value

_SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    row INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    text TEXT,
    metadata TEXT NOT NULL,
    vector BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
-- Every scalar metadata value, typed (filters.py): what metadata filters search by index.
CREATE TABLE IF NOT EXISTS fields (row INTEGER NOT NULL, key TEXT NOT NULL, t TEXT NOT NULL, v);
CREATE INDEX IF NOT EXISTS fields_by_value ON fields (key, t, v);
CREATE INDEX IF NOT EXISTS fields_by_row ON fields (row);
"""
_CHUNK = 900  # bound on SQL variables per statement


def _chunks(seq, n=_CHUNK):
    for s in range(0, len(seq), n):
        yield seq[s:s + n]


class DocStore:
    def __init__(self, path: Path, dim: int):
        self.path, self.dim = Path(path), dim
        self._writer = self._connect()
        self._writer.executescript(_SCHEMA)
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=60)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        return con

    def _reader(self) -> sqlite3.Connection:
        """One read connection per thread: WAL-mode readers never block each other or the writer."""
        con = getattr(self._local, "con", None)
        if con is None:
            con = self._connect()
            con.execute("PRAGMA query_only=1")
            self._local.con = con
            with self._readers_lock:
                self._readers.append(con)
        return con

    # -- state kept with the data --------------------------------------------------------------
    def meta(self, key: str, default: int = 0) -> int:
        r = self._writer.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if r is None else int(r[0])

    # -- writes (the caller serialises them) ----------------------------------------------------
    def begin(self) -> None:
        self._writer.execute("BEGIN IMMEDIATE")

    def commit(self, applied_lsn: int, next_row: int) -> None:
        self._writer.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                 [("applied_lsn", applied_lsn), ("next_row", next_row)])
        self._writer.execute("COMMIT")

    def rollback(self) -> None:
        if self._writer.in_transaction:
            self._writer.execute("ROLLBACK")

    def remove(self, ids: list[str]) -> list[int]:
        """Delete these ids; returns the rows they had (unknown ids are skipped)."""
        rows = []
        for part in _chunks(ids):
            q = ",".join("?" * len(part))
            found = [r for (r,) in self._writer.execute(f"SELECT row FROM docs WHERE id IN ({q})", part)]
            self._writer.execute(f"DELETE FROM docs WHERE id IN ({q})", part)
            if found:
                self._writer.execute(f"DELETE FROM fields WHERE row IN ({','.join('?' * len(found))})", found)
            rows += found
        return rows

    def insert(self, rows, ids, texts, metas_json, vectors: np.ndarray) -> None:
        self._writer.executemany(
            "INSERT INTO docs (row, id, text, metadata, vector) VALUES (?, ?, ?, ?, ?)",
            ((int(r), i, t, m, v.tobytes()) for r, i, t, m, v in zip(rows, ids, texts, metas_json, vectors)))
        values = []
        for r, m in zip(rows, metas_json):
            for key, value in json.loads(m).items():
                tv = field_value(value)
                if tv is not None:
                    values.append((int(r), key, *tv))
        self._writer.executemany("INSERT INTO fields (row, key, t, v) VALUES (?, ?, ?, ?)", values)

    def remove_all(self) -> list[int]:
        rows = [r for (r,) in self._writer.execute("SELECT row FROM docs")]
        self._writer.execute("DELETE FROM docs")
        self._writer.execute("DELETE FROM fields")
        return rows

    def make_durable(self) -> None:
        """fsync every applied write (after this the collection's log can be emptied): one commit
        under synchronous=FULL syncs SQLite's own log, and with it every commit before it."""
        self._writer.execute("PRAGMA synchronous=FULL")
        try:
            self._writer.execute("BEGIN IMMEDIATE")
            self._writer.execute("INSERT OR REPLACE INTO meta VALUES ('synced', 1)")
            self._writer.execute("COMMIT")
        finally:
            self.rollback()
            self._writer.execute("PRAGMA synchronous=NORMAL")
        self._writer.execute("PRAGMA wal_checkpoint(PASSIVE)")  # keeps SQLite's log short; no waiting

    # -- reads ----------------------------------------------------------------------------------
    def count(self) -> int:
        return self._reader().execute("SELECT COUNT(*) FROM docs").fetchone()[0]

    def _vec(self, blob: bytes) -> np.ndarray:
        return np.frombuffer(blob, dtype=np.float32).copy()

    def get(self, ids: list[str], with_vectors: bool) -> dict[str, tuple]:
        """id -> (text, metadata, vector or None) for the ids that exist."""
        out = {}
        con = self._reader()
        for part in _chunks(ids):
            q = ",".join("?" * len(part))
            for i, t, m, v in con.execute(f"SELECT id, text, metadata, vector FROM docs WHERE id IN ({q})", part):
                out[i] = (t, json.loads(m), self._vec(v) if with_vectors else None)
        return out

    def by_rows(self, rows, with_vectors: bool) -> dict[int, tuple]:
        """row -> (id, text, metadata, vector or None) for the rows still live."""
        out = {}
        con = self._reader()
        rows = [int(r) for r in rows]
        col = "vector" if with_vectors else "NULL"
        for part in _chunks(rows):
            q = ",".join("?" * len(part))
            for r, i, t, m, v in con.execute(
                    f"SELECT row, id, text, metadata, {col} FROM docs WHERE row IN ({q})", part):
                out[r] = (i, t, json.loads(m), self._vec(v) if with_vectors else None)
        return out

    def rows_where(self, query: str, params: list) -> np.ndarray:
        """Sorted rows of the live documents that pass a compiled filter (filters.compile_filter)."""
        cur = self._reader().execute(query, params)
        return np.fromiter((r for (r,) in cur), dtype=np.int64)

    def rows_and_vectors(self, above: int = -1, con: sqlite3.Connection | None = None):
        """(rows int64 sorted, vectors float32 (n, dim)) of the live documents with row > above."""
        cur = (con or self._reader()).execute("SELECT row, vector FROM docs WHERE row > ? ORDER BY row", (above,))
        rows, blobs = [], []
        for r, v in cur:
            rows.append(r)
            blobs.append(v)
        vecs = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(rows), self.dim)
        return np.asarray(rows, dtype=np.int64), vecs

    def vectors_of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, vectors) of those of these rows still live, in row order."""
        con = self._reader()
        got, blobs = [], []
        for part in _chunks([int(r) for r in rows]):
            q = ",".join("?" * len(part))
            for r, v in con.execute(f"SELECT row, vector FROM docs WHERE row IN ({q}) ORDER BY row", part):
                got.append(r)
                blobs.append(v)
        vecs = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(got), self.dim)
        return np.asarray(got, dtype=np.int64), vecs

    def live_rows(self) -> np.ndarray:
        cur = self._reader().execute("SELECT row FROM docs ORDER BY row")
        return np.fromiter((r for (r,) in cur), dtype=np.int64)

    def snapshot(self) -> sqlite3.Connection:
        """A connection holding a read transaction: it sees the store as of now until closed."""
        con = self._connect()
        con.execute("BEGIN")
        con.execute("SELECT COUNT(*) FROM meta").fetchone()
        return con

    def close(self) -> None:
        with self._readers_lock:
            for con in self._readers:
                con.close()
            self._readers.clear()
        self._writer.close()
