"""A real fusionrag service (uvicorn on a free loopback port, in a thread of the test process) for
the integrations' remote-mode tests, and the service over each backend a collection's routes run on
(serving_backend, BACKENDS) for the server tests that run on every one."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import numpy as np
import uvicorn

from fusionrag.retriever.engine.config import BuildConfig
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


# The backends a collection's routes are served by (#69 item 1), for the tests that run on each of them:
# The backends a collection's routes are served by (#69 item 1), for the tests that run on each of them: "single"
# (a collection), "sharded" (a sharded collection with its shards in the service's process, served by the app every
# Ray Serve router replica builds: ray_serve.replica_app over a ShardedCatalog) and "hosted" (a sharded collection in
# the service's data directory, created with a shard count and built by its first import: retriever/sharded/hosted.py).
# Each is the service's own app under uvicorn in a thread of the test process, spoken to over real HTTP.
#
# The OpenAI vector stores' tests run on no sharded backend: a store is always a single collection the service
# makes for itself (server/vector_stores.py creates each as a plain cosine collection, never with shards), so their
# tests (test_openai_vector_stores.py, test_vector_store_ranking.py) have no sharded backend to run on; the sharded
# service refuses the stores' routes with 405 (test_api_backends.py, test_what_only_a_collection_does).
BACKENDS = ("single", "sharded", "hosted")


@contextlib.contextmanager
def serving_backend(kind: str, root: Path, name: str, config: ServerConfig, vectors: np.ndarray, *,
                    documents: Sequence[dict] | None = None, metric: str = "l2", embedding: str | None = None,
                    keys=None, headers: dict | None = None, shards: int = 3,
                    build: BuildConfig | None = None) -> Iterator[str]:
    """The service (config, keys) holding collection `name` (metric; embedding: the model that made the vectors)
    on backend `kind` (BACKENDS), its base URL while the block runs. Its documents are the rows of `vectors`, named
    "0", "1", ... or, with `documents` (one {"id", "text", "metadata"} per row), those; all of them in the index:
    the collection merged after its writes, the sharded ones built with them (build: the sharded build's settings;
    `shards` shards). root: a fresh folder of the test's for the files."""
    headers = headers or {}
    n = len(vectors)
    rows = [{"id": str(i)} for i in range(n)] if documents is None else [dict(d) for d in documents]
    assert len(rows) == n
    create = {"name": name, "dimension": int(vectors.shape[1]), "metric": metric,
              **({"embedding": embedding} if embedding else {})}
    if kind == "sharded":
        sidecar = None
        if documents is not None:
            sidecar = root / "documents.jsonl"
            sidecar.write_text("".join(json.dumps(d) + "\n" for d in rows))
        from fusionrag.retriever.sharded.build import build_sharded

        build_sharded(np.asarray(vectors, dtype=np.float32), root / "built", shards,
                      build or BuildConfig(threads=1, metric=metric), progress=False,
                      documents=None if sidecar is None else str(sidecar), embedding=embedding)
        with serving_sharded(root / "built", root / "idx", name, config, keys) as (url, _):
            yield url
        return
    app = create_app(config, keys=keys)
    with serving(app) as url:
        body = {**create, "shards": shards} if kind == "hosted" else create
        r = httpx.post(f"{url}/v1/collections", json=body, headers=headers)
        assert r.status_code == 201, r.text
        if kind == "single":
            step = config.max_documents
            for lo in range(0, n, step):
                docs = [{**d, "vector": v.tolist()} for d, v in zip(rows[lo:lo + step], vectors[lo:lo + step])]
                r = httpx.post(f"{url}/v1/collections/{name}/documents", json={"documents": docs}, headers=headers,
                               timeout=60)
                assert r.status_code == 200, r.text
            app.state.fusionrag.catalog.get(name).merge()  # searched through its index, as the shards are
        else:
            if documents is None:  # a vector file: its rows are "0", "1", ...
                buf = io.BytesIO()
                np.save(buf, np.asarray(vectors, dtype=np.float32))
                r = httpx.post(f"{url}/v1/collections/{name}/import", files={"vectors": ("base.npy", buf.getvalue())},
                               headers=headers, timeout=60)
            else:
                lines = "".join(json.dumps({**d, "vector": v.tolist()}) + "\n" for d, v in zip(rows, vectors))
                r = httpx.post(f"{url}/v1/collections/{name}/import", content=lines.encode(),
                               headers={**headers, "Content-Type": "application/x-ndjson"}, timeout=60)
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + 120
            while (state := httpx.get(f"{url}/v1/collections/{name}", headers=headers).json()["build_state"]
                   ["import"])["state"] in ("uploading", "running"):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert state["state"] == "done", state
        assert httpx.get(f"{url}/v1/collections/{name}", headers=headers).json()["count"] == n
        yield url


def drop_collection(url: str, name: str) -> None:
    """Remove a collection the test made (a store's delete-all keeps the collection itself)."""
    r = httpx.delete(f"{url}/v1/collections/{name}", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code in (200, 404), r.text


@contextlib.contextmanager
def serving_filled_backend(kind: str, root: Path, config: ServerConfig, name: str, dim: int, first: list[dict],
                           rest: list) -> Iterator[tuple[str, object]]:
    """serving_filled on backend `kind` (BACKENDS): "single" and "hosted" are serving_filled's "single" and
    "sharded" (2 shards, built by its import); "sharded" is the documents `first` (as the API takes them, each with
    its vector) built by build_sharded (2 shards, l2) as a collection's import builds them, served in this process
    by the app every Ray Serve router replica builds (serving_sharded), then `rest` (client Documents) written
    after, fresh. root: a fresh folder of the test's for the files. (base URL, a Client) while the block runs."""
    if kind in ("single", "hosted"):
        with serving_filled(config, "single" if kind == "single" else "sharded", name, dim, first, rest) as got:
            yield got
        return
    assert kind == "sharded", kind
    from fusionrag.client import Client
    from fusionrag.retriever.sharded.build import build_sharded

    lines = root / "first.jsonl"
    lines.write_text("".join(json.dumps(d) + "\n" for d in first))
    build_sharded(None, root / "built", 2, BuildConfig(threads=1, metric="l2"), progress=False, documents=str(lines))
    with serving_sharded(root / "built", root / "idx", name, config) as (url, _), Client(url) as c:
        c.upsert(name, rest)
        assert c.count(name) == len(first) + len(rest)
        yield url, c
