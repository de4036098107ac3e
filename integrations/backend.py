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
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fusionrag.retriever.collection import DEFAULT_TEXT_WEIGHT, Catalog, Collection, Document, Hit
from fusionrag.retriever.config import METRICS, SearchParams
from fusionrag.retriever.errors import ConfigError, ConflictError, FusionRAGError, InputError, NotFoundError


class RemoteError(FusionRAGError):
    """The service answered with an error the contract's error types do not cover (401, 403, 5xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


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
            entry = _catalogs[root] = [Catalog(root), 0]
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


class EmbeddedBackend:
    """The engine in-process. Async methods run the blocking engine call on a worker thread."""

    def __init__(self, path: str | os.PathLike, collection: str, metric: str | None, search_params: dict | None,
                 embedding: str | None = None):
        self.root = Path(path).resolve()
        self.name = collection
        self._metric = metric
        self._embedding = embedding
        self._params = SearchParams.from_dict(search_params) if search_params else None
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

    def get(self, ids: Sequence[str], with_vectors: bool = False) -> list[Document]:
        coll = self._collection()
        return coll.get(list(ids), with_vectors=with_vectors) if coll is not None and ids else []

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

    async def aupsert(self, docs):
        return await asyncio.to_thread(self.upsert, docs)

    async def adelete(self, ids):
        return await asyncio.to_thread(self.delete, ids)

    async def aget(self, ids, with_vectors=False):
        return await asyncio.to_thread(self.get, ids, with_vectors)

    async def asearch(self, vectors, k, filter=None, with_vectors=False, texts=None, mode="vector",
                      text_weight=DEFAULT_TEXT_WEIGHT):
        return await asyncio.to_thread(self.search, vectors, k, filter, with_vectors, texts, mode, text_weight)

    async def acount(self):
        return await asyncio.to_thread(self.count)

    async def aclear(self):
        return await asyncio.to_thread(self.clear)


def _doc_json(doc: Document) -> dict:
    out: dict[str, Any] = {"text": doc.text, "metadata": doc.metadata}
    if doc.id is not None:
        out["id"] = doc.id
    if doc.vector is not None:
        out["vector"] = np.asarray(doc.vector, dtype=np.float32).tolist()
    return out


def _doc_from_json(d: dict) -> Document:
    vec = d.get("vector")
    return Document(id=d["id"], text=d.get("text"), metadata=d.get("metadata") or {},
                    vector=None if vec is None else np.asarray(vec, dtype=np.float32))


def _hit_from_json(d: dict) -> Hit:
    vec = d.get("vector")
    return Hit(id=d["id"], distance=float(d["distance"]), score=float(d["score"]), text=d.get("text"),
               metadata=d.get("metadata") or {}, vector=None if vec is None else np.asarray(vec, dtype=np.float32))


class RemoteBackend:
    """Our HTTP service (see the README's API section), with an optional bearer API key.

    Sync calls share one `httpx.Client`; async calls go through an `httpx.AsyncClient` (one per
    event loop, since a connection pool belongs to the loop that opened it), never a thread.
    """

    def __init__(self, url: str, collection: str, api_key: str | None, metric: str | None,
                 search_params: dict | None, timeout: float, embedding: str | None = None):
        import httpx

        self._httpx = httpx
        self.url = url.rstrip("/")
        self.name = collection
        self._metric = metric
        self._embedding = embedding
        self._params = SearchParams.from_dict(search_params).to_dict() if search_params else None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._client = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout)
        self._aclients: dict[asyncio.AbstractEventLoop, Any] = {}
        self._info: dict | None = None

    # -- plumbing -------------------------------------------------------------------------------

    def _coll_path(self, suffix: str = "") -> str:
        return f"/v1/collections/{self.name}{suffix}"

    @staticmethod
    def _raise_for(resp) -> None:
        if resp.status_code < 400:
            return
        try:
            body = resp.json()
            msg = body.get("detail") or body.get("error") or body
            if isinstance(msg, dict):  # vLLM's error shape, when the API is served by the vLLM plugin
                msg = msg.get("message", msg)
        except ValueError:
            msg = resp.text
        if not isinstance(msg, str):
            msg = str(msg)
        status = resp.status_code
        if status == 404:
            raise NotFoundError(msg)
        if status == 409:
            raise ConflictError(msg)
        if status in (400, 413, 422):
            raise InputError(msg)
        raise RemoteError(status, msg)

    def _request(self, method: str, path: str, json: Any = None, missing_ok: bool = False, params=None):
        resp = self._client.request(method, path, json=json, params=params)
        if missing_ok and resp.status_code == 404:
            return None
        self._raise_for(resp)
        return resp.json() if resp.content else {}

    def _aclient(self):
        loop = asyncio.get_running_loop()
        for old in [lp for lp in self._aclients if lp.is_closed()]:
            del self._aclients[old]  # its connections died with their loop
        client = self._aclients.get(loop)
        if client is None:
            client = self._aclients[loop] = self._httpx.AsyncClient(
                base_url=self.url, headers=self._headers, timeout=self._timeout)
        return client

    async def _arequest(self, method: str, path: str, json: Any = None, missing_ok: bool = False, params=None):
        resp = await self._aclient().request(method, path, json=json, params=params)
        if missing_ok and resp.status_code == 404:
            return None
        self._raise_for(resp)
        return resp.json() if resp.content else {}

    # -- collection lifecycle -------------------------------------------------------------------

    def _create_body(self, dim: int) -> dict:
        return {"name": self.name, "dimension": dim, "metric": self._metric or "cosine", "embedding": self._embedding}

    def _checked_info(self, info: dict | None) -> dict | None:
        if info is not None:
            if self._metric is not None and info.get("metric") != self._metric:
                raise ConfigError(f"collection {self.name!r} exists with metric {info.get('metric')!r}, "
                                  f"not {self._metric!r}")
            _check_embedding_matches(self.name, info.get("embedding"), self._embedding)
            self._info = info
        return info

    def info(self) -> dict | None:
        return self._checked_info(self._request("GET", self._coll_path(), missing_ok=True))

    async def ainfo(self) -> dict | None:
        return self._checked_info(await self._arequest("GET", self._coll_path(), missing_ok=True))

    def _ensure(self, dim: int) -> None:
        if self._info is None and self.info() is None:
            try:
                self._request("POST", "/v1/collections", self._create_body(dim))
            except ConflictError:
                pass
            self.info()
        self._check_dim(dim)

    async def _aensure(self, dim: int) -> None:
        if self._info is None and await self.ainfo() is None:
            try:
                await self._arequest("POST", "/v1/collections", self._create_body(dim))
            except ConflictError:
                pass
            await self.ainfo()
        self._check_dim(dim)

    def _check_dim(self, dim: int) -> None:
        have = self._info.get("dimension")
        if have != dim:
            raise InputError(f"collection {self.name!r} holds {have}-dimensional vectors, got {dim}")

    @property
    def metric(self) -> str:
        info = self._info or self.info()
        return info["metric"] if info else (self._metric or "cosine")

    async def ametric(self) -> str:
        info = self._info or await self.ainfo()
        return info["metric"] if info else (self._metric or "cosine")

    @property
    def dim(self) -> int | None:
        info = self._info or self.info()
        return info["dimension"] if info else None

    # -- documents and search -------------------------------------------------------------------

    def upsert(self, docs: Sequence[Document]) -> list[str]:
        if not docs:
            return []
        self._ensure(len(docs[0].vector))
        ids = []
        for part in _chunks(docs):
            body = {"documents": [_doc_json(d) for d in part]}
            ids += self._request("POST", self._coll_path("/documents"), body)["ids"]
        return ids

    async def aupsert(self, docs: Sequence[Document]) -> list[str]:
        if not docs:
            return []
        await self._aensure(len(docs[0].vector))
        ids = []
        for part in _chunks(docs):
            body = {"documents": [_doc_json(d) for d in part]}
            ids += (await self._arequest("POST", self._coll_path("/documents"), body))["ids"]
        return ids

    def delete(self, ids: Sequence[str]) -> int:
        n = 0
        for part in _chunks(list(ids)):
            res = self._request("DELETE", self._coll_path("/documents"), {"ids": part}, missing_ok=True)
            n += 0 if res is None else int(res["deleted"])
        return n

    async def adelete(self, ids: Sequence[str]) -> int:
        n = 0
        for part in _chunks(list(ids)):
            res = await self._arequest("DELETE", self._coll_path("/documents"), {"ids": part}, missing_ok=True)
            n += 0 if res is None else int(res["deleted"])
        return n

    def _doc_args(self, doc_id: str, with_vectors: bool) -> tuple:
        params = {"vector": "true"} if with_vectors else None
        return "GET", self._coll_path(f"/documents/{_quote(doc_id)}"), None, True, params

    def get(self, ids: Sequence[str], with_vectors: bool = False) -> list[Document]:
        found = [self._request(*self._doc_args(i, with_vectors)) for i in ids]
        return [_doc_from_json(d) for d in found if d is not None]

    async def aget(self, ids: Sequence[str], with_vectors: bool = False) -> list[Document]:
        found = await asyncio.gather(*(self._arequest(*self._doc_args(i, with_vectors)) for i in ids))
        return [_doc_from_json(d) for d in found if d is not None]

    def _search_body(self, vectors: np.ndarray | None, k: int, filter: dict | None, texts: list[str] | None = None,
                     mode: str = "vector", text_weight: float = DEFAULT_TEXT_WEIGHT) -> dict:
        body: dict[str, Any] = {"k": k}
        if vectors is not None:
            body["vectors"] = np.asarray(vectors, dtype=np.float32).tolist()
        if mode != "vector":
            body.update(texts=list(texts or []), mode=mode, text_weight=text_weight)
        if filter:
            body["filter"] = filter
        if self._params:
            body["params"] = self._params
        return body

    @staticmethod
    def _with_vectors(hits: list[list[Hit]], docs: list[Document]) -> list[list[Hit]]:
        vec = {d.id: d.vector for d in docs}
        return [[replace(h, vector=vec.get(h.id)) for h in q if h.id in vec] for q in hits]

    def search(self, vectors: np.ndarray | None, k: int, filter: dict | None = None, with_vectors: bool = False,
               texts: list[str] | None = None, mode: str = "vector",
               text_weight: float = DEFAULT_TEXT_WEIGHT) -> list[list[Hit]]:
        res = self._request("POST", self._coll_path("/search"),
                            self._search_body(vectors, k, filter, texts, mode, text_weight), missing_ok=True)
        if res is None:
            return [[] for _ in range(len(texts if vectors is None else vectors))]
        hits = [[_hit_from_json(h) for h in q] for q in res["results"]]
        if with_vectors:  # the service's search answers without vectors: fetch the hits' documents
            hits = self._with_vectors(hits, self.get(list({h.id for q in hits for h in q}), with_vectors=True))
        return hits

    async def asearch(self, vectors: np.ndarray | None, k: int, filter: dict | None = None,
                      with_vectors: bool = False, texts: list[str] | None = None, mode: str = "vector",
                      text_weight: float = DEFAULT_TEXT_WEIGHT) -> list[list[Hit]]:
        res = await self._arequest("POST", self._coll_path("/search"),
                                   self._search_body(vectors, k, filter, texts, mode, text_weight), missing_ok=True)
        if res is None:
            return [[] for _ in range(len(texts if vectors is None else vectors))]
        hits = [[_hit_from_json(h) for h in q] for q in res["results"]]
        if with_vectors:
            docs = await self.aget(list({h.id for q in hits for h in q}), with_vectors=True)
            hits = self._with_vectors(hits, docs)
        return hits

    def count(self) -> int:
        info = self.info()
        return int(info["count"]) if info else 0

    async def acount(self) -> int:
        info = await self.ainfo()
        return int(info["count"]) if info else 0

    @staticmethod
    def _recreate_body(info: dict) -> dict:
        return {k: info[k] for k in ("name", "dimension", "metric", "embedding")}

    def clear(self) -> None:
        # The service has no "delete all documents": drop the collection and create it again with the
        # same settings (writes in between get a 404).
        info = self.info()
        if info is not None:
            self._request("DELETE", self._coll_path(), missing_ok=True)
            self._request("POST", "/v1/collections", self._recreate_body(info))

    async def aclear(self) -> None:
        info = await self.ainfo()
        if info is not None:
            await self._arequest("DELETE", self._coll_path(), missing_ok=True)
            await self._arequest("POST", "/v1/collections", self._recreate_body(info))

    def close(self) -> None:
        self._client.close()
        # Async clients whose loop is gone cannot be closed cleanly; their sockets go with the loop.
        self._aclients.clear()


def _chunks(items: Sequence, size: int = 256) -> list:
    # Well under the service's per-request document limit (max_documents, 1024 by default).
    return [items[i:i + size] for i in range(0, len(items), size)]


def _quote(doc_id: str) -> str:
    from urllib.parse import quote

    return quote(doc_id, safe="")
