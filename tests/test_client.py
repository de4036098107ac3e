"""fusionrag.client against the real service: sync and async give the same answers, searches go through a built
index (SSD tier read, results checked against exact search), results are the engine's types and errors its
classes; reads are retried after a 503 with Retry-After and writes never are; and the remote stores read
in one request where they made one per document."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from server_util import ServerProcess

from fusionrag.client import AsyncClient, AuthError, Client, CollectionInfo, Document, Hit, RemoteError
from fusionrag.retriever.collection import Catalog, CollectionConfig
from fusionrag.retriever.errors import ConflictError, InputError, NotFoundError, StorageError, UnavailableError

ADMIN = "admin-key-0123456789"
TEAM = "team-key-0123456789"
N, DIM = 3000, 16


def _data() -> np.ndarray:
    rng = np.random.default_rng(7)
    centers = rng.standard_normal((30, DIM)).astype(np.float32) * 4
    return (centers[rng.integers(30, size=N)] + rng.standard_normal((N, DIM)).astype(np.float32)).astype(np.float32)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """`team-vec`: N vectors merged into a built index (min_index_count 200) before the service starts; and a
    collection whose files are broken, so that it fails to open. Keys: every collection; team-* only."""
    root = tmp_path_factory.mktemp("client")
    data = _data()
    cat = Catalog(root / "data", collection_config=CollectionConfig(min_index_count=200))
    try:
        col = cat.create("team-vec", DIM, "l2")
        col.upsert([Document(f"v{i}", f"vector {i}", data[i], {"i": i, "half": i % 2}) for i in range(N)])
        col.merge(progress=False)
        assert col.info()["build_state"]["indexed"] == N
        cat.create("team-broken", DIM, "l2")
    finally:
        cat.close()
    (root / "data" / "collections" / "team-broken" / "collection.json").write_text("{")
    (root / "keys").write_text(f"{ADMIN}\n{TEAM} team-*\n")
    srv = ServerProcess(root / "data", root / "server.log", "--no-demo", "--min-index-count", "200",
                        "--api-keys-file", str(root / "keys"))
    try:
        srv.wait_ready()
        yield srv, data
    finally:
        srv.stop()


def _exact(data: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    d = ((queries[:, None, :].astype(np.float64) - data[None, :, :]) ** 2).sum(-1)
    return np.argsort(d, axis=1)[:, :k]


def test_search_goes_through_the_built_index_and_matches_exact_search(service):
    srv, data = service
    queries = data[::150] + np.random.default_rng(1).standard_normal((N // 150, DIM)).astype(np.float32) * 0.1
    with Client(srv.url, TEAM) as client:
        info = client.info("team-vec")
        assert isinstance(info, CollectionInfo) and (info.count, info.dimension, info.metric) == (N, DIM, "l2")
        assert info.build_state["indexed"] == N and info.build_state["fresh"] == 0 and info.tiers["ssd_bytes"] > 0
        res = client.search("team-vec", queries, k=10, stats=True, with_vectors=True)
    assert len(res.hits) == len(queries) and all(isinstance(h, Hit) for q in res.hits for h in q)
    # Through the index: its exact re-rank scored every query's candidates (from the raw vectors in RAM, which
    # the default budget holds here, or from the SSD).
    assert all(s["reranked"] > 0 and s["lists_probed"] > 0 and not s["filtered_exact"] for s in res.stats)
    truth = _exact(data, queries, 10)
    found = [[int(h.id[1:]) for h in q] for q in res.hits]
    recall = np.mean([len(set(f) & set(t.tolist())) / 10 for f, t in zip(found, truth)])
    assert recall >= 0.9, recall
    for q, hits in zip(queries, res.hits):
        dist = [h.distance for h in hits]
        assert dist == sorted(dist)
        for h in hits:
            assert np.array_equal(h.vector, data[int(h.id[1:])])  # the stored vector, exactly
            assert h.distance == pytest.approx(float(((q - h.vector) ** 2).sum()), rel=1e-4, abs=1e-4)

    async def same_async():
        async with AsyncClient(srv.url, TEAM) as client:
            return await client.search("team-vec", queries, k=10, with_vectors=True)

    again = asyncio.run(same_async())
    assert [[(h.id, h.distance) for h in q] for q in again.hits] == [[(h.id, h.distance) for h in q] for q in res.hits]


def test_documents_written_read_paged_and_deleted(service):
    srv, data = service
    with Client(srv.url, ADMIN) as client:
        client.create_collection("team-rw", 4, metric="l2")
        docs = [Document(f"w{i}", f"text {i}", np.full(4, i, np.float32), {"i": i, "even": i % 2 == 0})
                for i in range(30)]
        assert client.upsert("team-rw", docs) == [d.id for d in docs]
        got = client.get("team-rw", ["w7", "nope", "w3"], with_vectors=True)
        assert [d.id for d in got] == ["w7", "w3"] and np.array_equal(got[0].vector, np.full(4, 7, np.float32))
        assert got[1].text == "text 3" and got[1].metadata == {"i": 3, "even": False}
        seen, cursor = [], None
        while True:
            page = client.scroll("team-rw", limit=4, cursor=cursor, filter={"even": True})
            seen += [d.id for d in page.documents]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert seen == [f"w{i}" for i in range(0, 30, 2)]
        assert client.delete("team-rw", filter={"i": {"$gte": 20}}) == 10
        assert client.delete("team-rw", ["w0", "w1", "nope"]) == 2
        assert client.info("team-rw").count == 18
        hits = client.search("team-rw", [5, 5, 5, 5], k=2).hits[0]
        assert [h.id for h in hits] == ["w5", "w4"] or [h.id for h in hits] == ["w5", "w6"]
        assert {c.name for c in client.collections()} >= {"team-rw", "team-vec", "team-broken"}
        client.drop_collection("team-rw")
        with pytest.raises(NotFoundError):
            client.info("team-rw")


def test_upsert_splits_what_exceeds_a_request_into_batches_with_progress(service):
    """#49: upsert refused more than max_documents in one call; now it sends batches of at most batch_size
    documents and about batch_bytes of JSON, in order, reporting progress; an error stops at its batch, the ones
    before it written. The service is run with --max-documents 1024 (its default): 3,000 documents go in 3+."""
    srv, _ = service
    rng = np.random.default_rng(3)
    docs = [Document(f"b{i}", f"text {i}", rng.standard_normal(4).astype(np.float32), {"i": i}) for i in range(3000)]
    with Client(srv.url, ADMIN) as client:
        client.create_collection("team-batched", 4, metric="l2")
        progress = []
        assert client.upsert("team-batched", docs, on_progress=lambda done, n: progress.append((done, n))) == \
            [d.id for d in docs]
        assert progress[-1] == (3000, 3000) and len(progress) == 6  # UPSERT_BATCH 512
        assert client.count("team-batched") == 3000
        progress.clear()
        ids = client.upsert("team-batched", docs[:100], batch_bytes=2000, on_progress=lambda d, n: progress.append(d))
        assert ids == [d.id for d in docs[:100]] and len(progress) >= 100 * 90 // 2000 and progress[-1] == 100
        bad = docs[:10] + [Document("bad", "t", [1.0, 2.0])] + docs[10:20]  # the 2nd batch holds a wrong dimension
        with pytest.raises(InputError, match="dimension"):
            client.upsert("team-batched", bad, batch_size=10)
        assert client.upsert("team-batched", []) == []
        with pytest.raises(InputError, match="positive"):
            client.upsert("team-batched", docs[:1], batch_size=0)
        client.drop_collection("team-batched")


def test_snapshot_download_restore_and_import_through_the_client(service, tmp_path):
    """#49: the client's snapshot, list, download, restore, delete and import calls (files streamed both ways), on
    the real service; sync and async alike. The restored collection answers as the original; the imports (JSON
    lines alone, and a vector file with its JSON-lines sidecar) land in the collection's info."""
    srv, _ = service
    rng = np.random.default_rng(4)
    vecs = rng.standard_normal((50, 4)).astype(np.float32)
    with Client(srv.url, ADMIN) as client:
        client.create_collection("team-snap", 4, metric="l2")
        client.upsert("team-snap", [Document(f"s{i}", f"t{i}", vecs[i], {"i": i}) for i in range(50)])
        taken = client.snapshot("team-snap")
        assert taken["id"] in [s["id"] for s in client.snapshots("team-snap")]
        path = client.download_snapshot("team-snap", taken["id"], tmp_path / "snap.tar")
        assert path == tmp_path / "snap.tar" and path.stat().st_size > 0 and not (tmp_path / "snap.tar.part").exists()
        with pytest.raises(NotFoundError):
            client.download_snapshot("team-snap", "20990101T000000Z-00000000", tmp_path / "none.tar")
        assert not (tmp_path / "none.tar").exists()
        restored = client.restore("team-snap-copy", path)
        assert restored.name == "team-snap-copy" and restored.count == 50
        q = vecs[7]
        assert [h.id for h in client.search("team-snap-copy", q, k=3).hits[0]] == \
            [h.id for h in client.search("team-snap", q, k=3).hits[0]]
        client.delete_snapshot("team-snap", taken["id"])
        assert taken["id"] not in [s["id"] for s in client.snapshots("team-snap")]
        lines = tmp_path / "docs.jsonl"
        lines.write_text("".join(json.dumps({"id": f"j{i}", "text": f"line {i}", "vector": vecs[i].tolist()}) + "\n"
                                 for i in range(20)))
        client.create_collection("team-import", 4, metric="l2")
        started = client.import_documents("team-import", lines)
        assert started["files"]["documents"] == lines.stat().st_size
        np.save(tmp_path / "v.npy", vecs[:20])
        side = tmp_path / "side.jsonl"
        side.write_text("".join(json.dumps({"id": f"n{i}", "metadata": {"i": i}}) + "\n" for i in range(20)))
        client.create_collection("team-import2", 4, metric="l2")
        assert set(client.import_documents("team-import2", side, tmp_path / "v.npy")["files"]) == {"documents",
                                                                                                   "vectors"}
        for name in ("team-import", "team-import2"):
            for _ in range(300):
                state = (client.info(name).build_state or {}).get("import") or {}
                if state.get("state") in ("done", "failed"):
                    break
                time.sleep(0.1)
            assert state.get("state") == "done" and client.count(name) == 20, (name, state)
        assert client.get("team-import2", ["n3"])[0].metadata == {"i": 3}

    async def async_calls():
        async with AsyncClient(srv.url, ADMIN) as client:
            taken = await client.snapshot("team-snap")
            path = await client.download_snapshot("team-snap", taken["id"], tmp_path / "async.tar")
            info = await client.restore("team-snap-async", path)
            return path, info

    path, info = asyncio.run(async_calls())
    assert path.read_bytes()[:100] and info.count == 50
    with Client(srv.url, ADMIN) as client:
        for name in ("team-snap", "team-snap-copy", "team-snap-async", "team-import", "team-import2"):
            client.drop_collection(name)


def test_a_dict_in_the_vector_slot_is_refused_with_a_clear_error():
    with pytest.raises(InputError, match="third field is the vector"):
        Document("a", "text", {"lang": "en"})


def test_errors_are_the_engines_classes_with_the_status(service, tmp_path):
    srv, _ = service
    cat = Catalog(tmp_path)
    try:
        with pytest.raises(NotFoundError) as embedded:
            cat.get("team-missing")
    finally:
        cat.close()
    with Client(srv.url, TEAM, max_retry_wait=1) as client:
        with pytest.raises(NotFoundError) as remote:
            client.info("team-missing")
        assert remote.value.status == 404 and str(remote.value) == str(embedded.value)
        with pytest.raises(InputError, match="dimension 3") as e:
            client.search("team-vec", [1, 2, 3])
        assert e.value.status == 422
        with pytest.raises(ConflictError) as e:
            client.create_collection("team-vec", DIM)
        assert e.value.status == 409
        with pytest.raises(AuthError) as e:
            client.info("other")
        assert e.value.status == 403 and isinstance(e.value, RemoteError)
        start = time.monotonic()
        with pytest.raises(UnavailableError, match="failed to open") as e:  # Retry-After 5 > max_retry_wait
            client.search("team-broken", np.zeros(DIM))
        assert e.value.status == 503 and time.monotonic() - start < 4
        with pytest.raises(InputError, match="exactly one of ids and filter"):
            client.delete("team-vec")
    with Client(srv.url, "wrong-key-0123456789") as client, pytest.raises(AuthError, match="HTTP 401"):
        client.collections()


def _flaky(statuses: list[int], retry_after: str | None = "0"):
    """A transport answering each request with the next status (then 200), and the requests it saw."""
    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status = statuses[len(seen) - 1] if len(seen) <= len(statuses) else 200
        if status == 200:
            return httpx.Response(200, json={"collections": [], "ids": ["a"]})
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        return httpx.Response(status, json={"detail": f"status {status}"}, headers=headers)
    return handle, seen


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_reads_are_retried_after_a_503_with_retry_after_and_writes_never(mode):
    def call(statuses, method, retries=2, retry_after="0", max_retry_wait=30.0):
        handle, seen = _flaky(statuses, retry_after)
        kw = dict(api_key="k-0123456789", retries=retries, max_retry_wait=max_retry_wait)
        if mode == "sync":
            with Client("http://svc", transport=httpx.MockTransport(handle), **kw) as c:
                try:
                    return getattr(c, method)(*ARGS[method]), seen
                except Exception as e:  # noqa: BLE001 - handed to the test
                    return e, seen

        async def run():
            async with AsyncClient("http://svc", transport=httpx.MockTransport(handle), **kw) as c:
                try:
                    return await getattr(c, method)(*ARGS[method]), seen
                except Exception as e:  # noqa: BLE001
                    return e, seen
        return asyncio.run(run())

    ARGS = {"collections": (), "upsert": ("c", [Document("a", "t", [1.0])])}
    result, seen = call([503, 503], "collections")
    assert result == [] and len(seen) == 3 and seen[0].headers["authorization"] == "Bearer k-0123456789"
    result, seen = call([503, 503], "collections", retries=1)
    assert isinstance(result, UnavailableError) and result.status == 503 and len(seen) == 2
    for statuses, kw in (([503], {}), ([503], {"retry_after": None}), ([503], {"retry_after": "60"})):
        method = "upsert" if not kw else "collections"  # a write; no Retry-After; one past max_retry_wait
        result, seen = call(statuses, method, **kw)
        assert isinstance(result, UnavailableError) and len(seen) == 1, (method, kw)
    result, seen = call([507], "upsert")
    assert isinstance(result, StorageError) and result.status == 507
    result, seen = call([500], "collections")
    assert type(result) is RemoteError and result.status == 500 and len(seen) == 1


def _counting(http: httpx.Client | httpx.AsyncClient) -> list:
    sent = []

    def hook(request):
        sent.append(f"{request.method} {request.url.path}")
    if isinstance(http, httpx.AsyncClient):
        async def ahook(request):
            hook(request)
        http.event_hooks["request"].append(ahook)
    else:
        http.event_hooks["request"].append(hook)
    return sent


def test_remote_stores_read_in_one_request(service):
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode

    from fusionrag.integrations.langchain import FusionRAGVectorStore
    from fusionrag.integrations.llamaindex import FusionRAGVectorStore as LlamaStore

    srv, _ = service
    store = FusionRAGVectorStore(embedding=DeterministicFakeEmbedding(size=8), url=srv.url, api_key=TEAM,
                                 collection="team-lc")
    try:
        ids = store.add_texts([f"text number {i}" for i in range(60)], ids=[f"t{i}" for i in range(60)])
        wanted = ids[::-1][:50]
        sent = _counting(store._backend._client._http)
        assert [d.id for d in store.get_by_ids(wanted)] == wanted
        assert sent == ["POST /v1/collections/team-lc/documents/get"]
        sent.clear()
        assert len(store.max_marginal_relevance_search("text number 3", k=4, fetch_k=20)) == 4
        assert sent == ["POST /v1/collections/team-lc/search"]  # the hits' vectors come with them

        async def aget():
            asent = _counting(store._backend._aclient()._http)
            return [d.id for d in await store.aget_by_ids(wanted)], asent

        got, asent = asyncio.run(aget())
        assert got == wanted and asent == ["POST /v1/collections/team-lc/documents/get"]
    finally:
        store.close()

    li = LlamaStore(url=srv.url, api_key=TEAM, collection="team-li")
    try:
        li.add([TextNode(id_=f"n{i}", text=f"node {i}", embedding=[float(i), 1.0], relationships={
            NodeRelationship.SOURCE: RelatedNodeInfo(node_id="doc-a" if i < 5 else "doc-b")}) for i in range(8)])
        sent = _counting(li.client._client._http)
        li.delete("doc-a")
        assert sent == ["POST /v1/collections/team-li/documents/delete"]  # one write, not a search then a delete
        assert sorted(n.node_id for n in li.get_nodes(node_ids=[f"n{i}" for i in range(8)])) == \
            [f"n{i}" for i in range(5, 8)]
    finally:
        li.close()


def test_small_things_a_user_reaches_for(service):
    """#67 item 6: upsert takes dicts as the API does; count says why a filter matched nothing (a misspelt field);
    help(Client.search) shows the operation's parameters; a service that is down raises the client's own error
    naming the URL, sync and async."""
    import inspect
    import socket
    import warnings

    from fusionrag.client import AsyncClient, UnreachableError

    srv, _ = service
    with Client(srv.url, ADMIN) as client:
        client.create_collection("team-small", 3, metric="l2")
        try:
            ids = client.upsert("team-small", [{"id": "a", "text": "x", "vector": [1, 0, 0], "metadata": {"g": 1}},
                                               Document("b", None, np.array([0, 1, 0], np.float32), {"g": 2})])
            assert ids == ["a", "b"]
            got = client.get("team-small", ["a"], with_vectors=True)[0]
            assert got.text == "x" and got.metadata == {"g": 1} and got.vector.tolist() == [1, 0, 0]
            full = client.search("team-small", [1, 0, 0], k=2).hits[0]
            assert [h.id for h in client.search("team-small", [1, 0, 0], k=1, offset=1).hits[0]] == [full[1].id]
            low = (full[0].score + full[1].score) / 2
            assert [h.id for h in client.search("team-small", [1, 0, 0], k=2, score_threshold=low).hits[0]] == \
                [full[0].id]
            like = client.recommend("team-small", ["a"], k=1)
            assert [h.id for h in like] == ["b"]  # the other document: the example itself left out
            with pytest.raises(InputError, match="unknown field"):
                client.upsert("team-small", [{"id": "c", "vectr": [1, 1, 1]}])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert client.count("team-small", filter={"gg": 1}) == 0
                assert client.count("team-small", filter={"g": 1}) == 1
            # (a ResourceWarning of some earlier test's socket, collected meanwhile, is not the client's)
            caught = [w for w in caught if not issubclass(w.category, ResourceWarning)]
            assert len(caught) == 1 and "'gg'" in str(caught[0].message), [str(w.message) for w in caught]
        finally:
            client.drop_collection("team-small")
    params = inspect.signature(Client.search).parameters
    assert {"collection", "k", "filter"} <= set(params), params
    assert (Client.search.__doc__ or "").startswith("Top-k")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with Client(url, ADMIN, timeout=5) as down:
        with pytest.raises(UnreachableError, match=url) as e:
            down.collections()
        assert isinstance(e.value.__cause__, httpx.ConnectError)

    async def unreachable():
        async with AsyncClient(url, ADMIN, timeout=5) as down:
            await down.collections()

    with pytest.raises(UnreachableError, match=url):
        asyncio.run(unreachable())
