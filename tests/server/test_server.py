"""The service end to end: the real uvicorn server in a subprocess on a loopback port, spoken to over HTTP.

The tests of a collection's routes (searches, filters, documents, bad input, batching) run on every backend
(#69 item 1; integration_helpers.BACKENDS) through the fixture `demo`: "single" is the subprocess's demo
collection, "sharded" and "hosted" the same documents (ids, texts, metadata and the demo's own vectors) as a
sharded collection named demo, served with the same limits and batch window by the app every Ray Serve router
replica builds (its shards in the test process) and by the service holding it in its data directory. Each asserts
what the demo asserts; where a backend does not do what a test is about, the test asserts that backend's
documented refusal (new_collection)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import pytest
from integration_helpers import BACKENDS, serving_backend
from prometheus_client.parser import text_string_to_metric_families
from server_util import ServerProcess

from fusionrag.server.config import ServerConfig
from fusionrag.server.demo import corpus

# Paraphrased questions whose answer is one known chunk of the demo corpus.
KNOWN = {
    "how does the re-ranker decide to stop early?": "concepts/early-stopping-of-the-re-ranker",
    "what happens to a document when it is deleted?": "concepts/tombstones",
    "compress a vector into a few bytes with code words": "concepts/product-quantization",
    "asynchronous reads through a ring shared with the Linux kernel": "concepts/io-uring",
}
LIMITS = ["--max-queries", "8", "--max-k", "50", "--max-text-chars", "2000", "--max-documents", "16",
          "--max-body-bytes", "65536"]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The workhorse, started on an empty data directory (so it builds the demo), with small limits and a
    batch window of 50 ms."""
    root = tmp_path_factory.mktemp("main")
    srv = ServerProcess(root / "data", root / "server.log", *LIMITS, "--batch-wait-ms", "50")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="session")
def demo_vectors(client):
    """The stored vector of each demo document, by id."""
    ids = [d.id for d in corpus()]
    return {i: np.asarray(client.get(f"/v1/collections/demo/documents/{i}", params={"vector": True}).json()["vector"],
                          dtype=np.float32) for i in ids}


class Backend(NamedTuple):
    kind: str  # one of BACKENDS
    url: str
    client: httpx.Client
    data_dir: Path


@pytest.fixture(scope="module", params=BACKENDS)
def demo(request, server, client, demo_vectors, tmp_path_factory):
    """The demo collection on each backend: the subprocess's own ("single"), or its documents with their vectors
    as a sharded collection of 3 shards named demo (built by build_sharded with a documents sidecar, "sharded";
    created with "shards" and built by its import, "hosted"), served in this process with the subprocess's limits
    and batch window."""
    if request.param == "single":
        yield Backend("single", server.url, client, server.data_dir)
        return
    root = tmp_path_factory.mktemp(f"demo-{request.param}")
    limits = {flag[2:].replace("-", "_"): int(v) for flag, v in zip(LIMITS[::2], LIMITS[1::2])}
    config = ServerConfig(data_dir=str(root / "data"), demo=False, log_level="warning", batch_wait_ms=50, **limits)
    docs = corpus()
    vectors = np.stack([demo_vectors[d.id] for d in docs])
    embedding = client.get("/v1/collections/demo").json()["embedding"]
    with serving_backend(request.param, root, "demo", config, vectors, metric="cosine", embedding=embedding,
                         documents=[{"id": d.id, "text": d.text, "metadata": d.metadata} for d in docs]) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        yield Backend(request.param, url, c, root / "data")


def new_collection(demo: Backend, body: dict) -> httpx.Response | None:
    """Create a collection (body: as POST /v1/collections takes it) for a test of what a new collection does:
    the answer to its creation where the backend makes one that takes writes, else None, its refusals asserted. The
    Ray service serves its one sharded index alone and creates none (422, "alone"); a sharded collection in a data
    directory (created with "shards") holds nothing until its first import builds it, its lists learnt from those
    documents, and refuses a write or a search before that (409, "import"): it is dropped again. What such a test
    does with documents, it then does beside the demo's own documents (deleting them after); a vector-only
    collection runs on every backend in test_api_backends.py."""
    client = demo.client
    if demo.kind == "sharded":
        r = client.post("/v1/collections", json=body)
        assert r.status_code == 422 and "alone" in r.json()["detail"], r.text
        assert body["name"] not in [c["name"] for c in client.get("/v1/collections").json()["collections"]]
        return None
    if demo.kind == "hosted":
        name = body["name"]
        r = client.post("/v1/collections", json={**body, "shards": 3})
        assert r.status_code == 201 and r.json()["sharded"] and r.json()["count"] == 0, r.text
        try:
            assert client.post("/v1/collections", json={**body, "shards": 3}).status_code == 409
            vector = [0.5] * r.json()["dimension"]
            write = {"documents": [{"id": "a", "vector": vector}]}
            for r in (client.post(f"/v1/collections/{name}/documents", json=write),
                      search(client, name, vectors=[vector], k=1)):
                assert r.status_code == 409 and "import" in r.json()["detail"], r.text
            assert client.get(f"/v1/collections/{name}").json()["count"] == 0
        finally:
            assert client.delete(f"/v1/collections/{name}").status_code == 200
        assert name not in [c["name"] for c in client.get("/v1/collections").json()["collections"]]
        return None
    return client.post("/v1/collections", json=body)


def search(client, name="demo", **body):
    return client.post(f"/v1/collections/{name}/search", json=body)


# -- the demo collection --------------------------------------------------------------------------

def test_first_start_builds_the_demo_with_its_index(server, client):
    assert client.get("/readyz").json() == {"status": "ready", "collections": ["demo"], "failed": {}}
    built = [line for line in server.log_lines() if line["msg"] == "building the demo collection"]
    assert len(built) == 1 and built[0]["documents"] == len(corpus())
    info = client.get("/v1/collections/demo").json()
    assert info["count"] == len(corpus()) and info["embedding"] == "all-MiniLM-L6-v2"
    assert info["build_state"]["indexed"] == len(corpus()) and info["build_state"]["generation"] == 1
    assert info["tiers"]["ssd_bytes"] > 0 and info["tiers"]["pq_bytes"] > 0
    # The demo's raw vectors fit the default budget (--buffer-mb 64): held in RAM in place of the page buffer
    assert info["tiers"]["raw_in_ram"] and info["tiers"]["raw_vectors_bytes"] >= len(corpus()) * 384 * 4
    assert info["tiers"]["record_cache_bytes"] == 0 and info["tiers"]["page_buffer_bytes"] == 0
    assert client.get("/v1/collections").json()["collections"][0]["name"] == "demo"


def test_the_listing_says_building_until_the_demo_answers(tmp_path):
    """While the demo is built (on a first start) the listing shows it "building"; once it says "ready", the
    demo answers a search (a collection listed ready answered 503 "being built" before)."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    seen = []
    try:
        with srv.client() as c:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and seen[-1:] != ["ready"]:
                demo = [x for x in c.get("/v1/collections").json()["collections"] if x["name"] == "demo"]
                if demo:
                    seen.append(demo[0]["state"])
                    r = c.post("/v1/collections/demo/search", json={"vectors": [[1.0] + [0.0] * 383], "k": 1})
                    # building may end between the two requests; listed ready, it has ended
                    assert r.status_code == 200 if seen[-1] == "ready" else r.status_code in (200, 503), r.text
                time.sleep(0.05)
    finally:
        srv.stop()
    assert seen[-1] == "ready" and "building" in seen, seen[-5:]


def test_text_search_finds_known_documents(demo):
    client = demo.client
    r = search(client, texts=list(KNOWN), k=3)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [hits[0]["id"] for hits in results] == list(KNOWN.values())
    for hits in results:
        assert len(hits) == 3
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
        assert set(hits[0]) == {"id", "score", "distance", "text", "metadata"}
        assert hits[0]["metadata"]["source"] == "concepts.md"


def test_phrase_from_a_document_returns_it_first(demo):
    """Every sentence of eight words or more, searched as text, finds the document it was taken from."""
    client = demo.client
    phrases = [(doc, sentence) for doc in corpus() for sentence in re.split(r"(?<=\.)\s+", doc.text)
               if len(sentence.split()) >= 8]
    assert len(phrases) > 2 * len(corpus())
    for at in range(0, len(phrases), 8):
        part = phrases[at:at + 8]
        results = search(client, texts=[sentence for _, sentence in part], k=1).json()["results"]
        assert [hits[0]["id"] for hits in results] == [doc.id for doc, _ in part], [s for _, s in part]
        assert [hits[0]["text"] for hits in results] == [doc.text for doc, _ in part]


def test_vector_search_returns_the_document_of_its_vector(demo, demo_vectors):
    """Each query's stats are its engine's: a collection's index's (centroids probed, pages read or found in the
    buffer), a sharded collection's router's (lists and shards probed)."""
    client = demo.client
    ids = list(demo_vectors)[:8]
    r = search(client, vectors=[demo_vectors[i].tolist() for i in ids], k=2, stats=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [hits[0]["id"] for hits in body["results"]] == ids
    for hits in body["results"]:
        assert hits[0]["score"] == pytest.approx(1.0, abs=1e-4) and hits[0]["distance"] == pytest.approx(0, abs=1e-4)
    stats = body["stats"]
    assert len(stats) == 8
    # One vocabulary on every backend (docs/api.md): the same measure under the same name.
    assert all(s["lists_probed"] >= 1 and s["candidates"] >= 1 and s["reranked"] >= 1 for s in stats), stats
    if demo.kind == "single":
        # re-ranked from the raw vectors in RAM (the demo fits the budget): nothing read
        assert all(s["pages_read"] + s["pages_buffered"] == 0 and s["reranked"] >= 2 for s in stats), stats
    else:
        assert all(s["shards_probed"] >= 1 for s in stats), stats


def test_filter_and_tuning(demo):
    client = demo.client
    r = search(client, texts=["what is the ssd tier"], k=5, filter={"section": "Tombstones"}, params={"nprobe": 4})
    assert r.status_code == 200, r.text
    assert [h["id"] for h in r.json()["results"][0]] == ["concepts/tombstones"]
    r = search(client, texts=["product quantization"], k=3, filter={"section": {"$in": ["Tombstones", "Collections"]}})
    assert {h["id"] for h in r.json()["results"][0]} == {"concepts/tombstones", "concepts/collections"}
    assert "warnings" not in r.json()


def test_a_filter_of_the_wrong_type_is_answered_with_a_warning(demo):
    client = demo.client
    # The demo's `part` is a number: "1" matches no document, and the answer says why.
    r = search(client, texts=["tombstones"], k=3, filter={"part": "1"})
    assert r.status_code == 200 and r.json()["results"] == [[]]
    [warning] = r.json()["warnings"]
    assert "'part'" in warning and "numbers only" in warning and "strings" in warning
    r = search(client, texts=["tombstones"], k=3, filter={"part": 1})
    assert len(r.json()["results"][0]) == 3 and "warnings" not in r.json()
    # Lists in metadata: $contains tests their elements; in a collection of their own where the backend makes one
    # that takes them, else beside the demo's documents (which have no `tags`), deleted after.
    docs = [{"id": "x", "text": "about tombstones", "metadata": {"tags": ["engine", "delete"]}},
            {"id": "y", "text": "about pages", "metadata": {"tags": ["ssd"]}}]
    created = new_collection(demo, {"name": "tagged", "embedding": "all-MiniLM-L6-v2"})
    if created is not None:
        assert created.status_code == 201
    name = "tagged" if created is not None else "demo"
    try:
        assert client.post(f"/v1/collections/{name}/documents", json={"documents": docs}).status_code == 200
        r = search(client, name, texts=["tombstones"], k=2, filter={"tags": {"$contains": "delete"}})
        assert [h["id"] for h in r.json()["results"][0]] == ["x"] and "warnings" not in r.json()
        r = search(client, name, texts=["tombstones"], k=2, filter={"tags": "delete"})
        assert r.json()["results"] == [[]] and "$contains" in r.json()["warnings"][0]
    finally:
        if created is not None:
            assert client.delete("/v1/collections/tagged").status_code == 200
        else:
            client.request("DELETE", "/v1/collections/demo/documents", json={"ids": ["x", "y"]})
    assert client.get("/v1/collections/demo").json()["count"] == len(corpus())


# -- documents ------------------------------------------------------------------------------------

def test_documents_upsert_get_search_delete(demo, demo_vectors):
    """A new collection with an embedding model: documents written with and without a vector and id, read, found by
    text and by vector, replaced, deleted; the collection dropped. Where the backend makes no new collection that
    takes documents (new_collection), the same documents go beside the demo's own and are deleted after."""
    client = demo.client
    r = new_collection(demo, {"name": "notes", "embedding": "all-MiniLM-L6-v2"})
    if r is not None:
        assert r.status_code == 201, r.text
        assert r.json()["dimension"] == 384 and r.json()["count"] == 0
        assert client.post("/v1/collections", json={"name": "notes", "dimension": 384}).status_code == 409
    name = "notes" if r is not None else "demo"
    before = client.get(f"/v1/collections/{name}").json()["count"]  # 0 in a new collection

    # n3's vector is none of the demo's: found first by it beside them too
    given = demo_vectors["concepts/page-buffer"] + demo_vectors["concepts/io-uring"]
    given = (given / np.linalg.norm(given)).tolist()
    docs = [{"id": "n1", "text": "The lighthouse keeper climbs two hundred steps every evening.", "metadata": {"n": 1}},
            {"text": "Sourdough bread needs a starter fed with flour and water.", "metadata": {"n": 2}},
            {"id": "n3", "text": "vector given", "vector": given}]
    r = client.post(f"/v1/collections/{name}/documents", json={"documents": docs})
    assert r.status_code == 200, r.text
    ids = r.json()["ids"]
    try:
        assert ids[0] == "n1" and ids[2] == "n3" and len(ids[1]) == 32  # a new uuid4 hex

        got = client.get(f"/v1/collections/{name}/documents/n1").json()
        assert got == {"id": "n1", "text": docs[0]["text"], "metadata": {"n": 1}}
        hits = search(client, name, texts=["who climbs the stairs of the lighthouse?"], k=3).json()["results"][0]
        assert hits[0]["id"] == "n1"
        hits = search(client, name, vectors=[given], k=1).json()["results"][0]
        assert hits[0]["id"] == "n3"

        # Upsert by id replaces the text and the vector.
        r = client.post(f"/v1/collections/{name}/documents",
                        json={"documents": [{"id": "n1", "text": "Bees dance to tell the hive where flowers are."}]})
        assert r.json() == {"ids": ["n1"]}
        assert client.get(f"/v1/collections/{name}/documents/n1").json()["text"].startswith("Bees")
        hits = search(client, name, texts=["how do bees communicate?"], k=1).json()["results"][0]
        assert hits[0]["id"] == "n1"
        assert client.get(f"/v1/collections/{name}").json()["count"] == before + 3

        r = client.request("DELETE", f"/v1/collections/{name}/documents", json={"ids": ["n1", "unknown"]})
        assert r.json() == {"deleted": 1}
        r = client.get(f"/v1/collections/{name}/documents/n1")
        assert r.status_code == 404 and "n1" in r.json()["detail"]
        hits = search(client, name, texts=["how do bees communicate?"], k=3).json()["results"][0]
        assert "n1" not in {h["id"] for h in hits} and len(hits) == min(3, before + 2)
    finally:
        if name == "demo":
            client.request("DELETE", "/v1/collections/demo/documents", json={"ids": ids})
    if name == "demo":
        assert client.get("/v1/collections/demo").json()["count"] == len(corpus())
        return
    assert client.delete("/v1/collections/notes").json() == {"deleted": "notes"}
    assert search(client, "notes", texts=["x"]).status_code == 404
    assert "notes" not in [c["name"] for c in client.get("/v1/collections").json()["collections"]]


def test_vector_only_collection(demo):
    client = demo.client
    r = new_collection(demo, {"name": "points", "dimension": 3, "metric": "l2"})
    if r is None:  # refused as new_collection says; a vector-only collection on every backend: test_api_backends.py
        return
    assert r.status_code == 201, r.text
    pts = [[0, 0, 0], [1, 0, 0], [0, 5, 0]]
    r = client.post("/v1/collections/points/documents",
                    json={"documents": [{"id": f"p{i}", "vector": p} for i, p in enumerate(pts)]})
    assert r.json() == {"ids": ["p0", "p1", "p2"]}
    hits = search(client, "points", vectors=[[0.9, 0.1, 0]], k=3).json()["results"][0]
    assert [h["id"] for h in hits] == ["p1", "p0", "p2"]
    assert hits[0]["distance"] == pytest.approx(0.02, abs=1e-5) and hits[0]["score"] == pytest.approx(-0.02, abs=1e-5)
    # Text needs an embedding model, which this collection does not have.
    for r in (search(client, "points", texts=["hello"]),
              client.post("/v1/collections/points/documents", json={"documents": [{"text": "no vector"}]})):
        assert r.status_code == 422 and "no embedding model" in r.json()["detail"]
    client.delete("/v1/collections/points")


# -- bad input: each gets its 4xx and a message that says what was wrong -----------------------------

BAD = [
    # (what, method, path, body or raw bytes, status, words in the message)
    ("malformed JSON", "POST", "/v1/collections/demo/search", b'{"texts": ["a"', 400, "malformed JSON"),
    ("NaN", "POST", "/v1/collections/demo/search", b'{"vectors": [[NaN' + b', 0.1' * 383 + b']]}', 422, "finite"),
    ("infinity", "POST", "/v1/collections/demo/search", b'{"vectors": [[Infinity' + b', 0.1' * 383 + b']]}', 422,
     "finite"),
    ("wrong dimension", "POST", "/v1/collections/demo/search", {"vectors": [[0.1, 0.2]]}, 422, "dimension 2"),
    ("zero vector, cosine", "POST", "/v1/collections/demo/search", {"vectors": [[0.0] * 384]}, 422, "zero vector"),
    ("ragged vectors", "POST", "/v1/collections/demo/search", {"vectors": [[0.1] * 384, [0.1]]}, 422, "dimension"),
    ("unknown collection", "POST", "/v1/collections/nothere/search", {"texts": ["a"]}, 404, "does not exist"),
    ("bad collection name", "POST", "/v1/collections/bad$name/search", {"texts": ["a"]}, 400,
     "invalid collection name"),
    ("dot-dot collection", "GET", "/v1/collections/%2e%2e", None, 400, "invalid collection name"),
    ("newline in a name", "GET", "/v1/collections/demo%0A", None, 400, "invalid collection name"),
    ("k too large", "POST", "/v1/collections/demo/search", {"texts": ["a"], "k": 51}, 422, "max_k"),
    ("k zero", "POST", "/v1/collections/demo/search", {"texts": ["a"], "k": 0}, 422, "k"),
    ("too many queries", "POST", "/v1/collections/demo/search", {"texts": ["a"] * 9}, 422, "max_queries"),
    ("text too long", "POST", "/v1/collections/demo/search", {"texts": ["a" * 2001]}, 422, "max_text_chars"),
    ("no queries", "POST", "/v1/collections/demo/search", {"texts": []}, 422, "no queries"),
    ("both kinds", "POST", "/v1/collections/demo/search", {"texts": ["a"], "vectors": [[0.1] * 384]}, 422,
     "exactly one"),
    ("unknown field", "POST", "/v1/collections/demo/search", {"texts": ["a"], "topk": 3}, 422, "topk"),
    ("unknown param", "POST", "/v1/collections/demo/search", {"texts": ["a"], "params": {"nprob": 3}}, 422,
     "nprob"),
    ("param of wrong type", "POST", "/v1/collections/demo/search", {"texts": ["a"], "params": {"nprobe": "x"}},
     422, "params.nprobe"),
    ("param out of range", "POST", "/v1/collections/demo/search", {"texts": ["a"], "params": {"nprobe": 0}}, 422,
     "nprobe"),
    ("bad filter", "POST", "/v1/collections/demo/search", {"texts": ["a"], "filter": {"n": {"$near": 1}}}, 422,
     "$near"),
    ("body too large", "POST", "/v1/collections/demo/search", {"texts": ["a" * 70000]}, 413, "max_body_bytes"),
    ("missing document", "GET", "/v1/collections/demo/documents/no-such-doc", None, 404, "no-such-doc"),
    ("too many documents", "POST", "/v1/collections/demo/documents", {"documents": [{"text": "a"}] * 17}, 422,
     "max_documents"),
    ("document without text or vector", "POST", "/v1/collections/demo/documents",
     {"documents": [{"id": "x", "metadata": {}}]}, 422, "text, a vector"),
    ("document vector of wrong dimension", "POST", "/v1/collections/demo/documents",
     {"documents": [{"id": "x", "vector": [1.0, 2.0]}]}, 422, "dimension 2"),
    ("empty delete", "DELETE", "/v1/collections/demo/documents", {"ids": []}, 422, "ids"),
    ("create: bad name", "POST", "/v1/collections", {"name": "../../escape", "dimension": 4}, 400,
     "invalid collection name"),
    ("create: bad metric", "POST", "/v1/collections", {"name": "m", "dimension": 4, "metric": "hamming"}, 422,
     "metric"),
    ("create: unknown model", "POST", "/v1/collections", {"name": "m", "embedding": "gpt-embed"}, 422,
     "unknown embedding model"),
    ("create: dimension does not fit the model", "POST", "/v1/collections",
     {"name": "m", "dimension": 10, "embedding": "all-MiniLM-L6-v2"}, 422, "does not fit"),
    ("create: neither dimension nor model", "POST", "/v1/collections", {"name": "m"}, 422, "dimension"),
]


@pytest.mark.parametrize("what,method,path,body,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_4xx(demo, what, method, path, body, status, words):
    client = demo.client
    if isinstance(body, bytes):
        r = client.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.request(method, path, json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["detail"], r.json()
    # Nothing was written or created by a refused request, and nothing escaped the data directory.
    assert client.get("/v1/collections/demo").json()["count"] == len(corpus())
    assert not (demo.data_dir.parent / "escape").exists()
    assert not {"m", "x", "escape"} & {c["name"] for c in client.get("/v1/collections").json()["collections"]}


def test_streamed_body_over_the_limit_gets_413(demo):
    client = demo.client

    def chunks():  # no Content-Length: the limit must catch it while reading
        for _ in range(40):
            yield b'{"texts": ["' + b"a" * 2000

    r = client.post("/v1/collections/demo/search", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]


def test_the_process_survives_bad_input(demo):
    client = demo.client
    assert client.get("/healthz").json() == {"status": "ok"}
    assert search(client, texts=list(KNOWN)[:1], k=1).json()["results"][0][0]["id"] == list(KNOWN.values())[0]


# -- micro-batching ------------------------------------------------------------------------------

def _batch_counts(client) -> tuple[float, float]:
    fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    samples = {s.name: s.value for s in fams["fusionrag_batch_requests"].samples}
    return samples["fusionrag_batch_requests_count"], samples["fusionrag_batch_requests_sum"]


def test_concurrent_searches_share_batches_and_get_their_own_answers(demo, demo_vectors):
    client = demo.client
    batches0, requests0 = _batch_counts(client)
    ids = list(demo_vectors)[:24]

    async def burst():
        async with httpx.AsyncClient(base_url=demo.url, timeout=60) as ac:
            reqs = []
            for n, i in enumerate(ids):
                body = {"vectors": [demo_vectors[i].tolist()], "k": 1} if n % 2 else {"texts": [i], "k": 3}
                reqs.append(ac.post("/v1/collections/demo/search", json=body))
            # A k no other request has: a group of its own inside the batch.
            body = {"vectors": [demo_vectors[ids[0]].tolist()], "k": 2}
            reqs.append(ac.post("/v1/collections/demo/search", json=body))
            return await asyncio.gather(*reqs)

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    for n, (i, r) in enumerate(zip(ids, responses)):
        hits = r.json()["results"][0]
        if n % 2:  # a vector query answers with the document it came from
            assert len(hits) == 1 and hits[0]["id"] == i
        else:
            assert len(hits) == 3
    assert [h["id"] for h in responses[-1].json()["results"][0]][0] == ids[0]
    assert len(responses[-1].json()["results"][0]) == 2

    batches, requests = _batch_counts(client)
    assert requests - requests0 == len(ids) + 1
    assert batches - batches0 < requests - requests0  # at least one batch held several requests


# -- metrics, logs, the OpenAPI page ----------------------------------------------------------

def test_metrics_parse_and_cover_the_figures(client):
    search(client, texts=["page buffer"], k=3)
    text = client.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("fusionrag_http_requests", "fusionrag_http_request_seconds", "fusionrag_stage_seconds",
                 "fusionrag_batch_requests", "fusionrag_batch_queries", "fusionrag_queries",
                 "fusionrag_ssd_pages_read", "fusionrag_page_buffer_hits", "fusionrag_page_buffer_hit_ratio",
                 "fusionrag_reranked_candidates",
                 "fusionrag_collection_documents", "fusionrag_tier_bytes", "fusionrag_gpu_memory_bytes",
                 "fusionrag_search_scratch_bytes"):
        assert name in fams, name
    # The demo collection's index searched its graph and scanned: some thread of the service holds scratch.
    assert fams["fusionrag_search_scratch_bytes"].samples[0].value > 0
    stages = {s.labels["stage"] for s in fams["fusionrag_stage_seconds"].samples}
    assert {"queue", "embed", "engine", "graph", "lut", "scan", "rerank"} <= stages
    docs = {s.labels["collection"]: s.value for s in fams["fusionrag_collection_documents"].samples}
    assert docs["demo"] == len(corpus())
    tiers = {s.labels["tier"] for s in fams["fusionrag_tier_bytes"].samples if s.labels["collection"] == "demo"}
    assert {"host_index", "pq", "page_buffer", "record_cache", "raw_vectors", "ssd", "fresh"} <= tiers
    # No page was asked for (the demo's raw vectors are in RAM): no hit ratio to give for it
    ratio = [s.value for s in fams["fusionrag_page_buffer_hit_ratio"].samples if s.labels["collection"] == "demo"]
    assert ratio == []
    ok = [s for s in fams["fusionrag_http_requests"].samples
          if s.name == "fusionrag_http_requests_total" and s.labels["route"] == "/v1/collections/{name}/search"
          and s.labels["status"] == "200"]
    assert ok and ok[0].value >= 1
    # The demo's raw vectors are in RAM (they fit the default budget): candidates re-ranked, no page read
    total = lambda name: sum(s.value for s in fams[name].samples if s.name.endswith("_total"))
    assert total("fusionrag_reranked_candidates") >= 3 and total("fusionrag_ssd_pages_read") == 0


def test_stats_endpoint_and_structured_logs(server, client):
    search(client, texts=["navigation graph"], k=2)
    stats = client.get("/v1/stats").json()
    assert stats["ready"] and stats["collections"]["demo"]["count"] == len(corpus())
    assert stats["recent"]["searches"] >= 1 and stats["recent"]["latency_ms_p50"] > 0
    deadline = time.monotonic() + 10  # a request is logged just after its answer is sent
    while not any(line["msg"] == "request" and line["path"] == "/v1/stats" and line["status"] == 200
                  and line["ms"] > 0 for line in server.log_lines()):
        assert time.monotonic() < deadline, "no log line for GET /v1/stats"
        time.sleep(0.05)


def test_openapi_page_is_served_offline(client):
    spec = client.get("/openapi.json").json()
    assert "/v1/collections/{name}/search" in spec["paths"]
    page = client.get("/docs").text
    assert "/swagger/swagger-ui-bundle.js" in page and "cdn" not in page.lower()
    assert client.get("/swagger/swagger-ui-bundle.js").status_code == 200


# -- API keys -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    keys = root / "keys.txt"
    keys.write_text("# admin\nadmin-key-0123456789\nteam-key-0123456789 notes-*, shared\n")
    srv = ServerProcess(root / "data", root / "server.log", "--no-demo", "--api-keys-file", str(keys),
                        env={"FUSIONRAG_API_KEYS": "env-key-0123456789 shared"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_api_keys(keyed):
    admin = {"Authorization": "Bearer admin-key-0123456789"}
    team = {"Authorization": "Bearer team-key-0123456789"}
    env_key = {"Authorization": "Bearer env-key-0123456789"}
    with keyed.client() as c:
        r = c.get("/v1/collections")
        assert r.status_code == 401 and "missing API key" in r.json()["detail"]
        assert r.headers["www-authenticate"] == "Bearer"
        r = c.get("/v1/collections", headers={"Authorization": "Bearer admin-key-012345678X"})
        assert r.status_code == 401 and r.json()["detail"] == "invalid API key"
        assert c.get("/v1/collections", headers={"Authorization": "Basic YWxhZGRpbjpvcGVu"}).status_code == 401

        for name in ("notes-a", "private", "shared"):
            assert c.post("/v1/collections", json={"name": name, "dimension": 2}, headers=admin).status_code == 201
            c.post(f"/v1/collections/{name}/documents", json={"documents": [{"id": "a", "vector": [1, 0]}]},
                   headers=admin)
        body = {"vectors": [[1, 0]], "k": 1}
        assert c.post("/v1/collections/notes-a/search", json=body, headers=team).json()["results"][0][0]["id"] == "a"
        r = c.post("/v1/collections/private/search", json=body, headers=team)
        assert r.status_code == 403 and "private" in r.json()["detail"]
        assert c.get("/v1/collections/private/documents/a", headers=team).status_code == 403
        assert c.delete("/v1/collections/private", headers=team).status_code == 403
        assert c.post("/v1/collections", json={"name": "mine", "dimension": 2}, headers=team).status_code == 403
        assert c.post("/v1/collections", json={"name": "notes-b", "dimension": 2}, headers=team).status_code == 201
        names = [x["name"] for x in c.get("/v1/collections", headers=team).json()["collections"]]
        assert names == ["notes-a", "notes-b", "shared"]
        # A key from the environment works beside the file's.
        assert c.post("/v1/collections/shared/search", json=body, headers=env_key).status_code == 200
        assert c.post("/v1/collections/notes-a/search", json=body, headers=env_key).status_code == 403
        # Health, readiness and the page stay open (/metrics needs a key: test_server_reliability.py); the
        # collection still exists after the 403s.
        for path in ("/healthz", "/readyz", "/"):
            assert c.get(path).status_code == 200, path
        assert c.get("/v1/collections/private", headers=admin).json()["count"] == 1


# -- a later start, and graceful shutdown -----------------------------------------------------------

def test_later_start_loads_the_demo_and_sigterm_lets_requests_finish(server, demo_vectors, tmp_path):
    """The demo is loaded, not rebuilt; a request in flight at SIGTERM still gets its answer."""
    # The demo is never written after its build, so its files can be copied while the other server runs.
    shutil.copytree(server.data_dir / "collections" / "demo", tmp_path / "data" / "collections" / "demo")
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--batch-wait-ms", "1500")
    try:
        assert srv.wait_ready() == {"status": "ready", "collections": ["demo"], "failed": {}}
        assert not any(line["msg"] == "building the demo collection" for line in srv.log_lines())
        target = "concepts/graceful-shutdown"
        answer = {}

        def slow_search():  # waits 1.5 s in the batcher: SIGTERM arrives meanwhile
            with srv.client() as c:
                answer["r"] = c.post("/v1/collections/demo/search",
                                     json={"vectors": [demo_vectors[target].tolist()], "k": 1})

        t = threading.Thread(target=slow_search)
        t.start()
        time.sleep(0.5)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no new connections once shutdown began
            httpx.get(srv.url + "/healthz")
        t.join(30)
        assert answer["r"].status_code == 200 and answer["r"].json()["results"][0][0]["id"] == target
        # An orderly shutdown is a success: exit 0, not death by the signal (`make run` would say "Terminated").
        assert srv.proc.wait(30) == 0
        assert [line["msg"] for line in srv.log_lines()][-3:-1] == ["stopped", "Application shutdown complete."]
    finally:
        srv.stop()


def test_ctrl_c_stops_the_service_in_order_and_exits_0(tmp_path):
    """`make run` in a terminal stopped by Ctrl-C (SIGINT): the same orderly shutdown, exit 0, no traceback."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo")
    try:
        srv.wait_ready()
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0
        assert "stopped" in [line.get("msg") for line in srv.log_lines()]
        assert "Traceback" not in srv.log_path.read_text()
    finally:
        srv.stop()


def test_gpu_tier_flags_reach_the_engine_and_metrics(server, demo_vectors, tmp_path):
    """--filter-tier gpu with a budget: answers equal the CPU tier's, and /metrics shows the budget held.
    Without a GPU the tier runs its Triton kernels through the interpreter (TRITON_INTERPRET=1, conftest)."""
    shutil.copytree(server.data_dir / "collections" / "demo", tmp_path / "data" / "collections" / "demo")
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--filter-tier", "gpu", "--gpu-budget-mb", "256")
    try:
        srv.wait_ready()
        target = "concepts/graceful-shutdown"
        body = {"vectors": [demo_vectors[target].tolist()], "k": 5}
        with srv.client() as c, server.client() as cpu:
            gpu_hits = search(c, **body).json()["results"][0]
            cpu_hits = search(cpu, **body).json()["results"][0]
            # Float sums may differ in order on a device: the same best hit, near-ties aside the same hits, and
            # the same exact distances for the hits both found.
            assert gpu_hits[0]["id"] == cpu_hits[0]["id"] == target
            cpu_distance = {h["id"]: h["distance"] for h in cpu_hits}
            shared = [h for h in gpu_hits if h["id"] in cpu_distance]
            assert len(shared) >= 4
            assert [h["distance"] for h in shared] == pytest.approx([cpu_distance[h["id"]] for h in shared], abs=1e-5)
            assert c.get("/v1/collections/demo").json()["tiers"]["pq_tier"] == "gpu"
            fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
            gpu = {s.labels["kind"]: s.value for s in fams["fusionrag_gpu_memory_bytes"].samples}
            assert gpu["budget"] == 256 << 20 and 0 < gpu["used"] <= gpu["budget"] and gpu["peak"] >= gpu["used"]
            # What the driver says the process holds, where it gives a per-process figure (a CUDA device).
            if "process" in gpu:
                assert 0 < gpu["process"] <= gpu["budget"]
            # The one collection's share of the process's budget is all of what is used.
            share = [s.value for s in fams["fusionrag_tier_bytes"].samples
                     if s.labels == {"collection": "demo", "tier": "gpu"}]
            assert share == [gpu["used"]]
            pinned = [s.value for s in fams["fusionrag_tier_bytes"].samples
                      if s.labels == {"collection": "demo", "tier": "gpu_host_pinned"}]
            assert pinned == [0]  # every posting fits the budget: none pinned on the host
    finally:
        srv.stop()


def test_bad_gpu_tier_flag_is_refused(tmp_path):
    p = subprocess.run([sys.executable, "-m", "fusionrag", "serve", "--data-dir", str(tmp_path), "--no-demo",
                        "--filter-tier", "tpu"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "filter_tier must be one of" in p.stderr


# -- the web page, in headless Chromium ------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    chromium = shutil.which("chromium")
    assert chromium and shutil.which(driver_path), \
        "the page test needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _open_page(server, browser):
    """The web page, loaded, the service ready and the demo collection chosen; its 30 s WebDriverWait."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait = WebDriverWait(browser, 30)
    browser.get(server.url + "/")
    wait.until(EC.text_to_be_present_in_element((By.ID, "status"), "ready"))
    wait.until(lambda d: Select(d.find_element(By.ID, "collection")).first_selected_option.get_attribute("value")
               == "demo")
    return wait


def test_web_page_searches_and_shows_live_figures(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC

    wait = _open_page(server, browser)
    query = browser.find_element(By.ID, "query")
    query.send_keys("how are deleted documents kept out of results?")
    browser.find_element(By.ID, "search").click()
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#results li")))
    hits = browser.find_elements(By.CSS_SELECTOR, "#results li")
    assert len(hits) == 5
    assert hits[0].get_attribute("data-id") == "concepts/tombstones"
    assert hits[0].find_element(By.CLASS_NAME, "hit-score").text.startswith("score 0.")
    assert "tombstone" in hits[0].find_element(By.CLASS_NAME, "hit-text").text
    assert "pages read" in browser.find_element(By.ID, "summary").text
    # Live figures: the demo's tiers, and the search just made counted in the recent figures.
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#tiers tr[data-collection='demo']")))
    row = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "#tiers tr[data-collection='demo'] td")]
    assert row[0] == "demo" and row[1] == str(len(corpus())) and row[5].endswith("KiB")
    # the buffer's column: the raw vectors held in RAM in its place (the demo's fit the default budget), fewer
    # bytes than their pages on the SSD (two 1536-byte records a 4 KiB page)
    assert row[4].endswith("KiB") and 0 < float(row[4].split()[0]) < float(row[5].split()[0])
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "dd[data-figure='latency p50']").text.endswith(" ms"))
    # An error is shown, not swallowed.
    query.clear()
    browser.find_element(By.ID, "k").clear()
    browser.find_element(By.ID, "k").send_keys("80")  # the page allows it, the server (max_k 50) does not
    query.send_keys("anything")
    browser.find_element(By.ID, "search").click()
    wait.until(EC.visibility_of_element_located((By.ID, "error")))
    assert "422" in browser.find_element(By.ID, "error").text and "max_k" in browser.find_element(By.ID, "error").text


def test_web_page_memory_table_stays_in_its_box_with_many_collections(server, browser, client):
    """#49: the memory table overflowed the page at 1280 px with nine collections: it now scrolls inside its box,
    and the page itself never scrolls sideways."""
    from selenium.webdriver.common.by import By

    names = [f"a-rather-long-collection-name-{i:02d}" for i in range(9)]
    for name in names:
        assert client.post("/v1/collections", json={"name": name, "dimension": 4, "metric": "l2"}).status_code == 201
    try:
        wait = _open_page(server, browser)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tiers tbody tr")) >= 10)
        box = browser.execute_script(
            "const t = document.getElementById('tiers'), w = t.parentElement, a = document.getElementById('figures');"
            "const r = x => x.getBoundingClientRect();"
            "return {page: document.documentElement.scrollWidth, view: window.innerWidth, table_right: r(t).right,"
            "        aside_right: r(a).right, aside_scroll: a.scrollWidth, aside_client: a.clientWidth,"
            "        clipped: w !== a && getComputedStyle(w).overflowX === 'auto'};")
        assert box["page"] <= box["view"], box  # nothing spills past the window
        assert box["aside_scroll"] <= box["aside_client"], box  # nor past the panel: the table scrolls inside it
        assert box["table_right"] <= box["aside_right"] or box["clipped"], box
    finally:
        for name in names:
            client.delete(f"/v1/collections/{name}")


def test_web_page_text_and_hybrid_modes(server, browser):
    """The page's mode selector reaches the service: text mode by words alone, hybrid by both."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select

    wait = _open_page(server, browser)
    for mode, words in (("text", "matched by words"), ("hybrid", "lists probed")):
        Select(browser.find_element(By.ID, "mode")).select_by_value(mode)
        query = browser.find_element(By.ID, "query")
        query.clear()
        query.send_keys("tombstones")
        browser.find_element(By.ID, "search").click()
        wait.until(EC.text_to_be_present_in_element((By.ID, "summary"), words))
        hits = browser.find_elements(By.CSS_SELECTOR, "#results li")
        assert hits[0].get_attribute("data-id") == "concepts/tombstones", mode
        assert "matched by words" in browser.find_element(By.ID, "summary").text


def test_web_page_browses_documents_with_a_filter_and_opens_one(server, browser):
    """#49: the page's document browser: the documents a filter passes, page after page, one opened whole; a
    filter that is not JSON, or names a field no document holds, says so."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC

    wait = _open_page(server, browser)
    docs = {d.id: d for d in corpus()}
    want = sorted(i for i, d in docs.items() if d.metadata["source"] == "concepts.md")
    box = browser.find_element(By.ID, "filter")
    box.clear()
    box.send_keys('{"source": "concepts.md"}')
    browser.find_element(By.ID, "browse").click()
    wait.until(EC.text_to_be_present_in_element((By.ID, "browse-summary"), f"{len(want)} documents pass the filter"))
    while True:  # the server's pages are 16 documents here (max_documents): "More" until the last
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#documents li"))
        more = browser.find_element(By.ID, "more")
        if not more.is_displayed():
            break
        shown = len(browser.find_elements(By.CSS_SELECTOR, "#documents li"))
        more.click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#documents li")) > shown)
    listed = [li.get_attribute("data-id") for li in browser.find_elements(By.CSS_SELECTOR, "#documents li")]
    assert sorted(listed) == want and len(set(listed)) == len(listed)
    assert len(want) > 16  # more than one page was read
    browser.find_element(By.CSS_SELECTOR, f"#documents li[data-id='{want[0]}']").click()
    wait.until(EC.visibility_of_element_located((By.ID, "document")))
    assert browser.find_element(By.ID, "doc-id").text == want[0]
    assert browser.find_element(By.ID, "doc-text").text.strip() == docs[want[0]].text.strip()
    assert '"source": "concepts.md"' in browser.find_element(By.ID, "doc-meta").text
    # A search hit opens its document too.
    query = browser.find_element(By.ID, "query")
    query.clear()
    query.send_keys("how are deleted documents kept out of results?")
    browser.find_element(By.ID, "search").click()
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#results li[data-id='concepts/tombstones']")))
    browser.find_element(By.CSS_SELECTOR, "#results li[data-id='concepts/tombstones']").click()
    wait.until(EC.text_to_be_present_in_element((By.ID, "doc-id"), "concepts/tombstones"))
    # A misspelled field is named; a filter that is not JSON is refused on the page.
    box.clear()
    box.send_keys('{"sourse": "concepts.md"}')
    browser.find_element(By.ID, "browse").click()
    wait.until(EC.text_to_be_present_in_element((By.ID, "browse-summary"), "0 documents pass the filter"))
    assert "source" in browser.find_element(By.ID, "browse-summary").text  # the nearest stored name
    box.clear()
    box.send_keys("{source: concepts}")
    browser.find_element(By.ID, "browse").click()
    wait.until(EC.visibility_of_element_located((By.ID, "error")))
    assert "not JSON" in browser.find_element(By.ID, "error").text


def test_web_page_shows_how_imports_went(server, client, browser):
    """The page's collection table has each collection's state: an import's outcome, its reason when it failed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    vecs = np.random.default_rng(3).standard_normal((400, 8)).astype(np.float32)
    lines = ["".join(json.dumps({"id": f"i{i}", "vector": v.tolist()}) + "\n" for i, v in enumerate(vecs[:n]))
             for n in (40, 400)]
    # a vector of the wrong dimension past the start that the service checks before its 202 (#67): the import finds it
    lines[1] += json.dumps({"id": "bad", "vector": [0.5] * 9}) + "\n"
    assert len(lines[1]) > 64 << 10
    for name, body in zip(("page-import", "page-badimport"), lines):
        assert client.post("/v1/collections", json={"name": name, "dimension": 8, "metric": "l2"}).status_code == 201
        r = client.post(f"/v1/collections/{name}/import", content=body, headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 202, r.text
    try:
        browser.get(server.url + "/")

        def row(name):
            cells = browser.find_elements(By.CSS_SELECTOR, f"#tiers tr[data-collection='{name}'] td")
            return [c.text for c in cells]

        wait = WebDriverWait(browser, 60)
        wait.until(lambda d: (r := row("page-import")) and r[-1] == "ready" and r[1] == "40")
        wait.until(lambda d: (r := row("page-badimport")) and r[-1].startswith("import failed: documents line 401"))
    finally:
        for name in ("page-import", "page-badimport"):
            client.delete(f"/v1/collections/{name}")


def _page_search(browser, wait, query: str, mode: str, k: int, filter_text: str):
    """Search from the page's form; the ids of its hits, once the page has answered."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.execute_script("document.getElementById('summary').textContent = '';"
                           "document.getElementById('results').replaceChildren();")
    Select(browser.find_element(By.ID, "mode")).select_by_value(mode)
    for box, value in (("query", query), ("k", str(k)), ("search-filter", filter_text)):
        el = browser.find_element(By.ID, box)
        el.clear()
        el.send_keys(value)
    browser.find_element(By.ID, "search").click()
    wait.until(lambda d: d.find_element(By.ID, "summary").text or d.find_element(By.ID, "error").is_displayed())
    return browser.execute_script("return [...document.querySelectorAll('#results li')].map(li => li.dataset.id)")


def test_web_page_search_form_filters_as_the_api_does(server, browser, client):
    """#67 item 6: the search form's filter box sends the API's own filter: in each mode the page shows exactly the
    ids the API returns for the same query, k and filter; a filter that is not a JSON object is refused on the
    page, one the service refuses shows its reason, and a misspelt field its warning."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC

    wait = _open_page(server, browser)
    query, k = "how are deleted documents kept out of results?", 5
    filt = {"section": {"$nin": ["Tombstones", "Merging generations"]}}
    for mode in ("vector", "text", "hybrid"):
        unfiltered = search(client, texts=[query], k=k, mode=mode).json()["results"][0]
        want = [h["id"] for h in search(client, texts=[query], k=k, mode=mode, filter=filt).json()["results"][0]]
        assert "concepts/tombstones" in [h["id"] for h in unfiltered] and "concepts/tombstones" not in want, mode
        assert len(want) == k
        shown = _page_search(browser, wait, query, mode, k, json.dumps(filt))
        assert shown == want, (mode, shown, want)
        assert not browser.find_element(By.ID, "error").is_displayed()
        assert "filtered" in browser.find_element(By.ID, "summary").text
    # Not JSON, and JSON but not an object: said on the page, nothing asked of the service.
    for text, words in (("{section: Tombstones}", "search filter is not JSON"),
                        ('["Tombstones"]', "must be a JSON object")):
        _page_search(browser, wait, query, "vector", k, text)
        wait.until(EC.visibility_of_element_located((By.ID, "error")))
        assert words in browser.find_element(By.ID, "error").text
        assert not browser.find_elements(By.CSS_SELECTOR, "#results li")
    # An operator the service does not know: its 422 and reason, as the API gives them.
    bad = {"section": {"$like": "Tomb%"}}
    api = search(client, texts=[query], k=k, filter=bad)
    assert api.status_code == 422
    _page_search(browser, wait, query, "vector", k, json.dumps(bad))
    wait.until(EC.visibility_of_element_located((By.ID, "error")))
    assert browser.find_element(By.ID, "error").text == f"422: {api.json()['detail']}"
    # A misspelt field: no hits, and the service's warning naming the field it meant.
    typo = {"sectoin": "Tombstones"}
    warning = search(client, texts=[query], k=k, filter=typo).json()["warnings"][0]
    assert _page_search(browser, wait, query, "vector", k, json.dumps(typo)) == []
    assert warning in browser.find_element(By.ID, "summary").text and "'section'" in warning


def test_web_page_explains_hybrid_scores(server, browser, client):
    """#67 item 6: hybrid results come with what their score is, the fusion's: its method and constants are the ones
    the service's OpenAPI document gives a search that names none, each hit's score the API's, and the formula the
    note states gives those scores from the API's own vector and text rankings."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC

    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    fusion = {name: p["default"] for name, p in schemas["FusionSpec"]["properties"].items()}
    w = schemas["SearchRequest"]["properties"]["text_weight"]["default"]
    assert fusion["method"] == "rrf"
    rrf_k = fusion["k"]
    wait = _open_page(server, browser)
    query, k = "tombstones merge deleted documents", 5  # not a question: the full text weight
    _page_search(browser, wait, query, "vector", k, "")
    assert not browser.find_element(By.ID, "fusion-note").is_displayed()  # vector scores are no fusion's
    shown = _page_search(browser, wait, query, "hybrid", k, "")
    wait.until(EC.visibility_of_element_located((By.ID, "fusion-note")))
    note = browser.find_element(By.ID, "fusion-note").text
    assert f"reciprocal rank fusion (RRF, k = {rrf_k})" in note and f"text weight w = {w}" in note, note
    assert f"(1 − w) / ({rrf_k} + its vector rank) + w / ({rrf_k} + its text rank)" in note, note
    assert f"{w * fusion['question_share']:g} for a query phrased as a question" in note, note
    hybrid = search(client, texts=[query], k=k, mode="hybrid").json()["results"][0]
    assert shown == [h["id"] for h in hybrid]
    scores = browser.execute_script(
        "return [...document.querySelectorAll('#results li .hit-score')].map(s => s.textContent)")
    assert scores == [f"score {h['score']:.4f} (RRF)" for h in hybrid], scores
    # The note's formula, from the API's own rankings (each taken 20 deep, as hybrid takes them).
    ranks = {mode: {h["id"]: r for r, h in enumerate(search(client, texts=[query], k=20, mode=mode).json()
                                                     ["results"][0], 1)} for mode in ("vector", "text")}
    for h in hybrid:
        want = sum(weight / (rrf_k + ranks[mode][h["id"]]) for mode, weight in (("vector", 1 - w), ("text", w))
                   if h["id"] in ranks[mode])
        assert h["score"] == pytest.approx(want, rel=1e-9), (h["id"], h["score"], want)


def test_web_page_memory_table_shows_the_state_at_1280_px(server, browser, client):
    """#67 item 6: at a 1280 x 800 window the memory table's state column is in view for every collection (it was
    scrolled out of its panel): each row's state cell lies inside the table's visible box, is the element drawn at
    its own centre, and says what the API's build_state says, with the collection's name in view beside it."""
    names = [f"a-rather-long-collection-name-{i:02d}" for i in range(5)]
    for name in names:
        assert client.post("/v1/collections", json={"name": name, "dimension": 4, "metric": "l2"}).status_code == 201
    try:
        from selenium.webdriver.common.by import By

        wait = _open_page(server, browser)
        assert browser.execute_script("return [window.innerWidth, window.outerWidth]")[1] == 1280
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tiers tbody tr")) >= len(names) + 1)
        for name in ["demo", *names]:
            cells = browser.execute_script(
                "const tr = document.querySelector(`#tiers tr[data-collection='${arguments[0]}']`);"
                "window.scrollTo(0, window.scrollY + tr.getBoundingClientRect().top - 200);"  # down only
                "const wrap = document.getElementById('tiers').parentElement.getBoundingClientRect();"
                "const out = {};"
                "for (const [key, td] of [['name', tr.cells[0]], ['state', tr.cells[tr.cells.length - 1]]]) {"
                "  const r = td.getBoundingClientRect();"
                "  const at = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);"
                "  out[key] = {left: r.left, right: r.right, wrap_left: wrap.left, wrap_right: wrap.right,"
                "              width: r.width, drawn: td === at || td.contains(at), text: td.textContent};"
                "}"
                "return out;", name)
            for key, c in cells.items():
                assert c["width"] > 0 and c["wrap_left"] - 0.5 <= c["left"] and c["right"] <= c["wrap_right"] + 0.5, \
                    (name, key, c)
                assert c["drawn"], (name, key, c)
            assert cells["name"]["text"] == name
            assert cells["state"]["text"] == "ready"
            info = client.get(f"/v1/collections/{name}").json()["build_state"]
            assert info["progress"] is None and not info["merging"] and (info["import"] or {}).get("state") in \
                (None, "done"), info
    finally:
        for name in names:
            client.delete(f"/v1/collections/{name}")


def test_web_page_labels_vector_store_collections(server, browser, client):
    """#67 item 6: a vector store's collection (vs_<hex>) is labelled as one, with the store's name as
    /v1/vector_stores gives it, in the memory table and in the collection menu; other collections are not."""
    from selenium.webdriver.common.by import By

    store = client.post("/v1/vector_stores", json={"name": "team handbook"}).json()
    sid = store["id"]
    assert re.fullmatch(r"vs_[0-9a-f]{24}", sid) and client.get(f"/v1/collections/{sid}").status_code == 200
    try:
        wait = _open_page(server, browser)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#tiers tr[data-collection='{sid}'] .badge.store"))
        name = client.get(f"/v1/vector_stores/{sid}").json()["name"]
        badge = browser.find_element(By.CSS_SELECTOR, f"#tiers tr[data-collection='{sid}'] .badge.store")
        assert badge.text == f'vector store "{name}"' and badge.is_displayed()
        assert not browser.find_elements(By.CSS_SELECTOR, "#tiers tr[data-collection='demo'] .badge.store")
        options = {o.get_attribute("value"): o.text
                   for o in browser.find_elements(By.CSS_SELECTOR, "#collection option")}
        assert options[sid] == f'vector store "{name}" · {sid} (0)', options
        assert options["demo"] == f"demo ({len(corpus())})"
    finally:
        client.delete(f"/v1/vector_stores/{sid}")


def test_openapi_page_renders_the_operations_in_a_browser(server, browser):
    """/docs in headless Chromium: Swagger UI reads the OpenAPI 3.1 document FastAPI writes and lists its operations,
    loading nothing but the service's own files."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/docs")
    # Either the operations or Swagger UI's refusal of the document ("does not specify a valid version field").
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")
                                     or "Unable to render" in d.find_element(By.TAG_NAME, "body").text)
    assert "Unable to render" not in browser.find_element(By.TAG_NAME, "body").text
    paths = {e.get_attribute("data-path") for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert {"/v1/collections", "/v1/collections/{name}/search", "/v1/collections/{name}/documents"} <= paths
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(server.url + "/") for url in loaded), loaded
