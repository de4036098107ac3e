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

Collection is made of its operations, a module each (#69): write_ops.py (WriteOps: the log, the doc store, the
fresh tier and tombstones), search_ops.py (SearchOps: count, get, scroll, search), merge_ops.py (MergeOps) and
import_ops.py (ImportOps: snapshots and bulk imports); this module holds its state, opening, files and closing,
and declares the collection contract (contract.py) the routes use.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection import importer
from fusionrag.retriever.collection.config import CollectionConfig, check_analyzer
from fusionrag.retriever.collection.contract import CollectionContract, Uses, in_use
from fusionrag.retriever.collection.docstore import DocStore
from fusionrag.retriever.collection.generations import Generation, load_published
from fusionrag.retriever.collection.import_ops import ImportOps
from fusionrag.retriever.collection.merge_ops import MergeOps
from fusionrag.retriever.collection.quota import DESCRIPTORS_PER_COLLECTION, Limits, OpenFiles
from fusionrag.retriever.collection.records import engine_form
from fusionrag.retriever.collection.search_ops import SearchOps
from fusionrag.retriever.collection.store import LiveSet, LocalStore
from fusionrag.retriever.collection.write_ops import WriteOps
from fusionrag.retriever.engine.config import EngineConfig, SearchParams
from fusionrag.retriever.engine.manifest import ArrayFileWriter
from fusionrag.retriever.engine.vectors import vector_problems
from fusionrag.retriever.errors import FusionRAGError, IndexFormatError, InputError, UnavailableError

# The most queries a search may hold to count as quick (Collection.quick): an engine call of four queries on a 38k x 384
# collection takes ~0.6-1 ms of one core on a 2-core VM, the span the service's event loop may be held by it.
QUICK_QUERIES = 4

log = logging.getLogger(__name__)


class Collection(WriteOps, SearchOps, MergeOps, ImportOps, Uses, CollectionContract):
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
        # The last bulk import: its state, and what it did or why it failed (import_ops.py).
        self._imports = importer.ImportState(self.path, f"collection {self.name!r}")
        self._build_config = replace(self.config.build, metric=self.metric)
        # Its log, doc store, fresh tier, tombstones and commit: the local store a shard is made of too (#69).
        self._local = LocalStore(self.path, self.dim, self.metric, f"collection {self.name!r}", legacy="collection",
                                 assigns_keys=True)
        self._local.admit = self._admit
        self._lock = self._local.lock  # log appends, applies, publishes
        self._mem_lock = self._local.mem_lock  # the in-memory state searches snapshot
        self._merge_lock = threading.Lock()
        self._merge_thread: threading.Thread | None = None
        self._merging = False
        self._merge_retry_at = 0.0
        self._users = 0  # calls in progress, and a background merge
        self._users_cv = threading.Condition()
        self._closed: tuple[type, str] | None = None  # once closing began: what a later call raises
        self._unsearchable = 0  # stored vectors the engine cannot use (written before they were refused)
        self._progress: dict | None = None  # the running merge's or import's step, for info()
        self._files = files
        self._dormant = False  # its doc store and log are closed until its next call

        self._main = Generation(0, None, np.empty(0, np.int64), -1)
        self.store = None
        try:
            records = self._local.open_log()
            # Until a first merge the log holds every write ever made, and a lost doc store can be
            # remade from it; after one, the doc store holds what the log no longer does.
            whole_log = not (self.path / "CURRENT").exists() and (not records or records[0][0] == 1)
            self.store = self._local.store = DocStore(self.path / "docs.sqlite", self.dim, create=whole_log,
                                                      analyzer=self.analyzer)
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
            self._local.next_key = self._local.applied_next_key = next_row
            self._local.replay(records, memory=False)  # the memory is read back from the doc store, below
            self._load_memory()
            self._load_import_state()
        except BaseException:
            self._local.wal.close()
            if self.store is not None:
                self.store.close()
            if self._main.index is not None:
                self._main.index.close()
            raise

    # -- opening -------------------------------------------------------------------------------
    def _load_memory(self) -> None:
        """The live set read back from the doc store: the generation's rows it no longer holds tombstoned, the
        rows written since the generation in the fresh tier."""
        live = self.store.live_rows()
        main = self._main
        live_set = LiveSet(main.rows, self.dim, ~np.isin(main.rows, live, assume_unique=True))
        rows, vecs, bad = self._usable(*self.store.rows_and_vectors(above=main.max_row))
        # Live rows a merge left out of the index it built (see _usable), and those of the fresh tier.
        self._unsearchable = bad + len(np.setdiff1d(live[live <= main.max_row], main.rows, assume_unique=True))
        if len(rows):
            live_set.add(rows, engine_form(vecs, self.metric))
        self._local.live_set = live_set

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
    def _room_to_open(self) -> int:
        return DESCRIPTORS_PER_COLLECTION

    def release_files(self) -> bool:
        """Close the doc store and the log if nothing uses the collection now (no call, merge or import in
        progress); its next call reopens them. True when they were closed."""
        with self._users_cv:
            if self._users or self._closed is not None or self._dormant or self._local.pending:
                return False
            self._local.wal.release()
            self.store.release()
            self._dormant = True
            return True

    def _wake(self) -> None:
        """Reopen what release_files closed (caller holds _users_cv)."""
        try:
            self._local.wal.reopen()
            try:
                self.store.reopen()
            except BaseException:
                self._local.wal.release()
                raise
        except (OSError, sqlite3.Error) as e:
            raise UnavailableError(f"collection {self.name!r} cannot reopen its files: {e}") from e
        self._dormant = False

    # -- reads ---------------------------------------------------------------------------------
    @in_use
    def __len__(self) -> int:
        return self.store.count()

    def crossover(self) -> int | None:
        """The call size from which the main index serves a search from the GPU, measured cheaper there than on
        the CPU tier beside it (filter_tier auto with CUDA; Index.crossover); None otherwise."""
        index = getattr(self._main, "index", None)  # read once: a merge may publish another meanwhile
        return index.crossover() if index is not None else None

    def quick(self, queries: int) -> bool:
        """A few queries (at most QUICK_QUERIES) on an index whose searches stay on the CPU (no GPU tier), a fresh
        tier (searched exactly) no larger than a merge leaves it, and its files open: work of a millisecond or so."""
        index = getattr(self._main, "index", None)  # read once: a merge may publish another meanwhile
        return (queries <= QUICK_QUERIES and not self._dormant and self._closed is None
                and self._local.live_set.fresh.n <= self.config.merge_fresh_count
                and (index is None or index.filter.name == "cpu"))

    # -- description ---------------------------------------------------------------------------
    @in_use
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
                "import": self._imports.now,
            },
            # log entries that could not be applied, kept aside (the writes after them applied)
            "set_aside": self._set_aside_info(),
        }

    def _set_aside_info(self) -> dict:
        if not self._local.set_aside_count:
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
        self._local.wal.close()
        self.store.close()
        with self._mem_lock:
            old, self._main = self._main, Generation(0, None, np.empty(0, np.int64), -1)
            unread = self._retire(old)
        if unread:
            old.index.close()
