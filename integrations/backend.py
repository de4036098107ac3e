"""One collection seen through one interface, in two modes: embedded (the engine in this process,
a data directory on disk) and remote (our HTTP service). The LangChain and LlamaIndex stores sit on
this, so each of them is written once for both modes.

Both modes speak the collection contract's types (`Document`, `Hit`) and filter syntax. Embedding is
the caller's job: a backend stores and searches vectors. A backend creates its collection on the
first write, when the dimension is known; reads of a collection that does not exist yet see an
empty one.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fusionrag.client import AsyncClient, Client, CollectionInfo, Op, Ops
from fusionrag.client import RemoteError  # noqa: F401 - where callers have imported it from
from fusionrag.retriever.collection import DEFAULT_TEXT_WEIGHT, Catalog, Collection, Document, Hit
from fusionrag.retriever.directory import catalog as data_catalog
from fusionrag.retriever.engine.config import METRICS, SearchOverrides
from fusionrag.retriever.errors import ConfigError, ConflictError, FusionRAGError, InputError, NotFoundError


def _check_metric(metric: str | None) -> None:
    if metric is not None and metric not in METRICS:
        raise ConfigError(f"metric must be one of {METRICS}, got {metric!r}")


def open_backend(*, collection: str, path: str | os.PathLike | None = None, url: str | None = None,
                 api_key: str | None = None, metric: str | None = None, search_params: dict | None = None,
                 timeout: float = 60.0, embedding: str | None = None) -> EmbeddedBackend | RemoteBackend:
    """The backend for exactly one of `path` (embedded) or `url` (remote). `embedding`: the name of the model
    the caller embeds with, when the service knows it: the collection is created with it, so that the
    service can embed text queries and documents for it, and an existing one must have no other."""
    if (path is None) == (url is None):
        raise ConfigError("give exactly one of path= (embedded mode) or url= (remote mode)")
    if not isinstance(collection, str) or not collection:
        raise ConfigError("collection= must be a non-empty collection name")
    _check_metric(metric)
    if path is not None:
        if api_key is not None:
            raise ConfigError("api_key= is for remote mode (url=); embedded mode reads the data directory directly")
        return EmbeddedBackend(path, collection, metric, search_params, embedding)
    return RemoteBackend(url, collection, api_key, metric, search_params, timeout, embedding)


def _check_embedding_matches(name: str, existing: str | None, given: str | None) -> None:
    if existing is not None and given is not None and existing != given:
        raise ConfigError(f"collection {name!r} exists with embedding model {existing!r}, not {given!r}")


# One Catalog per data directory per process: a collection is opened once and its writes serialized,
# however many stores point at it.
_catalogs: dict[Path, list] = {}
_catalogs_lock = threading.Lock()


def _acquire_catalog(root: Path) -> Catalog:
    with _catalogs_lock:
        entry = _catalogs.get(root)
        if entry is None:
            entry = _catalogs[root] = [data_catalog(root), 0]
        entry[1] += 1
        return entry[0]


def _release_catalog(root: Path) -> None:
    with _catalogs_lock:
        entry = _catalogs.get(root)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _catalogs[root]
            entry[0].close()


def _in_thread(method):
    """The async twin of a blocking method: the same call on a worker thread."""
    async def twin(self, *args, **kwargs):
        return await asyncio.to_thread(method, self, *args, **kwargs)
    return twin


class EmbeddedBackend:
    """The engine in-process. Async methods run the blocking engine call on a worker thread."""

    def __init__(self, path: str | os.PathLike, collection: str, metric: str | None, search_params: dict | None,
                 embedding: str | None = None):
        self.root = Path(path).resolve()
        self.name = collection
        self._metric = metric
        self._embedding = embedding
        self._params = SearchOverrides.of(search_params) if search_params else None  # over the index's defaults
        self._catalog = _acquire_catalog(self.root)
        self._closed = False
        if self.name in self._catalog.names():
            try:
                existing = self._catalog.get(self.name)
                self._check_metric_matches(existing.metric)
                _check_embedding_matches(self.name, existing.embedding, embedding)
            except BaseException:  # a store refused leaves the data directory's catalog to the others
                self.close()
                raise

    def _check_metric_matches(self, existing: str) -> None:
        if self._metric is not None and self._metric != existing:
            raise ConfigError(f"collection {self.name!r} exists with metric {existing!r}, not {self._metric!r}")

    def _collection(self) -> Collection | None:
        if self._closed:
            raise FusionRAGError("this store is closed")
        try:
            return self._catalog.get(self.name)
        except NotFoundError:
            return None

    @property
    def metric(self) -> str:
        coll = self._collection()
        return coll.metric if coll is not None else (self._metric or "cosine")

    @property
    def dim(self) -> int | None:
        coll = self._collection()
        return coll.dim if coll is not None else None

    async def ametric(self) -> str:
        return self.metric

    def _writable(self, dim: int) -> Collection:
        coll = self._collection()
        if coll is None:
            try:
                coll = self._catalog.create(self.name, dim, self._metric or "cosine", self._embedding)
            except ConflictError:  # another store created it meanwhile
                coll = self._catalog.get(self.name)
        if coll.dim != dim:
            raise InputError(f"collection {self.name!r} holds {coll.dim}-dimensional vectors, got {dim}")
        return coll

    def upsert(self, docs: Sequence[Document]) -> list[str]:
        if not docs:
            return []
        return self._writable(len(docs[0].vector)).upsert(docs)

    def delete(self, ids: Sequence[str]) -> int:
        coll = self._collection()
        return coll.delete(list(ids)) if coll is not None and ids else 0

    def delete_where(self, filter: dict) -> int:
        """Delete every document the filter passes, in one write."""
        coll = self._collection()
        return coll.delete_where(filter) if coll is not None else 0

    def get(self, ids: Sequence[str], with_vectors: bool = False) -> list[Document]:
        coll = self._collection()
        return coll.get(list(ids), with_vectors=with_vectors) if coll is not None and ids else []

    def select(self, filter: dict | None, with_vectors: bool = False) -> list[Document]:
        """Every document the filter passes (all without one), in a stable order."""
        coll = self._collection()
        found: list[Document] = []
        after: int | None = -1
        while coll is not None and after is not None:
            page, after = coll.scroll(_CHUNK, after, filter, with_vectors)
            found += page
        return found

    def search(self, vectors: np.ndarray | None, k: int, filter: dict | None = None, with_vectors: bool = False,
               texts: list[str] | None = None, mode: str = "vector",
               text_weight: float = DEFAULT_TEXT_WEIGHT) -> list[list[Hit]]:
        """mode, texts, text_weight: as Collection.search (vectors None in text mode)."""
        coll = self._collection()
        if coll is None:
            return [[] for _ in range(len(texts if vectors is None else vectors))]
        return coll.search(vectors, k=k, filter=filter, params=self._params, with_vectors=with_vectors,
                           texts=texts, mode=mode, text_weight=text_weight).hits

    def count(self) -> int:
        coll = self._collection()
        return len(coll) if coll is not None else 0

    def clear(self) -> None:
        coll = self._collection()
        if coll is not None:
            coll.clear()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _release_catalog(self.root)

    aupsert = _in_thread(upsert)
    adelete = _in_thread(delete)
    adelete_where = _in_thread(delete_where)
    aget = _in_thread(get)
    aselect = _in_thread(select)
    asearch = _in_thread(search)
    acount = _in_thread(count)
    aclear = _in_thread(clear)


def _both(op):
    """The sync and async methods of one operation (fusionrag.client): the same code over either client."""
    def sync(self, *args, **kwargs):
        return self._client.run(op(self, *args, **kwargs))

    async def asynchronous(self, *args, **kwargs):
        return await self._aclient().run(op(self, *args, **kwargs))

    return sync, asynchronous


class RemoteBackend:
    """Our HTTP service through fusionrag.client, with an optional bearer API key.

    Each call is one client operation, run by a `Client` (sync) or by an `AsyncClient` (async; one per event
    loop, since a connection pool belongs to the loop that opened it), never a thread.
    """

    def __init__(self, url: str, collection: str, api_key: str | None, metric: str | None,
                 search_params: dict | None, timeout: float, embedding: str | None = None):
        self.url = url.rstrip("/")
        self.name = collection
        self._metric = metric
        self._embedding = embedding
        self._params = SearchOverrides.of(search_params) if search_params else None  # over the index's defaults
        self._api_key, self._timeout = api_key, timeout
        self._client = Client(self.url, api_key, timeout=timeout)
        self._aclients: dict[asyncio.AbstractEventLoop, AsyncClient] = {}
        self._info: CollectionInfo | None = None

    def _aclient(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        for old in [lp for lp in self._aclients if lp.is_closed()]:
            del self._aclients[old]  # its connections died with their loop
        client = self._aclients.get(loop)
        if client is None:
            client = self._aclients[loop] = AsyncClient(self.url, self._api_key, timeout=self._timeout)
        return client

    # -- collection lifecycle -------------------------------------------------------------------

    def _info_op(self) -> Op[CollectionInfo | None]:
        try:
            info = yield from Ops.info(self.name)
        except NotFoundError:
            return None
        if self._metric is not None and info.metric != self._metric:
            raise ConfigError(f"collection {self.name!r} exists with metric {info.metric!r}, not {self._metric!r}")
        _check_embedding_matches(self.name, info.embedding, self._embedding)
        self._info = info
        return info

    info, ainfo = _both(_info_op)

    def _ensure(self, dim: int) -> Op[None]:
        if self._info is None and (yield from self._info_op()) is None:
            try:
                yield from Ops.create_collection(self.name, dim, metric=self._metric or "cosine",
                                                 embedding=self._embedding)
            except ConflictError:  # another store created it meanwhile
                pass
            yield from self._info_op()
        have = self._info.dimension
        if have != dim:
            raise InputError(f"collection {self.name!r} holds {have}-dimensional vectors, got {dim}")

    def _metric_op(self) -> Op[str]:
        info = self._info or (yield from self._info_op())
        return info.metric if info else (self._metric or "cosine")

    def _dim_op(self) -> Op[int | None]:
        info = self._info or (yield from self._info_op())
        return info.dimension if info else None

    _metric_now, ametric = _both(_metric_op)
    metric = property(_metric_now)
    dim = property(_both(_dim_op)[0])

    # -- documents and search -------------------------------------------------------------------

    def _upsert(self, docs: Sequence[Document]) -> Op[list[str]]:
        if not docs:
            return []
        yield from self._ensure(len(docs[0].vector))
        ids: list[str] = []
        for part in _chunks(docs):
            ids += yield from Ops.upsert(self.name, part)
        return ids

    def _delete(self, ids: Sequence[str]) -> Op[int]:
        n = 0
        for part in _chunks(list(ids)):
            try:
                n += yield from Ops.delete(self.name, part)
            except NotFoundError:  # no collection: nothing to delete
                break
        return n

    def _delete_where(self, filter: dict) -> Op[int]:
        try:
            return (yield from Ops.delete(self.name, filter=filter))
        except NotFoundError:
            return 0

    def _get(self, ids: Sequence[str], with_vectors: bool = False) -> Op[list[Document]]:
        found: list[Document] = []
        for part in _chunks(list(ids)):
            try:
                found += yield from Ops.get(self.name, part, with_vectors=with_vectors)
            except NotFoundError:
                return []
        return found

    def _select(self, filter: dict | None, with_vectors: bool = False) -> Op[list[Document]]:
        found: list[Document] = []
        cursor = None
        while True:
            try:
                page = yield from Ops.scroll(self.name, limit=_CHUNK, cursor=cursor, filter=filter,
                                             with_vectors=with_vectors)
            except NotFoundError:
                return []
            found += page.documents
            if page.next_cursor is None:
                return found
            cursor = page.next_cursor

    def _search(self, vectors: np.ndarray | None, k: int, filter: dict | None = None, with_vectors: bool = False,
                texts: list[str] | None = None, mode: str = "vector",
                text_weight: float = DEFAULT_TEXT_WEIGHT) -> Op[list[list[Hit]]]:
        try:
            res = yield from Ops.search(self.name, vectors, texts=None if mode == "vector" else list(texts or []),
                                        k=k, filter=filter or None, params=self._params, mode=mode,
                                        text_weight=text_weight, with_vectors=with_vectors)
        except NotFoundError:
            return [[] for _ in range(len(texts if vectors is None else vectors))]
        return res.hits

    def _count(self) -> Op[int]:
        info = yield from self._info_op()
        return int(info.count) if info else 0

    def _clear(self) -> Op[None]:
        # The service has no "delete all documents": drop the collection and create it again with the
        # same settings (writes in between get a 404).
        info = yield from self._info_op()
        if info is not None:
            try:
                yield from Ops.drop_collection(self.name)
            except NotFoundError:
                pass
            yield from Ops.create_collection(self.name, info.dimension, metric=info.metric, embedding=info.embedding)

    upsert, aupsert = _both(_upsert)
    delete, adelete = _both(_delete)
    delete_where, adelete_where = _both(_delete_where)
    get, aget = _both(_get)
    select, aselect = _both(_select)
    search, asearch = _both(_search)
    count, acount = _both(_count)
    clear, aclear = _both(_clear)

    def close(self) -> None:
        self._client.close()
        # Async clients whose loop is gone cannot be closed cleanly; their sockets go with the loop.
        self._aclients.clear()


_CHUNK = 256  # well under the service's per-request document limit (max_documents, 1024 by default)


def _chunks(items: Sequence, size: int = _CHUNK) -> list:
    return [items[i:i + size] for i in range(0, len(items), size)]
