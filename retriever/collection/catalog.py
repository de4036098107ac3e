"""All collections under one data directory: create, open, restore, drop, with one catalog per directory."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
import threading
import uuid
import weakref
from pathlib import Path
from typing import Callable

import numpy as np

from fusionrag.retriever import dirlock
from fusionrag.retriever.collection import quota, snapshot
from fusionrag.retriever.collection.api import Collection
from fusionrag.retriever.collection.config import COLLECTION_FORMAT, NAME_RE, CollectionConfig, check_analyzer
from fusionrag.retriever.collection.contract import CatalogContract
from fusionrag.retriever.collection.docstore import DocStore
from fusionrag.retriever.collection.generations import write_json_atomic
from fusionrag.retriever.engine.config import METRICS, EngineConfig
from fusionrag.retriever.engine.manifest import fsync_path
from fusionrag.retriever.errors import (ConflictError, FusionRAGError, InputError, NotFoundError, QuotaError,
                                        StorageError, UnavailableError, UnsupportedError)

log = logging.getLogger(__name__)

MAX_SHARDS = 16  # shards of one sharded collection at most: each runs in the service's process, its files open


def check_description(dim, metric, embedding) -> None:
    """What a collection's description must hold, at create and at restore (InputError says what is wrong)."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or not 1 <= dim <= 65536:
        raise InputError(f"dim must be an integer in [1, 65536], got {dim!r:.80}")
    if metric not in METRICS:
        raise InputError(f"metric must be one of {METRICS}, got {metric!r:.80}")
    if embedding is not None and not isinstance(embedding, str):
        raise InputError(f"embedding must be a model name or None, got {embedding!r:.80}")


class Catalog(CatalogContract):
    """All collections under one data directory (root/collections/<name>/). Thread-safe.

    A collection that fails to open is set aside with the reason (its calls get UnavailableError,
    `failed()` lists it) while the others serve; dropping it removes it.

    One catalog at a time holds a data directory (an exclusive lock on root/catalog.lock, released by
    close or the process's end): two would append to the same logs and rebuild the same indexes.

    A sharded collection (create's shards; its collection.json says how many) is opened by open_sharded(path,
    description, catalog), which the layer above gives (retriever/directory.py catalog(): a HostedSharded); a
    catalog without it sets such a collection aside as one it cannot open.

    Aliases (Qdrant's): other names for collections, kept in root/aliases.json ({alias: collection}, written
    atomically) and changed only by `update_aliases`, whose actions apply together or not at all; `resolve` gives
    the collection a name stands for. An alias never shares a name with a collection, points to a collection (not
    to another alias), and a collection an alias points to is not dropped (ConflictError) until no alias does."""

    def __init__(self, root: str | os.PathLike, engine_config: EngineConfig | None = None,
                 collection_config: CollectionConfig | None = None, limits: quota.Limits | None = None,
                 open_sharded: Callable | None = None):
        self.root = Path(root)
        self.dir = self.root / "collections"
        self.dir.mkdir(parents=True, exist_ok=True)
        # Released by close, or when the catalog is collected without one.
        self._release = weakref.finalize(self, os.close, _hold(self.root / "catalog.lock"))
        self.engine_config = engine_config or EngineConfig()
        self.collection_config = collection_config or CollectionConfig()
        self.limits = limits or quota.Limits()
        self.open_sharded = open_sharded
        self.files = quota.OpenFiles(self.limits)  # the collections whose files are open, most recently used last
        self._lock = threading.Lock()
        self._open: dict[str, Collection] = {}
        self._failed: dict[str, str] = {}  # name -> why it would not open
        self._dropping: set[str] = set()  # dropped, waiting for their calls in progress to end
        self._restoring: set[str] = set()  # names a restore is unpacking a snapshot for
        self._closed = False
        self._aliases: dict[str, str] = _load_aliases(self.root / ALIASES_FILE)  # replaced whole, never changed
        for p in self.dir.glob(".*"):  # creates and drops a crash interrupted
            shutil.rmtree(p, ignore_errors=True)

    @staticmethod
    def _check_name(name) -> str:
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise InputError(f"collection name {name!r:.80} must be 1-64 letters, digits, '_', '.' or '-', "
                             "starting with a letter or digit")
        return name

    def names(self) -> list[str]:
        """Every collection, those that failed to open included (each a directory named like one)."""
        with self._lock:
            dropping = set(self._dropping)
        return sorted(p.name for p in self.dir.iterdir()
                      if NAME_RE.fullmatch(p.name) and p.name not in dropping and p.is_dir())

    def failed(self) -> dict[str, str]:
        """The collections that failed to open, and why (no server paths in the reasons)."""
        with self._lock:
            return dict(self._failed)

    def open_all(self) -> dict[str, str]:
        """Open every collection; returns those that failed (see failed())."""
        for name in self.names():
            with contextlib.suppress(NotFoundError, UnavailableError):
                self.get(name)
        return self.failed()

    def _reason(self, e: BaseException, path: Path) -> str:
        text = f"{type(e).__name__}: {e}" if not isinstance(e, FusionRAGError) else str(e)
        return text.replace(f"{path}{os.sep}", "").replace(str(path), ".").replace(str(self.root), "<data-dir>")

    def _unavailable(self, name: str) -> UnavailableError:
        return UnavailableError(f"collection {name!r} failed to open: {self._failed[name]}; fix or restore its files "
                                "and restart the service, or delete the collection")

    def create(self, name: str, dim: int, metric: str = "cosine", embedding: str | None = None,
               allow: Callable[[list[str]], None] | None = None, text_analyzer: dict | None = None,
               shards: int | None = None) -> Collection:
        """allow(names): raises (QuotaError) when one more collection beside `names` would be too many for the
        caller; called under the catalog's lock, so two creates cannot both pass it. text_analyzer: how its
        texts are indexed and queried ({"stemming": "porter" | "none", "stop_words": "english" | "none"}; English
        by default), fixed for the collection's life. shards: a sharded collection of that many shards
        (retriever/sharded/hosted.py: empty until its first import builds it); None: a collection."""
        self._check_name(name)
        check_description(dim, metric, embedding)
        analyzer = check_analyzer(text_analyzer)
        check_shards(shards)
        if shards is not None and self.open_sharded is None:
            raise UnsupportedError("this catalog opens no sharded collection (open the data directory with "
                                   "fusionrag.retriever.directory.catalog)")
        if shards is not None and not self.files.fits(int(shards) * quota.DESCRIPTORS_PER_SHARD):
            room = quota.descriptor_limit() - self.files.reserve
            raise QuotaError(f"a sharded collection of {shards} shards may hold "
                             f"{int(shards) * quota.DESCRIPTORS_PER_SHARD} open files, and the service's open-files "
                             f"limit leaves {room} past its reserve (descriptor_reserve): ask for at most "
                             f"{max(0, room // quota.DESCRIPTORS_PER_SHARD)} shards")
        self.files.make_room()
        with self._lock:
            final = self.dir / name
            self._check_free(name, allow)
            tmp = self.dir / f".create-{name}-{uuid.uuid4().hex}"
            published = False
            try:
                # Made whole under a hidden name, then renamed into place: a crash or a full disk never
                # leaves half a collection behind.
                tmp.mkdir()
                desc = {"format": COLLECTION_FORMAT, "name": name, "dim": int(dim), "metric": metric,
                        "embedding": embedding, "analyzer": analyzer}
                if shards is not None:  # its documents are its shards' (made by its first import)
                    desc["shards"] = int(shards)
                write_json_atomic(tmp / "collection.json", desc)
                if shards is None:
                    DocStore(tmp / "docs.sqlite", int(dim), create=True, analyzer=analyzer).close()
                os.rename(tmp, final)
                published = True
                fsync_path(self.dir)
                return self._open_at(name, final)
            except (OSError, sqlite3.Error) as e:
                with contextlib.suppress(OSError):
                    if published:
                        os.rename(final, tmp)
                shutil.rmtree(tmp, ignore_errors=True)
                raise StorageError(f"cannot create collection {name!r}: {self._reason(e, tmp)}") from e

    def _open_at(self, name: str, path: Path) -> Collection:
        """Open the collection at path as `name`, in the pool of open files (caller holds _lock)."""
        desc = _description(path)
        if desc.get("shards") is not None:
            if self.open_sharded is None:
                raise UnsupportedError("a sharded collection, which this catalog does not open (open the data "
                                       "directory with fusionrag.retriever.directory.catalog)")
            col = self._open[name] = self.open_sharded(path, desc, self)
        else:
            col = self._open[name] = Collection(path, self.engine_config, self.collection_config, self.files,
                                                self.limits)
        self.files.used(col, True)
        return col

    def check_free(self, name: str, allow: Callable[[list[str]], None] | None = None) -> None:
        """ConflictError unless a collection `name` could be made now (QuotaError: not one more)."""
        self._check_name(name)
        with self._lock:
            self._check_free(name, allow)

    def _check_free(self, name: str, allow: Callable[[list[str]], None] | None = None) -> None:
        """ConflictError unless `name` can be taken now (caller holds _lock)."""
        if name in self._dropping:
            raise ConflictError(f"collection {name!r} is being deleted; create it again once that is done")
        if name in self._restoring:
            raise ConflictError(f"collection {name!r} is being restored from a snapshot")
        if (self.dir / name).exists():
            raise ConflictError(f"collection {name!r} already exists")
        if name in self._aliases:
            raise ConflictError(f"{name!r} is an alias (of collection {self._aliases[name]!r}); a collection may not "
                                "take an alias's name: delete the alias first")
        taken = sorted({p.name for p in self.dir.iterdir() if NAME_RE.fullmatch(p.name)} | self._restoring)
        if self.limits.max_collections and len(taken) >= self.limits.max_collections:
            raise QuotaError(f"the service holds {len(taken)} collections, its limit (max_collections): delete one "
                             "before making another")
        if allow is not None:
            allow(taken)

    # -- aliases ---------------------------------------------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """The collection `name` stands for: an alias's target, else the name itself (a dict read, no lock)."""
        return self._aliases.get(name, name)

    def aliases(self) -> dict[str, str]:
        """Every alias and the collection it points to."""
        return dict(self._aliases)

    def update_aliases(self, actions: list[tuple], allow: Callable[[str, str], None] | None = None) -> dict[str, str]:
        """Apply alias actions together, in order, or none of them: ("create", alias, collection) makes an alias or
        points an existing one elsewhere (a switch), ("delete", alias), ("rename", old, new). Checked against the
        aliases as the actions before it leave them; the whole set is written (aliases.json, atomically) before
        any search sees it. Returns the aliases after. InputError, NotFoundError, ConflictError say what is wrong.
        allow(kind, name): raises unless the caller may use this alias name (kind "alias") or collection (kind
        "collection"): asked, under the lock, for every alias an action names and every collection an alias it
        changes points to, before and after."""
        def check(kind: str, name: str) -> None:
            if allow is not None:
                allow(kind, name)

        with self._lock:
            new = dict(self._aliases)
            for action in actions:
                op, *args = action
                if op == "create":
                    alias, target = args
                    self._check_alias_name(alias)
                    self._check_name(target)
                    check("alias", alias)
                    check("collection", target)
                    if alias in new:  # a switch: the collection it leaves is one the caller may use too
                        check("collection", new[alias])
                    if target in new:
                        raise InputError(f"{target!r} is an alias; an alias points to a collection, not to an alias")
                    if target in self._dropping or not (self.dir / target).is_dir():
                        raise NotFoundError(f"collection {target!r} does not exist")
                    new[alias] = target
                elif op == "delete":
                    (alias,) = args
                    check("alias", alias)
                    if alias not in new:
                        raise NotFoundError(f"alias {alias!r} does not exist")
                    check("collection", new.pop(alias))
                elif op == "rename":
                    old, alias = args
                    check("alias", old)
                    if old not in new:
                        raise NotFoundError(f"alias {old!r} does not exist")
                    self._check_alias_name(alias)
                    check("alias", alias)
                    check("collection", new[old])
                    if alias in new and alias != old:
                        raise ConflictError(f"alias {alias!r} already exists")
                    new[alias] = new.pop(old)
                else:
                    raise InputError(f"unknown alias action {op!r}")
            if new != self._aliases:
                try:
                    write_json_atomic(self.root / ALIASES_FILE, {"format": 1, "aliases": new})
                except OSError as e:
                    raise StorageError(f"cannot write the aliases: {self._reason(e, self.root)}") from e
                self._aliases = new
            return dict(new)

    def _check_alias_name(self, alias) -> None:
        """An alias may take this name: valid, and no collection's (caller holds _lock)."""
        if not isinstance(alias, str) or not NAME_RE.fullmatch(alias):
            raise InputError(f"alias name {alias!r:.80} must be 1-64 letters, digits, '_', '.' or '-', "
                             "starting with a letter or digit")
        if (self.dir / alias).exists() or alias in self._restoring or alias in self._dropping:
            raise ConflictError(f"{alias!r} is a collection's name; an alias may not shadow a collection")

    def restore(self, name: str, archive, embedding_dim: Callable[[str], int] | None = None,
                allow: Callable[[list[str]], None] | None = None) -> Collection:
        """A new collection `name` from a snapshot archive (a binary file object; see Collection.snapshot).
        InputError for an archive that is not a whole, valid snapshot. Its collection.json is checked as
        create checks its arguments; embedding_dim(model): the dimension of an embedding model the caller
        allows (raising for any other), checked against the collection's. allow: as for create."""
        self._check_name(name)
        self.files.make_room()
        with self._lock:
            self._check_free(name, allow)
            self._restoring.add(name)
        tmp = self.dir / f".restore-{name}-{uuid.uuid4().hex}"
        final = self.dir / name
        try:
            tmp.mkdir()
            snapshot.extract(archive, tmp, self.limits.max_restore_bytes, self.limits.disk_reserve_bytes)
            desc = snapshot.rename_collection(tmp, name)
            try:
                check_description(desc.get("dim"), desc.get("metric"), desc.get("embedding"))
                check_analyzer(desc.get("analyzer"))
                check_shards(desc.get("shards"))
                if desc.get("embedding") is not None and embedding_dim is not None:
                    model_dim = embedding_dim(desc["embedding"])
                    if model_dim != desc["dim"]:
                        raise InputError(f"dimension {desc['dim']} does not fit embedding model {desc['embedding']!r} "
                                         f"(dimension {model_dim})")
            except UnavailableError:  # the model's endpoint, asked its dimension, did not answer: try again later
                raise
            except FusionRAGError as e:
                raise InputError(f"snapshot: collection.json: {e}") from e
            with self._lock:
                os.rename(tmp, final)
                try:
                    col = self._open_at(name, final)
                except BaseException as e:
                    os.rename(final, tmp)
                    if isinstance(e, OSError) or not isinstance(e, Exception):
                        raise
                    # It passed every check of its members, so what fails to open is what the archive holds.
                    raise InputError(f"snapshot: the restored collection does not open: "
                                     f"{self._reason(e, final)}") from e
                fsync_path(self.dir)
            return col
        except OSError as e:
            raise StorageError(f"cannot restore collection {name!r}: {self._reason(e, tmp)}") from e
        finally:
            snapshot.remove(tmp)
            with self._lock:
                self._restoring.discard(name)

    def peek(self, name: str):
        """The collection of this name if it is open now, else None: no lock, no file touched (a dict read), so the
        service's routes take an open collection on the event loop and go to a thread only to open one (get)."""
        return None if self._closed else self._open.get(name)

    def get(self, name: str) -> Collection:
        self._check_name(name)
        with self._lock:
            col = self._open.get(name)
            if col is not None:
                return col
            if self._closed:
                raise UnavailableError("the service is stopping")
            if name in self._failed:
                raise self._unavailable(name)
            path = self.dir / name
            if name in self._dropping or not path.is_dir():
                raise NotFoundError(f"collection {name!r} does not exist")
            self.files.make_room()
            try:
                return self._open_at(name, path)
            except Exception as e:  # noqa: BLE001 - whatever it was, this collection alone is set aside
                self._failed[name] = self._reason(e, path)
                log.error("collection %r failed to open: %s", name, self._failed[name], exc_info=e)
                raise self._unavailable(name) from e

    def drop(self, name: str) -> None:
        """Delete a collection: calls in progress on it finish first, later ones get NotFoundError."""
        self._check_name(name)
        with self._lock:
            path = self.dir / name
            if name in self._dropping or not path.is_dir():
                raise NotFoundError(f"collection {name!r} does not exist")
            if pointing := sorted(a for a, t in self._aliases.items() if t == name):
                raise ConflictError(f"collection {name!r} is the target of alias{'es' if len(pointing) > 1 else ''} "
                                    f"{', '.join(map(repr, pointing))}: delete or switch "
                                    f"{'them' if len(pointing) > 1 else 'it'} first (POST /v1/aliases)")
            self._dropping.add(name)
            self._failed.pop(name, None)
            col = self._open.pop(name, None)
        trash = self.dir / f".drop-{name}-{uuid.uuid4().hex}"
        try:
            if col is not None:
                col.close(NotFoundError(f"collection {name!r} was deleted"))
        finally:
            with self._lock:
                try:
                    os.rename(path, trash)
                    fsync_path(self.dir)
                except OSError as e:
                    raise StorageError(f"cannot delete collection {name!r}: {self._reason(e, path)}") from e
                finally:
                    self._dropping.discard(name)
        shutil.rmtree(trash, ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            cols = list(self._open.values())
            self._open.clear()
        for col in cols:
            col.close()
        self._release()  # after the collections: nothing of this catalog writes any more


ALIASES_FILE = "aliases.json"


def _load_aliases(path: Path) -> dict[str, str]:
    """The aliases stored at path ({} where there is no file); StorageError for a file that is not one of them."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise StorageError(f"cannot read the aliases ({path.name}): {e}") from e
    aliases = data.get("aliases") if isinstance(data, dict) else None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise StorageError(f"{path.name} does not hold aliases ({{\"aliases\": {{alias: collection}}}})")
    return dict(aliases)


def check_shards(shards) -> None:
    """A sharded collection's shard count: None (not sharded) or an integer in [1, MAX_SHARDS]."""
    if shards is not None and (isinstance(shards, bool) or not isinstance(shards, (int, np.integer))
                               or not 1 <= shards <= MAX_SHARDS):
        raise InputError(f"shards must be an integer in [1, {MAX_SHARDS}], got {shards!r:.80}")


def _description(path: Path) -> dict:
    """A collection's collection.json ({} where unreadable: the collection's own open says why)."""
    try:
        desc = json.loads((path / "collection.json").read_text())
    except (OSError, ValueError):
        return {}
    return desc if isinstance(desc, dict) else {}


def _hold(path: Path) -> int:
    """An exclusive lock on `path` for as long as the descriptor returned stays open; ConflictError,
    naming the holder, when another process (or catalog) holds it."""
    return dirlock.hold(path, lambda holder: f"data directory {path.parent} is in use by another catalog ({holder}): "
                        "stop the service using it, or go through its HTTP API")
