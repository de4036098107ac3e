"""A typed client of the fusionrag service: `Client` (sync) and `AsyncClient` (async), one implementation.

Each call of the API is written once, as an operation (the `Ops` below): a generator that yields the requests it
needs and receives each answer's JSON, or the error the answer's status maps to, thrown in at the `yield`; what it
returns is the call's result. `Client` runs operations over an `httpx.Client`, `AsyncClient` over an
`httpx.AsyncClient`; they differ only in how they send a request and wait. Operations compose with `yield from`,
and `run(op)` runs one of your own the same way in both.

Results are the types the engine answers with too (`Document`, `Hit`: fusionrag.types) or dataclasses of this
module, and errors are the engine's classes (retriever/errors.py), so code catches the same errors in embedded and
remote mode: 400, 413 and 422 raise `InputError`, 404 `NotFoundError`, 409 `ConflictError`, 503 `UnavailableError`,
507 `StorageError` (each with the status as `.status`); 401 and 403 `AuthError`, any other `RemoteError`. Network
failures are httpx's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
import warnings
from collections.abc import Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload
from urllib.parse import quote

import httpx
import numpy as np

from fusionrag import __version__
from fusionrag.retriever.errors import FusionRAGError, InputError, error_class
from fusionrag.types import DEFAULT_TEXT_WEIGHT, Document, Hit

if TYPE_CHECKING:  # the engine's configuration: loaded only where a caller made one (_params_body)
    from fusionrag.retriever.engine.config import SearchOverrides, SearchParams

T = TypeVar("T")
P = ParamSpec("P")

DEFAULT_URL = "http://127.0.0.1:8000"
UPSERT_BATCH = 512  # documents a request of upsert at most (the service's --max-documents: 1024)
UPSERT_BYTES = 8 << 20  # JSON bytes of a request of upsert, about (the service's --max-body-bytes: 16 MiB)


class RemoteError(FusionRAGError):
    """An answer of the service that the engine's error classes do not cover (401, 403, 500, ...)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class AuthError(RemoteError):
    """401: no valid API key; 403: the key does not cover this collection."""


class UnreachableError(FusionRAGError):
    """The service did not answer: nothing listens at the URL, the connection broke, or the timeout passed (the
    httpx error is its __cause__). A write that raised it may or may not have been applied."""

    def __init__(self, url: str, exc: Exception):
        super().__init__(f"the fusionrag service at {url} did not answer: {type(exc).__name__}: {exc}".rstrip(": "))
        self.url = url


def error_for(status: int, message: str) -> FusionRAGError:
    """The exception an error answer maps to, with its status as `.status`."""
    cls = error_class(status)
    if cls is None:
        return (AuthError if status in (401, 403) else RemoteError)(status, message)
    error: Any = cls(message)
    error.status = status
    return error


# -- results -------------------------------------------------------------------------------------

@dataclass
class CollectionInfo:
    name: str
    state: str = "ready"  # or "failed": it did not open, `reason` says why
    dimension: int | None = None
    metric: str | None = None
    embedding: str | None = None
    count: int | None = None
    reason: str | None = None
    tiers: dict | None = None  # memory per tier (not in `collections()`)
    build_state: dict | None = None  # indexed, fresh, deleted, merging, progress, ... (not in `collections()`)

    @classmethod
    def from_json(cls, d: dict) -> CollectionInfo:
        return cls(**{f.name: d[f.name] for f in fields(cls) if d.get(f.name) is not None})


@dataclass
class SearchResult:
    hits: list[list[Hit]]  # per query, best first
    stats: list[dict] | None = None  # per query, when asked
    warnings: list[str] = field(default_factory=list)  # parts of the filter no stored value can match


@dataclass
class Group:
    id: str | int  # the value of the field grouped by that its hits share
    hits: list[Hit]  # best first


@dataclass
class GroupsResult:
    groups: list[list[Group]]  # per query, the group of the best hit first
    warnings: list[str] = field(default_factory=list)  # parts of the filter, or a group_by field, matching nothing


@dataclass
class Page:
    documents: list[Document]
    next_cursor: str | None  # give it as `cursor` for the next page; None after the last
    warnings: list[str] = field(default_factory=list)


# -- operations -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    method: str
    path: str
    json: Any = None
    params: dict | None = None
    safe: bool = False  # a read: may be sent again after a 503 with Retry-After
    upload: Path | None = None  # a file streamed as the body, of upload_type
    upload_type: str | None = None
    upload_encoding: str | None = None  # its Content-Encoding ("gzip": the file is gzipped)
    files: dict[str, Path] | None = None  # multipart/form-data parts, each a file streamed
    fields: dict[str, str] | None = None  # multipart/form-data fields beside the files
    file_names: dict[str, str] | None = None  # a file part's name where not its path's
    save_to: Path | None = None  # the answer's body streamed into this file (the answer is then its path)


Op = Generator[Request, Any, T]


def _path(collection: str, suffix: str = "") -> str:
    return f"/v1/collections/{quote(collection, safe='')}{suffix}"


def _document_json(d: Document) -> dict:
    out: dict[str, Any] = {"text": d.text, "metadata": d.metadata}
    if d.id is not None:
        out["id"] = d.id
    if d.vector is not None:
        out["vector"] = np.asarray(d.vector, dtype=np.float32).tolist()
    return out


def _document(d: dict) -> Document:
    vec = d.get("vector")
    return Document(id=d["id"], text=d.get("text"), metadata=d.get("metadata") or {},
                    vector=None if vec is None else np.asarray(vec, dtype=np.float32))


def _hit(d: dict) -> Hit:
    vec = d.get("vector")
    return Hit(id=d["id"], distance=float(d["distance"]), score=float(d["score"]), text=d.get("text"),
               metadata=d.get("metadata") or {}, vector=None if vec is None else np.asarray(vec, dtype=np.float32))


class Ops:
    """The API's calls as operations; `Client` and `AsyncClient` have each as a method of the same name."""

    @staticmethod
    def collections() -> Op[list[CollectionInfo]]:
        """Every collection the key may use; those that failed to open with state "failed" and the reason."""
        data = yield Request("GET", "/v1/collections", safe=True)
        return [CollectionInfo.from_json(c) for c in data["collections"]]

    @staticmethod
    def create_collection(name: str, dimension: int | None = None, *, metric: str = "cosine",
                          embedding: str | None = None, text_analyzer: dict | None = None,
                          shards: int | None = None) -> Op[CollectionInfo]:
        """An empty collection; `embedding` (a model the service knows) gives the dimension and embeds texts;
        `text_analyzer` ({"stemming": "porter" | "none", "stop_words": "english" | "none"}) how texts are
        indexed for text and hybrid search (English by default); `shards`: a sharded collection of that many
        shards, built by its first import (docs/sharded.md)."""
        body: dict[str, Any] = {"name": name, "metric": metric}
        if shards is not None:
            body["shards"] = shards
        if text_analyzer is not None:
            body["text_analyzer"] = text_analyzer
        if dimension is not None:
            body["dimension"] = dimension
        if embedding is not None:
            body["embedding"] = embedding
        return CollectionInfo.from_json((yield Request("POST", "/v1/collections", body)))

    @staticmethod
    def info(collection: str) -> Op[CollectionInfo]:
        """Size, memory per tier and build state; the reason when it failed to open."""
        return CollectionInfo.from_json((yield Request("GET", _path(collection), safe=True)))

    @staticmethod
    def drop_collection(collection: str) -> Op[None]:
        yield Request("DELETE", _path(collection))

    @staticmethod
    def update_aliases(actions: Sequence[Mapping]) -> Op[dict[str, str]]:
        """Apply alias actions together, or none of them (Qdrant's form: {"create_alias": {"alias_name",
        "collection_name"}} also switches an existing alias, {"delete_alias": {"alias_name"}}, {"rename_alias":
        {"old_alias_name", "new_alias_name"}}); the aliases after ({alias: collection}, those this key reaches)."""
        data = yield Request("POST", "/v1/aliases", {"actions": [dict(a) for a in actions]})
        return {a["alias_name"]: a["collection_name"] for a in data["aliases"]}

    @staticmethod
    def create_alias(alias: str, collection: str) -> Op[dict[str, str]]:
        """Point `alias` at `collection` (made, or switched from the collection it pointed to, atomically): every
        call that takes a collection's name takes the alias for it."""
        return (yield from Ops.update_aliases([{"create_alias": {"alias_name": alias, "collection_name": collection}}]))

    @staticmethod
    def delete_alias(alias: str) -> Op[dict[str, str]]:
        return (yield from Ops.update_aliases([{"delete_alias": {"alias_name": alias}}]))

    @staticmethod
    def aliases(collection: str | None = None) -> Op[dict[str, str]]:
        """{alias: collection}: every alias (this key reaches), or those of one collection."""
        path = "/v1/aliases" if collection is None else _path(collection, "/aliases")
        data = yield Request("GET", path, safe=True)
        return {a["alias_name"]: a["collection_name"] for a in data["aliases"]}

    @staticmethod
    def upsert(collection: str, documents: Sequence[Document], *, batch_size: int = UPSERT_BATCH,
               batch_bytes: int = UPSERT_BYTES, on_progress: Callable[[int, int], None] | None = None
               ) -> Op[list[str]]:
        """Add or replace (same id) documents; a document without a vector has its text embedded by the
        collection's model. Their ids, in order. Sent in requests of at most `batch_size` documents and about
        `batch_bytes` of JSON (keep both within the service's --max-documents and --max-body-bytes), one after
        the other, each durable when answered: an error stops at its batch, the ones before it written.
        on_progress(documents written, documents in all) after each."""
        if isinstance(documents, Document) or not isinstance(documents, Sequence):
            raise InputError("upsert takes a sequence of Document (or of dicts with id, text, vector, metadata)")
        if not isinstance(batch_size, int) or batch_size < 1 or not isinstance(batch_bytes, int) or batch_bytes < 1:
            raise InputError("batch_size and batch_bytes must be positive integers")
        ids: list[str] = []

        def send(batch: list[dict]) -> Op[None]:
            ids.extend((yield Request("POST", _path(collection, "/documents"), {"documents": batch}))["ids"])
            if on_progress is not None:
                on_progress(len(ids), len(documents))

        batch: list[dict] = []
        size = 0
        for i, d in enumerate(documents):
            if isinstance(d, Mapping):  # {"id", "text", "vector", "metadata"}, as the service's API takes them
                unknown = set(d) - {"id", "text", "vector", "metadata"}
                if unknown:
                    raise InputError(f"document {i}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; "
                                     "a document has id, text, vector and metadata")
                d = Document(d.get("id"), d.get("text"), d.get("vector"), d.get("metadata") or {})
            if not isinstance(d, Document):
                raise InputError(f"document {i}: expected a Document or a dict, got {type(d).__name__}")
            doc = _document_json(d)
            cost = len(json.dumps(doc, separators=(",", ":"))) + 1
            if batch and (len(batch) == batch_size or size + cost > batch_bytes):
                yield from send(batch)
                batch, size = [], 0
            batch.append(doc)
            size += cost
        if batch:
            yield from send(batch)
        return ids

    @staticmethod
    def get(collection: str, ids: Sequence[str], *, with_vectors: bool = False) -> Op[list[Document]]:
        """The documents with these ids, in that order; ids not found are left out."""
        body = {"ids": list(ids), "with_vectors": with_vectors}
        data = yield Request("POST", _path(collection, "/documents/get"), body, safe=True)
        return [_document(d) for d in data["documents"]]

    @staticmethod
    def scroll(collection: str, *, limit: int | None = None, cursor: str | None = None, filter: dict | None = None,
               with_vectors: bool = False, where_document: dict | None = None) -> Op[Page]:
        """One page of the documents (those the filter passes) in a stable order; `cursor`: the page before's
        `next_cursor`. A document present throughout is seen once, however the collection changes meanwhile.
        where_document: a text condition, {"$contains": "s"} and the like (`with_document`)."""
        filter = with_document(filter, where_document)
        params: dict[str, Any] = {"with_vectors": "true"} if with_vectors else {}
        if limit is not None:
            params["limit"] = limit
        if cursor is not None:
            params["cursor"] = cursor
        if filter is not None:
            params["filter"] = json.dumps(filter, separators=(",", ":"))
        data = yield Request("GET", _path(collection, "/documents"), params=params, safe=True)
        return Page([_document(d) for d in data["documents"]], data["next_cursor"], data.get("warnings", []))

    @staticmethod
    def set_metadata(collection: str, updates: Mapping[str, dict], *, merge: bool = True) -> Op[int]:
        """Change documents' metadata alone (text, vector and index place stay): updates maps an id to a merge
        patch (a key given None is removed) or, with merge=False, to its whole new metadata. How many changed."""
        body = {"documents": [{"id": i, "metadata": m} for i, m in updates.items()], "merge": merge}
        return (yield Request("POST", _path(collection, "/documents/metadata"), body))["updated"]

    @staticmethod
    def count(collection: str, *, filter: dict | None = None, where_document: dict | None = None) -> Op[int]:
        """How many documents the filter passes (all of them without one); where_document: a text condition
        (`with_document`)."""
        filter = with_document(filter, where_document)
        body = {} if filter is None else {"filter": filter}
        data = yield Request("POST", _path(collection, "/documents/count"), body, safe=True)
        for warning in data.get("warnings", []):  # a misspelt field, say: the count is 0 and says why
            warnings.warn(f"count of {collection!r}: {warning}", UserWarning, stacklevel=3)
        return data["count"]

    @staticmethod
    def delete(collection: str, ids: Sequence[str] | None = None, *, filter: dict | None = None,
               where_document: dict | None = None) -> Op[int]:
        """Delete by id (unknown ids are ignored) or every document a filter passes (one write); how many.
        where_document: a text condition (`with_document`), part of the filter."""
        filter = with_document(filter, where_document)
        if (ids is None) == (filter is None):
            raise InputError("give exactly one of ids and filter")
        body: dict[str, Any] = {"ids": list(ids)} if ids is not None else {"filter": filter}
        return (yield Request("POST", _path(collection, "/documents/delete"), body))["deleted"]

    @staticmethod
    def snapshot(collection: str) -> Op[dict]:
        """Write a snapshot of the collection (its state now, while writes go on): its id and what it holds."""
        return (yield Request("POST", _path(collection, "/snapshots")))

    @staticmethod
    def snapshots(collection: str) -> Op[list[dict]]:
        """The collection's snapshots (each with its "id" and what it holds), oldest first."""
        return (yield Request("GET", _path(collection, "/snapshots"), safe=True))["snapshots"]

    @staticmethod
    def download_snapshot(collection: str, snapshot_id: str, path: str | os.PathLike) -> Op[Path]:
        """A snapshot's archive (a tar file) written to `path` (whole, or not at all); returns the path."""
        data = yield Request("GET", _path(collection, f"/snapshots/{quote(snapshot_id, safe='')}"), safe=True,
                             save_to=Path(path))
        return Path(data["path"])

    @staticmethod
    def delete_snapshot(collection: str, snapshot_id: str) -> Op[None]:
        yield Request("DELETE", _path(collection, f"/snapshots/{quote(snapshot_id, safe='')}"))

    @staticmethod
    def restore(collection: str, archive: str | os.PathLike) -> Op[CollectionInfo]:
        """A new collection, named `collection`, from a snapshot's archive (a file, streamed up)."""
        return CollectionInfo.from_json((yield Request("POST", _path(collection, "/restore"), upload=Path(archive),
                                                       upload_type="application/octet-stream")))

    @staticmethod
    def import_documents(collection: str, documents: str | os.PathLike,
                         vectors: str | os.PathLike | None = None) -> Op[dict]:
        """Bulk import into an empty collection: `documents` a JSON-lines file (one document an object), and
        optionally `vectors` a vector file (.fvecs, .npy, ...) for them in order; both streamed up, a file whose
        name ends in .gz as it is (gzipped: the service decompresses it). The service checks the start of the
        files before it accepts them (InputError naming the line); the import runs in the background once they
        have arrived: its progress and outcome are in `info(collection).build_state["import"]`. Returns what the
        service took (the files' sizes, decompressed)."""
        if vectors is None:
            gz = Path(documents).name.lower().endswith(".gz")
            return (yield Request("POST", _path(collection, "/import"), upload=Path(documents),
                                  upload_type="application/x-ndjson", upload_encoding="gzip" if gz else None))
        return (yield Request("POST", _path(collection, "/import"),
                              files={"documents": Path(documents), "vectors": Path(vectors)}))

    @staticmethod
    def upload_file(collection: str, path: str | os.PathLike, *, filename: str | None = None,
                    max_chunk_size_tokens: int | None = None, chunk_overlap_tokens: int | None = None,
                    metadata: dict | None = None) -> Op[dict]:
        """A text file (streamed up) cut into chunks by the vector stores' chunker, by the collection model's
        tokens (by default the model's window or 800 tokens, half overlapping), each embedded and stored as the
        document `<filename>#<n>` with metadata {**metadata, "filename", "chunk": n}; an upload of the same
        `filename` (the path's name unless given) replaces its chunks. Returns {"collection", "filename",
        "chunks", "max_chunk_size_tokens", "chunk_overlap_tokens"}. See docs/collections.md."""
        fields = {k: str(v) for k, v in (("max_chunk_size_tokens", max_chunk_size_tokens),
                                         ("chunk_overlap_tokens", chunk_overlap_tokens)) if v is not None}
        if metadata is not None:
            fields["metadata"] = json.dumps(metadata)
        return (yield Request("POST", _path(collection, "/files"), files={"file": Path(path)}, fields=fields or None,
                              file_names={"file": filename} if filename else None))

    @staticmethod
    def search(collection: str, vectors=None, *, texts: Sequence[str] | None = None, k: int = 10,
               filter: dict | None = None, params: SearchParams | SearchOverrides | dict | None = None, mode: str = "vector",
               text_weight: float = DEFAULT_TEXT_WEIGHT, with_vectors: bool = False,
               stats: bool = False, fusion: dict | None = None, offset: int = 0,
               score_threshold: float | None = None, where_document: dict | None = None) -> Op[SearchResult]:
        """Top-k of each query: `vectors` (one, or a (q, dim) array) or `texts` (embedded by the collection's
        model), or both in mode "hybrid" (fused as `fusion` says: {"method": "rrf", "k": 60}, the default, or
        {"method": "weighted"}); mode "text" ranks by BM25 over the texts. See docs/collections.md. offset: the k
        hits after each query's best `offset`; score_threshold: only hits whose score is at least this;
        where_document: only documents whose text passes this condition (`with_document`), in every mode."""
        filter = with_document(filter, where_document)
        body: dict[str, Any] = {"k": k, "mode": mode}
        if offset:
            body["offset"] = offset
        if score_threshold is not None:
            body["score_threshold"] = score_threshold
        _queries(body, vectors, texts, mode, text_weight, fusion)
        _query_options(body, filter, params, with_vectors)
        if stats:
            body["stats"] = True
        data = yield Request("POST", _path(collection, "/search"), body, safe=True)
        return SearchResult([[_hit(h) for h in q] for q in data["results"]], data.get("stats"),
                            data.get("warnings", []))

    @staticmethod
    def recommend(collection: str, positive: Sequence[str], negative: Sequence[str] = (), *, k: int = 10,
                  filter: dict | None = None, params: SearchParams | SearchOverrides | dict | None = None,
                  with_vectors: bool = False, where_document: dict | None = None) -> Op[list[Hit]]:
        """Documents like the stored documents `positive` and unlike `negative`, by their ids: the nearest of
        2 x the positives' mean vector - the negatives' mean (the positives' mean alone without negatives), the
        examples themselves left out."""
        filter = with_document(filter, where_document)
        body: dict[str, Any] = {"positive": list(positive), "negative": list(negative), "k": k}
        _query_options(body, filter, params, with_vectors)
        data = yield Request("POST", _path(collection, "/recommend"), body, safe=True)
        return [_hit(h) for h in data["results"]]

    @staticmethod
    def search_groups(collection: str, vectors=None, *, group_by: str, group_size: int = 3, limit: int = 10,
                      texts: Sequence[str] | None = None, filter: dict | None = None,
                      params: SearchParams | SearchOverrides | dict | None = None, mode: str = "vector",
                      text_weight: float = DEFAULT_TEXT_WEIGHT, with_vectors: bool = False,
                      fusion: dict | None = None, where_document: dict | None = None) -> Op[GroupsResult]:
        """Hits grouped by the metadata field `group_by` (Qdrant's search groups): for each query the best `limit`
        groups, ordered by their best hit, each its best `group_size` hits sharing one value of the field. A
        document whose field holds a list is in each of its values' groups; one without a string or integer value
        there in none. Queries, modes and filters as `search` takes them. See docs/collections.md."""
        filter = with_document(filter, where_document)
        body: dict[str, Any] = {"group_by": group_by, "group_size": group_size, "limit": limit, "mode": mode}
        _queries(body, vectors, texts, mode, text_weight, fusion)
        _query_options(body, filter, params, with_vectors)
        data = yield Request("POST", _path(collection, "/search/groups"), body, safe=True)
        return GroupsResult([[Group(g["id"], [_hit(h) for h in g["hits"]]) for g in q] for q in data["results"]],
                            data.get("warnings", []))


def with_document(filter: dict | None, where_document: dict | None) -> dict | None:
    """A metadata filter and a text condition on the documents' text (Chroma's where_document: {"$contains": "s"},
    {"$not_contains": "s"}, $and/$or of those) as one filter, the form the service takes: the condition under the
    filter's "$document" key, ANDed with the rest. Substring match, case-sensitive (docs/collections.md)."""
    if where_document is None:
        return filter
    if filter is None:
        return {"$document": where_document}
    return {"$and": [filter, {"$document": where_document}]}


def _queries(body: dict, vectors, texts, mode: str, text_weight: float, fusion: dict | None) -> None:
    """The queries a search and a grouped search take (vectors, texts, hybrid's weight and fusion), put in the
    request's body where given."""
    if vectors is not None:
        v = np.asarray(vectors, dtype=np.float32)
        body["vectors"] = (v[None, :] if v.ndim == 1 else v).tolist()
    if texts is not None:
        body["texts"] = [texts] if isinstance(texts, str) else list(texts)
    if mode == "hybrid":
        body["text_weight"] = text_weight
        if fusion is not None:
            body["fusion"] = fusion


def _query_options(body: dict, filter: dict | None, params, with_vectors: bool) -> None:
    """The options a search and a recommendation share, put in the request's body where given."""
    if filter is not None:
        body["filter"] = filter
    if params:
        body["params"] = _params_body(params)
    if with_vectors:
        body["with_vectors"] = True


def _params_body(params):
    """A search's knobs as the body carries them: a SearchParams or SearchOverrides as its to_dict(), anything else
    (a dict) as given. Their module (retriever/engine/config.py) is imported here, not with the client: a caller
    that made one has loaded it already, and a dict needs it not."""
    if isinstance(params, dict):
        return params
    from fusionrag.retriever.engine.config import SearchOverrides, SearchParams

    return params.to_dict() if isinstance(params, (SearchParams, SearchOverrides)) else params


# -- running operations ---------------------------------------------------------------------------

def _answer(resp: httpx.Response) -> Any:
    """An answer's JSON, or the exception its error status maps to (thrown into the operation)."""
    if resp.status_code < 400:
        return resp.json() if resp.content else None
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    msg = (body.get("detail") or body.get("error") or body) if isinstance(body, dict) else body
    if isinstance(msg, dict):  # vLLM's error shape, when the API is served by the vLLM plugin
        msg = msg.get("message", msg)
    return error_for(resp.status_code, msg if isinstance(msg, str) else str(msg))


UPLOAD_CHUNK = 1 << 20


def _body(req: Request, stack: contextlib.ExitStack, sync: bool) -> dict:
    """httpx's keywords for the request's body: JSON, a file streamed, or multipart parts (files streamed)."""
    if req.files is not None:
        names = req.file_names or {}
        return {"files": {name: (names.get(name, path.name), stack.enter_context(open(path, "rb")),
                                 "application/octet-stream") for name, path in req.files.items()},
                **({"data": req.fields} if req.fields else {})}
    if req.upload is not None:
        f = stack.enter_context(open(req.upload, "rb"))
        headers = {"Content-Type": req.upload_type or "application/octet-stream",
                   "Content-Length": str(os.fstat(f.fileno()).st_size)}
        if req.upload_encoding:
            headers["Content-Encoding"] = req.upload_encoding
        if sync:
            return {"content": iter(lambda: f.read(UPLOAD_CHUNK), b""), "headers": headers}

        async def chunks():
            while chunk := f.read(UPLOAD_CHUNK):
                yield chunk
        return {"content": chunks(), "headers": headers}
    return {} if req.json is None else {"json": req.json}


@contextlib.contextmanager
def _saving(path: Path):
    """A file to write a download into: beside `path`, renamed onto it once whole, removed if cut short."""
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as out:
            yield out
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def _saved(path: Path) -> httpx.Response:
    return httpx.Response(200, json={"path": str(path)})


def _step(op: Op[T], answer: Any) -> Request:
    return op.throw(answer) if isinstance(answer, BaseException) else op.send(answer)


@dataclass(frozen=True)
class _Retries:
    times: int
    max_wait: float

    def wait(self, req: Request, resp: httpx.Response, attempt: int) -> float | None:
        """Seconds to wait before sending `req` again, or None to take this answer: only reads are sent again,
        only after a 503 whose Retry-After (seconds) is within max_wait."""
        if not req.safe or resp.status_code != 503 or attempt >= self.times:
            return None
        try:
            seconds = float(resp.headers.get("retry-after", ""))
        except ValueError:
            return None
        return seconds if 0 <= seconds <= self.max_wait else None


def _headers(api_key: str | None) -> dict[str, str]:
    out = {"User-Agent": f"fusionrag-client/{__version__}"}
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


class _Operation(Generic[P, T]):
    """An operation as a method: run by the client it is called on (so awaitable on an AsyncClient)."""

    def __init__(self, op: Callable[P, Op[T]]):
        self.op = op
        self.__doc__ = op.__doc__

    @overload
    def __get__(self, client: None, owner: type) -> Callable[P, Op[T]]: ...

    @overload
    def __get__(self, client: AsyncClient, owner: type) -> Callable[P, Coroutine[Any, Any, T]]: ...

    @overload
    def __get__(self, client: Client, owner: type) -> Callable[P, T]: ...

    def __get__(self, client, owner=None):
        if client is None:
            return self.op  # the operation itself: help(Client.search) shows its parameters and doc
        op = self.op

        @functools.wraps(op)
        def call(*args, **kwargs):
            return client.run(op(*args, **kwargs))
        return call


class _Api:
    collections = _Operation(Ops.collections)
    create_collection = _Operation(Ops.create_collection)
    info = _Operation(Ops.info)
    drop_collection = _Operation(Ops.drop_collection)
    upsert = _Operation(Ops.upsert)
    get = _Operation(Ops.get)
    scroll = _Operation(Ops.scroll)
    count = _Operation(Ops.count)
    set_metadata = _Operation(Ops.set_metadata)
    delete = _Operation(Ops.delete)
    search = _Operation(Ops.search)
    recommend = _Operation(Ops.recommend)
    search_groups = _Operation(Ops.search_groups)
    snapshot = _Operation(Ops.snapshot)
    snapshots = _Operation(Ops.snapshots)
    download_snapshot = _Operation(Ops.download_snapshot)
    delete_snapshot = _Operation(Ops.delete_snapshot)
    restore = _Operation(Ops.restore)
    import_documents = _Operation(Ops.import_documents)
    upload_file = _Operation(Ops.upload_file)
    update_aliases = _Operation(Ops.update_aliases)
    create_alias = _Operation(Ops.create_alias)
    delete_alias = _Operation(Ops.delete_alias)
    aliases = _Operation(Ops.aliases)


class Client(_Api):
    """The service at `url`, with an API key when it has keys. `timeout`: seconds (or an httpx.Timeout).
    Reads answered 503 with a Retry-After of at most `max_retry_wait` seconds are sent again, `retries` times;
    writes never are (they may have been applied). `transport`: an httpx transport (tests, proxies)."""

    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, *, timeout: float | httpx.Timeout = 60.0,
                 retries: int = 2, max_retry_wait: float = 30.0, transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self._retries = _Retries(retries, max_retry_wait)
        self._http = httpx.Client(base_url=self.url, headers=_headers(api_key), timeout=timeout, transport=transport)

    def run(self, op: Op[T]) -> T:
        """Run an operation (see Ops), sending its requests one after the other."""
        answer = None
        try:
            while True:
                answer = _answer(self._send(_step(op, answer)))
        except StopIteration as done:
            return done.value

    def _send(self, req: Request) -> httpx.Response:
        try:
            return self._send_once(req)
        except httpx.TransportError as e:
            raise UnreachableError(self.url, e) from e

    def _send_once(self, req: Request) -> httpx.Response:
        attempt = 0
        while True:
            with contextlib.ExitStack() as stack:
                kw = _body(req, stack, sync=True)
                with self._http.stream(req.method, req.path, params=req.params, **kw) as resp:
                    if req.save_to is not None and resp.status_code < 400:
                        with _saving(req.save_to) as out:
                            for chunk in resp.iter_bytes(1 << 20):
                                out.write(chunk)
                        return _saved(req.save_to)
                    resp.read()
            wait = self._retries.wait(req, resp, attempt)
            if wait is None:
                return resp
            attempt += 1
            time.sleep(wait)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Api):
    """As `Client`, each method a coroutine. Its connections belong to the event loop that first uses it."""

    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, *, timeout: float | httpx.Timeout = 60.0,
                 retries: int = 2, max_retry_wait: float = 30.0, transport: httpx.AsyncBaseTransport | None = None):
        self.url = url.rstrip("/")
        self._retries = _Retries(retries, max_retry_wait)
        self._http = httpx.AsyncClient(base_url=self.url, headers=_headers(api_key), timeout=timeout,
                                       transport=transport)

    async def run(self, op: Op[T]) -> T:
        """Run an operation (see Ops), sending its requests one after the other."""
        answer = None
        try:
            while True:
                answer = _answer(await self._send(_step(op, answer)))
        except StopIteration as done:
            return done.value

    async def _send(self, req: Request) -> httpx.Response:
        try:
            return await self._send_once(req)
        except httpx.TransportError as e:
            raise UnreachableError(self.url, e) from e

    async def _send_once(self, req: Request) -> httpx.Response:
        attempt = 0
        while True:
            with contextlib.ExitStack() as stack:
                kw = _body(req, stack, sync=False)
                async with self._http.stream(req.method, req.path, params=req.params, **kw) as resp:
                    if req.save_to is not None and resp.status_code < 400:
                        with _saving(req.save_to) as out:
                            async for chunk in resp.aiter_bytes(1 << 20):
                                out.write(chunk)
                        return _saved(req.save_to)
                    await resp.aread()
            wait = self._retries.wait(req, resp, attempt)
            if wait is None:
                return resp
            attempt += 1
            await asyncio.sleep(wait)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


__all__ = ["AsyncClient", "AuthError", "Client", "CollectionInfo", "Document", "Group", "GroupsResult", "Hit", "Ops",
           "Page", "RemoteError",
           "UnreachableError",
           "Request", "SearchResult", "error_for"]
