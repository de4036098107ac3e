"""Mutable collections: documents added, replaced and deleted without a rebuild, durable when a
write returns (docs/collections.md describes the interface; docs/design.md, where a write goes).

A collection directory holds:
- collection.json: name, dimension, metric, embedding (written once, at create);
- docs.sqlite: the doc store, every live document by internal row (docstore.py);
- wal.log: the write-ahead log of writes not yet folded into a checkpointed doc store (wal.py);
- CURRENT and gen-NNNNNN/: the published main index (an engine index over the documents that
  were live when it was built, plus rows.npy mapping its vector ids to rows).

Searches read the main index with tombstones (rows deleted or replaced since its build)
excluded inside the PQ scan, and the fresh tier (rows written since) exactly; the two are merged
by exact distance. A merge builds the next generation in the background and publishes it by
swapping one reference, so a search sees either the old or the new state.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from fusionrag.retriever.collection import compaction, importer, snapshot, tombstones
from fusionrag.retriever.collection.config import (CURRENT_FORMAT, DEFAULT_TEXT_WEIGHT, FRESH_HOLD, FRESH_SHARE,
                                                   HYBRID_DEPTH, MERGE_RETRY_S, CollectionConfig, Fusion, check_analyzer,
                                                   check_search)
from fusionrag.retriever.collection.contract import CollectionContract
from fusionrag.retriever.collection.docstore import DocStore
from fusionrag.retriever.collection.filters import compile_filter, filter_warnings
from fusionrag.retriever.collection.fresh import FreshTier
from fusionrag.retriever.collection.fusion import fuse, fused_hits
from fusionrag.retriever.collection.generations import (Generation, ReadView, gen_dir_name, load_published,
                                                        rows_digest, write_json_atomic, write_rows)
from fusionrag.retriever.collection.quota import Limits, OpenFiles
from fusionrag.retriever.collection.records import (METADATA_OPS, QUERY_WORDS, CollectionSearch, Document, Hit, Write,
                                                    engine_form, metadata_record, upsert_record)
from fusionrag.retriever.collection.values import check_ids, logged_problem
from fusionrag.retriever.collection.wal import WriteAheadLog
from fusionrag.retriever.engine.config import EngineConfig, SearchOverrides, SearchParams, resolve_params
from fusionrag.retriever.engine.index import STAT_KEYS, Index
from fusionrag.retriever.engine.manifest import ArrayFileWriter
from fusionrag.retriever.engine.queries import PreparedQueries, prepare_queries
from fusionrag.retriever.engine.vectors import vector_problems
from fusionrag.retriever.process import lower_thread_priority, memory_limit
from fusionrag.retriever.errors import (ConflictError, FusionRAGError, IndexFormatError, InputError, StorageError,
                                        UnavailableError)

log = logging.getLogger(__name__)

# What applying a logged write raises when the write itself cannot be stored (a value SQLite refuses, a filter that
# no longer compiles), as opposed to the disk failing (sqlite3.OperationalError, OSError): such an entry is set
# aside and the log goes on (_set_aside).
ENTRY_ERRORS = (ValueError, TypeError, OverflowError, KeyError, IndexError, RecursionError,
                sqlite3.IntegrityError, sqlite3.DataError, sqlite3.InterfaceError)


# A query's statistics before its search fills them, and the engine's columns' Python types (counts int, seconds float).
_NO_STATS = dict.fromkeys(STAT_KEYS, 0) | {"fresh_candidates": 0, "filtered_exact": False}
_SECONDS_KEYS = tuple(key for key in STAT_KEYS if key.endswith("_s"))
_COUNT_KEYS = tuple(key for key in STAT_KEYS if not key.endswith("_s"))


class _Reading:
    """Collection._reading's block (a class: a generator's context manager cost a search ~4 us more)."""

    __slots__ = ("coll", "snap")

    def __init__(self, coll: "Collection"):
        self.coll = coll

    def __enter__(self) -> ReadView:
        self.snap = self.coll._snapshot()
        return self.snap

    def __exit__(self, *exc) -> None:
        self.coll._unread(self.snap)


def _in_use(method):
    """Run a public method as one use of the collection: close (a drop, a shutdown) waits for every
    use to end before it closes the store and the index, and a call that starts later is refused."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        self._enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._leave()
    return call


class Collection(CollectionContract):
    """One collection, opened. Thread-safe: searches run concurrently with writes and a merge."""

    def __init__(self, path: Path, engine_config: EngineConfig | None = None,
                 config: CollectionConfig | None = None, files: OpenFiles | None = None,
                 limits: Limits | None = None):
        """files: the pool of open collections this one takes part in (its doc store and log are closed while
        it is idle and others are used; see quota.OpenFiles); None keeps them open until close. limits: the
        catalog's (an import's disk reserve)."""
        self.path = Path(path)
        self.limits = limits or Limits()
        self.engine_config = engine_config or EngineConfig()
        self.config = config or CollectionConfig()
        self._memory_limit: int | None = None  # what the process may use, once a write asks (_fresh_limit)
        try:
            desc = json.loads((self.path / "collection.json").read_text())
            self.name, self.dim, self.metric = desc["name"], int(desc["dim"]), desc["metric"]
            self.embedding = desc.get("embedding")
            self.analyzer = check_analyzer(desc.get("analyzer"))  # absent: made before analyzers, the default
        except (OSError, ValueError, KeyError, InputError) as e:
            raise IndexFormatError(f"{self.path}: not a readable collection ({e})") from e
        self._build_config = replace(self.config.build, metric=self.metric)
        self._lock = threading.Lock()  # log appends, applies, publishes
        self._mem_lock = threading.Lock()  # the in-memory state searches snapshot
        self._merge_lock = threading.Lock()
        self._merge_thread: threading.Thread | None = None
        self._merging = False
        self._merge_removed: list[int] = []
        self._merge_retry_at = 0.0
        self._pending: list[Write] = []
        self._users = 0  # calls in progress, and a background merge
        self._users_cv = threading.Condition()
        self._closed: tuple[type, str] | None = None  # once closing began: what a later call raises
        self._unsearchable = 0  # stored vectors the engine cannot use (written before they were refused)
        self._progress: dict | None = None  # the running merge's or import's step, for info()
        self._import: dict | None = None  # the last bulk import: its state, and what it did or why it failed
        self._files = files
        self._dormant = False  # its doc store and log are closed until its next call
        self._set_aside_count = 0  # log entries the doc store could not apply (_set_aside)

        self._wal = WriteAheadLog(self.path / "wal.log")
        self._main = Generation(0, None, np.empty(0, np.int64), -1)
        self.store = None
        try:
            records = self._wal.open()
            # Until a first merge the log holds every write ever made, and a lost doc store can be
            # remade from it; after one, the doc store holds what the log no longer does.
            whole_log = not (self.path / "CURRENT").exists() and (not records or records[0][0] == 1)
            self.store = DocStore(self.path / "docs.sqlite", self.dim, create=whole_log, analyzer=self.analyzer)
            self._main = load_published(self.path, self.engine_config, self.name)
            next_row = self.store.meta("next_row", 0)
            if next_row <= self._main.max_row:
                raise IndexFormatError(
                    f"docs.sqlite holds no document past row {next_row - 1}, but generation {self._main.generation} "
                    f"indexed rows up to {self._main.max_row}: the doc store was emptied or replaced")
            applied = self.store.meta("applied_lsn")
            if records and records[0][0] > applied + 1:
                raise IndexFormatError(f"docs.sqlite has applied writes up to {applied}, but wal.log starts at "
                                       f"write {records[0][0]}: the doc store is older than the log (restored?)")
            self._next_row = self._applied_next_row = next_row
            self._set_aside_count = self.store.set_aside_entries(0)[0]
            replay = [Write.decode(lsn, p, self.dim) for lsn, p in records if lsn > applied]
            if replay:
                self._apply_to_store(replay, check=True)
            self._next_lsn = max([applied] + [lsn for lsn, _ in records]) + 1
            self._last_appended = self._next_lsn - 1
            self._load_memory()
            self._load_import_state()
        except BaseException:
            self._wal.close()
            if self.store is not None:
                self.store.close()
            if self._main.index is not None:
                self._main.index.close()
            raise

    # -- opening -------------------------------------------------------------------------------
    def _load_memory(self) -> None:
        live = self.store.live_rows()
        dead = ~np.isin(self._main.rows, live, assume_unique=True)
        self._tomb = np.packbits(dead, bitorder="little")
        self._tomb_count = int(dead.sum())
        rows, vecs, bad = self._usable(*self.store.rows_and_vectors(above=self._main.max_row))
        # Live rows a merge left out of the index it built (see _usable), and those of the fresh tier.
        main = self._main
        self._unsearchable = bad + len(np.setdiff1d(live[live <= main.max_row], main.rows, assume_unique=True))
        self._fresh = FreshTier(self.dim)
        if len(rows):
            self._fresh.add(rows, engine_form(vecs, self.metric))

    def _usable(self, rows: np.ndarray, vecs: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The stored vectors the engine can use, and how many it cannot. Writes refuse those, but a
        store written before they were refused may hold some: they are left out of every index and
        search (and logged) rather than failing every merge and search after them."""
        bad, why = vector_problems(vecs, self.metric)
        if not bad.size:
            return rows, vecs, 0
        docs = self.store.by_rows(rows[bad[:5]], False)
        log.warning("collection %r: %d stored vectors cannot be searched and are left out, e.g. document %r %s",
                    self.name, len(bad), docs.get(int(rows[bad[0]]), ("?",))[0], why[0])
        keep = np.ones(len(rows), bool)
        keep[bad] = False
        return rows[keep], vecs[keep], len(bad)

    def _stage_stored(self, con, staged: Path) -> tuple[np.ndarray, np.ndarray, int]:
        """The live stored vectors as of con's read transaction that the engine can use (_usable), written a
        chunk at a time to the memory-mapped float32 file `staged` in row order, so a rebuild holds none of them
        whole: (their rows, the file's rows that hold them, how many stored vectors could not be used)."""
        n = self.store.live_count(con)
        out = ArrayFileWriter(staged, np.float32, (n, self.dim))
        rows = np.empty(n, np.int64)
        k = unusable = 0
        for r, v in self.store.iter_rows_and_vectors(-1, con):
            r, v, bad = self._usable(r, v)
            out.write(v)
            rows[k:k + len(r)] = r
            k += len(r)
            unusable += bad
        return rows[:k], out.array()[:k], unusable

    # -- input checks --------------------------------------------------------------------------
    def _enter(self) -> None:
        if self._dormant and self._files is not None:
            self._files.make_room()
        with self._users_cv:
            if self._closed is not None:
                cls, message = self._closed
                raise cls(message)
            woke = self._dormant
            if woke:
                self._wake()
            self._users += 1
        if self._files is not None:
            self._files.used(self, woke)

    @property
    def dormant(self) -> bool:
        """Its doc store and log are closed while it is idle (reopened by its next call)."""
        return self._dormant

    def release_files(self) -> bool:
        """Close the doc store and the log if nothing uses the collection now (no call, merge or import in
        progress); its next call reopens them. True when they were closed."""
        with self._users_cv:
            if self._users or self._closed is not None or self._dormant or self._pending:
                return False
            self._wal.release()
            self.store.release()
            self._dormant = True
            return True

    def _wake(self) -> None:
        """Reopen what release_files closed (caller holds _users_cv)."""
        try:
            self._wal.reopen()
            try:
                self.store.reopen()
            except BaseException:
                self._wal.release()
                raise
        except (OSError, sqlite3.Error) as e:
            raise UnavailableError(f"collection {self.name!r} cannot reopen its files: {e}") from e
        self._dormant = False

    def _leave(self) -> None:
        with self._users_cv:
            self._users -= 1
            if not self._users:
                self._users_cv.notify_all()

    # -- the write path ------------------------------------------------------------------------
    @_in_use
    def upsert(self, docs: Sequence[Document]) -> list[str]:
        """Insert or replace documents; durable when it returns. Ids in input order."""
        w, ids = upsert_record(docs, self.dim, self.metric)
        if w.ids:
            self._commit(w)
        return ids

    add = upsert

    @_in_use
    def delete(self, ids: Sequence[str]) -> int:
        ids = check_ids(ids, "delete")
        return self._commit(Write("delete", ids)) if ids else 0

    @_in_use
    def delete_where(self, filter: dict) -> int:
        """Delete every document the filter passes, as one write: the filter is logged and evaluated when the
        write is applied, in the same transaction, so it sees every write logged before it and none after."""
        compile_filter(filter)  # a bad filter is refused before it is logged
        return self._commit(Write("delete_where", filter=json.dumps(filter, separators=(",", ":"), allow_nan=False)))

    @_in_use
    def set_metadata(self, updates: Mapping[str, dict], merge: bool = True) -> int:
        """Change documents' metadata alone, as Qdrant's set_payload and Chroma's update do: their text, vector and
        place in the index stay (nothing is re-indexed). updates maps an id to its metadata: with merge, an RFC
        7386 merge patch over the stored metadata (a key given None is removed; objects merge key by key), else
        the whole new metadata. One durable write; unknown ids are skipped; returns how many were updated."""
        w = metadata_record(updates, merge)
        return self._commit(w) if w.ids else 0

    @_in_use
    def clear(self) -> None:
        self._commit(Write("clear"))

    def _commit(self, w: Write) -> int:
        with self._lock:
            if self._import is not None and self._import["state"] in self._IMPORT_ACTIVE:
                raise ConflictError(f"collection {self.name!r} is importing documents: write once the import is "
                                    "done (its progress is in the collection's info)")
            if w.op == "upsert" and self._merging and self._fresh.bytes >= FRESH_HOLD * self._fresh_limit():
                # The fresh tier holds its vectors in RAM until the merge running now and the next fold them in:
                # past this it would grow with the write rate for as long as the merge takes. A 503: the caller
                # sends it again (the client does not resend writes itself).
                raise UnavailableError(f"collection {self.name!r} holds {self._fresh.bytes >> 20} MiB of writes in "
                                       "memory while a merge runs: retry once it is done")
            w.lsn = self._next_lsn
            self._next_lsn += 1
            if w.op == "upsert":
                w.rows = np.arange(self._next_row, self._next_row + len(w.ids), dtype=np.int64)
                self._next_row += len(w.ids)
            try:
                w.offset = self._wal.append(w.lsn, w.payload())
            except OSError as e:
                raise StorageError(f"collection {self.name!r}: cannot write its log: {e}") from e
            self._last_appended = w.lsn
            self._pending.append(w)
        try:
            self._wal.sync(w.lsn, lambda: self._last_appended)
        except OSError as e:
            with self._lock:
                self._fail_pending(lambda p: not self._wal.durable(p.lsn), e)
        with self._lock:
            if not w.applied and w.error is None:
                self._apply_pending()
        if isinstance(w.error, InputError):  # set aside: what it holds cannot be stored
            raise w.error
        if w.error is not None:
            raise StorageError(f"collection {self.name!r}: write not applied: {w.error}") from w.error
        self._maybe_merge()
        return w.result

    def _fail_pending(self, which, error: BaseException) -> None:
        """Cut the log back to before the first failed record; it and every later pending record
        fail (their writers get the error; none was acknowledged)."""
        failed = [p for p in self._pending if which(p)]
        if not failed:
            return
        first = min(failed, key=lambda p: p.lsn)
        doomed = [p for p in self._pending if p.lsn >= first.lsn]
        try:
            self._wal.cut(first.offset)
        except OSError:
            log.exception("collection %r: cannot cut the log back after a failed write", self.name)
        for p in doomed:
            p.error = error
        self._pending = [p for p in self._pending if p.lsn < first.lsn]

    def _apply_pending(self) -> None:
        """Apply, in log order, every pending record that is durable (caller holds _lock)."""
        batch = []
        for p in self._pending:
            if not self._wal.durable(p.lsn):
                break
            batch.append(p)
        if not batch:
            return
        try:
            removed = self._apply_to_store(batch)
        except (sqlite3.Error, OSError) as e:
            self._fail_pending(lambda p: True, e)
            return
        self._pending = self._pending[len(batch):]
        with self._mem_lock:
            for p, gone in zip(batch, removed):
                if gone is not None:  # None: set aside, its error set
                    self._apply_to_memory(p, gone)
                    p.applied = True

    def _apply_to_store(self, batch: list[Write], check: bool = False) -> list[list[int] | None]:
        """Apply a batch of log records to the doc store, in log order: rows removed per write, None for a write
        set aside (_set_aside), so that no entry blocks those after it or the opening of the collection. check:
        the records come from the log at open (a replay), and each is checked again as a write is today
        (values.logged_problem: a version that checked less may have logged it); those that fail are set aside.
        Live writes were checked before they were logged."""
        if not check:
            return self._apply_run(batch)
        out, run = [], []
        for w in batch:  # in log order: a run of good writes applied before the bad one after it is set aside
            problem = logged_problem(w.ids, w.texts, w.metas)
            if problem is None:
                run.append(w)
                continue
            if run:
                out += self._apply_run(run)
                run = []
            self._set_aside(w, problem)
            out.append(None)
        return out + (self._apply_run(run) if run else [])

    def _apply_run(self, batch: list[Write]) -> list[list[int] | None]:
        """One SQLite transaction for the batch, with the last lsn it applied; where a write cannot be applied
        (ENTRY_ERRORS: what it holds, not the disk), each is applied in its own transaction and the one that
        cannot is set aside. A disk's error (sqlite3.OperationalError, OSError) fails the batch as before."""
        try:
            return self._apply_batch(batch)
        except ENTRY_ERRORS as e:
            if len(batch) == 1:
                self._set_aside(batch[0], e)
                return [None]
        removed = []
        for w in batch:
            try:
                removed += self._apply_batch([w])
            except ENTRY_ERRORS as e:
                self._set_aside(w, e)
                removed.append(None)
        return removed

    def _apply_batch(self, batch: list[Write]) -> list[list[int]]:
        removed = []
        self.store.begin()
        try:
            for w in batch:
                updated = None
                if w.op == "clear":
                    gone = self.store.remove_all()
                elif w.op == "delete_where":
                    gone = self.store.remove_where(*compile_filter(json.loads(w.filter)))
                elif w.op in METADATA_OPS:
                    gone, updated = [], self.store.update_metadata(w.ids, w.metas, w.op == "merge_metadata")
                else:
                    gone = self.store.remove(w.ids)
                if w.op == "upsert":
                    self.store.insert(w.rows, w.ids, w.texts, w.metas, w.vectors)
                    self._applied_next_row = max(self._applied_next_row, int(w.rows[-1]) + 1)
                    self._next_row = max(self._next_row, self._applied_next_row)
                w.result = len(gone) if updated is None else updated
                removed.append(gone)
            self.store.commit(batch[-1].lsn, self._next_row)
        except BaseException:
            self.store.rollback()
            raise
        return removed

    def _set_aside(self, w: Write, error: BaseException) -> None:
        """A log record the doc store cannot apply, kept whole in the store's set_aside table with why, in the
        transaction that moves applied_lsn past it: the writes after it apply, a reopen does not replay it, and
        info() reports it. Its writer (if still waiting) gets InputError; the rows an upsert took are not reused."""
        reason = f"{type(error).__name__}: {error}".encode("utf-8", "backslashreplace").decode()[:2000]
        if w.op == "upsert" and w.rows is not None and len(w.rows):
            self._applied_next_row = max(self._applied_next_row, int(w.rows[-1]) + 1)
            self._next_row = max(self._next_row, self._applied_next_row)
        self.store.begin()
        try:
            self.store.set_aside(w.lsn, w.op, w.ids, reason, w.payload())
            self.store.commit(w.lsn, self._next_row)
        except BaseException:
            self.store.rollback()
            raise
        self._set_aside_count += 1
        w.error = InputError(f"collection {self.name!r}: write {w.lsn} ({w.op} of {len(w.ids)} documents) cannot "
                             f"be applied and was set aside ({reason}); the collection's info lists it")
        log.error("collection %r: log entry %d (%s of %d documents) cannot be applied and is set aside: %s",
                  self.name, w.lsn, w.op, len(w.ids), reason)

    def _apply_to_memory(self, w: Write, gone: list[int]) -> None:
        self._remove_rows(gone)
        if w.op == "upsert":
            self._fresh.add(w.rows, engine_form(w.vectors, self.metric))

    def _remove_rows(self, rows: list[int]) -> None:
        if not rows:
            return
        main = self._main
        r = np.asarray(rows, dtype=np.int64)
        in_main = r <= main.max_row
        if in_main.any() and len(main.rows):
            # Copy on write: a search's snapshot holds the bitmap it took as it was, without copying it (N/8 bytes
            # a search: 2.5 MB at 20M vectors); a write of deletes pays the copy instead, beside its fsync.
            tomb = self._tomb.copy()
            self._tomb_count += tombstones.mark(tomb, tombstones.positions(main.rows, r[in_main]))
            self._tomb = tomb
        self._fresh.remove(r[~in_main].tolist())
        if self._merging:
            self._merge_removed += rows

    # -- reads ---------------------------------------------------------------------------------
    @_in_use
    def __len__(self) -> int:
        return self.store.count()

    def crossover(self) -> int | None:
        """The call size from which the main index serves a search from the GPU, measured cheaper there than on
        the CPU tier beside it (filter_tier auto with CUDA; Index.crossover); None otherwise."""
        index = getattr(self._main, "index", None)  # read once: a merge may publish another meanwhile
        return index.crossover() if index is not None else None

    @_in_use
    def count(self, filter: dict | None = None) -> int:
        """How many documents the filter passes (all of them without one)."""
        if filter is None:
            return self.store.count()
        return len(self.store.rows_where(*compile_filter(filter)))

    @_in_use
    def get(self, ids: Sequence[str], with_vectors: bool = False) -> list[Document]:
        found = self.store.get(check_ids(ids, "get"), with_vectors)
        return [Document(i, found[i][0], found[i][2], found[i][1]) for i in ids if i in found]

    @_in_use
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
            snap = ReadView(self._main, self._tomb, self._tomb_count, self._fresh.view())  # never written in place
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

    @_in_use
    def filter_warnings(self, filter: dict) -> list[str]:
        """Why parts of a filter match nothing: each field it names that no document holds (with the stored fields
        nearest its name), or compares only with types of values that the documents do not hold it as ("3"
        against numbers, a scalar against lists); none when all can match."""
        return filter_warnings(filter, self.store.field_types, self.store.field_names)

    @_in_use
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
            among = len(allowed) <= self.config.filter_exact_max
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
            res = main.index.search(q, k, params, exclude=exclude)
            ids, dists = res.ids, res.distances
            # Excluded vectors can empty the probed lists: probe them all for queries left short (ids are best
            # first, -1 padded: short where the min(k, live)-th is -1).
            short = [i for i, v in enumerate(ids[:, min(k, live) - 1].tolist()) if v < 0] if live else []
            if short:
                short = np.asarray(short)
                # Every list: the ratio rule would still cut those beyond twice the nearest one's distance.
                p = resolve_params(params, main.index.params).with_overrides(
                    nprobe=main.index.nav.graph.size, probe="ratio", probe_ratio=0.0)
                again = main.index.search(q.rows(short), k, p, exclude=exclude)
                ids[short], dists[short] = again.ids, again.distances
        # Python numbers, the counts' columns as one matrix and the seconds' as another (two conversions, not one a
        # column), then a query's all at once.
        st = res.stats
        counts = np.array([st[key] for key in _COUNT_KEYS], np.int64).T.tolist()
        seconds = np.array([st[key] for key in _SECONDS_KEYS], np.float64).T.tolist()
        tier = res.info.get("filter_tier")  # which tier served (under filter_tier auto with CUDA, the cheaper)
        for s, c, sec in zip(stats, counts, seconds):
            s.update(zip(_COUNT_KEYS, c))
            s.update(zip(_SECONDS_KEYS, sec))
            s["filter_tier"] = tier
        # The engine pads with id -1 at distance inf (every tier): hits skip the -1 rows, whatever their distance.
        rows = main.rows.take(ids, mode="clip") if n else np.zeros(ids.shape, np.int64)  # -1 taken, then put back
        rows[ids < 0] = -1
        return rows, dists

    def _hits(self, rows: np.ndarray, dists: np.ndarray, stats, k: int, with_vectors: bool,
              score=None, ordered: bool = False) -> CollectionSearch:
        """Each query's first k live documents by distance; ordered: rows are each nearest first already."""
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
                hits.append(Hit(doc[0], d, score(d), doc[1], doc[2], doc[3]))
                if len(hits) == k:
                    break
            k_all.append(hits)
        return CollectionSearch(k_all, stats)

    def _score(self, d: float) -> float:
        return 1.0 - d if self.metric == "cosine" else -d

    # -- merge ---------------------------------------------------------------------------------
    def _merge_due(self) -> bool:
        f, cfg = self._fresh, self.config
        # Deletes alone also call for a merge: tombstones cost scan time and the log grows.
        return not (f.live_count < cfg.merge_fresh_count and f.bytes < self._fresh_limit()
                    and self._tomb_count < cfg.merge_fresh_count and self._wal.bytes < cfg.merge_fresh_bytes)

    def _maybe_merge(self) -> None:
        cfg = self.config
        if not cfg.background_merge or self._closed is not None or time.monotonic() < self._merge_retry_at:
            return
        if not self._merge_due():
            return
        with self._mem_lock:
            if self._merge_thread is not None and self._merge_thread.is_alive():
                return
            try:
                self._enter()  # the merge is a use: close waits for it
            except FusionRAGError:  # closing
                return
            self._merge_thread = threading.Thread(target=self._background_merge, name=f"merge-{self.name}",
                                                  daemon=True)
            self._merge_thread.start()

    def _fresh_limit(self) -> int:
        """The fresh tier's bytes at which a merge starts: merge_fresh_bytes, or a sixteenth of what the process
        may use (its cgroup's limit, else the machine's memory) where that is less (#51)."""
        if self._memory_limit is None:  # read once: it is a few files of /sys, and every write asks
            self._memory_limit = memory_limit()
        return min(self.config.merge_fresh_bytes, max(1 << 20, self._memory_limit // FRESH_SHARE))

    def _background_merge(self) -> None:
        lower_thread_priority()  # a merge takes the cores that searches leave
        try:
            while True:
                with self._merge_lock:
                    self._merge()
                # Writes that came while it ran may be past the threshold already: merged now, not at the next write.
                if self._closed is not None or not self._merge_due():
                    break
        except Exception:
            if self._closed is not None:
                log.info("collection %r: merge given up, the collection is closing", self.name)
                return
            self._merge_retry_at = time.monotonic() + MERGE_RETRY_S
            log.exception("collection %r: background merge failed (retried in %d s); the fresh tier keeps the writes",
                          self.name, MERGE_RETRY_S)
        finally:
            self._leave()

    @_in_use
    def snapshot(self, dest: str | os.PathLike) -> dict:
        """Write the collection's state as of now to the archive `dest` (retriever/collection/snapshot.py), while
        writes go on; a merge waits until it is written. Returns what the archive holds."""
        with self._merge_lock:  # the published generation stays while its files are read
            cur = self.path / "CURRENT"
            current = json.loads(cur.read_text()) if cur.exists() else None
            try:
                return snapshot.write(self, current, Path(dest))
            except (OSError, sqlite3.Error) as e:
                raise StorageError(f"collection {self.name!r}: cannot write its snapshot: {e}") from e

    # -- bulk import -----------------------------------------------------------------------------
    # Its state (importer.read_state, record_state): "uploading", "running", then "done", "failed" or "interrupted".
    _IMPORT_ACTIVE = importer.ACTIVE

    def _load_import_state(self) -> None:
        """The last import's state, as the previous process left it; staging an interrupted one left removed."""
        for p in self.path.glob(".import-*"):
            shutil.rmtree(p, ignore_errors=True)
        state = importer.read_state(self.path)
        if state is None:
            return
        if state.get("state") in self._IMPORT_ACTIVE:
            n = self.store.count()
            state = {**state, "state": "interrupted", "reason": (
                "the service stopped during the import: nothing of it was stored; import again" if not n else
                f"the service stopped during the import, after its {n} documents were stored (the next merge "
                "indexes them)")}
            self._set_import(state)
        self._import = state

    def _set_import(self, state: dict | None) -> None:
        self._import = state
        importer.record_state(self.path, state, f"collection {self.name!r}")

    @_in_use
    def claim_import(self) -> None:
        """Reserve this empty collection for one bulk import before its files arrive (the service claims it,
        then uploads): ConflictError if it holds documents or another import holds it. Writes are refused
        until the import ends; import_files(claimed=True) runs it, release_import gives up a claim whose
        upload failed."""
        with self._lock:
            importer.check_empty(self)
            if self._import is not None and self._import["state"] in self._IMPORT_ACTIVE:
                raise ConflictError(f"collection {self.name!r} is already importing documents (its progress is in "
                                    "the collection's info)")
            self._before_claim = self._import
            self._set_import({"state": "uploading", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})

    def release_import(self) -> None:
        """Give up a claim (its upload was refused, and the caller told so): the import state is as before it."""
        with self._lock:
            if self._import is not None and self._import["state"] == "uploading":
                self._set_import(getattr(self, "_before_claim", None))

    def import_files(self, documents: str | os.PathLike | None = None, vectors: str | os.PathLike | None = None,
                     progress: bool | None = None, claimed: bool = False) -> dict:
        """Bulk-import documents into this empty collection from files, indexed by one build (see
        retriever/collection/importer.py); writes wait (ConflictError) until it is done. Returns what it did. claimed: the
        caller claimed the collection first (claim_import). Whatever happens, the state ends "done" or
        "failed" with the reason (info()'s build_state.import)."""
        folders = [Path(p).resolve().parent for p in (documents, vectors) if p is not None]
        ran: list[bool] = []  # set once this call has made the state "running": the state is its own
        try:
            return self._import_files(documents, vectors, progress, claimed, ran)
        except BaseException as e:
            with self._lock:
                state = None if self._import is None else self._import["state"]
                if self._closed is None and ((ran and state == "running") or (claimed and state == "uploading")):
                    reason = importer.public_reason(e, self.path, *folders)
                    self._set_import({**self._import, "state": "failed", "reason": reason})
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise StorageError(f"collection {self.name!r}: the import could not write: {e}") from e
            raise

    @_in_use
    def _import_files(self, documents, vectors, progress, claimed: bool, ran: list) -> dict:
        from fusionrag.retriever.collection.embedding import get_embedder

        with self._merge_lock:  # no merge meanwhile: the import publishes the next generation itself
            with self._lock:
                state = None if self._import is None else self._import["state"]
                if claimed and state != "uploading":
                    raise ConflictError(f"collection {self.name!r}: the import's claim was lost")
                if not claimed:
                    importer.check_empty(self)
                    if state in self._IMPORT_ACTIVE:
                        raise ConflictError(f"collection {self.name!r} is already importing documents")
                started = self._import["started"] if claimed else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                self._set_import({"state": "running", "started": started})
                ran.append(True)
            try:
                embedder = get_embedder(self.embedding) if self.embedding else None
                done = importer.import_files(self, None if documents is None else Path(documents),
                                             None if vectors is None else Path(vectors), progress, embedder)
            finally:
                self._progress = None
            with self._lock:
                self._set_import({**self._import, "state": "done", **done})
            return done

    def _publish_import(self, n: int, source: Path, documents, index_dir: Path | None, steps) -> int:
        """Store the n imported documents (documents(): chunks of (id, text, metadata JSON); vectors from
        source) in one transaction, then publish index_dir (if any) as the next generation over them.
        Caller holds _merge_lock; writes are refused meanwhile. Returns the documents stored."""
        vecs = np.load(source, mmap_mode="r")
        with self._lock:
            old = self._main
            base = self._next_row
            rows = np.arange(base, base + n, dtype=np.int64)
            gen = old.generation + 1
            gdir = self.path / gen_dir_name(gen)
            if index_dir is not None:
                shutil.rmtree(gdir, ignore_errors=True)
                gdir.mkdir()
                os.rename(index_dir, gdir / "index")
                write_rows(gdir, rows)
            self.store.begin()
            try:
                at = 0
                with steps.step("storing documents", n, "doc") as update:
                    for chunk in documents():
                        # An id given twice: the later line wins (the earlier's row stays unstored, a tombstone).
                        keep = sorted({doc_id: j for j, (doc_id, _, _) in enumerate(chunk)}.values())
                        ids = [chunk[j][0] for j in keep]
                        self.store.remove(ids)
                        self.store.insert(rows[at:at + len(chunk)][keep], ids, [chunk[j][1] for j in keep],
                                          [chunk[j][2] for j in keep], vecs[at:at + len(chunk)][keep])
                        at += len(chunk)
                        update(len(chunk))
                self.store.commit(self.store.meta("applied_lsn"), base + n)
            except BaseException:
                self.store.rollback()
                shutil.rmtree(gdir, ignore_errors=True)
                raise
            self._next_row = self._applied_next_row = base + n
            self.store.make_durable()
            index = None
            if index_dir is not None:
                index = Index.open(gdir / "index", self.engine_config)
                write_json_atomic(self.path / "CURRENT", {"format": CURRENT_FORMAT, "generation": gen, "indexed": True,
                                                           "max_row": base + n - 1, "rows_sha256": rows_digest(rows)})
            with self._mem_lock:
                unread = False
                if index is not None:
                    self._main = Generation(gen, index, rows, base + n - 1)
                    unread = self._retire(old)
                self._load_memory()
            stored = self.store.count()
        if unread:
            old.index.close()
        if index is not None:
            shutil.rmtree(self.path / gen_dir_name(old.generation), ignore_errors=True)
        return stored

    @_in_use
    def merge(self, progress: bool | None = None) -> None:
        """Fold the fresh tier into the main index now (blocking). progress: bars on stderr for its long
        steps (None: when stderr is a terminal; a background merge draws none)."""
        with self._merge_lock:
            self._merge(progress)

    def _stop_if_closing(self) -> None:
        """A merge gives up once its collection is being closed or dropped: close is waiting for it."""
        closed = self._closed
        if closed is not None:
            raise closed[0](closed[1])

    def _merge_step(self, step: str, done: int, total: int) -> None:
        self._progress = {"step": step, "done": done, "total": total}

    def _merge(self, progress: bool | None = False) -> None:
        self._stop_if_closing()
        with self._lock:
            if self._fresh.n == 0 and self._tomb_count == 0:  # nothing to fold in
                self._checkpoint()
                return
            with self._mem_lock:
                old = self._main
                dead = tombstones.dead(self._tomb, len(old.rows))
                fresh_rows, fresh_vecs = self._fresh.live_items()
                max_row = self._applied_next_row - 1
                live = len(old.rows) - self._tomb_count + len(fresh_rows)
                incremental = compaction.can_grow(self.config, old, live, fresh_vecs)
                # A rebuild reads the stored vectors as of this point.
                snap_con = None if incremental else self.store.snapshot()
                self._merging, self._merge_removed = True, []

        def read_all(staged: Path):  # a rebuild reads the stored vectors as of the snapshot taken above
            try:
                return self._stage_stored(snap_con, staged)
            finally:
                snap_con.close()

        try:
            new, current = compaction.next_generation(
                self.path, old, dead, fresh_rows, fresh_vecs, max_row, read_all if not incremental else None,
                self._build_config, self.engine_config, self.config.min_index_count, progress, self._merge_step)
            index = new.index
            unread_old = False
            try:
                self._stop_if_closing()
                with self._lock:
                    write_json_atomic(self.path / "CURRENT", current)
                    with self._mem_lock:
                        self._publish(new)
                        unread_old = self._retire(old)
                    self._checkpoint()
            except BaseException:
                if self._main is not new and index is not None:  # never published: nothing else holds it
                    index.close()
                raise
            finally:
                if unread_old:
                    old.index.close()
        finally:
            with self._mem_lock:
                self._merging, self._merge_removed, self._progress = False, [], None
        shutil.rmtree(self.path / gen_dir_name(old.generation), ignore_errors=True)

    def _publish(self, new: Generation) -> None:
        """Swap in the new generation (caller holds _lock and _mem_lock)."""
        dead = np.isin(new.rows, np.asarray(self._merge_removed, np.int64))
        fresh = FreshTier(self.dim)
        rows, vecs = self._fresh.live_items()
        if new.index is None:  # nothing indexed: every live row is fresh
            rows, vecs, new.unsearchable = self._usable(*self.store.rows_and_vectors(-1))
            vecs = engine_form(vecs, self.metric)
        if new.unsearchable is not None:  # counted again by a rebuild; an incremental merge keeps the count
            self._unsearchable = new.unsearchable
        keep = rows > new.max_row
        if keep.any():
            fresh.add(rows[keep], vecs[keep])
        self._main, self._fresh = new, fresh
        self._tomb, self._tomb_count = np.packbits(dead, bitorder="little"), int(dead.sum())

    def _checkpoint(self) -> None:
        """Make every logged write durable in the doc store, then empty the log (holds _lock)."""
        if self._pending:
            self._wal.sync(self._last_appended, lambda: self._last_appended)
            self._apply_pending()
        self.store.make_durable()
        self._wal.reset()

    # -- description ---------------------------------------------------------------------------
    @_in_use
    def info(self) -> dict:
        with self._reading() as snap:
            main = snap.main
            tiers = {"host_index_bytes": 0, "pq_bytes": 0, "pq_tier": "none", "page_buffer_bytes": 0,
                     "page_buffer_compressed": False, "record_cache_bytes": 0, "ssd_bytes": 0}
            if main.index is not None:
                tiers.update(main.index.memory())
        tiers["fresh_bytes"] = int(snap.fresh.vectors.nbytes)
        fresh_live = int(snap.fresh.live.sum())
        return {
            "name": self.name, "dimension": self.dim, "metric": self.metric, "embedding": self.embedding,
            "text_analyzer": self.analyzer, "state": "ready",
            "count": self.store.count(),
            "tiers": tiers,
            # what a search's params apply over: the index's defaults, as its build's calibration chose them
            "search_defaults": (main.index.params if main.index is not None else SearchParams()).to_dict(),
            "calibration": main.index.manifest.get("calibration") if main.index is not None else None,
            "build_state": {
                "indexed": len(main.rows) - snap.tomb_count,
                "fresh": fresh_live,
                "deleted": snap.tomb_count + len(snap.fresh.live) - fresh_live,
                "merging": self._merging,
                "generation": main.generation,
                "unsearchable": self._unsearchable,
                "progress": self._progress,  # while a merge or an import runs: {"step", "done", "total"}
                "import": self._import,
            },
            # log entries that could not be applied, kept aside (the writes after them applied)
            "set_aside": self._set_aside_info(),
        }

    def _set_aside_info(self) -> dict:
        if not self._set_aside_count:
            return {"count": 0, "last": []}
        count, last = self.store.set_aside_entries(10)
        return {"count": count, "last": last}

    def close(self, error: FusionRAGError | None = None) -> None:
        """Refuse new calls (with `error`, else "closed"), wait for those in progress and a
        background merge to end, then close the store, the log and the index."""
        with self._users_cv:
            if self._closed is not None:
                return
            error = error or UnavailableError(f"collection {self.name!r} is closed")
            self._closed = (type(error), str(error))
            while self._users:
                self._users_cv.wait()
        # Nothing uses the collection now, and nothing can start to.
        if self._files is not None:
            self._files.forget(self)
        self._wal.close()
        self.store.close()
        with self._mem_lock:
            old, self._main = self._main, Generation(0, None, np.empty(0, np.int64), -1)
            unread = self._retire(old)
        if unread:
            old.index.close()
