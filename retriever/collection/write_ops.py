"""A collection's writes (Collection's part, #69): upsert, delete, delete_where, set_metadata and clear
logged, group-committed and applied to the doc store, the fresh tier and the tombstones; an entry that cannot be
applied set aside (ENTRY_ERRORS).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Mapping, Sequence

import numpy as np

from fusionrag.retriever.collection import tombstones
from fusionrag.retriever.collection.config import FRESH_HOLD
from fusionrag.retriever.collection.contract import in_use
from fusionrag.retriever.collection.filters import compile_filter
from fusionrag.retriever.collection.records import (METADATA_OPS, Document, Write, engine_form, metadata_record,
                                                    upsert_record)
from fusionrag.retriever.collection.values import check_ids, logged_problem
from fusionrag.retriever.errors import ConflictError, InputError, StorageError, UnavailableError

log = logging.getLogger(__name__)


# What applying a logged write raises when the write itself cannot be stored (a value SQLite refuses, a filter that
# no longer compiles), as opposed to the disk failing (sqlite3.OperationalError, OSError): such an entry is set
# aside and the log goes on (_set_aside).
ENTRY_ERRORS = (ValueError, TypeError, OverflowError, KeyError, IndexError, RecursionError,
                sqlite3.IntegrityError, sqlite3.DataError, sqlite3.InterfaceError)


class WriteOps:
    """Collection's write operations: a part of Collection (api.py), whose state they use."""

    # -- the write path ------------------------------------------------------------------------
    @in_use
    def upsert(self, docs: Sequence[Document]) -> list[str]:
        """Insert or replace documents; durable when it returns. Ids in input order."""
        w, ids = upsert_record(docs, self.dim, self.metric)
        if w.ids:
            self._commit(w)
        return ids

    add = upsert

    @in_use
    def delete(self, ids: Sequence[str]) -> int:
        ids = check_ids(ids, "delete")
        return self._commit(Write("delete", ids)) if ids else 0

    @in_use
    def delete_where(self, filter: dict) -> int:
        """Delete every document the filter passes, as one write: the filter is logged and evaluated when the
        write is applied, in the same transaction, so it sees every write logged before it and none after."""
        compile_filter(filter)  # a bad filter is refused before it is logged
        return self._commit(Write("delete_where", filter=json.dumps(filter, separators=(",", ":"), allow_nan=False)))

    @in_use
    def set_metadata(self, updates: Mapping[str, dict], merge: bool = True) -> int:
        """Change documents' metadata alone, as Qdrant's set_payload and Chroma's update do: their text, vector and
        place in the index stay (nothing is re-indexed). updates maps an id to its metadata: with merge, an RFC
        7386 merge patch over the stored metadata (a key given None is removed; objects merge key by key), else
        the whole new metadata. One durable write; unknown ids are skipped; returns how many were updated."""
        w = metadata_record(updates, merge)
        return self._commit(w) if w.ids else 0

    @in_use
    def clear(self) -> None:
        self._commit(Write("clear"))

    def _commit(self, w: Write) -> int:
        with self._lock:
            if self._imports.active:
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
