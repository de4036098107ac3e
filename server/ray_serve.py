"""`fusionrag serve --ray ADDRESS` (docs/sharded.md, "Serving on Ray"): one sharded index served over HTTP with the
router as a Ray Serve deployment and the shards as Ray actors.

Every router replica serves the service's own app (server/app.py, built from the user's ServerConfig: the same
routes, limits, API keys, error codes and bodies as `fusionrag serve`) over one collection named after the index
directory (or --name): a ShardedCatalog (retriever/sharded/catalog.py) of a ShardedCollection (retriever/sharded/
docs.py). Documents carry their vectors (nothing is embedded); hybrid search needs the query vectors beside the
texts; creating, dropping, restoring and snapshotting a collection, importing into it and the OpenAI vector stores
are refused (409/422/405). A search that could not reach every list it needed says which (`missing_lists` per
query, `partial`); with `"partial": false` it is refused with 503 instead, as is a write, a get, a filter or a page
that needs a shard that is down. /readyz adds each shard's liveness (`shards_alive`, `degraded`).

    python -m fusionrag.server.ray_serve --address 127.0.0.1:6379 --index IDX [--host 127.0.0.1] [--port 8000]
        [--routers N]

With --routers N above 1, N router replicas run vector searches and follow a leader replica that does the writes
(_led_deployment, retriever/sharded/follow.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI

from fusionrag.retriever.collection import NAME_RE, CollectionConfig
from fusionrag.retriever.errors import FusionRAGError, InputError, UnavailableError
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.server.auth import KeyRing
from fusionrag.server.config import ServerConfig

DEPLOYMENT = "fusionrag-router"
LEADER = "fusionrag-leader"  # with more than one router replica: the one that writes (_led_deployment)
log = logging.getLogger(__name__)




def replica_app(coll: ShardedCollection, config: ServerConfig | None = None, keys: KeyRing | None = None,
                router: str | None = None) -> FastAPI:
    """The service's own app (server/app.py) over one sharded collection (a ShardedCatalog): the same routes,
    limits (the user's ServerConfig), keys, errors and bodies as `fusionrag serve`; router: this replica's id,
    sent back in the header x-fusionrag-router."""
    from fusionrag.retriever.sharded.catalog import ShardedCatalog
    from fusionrag.server.app import create_app

    return create_app(config or ServerConfig(demo=False), ShardedCatalog(coll),
                      keys if keys is not None else KeyRing([]), {"x-fusionrag-router": router} if router else None)


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


def keep_healthy(index, every_s: float, stop: threading.Event, config: CollectionConfig | None = None,
                  after=None) -> None:
    """Every every_s: ask each shard whether it runs, restart those that do not from their directories, and, once
    a merge is due by a collection's rule over all the shards (CollectionConfig.shard_merge, as a sharded
    collection in a data directory merges), merge each shard holding its share (searches and writes go on); then
    call after() (where given)."""
    config = config or CollectionConfig()
    while not stop.wait(every_s):
        try:
            index.check_shards()
            index.heal()
            share = config.shard_merge(len(index.fresh_owner), len(index.base_gone), index.n_shards)
            if share is not None:
                index.merge_shards(min_fresh=share)
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

    def _open(self, index_dir: str, loopback: bool, actor_options: dict | None, call_timeout_s: float | None,
              config: ServerConfig | None) -> None:
        """config: the service's settings, whose engine flags (--buffer-mb, --raw-in-ram, ...) every shard actor
        opens its part with (each its own process: the whole --buffer-mb each, where shards in one process share
        it); None: the engine's defaults."""
        from fusionrag.retriever.sharded.router import ShardedIndex
        from fusionrag.server.life import engine_config

        if loopback:
            _keep_replica_on_loopback()
        engine = engine_config(config) if config is not None else None
        self.index = ShardedIndex.open(index_dir, engine, ray=True, actor_options=actor_options,
                                       call_timeout_s=call_timeout_s)
        self.stop = threading.Event()

    def _heal_every(self, every_s: float, after=None) -> None:
        threading.Thread(target=keep_healthy, args=(self.index, every_s, self.stop, None, after),
                         daemon=True, name="fusionrag-heal").start()

    def __del__(self):
        index = getattr(self, "index", None)
        if index is not None:
            self.stop.set()
            index.close()


def _deployment(index_dir: str, name: str, actor_options: dict | None, loopback: bool, call_timeout_s: float | None,
                heal_every_s: float, keys: KeyRing | None = None, routers: int = 1, config: ServerConfig | None = None):
    """The router as a Ray Serve deployment that serves the service's app (replica_app). routers=1: one replica,
    which opens the index, starts the shards as Ray actors of its own and keeps the write maps. More:
    _led_deployment."""
    from ray import serve

    if routers > 1:
        return _led_deployment(index_dir, name, actor_options, loopback, call_timeout_s, heal_every_s, keys, routers,
                               config)

    @serve.deployment(name=DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=64)
    @serve.ingress()
    class Router(_IndexOwner):
        def __init__(self):
            self._open(index_dir, loopback, actor_options, call_timeout_s, config)
            self._heal_every(heal_every_s)

        def __serve_build_asgi_app__(self):
            return replica_app(ShardedCollection(self.index, name), config, keys, _replica_id())

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
                    config: ServerConfig | None = None):
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
            self._open(index_dir, loopback, actor_options, call_timeout_s, config)
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
            return replica_app(FollowerCollection(self.index, name, self._call), config, keys, _replica_id())

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
    request limits (max_queries, max_documents, max_k, max_text_chars, max_body_bytes) every replica applies, and
    whose engine flags (--buffer-mb, --raw-in-ram, --filter-tier, ...) the shard actors open their parts with."""
    import ray
    from ray import serve as rserve

    from fusionrag.retriever.sharded.parts import is_sharded

    if isinstance(routers, bool) or not isinstance(routers, int) or routers < 1:
        raise InputError(f"routers must be a positive integer, got {routers!r}")
    index_dir = str(Path(index_dir).resolve())
    if not is_sharded(index_dir):
        raise InputError(f"{index_dir}: not a sharded index (build it with --shards)")
    name = name or Path(index_dir).name
    if not NAME_RE.fullmatch(name):  # every route would answer 400 for it
        raise InputError(f"{name!r} is no collection name: give --name (1-64 letters, digits, '_', '.' or '-')")
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False,
                 **({"_node_ip_address": host} if host in ("127.0.0.1", "localhost") else {}))
    rserve.start(proxy_location=proxy_location, http_options={"host": host, "port": port})
    loopback = host in ("127.0.0.1", "localhost", "::1")
    rserve.run(_deployment(index_dir, name, actor_options, loopback, call_timeout_s, heal_every_s, keys, routers,
                           config),
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
