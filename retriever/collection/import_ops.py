"""A collection's snapshots and bulk imports (Collection's part, #69): the import's state and slot, the
import (importer.py stages and builds it) and its publication as the collection's first generation.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection import importer, snapshot
from fusionrag.retriever.collection.config import CURRENT_FORMAT
from fusionrag.retriever.collection.contract import in_use
from fusionrag.retriever.collection.generations import (Generation, gen_dir_name, rows_digest, write_json_atomic,
                                                        write_rows)
from fusionrag.retriever.engine.index import Index
from fusionrag.retriever.errors import StorageError


class ImportOps:
    """Collection's import operations: a part of Collection (api.py), whose state they use."""

    @in_use
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
    # Its state: self._imports (importer.ImportState, the lifecycle a sharded collection's import shares).

    def _load_import_state(self) -> None:
        """The last import's state, as the previous process left it; staging an interrupted one left removed."""
        for p in self.path.glob(".import-*"):
            shutil.rmtree(p, ignore_errors=True)

        def interrupted() -> str:
            n = self.store.count()
            return ("the service stopped during the import: nothing of it was stored; import again" if not n else
                    f"the service stopped during the import, after its {n} documents were stored (the next merge "
                    "indexes them)")
        self._imports.load(interrupted)

    @in_use
    def claim_import(self) -> None:
        """Reserve this empty collection for one bulk import before its files arrive (the service claims it,
        then uploads): ConflictError if it holds documents or another import holds it. Writes are refused
        until the import ends; import_files(claimed=True) runs it, release_import gives up a claim whose
        upload failed."""
        with self._lock:
            importer.check_empty(self)
            self._imports.claim()

    def release_import(self) -> None:
        """Give up a claim (its upload was refused, and the caller told so): the import state is as before it."""
        with self._lock:
            self._imports.release()

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
                state = None if self._imports.now is None else self._imports.now["state"]
                if self._closed is None and ((ran and state == "running") or (claimed and state == "uploading")):
                    self._imports.failed(importer.public_reason(e, self.path, *folders))
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise StorageError(f"collection {self.name!r}: the import could not write: {e}") from e
            raise

    @in_use
    def _import_files(self, documents, vectors, progress, claimed: bool, ran: list) -> dict:
        from fusionrag.retriever.collection.embedding import get_embedder

        with self._merge_lock:  # no merge meanwhile: the import publishes the next generation itself
            with self._lock:
                if not claimed:
                    importer.check_empty(self)
                self._imports.start(claimed)
                ran.append(True)
            try:
                embedder = get_embedder(self.embedding) if self.embedding else None
                done = importer.import_files(self, None if documents is None else Path(documents),
                                             None if vectors is None else Path(vectors), progress, embedder)
            finally:
                self._progress = None
            with self._lock:
                self._imports.done(done)
            return done

    def is_empty(self) -> bool:
        """No document stored, indexed or fresh (what an import needs)."""
        return not (self.store.count() or len(self._main.rows) or self._local.live_set.fresh.n)

    def import_steps(self) -> tuple:
        """What importer.import_files calls back: (each step's progress, the build's config, the publication of
        the staged import as the collection's first generation)."""
        return self._merge_step, self._build_config, self._publish_import

    def _publish_import(self, n: int, source: Path, documents, index_dir: Path | None, steps) -> int:
        """Store the n imported documents (documents(): chunks of (id, text, metadata JSON); vectors from
        source) in one transaction, then publish index_dir (if any) as the next generation over them.
        Caller holds _merge_lock; writes are refused meanwhile. Returns the documents stored."""
        vecs = np.load(source, mmap_mode="r")
        with self._lock:
            old = self._main
            base = self._local.next_key
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
            self._local.next_key = self._local.applied_next_key = base + n
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
