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
