"""`fusionrag serve --ray ADDRESS` (docs/sharded.md, "Serving on Ray"): one sharded index served over HTTP with the
router as a Ray Serve deployment and the shards as Ray actors.

The routes are the service's under the same paths and bodies (docs/api.md), for one collection named after the index
directory (or --name), a ShardedCollection (retriever/sharded/docs.py): search by vectors under a metadata filter,
upsert documents (any string id, text, metadata, and a vector: nothing is embedded), get, page through and delete them
by id or filter, the collection's info, health. The built vectors are documents "0", "1", ... (their source rows),
with no text or metadata. Text search (mode "text") ranks the documents' texts by BM25 on every shard; hybrid search
needs the query vectors beside the texts (nothing is embedded); creating or dropping a collection is refused.
A search that could not reach every list it needed says which (`missing_lists` per query, `partial`); with
`"partial": false` it is refused with 503 instead, as is a write, a get, a filter or a page that needs a shard that
is down.

    python -m fusionrag.server.ray_serve --address 127.0.0.1:6379 --index IDX [--host 127.0.0.1] [--port 8000]
        [--routers N]

With --routers N above 1, N router replicas run vector searches and follow a leader replica that does the writes
(_led_deployment, retriever/sharded/follow.py).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import Field

from fusionrag.retriever.collection import CollectionConfig, Document
from fusionrag.retriever.errors import FusionRAGError, InputError, UnavailableError
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.server.auth import KeyRing
from fusionrag.server.config import ServerConfig
from fusionrag.server.errors import http_error, install_handlers
from fusionrag.server.requests import check_texts, search_params, search_queries
from fusionrag.server.responses import VectorJSON, document_json, hit_json
from fusionrag.server.routes.documents import page_answer, query_filter
from fusionrag.server.schemas import CreateCollection, DeleteRequest, GetRequest, SearchRequest, UpsertRequest

DEPLOYMENT = "fusionrag-router"
LEADER = "fusionrag-leader"  # with more than one router replica: the one that writes (_led_deployment)
log = logging.getLogger(__name__)


class ShardedSearchRequest(SearchRequest):
    partial: bool = Field(True, description="false: 503 rather than an answer that misses lists of a down shard")


@dataclass(frozen=True)
class Limits:
    """A request's limits, those of the user's ServerConfig (`fusionrag serve --ray --max-k 50` ...): every router
    replica is given them (they were frozen at ServerConfig()'s defaults, whatever was asked)."""

    max_queries: int
    max_documents: int
    max_k: int
    max_text_chars: int
    max_body_bytes: int

    @classmethod
    def of(cls, config: ServerConfig) -> "Limits":
        return cls(config.max_queries, config.max_documents, config.max_k, config.max_text_chars,
                   config.max_body_bytes)


DEFAULT_LIMITS = Limits.of(ServerConfig())
DEFAULT_PAGE = 100
MERGE_FRESH_COUNT = CollectionConfig().merge_fresh_count  # a shard merges at a collection's threshold


def create_app(coll: ShardedCollection, keys: KeyRing | None = None, router: str | None = None,
               limits: Limits = DEFAULT_LIMITS) -> FastAPI:
    """The HTTP routes over a sharded collection (ShardedCollection over an opened ShardedIndex). Thread-safe as
    the index is. keys: API keys (server/auth.py) the /v1 routes require, as the single service's do; None or
    none configured: open. router: this router replica's id, sent back in the header x-fusionrag-router."""
    app = FastAPI(title="fusionrag (sharded, on Ray)")
    index, name = coll.index, coll.name
    app.state.index_dir = index.path
    install_handlers(app)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """API keys first (401 without a valid one, 403 for a key not allowed this collection; a key's listing of
        collections leaves out what it may not use), then the body's size (413)."""
        request.state.listed = True
        if keys is not None and keys.enabled and request.url.path.startswith("/v1/"):
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            challenge = {"WWW-Authenticate": "Bearer"}
            if scheme.lower() != "bearer" or not token.strip():
                return JSONResponse({"detail": "missing API key: send the header 'Authorization: Bearer <key>'"}, 401,
                                    challenge)
            key = keys.lookup(token.strip())
            if key is None:
                return JSONResponse({"detail": "invalid API key"}, 401, challenge)
            if not key.allows(name):
                if request.url.path.rstrip("/") != "/v1/collections" or request.method != "GET":
                    return JSONResponse({"detail": f"this API key has no rights to collection {name!r}"}, 403)
                request.state.listed = False
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
            return JSONResponse({"detail": f"request body of {size} bytes is over the limit of "
                                           f"{limits.max_body_bytes} bytes (max_body_bytes)"}, 413)
        response = await call_next(request)
        if router is not None:
            response.headers["x-fusionrag-router"] = router
        return response

    def collection(coll_name: str) -> None:
        if coll_name != name:
            raise http_error(404, f"no collection {coll_name!r} (this service serves {name!r})")

    def at_most(n: int, limit: int, what: str, setting: str) -> None:
        if n > limit:  # as the single service answers it (docs/api.md): a 422 naming the setting
            raise http_error(422, f"more than {limit} {what} in one request, at most {limit} allowed ({setting})")

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz():
        alive = index.check_shards()
        body = {"status": "ready" if alive.all() else "degraded", "shards_alive": alive.tolist()}
        return JSONResponse(body, status_code=200 if alive.any() else 503)

    @app.get("/v1/collections")
    def collections(request: Request):
        if not request.state.listed:
            return {"collections": []}
        info = coll.info()
        return {"collections": [{k: info[k] for k in ("name", "dimension", "metric", "embedding", "count", "state",
                                                      "sharded", "shards", "shards_alive")}]}

    @app.post("/v1/collections", status_code=201)
    def create_collection(body: CreateCollection):
        if body.name == name:
            raise http_error(409, f"collection {name!r} exists (this service serves that sharded index)")
        raise http_error(422, f"this service serves the sharded index {name!r} alone: collections are not created "
                              "through it")

    @app.get("/v1/collections/{coll_name}")
    def collection_info(coll_name: str):
        collection(coll_name)
        return coll.info()

    @app.delete("/v1/collections/{coll_name}")
    def drop_collection(coll_name: str):
        collection(coll_name)
        raise http_error(405, "a sharded collection is not dropped through the service: delete its documents, or "
                              "stop the service and remove the index directory")

    @app.post("/v1/collections/{coll_name}/search")
    async def search(coll_name: str, body: ShardedSearchRequest):
        collection(coll_name)
        if body.mode == "vector" and body.vectors is None:
            raise http_error(422, "give 'vectors' (a sharded collection embeds nothing: texts are searched with mode "
                                  "'text', or 'hybrid' beside their vectors)")
        queries = search_queries(body.mode, body.vectors, body.texts)
        if body.mode == "hybrid" and body.vectors is None:
            raise http_error(422, "mode 'hybrid' over a sharded collection needs 'vectors' beside the 'texts' "
                                  "(nothing is embedded)")
        at_most(len(queries), limits.max_queries, "queries", "max_queries")
        if body.k > limits.max_k:
            raise http_error(422, f"k is {body.k}, at most {limits.max_k} allowed (max_k)")
        q = None
        if body.vectors is not None:
            if any(len(v) != index.dim for v in body.vectors):
                raise http_error(422, f"query vectors must have dimension {index.dim}")
            q = np.asarray(body.vectors, dtype=np.float32)
        if body.texts is not None:
            check_texts(body.texts, limits.max_text_chars, "texts")
        params = search_params(body.params) if body.params else None
        res = await run_in_threadpool(coll.search, q, body.k, body.filter, params, body.with_vectors,
                                      texts=body.texts, mode=body.mode, text_weight=body.text_weight,
                                      partial=body.partial, fusion=body.fusion.model_dump() if body.fusion else None)
        out: dict = {"results": [[hit_json(h, body.with_vectors) for h in hits] for hits in res.hits],
                     "partial": res.partial}
        if res.partial:
            out["missing_lists"] = res.missing_lists
            out["missing_shards"] = res.missing_shards
        if body.filter is not None and (warnings := await run_in_threadpool(coll.filter_warnings, body.filter)):
            out["warnings"] = warnings
        if body.stats:
            out["stats"] = res.stats
        return VectorJSON(out)

    @app.post("/v1/collections/{coll_name}/documents")
    async def upsert(coll_name: str, body: UpsertRequest):
        collection(coll_name)
        at_most(len(body.documents), limits.max_documents, "documents", "max_documents")
        for i, d in enumerate(body.documents):
            if d.vector is None:
                raise http_error(422, f"documents[{i}]: a sharded collection embeds nothing: give the vector")
        docs = [Document(d.id, d.text, np.asarray(d.vector, dtype=np.float32), d.metadata) for d in body.documents]
        return {"ids": await run_in_threadpool(coll.upsert, docs)}

    @app.get("/v1/collections/{coll_name}/documents/{doc_id}")
    def get_document(coll_name: str, doc_id: str, vector: bool = False):
        collection(coll_name)
        found = coll.get([doc_id], with_vectors=vector)
        if not found:
            raise http_error(404, f"no document {doc_id!r} in collection {name!r}")
        return VectorJSON(document_json(found[0], vector))

    @app.post("/v1/collections/{coll_name}/documents/get")
    async def get_documents(coll_name: str, body: GetRequest):
        collection(coll_name)
        at_most(len(body.ids), limits.max_documents, "ids", "max_documents")
        docs = await run_in_threadpool(coll.get, body.ids, body.with_vectors)
        return VectorJSON({"documents": [document_json(d, body.with_vectors) for d in docs]})

    @app.get("/v1/collections/{coll_name}/documents")
    def list_documents(coll_name: str, request: Request, limit: int | None = Query(None, ge=1),
                       cursor: str | None = Query(None, pattern=r"^[0-9]{1,19}$"), with_vectors: bool = False):
        collection(coll_name)
        if limit is None:
            limit = min(DEFAULT_PAGE, limits.max_documents)
        at_most(limit, limits.max_documents, "documents per page", "max_documents")
        return page_answer(coll, limit, cursor, query_filter(request), with_vectors)

    @app.post("/v1/collections/{coll_name}/documents/delete")
    @app.delete("/v1/collections/{coll_name}/documents")
    async def delete(coll_name: str, body: DeleteRequest):
        collection(coll_name)
        if (body.ids is None) == (body.filter is None):
            raise http_error(422, "give exactly one of 'ids' and 'filter'")
        if body.filter is not None:
            return {"deleted": await run_in_threadpool(coll.delete_where, body.filter)}
        at_most(len(body.ids), limits.max_documents, "ids", "max_documents")
        return {"deleted": await run_in_threadpool(coll.delete, body.ids)}

    return app


def _keep_replica_on_loopback() -> None:
    """Ray Serve 2.60's replica opens its inter-deployment gRPC server on every interface ("[::]:0",
    ray/serve/_private/replica.py), whatever the HTTP host; when the service is to listen on loopback alone, that
    server is bound to 127.0.0.1 instead. The router replicas call the leader (_led_deployment) through Serve
    handles, which go as Ray actor calls unless RAY_SERVE_USE_GRPC_BY_DEFAULT=1, so nothing dials that server from
    elsewhere. Runs in the replica, before Serve starts that server."""
    from ray.serve._private import replica

    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "loopback", False):
        return

    def on_loopback(server, address):
        return add_port(server, "127.0.0.1:0" if address == "[::]:0" else address)

    on_loopback.loopback = True
    replica.add_port_to_grpc_server = on_loopback


def _keep_healthy(index, every_s: float, stop: threading.Event, merge_fresh_count: int = MERGE_FRESH_COUNT,
                  after=None) -> None:
    """Every every_s: ask each shard whether it runs, restart those that do not from their directories, and merge
    those whose fresh tier and tombstones hold merge_fresh_count rows or more (searches and writes go on); then
    call after() (where given)."""
    while not stop.wait(every_s):
        try:
            index.check_shards()
            index.heal()
            index.merge_shards(min_fresh=merge_fresh_count)
        except Exception:  # noqa: BLE001 - the next round tries again
            log.warning("fusionrag: checking or merging the shards failed", exc_info=True)
        if after is not None:
            try:
                after()
            except Exception:  # noqa: BLE001
                log.warning("fusionrag: publishing the router's view failed", exc_info=True)


class _IndexOwner:
    """A replica that opens the index with its shards as Ray actors of its own and keeps them healthy (the single
    router, or the leader of several): the two deployments' shared part."""

    def _open(self, index_dir: str, loopback: bool, actor_options: dict | None, call_timeout_s: float | None) -> None:
        from fusionrag.retriever.sharded.router import ShardedIndex

        if loopback:
            _keep_replica_on_loopback()
        self.index = ShardedIndex.open(index_dir, ray=True, actor_options=actor_options, call_timeout_s=call_timeout_s)
        self.stop = threading.Event()

    def _heal_every(self, every_s: float, after=None) -> None:
        threading.Thread(target=_keep_healthy, args=(self.index, every_s, self.stop, MERGE_FRESH_COUNT, after),
                         daemon=True, name="fusionrag-heal").start()

    def __del__(self):
        index = getattr(self, "index", None)
        if index is not None:
            self.stop.set()
            index.close()


def _deployment(index_dir: str, name: str, actor_options: dict | None, loopback: bool, call_timeout_s: float | None,
                heal_every_s: float, keys: KeyRing | None = None, routers: int = 1, limits: Limits = DEFAULT_LIMITS):
    """The router as a Ray Serve deployment that serves create_app's routes. routers=1: one replica, which opens
    the index, starts the shards as Ray actors of its own and keeps the write maps. More: _led_deployment."""
    from ray import serve

    if routers > 1:
        return _led_deployment(index_dir, name, actor_options, loopback, call_timeout_s, heal_every_s, keys, routers,
                               limits)

    @serve.deployment(name=DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=64)
    @serve.ingress()
    class Router(_IndexOwner):
        def __init__(self):
            self._open(index_dir, loopback, actor_options, call_timeout_s)
            self._heal_every(heal_every_s)

        def __serve_build_asgi_app__(self):
            return create_app(ShardedCollection(self.index, name), keys, _replica_id(), limits)

    return Router.bind()


def _replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


def _on_leader(leader, timeout_s: float, method: str, *args):
    """Call a method of the leader's replica (a Serve deployment handle) and wait for its answer; the leader's own
    errors as it raised them (an InputError stays a 422), no answer (its replica is being replaced) as
    UnavailableError (503)."""
    from ray import exceptions as rex
    from ray.serve.exceptions import RayServeException

    try:
        return getattr(leader, method).remote(*args).result(timeout_s=timeout_s)
    except rex.RayTaskError as e:
        if isinstance(e.cause, FusionRAGError):
            raise e.cause from None
        raise
    except (rex.RayError, RayServeException, TimeoutError) as e:
        raise UnavailableError(f"the leading router did not answer ({type(e).__name__}): try again") from e


class ViewBoard:
    """The leader's latest view (ShardedIndex.view), where the router replicas read it: a plain Ray actor, so a
    follower's call before a search (before a round of them: ShardedFollower.sync) is one actor call rather than
    a Serve request through the leader (which cost the routers 3.7 ms and the leader 1.8 ms of CPU per query,
    bench/results/sharded/sharded_routers_handle.md). The leader sets it before it answers a write, so a search that
    starts after the answer reads a view that holds the write. It goes with the leader's replica that made it."""

    def __init__(self):
        self.view: dict | None = None

    def set(self, view: dict) -> None:
        v = self.view  # a newer view of the same leader, set concurrently, is not replaced by an older one
        if v is None or v["epoch"] != view["epoch"] or v["version"] < view["version"]:
            self.view = view

    def get(self, epoch: str | None, version: int) -> dict | None:
        v = self.view
        return None if v is None or (v["epoch"] == epoch and v["version"] == version) else v


def _led_deployment(index_dir: str, name: str, actor_options: dict | None, loopback: bool,
                    call_timeout_s: float | None, heal_every_s: float, keys: KeyRing | None, routers: int,
                    limits: Limits = DEFAULT_LIMITS):
    """`routers` replicas of the router (retriever/sharded/follow.py), and a leader: a deployment of one replica
    that opens the index, starts the shards as Ray actors of its own, keeps the write maps, restarts and merges
    shards, and does every write. Each router replica follows it: vector searches on the replica, with the
    leader's shards and write state (read from the leader's ViewBoard before each search, sent when changed),
    everything else on the leader."""
    import ray
    from ray import serve

    from fusionrag.retriever.sharded.follow import FollowerCollection, ShardedFollower

    leader_timeout_s = call_timeout_s or 30.0

    @serve.deployment(name=LEADER, num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    class Leader(_IndexOwner):
        def __init__(self):
            self._open(index_dir, loopback, actor_options, call_timeout_s)
            self.coll = ShardedCollection(self.index, name)
            self.board = ray.remote(ViewBoard).options(num_cpus=0).remote()
            self.published: tuple[str | None, int] = (None, -1)
            self.publishing = threading.Lock()
            self.publish()
            self._heal_every(heal_every_s, self.publish)

        def publish(self) -> None:
            """The index's view onto the board, where it changed since the last one published (in a thread)."""
            with self.publishing:
                view = self.index.view(*self.published)
                if view is not None:
                    ray.get(self.board.set.remote(view), timeout=leader_timeout_s)
                    self.published = (view["epoch"], view["version"])

        async def view_board(self):
            return self.board

        async def call(self, method: str, args: tuple, kwargs: dict):
            # In a thread of its own: the replica's event loop goes on meanwhile. The view published before the
            # answer (a write's, or a shard found down by a read).
            try:
                return await asyncio.to_thread(getattr(self.coll, method), *args, **kwargs)
            finally:
                await asyncio.to_thread(self.publish)

    @serve.deployment(name=DEPLOYMENT, num_replicas=routers, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=64)
    @serve.ingress()
    class Router:
        def __init__(self, leader):
            if loopback:
                _keep_replica_on_loopback()
            self.leader, self.board = leader, None
            # Serve runs this on the replica's event loop, where a handle's answer is not waited for: in a thread.
            with ThreadPoolExecutor(1) as pool:
                self.index = pool.submit(ShardedFollower.follow, index_dir, self._view,
                                         call_timeout_s=call_timeout_s).result()

        def _view(self, epoch: str | None, version: int) -> dict | None:
            """The leader's view from its board, if newer than (epoch, version); the board asked of the leader
            first, and again when it is gone (the leader's replica was replaced: a new board, a new epoch)."""
            for _ in range(2):
                if self.board is None:
                    self.board = _on_leader(self.leader, leader_timeout_s, "view_board")
                try:
                    return ray.get(self.board.get.remote(epoch, version), timeout=leader_timeout_s)
                except ray.exceptions.RayActorError:
                    self.board = None
                except ray.exceptions.GetTimeoutError as e:
                    raise UnavailableError("the leading router's view did not come: try again") from e
            raise UnavailableError("the leading router is being replaced: try again")

        def _call(self, method: str, args: tuple, kwargs: dict):
            return _on_leader(self.leader, leader_timeout_s, "call", method, args, kwargs)

        def __serve_build_asgi_app__(self):
            return create_app(FollowerCollection(self.index, name, self._call), keys, _replica_id(), limits)

        def __del__(self):
            index = getattr(self, "index", None)
            if index is not None:
                index.close()

    return Router.bind(Leader.bind())


def serve(address: str, index_dir, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
          actor_options: dict | None = None, proxy_location: str = "HeadOnly", call_timeout_s: float | None = 30.0,
          heal_every_s: float = 5.0, block: bool = True, keys: KeyRing | None = None, routers: int = 1,
          config: ServerConfig | None = None) -> str:
    """Serve the sharded index at index_dir over HTTP on host:port, from the Ray cluster at `address` (Ray Serve
    starts its controller and an HTTP proxy there; the proxy listens on host:port). name: the collection's name
    (default: the directory's). proxy_location: Serve's (HeadOnly: one HTTP proxy, on the head node; EveryNode
    where every node has its own address). call_timeout_s: a shard call not answered by then takes the shard for
    down (ShardedIndex.open). heal_every_s: how often the router checks its shards and restarts those that are down
    from their directories. keys: the API keys the /v1 routes require (server/auth.py; None: open), as
    `fusionrag serve` reads them (--api-keys-file, FUSIONRAG_API_KEYS). block: until SIGINT or SIGTERM, then the
    application is deleted and Serve shut down; else returns the base URL and leaves it running (serve.shutdown()
    stops it). routers: replicas of the router; more than one: a leader replica does every write and each router
    replica follows it (_led_deployment, retriever/sharded/follow.py). config: the service's settings, whose
    request limits (max_queries, max_documents, max_k, max_text_chars, max_body_bytes) every replica applies."""
    import ray
    from ray import serve as rserve

    from fusionrag.retriever.sharded.parts import is_sharded

    if isinstance(routers, bool) or not isinstance(routers, int) or routers < 1:
        raise InputError(f"routers must be a positive integer, got {routers!r}")
    index_dir = str(Path(index_dir).resolve())
    if not is_sharded(index_dir):
        raise InputError(f"{index_dir}: not a sharded index (build it with --shards)")
    name = name or Path(index_dir).name
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False,
                 **({"_node_ip_address": host} if host in ("127.0.0.1", "localhost") else {}))
    rserve.start(proxy_location=proxy_location, http_options={"host": host, "port": port})
    loopback = host in ("127.0.0.1", "localhost", "::1")
    limits = Limits.of(config) if config is not None else DEFAULT_LIMITS
    rserve.run(_deployment(index_dir, name, actor_options, loopback, call_timeout_s, heal_every_s, keys, routers,
                           limits),
               name="fusionrag",
               route_prefix="/")
    url = f"http://{host}:{port}"
    if not block:
        return url
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"fusionrag: serving {index_dir} as collection {name!r} on {url} (Ray Serve, cluster {address})",
          flush=True)
    stop.wait()
    rserve.delete("fusionrag")
    rserve.shutdown()
    return url


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fusionrag.server.ray_serve", description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True, help="the Ray cluster (host:port of its head)")
    ap.add_argument("--index", required=True, help="a sharded index directory every node sees")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--name", default=None, help="the collection's name (default: the directory's)")
    ap.add_argument("--routers", type=int, default=1, help="router replicas (more than one: they follow a leader)")
    a = ap.parse_args(argv)
    serve(a.address, a.index, a.host, a.port, a.name, routers=a.routers)


if __name__ == "__main__":
    main()
