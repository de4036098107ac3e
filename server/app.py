"""The HTTP API: a FastAPI app over a Catalog of collections. The engine underneath knows nothing of HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Annotated, Callable

import numpy as np
import orjson
import anyio
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from fastapi import APIRouter, Depends, FastAPI, Path as PathParam, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from fusionrag import __version__
from fusionrag.retriever.collection import NAME_RE, Catalog, Collection, CollectionConfig, Document
from fusionrag.retriever.config import EngineConfig, SearchParams
from fusionrag.retriever.embedding import canonical_name, get_embedder, set_threads
from fusionrag.retriever.errors import (ConfigError, ConflictError, FusionRAGError, InputError, NotFoundError,
                                       StorageError, UnavailableError)
from fusionrag.retriever.filters import compile_filter
from fusionrag.retriever.vectors import EXTENSIONS as VECTOR_EXTENSIONS, vector_problems
from fusionrag.server.auth import Key, KeyRing
from fusionrag.server.batcher import MicroBatcher, ServiceClosing
from fusionrag.server.config import ServerConfig, data_path
from fusionrag.server.demo import ensure_demo
from fusionrag.server.metrics import Metrics
from fusionrag.server.bodies import Body, read_body, validate
from fusionrag.server.schemas import (NAME_PATTERN, CreateCollection, Deleted, DeleteRequest, Documents,
                                      DocumentsPage, Error, GetRequest, Readiness, SearchRequest, UpsertRequest)

log = logging.getLogger("fusionrag.server")
_STATUS = ((NotFoundError, 404), (ConflictError, 409), (InputError, 422), (ConfigError, 422), (StorageError, 507),
           (UnavailableError, 503))


def open_catalog(config: ServerConfig) -> Catalog:
    engine = EngineConfig(buffer_bytes=int(config.buffer_mb * (1 << 20)), filter_tier=config.filter_tier,
                          gpu_budget_bytes=int(config.gpu_budget_mb * (1 << 20)),
                          gpu_memory_utilization=config.gpu_memory_utilization,
                          gpu_tiered_share=config.gpu_tiered_share)
    return Catalog(data_path(config), engine, CollectionConfig(min_index_count=config.min_index_count))


class State:
    """What the routes share: the catalog, the batcher, the keys, and whether loading has finished."""

    def __init__(self, config: ServerConfig):
        self.config = config
        set_threads(config.embed_threads)
        self.keys = KeyRing.from_config(config.api_keys, config.api_keys_file)
        self.catalog = open_catalog(config)
        shutil.rmtree(data_path(config) / "uploads", ignore_errors=True)  # what a crash cut short
        self.metrics = Metrics(self.collections_info)
        self.batcher = MicroBatcher(config.batch_wait_ms / 1000, config.batch_max_queries,
                                    config.search_threads, self.metrics)
        self.ready = threading.Event()
        self.demo_error: str | None = None
        self.building: set[str] = set()
        self.lock = threading.Lock()

    def load(self) -> None:
        """Open every collection (building the demo on a first start) and warm the embedding models.
        One that fails is set aside with the reason (/readyz and its info say it) while the others serve."""
        if self.config.demo:
            with self.lock:
                self.building.add("demo")
            try:
                ensure_demo(self.catalog, self.config.embedding)
            except UnavailableError:  # on disk but broken: reported like any other collection
                pass
            except Exception as e:  # noqa: BLE001 - reported by /readyz and the log; the rest still serves
                self.demo_error = f"building the demo collection failed: {type(e).__name__}: {e}"
                log.exception("building the demo collection failed")
            finally:
                with self.lock:
                    self.building.discard("demo")
        failed = self.catalog.open_all()
        for name in self.catalog.names():
            try:
                coll = self.catalog.get(name)
                if coll.embedding:
                    get_embedder(coll.embedding).load()
            except (NotFoundError, UnavailableError):  # dropped meanwhile, or failed to open
                pass
            except Exception:  # noqa: BLE001 - its text queries will fail with the reason; vectors still work
                log.exception("loading the embedding model of collection %r failed", name)
        self.ready.set()
        log.info("ready", extra={"collections": self.catalog.names(), "failed": failed})

    def collections_info(self) -> dict[str, dict]:
        """Info of every collection that serves (those that failed to open are in failed_info)."""
        if not self.ready.is_set():
            return {}
        out = {}
        for name in self.catalog.names():
            try:
                out[name] = self.catalog.get(name).info()
            except (NotFoundError, UnavailableError):  # dropped meanwhile, or failed to open
                pass
        return out

    def failed_info(self, name: str) -> dict:
        return {"name": name, "state": "failed", "reason": self.catalog.failed().get(name, "")}


def _error(status: int, detail: str, headers: dict | None = None) -> HTTPException:
    return HTTPException(status_code=status, detail=detail, headers=headers)


_WHY = {400: "malformed JSON, or an invalid collection name", 401: "no valid API key (when the service has keys)",
        403: "the API key does not cover this collection", 404: "no such collection or document",
        405: "a verb's path (…/documents/get or …/delete) asked with another method",
        409: "a collection of this name exists", 413: "body over max_body_bytes, or over its share of JSON values",
        422: "a value or a limit refused; `errors` lists what the body's model found",
        415: "the body's content type is not one the route takes",
        503: "the collection is being built or failed to open, or the service is stopping",
        507: "the disk refused a write"}


def _errors(*statuses: int) -> dict:
    # Named by reference, not `model`, which would take the route's media type (text/plain for /metrics).
    return {status: {"description": _WHY[status], "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}} for status in statuses}


def _json_body(model) -> dict:
    """The body of a route that reads it itself (server/bodies.py), declared as FastAPI would declare it."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


class _AnyText(Convertor):
    """A path parameter matched whole: `path` is `.*`, which stops at a newline that the route's `$` then lets
    through, so `…/documents/a%0A` would have answered document `a`."""
    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


# The verbs under /documents/ (POST …/documents/get and …/delete): concrete paths before templated ones, as
# OpenAPI matches them, so a GET there is a 405, not the document of that id (POST …/documents/get reads it).
_DOCUMENT_VERBS = ("get", "delete")


class _DocumentId(_AnyText):
    regex = rf"(?!(?:{'|'.join(_DOCUMENT_VERBS)})\Z)[\s\S]*"


register_url_convertor("document_id", _DocumentId())


def _state(request: Request) -> State:
    return request.app.state.fusionrag


def authenticate(request: Request) -> Key | None:
    """The caller's key; None when the service runs without keys."""
    ring = _state(request).keys
    if not ring.enabled:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}
    if scheme.lower() != "bearer" or not token.strip():
        raise _error(401, "missing API key: send the header 'Authorization: Bearer <key>'", challenge)
    key = ring.lookup(token.strip())
    if key is None:
        raise _error(401, "invalid API key", challenge)
    return key


def check_name(name: str) -> None:
    if not NAME_RE.fullmatch(name):  # fullmatch: `$` alone would let a trailing newline through
        raise _error(400, f"invalid collection name {name[:80]!r}: use 1-64 letters, digits, '_', '.' or '-', "
                          "starting with a letter or digit")


def allowed(name: Annotated[str, PathParam(json_schema_extra={"pattern": NAME_PATTERN})],
            key: Key | None = Depends(authenticate)) -> str:
    """The collection name of the path, valid and open to this key."""
    check_name(name)
    if key is not None and not key.allows(name):
        raise _error(403, f"this API key has no rights to collection {name!r}")
    return name


def open_collection(request: Request, name: str = Depends(allowed)) -> Collection:
    state = _state(request)
    with state.lock:
        building = name in state.building
    if building:
        raise _error(503, f"collection {name!r} is being built; /readyz says when it is done", {"Retry-After": "5"})
    return state.catalog.get(name)


def _hit(h, with_vector: bool = False) -> dict:
    out = {"id": h.id, "score": float(h.score), "distance": float(h.distance), "text": h.text, "metadata": h.metadata}
    if with_vector:
        out["vector"] = np.asarray(h.vector, dtype=np.float32)
    return out


class VectorJSON(JSONResponse):
    """JSON by orjson, vectors given as float32 arrays: the floats' text is most of what an answer with vectors
    costs (20 hits of 384 numbers: 5 ms by json.dumps, 0.14 ms by orjson, which also writes float32's shortest
    digits, half the bytes, that read back to the same float32)."""

    def render(self, content) -> bytes:
        try:
            return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
        except orjson.JSONEncodeError:  # what orjson does not write, such as an integer past 64 bits in metadata
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                              default=np.ndarray.tolist).encode()


def _document(d: Document, with_vector: bool = False) -> dict:
    out = {"id": d.id, "text": d.text, "metadata": d.metadata}
    if with_vector:
        out["vector"] = np.asarray(d.vector, dtype=np.float32)
    return out


def _plain(stats: dict) -> dict:
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in stats.items()}


def _search_params(given: dict) -> SearchParams:
    kinds = {f.name: type(f.default) for f in fields(SearchParams)}
    for name, value in given.items():
        kind = kinds.get(name)
        ok = kind is None or (isinstance(value, kind) and not isinstance(value, bool)) or \
            (kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise _error(422, f"params.{name} must be a{'n' if kind is int else ''} {kind.__name__}, got {value!r}")
    return SearchParams.from_dict(given)  # unknown names and ranges: ConfigError, a 422


def _check_texts(texts, limit: int, what: str) -> None:
    for i, t in enumerate(texts):
        if t is not None and len(t) > limit:
            raise _error(422, f"{what}[{i}] has {len(t)} characters, at most {limit} allowed (max_text_chars)")


def _check_vectors(vectors: np.ndarray, coll: Collection, what: str) -> None:
    """What Collection.search would refuse, refused here: in a batch, one bad query would fail its neighbours."""
    if vectors.ndim != 2 or vectors.shape[1] != coll.dim:
        got = vectors.shape[1] if vectors.ndim == 2 else "ragged"
        raise _error(422, f"{what} have dimension {got}, collection {coll.name!r} has dimension {coll.dim}")
    bad, why = vector_problems(vectors, coll.metric)
    if bad.size:
        raise _error(422, f"{what}[{bad[0]}] {why[0]}")


def _embedder_of(coll: Collection, what: str):
    if not coll.embedding:
        raise _error(422, f"collection {coll.name!r} has no embedding model, so {what} need vectors")
    return get_embedder(coll.embedding)


v1 = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])


@v1.get("/collections", summary="List the collections (those this key may use)", responses=_errors(401))
def list_collections(request: Request, key: Key | None = Depends(authenticate)):
    state = _state(request)
    out = []
    for name in state.catalog.names():
        if key is None or key.allows(name):
            try:
                coll = state.catalog.get(name)
                out.append({"name": name, "state": "ready", "dimension": coll.dim, "metric": coll.metric,
                            "embedding": coll.embedding, "count": len(coll)})
            except UnavailableError:
                out.append(state.failed_info(name))
            except NotFoundError:  # dropped meanwhile
                pass
    return {"collections": out}


@v1.post("/collections", status_code=201, summary="Create an empty collection",
         responses=_errors(400, 401, 403, 409, 413, 422, 507))
def create_collection(body: CreateCollection, request: Request, key: Key | None = Depends(authenticate)):
    check_name(body.name)
    if key is not None and not key.allows(body.name):
        raise _error(403, f"this API key has no rights to collection {body.name!r}")
    dim = body.dimension
    embedding = canonical_name(body.embedding) if body.embedding else None
    if embedding:
        model_dim = get_embedder(embedding).dim
        if dim is not None and dim != model_dim:
            raise _error(422, f"dimension {dim} does not fit embedding model {embedding} (dimension {model_dim})")
        dim = model_dim
    info = _state(request).catalog.create(body.name, dim, body.metric, embedding).info()
    if embedding:  # loaded now, in the background, rather than by the first write or search that needs it
        threading.Thread(target=_preload, args=(embedding,), name="embedder-load", daemon=True).start()
    return info


def _preload(model: str) -> None:
    try:
        get_embedder(model).load()
    except Exception:  # noqa: BLE001 - the first request that needs the model gets the error
        log.exception("loading embedding model %r failed", model)


@v1.get("/collections/{name}", summary="Size, tiers, memory per tier and build state of a collection; the "
                                      "reason when it failed to open",
        responses=_errors(400, 401, 403, 404, 422, 503))
def collection_info(request: Request, name: str = Depends(allowed)):
    state = _state(request)
    if name in state.catalog.failed():
        return state.failed_info(name)
    return open_collection(request, name).info()


@v1.delete("/collections/{name}", summary="Delete a collection and its files",
           responses=_errors(400, 401, 403, 404, 422, 503, 507))
def drop_collection(request: Request, name: str = Depends(allowed)):
    _state(request).catalog.drop(name)
    return {"deleted": name}


# -- snapshots ---------------------------------------------------------------------------------------

SNAPSHOT_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{8}")
_TAR = {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}
_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary", "description": "the archive"}}}


def _snapshots(request: Request, name: str) -> Path:
    """Where a collection's snapshots are kept: beside the collections, so that they outlive a drop."""
    return data_path(_state(request).config) / "snapshots" / name


def _snapshot_file(request: Request, name: str, snapshot_id: str) -> Path:
    path = _snapshots(request, name) / f"{snapshot_id}.tar"
    if not SNAPSHOT_ID.fullmatch(snapshot_id) or not path.is_file():
        raise _error(404, f"no snapshot {snapshot_id[:80]!r} of collection {name!r}")
    return path


@v1.post("/collections/{name}/snapshots", status_code=201, responses=_errors(400, 401, 403, 404, 422, 503, 507),
         summary="Write a snapshot of a collection (its state now, while writes go on); returns its id")
def create_snapshot(request: Request, coll: Collection = Depends(open_collection)):
    folder = _snapshots(request, coll.name)
    snapshot_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot make the snapshot folder: {e}") from e
    info = {"id": snapshot_id, **coll.snapshot(folder / f"{snapshot_id}.tar")}
    try:
        (folder / f"{snapshot_id}.json").write_text(json.dumps(info))
    except OSError as e:
        (folder / f"{snapshot_id}.tar").unlink(missing_ok=True)
        raise StorageError(f"cannot write the snapshot's description: {e}") from e
    return info


@v1.get("/collections/{name}/snapshots", summary="The snapshots of a collection, oldest first",
        responses=_errors(400, 401, 403, 422))
def list_snapshots(request: Request, name: str = Depends(allowed)):
    folder = _snapshots(request, name)
    found = []
    for desc in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if SNAPSHOT_ID.fullmatch(desc.stem) and desc.with_suffix(".tar").is_file():
            try:
                found.append(json.loads(desc.read_text()))
            except (OSError, ValueError):  # a description cut short by a crash: the archive is still listed
                found.append({"id": desc.stem, "bytes": desc.with_suffix(".tar").stat().st_size})
    return {"snapshots": found}


@v1.get("/collections/{name}/snapshots/{snapshot_id}", summary="Download a snapshot (a tar archive)",
        responses={200: {"content": _TAR, "description": "the archive"}, **_errors(400, 401, 403, 404, 422)},
        response_class=FileResponse)
def download_snapshot(request: Request, snapshot_id: str, name: str = Depends(allowed)):
    return FileResponse(_snapshot_file(request, name, snapshot_id), media_type="application/x-tar",
                        filename=f"{name}-{snapshot_id}.tar")


@v1.delete("/collections/{name}/snapshots/{snapshot_id}", summary="Delete a snapshot",
           responses=_errors(400, 401, 403, 404, 422))
def delete_snapshot(request: Request, snapshot_id: str, name: str = Depends(allowed)):
    path = _snapshot_file(request, name, snapshot_id)
    path.with_suffix(".json").unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    return {"deleted": snapshot_id}


async def _spool(request: Request) -> Path:
    """The request's body, written to a file of the data directory as it arrives (an upload may be far larger
    than memory); the caller removes it."""
    folder = data_path(_state(request).config) / "uploads"
    path = folder / f"{uuid.uuid4().hex}.part"
    size = 0
    try:
        folder.mkdir(parents=True, exist_ok=True)
        async with await anyio.open_file(path, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                await f.write(chunk)
    except OSError as e:
        path.unlink(missing_ok=True)
        raise StorageError(f"cannot store the upload: {e}") from e
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    if not size:
        path.unlink(missing_ok=True)
        raise _error(422, "the body is empty: send the file as the request's body")
    return path


# -- bulk import ------------------------------------------------------------------------------------

_JSONL = ("application/x-ndjson", "application/jsonl")


async def _spool_parts(request: Request, folder: Path) -> dict[str, Path]:
    """The files of an import request, written into `folder` as they arrive: a JSON-lines body is the
    documents; a multipart body has parts `documents` (JSON lines) and `vectors` (a vector file, its
    format by its file name's extension)."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    ctype = ctype.decode("latin-1").lower()
    if ctype in _JSONL:
        path = folder / "documents.jsonl"
        async with await anyio.open_file(path, "wb") as f:
            async for chunk in request.stream():
                await f.write(chunk)
        return {"documents": path}
    if ctype != "multipart/form-data" or not params.get(b"boundary"):
        raise _error(415, f"send the documents as {' or '.join(_JSONL)} (JSON lines), or multipart/form-data with "
                          "parts 'documents' and 'vectors' (a .fvecs .fbin .npy ... file)")
    files: dict[str, Path] = {}
    part: dict = {}

    def headers_finished() -> None:
        _, disposition = parse_options_header(part["headers"].get(b"content-disposition", b""))
        name = disposition.get(b"name", b"").decode("latin-1")
        if name == "documents":
            path = folder / "documents.jsonl"
        elif name == "vectors":
            ext = os.path.splitext(disposition.get(b"filename", b"").decode("latin-1"))[1].lower()
            if ext not in VECTOR_EXTENSIONS:
                raise _error(422, f"the vectors part's file name must end in one of {', '.join(VECTOR_EXTENSIONS)}")
            path = folder / f"vectors{ext}"
        else:
            raise _error(422, f"unknown part {name[:40]!r}: an import takes 'documents' and 'vectors'")
        if name in files:
            raise _error(422, f"part {name!r} given twice")
        files[name] = path
        part["file"] = open(path, "wb")

    def header_end() -> None:
        part["headers"][part["field"].lower()] = part["value"]
        part["field"] = part["value"] = b""

    callbacks = {
        "on_part_begin": lambda: part.update(headers={}, field=b"", value=b"", file=None),
        "on_header_field": lambda d, s, e: part.update(field=part["field"] + d[s:e]),
        "on_header_value": lambda d, s, e: part.update(value=part["value"] + d[s:e]),
        "on_header_end": header_end,
        "on_headers_finished": headers_finished,
        "on_part_data": lambda d, s, e: part["file"].write(d[s:e]),
        "on_part_end": lambda: part["file"].close(),
    }
    parser = MultipartParser(params[b"boundary"], callbacks)
    try:
        async for chunk in request.stream():
            await anyio.to_thread.run_sync(parser.write, chunk)
        parser.finalize()
    except MultipartParseError as e:
        raise _error(400, f"malformed multipart body: {e}") from e
    finally:
        if part.get("file") is not None:
            part["file"].close()
    if not files:
        raise _error(422, "the multipart body has neither a 'documents' nor a 'vectors' part")
    return files


def _run_import(coll: Collection, files: dict[str, Path], folder: Path) -> None:
    try:
        coll.import_files(files.get("documents"), files.get("vectors"), progress=False)
    except Exception:  # noqa: BLE001 - the collection's info says why; the log has the rest
        log.exception("import into collection %r failed", coll.name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@v1.post("/collections/{name}/import", status_code=202, summary="Bulk import into an empty collection: JSON lines "
         "(or a vector file and JSON lines) streamed to disk, then indexed in the background; progress and outcome "
         "in the collection's info", responses=_errors(400, 401, 403, 404, 409, 413, 415, 422, 503, 507),
         openapi_extra={"requestBody": {"required": True, "content": {
             "application/x-ndjson": {"schema": {"type": "string", "format": "binary"}},
             "multipart/form-data": {"schema": {"type": "object", "properties": {
                 "documents": {"type": "string", "format": "binary"},
                 "vectors": {"type": "string", "format": "binary"}}}}}}})
async def import_documents(request: Request, coll: Collection = Depends(open_collection)):
    state = _state(request)
    if len(coll):  # before the upload, not after it
        raise ConflictError(f"collection {coll.name!r} already holds documents: import into a new, empty collection")
    folder = data_path(state.config) / "uploads" / uuid.uuid4().hex
    try:
        folder.mkdir(parents=True)
        files = await _spool_parts(request, folder)
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise StorageError(f"cannot store the upload: {e}") from e
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if not any(p.stat().st_size for p in files.values()):
        shutil.rmtree(folder, ignore_errors=True)
        raise _error(422, "the upload is empty")
    threading.Thread(target=_run_import, args=(coll, files, folder), name=f"import-{coll.name}", daemon=True).start()
    return JSONResponse({"collection": coll.name, "import": "started",
                         "files": {k: p.stat().st_size for k, p in files.items()}}, 202)


@v1.post("/collections/{name}/restore", status_code=201, summary="A new collection from a snapshot (the archive "
         "as the body, up to max_upload_bytes)", openapi_extra={"requestBody": {"required": True, "content": _BINARY}},
         responses=_errors(400, 401, 403, 409, 413, 422, 503, 507))
async def restore_collection(request: Request, name: str = Depends(allowed)):
    catalog = _state(request).catalog
    catalog.check_free(name)  # before the upload, not after it
    upload = await _spool(request)
    try:
        def restore() -> dict:
            with open(upload, "rb") as f:
                return catalog.restore(name, f).info()
        return await run_in_threadpool(restore)
    finally:
        upload.unlink(missing_ok=True)


async def _read(request: Request, readers: Callable[[Body], dict]) -> dict:
    """The JSON object of the body, the members named by readers(body) read by theirs; its bytes go on return."""
    body = Body(await read_body(request))
    return body.document(readers(body))


def _too_many(what: str, limit: int, setting: str) -> Callable[[], HTTPException]:
    return lambda: _error(422, f"more than {limit} {what} in one request, at most {limit} allowed ({setting})")


@v1.post("/collections/{name}/search", summary="Top-k documents of each query vector or text",
         openapi_extra=_json_body(SearchRequest), responses=_errors(400, 401, 403, 404, 413, 422, 503))
async def search(request: Request, coll: Collection = Depends(open_collection)):
    state = _state(request)
    cfg = state.config
    too_many = _too_many("queries", cfg.max_queries, "max_queries")

    def wrong_dim(d: int) -> HTTPException:
        return _error(422, f"query vectors have dimension {d}, collection {coll.name!r} has dimension {coll.dim}")

    data = await _read(request, lambda b: {
        "vectors": lambda i: b.array(i, 1, lambda n, j: b.vector(j, coll.dim, ("vectors", n), wrong_dim),
                                     cfg.max_queries, too_many),
        "texts": lambda i: b.array(i, 1, lambda _, j: b.value(j, 2), cfg.max_queries, too_many)})
    rows = data.pop("vectors", None)
    # Vectors that are not a list are the model's to refuse, with its message.
    body = validate(SearchRequest, data if isinstance(rows, (list, type(None))) else {**data, "vectors": rows})
    if body.mode == "vector" and (rows is None) == (body.texts is None):
        raise _error(422, "give exactly one of 'vectors' and 'texts'")
    if body.mode != "vector" and body.texts is None:
        raise _error(422, f"mode {body.mode!r} needs 'texts'")
    if body.mode == "text" and rows is not None:
        raise _error(422, "mode 'text' searches by 'texts' alone: give no 'vectors'")
    if body.mode == "hybrid" and rows is not None and len(rows) != len(body.texts):
        raise _error(422, f"mode 'hybrid' needs one text per query vector, got {len(body.texts)} for {len(rows)}")
    queries = rows if rows is not None else body.texts
    if not queries:
        raise _error(422, "no queries: 'vectors' or 'texts' is empty")
    if body.k > cfg.max_k:
        raise _error(422, f"k is {body.k}, at most {cfg.max_k} allowed (max_k)")
    params = _search_params(body.params) if body.params else None
    if body.filter is not None:
        compile_filter(body.filter)  # a bad filter fails its own request here, not the batch it would join
    vectors = None
    if rows is not None:
        vectors = np.stack(rows)
        _check_vectors(vectors, coll, "query vectors")
    if body.texts is not None:
        _check_texts(body.texts, cfg.max_text_chars, "texts")
        if vectors is None and body.mode != "text":
            _embedder_of(coll, "queries")
    t = time.perf_counter()
    try:
        res = await state.batcher.search(coll, body.k, filter=body.filter, params=params, vectors=vectors,
                                         texts=body.texts, mode=body.mode, text_weight=body.text_weight,
                                         with_vectors=body.with_vectors)
    except ServiceClosing as e:
        raise _error(503, str(e)) from e
    state.metrics.recent.add(time.perf_counter() - t, len(queries),
                             sum(int(s.get("pages_read", 0)) for s in res.stats),
                             sum(int(s.get("pages_buffered", 0)) for s in res.stats))
    out = {"results": [[_hit(h, body.with_vectors) for h in hits] for hits in res.hits]}
    # A filter comparing a field with values of a type it is not held as matches nothing: said, not silent.
    if body.filter is not None and (warnings := await run_in_threadpool(coll.filter_warnings, body.filter)):
        out["warnings"] = warnings
    if body.stats:
        out["stats"] = [_plain(s) for s in res.stats]
    return VectorJSON(out)


@v1.post("/collections/{name}/documents", summary="Add or replace documents (by id); returns their ids",
         openapi_extra=_json_body(UpsertRequest), responses=_errors(400, 401, 403, 404, 413, 422, 503, 507))
async def upsert_documents(request: Request, coll: Collection = Depends(open_collection)):
    cfg = _state(request).config

    def document(b: Body, n: int, i: int):
        def wrong_dim(d: int) -> HTTPException:
            return _error(422, f"documents[{n}].vector has dimension {d}, collection {coll.name!r} "
                               f"has dimension {coll.dim}")
        return b.obj(i, 2, {"vector": lambda j: b.vector(j, coll.dim, ("documents", n, "vector"), wrong_dim,
                                                         nullable=True)})

    too_many = _too_many("documents", cfg.max_documents, "max_documents")
    data = await _read(request, lambda b: {
        "documents": lambda i: b.array(i, 1, lambda n, j: document(b, n, j), cfg.max_documents, too_many)})
    given = data.get("documents")
    vectors = [d.pop("vector", None) if isinstance(d, dict) else None for d in given] \
        if isinstance(given, list) else []
    docs = validate(UpsertRequest, data).documents
    _check_texts([d.text for d in docs], cfg.max_text_chars, "documents.text")
    for i, (d, v) in enumerate(zip(docs, vectors)):
        if d.text is None and v is None:
            raise _error(422, f"documents[{i}]: a document needs a text, a vector, or both")
    to_embed = [i for i, v in enumerate(vectors) if v is None]
    embedder = _embedder_of(coll, "documents without a vector") if to_embed else None

    def write() -> list[str]:
        if to_embed:
            for i, vec in zip(to_embed, embedder.embed([docs[i].text for i in to_embed])):
                vectors[i] = vec
        return coll.upsert([Document(id=d.id, text=d.text, vector=v, metadata=d.metadata)
                            for d, v in zip(docs, vectors)])

    return {"ids": await run_in_threadpool(write)}


@v1.get("/collections/{name}/documents/{doc_id:document_id}", summary="One document by id (ids 'get' and "
        "'delete' through POST …/documents/get)", responses=_errors(400, 401, 403, 404, 405, 422, 503))
def get_document(doc_id: Annotated[str, PathParam(json_schema_extra={"not": {"enum": list(_DOCUMENT_VERBS)}})],
                 vector: bool = False, coll: Collection = Depends(open_collection)):
    found = coll.get([doc_id], with_vectors=vector)
    if not found:
        raise _error(404, f"no document {doc_id!r} in collection {coll.name!r}")
    return VectorJSON(_document(found[0], vector))


def _ids_reader(request: Request) -> Callable[[Body], dict]:
    """The body's `ids`, refused at the one past max_documents."""
    limit = _state(request).config.max_documents
    too_many = _too_many("ids", limit, "max_documents")
    return lambda b: {"ids": lambda i: b.array(i, 1, lambda _, j: b.value(j, 2), limit, too_many)}


@v1.post("/collections/{name}/documents/get", summary="Documents by id, in the order asked; ids not found are left "
         "out", openapi_extra=_json_body(GetRequest),
         responses={200: {"model": Documents}, **_errors(400, 401, 403, 404, 413, 422, 503)})
async def get_documents(request: Request, coll: Collection = Depends(open_collection)):
    body = validate(GetRequest, await _read(request, _ids_reader(request)))
    docs = await run_in_threadpool(coll.get, body.ids, body.with_vectors)
    return VectorJSON({"documents": [_document(d, body.with_vectors) for d in docs]})


DEFAULT_PAGE = 100  # documents per page when `limit` is not given (at most max_documents)
PageLimit = Annotated[int, Query(ge=1, description="documents per page, at most max_documents")]
# The internal row to continue after: rows are never reused, so the order is stable while writes go on.
Cursor = Annotated[str, Query(pattern=r"^[0-9]{1,18}$", description="the next_cursor of the page before; left "
                                                                    "out: the first page")]
# Read by the route itself: FastAPI cannot declare a query parameter whose value is JSON.
_FILTER_PARAMETER = {"name": "filter", "in": "query", "required": False,
                     "description": "metadata filter as JSON, e.g. {\"year\": {\"$gte\": 2020}} (URL-encoded)",
                     "content": {"application/json": {"schema": {"type": "object"}}}}


def _query_filter(request: Request) -> dict | None:
    """The `filter` query parameter, read at the bounded cost of a body (server/bodies.py)."""
    text = request.query_params.get("filter")
    if text is None:
        return None
    if not text.lstrip().startswith("{"):
        raise _error(422, "the filter query parameter must be a JSON object")
    try:
        return Body(text.encode()).document({})
    except HTTPException as e:
        raise _error(e.status_code, f"the filter query parameter: {e.detail}") from None


@v1.get("/collections/{name}/documents", summary="Page through the documents (those a filter passes) in a stable "
        "order: each page's next_cursor gives the next", openapi_extra={"parameters": [_FILTER_PARAMETER]},
        responses={200: {"model": DocumentsPage}, **_errors(400, 401, 403, 404, 413, 422, 503)})
def list_documents(request: Request, limit: PageLimit = DEFAULT_PAGE, cursor: Cursor = None,
                   with_vectors: bool = False, coll: Collection = Depends(open_collection)):
    cfg = _state(request).config
    if "limit" not in request.query_params:
        limit = min(limit, cfg.max_documents)
    elif limit > cfg.max_documents:
        raise _error(422, f"limit is {limit}, at most {cfg.max_documents} allowed (max_documents)")
    flt = _query_filter(request)
    docs, after = coll.scroll(limit, int(cursor) if cursor else -1, flt, with_vectors)
    out = {"documents": [_document(d, with_vectors) for d in docs],
           "next_cursor": None if after is None else str(after)}
    if flt is not None and (warnings := coll.filter_warnings(flt)):
        out["warnings"] = warnings
    return VectorJSON(out)


@v1.post("/collections/{name}/documents/delete", summary="Delete documents by id (unknown ids are ignored) or by "
         "filter (in one write)", openapi_extra=_json_body(DeleteRequest),
         responses={200: {"model": Deleted}, **_errors(400, 401, 403, 404, 413, 422, 503, 507)})
@v1.delete("/collections/{name}/documents", summary="Delete documents by id (unknown ids are ignored) or by filter "
           "(in one write)", openapi_extra=_json_body(DeleteRequest),
           responses={200: {"model": Deleted}, **_errors(400, 401, 403, 404, 413, 422, 503, 507)})
async def delete_documents(request: Request, coll: Collection = Depends(open_collection)):
    data = await _read(request, _ids_reader(request))
    body = validate(DeleteRequest, data)
    if ("ids" in data) == ("filter" in data):
        raise _error(422, "give exactly one of 'ids' and 'filter'")
    if body.filter is not None:
        return {"deleted": await run_in_threadpool(coll.delete_where, body.filter)}
    return {"deleted": await run_in_threadpool(coll.delete, body.ids)}


@v1.get("/stats", summary="Live figures for the web page: memory per tier, pages per query, latency",
        responses=_errors(401))
def stats(request: Request, key: Key | None = Depends(authenticate)):
    state = _state(request)
    infos = {n: i for n, i in state.collections_info().items() if key is None or key.allows(n)}
    return {"ready": state.ready.is_set(), "collections": infos, "recent": state.metrics.recent.summary(),
            "page_buffer_hit_ratio": {n: r for n, r in state.metrics.hit_ratios().items() if n in infos}}


def _validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json:
        pos = bad_json["loc"][-1]
        return JSONResponse({"detail": f"malformed JSON at character {pos}: {bad_json['ctx']['error']}"}, 400)
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
        parts.append(f"{loc}: {e['msg']}")
    more = f" (and {len(parts) - 10} more)" if len(parts) > 10 else ""
    return JSONResponse({"detail": "; ".join(parts[:10]) + more,
                         "errors": [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors[:50]]},
                        422)


def engine_error(request: Request, exc: FusionRAGError) -> JSONResponse:
    # The service's own paths are none of a client's business.
    detail = str(exc).replace(str(_state(request).catalog.root), "<data-dir>")
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return JSONResponse({"detail": detail}, status, {"Retry-After": "5"} if status == 503 else None)
    log.error("engine error", exc_info=exc)
    return JSONResponse({"detail": f"{type(exc).__name__}: {detail}"}, 500)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc, extra={"path": request.url.path})
    # uvicorn closes the connection after an unhandled error: the client is told so, not left to find out.
    return JSONResponse({"detail": "internal error; see the service's log"}, 500, {"Connection": "close"})


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 405:  # Starlette's Allow names the methods of the path's first route only
        routes = request.app.router.routes
        methods = [m for m in ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")
                   if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes)]
        exc = StarletteHTTPException(405, exc.detail, {"Allow": ", ".join(methods)})
    return await http_exception_handler(request, exc)


def _for_caller(request: Request, body: dict) -> dict:
    """`body` with its collection names (its lists of names, its dicts by name) cut to those the caller's key
    covers; with API keys, a caller without a valid key is told the status only."""
    if not _state(request).keys.enabled:
        return body
    try:
        key = authenticate(request)
    except HTTPException:
        return {"status": body["status"]}
    return {k: [n for n in v if key.allows(n)] if isinstance(v, list) else
            {n: x for n, x in v.items() if key.allows(n)} if isinstance(v, dict) else v for k, v in body.items()}


def _document_limits(schemas: dict, config: ServerConfig) -> None:
    """The configured limits, written into the bodies' schemas of the OpenAPI document."""
    search = schemas["SearchRequest"]["properties"]
    search["k"]["maximum"] = config.max_k
    search["vectors"]["maxItems"] = search["texts"]["maxItems"] = config.max_queries
    search["texts"]["anyOf"][0]["items"]["maxLength"] = config.max_text_chars
    schemas["DocumentIn"]["properties"]["text"]["maxLength"] = config.max_text_chars
    schemas["UpsertRequest"]["properties"]["documents"]["maxItems"] = config.max_documents
    schemas["DeleteRequest"]["properties"]["ids"]["maxItems"] = config.max_documents
    schemas["GetRequest"]["properties"]["ids"]["maxItems"] = config.max_documents


def _document_page_limit(paths: dict, config: ServerConfig) -> None:
    """The configured page size, written into the listing's `limit` parameter."""
    limit = next(p for p in paths["/v1/collections/{name}/documents"]["get"]["parameters"] if p["name"] == "limit")
    limit["schema"].update(maximum=config.max_documents, default=min(DEFAULT_PAGE, config.max_documents))


# Routes whose body is a file, written to disk as it arrives: they take max_upload_bytes.
_UPLOADS = re.compile(r"/v1/collections/[^/]+/(restore|import)")


class BodyLimit:
    """413, with a message, for a body over the limit: at once when its declared length says so, else as soon as
    the bytes read pass it (raised from `receive`, so the route answers it like any HTTPException)."""

    def __init__(self, app, limit: int, upload_limit: int):
        self.app, self.limit, self.upload_limit = app, limit, upload_limit

    @staticmethod
    def _message(size: int, exact: bool, limit: int, setting: str) -> str:
        return f"request body {'of' if exact else 'over'} {size} bytes is over the limit of {limit} bytes ({setting})"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        upload = _UPLOADS.fullmatch(scope["path"]) is not None
        limit, setting = (self.upload_limit, "max_upload_bytes") if upload else (self.limit, "max_body_bytes")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await JSONResponse({"detail": self._message(int(declared), True, limit, setting)},
                                      413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, self._message(seen, False, limit, setting))
            return message

        await self.app(scope, counted, send)


class ObserveMiddleware:
    """Counts and times every request by route, and logs it as one structured line."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            seconds = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(scope["method"], route, str(status)).inc()
            self.metrics.request_seconds.labels(route).observe(seconds)
            log.info("request", extra={"method": scope["method"], "path": scope["path"], "status": status,
                                       "ms": round(seconds * 1000, 3),
                                       "client": (scope.get("client") or ("",))[0]})


def create_app(config: ServerConfig) -> FastAPI:
    state = State(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.batcher.start()
        loader = threading.Thread(target=state.load, name="fusionrag-load", daemon=True)
        loader.start()
        try:
            yield
        finally:
            # uvicorn has let the requests in flight finish; what they queued is answered before we close.
            await state.batcher.stop()
            await asyncio.get_running_loop().run_in_executor(None, loader.join)
            state.catalog.close()
            log.info("stopped")

    app = FastAPI(title="fusionrag", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Retrieval for RAG over a FusionANNS-style index. Send `Authorization: Bearer <key>` "
                              "when the service has API keys.")
    app.state.fusionrag = state
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, upload_limit=config.max_upload_bytes)
    app.add_middleware(ObserveMiddleware, metrics=state.metrics)
    app.add_exception_handler(RequestValidationError, _validation_response)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(FusionRAGError, engine_error)
    app.add_exception_handler(Exception, _unexpected)
    app.include_router(v1)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schemas = FastAPI.openapi(app)["components"]["schemas"]
            _, read_by_routes = models_json_schema(
                [(m, "validation") for m in (SearchRequest, UpsertRequest, DeleteRequest, GetRequest, Error)],
                ref_template="#/components/schemas/{model}")
            schemas.update(read_by_routes["$defs"])
            _document_limits(schemas, config)
            _document_page_limit(app.openapi_schema["paths"], config)
        return app.openapi_schema

    app.openapi = openapi

    static = resources.files("fusionrag.server") / "static"

    @app.get("/", include_in_schema=False)
    def page():
        return FileResponse(str(static / "index.html"))

    app.mount("/static", StaticFiles(directory=str(static)), name="static")
    # The OpenAPI page from a PyPI copy of Swagger UI (fastapi-offline's, 5.x: the OpenAPI 3.1 that FastAPI writes
    # needs Swagger UI 5); the default page loads it from a CDN.
    app.mount("/swagger", StaticFiles(directory=str(resources.files("fastapi_offline") / "static")), name="swagger")

    @app.get("/docs", include_in_schema=False)
    def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="fusionrag API",
                                   swagger_js_url="/swagger/swagger-ui-bundle.js",
                                   swagger_css_url="/swagger/swagger-ui.css",
                                   swagger_favicon_url="/swagger/favicon.png")

    @app.get("/healthz", summary="Live: the process answers")
    def healthz():
        return {"status": "ok"}

    @app.get("/readyz", summary="Ready: every collection is loaded",
             responses={200: {"model": Readiness}, 503: {"model": Readiness}})
    def readyz(request: Request):
        if state.ready.is_set():
            # Ready while any collection serves: one that failed to open is named here with the reason.
            failed = state.catalog.failed()
            if state.demo_error:
                failed.setdefault("demo", state.demo_error)
            return _for_caller(request, {"status": "ready", "collections": state.catalog.names(), "failed": failed})
        return JSONResponse(_for_caller(request, {"status": "loading", "building": sorted(state.building)}), 503)

    @app.get("/metrics", summary="Prometheus metrics (with API keys and metrics_auth: for a key that covers "
                                 "every collection)", response_class=PlainTextResponse, responses=_errors(401, 403))
    def metrics(request: Request):
        if config.metrics_auth and state.keys.enabled and not authenticate(request).unrestricted:
            raise _error(403, "/metrics names every collection: it needs a key that covers them all")
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
