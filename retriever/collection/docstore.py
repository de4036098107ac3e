"""The documents of a collection in SQLite (WAL mode): the user's id, text, metadata (JSON) and
vector of every live document, keyed by an internal row number that is never reused.

Why SQLite: one file, transactions, an index on the user's id, and JSON functions that let a
metadata filter run as one query next to the data. Commits do not fsync (synchronous=NORMAL):
the collection's own log is what makes a write durable, and the store records the last log
sequence number it applied in the same transaction as the write, so replay is exact.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sqlite3
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection.filters import TYPES, field_rows
from fusionrag.retriever.errors import IndexFormatError, StorageError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    row INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    text TEXT,
    metadata TEXT NOT NULL,
    vector BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
-- Every scalar metadata value and every element of a list value, typed (filters.py): what metadata filters
-- search by index.
CREATE TABLE IF NOT EXISTS fields (row INTEGER NOT NULL, key TEXT NOT NULL, t TEXT NOT NULL, v);
CREATE INDEX IF NOT EXISTS fields_by_value ON fields (key, t, v, row);  -- covering: no table lookups
CREATE INDEX IF NOT EXISTS fields_by_row ON fields (row);
-- Full text of the documents (BM25 ranking): an index over docs.text, kept by triggers in the write's
-- own transaction (a replace is a delete then an insert).
CREATE VIRTUAL TABLE IF NOT EXISTS docs_fts USING fts5(text, content='docs', content_rowid='row',
                                                       tokenize='{tokenize}');
CREATE TRIGGER IF NOT EXISTS docs_fts_insert AFTER INSERT ON docs WHEN new.text IS NOT NULL BEGIN
    INSERT INTO docs_fts (rowid, text) VALUES (new.row, new.text);
END;
CREATE TRIGGER IF NOT EXISTS docs_fts_delete AFTER DELETE ON docs WHEN old.text IS NOT NULL BEGIN
    INSERT INTO docs_fts (docs_fts, rowid, text) VALUES ('delete', old.row, old.text);
END;
-- Sharded mode: the documents with a text this store holds whose BM25 statistics another store counts (their
-- owner: the shard that took the write first, a replicated list's other replica), with their lengths in tokens,
-- and per owner their number and tokens (kept by triggers), so that a document on two shards counts once.
CREATE TABLE IF NOT EXISTS text_guests (row INTEGER PRIMARY KEY, owner INTEGER NOT NULL, tokens INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS guest_totals (owner INTEGER PRIMARY KEY, docs INTEGER NOT NULL, tokens INTEGER NOT NULL);
CREATE TRIGGER IF NOT EXISTS text_guests_insert AFTER INSERT ON text_guests BEGIN
    INSERT INTO guest_totals SELECT new.owner, 0, 0
        WHERE NOT EXISTS (SELECT 1 FROM guest_totals WHERE owner = new.owner);
    UPDATE guest_totals SET docs = docs + 1, tokens = tokens + new.tokens WHERE owner = new.owner;
END;
CREATE TRIGGER IF NOT EXISTS text_guests_delete AFTER DELETE ON text_guests BEGIN
    UPDATE guest_totals SET docs = docs - 1, tokens = tokens - old.tokens WHERE owner = old.owner;
END;
-- Writes in the log that could not be applied (written before their values were refused, or refused by SQLite):
-- each kept whole with why, in the transaction that moved applied_lsn past it, so that it never blocks the writes
-- after it or the opening of the collection (store.LocalStore._set_aside).
CREATE TABLE IF NOT EXISTS set_aside (lsn INTEGER PRIMARY KEY, op TEXT NOT NULL, ids TEXT NOT NULL,
                                      reason TEXT NOT NULL, at REAL NOT NULL, payload BLOB NOT NULL);
CREATE TRIGGER IF NOT EXISTS docs_guest_delete AFTER DELETE ON docs BEGIN
    DELETE FROM text_guests WHERE row = old.row;
END;
"""
_CHUNK = 900  # bound on SQL variables per statement
_MMAP_BYTES = 1 << 30
_TABLES = {"docs", "meta", "fields"}
_TERM = re.compile(r"\w+")
MAX_TEXT_TERMS = 64  # words of a text query that count; a longer one is cut
# Lucene's English stop words. BM25 gives them next to no weight, but matching them ranks most of the
# collection: a query drops them (unless it has no other word), which made text search on the Python docs
# several times faster at the same answers.
STOP_WORDS = frozenset("a an and are as at be but by for if in into is it no not of on or such that the their "
                       "then there these they this to was will with".split())
# Read connections a store keeps at most: each holds a descriptor or three and its own page cache,
# and a connection per thread grew without bound under bursts of clients (then: "Too many open files").
MAX_READERS = 8
# The rows a filter passes, kept for the filters asked again until the next commit (a service's filters repeat:
# a tenant's, an area's): at most this many bytes of rows per store, least recently used dropped first.
FILTER_CACHE_BYTES = 8 << 20
WIDE_FILTER = 0.25  # a text search's filter passing at least this share of the documents checks the ranking's top
# SQLite FTS5's bm25(): its constants and tokenizer, for scoring with statistics of several stores (global_bm25).
BM25_K1, BM25_B = 1.2, 0.75
_TOKENIZE = "porter unicode61"  # docs_fts's by default, in _SCHEMA (a collection's analyzer may leave out Porter)
TOKENIZERS = {"porter": "porter unicode61", "none": "unicode61"}  # by the analyzer's stemming


class RowCache:
    """The documents searches returned lately, as stored (id, text, metadata's JSON text), for every store of the
    process together: at most `limit` bytes, the oldest dropped first. Each store holds its own entries (a dict by
    row, read without a lock: a dict's get is atomic); this keeps their bytes and their order. A search's hits are
    read from here instead of from SQLite (~40 us of a one-query search; most of a 32-query request's time under the
    GIL). An entry is dropped by the commit that changes or deletes its row (DocStore.commit), and rows read before
    a commit that dropped any are not kept (the store's epoch), so an entry is always what SQLite holds now."""

    ENTRY_OVERHEAD = 200  # bytes of an entry beyond its strings' characters: the tuple, the key, the dict's slot

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0  # bytes of the entries held
        self.count = 0  # entries held
        self.lock = threading.Lock()
        # (a store's entries, row, entry), oldest first; records of entries dropped since are skipped (and compacted
        # away once they are most of it)
        self._order: deque[tuple[dict, int, tuple]] = deque()

    def fill(self, entries: dict, found: list[tuple], epoch: int, epoch_now) -> None:
        """Keep rows read as of the store's `epoch` (row, id, text, metadata JSON), unless it changed since."""
        if not self.limit:
            return
        with self.lock:
            if epoch != epoch_now():
                return
            for r, i, t, m in found:
                size = self.ENTRY_OVERHEAD + len(i) + len(m) + (len(t) if t is not None else 0)
                if size > self.limit // 16:  # a huge document would push out many: read it from SQLite each time
                    continue
                old = entries.get(r)
                if old is not None:
                    self.held -= old[3]
                    self.count -= 1
                entries[r] = entry = (i, t, m, size)
                self._order.append((entries, r, entry))
                self.held += size
                self.count += 1
            self._trim()
            if len(self._order) > 2 * self.count + 1024:
                self._order = deque(rec for rec in self._order if rec[0].get(rec[1]) is rec[2])

    def _trim(self) -> None:
        order = self._order
        while self.held > self.limit and order:
            entries, r, entry = order.popleft()
            if entries.get(r) is entry:  # else dropped or replaced already (and counted off then)
                del entries[r]
                self.held -= entry[3]
                self.count -= 1

    def drop(self, entries: dict, rows) -> None:
        """Entries of these rows gone (the caller holds the lock)."""
        for r in rows:
            old = entries.pop(r, None)
            if old is not None:
                self.held -= old[3]
                self.count -= 1

    def resize(self, limit: int) -> None:
        with self.lock:
            self.limit = max(0, int(limit))
            self._trim()


# Every store's cache of returned documents (the service sets its size: --doc-cache-mb).
ROW_CACHE = RowCache(32 << 20)


MMAP_SHARE = 8  # a store of more than this share of the memory the process may use is read without a map


def mmap_bytes(path: Path) -> int:
    """SQLite's mmap_size for a store: reads without a syscall per page where its file is small beside the memory
    the process may use (a cgroup's limit, else the machine's); none where it is larger than an eighth of it. A
    mapped read that misses faults in the kernel's read-around (read_ahead_kb, 8 MiB on this machine's disk), and
    beside a cap the pages it brings push out those the next reads need: in a 651 MiB cgroup, 5,000 scattered
    documents of a 2.4 GB store (a search of 500 queries, 10 hits each) read 2.0 GB from disk mapped, 49 MB not,
    in about half the time (bench/results/service/docstore_reads.md). A reader keeps what it was opened with."""
    from fusionrag.retriever.process import memory_limit

    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return _MMAP_BYTES if size <= memory_limit() // MMAP_SHARE else 0


def _unreadable(path: Path, e: sqlite3.DatabaseError) -> Exception:
    """A full or failing disk is a StorageError (nothing is wrong with the store); anything else
    SQLite refuses is a store that is not one."""
    if getattr(e, "sqlite_errorcode", None) in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR) or \
            "disk is full" in str(e) or "disk I/O error" in str(e):
        return StorageError(f"{path.name}: the disk refused a write ({e})")
    return IndexFormatError(f"{path.name} is not a readable SQLite database ({e})")


def query_words(text: str, stop_words: frozenset = STOP_WORDS) -> list[str]:
    """The words of a text query that count: lower-cased, each once, stop words dropped (unless it has no other
    word), at most MAX_TEXT_TERMS. Each is one phrase of the FTS5 query (quoted: never read as query syntax)."""
    words = list(dict.fromkeys(_TERM.findall(text.lower())))
    return ([w for w in words if w not in stop_words] or words)[:MAX_TEXT_TERMS]


def _phrase(word: str) -> str:
    return '"' + word.replace('"', '""') + '"'


def _varints(blob: bytes) -> list[int]:
    """The SQLite varints of an FTS5 record (big-endian, 7 bits a byte, a ninth byte of 8)."""
    out, i = [], 0
    while i < len(blob):
        v = 0
        for j in range(9):
            c = blob[i]
            i += 1
            if j == 8:
                v = (v << 8) | c
                break
            v = (v << 7) | (c & 0x7F)
            if c < 0x80:
                break
        out.append(v)
    return out


def _tokens(words: list[str]) -> list[tuple[str, ...]]:
    """The index's tokens of each word (stemmed, diacritics removed; "foo_bar" is two), by the index's own
    tokenizer in a scratch in-memory table."""
    con = sqlite3.connect(":memory:")
    try:
        con.execute(f"CREATE VIRTUAL TABLE q USING fts5(text, tokenize='{_TOKENIZE}')")
        con.executemany("INSERT INTO q (rowid, text) VALUES (?, ?)", list(enumerate(words)))
        con.execute("CREATE VIRTUAL TABLE temp.qv USING fts5vocab(main, q, instance)")
        out: list[list[str]] = [[] for _ in words]
        for doc, term in con.execute("SELECT doc, term FROM temp.qv ORDER BY doc, offset"):
            out[doc].append(term)
        return [tuple(t) for t in out]
    finally:
        con.close()


def bm25_idf(docs: int, hits: int) -> float:
    """FTS5's idf of a phrase that `hits` of `docs` documents match (never below 1e-6, as bm25() clamps it)."""
    idf = math.log((docs - hits + 0.5) / (hits + 0.5)) if docs else 0.0
    return idf if idf > 0 else 1e-6


def merge_patch(target, patch):
    """RFC 7386: patch merged into target (a key whose value is null removed; objects merged key by key; any
    other value replacing what was there)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


_LONG_NUMBER = re.compile(r"\d{19}")

try:  # the server's extra holds orjson: a stored metadata's JSON read ~9x faster (a search reads k a query)
    import orjson as _orjson

    def _metadata(text: str):
        if text == "{}":  # most documents' (a new dict each: callers may change theirs)
            return {}
        # orjson reads an integer past 64 bits as a float; json keeps it exact (stored before writes refused them)
        if _LONG_NUMBER.search(text):
            return json.loads(text)
        try:
            return _orjson.loads(text)
        except _orjson.JSONDecodeError:  # a lone surrogate's escape, stored before writes refused them
            return json.loads(text)
except ImportError:  # the engine alone
    _metadata = json.loads


def _chunks(seq, n=_CHUNK):
    for s in range(0, len(seq), n):
        yield seq[s:s + n]


class DocStore:
    """create: make the store (a new collection); otherwise it must exist and hold the tables."""

    def __init__(self, path: Path, dim: int, create: bool = False, max_readers: int = MAX_READERS,
                 analyzer: dict | None = None):
        """analyzer: the collection's text analyzer (config.check_analyzer: Porter stemming or none, English stop
        words or none); its stemming is the full-text index's tokenizer, fixed when the index is made."""
        self.path, self.dim = Path(path), dim
        analyzer = analyzer or {"stemming": "porter", "stop_words": "english"}
        self.stop_words = STOP_WORDS if analyzer["stop_words"] == "english" else frozenset()
        if not create and not self.path.is_file():
            raise IndexFormatError(f"{self.path.name} is missing: the collection's documents are gone")
        self._writer = self._connect()
        try:
            had_fts = False if create else "docs_fts" in self._check_tables()
            self._writer.executescript(_SCHEMA.replace("{tokenize}", TOKENIZERS[analyzer["stemming"]]))
            if not had_fts:  # a store from before full text: index what it holds
                self._writer.execute("INSERT INTO docs_fts (docs_fts) VALUES ('rebuild')")
            if not self.meta("list_elements"):  # a store from before lists' elements were: index those it holds
                self._index_fields("'%[%'", "list_elements")
            if not self.meta("nested_fields"):  # a store from before objects' values were: index those it holds
                self._index_fields("'%{%{%'", "nested_fields")
        except BaseException:
            self._writer.close()
            raise
        self._commits = 0  # commits since opening: what the filter cache's entries are valid for
        self._passing: OrderedDict[tuple, tuple[int, np.ndarray]] = OrderedDict()  # (query, params) -> (commits, rows)
        self._passing_lock = threading.Lock()
        self._counted = (-1, 0)  # (commits, documents) of the last count()
        self._cached: dict[int, tuple] = {}  # row -> (id, text, metadata JSON, bytes): this store's part of ROW_CACHE
        self._cache_epoch = 0  # changes each time a commit drops entries: reads begun before it are not kept
        self._changed: set[int] | None = set()  # rows the open write transaction changes (None: all of them)
        self._idle: list[sqlite3.Connection] = []  # read connections not in use
        self._all: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_readers)

    def _set_fields(self, row: int, metadata: dict) -> None:
        """The field table's rows of one document made those of this metadata (in the writer's transaction)."""
        self._writer.execute("DELETE FROM fields WHERE row = ?", (row,))
        self._writer.executemany("INSERT INTO fields (row, key, t, v) VALUES (?, ?, ?, ?)",
                                 [(row, *f) for f in field_rows(metadata)])

    def _index_fields(self, like: str, done: str) -> None:
        """The field table's rows again for the documents whose metadata's JSON is `like`; then meta[done] is set."""
        self._writer.execute("BEGIN IMMEDIATE")
        try:
            for row, m in self._writer.execute(f"SELECT row, metadata FROM docs WHERE metadata LIKE {like}").fetchall():
                self._set_fields(row, json.loads(m))
            self._writer.execute("INSERT OR REPLACE INTO meta VALUES (?, 1)", (done,))
            self._writer.execute("COMMIT")
        finally:
            self.rollback()

    def _check_tables(self) -> set[str]:
        try:
            names = {n for (n,) in self._writer.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as e:
            raise _unreadable(self.path, e) from e
        if not _TABLES <= names:
            raise IndexFormatError(f"{self.path.name} holds no document store (tables {sorted(_TABLES - names)} "
                                   "missing): emptied or replaced")
        return names

    def _connect(self) -> sqlite3.Connection:
        try:
            con = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=60)
            con.execute("PRAGMA journal_mode=WAL")
        except sqlite3.DatabaseError as e:
            raise _unreadable(self.path, e) from e
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute(f"PRAGMA mmap_size={mmap_bytes(self.path)}")
        return con

    @contextlib.contextmanager
    def _reader(self):
        """A read connection for one call, from a pool of at most max_readers (callers beyond that
        wait): WAL-mode readers never block each other or the writer."""
        with self._slots:
            with self._readers_lock:
                con = self._idle.pop() if self._idle else None
            if con is None:
                con = self._connect()
                # The full-text index's token instances (term, doc, offset), for global_bm25's term counts.
                con.execute("CREATE VIRTUAL TABLE temp.docs_vocab USING fts5vocab(main, docs_fts, instance)")
                con.execute("PRAGMA query_only=1")
                with self._readers_lock:
                    self._all.append(con)
            try:
                yield con
            finally:
                with self._readers_lock:
                    self._idle.append(con)

    @property
    def open_readers(self) -> int:
        with self._readers_lock:
            return len(self._all)

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
        self._commits += 1  # after: an entry made meanwhile holds rows at least as new as the count it carries
        self._forget_changed()

    def _forget_changed(self) -> None:
        """After a commit: the cached documents it changed or deleted are dropped (ROW_CACHE)."""
        changed, self._changed = self._changed, set()
        if changed is None or changed:
            with ROW_CACHE.lock:
                self._cache_epoch += 1
                ROW_CACHE.drop(self._cached, list(self._cached) if changed is None else changed)

    def rollback(self) -> None:
        if self._writer.in_transaction:
            self._writer.execute("ROLLBACK")
        self._changed = set()  # nothing changed after all

    def set_aside(self, lsn: int, op: str, ids: list[str], reason: str, payload: bytes) -> None:
        """Keep a log entry that cannot be applied, whole, with why (in the writer's transaction)."""
        self._writer.execute("INSERT OR REPLACE INTO set_aside VALUES (?, ?, ?, ?, ?, ?)",
                             (lsn, op, json.dumps(ids[:20]), reason, time.time(), payload))

    def set_aside_entries(self, limit: int = 10) -> tuple[int, list[dict]]:
        """How many log entries were set aside, and the last `limit` of them (lsn, op, first ids, reason, when)."""
        with self._reader() as con:
            n = con.execute("SELECT count(*) FROM set_aside").fetchone()[0]
            rows = con.execute("SELECT lsn, op, ids, reason, at FROM set_aside ORDER BY lsn DESC LIMIT ?",
                               (limit,)).fetchall()
        return n, [{"lsn": lsn, "op": op, "ids": json.loads(ids), "reason": reason, "at": at}
                   for lsn, op, ids, reason, at in rows]

    def set_aside_lsns(self) -> set[int]:
        """The lsn of every log entry set aside (a store replaying its log into memory skips them)."""
        with self._reader() as con:
            return {lsn for (lsn,) in con.execute("SELECT lsn FROM set_aside")}

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
        self._note_changed(rows)
        return rows

    def _note_changed(self, rows) -> None:
        if self._changed is not None:
            self._changed.update(rows)

    def remove_rows(self, rows: list[int]) -> list[int]:
        """Delete the documents at these rows; returns the rows that held one."""
        gone = []
        for part in _chunks([int(r) for r in rows]):
            q = ",".join("?" * len(part))
            found = [r for (r,) in self._writer.execute(f"SELECT row FROM docs WHERE row IN ({q})", part)]
            if found:
                f = ",".join("?" * len(found))
                self._writer.execute(f"DELETE FROM docs WHERE row IN ({f})", found)
                self._writer.execute(f"DELETE FROM fields WHERE row IN ({f})", found)
            gone += found
        self._note_changed(gone)
        return gone

    def remove_where(self, query: str, params: list) -> list[int]:
        """Delete the documents that pass a compiled filter (filters.compile_filter); returns their rows."""
        rows = [r for (r,) in self._writer.execute(f"SELECT DISTINCT row FROM ({query})", params)]
        for part in _chunks(rows):
            q = ",".join("?" * len(part))
            self._writer.execute(f"DELETE FROM docs WHERE row IN ({q})", part)
            self._writer.execute(f"DELETE FROM fields WHERE row IN ({q})", part)
        self._note_changed(rows)
        return rows

    def insert(self, rows, ids, texts, metas_json, vectors: np.ndarray) -> None:
        self._writer.executemany(
            "INSERT INTO docs (row, id, text, metadata, vector) VALUES (?, ?, ?, ?, ?)",
            ((int(r), i, t, m, v.tobytes()) for r, i, t, m, v in zip(rows, ids, texts, metas_json, vectors)))
        values = [(int(r), *f) for r, m in zip(rows, metas_json) for f in field_rows(json.loads(m))]
        self._writer.executemany("INSERT INTO fields (row, key, t, v) VALUES (?, ?, ?, ?)", values)

    def mark_text_guests(self, rows, owners) -> None:
        """Sharded mode, in a write's transaction after its insert: the documents at these rows are counted in BM25's
        statistics by shard owners[i] (a replicated list's other replica holds them too); text_stats leaves them
        out when told that their owner counts. Rows without a text are skipped (no statistics count them)."""
        owner_of = {int(r): int(o) for r, o in zip(rows, owners)}
        texted = np.asarray(sorted(
            r for part in _chunks(list(owner_of)) for (r,) in self._writer.execute(
                f"SELECT row FROM docs WHERE row IN ({','.join('?' * len(part))}) AND text IS NOT NULL", part)),
            np.int64)
        if len(texted):
            lengths = self._doc_lengths(self._writer, texted)
            # The rows were just inserted: removing a row removed its entry (docs_guest_delete), so none has one.
            self._writer.executemany("INSERT INTO text_guests VALUES (?, ?, ?)",
                                     [(r, owner_of[r], int(n)) for r, n in zip(texted.tolist(), lengths.tolist())])

    def update_metadata(self, ids: list[str], metas_json: list[str], merge: bool) -> int:
        """Each id's metadata replaced by metas_json[i], or (merge) that merged into it as an RFC 7386 merge patch (a
        key given null removed, objects merged key by key), with its filter fields; text, vector and row stay.
        Unknown ids are skipped; returns how many documents were updated."""
        n = 0
        for part in _chunks(list(range(len(ids)))):
            names = [ids[j] for j in part]
            stored = {i: (r, m) for i, r, m in self._writer.execute(
                f"SELECT id, row, metadata FROM docs WHERE id IN ({','.join('?' * len(names))})", names)}
            for j in part:
                if ids[j] not in stored:
                    continue
                row, old = stored[ids[j]]
                new = json.loads(metas_json[j])
                if merge:
                    new = merge_patch(json.loads(old), new)
                text = json.dumps(new, separators=(",", ":"), allow_nan=False)
                stored[ids[j]] = (row, text)  # an id given twice: the second patch applies over the first
                self._writer.execute("UPDATE docs SET metadata = ? WHERE row = ?", (text, row))
                self._note_changed((row,))
                self._set_fields(row, new)
                n += 1
        return n

    def remove_all(self) -> list[int]:
        rows = [r for (r,) in self._writer.execute("SELECT row FROM docs")]
        self._writer.execute("DELETE FROM docs")
        self._writer.execute("DELETE FROM fields")
        self._changed = None
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
        commits, (at, n) = self._commits, self._counted
        if at == commits:
            return n
        n = self.live_count()
        self._counted = (commits, n)  # as the filter cache: a count at least as new as the commits it carries
        return n

    def _vec(self, blob: bytes) -> np.ndarray:
        return np.frombuffer(blob, dtype=np.float32).copy()

    def get(self, ids: list[str], with_vectors: bool) -> dict[str, tuple]:
        """id -> (text, metadata, vector or None) for the ids that exist."""
        out = {}
        with self._reader() as con:
            for part in _chunks(ids):
                q = ",".join("?" * len(part))
                for i, t, m, v in con.execute(f"SELECT id, text, metadata, vector FROM docs WHERE id IN ({q})", part):
                    out[i] = (t, _metadata(m), self._vec(v) if with_vectors else None)
        return out

    def by_rows(self, rows, with_vectors: bool) -> dict[int, tuple]:
        """row -> (id, text, metadata, vector or None) for the rows still live. Without vectors (a search's hits),
        from ROW_CACHE where it holds them, and those read from SQLite are kept there."""
        out = {}
        rows = rows.tolist() if isinstance(rows, np.ndarray) else [int(r) for r in rows]
        if with_vectors:
            with self._reader() as con:
                for part in _chunks(rows):
                    q = ",".join("?" * len(part))
                    for r, i, t, m, v in con.execute(
                            f"SELECT row, id, text, metadata, vector FROM docs WHERE row IN ({q})", part):
                        out[r] = (i, t, _metadata(m), self._vec(v))
            return out
        meta, get, missing = _metadata, self._cached.get, []
        for r in rows:
            e = get(r)
            if e is None:
                missing.append(r)
            else:  # most documents' metadata is empty: a new dict each without the call (callers may change theirs)
                m = e[2]
                out[r] = (e[0], e[1], {} if m == "{}" else meta(m), None)
        if missing:
            epoch = self._cache_epoch  # before the read: a commit after it may have changed what is read
            with self._reader() as con:
                found = [row for part in _chunks(missing) for row in con.execute(
                    f"SELECT row, id, text, metadata FROM docs WHERE row IN ({','.join('?' * len(part))})", part)]
            for r, i, t, m in found:
                out[r] = (i, t, meta(m), None)
            ROW_CACHE.fill(self._cached, found, epoch, lambda: self._cache_epoch)
        return out

    def page(self, after: int, limit: int, where: tuple[str, list] | None, with_vectors: bool) -> list[tuple]:
        """(row, id, text, metadata, vector or None) of the first `limit` live documents past row `after` that
        pass a compiled filter (all without one), in row order. Without a filter a page is a range of the rowid,
        however far the scroll; with one, the filter's rows are gathered again for every page."""
        sql = f"SELECT row, id, text, metadata, {'vector' if with_vectors else 'NULL'} FROM docs WHERE row > ?"
        params = [after]
        if where is not None:
            sql += f" AND row IN (SELECT row FROM ({where[0]}))"
            params += where[1]
        with self._reader() as con:
            found = con.execute(sql + " ORDER BY row LIMIT ?", params + [limit]).fetchall()
        return [(r, i, t, _metadata(m), self._vec(v) if with_vectors else None) for r, i, t, m, v in found]

    def field_types(self, key: str) -> set[str]:
        """The types (filters.TYPES) of the values stored under a metadata key: an index seek each."""
        with self._reader() as con:
            return {t for t in TYPES
                    if con.execute("SELECT 1 FROM fields WHERE key = ? AND t = ? LIMIT 1", (key, t)).fetchone()}

    def field_names(self, limit: int = 10000) -> list[str]:
        """The metadata keys stored (filterable ones, dotted for objects' values), sorted: an index seek each."""
        with self._reader() as con:
            return [k for (k,) in con.execute(
                "WITH RECURSIVE k(key) AS (SELECT min(key) FROM fields UNION ALL "
                "SELECT (SELECT min(key) FROM fields WHERE key > k.key) FROM k WHERE k.key IS NOT NULL) "
                "SELECT key FROM k WHERE key IS NOT NULL LIMIT ?", (limit,))]

    def rows_where(self, query: str, params: list, con: sqlite3.Connection | None = None) -> np.ndarray:
        """Sorted rows of the live documents that pass a compiled filter (filters.compile_filter); con: a read
        connection the caller holds, its transaction's view (else one of the pool's, and a filter asked before
        with no commit since is answered from the cache: ~4 ms for 25k rows passing otherwise)."""
        key = (query, tuple(params))
        if con is None:
            commits = self._commits
            with self._passing_lock:
                hit = self._passing.get(key)
                if hit is not None and hit[0] == commits:
                    self._passing.move_to_end(key)
                    return hit[1]
        # One string of all rows, parsed in C: a Python object per row costs more than the query.
        with contextlib.nullcontext(con) if con is not None else self._reader() as c:
            (text,) = c.execute(f"SELECT group_concat(row) FROM ({query})", params).fetchone()
        rows = np.sort(np.fromstring(text or "", dtype=np.int64, sep=","))
        rows = rows[np.concatenate([[True], rows[1:] != rows[:-1]])] if len(rows) else rows
        if con is None and rows.nbytes <= FILTER_CACHE_BYTES:
            rows.flags.writeable = False  # shared by the callers that ask again
            with self._passing_lock:
                now = self._commits
                for stale in [k for k, (c, _) in self._passing.items() if c != now]:
                    del self._passing[stale]
                if commits == now:  # else a commit came meanwhile: these rows may be older than it
                    self._passing[key] = (commits, rows)
                    self._passing.move_to_end(key)
                held = sum(r.nbytes for _, r in self._passing.values())
                while held > FILTER_CACHE_BYTES:  # the least recently used first
                    _, (_, dropped) = self._passing.popitem(last=False)
                    held -= dropped.nbytes
        return rows

    def text_search(self, text: str, limit: int, where: tuple[str, list] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The `limit` documents whose text best matches the words of `text` by BM25, best first:
        (rows, bm25 scores; lower is better, as SQLite's bm25() gives them). Any one word matches
        (each quoted, so no word is read as query syntax); `where` is a compiled filter."""
        terms = query_words(text, self.stop_words)
        if not terms:
            return np.empty(0, np.int64), np.empty(0, np.float64)
        if where is not None:
            # A filter most documents pass: rank without it, deep enough to hold `limit` passing matches at its
            # rate (twice over), and keep those that pass; the same answer, at the cost of the unfiltered query
            # (checking each match against the passing rows in SQLite cost ~4x it at 60% passing).
            passing, live = self.rows_where(*where), self.count()
            if live and len(passing) >= WIDE_FILTER * live:
                deep = 2 * limit * live // len(passing) + 16
                rows, scores = self.text_search(text, deep)
                pos = np.minimum(np.searchsorted(passing, rows), len(passing) - 1)
                keep = passing[pos] == rows
                if keep.sum() >= limit or len(rows) < deep:  # enough, or every match seen
                    return rows[keep][:limit], scores[keep][:limit]
        match = " OR ".join(_phrase(t) for t in terms)
        sql = "SELECT rowid, bm25(docs_fts) AS s FROM docs_fts WHERE docs_fts MATCH ?"
        params: list = [match]
        if where is not None:
            sql += f" AND +rowid IN (SELECT row FROM ({where[0]}))"
            params += where[1]
        with self._reader() as con:
            found = con.execute(sql + " ORDER BY s LIMIT ?", params + [int(limit)]).fetchall()
        return np.asarray([r for r, _ in found], np.int64), np.asarray([s for _, s in found], np.float64)

    def text_stats(self, texts: list[str], counted_by=()) -> tuple[int, int, list[list[int]]]:
        """What BM25 counts over this store, to be summed with other stores' (a sharded collection's global
        statistics): (documents with a text, their tokens, per text the documents each of its query words
        matches), as SQLite's bm25() counts them. counted_by: shards whose counts are summed with these; the
        documents here that one of them owns (mark_text_guests) are left out, so each counts once."""
        owners = sorted({int(o) for o in counted_by})
        among = ",".join("?" * len(owners))
        with self._reader() as con:
            row = con.execute("SELECT block FROM docs_fts_data WHERE id = 1").fetchone()  # FTS5's totals record
            totals = _varints(row[0]) if row is not None else [0, 0]
            docs, tokens = totals[0], sum(totals[1:])
            guests = (0, 0)
            if owners:
                guests = con.execute(f"SELECT coalesce(sum(docs), 0), coalesce(sum(tokens), 0) FROM guest_totals "
                                     f"WHERE owner IN ({among})", owners).fetchone()
            hits = []
            for t in texts:
                hits.append([])
                for w in query_words(t):
                    n = con.execute("SELECT count(*) FROM docs_fts WHERE docs_fts MATCH ?", (_phrase(w),)).fetchone()[0]
                    if guests[0]:
                        n -= con.execute(f"SELECT count(*) FROM docs_fts JOIN text_guests AS g "
                                         f"ON g.row = docs_fts.rowid WHERE docs_fts MATCH ? AND g.owner IN ({among})",
                                         (_phrase(w), *owners)).fetchone()[0]
                    hits[-1].append(n)
        return docs - guests[0], tokens - guests[1], hits

    def global_bm25(self, text: str, limit: int, where: tuple[str, list] | None, docs: int, tokens: int,
                    hits: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """text_search's answer scored with statistics given, not this store's own: `docs` documents holding
        `tokens` tokens, and `hits[i]` of them matching query word i (text_stats summed over a sharded
        collection's stores). bm25() as SQLite computes it (its idf, k1, b), from each matching document's
        term counts and length read from the full-text index; with this store's own statistics it gives
        text_search's scores."""
        words = query_words(text)
        if len(hits) != len(words):
            raise ValueError(f"{len(hits)} word counts for the {len(words)} query words of {text!r}")
        if not words:
            return np.empty(0, np.int64), np.empty(0, np.float64)
        avgdl = tokens / docs if docs else 1.0
        with self._reader() as con:  # one connection, one read transaction's view of the store
            con.execute("BEGIN")
            try:
                counts = [self._phrase_counts(con, toks) for toks in _tokens(words)]  # per word: (docs, occurrences)
                rows = np.unique(np.concatenate([d for d, _ in counts]))
                tf = np.zeros((len(rows), len(words)))
                for w, (d, n) in enumerate(counts):
                    tf[np.searchsorted(rows, d), w] = n
                if where is not None and len(rows):
                    keep = np.isin(rows, self.rows_where(*where, con=con))
                    rows, tf = rows[keep], tf[keep]
                dl = self._doc_lengths(con, rows) if len(rows) else None
            finally:
                con.execute("COMMIT")
        if not len(rows):
            return np.empty(0, np.int64), np.empty(0, np.float64)
        idf = np.asarray([bm25_idf(docs, h) for h in hits])
        norm = BM25_K1 * (1 - BM25_B + BM25_B * dl / avgdl)
        score = -(idf * tf * (BM25_K1 + 1) / (tf + norm[:, None])).sum(1)
        order = np.lexsort((rows, score))[:int(limit)]
        return rows[order], score[order]

    @staticmethod
    def _phrase_counts(con: sqlite3.Connection, tokens: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(docs, sorted; how often the phrase of these tokens, one after the other, occurs in each one's text)."""
        sql = "SELECT doc, offset FROM temp.docs_vocab WHERE term = ?"
        if len(tokens) == 1:
            got = con.execute("SELECT doc, count(*) FROM temp.docs_vocab WHERE term = ? GROUP BY doc ORDER BY doc",
                              tokens).fetchall()
            return np.asarray([d for d, _ in got], np.int64), np.asarray([n for _, n in got], np.int64)
        found: dict[int, int] = {}
        if tokens:
            at = [set(con.execute(sql, (t,)).fetchall()) for t in tokens]
            for doc, off in at[0]:
                if all((doc, off + j) in at[j] for j in range(1, len(tokens))):
                    found[doc] = found.get(doc, 0) + 1
        docs = np.asarray(sorted(found), np.int64)
        return docs, np.asarray([found[d] for d in docs.tolist()], np.int64)

    @staticmethod
    def _doc_lengths(con: sqlite3.Connection, rows: np.ndarray) -> np.ndarray:
        """Tokens in the text of each of these rows (sorted), from the full-text index's sizes (a varint each)."""
        got = con.execute("SELECT id, sz FROM docs_fts_docsize WHERE id IN (SELECT value FROM json_each(?)) "
                          "ORDER BY id", (json.dumps(rows.tolist()),)).fetchall()
        ids = np.fromiter((i for i, _ in got), np.int64, len(got))
        blobs = [b for _, b in got]
        size = np.fromiter(map(len, blobs), np.int64, len(blobs))
        raw = np.frombuffer(b"".join(blobs), np.uint8).astype(np.int64)
        at = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64) if len(size) else size
        length = np.zeros(len(blobs), np.float64)
        one, two = size == 1, size == 2  # under 128 tokens; under 16384
        length[one] = raw[at[one]]
        length[two] = ((raw[at[two]] & 0x7F) << 7) | raw[at[two] + 1]
        for j in np.flatnonzero(~(one | two)).tolist():
            length[j] = sum(_varints(blobs[j]))
        out = np.zeros(len(rows), np.float64)
        out[np.searchsorted(rows, ids)] = length
        return out

    def vectors_where(self, query: str, params: list) -> tuple[np.ndarray, np.ndarray]:
        """(rows, vectors) of the live documents that pass a compiled filter, in row order."""
        # Driven by the filter's rows, each a rowid lookup (row IN (...) would scan every document).
        rows, blobs = [], []
        with self._reader() as con:
            for r, v in con.execute(f"SELECT d.row, d.vector FROM (SELECT DISTINCT row FROM ({query})) AS f "
                                    "JOIN docs AS d ON d.row = f.row", params):
                rows.append(r)
                blobs.append(v)
        rows = np.asarray(rows, np.int64)
        order = np.argsort(rows)
        return rows[order], np.frombuffer(b"".join(blobs), np.float32).reshape(len(rows), self.dim)[order]

    def rows_and_vectors(self, above: int = -1, con: sqlite3.Connection | None = None):
        """(rows int64 sorted, vectors float32 (n, dim)) of the live documents with row > above."""
        parts = list(self.iter_rows_and_vectors(above, con))
        if not parts:
            return np.empty(0, np.int64), np.empty((0, self.dim), np.float32)
        return np.concatenate([r for r, _ in parts]), np.concatenate([v for _, v in parts])

    def iter_rows_and_vectors(self, above: int = -1, con: sqlite3.Connection | None = None, chunk: int = 4096):
        """rows_and_vectors a chunk of rows at a time (row order), so a caller holds none of them whole."""
        with contextlib.nullcontext(con) if con is not None else self._reader() as c:
            cur = c.execute("SELECT row, vector FROM docs WHERE row > ? ORDER BY row", (above,))
            while got := cur.fetchmany(chunk):
                rows = np.fromiter((r for r, _ in got), np.int64, len(got))
                yield rows, np.frombuffer(b"".join(v for _, v in got), np.float32).reshape(len(got), self.dim)

    def live_count(self, con: sqlite3.Connection | None = None) -> int:
        """How many documents are stored (as of con's read transaction, where given)."""
        with contextlib.nullcontext(con) if con is not None else self._reader() as c:
            return int(c.execute("SELECT COUNT(*) FROM docs").fetchone()[0])

    def names(self) -> tuple[np.ndarray, list[str]]:
        """(rows, ids) of every live document, in row order."""
        with self._reader() as con:
            found = con.execute("SELECT row, id FROM docs ORDER BY row").fetchall()
        return np.asarray([r for r, _ in found], np.int64), [i for _, i in found]

    def live_rows(self) -> np.ndarray:
        with self._reader() as con:
            return np.fromiter((r for (r,) in con.execute("SELECT row FROM docs ORDER BY row")), dtype=np.int64)

    def snapshot(self) -> sqlite3.Connection:
        """A connection holding a read transaction: it sees the store as of now until closed."""
        con = self._connect()
        con.execute("BEGIN")
        con.execute("SELECT COUNT(*) FROM meta").fetchone()
        return con

    def release(self) -> None:
        """Close every connection while no call reads or writes; reopen() opens the writer again (readers open
        as calls need them)."""
        self.close()
        self._writer = None

    def reopen(self) -> None:
        if self._writer is None:
            self._writer = self._connect()

    def close(self) -> None:
        """Only once no call is reading (the collection waits for its calls to end first)."""
        with ROW_CACHE.lock:  # its cached documents given back
            self._cache_epoch += 1
            ROW_CACHE.drop(self._cached, list(self._cached))
        with self._readers_lock:
            for con in self._all:
                con.close()
            self._all.clear()
            self._idle.clear()
        if self._writer is not None:
            self._writer.close()
