"""`fusionrag serve --ray ADDRESS` (docs/sharded.md, "Serving on Ray"): one sharded index served over HTTP with the
router as a Ray Serve deployment and the shards as Ray actors.

The routes are the service's vector routes under the same paths and bodies (docs/api.md), for one collection named
after the index directory (or --name): search by vectors, upsert documents with vectors, delete by ids, list the
collection, health. Document ids are the index's integer ids written as strings (the built vectors' ids are their
rows in the source). Texts, metadata, filters and the text and hybrid modes need the doc store a collection has, and
a sharded index has not yet: they are refused with 422. A search that could not reach every list it needed says
which (`missing_lists` per query, `partial`); with `"partial": false` it is refused with 503 instead, as is a write
that needs a shard that is down.

    python -m fusionrag.server.ray_serve --address 127.0.0.1:6379 --index IDX [--host 127.0.0.1] [--port 8000]
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fusionrag.retriever.config import SearchParams
from fusionrag.retriever.errors import FusionRAGError, InputError, UnavailableError

DEPLOYMENT = "fusionrag-router"
log = logging.getLogger(__name__)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SearchBody(_Body):
    vectors: list[list[float]] | None = Field(None, min_length=1)
    texts: list[str] | None = None
    mode: str = "vector"
    k: int = Field(10, ge=1, le=1000)
    filter: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    stats: bool = False
    with_vectors: bool = False
    partial: bool = Field(True, description="false: 503 rather than an answer that misses lists of a down shard")


class DocumentBody(_Body):
    id: str = Field(min_length=1, max_length=20)
    vector: list[float]
    text: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class UpsertBody(_Body):
    documents: list[DocumentBody] = Field(min_length=1)


class DeleteBody(_Body):
    ids: list[str] = Field(min_length=1)


def _int_ids(ids: list[str]) -> np.ndarray:
    try:
        out = np.array([int(i) for i in ids], dtype=np.int64)
    except (ValueError, OverflowError):
        raise HTTPException(422, "a sharded index's document ids are non-negative integers (as strings)") from None
    if (out < 0).any():
        raise HTTPException(422, "a sharded index's document ids are non-negative integers (as strings)")
    return out


def create_app(index, name: str) -> FastAPI:
    """The HTTP routes over an opened ShardedIndex (`index`), as collection `name`. Thread-safe as the index is."""
    app = FastAPI(title="fusionrag (sharded, on Ray)")

    @app.exception_handler(FusionRAGError)
    async def engine_error(request: Request, exc: FusionRAGError):
        status = 503 if isinstance(exc, UnavailableError) else 422 if isinstance(exc, InputError) else 400
        return JSONResponse({"detail": str(exc)}, status_code=status)

    def collection(coll: str) -> None:
        if coll != name:
            raise HTTPException(404, f"no collection {coll!r} (this service serves {name!r})")

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz():
        alive = index.check_shards()
        body = {"status": "ready" if alive.all() else "degraded", "shards_alive": alive.tolist()}
        return JSONResponse(body, status_code=200 if alive.any() else 503)

    @app.get("/v1/collections")
    def collections():
        return {"collections": [{"name": name, "dim": index.dim, "metric": index.metric, "sharded": True,
                                 "shards": index.n_shards, "shards_alive": index.alive.tolist()}]}

    @app.post("/v1/collections/{coll}/search")
    async def search(coll: str, body: SearchBody):
        collection(coll)
        if body.mode != "vector" or body.texts is not None or body.filter is not None or body.with_vectors:
            raise HTTPException(422, "a sharded index is searched by vectors alone (no texts, filter, mode or "
                                     "with_vectors yet)")
        if body.vectors is None:
            raise HTTPException(422, "give 'vectors'")
        if any(len(v) != index.dim for v in body.vectors):
            raise HTTPException(422, f"query vectors must have dimension {index.dim}")
        try:
            params = SearchParams().with_overrides(**(body.params or {}))
        except TypeError as e:
            raise HTTPException(422, f"unknown tuning parameter: {e}") from None
        q = np.asarray(body.vectors, dtype=np.float32)
        res = await run_in_threadpool(index.search, q, body.k, params, partial=body.partial)
        hits = [[{"id": str(int(i)), "score": -float(d), "distance": float(d), "text": None, "metadata": {}}
                 for i, d in zip(ids, ds) if i >= 0] for ids, ds in zip(res.ids, res.distances)]
        out: dict = {"results": hits, "partial": res.partial}
        if res.partial:
            out["missing_lists"] = [m.tolist() for m in res.missing_lists]
            out["missing_shards"] = res.missing_shards
        if body.stats:
            out["stats"] = [{key: int(v[i]) for key, v in res.stats.items()} for i in range(len(q))]
        return out

    @app.post("/v1/collections/{coll}/documents")
    async def upsert(coll: str, body: UpsertBody):
        collection(coll)
        if any(d.text is not None or d.metadata for d in body.documents):
            raise HTTPException(422, "a sharded index stores vectors alone (no text or metadata yet)")
        ids = _int_ids([d.id for d in body.documents])
        if any(len(d.vector) != index.dim for d in body.documents):
            raise HTTPException(422, f"vectors must have dimension {index.dim}")
        vectors = np.asarray([d.vector for d in body.documents], dtype=np.float32)
        await run_in_threadpool(index.upsert, ids, vectors)
        return {"ids": [d.id for d in body.documents]}

    @app.post("/v1/collections/{coll}/documents/delete")
    async def delete(coll: str, body: DeleteBody):
        collection(coll)
        return {"deleted": await run_in_threadpool(index.delete, _int_ids(body.ids))}

    return app


def _keep_replica_on_loopback() -> None:
    """Ray Serve 2.60's replica opens its inter-deployment gRPC server on every interface ("[::]:0",
    ray/serve/_private/replica.py), whatever the HTTP host; when the service is to listen on loopback alone, that
    server is bound to 127.0.0.1 instead (this deployment calls no other, so nothing dials it from elsewhere).
    Runs in the replica, before Serve starts that server."""
    from ray.serve._private import replica

    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "loopback", False):
        return

    def on_loopback(server, address):
        return add_port(server, "127.0.0.1:0" if address == "[::]:0" else address)

    on_loopback.loopback = True
    replica.add_port_to_grpc_server = on_loopback


def _keep_healthy(index, every_s: float, stop: threading.Event) -> None:
    """Every every_s: ask each shard whether it runs, and restart those that do not from their directories."""
    while not stop.wait(every_s):
        try:
            index.check_shards()
            index.heal()
        except Exception:  # noqa: BLE001 - the next round tries again
            log.warning("fusionrag: checking the shards failed", exc_info=True)


def _deployment(index_dir: str, name: str, actor_options: dict | None, loopback: bool, call_timeout_s: float | None,
                heal_every_s: float):
    """The router as a Ray Serve deployment: one replica (the router keeps the write maps) that opens the index,
    the shards as Ray actors of its own, and serves create_app's routes."""
    from ray import serve

    from fusionrag.retriever.sharded import ShardedIndex

    @serve.deployment(name=DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=64)
    @serve.ingress()
    class Router:
        def __init__(self):
            if loopback:
                _keep_replica_on_loopback()
            self.index = ShardedIndex.open(index_dir, ray=True, actor_options=actor_options,
                                           call_timeout_s=call_timeout_s)
            self.stop = threading.Event()
            threading.Thread(target=_keep_healthy, args=(self.index, heal_every_s, self.stop), daemon=True,
                             name="fusionrag-heal").start()

        def __serve_build_asgi_app__(self):
            return create_app(self.index, name)

        def __del__(self):
            index = getattr(self, "index", None)
            if index is not None:
                self.stop.set()
                index.close()

    return Router.bind()


def serve(address: str, index_dir, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
          actor_options: dict | None = None, proxy_location: str = "HeadOnly", call_timeout_s: float | None = 30.0,
          heal_every_s: float = 5.0, block: bool = True) -> str:
    """Serve the sharded index at index_dir over HTTP on host:port, from the Ray cluster at `address` (Ray Serve
    starts its controller and an HTTP proxy there; the proxy listens on host:port). name: the collection's name
    (default: the directory's). proxy_location: Serve's (HeadOnly: one HTTP proxy, on the head node; EveryNode
    where every node has its own address). call_timeout_s: a shard call not answered by then takes the shard for
    down (ShardedIndex.open). heal_every_s: how often the router checks its shards and restarts those that are down
    from their directories. block: until SIGINT or SIGTERM, then the application is deleted and Serve shut
    down; else returns the base URL and leaves it running (serve.shutdown() stops it)."""
    import ray
    from ray import serve as rserve

    from fusionrag.retriever.sharded import is_sharded

    index_dir = str(Path(index_dir).resolve())
    if not is_sharded(index_dir):
        raise InputError(f"{index_dir}: not a sharded index (build it with --shards)")
    name = name or Path(index_dir).name
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False,
                 **({"_node_ip_address": host} if host in ("127.0.0.1", "localhost") else {}))
    rserve.start(proxy_location=proxy_location, http_options={"host": host, "port": port})
    loopback = host in ("127.0.0.1", "localhost", "::1")
    rserve.run(_deployment(index_dir, name, actor_options, loopback, call_timeout_s, heal_every_s), name="fusionrag",
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
    a = ap.parse_args(argv)
    serve(a.address, a.index, a.host, a.port, a.name)


if __name__ == "__main__":
    main()
