"""The HTTP API: a FastAPI app over a Catalog of collections. The engine underneath knows nothing of HTTP."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import fields
from importlib import resources
from typing import Annotated, Callable

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Path, Request
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
from fusionrag.retriever.vectors import vector_problems
from fusionrag.server.auth import Key, KeyRing
from fusionrag.server.batcher import MicroBatcher, ServiceClosing
from fusionrag.server.config import ServerConfig, data_path
from fusionrag.server.demo import ensure_demo
from fusionrag.server.metrics import Metrics
from fusionrag.server.bodies import Body, read_body, validate
from fusionrag.server.schemas import (NAME_PATTERN, CreateCollection, DeleteRequest, Error, Readiness, SearchRequest,
                                      UpsertRequest)

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
        409: "a collection of this name exists", 413: "body over max_body_bytes, or over its share of JSON values",
        422: "a value or a limit refused; `errors` lists what the body's model found",
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


register_url_convertor("any", _AnyText())


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


def allowed(name: Annotated[str, Path(json_schema_extra={"pattern": NAME_PATTERN})],
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


def _hit(h) -> dict:
    return {"id": h.id, "score": float(h.score), "distance": float(h.distance), "text": h.text,
            "metadata": h.metadata}


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
    return _state(request).catalog.create(body.name, dim, body.metric, embedding).info()


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
                                         texts=body.texts, mode=body.mode, text_weight=body.text_weight)
    except ServiceClosing as e:
        raise _error(503, str(e)) from e
    state.metrics.recent.add(time.perf_counter() - t, len(queries),
                             sum(int(s.get("pages_read", 0)) for s in res.stats),
                             sum(int(s.get("pages_buffered", 0)) for s in res.stats))
    out = {"results": [[_hit(h) for h in hits] for hits in res.hits]}
    # A filter comparing a field with values of a type it is not held as matches nothing: said, not silent.
    if body.filter is not None and (warnings := await run_in_threadpool(coll.filter_warnings, body.filter)):
        out["warnings"] = warnings
    if body.stats:
        out["stats"] = [_plain(s) for s in res.stats]
    return JSONResponse(out)


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


@v1.get("/collections/{name}/documents/{doc_id:any}", summary="One document by id",
        responses=_errors(400, 401, 403, 404, 422, 503))
def get_document(doc_id: str, vector: bool = False, coll: Collection = Depends(open_collection)):
    found = coll.get([doc_id], with_vectors=vector)
    if not found:
        raise _error(404, f"no document {doc_id!r} in collection {coll.name!r}")
    d = found[0]
    out = {"id": d.id, "text": d.text, "metadata": d.metadata}
    if vector:
        out["vector"] = np.asarray(d.vector, dtype=np.float32).tolist()
    return out


@v1.delete("/collections/{name}/documents", summary="Delete documents by id; unknown ids are ignored",
           openapi_extra=_json_body(DeleteRequest), responses=_errors(400, 401, 403, 404, 413, 422, 503, 507))
async def delete_documents(request: Request, coll: Collection = Depends(open_collection)):
    limit = _state(request).config.max_documents
    too_many = _too_many("ids", limit, "max_documents")
    data = await _read(request, lambda b: {
        "ids": lambda i: b.array(i, 1, lambda _, j: b.value(j, 2), limit, too_many)})
    return {"deleted": await run_in_threadpool(coll.delete, validate(DeleteRequest, data).ids)}


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


class BodyLimit:
    """413, with a message, for a body over the limit: at once when its declared length says so, else as soon as
    the bytes read pass it (raised from `receive`, so the route answers it like any HTTPException)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def _message(self, size: int, exact: bool) -> str:
        return (f"request body {'of' if exact else 'over'} {size} bytes is over the limit of {self.limit} bytes "
                "(max_body_bytes)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await JSONResponse({"detail": self._message(int(declared), True)}, 413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, self._message(seen, False))
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
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
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
                [(m, "validation") for m in (SearchRequest, UpsertRequest, DeleteRequest, Error)],
                ref_template="#/components/schemas/{model}")
            schemas.update(read_by_routes["$defs"])
            _document_limits(schemas, config)
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
