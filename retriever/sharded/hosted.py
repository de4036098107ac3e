"""A sharded collection held in a data directory beside the single ones (Catalog.create(..., shards=N), POST
/v1/collections with "shards"; docs/sharded.md, "A sharded collection in the service").

collections/<name>/collection.json records the shard count. The collection's first import builds it: build_sharded
of the import's documents (JSON lines with texts, vectors and metadata, or a vector file and its JSON-lines
sidecar), texts without a vector embedded by the collection's model, into collections/<name>/index/ (built under a
hidden name and renamed into place, so a crash never leaves half an index taken for a whole one). From then on
it is a ShardedCollection (sharded/docs.py) over that index, its shards in the service's process: written,
searched by vector, text and hybrid with filters, merged, snapshotted (snapshot.write_tree, its writes and merges
held still while the files are copied), restored and dropped as a collection is. Until that import it holds
nothing, and what needs documents (a write, a search) is refused with ConflictError (409) saying to import first:
a sharded collection's lists and their placement on shards are learnt from its documents, so there is nowhere to
put a document before them.

Its files take part in the catalog's pool of open files (quota.OpenFiles) as a collection's do, counted for what
its shards may hold (quota.DESCRIPTORS_PER_SHARD each): once the pool needs room, an idle one (no call in
progress, no merge, no import) closes its shards whole (their doc stores, logs, page files and locks) and its next
call opens them again, its shards' logs replayed; a call that would open them without leaving the pool's reserve
of descriptors free gets UnavailableError (503).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import sqlite3
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from fusionrag.retriever.collection import importer, quota, snapshot
from fusionrag.retriever.collection.config import CollectionConfig
from fusionrag.retriever.collection.contract import CollectionContract, Uses, in_use
from fusionrag.retriever.engine.config import BuildConfig, EngineConfig
from fusionrag.retriever.engine.vectors import as_source
from fusionrag.retriever.errors import ConflictError, FusionRAGError, InputError, StorageError, UnavailableError
from fusionrag.retriever.process import lower_thread_priority
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.retriever.sharded.router import ShardedIndex

log = logging.getLogger(__name__)

INDEX = "index"
BUILDING = ".index-building"


def _lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")) + 1


_CHILD = ("import pickle, sys; args = pickle.load(sys.stdin.buffer); sys.path[:] = args.pop('path'); "
          "from fusionrag.retriever.sharded.hosted import _child_build; _child_build(**args)")


def _child_build(fd: int, parent: int, vectors: str | None, out: str, shards: int, metric: str,
                 documents: str | None, progress: bool | None) -> None:
    """HostedSharded._build_in_child's process (python -c _CHILD, its arguments pickled on stdin): build_sharded,
    its progress and its outcome sent to the parent through the pipe fd."""
    send = Connection(fd, readable=False)
    try:  # die with the thread that started it (a SIGKILL of the service included)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before that took effect
        os._exit(1)
    lower_thread_priority()  # the threads it starts inherit it
    try:
        import threadpoolctl  # as the service's: BLAS on the calling thread, the build's native pool for the rest

        threadpoolctl.threadpool_limits(1, user_api="blas")
    except ImportError:
        pass
    try:
        manifest = build_sharded(vectors, out, shards, BuildConfig(metric=metric), documents=documents, use_ray=False,
                                 progress=progress, on_progress=lambda *step: send.send(("step", step)))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        try:
            pickle.loads(pickle.dumps(e))
            send.send(("error", e))
        except Exception:  # noqa: BLE001 - one that does not pickle: its words
            send.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
    else:
        send.send(("done", manifest))
    finally:
        send.close()


class _Stopped(Exception):
    """Raised into a build whose collection was closed meanwhile (dropped, or the service stopping)."""


class HostedSharded(Uses, CollectionContract):
    """A sharded collection in a catalog (see the module). Everything a ShardedCollection does, once built, is
    passed to it; before, reads answer empty and what needs documents is refused."""

    sharded = True

    def __init__(self, path, desc: dict, engine_config: EngineConfig | None = None,
                 collection_config: CollectionConfig | None = None, limits: quota.Limits | None = None,
                 files: quota.OpenFiles | None = None):
        """files: the catalog's pool of open files, which this collection's shards take part in (closed while it is
        idle and others need the room; see the module); None keeps them open until close."""
        self.path = Path(path)
        self.name, self.dim, self.metric = desc["name"], int(desc["dim"]), desc["metric"]
        self.embedding, self.shards, self.analyzer = desc.get("embedding"), int(desc["shards"]), desc.get("analyzer")
        self._engine_config = engine_config or EngineConfig()
        self._collection_config = collection_config or CollectionConfig()
        self._limits = limits or quota.Limits()
        self._lock = threading.Lock()  # the import's state, and the build's switch to the index
        self._closed: tuple[type, str] | None = None  # once closing began: what a later call raises
        self._inner: ShardedCollection | None = None  # the built index, while its shards' files are open
        self._progress: dict | None = None
        self._merging: threading.Thread | None = None
        self._files = files
        self._users = 0  # calls in progress, an import, and a background merge
        self._users_cv = threading.Condition()  # _users, and the shards' opening and closing
        self._dormant = False  # built, its shards closed until its next call
        for p in self.path.glob(f".*{BUILDING[1:]}*"):  # a build a crash cut short (and its staging): imported again
            shutil.rmtree(p, ignore_errors=True)
        # The last import's state (importer.ImportState: a collection's import lifecycle).
        self._imports = importer.ImportState(self.path, f"sharded collection {self.name!r}")
        self._imports.load(lambda: "the service stopped during the import: nothing of it was kept; import again")
        if (self.path / INDEX).is_dir():
            try:
                if self._files is not None:
                    self._files.make_room(self.shards * quota.DESCRIPTORS_PER_SHARD)
            except UnavailableError:  # no room now: its first call opens it (or says why it cannot)
                self._dormant = True
            else:
                self._inner = self._open()

    def _open(self) -> ShardedCollection:
        index = ShardedIndex.open(self.path / INDEX, self._engine_config)
        if index.dim != self.dim or index.metric != self.metric:
            index.close()
            raise InputError(f"sharded collection {self.name!r}: its index is of dimension {index.dim} and metric "
                             f"{index.metric}, the collection's {self.dim} and {self.metric}")
        return ShardedCollection(index, self.name, self._collection_config)

    # -- its files: open while it is used, closed while it is idle and the pool needs the room ---------

    @property
    def descriptors(self) -> int:
        """What its files may take while they are open (quota.OpenFiles counts it so): its shards' share each, or
        0 while it holds none open (not built yet, or closed while idle)."""
        return self.shards * quota.DESCRIPTORS_PER_SHARD if self._inner is not None else 0

    def _room_to_open(self) -> int:
        return self.shards * quota.DESCRIPTORS_PER_SHARD

    def _wake(self) -> None:
        """Open the shards release_files closed (caller holds _users_cv)."""
        try:
            self._inner = self._open()
        except (FusionRAGError, OSError, sqlite3.Error) as e:
            raise UnavailableError(f"sharded collection {self.name!r} cannot reopen its shards: {e}") from e
        self._dormant = False

    def release_files(self) -> bool:
        """Close its shards whole (their doc stores, logs, page files and locks) if nothing uses the collection now
        (no call, import or merge in progress); its next call opens them again. True when they were closed."""
        with self._users_cv:
            if self._users or self._closed is not None or self._dormant or self._inner is None:
                return False
            inner, self._inner = self._inner, None
            self._dormant = True
            # Under the lock: a call that comes now opens the shards once these have let go of them.
            inner.close()
            return True

    # -- what is passed to the built collection --------------------------------------------------------

    def _built(self) -> ShardedCollection:
        inner = self._inner
        if inner is not None:
            return inner
        self._refuse_if_closed()
        running = self._imports.active
        raise ConflictError(f"sharded collection {self.name!r} holds no documents yet: " + (
            "its import is building it (progress in the collection's info)" if running else
            f"its first import builds it (POST /v1/collections/{self.name}/import, JSON lines of documents)"))

    @property
    def config(self) -> CollectionConfig:
        return self._collection_config

    @property
    def index(self) -> ShardedIndex:
        """The built index, its shards opened where they were closed (a caller holding it past its use may see them
        closed again: tests and tools)."""
        self._enter()
        try:
            return self._built().index
        finally:
            self._leave()

    @in_use
    def search(self, *args, **kwargs):
        return self._built().search(*args, **kwargs)

    @in_use
    def scroll(self, *args, **kwargs):
        return self._built().scroll(*args, **kwargs)

    @in_use
    def filter_warnings(self, filter: dict) -> list[str]:
        return self._built().filter_warnings(filter)

    @in_use
    def __len__(self) -> int:
        inner = self._inner
        return 0 if inner is None else len(inner)

    @in_use
    def count(self, filter: dict | None = None) -> int:
        inner = self._inner
        return 0 if inner is None else inner.count(filter)

    @in_use
    def get(self, ids, with_vectors: bool = False) -> list:
        inner = self._inner
        return [] if inner is None else inner.get(ids, with_vectors)

    # -- writes, and the merges they call for ----------------------------------------------------------

    @in_use
    def upsert(self, docs) -> list[str]:
        out = self._built().upsert(docs)
        self._written()
        return out

    add = upsert

    @in_use
    def delete(self, ids) -> int:
        inner = self._inner
        if inner is None:
            return 0
        out = inner.delete(ids)
        self._written()
        return out

    @in_use
    def delete_where(self, filter: dict) -> int:
        out = self._built().delete_where(filter)
        self._written()
        return out

    @in_use
    def set_metadata(self, updates, merge: bool = True) -> int:
        out = self._built().set_metadata(updates, merge)
        self._written()
        return out

    @in_use
    def clear(self) -> None:
        self._built().clear()

    def _written(self) -> None:
        """After a write: once a merge is due by a collection's rule over all the shards (CollectionConfig.
        shard_merge: their fresh documents or their tombstones number merge_fresh_count), merge in a background
        thread (one at a time) each shard holding its share of them, as the service on Ray merges its shards;
        searches and writes go on meanwhile. The merge is a use of the collection
        until it ends (its shards stay open). Caller: a use of the collection."""
        cfg, inner = self._collection_config, self._inner
        if inner is None or not cfg.background_merge:
            return
        ix = inner.index
        share = cfg.shard_merge(len(ix.fresh_owner), len(ix.base_gone), ix.n_shards)
        if share is None:
            return
        with self._users_cv:
            if self._closed is not None or (self._merging is not None and self._merging.is_alive()):
                return
            self._users += 1  # left by the merge's thread
            self._merging = threading.Thread(target=self._merge, args=(ix, share),
                                             name=f"merge-{self.name}", daemon=True)
            try:
                self._merging.start()
            except BaseException:
                self._users -= 1
                raise

    def _merge(self, ix: ShardedIndex, min_fresh: int) -> None:
        lower_thread_priority()  # a merge takes the cores that searches leave
        try:
            ix.merge_shards(min_fresh=min_fresh)
        except Exception:  # noqa: BLE001 - the next write past the threshold tries again
            log.warning("sharded collection %r: merging its shards failed", self.name, exc_info=True)
        finally:
            self._leave()

    @in_use
    def info(self) -> dict:
        inner = self._inner
        if inner is not None:
            out = inner.info()
        else:
            out = {"name": self.name, "dimension": self.dim, "metric": self.metric, "embedding": self.embedding,
                   "state": "empty", "count": 0, "sharded": True, "shards": self.shards,
                   "build_state": {"indexed": 0, "fresh": 0}}
        out["text_analyzer"] = self.analyzer
        out["build_state"] = {**out.get("build_state", {}), "import": self._imports.now, "progress": self._progress}
        return out

    # -- import: the build -----------------------------------------------------------------------------

    def _check_importable(self) -> None:
        """Caller holds _lock; what an import claims or starts then checks itself (ImportState: none active)."""
        self._refuse_if_closed()
        if self._inner is not None:
            raise ConflictError(f"sharded collection {self.name!r} is built: its documents are written by upsert "
                                "now (an import fills an empty collection)")

    @in_use
    def claim_import(self) -> None:
        """Reserve this empty collection for one import before its files arrive (as Collection.claim_import);
        UnavailableError (503) while the pool of open files has no room for the shards it would build."""
        self._room_for_shards()
        with self._lock:
            self._check_importable()
            self._imports.claim()

    def _room_for_shards(self) -> None:
        """Before a build: UnavailableError unless the process has room for the shards' files past the pool's
        reserve (idle collections close theirs first where needed)."""
        if self._files is not None and self._inner is None:
            self._files.make_room(self.shards * quota.DESCRIPTORS_PER_SHARD)

    def release_import(self) -> None:
        with self._lock:
            self._imports.release()

    @in_use
    def import_files(self, documents=None, vectors=None, progress: bool | None = None, claimed: bool = False) -> dict:
        """Build this empty sharded collection from files: JSON lines of documents (a line's vector, else its
        text embedded by the collection's model), or a vector file with (or without) its JSON-lines sidecar, line
        i describing vector i. Returns what it did; whatever happens, the import's state ends "done" or "failed"
        with the reason (info()'s build_state.import)."""
        t0 = time.perf_counter()
        if not claimed:
            self._room_for_shards()
        with self._lock:
            if not claimed:
                self._check_importable()
            self._imports.start(claimed)
        try:
            done = self._build(None if documents is None else Path(documents),
                               None if vectors is None else Path(vectors), progress)
        except BaseException as e:
            with self._lock:
                if self._closed is None:
                    folders = [Path(p).resolve().parent for p in (documents, vectors) if p is not None]
                    self._imports.failed(importer.public_reason(e, self.path, *folders))
            if isinstance(e, _Stopped):
                raise UnavailableError(f"sharded collection {self.name!r} was closed during its import") from e
            if isinstance(e, OSError):
                raise StorageError(f"sharded collection {self.name!r}: the import could not write: {e}") from e
            raise
        finally:
            self._progress = None
        done["seconds"] = round(time.perf_counter() - t0, 3)
        with self._lock:
            self._imports.done(done)
        return done

    def _step(self, step: str, done: int, total: int) -> None:
        if self._closed is not None:
            raise _Stopped()
        self._progress = {"step": step, "done": done, "total": total}

    def _build(self, documents: Path | None, vectors: Path | None, progress: bool | None) -> dict:
        if documents is None and vectors is None:
            raise InputError("an import needs documents (JSON lines), vectors (a vector file), or both")
        if vectors is not None:
            dim = as_source(vectors).dim
        elif self.embedding is None:
            dim = importer.first_vector_dim(documents)
        else:
            dim = self.dim  # texts the model embeds, lines with vectors checked by the build
        if dim != self.dim:
            raise InputError(f"the import's vectors have dimension {dim}, the collection {self.dim}")
        # About what the build writes: the vectors' pages, codes and lists, the documents' stores (a JSON line's
        # vector takes more bytes as text than in the pages), and the vectors staged from JSON lines.
        need = 2 * sum(p.stat().st_size for p in (documents, vectors) if p is not None)
        if vectors is None and self.embedding is not None:  # texts the model embeds: staged, then paged
            need = max(need, 3 * 4 * self.dim * _lines(documents))
        quota.check_room(self.path, need, self._limits.disk_reserve_bytes, "the sharded collection's build")
        self._room_for_shards()  # the build opens the shards' files, then the collection holds them
        out = self.path / BUILDING
        shutil.rmtree(out, ignore_errors=True)
        try:
            if vectors is None and self.embedding is not None:  # texts the service's model embeds: here
                manifest = build_sharded(None, out, self.shards, BuildConfig(metric=self.metric), documents=documents,
                                         embedding=self.embedding, use_ray=False, progress=progress,
                                         on_progress=self._step)
            else:
                manifest = self._build_in_child(vectors, out, documents, progress)
            if manifest["dim"] != self.dim:
                raise InputError(f"the import's vectors have dimension {manifest['dim']}, the collection {self.dim}")
            with self._lock:
                if self._closed is not None:
                    raise _Stopped()
                (out).rename(self.path / INDEX)
                try:
                    self._inner = self._open()
                except BaseException:
                    (self.path / INDEX).rename(out)
                    raise
        finally:
            shutil.rmtree(out, ignore_errors=True)
        if self._files is not None:  # its shards' files are open now: counted in the pool
            self._files.used(self, True)
        return {"documents": int(manifest["count"]), "stored": int(manifest["count"]), "indexed": True,
                "shards": self.shards}

    def _build_in_child(self, vectors: Path | None, out: Path, documents: Path | None, progress: bool | None) -> dict:
        """build_sharded of the import's files into out, in a child process at the background's priority: its
        Python then holds a GIL of its own, not the service's, whose requests waited for it (a build's threads
        held 22% of the service's GIL-held time while one tenant built beside another's searches, py-spy --gil). Its progress comes back through a pipe to
        _step (which stops it once the collection closes: the child is killed), its error as itself; the child dies
        with the thread that started it (PR_SET_PDEATHSIG), so a service killed mid-import leaves no build
        running, only its staging, which the collection removes as it opens."""
        # A fresh interpreter (python -c), not multiprocessing's spawn, which imports the parent's __main__ again:
        # a caller's script without its `if __name__ == "__main__"` guard would run again in the child.
        r, w = os.pipe()
        try:
            child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, pass_fds=(w,))
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        recv = Connection(r, writable=False)
        try:
            child.stdin.write(pickle.dumps({
                "path": list(sys.path), "fd": w, "parent": os.getpid(),
                "vectors": None if vectors is None else str(vectors), "out": str(out), "shards": self.shards,
                "metric": self.metric, "documents": None if documents is None else str(documents),
                "progress": progress}))
            child.stdin.close()
        except OSError:  # it died already: said below
            pass
        try:
            while True:
                if not recv.poll(0.2):
                    if self._closed is not None:
                        raise _Stopped()
                    if child.poll() is not None and not recv.poll(0):
                        raise StorageError(f"sharded collection {self.name!r}: its build ended without a word "
                                           f"(exit code {child.returncode})")
                    continue
                try:
                    what, value = recv.recv()
                except EOFError:
                    try:
                        child.wait(5)
                    except subprocess.TimeoutExpired:
                        pass
                    raise StorageError(f"sharded collection {self.name!r}: its build ended without a word "
                                       f"(exit code {child.returncode})") from None
                if what == "step":
                    self._step(*value)
                elif what == "error":
                    raise value
                else:
                    return value
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
            recv.close()
            for p in self.path.glob(f"{BUILDING}.tmp-{child.pid}-*"):  # its staging, were it killed
                shutil.rmtree(p, ignore_errors=True)

    # -- snapshot, close ------------------------------------------------------------------------------

    @in_use
    def snapshot(self, dest) -> dict:
        """Write this collection's state now to the archive dest (snapshot.write_tree): its writes and merges
        wait while the files are copied; searches go on. Returns what the archive holds."""
        describe = {"collection": self.name, "dimension": self.dim, "metric": self.metric,
                    "embedding": self.embedding, "shards": self.shards}
        with self._lock:
            inner = self._inner
            if inner is None and self._imports.active:
                raise ConflictError(f"sharded collection {self.name!r} is importing: snapshot it once that is done")
        try:
            if inner is None:
                return snapshot.write_tree(self.path, {**describe, "documents": 0}, Path(dest))
            with inner.index.quiesced():
                return snapshot.write_tree(self.path, {**describe, "documents": len(inner)}, Path(dest))
        except (OSError, sqlite3.Error) as e:  # a shard's doc store copied by SQLite's backup: its errors too
            raise StorageError(f"sharded collection {self.name!r}: cannot write its snapshot: {e}") from e

    def close(self, error: FusionRAGError | None = None) -> None:
        """Refuse what comes next (with error, else "closed"), stop an import's build at its next step, wait for
        the calls in progress and a merge to end, and stop the shards."""
        with self._lock:
            if self._closed is not None:
                return
            error = error or UnavailableError(f"collection {self.name!r} is closed")
            self._closed = (type(error), str(error))
        with self._users_cv:
            while self._users:
                self._users_cv.wait()
            inner, self._inner = self._inner, None
        # Nothing uses the collection now, and nothing can start to.
        if self._files is not None:
            self._files.forget(self)
        if inner is not None:
            inner.close()
