"""A real fusionrag service (uvicorn on a free loopback port, in a thread of the test process) for
the integrations' remote-mode tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn

from fusionrag.server.app import create_app
from fusionrag.server.config import ServerConfig

API_KEY = "integration-test-key"


@contextlib.contextmanager
def running_service(data_dir: Path, **config) -> Iterator[str]:
    """The service's base URL while the block runs; it requires API_KEY and serves no demo."""
    cfg = ServerConfig(data_dir=str(data_dir), demo=False, api_keys=API_KEY, log_level="warning", **config)
    with serving(create_app(cfg)) as url:
        yield url


@contextlib.contextmanager
def serving(app, lifespan: str = "on") -> Iterator[str]:
    """An ASGI app served by uvicorn on a free loopback port, in a thread: its base URL while the block runs."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert thread.is_alive(), "the service died while starting"
            assert time.monotonic() < deadline, "the service was not ready within 60 s"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def serving_filled(config: ServerConfig, kind: str, name: str, dim: int, first: list[dict],
                   rest: list) -> Iterator[tuple[str, object]]:
    """The service (config) holding collection `name` (l2): kind "single", `first` (documents as the API takes
    them) written and merged into its index, or "sharded" (2 shards), `first` built by its import; then `rest`
    (client Documents) written after, fresh. (base URL, a Client) while the block runs."""
    import json

    from fusionrag.client import Client

    app = create_app(config)
    with serving(app) as url, Client(url) as c:
        body = {"name": name, "dimension": dim, "metric": "l2"}
        if kind == "sharded":
            body["shards"] = 2
        assert httpx.post(f"{url}/v1/collections", json=body).status_code == 201
        if kind == "sharded":  # built by its import, then written to
            lines = "".join(json.dumps(d) + "\n" for d in first)
            r = httpx.post(f"{url}/v1/collections/{name}/import", content=lines.encode(),
                           headers={"Content-Type": "application/x-ndjson"}, timeout=60)
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + 120
            while c.info(name).build_state["import"]["state"] in ("uploading", "running"):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert c.info(name).build_state["import"]["state"] == "done", c.info(name).build_state
        else:
            c.upsert(name, first)
            app.state.fusionrag.catalog.get(name).merge()  # `first` in the index, the rest fresh
        c.upsert(name, rest)
        assert c.count(name) == len(first) + len(rest)
        yield url, c


@contextlib.contextmanager
def serving_sharded(built: Path, at: Path, name: str, config: ServerConfig | None = None,
                    keys=None) -> Iterator[tuple[str, object]]:
    """A copy (at `at`) of the sharded index built at `built`, opened with its shards in this process and served as
    collection `name` by the app every Ray Serve router replica builds (ray_serve.replica_app, the service's own
    over a ShardedCatalog): (base URL, the ShardedCollection) while the block runs. The copy keeps the built index
    as it was for other fixtures."""
    import shutil

    from fusionrag.retriever.sharded.docs import ShardedCollection
    from fusionrag.retriever.sharded.router import ShardedIndex
    from fusionrag.server.ray_serve import replica_app

    shutil.copytree(built, at)
    coll = ShardedCollection(ShardedIndex.open(at), name)
    try:
        with serving(replica_app(coll, config, keys)) as url:
            yield url, coll
    finally:
        coll.close()


def drop_collection(url: str, name: str) -> None:
    """Remove a collection the test made (a store's delete-all keeps the collection itself)."""
    r = httpx.delete(f"{url}/v1/collections/{name}", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code in (200, 404), r.text
