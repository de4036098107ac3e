"""One HTTP API over any collection (#50): the same tests against the service over a collection, over a sharded
collection (the service's own app over a ShardedCatalog, as every Ray Serve router replica builds it; shards in this
process), and over a sharded collection in the service's data directory (created with a shard count, built by its
import: retriever/sharded/hosted.py), all served by uvicorn over real HTTP, behind API keys and the same limits.
Answers are checked against exact search in numpy over the 3000 vectors, which all hold in an index (the
collection merged), not against each other; only what the sharded service does not do differs, and is stated per
backend."""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest
from conftest import clustered
from integration_helpers import BACKENDS, serving_backend

from fusionrag.retriever.engine.config import BuildConfig
from fusionrag.server.auth import KeyRing, parse_entries
from fusionrag.server.config import ServerConfig

N, DIM, NAME = 3000, 16, "docs"
KEYS = f"good-key-123\nnarrow-key-1 other,team-*\nwide-key-12 {NAME}"
LIMITS = dict(max_k=50, max_queries=4, max_documents=1000)
GOOD = {"Authorization": "Bearer good-key-123"}
EXHAUSTIVE = {"nprobe": 4096, "rerank": N, "beta": 0}


@pytest.fixture(scope="module")
def base():
    return clustered(N, DIM, 20, seed=11, spread=0.6)


@pytest.fixture(scope="module", params=BACKENDS)
def service(request, tmp_path_factory, base):
    root = tmp_path_factory.mktemp(f"backend-{request.param}")
    keys = KeyRing(parse_entries(KEYS, "test"))
    config = ServerConfig(data_dir=str(root / "data"), demo=False, log_level="warning", **LIMITS)
    with serving_backend(request.param, root, NAME, config, base, keys=keys, headers=GOOD,
                         build=BuildConfig(threads=1, centroid_ratio=0.05)) as url:
        yield request.param, url


def post(url, path, body, headers=GOOD):
    return httpx.post(f"{url}/v1/collections/{NAME}{path}", json=body, headers=headers, timeout=60)


def exact(base, q, k):
    d = ((base.astype(np.float64) - q[None, :].astype(np.float64)) ** 2).sum(1)
    return [str(i) for i in np.argsort(d, kind="stable")[:k]]


def test_search_answers_the_exact_top_k(service, base):
    _, url = service
    q = base[[7, 1500, 2999]] + 0.02
    r = post(url, "/search", {"vectors": q.tolist(), "k": 10, "params": EXHAUSTIVE, "stats": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [[h["id"] for h in hits] for hits in body["results"]] == [exact(base, x, 10) for x in q]
    assert len(body["stats"]) == 3 and body.get("partial", False) is False


def test_limits_bad_input_and_unknown_names_are_answered_alike(service, base):
    _, url = service
    v = base[0].tolist()
    cases = [({"vectors": [v], "k": 51}, 422, "max_k"), ({"vectors": [v] * 5}, 422, "max_queries"),
             ({"vectors": [v[:-1]]}, 422, "dimension"), ({"vectors": [v], "filter": {"$nope": 1}}, 422, "$nope"),
             ({"texts": ["hi"]}, 422, "embedding model")]
    for body, status, words in cases:
        r = post(url, "/search", body)
        assert r.status_code == status and words in r.text, (body, r.text)
    r = httpx.post(f"{url}/v1/collections/{NAME}/search", content=b'{"vectors": [[NaN]]}', headers=GOOD)
    assert r.status_code == 422
    r = httpx.post(f"{url}/v1/collections/{NAME}/search", content=b'{"vectors": [[1, 2', headers=GOOD)
    assert r.status_code == 400 and "malformed JSON" in r.text
    assert post(url, "/documents/get", {"ids": [str(i) for i in range(1001)]}).status_code == 422
    # Text needs an embedding model, which this collection does not have (test_server's vector-only collection).
    r = post(url, "/documents", {"documents": [{"id": "t", "text": "no vector"}]})
    assert r.status_code == 422 and "no embedding model" in r.json()["detail"], r.text
    assert httpx.post(f"{url}/v1/collections/nope/search", json={"vectors": [v]}, headers=GOOD).status_code == 404
    assert httpx.post(f"{url}/v1/collections/bad name/search", json={"vectors": [v]},
                      headers=GOOD).status_code == 400


def test_api_keys(service, base):
    _, url = service
    body = {"vectors": [base[0].tolist()], "k": 1}
    r = post(url, "/search", body, headers={})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert post(url, "/search", body, headers={"Authorization": "Bearer wrong-key-9"}).status_code == 401
    narrow = {"Authorization": "Bearer narrow-key-1"}
    assert post(url, "/search", body, headers=narrow).status_code == 403
    assert httpx.get(f"{url}/v1/collections", headers=narrow).json() == {"collections": []}
    r = post(url, "/search", body, headers={"Authorization": "Bearer wide-key-12"})
    assert r.status_code == 200 and r.json()["results"][0][0]["id"] == "0"
    assert httpx.get(f"{url}/healthz").status_code == 200


def test_documents_written_read_counted_updated_and_deleted(service, base):
    _, url = service
    v = (base[42] + 0.001).tolist()
    doc = {"id": "note-1", "text": "a note about ships", "vector": v, "metadata": {"topic": "ships", "n": 1}}
    assert post(url, "/documents", {"documents": [doc]}).json() == {"ids": ["note-1"]}
    got = httpx.get(f"{url}/v1/collections/{NAME}/documents/note-1", headers=GOOD).json()
    assert (got["id"], got["text"], got["metadata"]) == ("note-1", doc["text"], doc["metadata"])
    assert post(url, "/search", {"vectors": [v], "k": 1}).json()["results"][0][0]["id"] == "note-1"
    assert post(url, "/documents/count", {"filter": {"topic": "ships"}}).json()["count"] == 1
    r = post(url, "/documents/metadata", {"documents": [{"id": "note-1", "metadata": {"n": 2, "extra": True}}],
                                          "merge": True})
    assert r.status_code == 200 and r.json() == {"updated": 1}, r.text
    got = post(url, "/documents/get", {"ids": ["note-1", "missing"]}).json()["documents"]
    assert [(d["id"], d["metadata"]) for d in got] == [("note-1", {"topic": "ships", "n": 2, "extra": True})]
    page = httpx.get(f"{url}/v1/collections/{NAME}/documents", params={"limit": 2}, headers=GOOD).json()
    assert len(page["documents"]) == 2 and page["next_cursor"] is not None
    assert post(url, "/documents/delete", {"ids": ["note-1"]}).json() == {"deleted": 1}
    assert httpx.get(f"{url}/v1/collections/{NAME}/documents/note-1", headers=GOOD).status_code == 404
    info = httpx.get(f"{url}/v1/collections/{NAME}", headers=GOOD).json()
    assert info["count"] == N


def test_what_only_a_collection_does(service, base):
    """Creating another collection, snapshots and the OpenAI vector stores: a collection's service does them (a
    sharded collection in its data directory too), the sharded service on Ray refuses them with a status that says
    so (422 / 405), not a 500."""
    kind, url = service
    create = httpx.post(f"{url}/v1/collections", json={"name": "other", "dimension": DIM}, headers=GOOD)
    snap = httpx.post(f"{url}/v1/collections/{NAME}/snapshots", headers=GOOD, timeout=60)
    stores = httpx.get(f"{url}/v1/vector_stores", headers=GOOD)
    if kind in ("single", "hosted"):
        assert (create.status_code, snap.status_code, stores.status_code) == (201, 201, 200), snap.text
        assert httpx.delete(f"{url}/v1/collections/other", headers=GOOD).status_code == 200
    else:
        assert create.status_code == 422 and "alone" in create.text
        assert snap.status_code == 405 and "snapshot" in snap.text
        assert stores.status_code == 405 and stores.json()["error"]["message"]
        assert httpx.delete(f"{url}/v1/collections/{NAME}", headers=GOOD).status_code == 405
        assert httpx.post(f"{url}/v1/collections", json={"name": NAME, "dimension": DIM},
                          headers=GOOD).status_code == 409
        ready = httpx.get(f"{url}/readyz", headers=GOOD).json()
        assert ready["status"] == "ready" and ready["shards_alive"] == [True, True, True]


def test_every_backend_takes_the_fast_search_path(service, base, fastapi_stack_passes):
    """#65 item 4: a search of a collection, of a sharded collection hosted by the service and of the app every Ray
    Serve router replica builds is answered before FastAPI's own stack (server/fastpath.py), as any other request is
    not: no second, slower path for sharded collections."""
    _, url = service
    passes = fastapi_stack_passes
    r = post(url, "/search", {"vectors": [base[3].tolist()], "k": 5, "params": EXHAUSTIVE})
    assert r.status_code == 200 and r.json()["results"][0][0]["id"] == "3", r.text
    assert httpx.get(f"{url}/v1/collections/{NAME}", headers=GOOD).status_code == 200
    assert passes == [f"/v1/collections/{NAME}"], passes  # the search passed none of FastAPI's layers


def test_offset_and_score_threshold_page_and_floor_the_ranking(service, base):
    """#67 item 7: `offset` gives each query's k hits after its best `offset`, `score_threshold` keeps the hits
    scored at least it; both checked against the same search asked for more, and k + offset bounded by max_k."""
    _, url = service
    q = (base[[11, 2222]] + 0.03).tolist()
    full = post(url, "/search", {"vectors": q, "k": 12, "params": EXHAUSTIVE}).json()["results"]
    page = post(url, "/search", {"vectors": q, "k": 5, "offset": 4, "params": EXHAUSTIVE}).json()["results"]
    assert [[h["id"] for h in hits] for hits in page] == [[h["id"] for h in hits[4:9]] for hits in full]
    for hits in full:
        low = (hits[5]["score"] + hits[6]["score"]) / 2
        r = post(url, "/search", {"vectors": [q[full.index(hits)]], "k": 12, "score_threshold": low,
                                  "params": EXHAUSTIVE})
        assert [h["id"] for h in r.json()["results"][0]] == [h["id"] for h in hits if h["score"] >= low]
    r = post(url, "/search", {"vectors": q, "k": 40, "offset": 20})
    assert r.status_code == 422 and "k + offset" in r.text, r.text
    assert post(url, "/search", {"vectors": q, "k": 2, "offset": -1}).status_code == 422


def test_recommend_by_ids_is_the_exact_search_of_its_query(service, base):
    """#67 item 7: recommend by stored ids (Qdrant's average-vector strategy): the hits are the exact nearest of
    2 x mean(positive) - mean(negative), the examples left out; an unknown id is 404, no positive 422."""
    _, url = service
    pos, neg = ["5", "17", "1200"], ["2900"]
    r = post(url, "/recommend", {"positive": pos, "negative": neg, "k": 8, "params": EXHAUSTIVE})
    assert r.status_code == 200, r.text
    q = 2 * base[[int(i) for i in pos]].astype(np.float64).mean(0) - base[[int(i) for i in neg]].mean(0)
    want = [i for i in exact(base, q.astype(np.float32), 12) if i not in pos + neg][:8]
    assert [h["id"] for h in r.json()["results"]] == want
    only = post(url, "/recommend", {"positive": ["42"], "k": 5, "params": EXHAUSTIVE}).json()["results"]
    assert [h["id"] for h in only] == [i for i in exact(base, base[42], 6) if i != "42"][:5]
    assert post(url, "/recommend", {"positive": ["nope"], "k": 3}).status_code == 404
    assert post(url, "/recommend", {"positive": [], "k": 3}).status_code == 422


def test_filters_answer_alike_in_search_count_scroll_and_delete(service, base):
    """#69 item 1: the filter routes on every backend. Twelve documents with metadata beside the 3000 without: a
    search under a filter answers the exact top-k of the documents it passes, count and a filtered scroll see
    exactly those, a delete by filter removes exactly those and no other."""
    _, url = service
    ids = [f"f{i}" for i in range(12)]
    vecs = base[100:112] + 0.003
    docs = [{"id": d, "vector": v.tolist(), "metadata": {"colour": "red" if i % 3 == 0 else "blue", "i": i}}
            for i, (d, v) in enumerate(zip(ids, vecs))]
    assert post(url, "/documents", {"documents": docs}).status_code == 200
    red, blue = [d for i, d in enumerate(ids) if i % 3 == 0], [d for i, d in enumerate(ids) if i % 3]
    try:
        q = vecs[1]
        r = post(url, "/search", {"vectors": [q.tolist()], "k": 10, "filter": {"colour": "red"}, "params": EXHAUSTIVE})
        assert r.status_code == 200, r.text
        dist = ((vecs[[0, 3, 6, 9]].astype(np.float64) - q) ** 2).sum(1)
        assert [h["id"] for h in r.json()["results"][0]] == [red[j] for j in np.argsort(dist, kind="stable")]
        assert post(url, "/documents/count", {"filter": {"colour": "red"}}).json()["count"] == 4
        assert post(url, "/documents/count", {"filter": {"i": {"$gte": 6}}}).json()["count"] == 6
        seen, cursor = [], None
        while True:
            params = {"limit": 3, "filter": json.dumps({"colour": "blue"}), **({"cursor": cursor} if cursor else {})}
            page = httpx.get(f"{url}/v1/collections/{NAME}/documents", params=params, headers=GOOD).json()
            seen += [d["id"] for d in page["documents"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert sorted(seen) == sorted(blue)
        assert post(url, "/documents/delete", {"filter": {"colour": "red"}}).json() == {"deleted": 4}
        assert post(url, "/documents/count", {"filter": {"colour": "red"}}).json()["count"] == 0
        assert post(url, "/documents/count", {}).json()["count"] == N + 8
    finally:
        post(url, "/documents/delete", {"ids": ids})
    assert httpx.get(f"{url}/v1/collections/{NAME}", headers=GOOD).json()["count"] == N


def test_an_import_into_a_collection_that_holds_documents_is_refused_alike(service, base):
    """The contract's optional import: a collection (and a sharded one in a data directory) built already refuses
    a second import with 409, the sharded service with 405; nothing changes either way."""
    kind, url = service
    buf = io.BytesIO()
    np.save(buf, base[:10])
    r = httpx.post(f"{url}/v1/collections/{NAME}/import", files={"vectors": ("more.npy", buf.getvalue())},
                   headers=GOOD, timeout=60)
    assert r.status_code == (405 if kind == "sharded" else 409), r.text
    assert "import" in r.text
    assert httpx.get(f"{url}/v1/collections/{NAME}", headers=GOOD).json()["count"] == N
