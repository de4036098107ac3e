"""A collection's merges (Collection's part, #69): when one is due, the background merge, and the merge
itself (the next generation built beside the current one and published by swapping one reference).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection import compaction, tombstones
from fusionrag.retriever.collection.config import FRESH_SHARE, MERGE_RETRY_S
from fusionrag.retriever.collection.contract import in_use
from fusionrag.retriever.collection.generations import Generation, gen_dir_name, write_json_atomic
from fusionrag.retriever.collection.records import engine_form
from fusionrag.retriever.collection.store import LiveSet
from fusionrag.retriever.process import lower_thread_priority, memory_limit
from fusionrag.retriever.errors import FusionRAGError

log = logging.getLogger(__name__)


class MergeOps:
    """Collection's merge operations: a part of Collection (api.py), whose state they use."""

    # -- merge ---------------------------------------------------------------------------------
    def _merge_due(self) -> bool:
        live, cfg = self._local.live_set, self.config
        return (cfg.merge_due(live.fresh.live_count, live.dead) or live.fresh.bytes >= self._fresh_limit()
                or self._local.wal.bytes >= cfg.merge_fresh_bytes)

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

    @in_use
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
            live_set = self._local.live_set
            if live_set.fresh.n == 0 and live_set.dead == 0:  # nothing to fold in
                self._checkpoint()
                return
            with self._mem_lock:
                old = self._main
                dead = tombstones.dead(live_set.tomb, len(old.rows))
                fresh_rows, fresh_vecs = live_set.fresh.live_items()
                max_row = self._local.applied_next_key - 1
                live = len(old.rows) - live_set.dead + len(fresh_rows)
                incremental = compaction.can_grow(self.config, old, live, fresh_vecs)
                # A rebuild reads the stored vectors as of this point.
                snap_con = None if incremental else self.store.snapshot()
                self._merging, live_set.removed = True, []  # what is removed while it runs

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
                self._merging, self._progress, self._local.live_set.removed = False, None, None
        shutil.rmtree(self.path / gen_dir_name(old.generation), ignore_errors=True)

    def _publish(self, new: Generation) -> None:
        """Swap in the new generation (caller holds _lock and _mem_lock)."""
        old = self._local.live_set
        dead = np.isin(new.rows, np.asarray(old.removed or [], np.int64))
        live_set = LiveSet(new.rows, self.dim, dead)
        rows, vecs = old.fresh.live_items()
        if new.index is None:  # nothing indexed: every live row is fresh
            rows, vecs, new.unsearchable = self._usable(*self.store.rows_and_vectors(-1))
            vecs = engine_form(vecs, self.metric)
        if new.unsearchable is not None:  # counted again by a rebuild; an incremental merge keeps the count
            self._unsearchable = new.unsearchable
        keep = rows > new.max_row
        if keep.any():
            live_set.add(rows[keep], vecs[keep])
        self._main, self._local.live_set = new, live_set

    def _checkpoint(self) -> None:
        """Make every logged write durable in the doc store, then empty the log (holds _lock)."""
        self._local.compact(self._local.last_appended)
