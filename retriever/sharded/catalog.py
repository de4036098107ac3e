"""A sharded collection as the service's catalog (server/life.py State takes any catalog): the one collection it
serves, under its name; creating, dropping and restoring refused as a sharded service refuses them. So one HTTP app
(server/app.py) serves a collection, a sharded one, and a router replica following a leader (retriever/sharded/
follow.py), with the same routes, limits, keys, errors and bodies."""

from __future__ import annotations

from fusionrag.retriever.collection import quota
from fusionrag.retriever.collection.contract import CatalogContract
from fusionrag.retriever.errors import ConflictError, InputError, NotFoundError, UnsupportedError
from fusionrag.retriever.sharded.docs import ShardedCollection


class ShardedCatalog(CatalogContract):
    """The catalog of one sharded collection (a ShardedCollection, or a FollowerCollection). owns: close() closes
    it (a router replica's own; the caller closes it otherwise)."""

    sharded = True

    def __init__(self, collection: ShardedCollection, owns: bool = False):
        self.collection, self.owns = collection, owns
        self.name = collection.name
        self.root = collection.index.path  # what error messages hide (<index-dir>)
        self.limits = quota.Limits()

    def names(self) -> list[str]:
        return [self.name]

    def failed(self) -> dict[str, str]:
        return {}

    def open_all(self) -> dict[str, str]:
        return {}

    def peek(self, name: str):
        """The collection if it is this one (always open), as Catalog.peek."""
        return self.collection if name == self.name else None

    def get(self, name: str) -> ShardedCollection:
        if name != self.name:
            raise NotFoundError(f"collection {name!r} does not exist (this service serves the sharded collection "
                                f"{self.name!r})")  # a collection's words (Catalog.get), then which one it serves
        return self.collection

    def create(self, name: str, *_, **__):
        if name == self.name:
            raise ConflictError(f"collection {name!r} exists (this service serves that sharded index)")
        raise InputError(f"this service serves the sharded index {self.name!r} alone: collections are not created "
                         "through it")

    def check_free(self, name: str, *_, **__) -> None:
        self.create(name)

    def restore(self, name: str, *_, **__):
        raise UnsupportedError("a sharded service restores no snapshot: it serves the index it was started on")

    def drop(self, name: str) -> None:
        self.get(name)
        raise UnsupportedError("a sharded collection is not dropped through the service: delete its documents, or "
                               "stop the service and remove the index directory")

    def readiness(self) -> dict:
        """What /readyz adds: each shard's liveness (asked now); not ready while no shard answers."""
        alive = self.collection.index.check_shards()
        return {"shards_alive": alive.tolist(), "degraded": not alive.all(), "ready": bool(alive.any())}

    def update_aliases(self, actions: list[tuple], allow=None) -> dict[str, str]:
        raise UnsupportedError("aliases are not served over a sharded collection under Ray Serve")

    def close(self) -> None:
        if self.owns:
            self.collection.close()
