"""The collection contract (#69): what the service's routes, the integrations and the OpenAI vector stores use of a
collection and of the catalog that holds them, declared once.

Four classes hold a collection and reach the routes; each is a CollectionContract:
- Collection (collection/api.py): one local store (log, doc store, fresh tier, tombstones, generations) and its
  index, in a data directory;
- ShardedCollection (sharded/docs.py): a sharded index opened in this process (the Ray Serve leader's, a
  ShardedCatalog's);
- FollowerCollection (sharded/follow.py): a Ray Serve router replica's: vector searches on its own router, the
  rest on the leader's ShardedCollection;
- HostedSharded (sharded/hosted.py): a sharded collection in a data directory, built by its first import, each
  call passed to the ShardedCollection it opens.

Every member a route calls is here. What each must do is abstract; what only some do (snapshots, imports, merges
through the service, closing files while idle, a GPU's crossover) has a default here: a refusal
(UnsupportedError, 405, saying why) or the neutral answer, which a class that does it overrides. A search
answers a CollectionSearch whatever the class (records.py); a sharded one also fills its missing lists and
shards. The catalogs (Catalog, ShardedCatalog) are CatalogContracts the same way: aliases are optional.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from fusionrag.retriever.collection.config import CollectionConfig
from fusionrag.retriever.collection.records import CollectionSearch, Document
from fusionrag.retriever.errors import UnsupportedError

if TYPE_CHECKING:
    from fusionrag.retriever.collection.quota import Limits


def in_use(method):
    """Run a public method as one use of the collection (Collection's and HostedSharded's): its class's _enter
    before it (refused once closing began; files reopened where they were closed while idle), its _leave after,
    so close (a drop, a shutdown) and the pool of open files wait for every use to end."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        self._enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._leave()
    return call


class Uses:
    """The uses of a collection in progress (in_use), Collection's and HostedSharded's alike: close waits for them
    to end, a call that starts once closing began is refused with why (`_closed`: (the error's type, its words)),
    and a collection whose files were closed while idle (release_files) opens them at its next call, once the
    catalog's pool of open files has room for them (quota.OpenFiles). The class holds `_users`, `_users_cv`,
    `_closed`, `_dormant` and `_files`, and says how to open its files again (`_wake`, called holding _users_cv)
    and how many descriptors they take open (`_room_to_open`)."""

    def _room_to_open(self) -> int:
        raise NotImplementedError

    def _wake(self) -> None:
        raise NotImplementedError

    def _refuse_if_closed(self) -> None:
        if self._closed is not None:
            cls, message = self._closed
            raise cls(message)

    def _enter(self) -> None:
        if self._dormant and self._files is not None:
            self._files.make_room(self._room_to_open())
        with self._users_cv:
            self._refuse_if_closed()
            woke = self._dormant
            if woke:
                self._wake()
            self._users += 1
        if self._files is not None:
            self._files.used(self, woke)

    def _leave(self) -> None:
        with self._users_cv:
            self._users -= 1
            if not self._users:
                self._users_cv.notify_all()

    @property
    def dormant(self) -> bool:
        """Its files closed while it was idle (release_files), opened again by its next call."""
        return self._dormant


class CollectionContract(ABC):
    """A collection as the routes see it (see the module). Attributes every class has: `name`, `dim`, `metric`,
    `embedding` (the model its texts are embedded with, or None), `config` (CollectionConfig) and `path` (its
    directory). `sharded`: whether it is sharded (its searches may be partial, and say so)."""

    sharded: ClassVar[bool] = False
    name: str
    dim: int
    metric: str
    embedding: str | None
    config: CollectionConfig
    path: Path

    # -- writes --------------------------------------------------------------------------------------

    @abstractmethod
    def upsert(self, docs: Sequence[Document]) -> list[str]:
        """Insert or replace documents by id, durable when it returns; the ids in input order."""

    @abstractmethod
    def delete(self, ids: Sequence[str]) -> int:
        """Delete these documents; how many there were."""

    @abstractmethod
    def delete_where(self, filter: dict) -> int:
        """Delete the documents the filter passes; how many."""

    @abstractmethod
    def set_metadata(self, updates: Mapping[str, dict], merge: bool = True) -> int:
        """Replace (or, merge, patch) the metadata of these documents; how many were found."""

    @abstractmethod
    def clear(self) -> None:
        """Delete every document."""

    # -- reads ---------------------------------------------------------------------------------------

    @abstractmethod
    def __len__(self) -> int:
        """Live documents."""

    @abstractmethod
    def count(self, filter: dict | None = None) -> int:
        """How many documents the filter passes (all without one)."""

    @abstractmethod
    def get(self, ids: Sequence[str], with_vectors: bool = False) -> list[Document]:
        """The documents with these ids, in that order; those not found left out."""

    @abstractmethod
    def scroll(self, limit: int, after: int = -1, filter: dict | None = None,
               with_vectors: bool = False) -> tuple[list[Document], int | None]:
        """Up to limit documents past `after` in order, and where to continue (None at the end)."""

    @abstractmethod
    def search(self, vectors=None, k: int = 10, filter: dict | None = None, params=None,
               with_vectors: bool = False, **kw) -> CollectionSearch:
        """Per query, the k best hits (vector, text or hybrid search: keyword arguments texts, mode,
        text_weight, fusion, partial)."""

    @abstractmethod
    def filter_warnings(self, filter: dict) -> list[str]:
        """What in a filter will match nothing by its fields' types (a search still runs)."""

    @abstractmethod
    def info(self) -> dict:
        """The collection's description, state and statistics, as GET /v1/collections/{name} answers."""

    @abstractmethod
    def close(self) -> None:
        """Let go of its files (the catalog's drop and the service's stop)."""

    # -- optional: refused, or neutral, unless a class does it --------------------------------------------

    def snapshot(self, dest: str | os.PathLike) -> dict:
        """An archive of the collection at dest."""
        raise UnsupportedError(f"collection {self.name!r} is not snapshotted through the service")

    def claim_import(self) -> None:
        """Take the collection's one import slot (ConflictError while another import holds it)."""
        raise UnsupportedError(f"collection {self.name!r} does not take imports")

    def release_import(self) -> None:
        """Give back the import slot claim_import took, where no import ran."""
        raise UnsupportedError(f"collection {self.name!r} does not take imports")

    def import_files(self, documents: str | os.PathLike | None = None, vectors: str | os.PathLike | None = None,
                     progress: bool | None = None, claimed: bool = False) -> dict:
        """Import documents (JSON lines) and their vectors (.npy/.fbin) in bulk."""
        raise UnsupportedError(f"collection {self.name!r} does not take imports")

    def merge(self, progress: bool | None = None) -> None:
        """Fold the documents written since the last merge into the index, now."""
        raise UnsupportedError(f"collection {self.name!r} merges by itself only")

    def crossover(self) -> int | None:
        """From how many queries a call a GPU tier answers it cheaper than the CPU (the batcher waits for that
        many), or None: no GPU tier, or no cheaper size."""
        return None

    @property
    def dormant(self) -> bool:
        """Whether its files are closed while idle (release_files), to be opened by its next call."""
        return False

    def quick(self, queries: int) -> bool:
        """Whether a vector search of this many queries, without a filter, is short work on this process's CPU
        alone: nothing waited for in another process or on a device, no files to open first. The service may then
        run it on its event loop when no other request is in flight (no hand-off to a search thread and back).
        Default: no."""
        return False

    def release_files(self) -> bool:
        """Close its files while nothing uses it (the catalog's pool of open files needs the room); True when
        it did. Default: it keeps them open."""
        return False


class CatalogContract(ABC):
    """The collections a service serves, as the routes see them: a data directory's Catalog, or a ShardedCatalog
    of one sharded index. `root`: its directory; `sharded`: a ShardedCatalog (the service's paths are then named
    <index-dir> in its answers, not <data-dir>); `limits`: its quotas. Aliases are optional: without them a name stands for itself."""

    sharded: ClassVar[bool] = False
    root: os.PathLike
    limits: Limits  # what one tenant may take from the others (quota.py)

    @abstractmethod
    def names(self) -> list[str]:
        """The collections' names, the open and the failed."""

    @abstractmethod
    def failed(self) -> dict[str, str]:
        """Collections that could not open: name -> why."""

    @abstractmethod
    def open_all(self) -> dict[str, str]:
        """Open every collection (the service's start); those that failed, as failed()."""

    @abstractmethod
    def peek(self, name: str):
        """The collection if it is open now, else None; opens nothing."""

    @abstractmethod
    def get(self, name: str) -> CollectionContract:
        """The collection (opened where it is not): NotFoundError for none."""

    @abstractmethod
    def create(self, name: str, *args, **kwargs) -> CollectionContract:
        """A new collection."""

    @abstractmethod
    def check_free(self, name: str, *args, **kwargs) -> None:
        """ConflictError where the name is taken (a collection or an alias)."""

    @abstractmethod
    def restore(self, name: str, *args, **kwargs) -> CollectionContract:
        """A collection from a snapshot's archive."""

    @abstractmethod
    def drop(self, name: str) -> None:
        """Delete the collection and its files."""

    @abstractmethod
    def close(self) -> None:
        """Close every collection."""

    def resolve(self, name: str) -> str:
        """The collection a name stands for: an alias's target, else the name."""
        return name

    def readiness(self) -> dict | None:
        """What /readyz adds to the service's own readiness (a sharded catalog: its shards' liveness, asked now),
        or None: nothing."""
        return None

    def aliases(self) -> dict[str, str]:
        """alias -> collection."""
        return {}

    def update_aliases(self, actions: list[tuple], allow: Callable[[str, str], None] | None = None) -> dict[str, str]:
        """Apply alias actions all or none; the aliases after."""
        raise UnsupportedError("this catalog serves no aliases")
