"""The local store (#69): what a collection and a shard of a sharded index are both made of.

One directory's write-ahead log (wal.py), doc store (docstore.py), fresh tier (fresh.py) and tombstones over the
keys of its index generation (tombstones.py), the log sequence numbers, and the commit:

- a write is one StoreRecord (records.py), logged in the one v2 format; logs written before hold the v1 format of
  a collection or of a shard, which are read (never written) as ever;
- group commit: writers append under the log lock, share one fsync, and the records that are durable are applied
  in log order, to the doc store (one SQLite transaction a batch, with the last lsn it applied) and then to the
  memory searches read (the fresh tier and tombstones, under mem_lock);
- an entry the doc store cannot hold (ENTRY_ERRORS: what it holds, not the disk) is set aside with its reason, in
  the transaction that moves applied_lsn past it; the writes after it apply, and its writer gets InputError;
- a disk's error cuts the log back to before the first record it failed and fails that record and every later one
  pending: none of them was acknowledged;
- compaction (after a merge): the pending records applied, the doc store made durable, and the log cut to the
  records the published generation does not hold.

A record's keys name what it writes. A store that assigns keys (a collection: its rows) gives an upsert the next
ones when it logs it and replaces documents by name; a store whose writer gives the keys (a shard: the router's
global ids) replaces by key, and holds a doc store only once a write carries documents.

What the two users still do apart, and why: a collection's memory is read back from its doc store at open (its
doc store holds every vector, and a delete by filter is resolved only when applied), a shard's from its log after
the generation's merged_lsn (its vector-only writes are held by the log alone); their generations are theirs
(collection/generations.py, sharded/generations.py).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from fusionrag.retriever.collection import tombstones
from fusionrag.retriever.collection.docstore import DocStore
from fusionrag.retriever.collection.filters import compile_filter
from fusionrag.retriever.collection.fresh import FreshTier, FreshView
from fusionrag.retriever.collection.records import METADATA_OPS, StoreRecord, engine_form
from fusionrag.retriever.collection.values import logged_problem
from fusionrag.retriever.collection.wal import WriteAheadLog
from fusionrag.retriever.errors import InputError, StorageError

log = logging.getLogger(__name__)

WAL = "wal.log"
DOCS = "docs.sqlite"

# What applying a logged write raises when the write itself cannot be stored (a value SQLite refuses, a filter that
# no longer compiles), as opposed to the disk failing (sqlite3.OperationalError, OSError): such an entry is set
# aside and the log goes on (LocalStore._set_aside).
ENTRY_ERRORS = (ValueError, TypeError, OverflowError, KeyError, IndexError, RecursionError,
                sqlite3.IntegrityError, sqlite3.DataError, sqlite3.InterfaceError)


class LiveSet:
    """What searches read of a local store's writes: tombstones over its generation's keys (ascending; a bitmap the
    filter tier skips, replaced on write, never written in place, so a search's snapshot holds it without a copy)
    and the fresh tier (keys written since the generation, searched exactly)."""

    def __init__(self, keys: np.ndarray, dim: int, dead: np.ndarray | None = None):
        """keys: the generation's, ascending; dead: bool per key, deleted or replaced already (None: none)."""
        self.keys = np.asarray(keys, dtype=np.int64)
        self.fresh = FreshTier(dim)
        if dead is None or not dead.any():
            self.tomb, self.dead = tombstones.empty(len(self.keys)), 0
        else:
            self.tomb, self.dead = np.packbits(dead, bitorder="little"), int(dead.sum())
        self.removed: list[int] | None = None  # while a merge runs: every key removed (MergeOps)

    def remove(self, keys) -> int:
        """Remove these keys (those not held are ignored); how many were live."""
        keys = np.asarray(keys, dtype=np.int64).ravel()
        if not len(keys):
            return 0
        marked = 0
        pos = tombstones.positions(self.keys, keys)
        if len(pos):
            tomb = self.tomb.copy()  # copy on write: a search's snapshot holds the old bitmap
            marked = tombstones.mark(tomb, pos)
            self.tomb, self.dead = tomb, self.dead + marked
        hit = self.fresh.remove(keys.tolist())
        if self.removed is not None:
            self.removed += keys.tolist()
        return marked + hit

    def add(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """vectors in the engine's form (unit length under cosine)."""
        self.fresh.add(np.asarray(keys, dtype=np.int64), vectors)

    def live(self, keys) -> np.ndarray:
        """bool: which keys have a live version here (the generation's, not tombstoned, or fresh)."""
        keys = np.asarray(keys, dtype=np.int64)
        out = self.fresh.contains(keys)
        if not len(self.keys):
            return out
        pos = np.searchsorted(self.keys, keys)
        at = np.minimum(pos, len(self.keys) - 1)
        return out | ((pos < len(self.keys)) & (self.keys[at] == keys) & ~tombstones.dead_at(self.tomb, at))

    def dead_keys(self) -> np.ndarray:
        return self.keys[tombstones.dead(self.tomb, len(self.keys))]

    def live_keys(self, after: int = -1) -> np.ndarray:
        """Sorted keys live here above `after`."""
        base = self.keys[~tombstones.dead(self.tomb, len(self.keys))]
        fresh = self.fresh.live_items()[0]
        return np.union1d(base[base > after], fresh[fresh > after]).astype(np.int64)

    def view(self) -> tuple[np.ndarray, int, FreshView]:
        """(the tombstone bitmap, how many it holds, the fresh tier's view): never written in place."""
        return self.tomb, self.dead, self.fresh.view()


class LocalStore:
    """One directory's log, doc store and live set, and the commit (the module's docstring). Thread-safe: writers
    commit at once (group commit); searches take `mem_lock` to read `live_set`."""

    def __init__(self, path, dim: int, metric: str, label: str, legacy: str, assigns_keys: bool,
                 store: DocStore | None = None, live: LiveSet | None = None, merged_lsn: int = 0):
        """label: how errors name the store ("collection 'docs'", a shard's directory). legacy: the v1 record
        format its old logs hold ("collection" or "shard"). assigns_keys: the store gives an upsert its keys (a
        collection's rows); else the writer does. merged_lsn: the log's records up to it are in the generation."""
        self.path, self.dim, self.metric, self.label = Path(path), dim, metric, label
        self.legacy, self.assigns_keys = legacy, assigns_keys
        self.wal = WriteAheadLog(self.path / WAL)
        self.log_open = False
        self.store = store
        self.live_set = live if live is not None else LiveSet(np.empty(0, np.int64), dim)
        self.lock = threading.Lock()  # log appends, applies
        self.mem_lock = threading.Lock()  # the live set searches read
        self.pending: list[StoreRecord] = []
        self.next_lsn = merged_lsn + 1
        self.last_appended = merged_lsn
        self.next_key = self.applied_next_key = 0  # a store that assigns keys: the next upsert's first
        self.merged_lsn = merged_lsn
        self.set_aside_count = 0  # log entries the doc store could not apply
        self.admit: Callable[[StoreRecord], None] | None = None  # called under `lock` before a record is logged
        self.applied_hook: Callable[[StoreRecord], None] | None = None  # under mem_lock, after a record applied

    # -- opening -------------------------------------------------------------------------------
    def open_log(self) -> list[tuple[int, bytes]]:
        """Open the log for appending (made if missing); its whole records (lsn, payload)."""
        records = self.wal.open()
        self.log_open = True
        return records

    def replay(self, records: list[tuple[int, bytes]], memory: bool) -> int:
        """Apply the logged records the doc store lacks (after its applied_lsn; each checked as a write is today,
        those that fail set aside) and, with `memory`, those after merged_lsn to the live set. Sets the next lsn.
        Returns how many records were after merged_lsn."""
        applied = self.store.meta("applied_lsn") if self.store is not None else 0
        if self.store is not None:
            self.set_aside_count = self.store.set_aside_entries(0)[0]
        decoded = [StoreRecord.decode(lsn, p, self.dim, self.legacy) for lsn, p in records
                   if lsn > applied or (memory and lsn > self.merged_lsn)]
        to_store = self._for_store([w for w in decoded if w.lsn > applied])
        aside: set[int] = set()
        if to_store:
            gone = self._apply_to_store(to_store, check=True)
            aside = {w.lsn for w, g in zip(to_store, gone) if g is None}
        if memory:
            if self.store is not None and self.set_aside_count:
                aside |= self.store.set_aside_lsns()
            for w in decoded:
                if w.lsn > self.merged_lsn and w.lsn not in aside:
                    self._apply_to_memory(w, [])
        self.next_lsn = max([applied, self.merged_lsn] + [lsn for lsn, _ in records]) + 1
        self.last_appended = self.next_lsn - 1
        return sum(1 for lsn, _ in records if lsn > self.merged_lsn)

    # -- the commit ----------------------------------------------------------------------------
    def commit(self, w: StoreRecord) -> int:
        """Log w (durable when this returns) and apply it; its result (rows removed, documents updated, or, where
        the writer gives the keys, how many of them were live). InputError where it was set aside, StorageError
        where the disk failed it."""
        with self.lock:
            if self.admit is not None:
                self.admit(w)
            if not self.log_open:  # a shard's first write: its log is made now
                records = self.open_log()
                applied = self.store.meta("applied_lsn") if self.store is not None else 0
                self.next_lsn = max([self.next_lsn, applied + 1] + [lsn + 1 for lsn, _ in records])
            w.lsn = self.next_lsn
            self.next_lsn += 1
            if w.op == "upsert" and self.assigns_keys:
                w.keys = np.arange(self.next_key, self.next_key + len(w.ids), dtype=np.int64)
                self.next_key += len(w.ids)
            try:
                w.offset = self.wal.append(w.lsn, w.payload())
            except OSError as e:
                self.next_lsn -= 1  # nothing of it is in the log: its number is taken again
                raise StorageError(f"{self.label}: cannot write its log: {e}") from e
            self.last_appended = w.lsn
            self.pending.append(w)
        try:  # the fsync outside the lock: searches and other writers' appends go on meanwhile
            self.wal.sync(w.lsn, lambda: self.last_appended)
        except OSError as e:
            with self.lock:
                self._fail_pending(lambda p: not self.wal.durable(p.lsn), e)
        with self.lock:
            if not w.applied and w.error is None:
                self._apply_pending()
        if isinstance(w.error, InputError):  # set aside: what it holds cannot be stored
            raise w.error
        if w.error is not None:
            raise StorageError(f"{self.label}: write not applied: {w.error}") from w.error
        return w.result

    def _fail_pending(self, which, error: BaseException) -> None:
        """Cut the log back to before the first failed record; it and every later pending record
        fail (their writers get the error; none was acknowledged)."""
        failed = [p for p in self.pending if which(p)]
        if not failed:
            return
        first = min(failed, key=lambda p: p.lsn)
        doomed = [p for p in self.pending if p.lsn >= first.lsn]
        try:
            self.wal.cut(first.offset, first.lsn)
            # Their numbers are taken again: a gap after an emptied log would read as a doc store older than its log.
            self.next_lsn, self.last_appended = first.lsn, first.lsn - 1
        except OSError:
            log.exception("%s: cannot cut the log back after a failed write", self.label)
        for p in doomed:
            p.error = error
        self.pending = [p for p in self.pending if p.lsn < first.lsn]

    def _apply_pending(self) -> None:
        """Apply, in log order, every pending record that is durable (caller holds lock)."""
        batch = []
        for p in self.pending:
            if not self.wal.durable(p.lsn):
                break
            batch.append(p)
        if not batch:
            return
        stored = self._for_store(batch)  # the batch's last records: those before it remove nothing stored
        try:
            gone = [[]] * (len(batch) - len(stored)) + (self._apply_to_store(stored) if stored else [])
        except (sqlite3.Error, OSError) as e:
            self._fail_pending(lambda p: True, e)
            return
        self.pending = self.pending[len(batch):]
        with self.mem_lock:
            for p, removed in zip(batch, gone):
                if removed is not None:  # None: set aside, its error set
                    self._apply_to_memory(p, removed)
                    p.applied = True

    def settle(self) -> None:
        """Make every logged record durable and applied (caller holds lock)."""
        if self.pending:
            self.wal.sync(self.last_appended, lambda: self.last_appended)
            self._apply_pending()

    # -- applying ------------------------------------------------------------------------------
    def _for_store(self, batch: list[StoreRecord]) -> list[StoreRecord]:
        """The records of a batch the doc store applies: all of them, or where there is none yet (a shard's), those
        from the first that carries documents on (which makes it)."""
        if self.store is not None:
            return batch
        first = next((i for i, w in enumerate(batch) if w.ids), len(batch))
        return batch[first:]

    def _apply_to_store(self, batch: list[StoreRecord], check: bool = False) -> list[list[int] | None]:
        """Apply a batch of log records to the doc store, in log order: keys removed per write, None for a write
        set aside (_set_aside), so that no entry blocks those after it or the opening of the store. check: the
        records come from the log at open (a replay), and each is checked again as a write is today
        (values.logged_problem: a version that checked less may have logged it); those that fail are set aside.
        Live writes were checked before they were logged."""
        if self.store is None:  # a shard's first write that carries documents makes its doc store
            self.store = DocStore(self.path / DOCS, self.dim, create=True)
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

    def _apply_run(self, batch: list[StoreRecord]) -> list[list[int] | None]:
        """One SQLite transaction for the batch, with the last lsn it applied; where a write cannot be applied
        (ENTRY_ERRORS), each is applied in its own transaction and the one that cannot is set aside. A disk's
        error (sqlite3.OperationalError, OSError) fails the batch."""
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

    def _apply_batch(self, batch: list[StoreRecord]) -> list[list[int]]:
        s = self.store
        removed = []
        s.begin()
        try:
            for w in batch:
                updated = None
                if w.op == "clear":
                    gone = s.remove_all()
                elif w.op == "delete_where":
                    gone = s.remove_where(*compile_filter(json.loads(w.filter)))
                elif w.op in METADATA_OPS:
                    gone, updated = [], s.update_metadata(w.ids, w.metas, w.op == "merge_metadata")
                elif self.assigns_keys:  # documents replaced by name
                    gone = s.remove(w.ids)
                else:  # by key, as the writer gave them
                    gone = s.remove_rows(w.keys.tolist())
                if w.op == "upsert" and w.ids:
                    s.insert(w.keys, w.ids, w.texts, w.metas, w.vectors)
                    if w.guests is not None and any(g >= 0 for g in w.guests):
                        s.mark_text_guests(*zip(*((k, g) for k, g in zip(w.keys.tolist(), w.guests) if g >= 0)))
                    if self.assigns_keys:
                        self._took_keys(w)
                w.result = len(gone) if updated is None else updated
                removed.append(gone)
            s.commit(batch[-1].lsn, self.next_key)
        except BaseException:
            s.rollback()
            raise
        return removed

    def _took_keys(self, w: StoreRecord) -> None:
        if w.keys is not None and len(w.keys):
            self.applied_next_key = max(self.applied_next_key, int(w.keys[-1]) + 1)
            self.next_key = max(self.next_key, self.applied_next_key)

    def _set_aside(self, w: StoreRecord, error: BaseException) -> None:
        """A log record the doc store cannot apply, kept whole in the store's set_aside table with why, in the
        transaction that moves applied_lsn past it: the writes after it apply, a reopen does not replay it, and
        info() reports it. Its writer (if still waiting) gets InputError; the keys an upsert took are not reused."""
        reason = f"{type(error).__name__}: {error}".encode("utf-8", "backslashreplace").decode()[:2000]
        if w.op == "upsert" and self.assigns_keys:
            self._took_keys(w)
        self.store.begin()
        try:
            self.store.set_aside(w.lsn, w.op, w.ids, reason, w.payload())
            self.store.commit(w.lsn, self.next_key)
        except BaseException:
            self.store.rollback()
            raise
        self.set_aside_count += 1
        n = len(w.ids) if w.ids else (0 if w.keys is None else len(w.keys))
        w.error = InputError(f"{self.label}: write {w.lsn} ({w.op} of {n} documents) cannot be applied and was set "
                             f"aside ({reason}); the collection's info lists it")
        log.error("%s: log entry %d (%s of %d documents) cannot be applied and is set aside: %s",
                  self.label, w.lsn, w.op, n, reason)

    def _apply_to_memory(self, w: StoreRecord, gone: list[int]) -> None:
        """The live set after w (caller holds mem_lock, or opens the store): the keys it removed tombstoned or
        dropped from the fresh tier, an upsert's added. Where the writer gave the keys, its result is how many of
        them were live."""
        if self.assigns_keys:
            self.live_set.remove(gone)
        else:
            w.result = self.live_set.remove(w.keys)
        if w.op == "upsert":
            vectors = engine_form(w.vectors, self.metric) if self.assigns_keys else w.vectors
            self.live_set.add(w.keys, vectors)
        if self.applied_hook is not None:
            self.applied_hook(w)

    # -- after a merge -------------------------------------------------------------------------
    def compact(self, keep_after: int) -> int:
        """Drop the log's records up to keep_after, which a published generation holds (caller holds lock): the
        pending records applied and the doc store made durable first (its commits are not fsynced: the log was
        what made them durable). Returns the bytes dropped."""
        if not self.log_open:
            return 0
        self.settle()
        if self.store is not None:
            self.store.make_durable()
        if keep_after >= self.last_appended:
            before = self.wal.bytes
            self.wal.reset()
            return before
        return self.wal.rewrite(lambda lsn: lsn > keep_after)

    def close(self, keep_store: bool = False) -> None:
        """keep_store: the doc store stays open (handed on to whoever takes the directory over next)."""
        self.wal.close()
        self.log_open = False
        if self.store is not None and not keep_store:
            self.store.close()
            self.store = None
