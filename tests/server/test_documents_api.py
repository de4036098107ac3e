"""Batch reads, scrolling and delete-by-filter, over HTTP against the real service, and the engine's
delete_where replayed from the log: documents come back in the order asked, a scroll sees each document
present throughout exactly once while writes go on, a delete by filter is one durable write, search hits
carry their vectors when asked, keys scoped elsewhere get 403, and the OpenAPI document says all of it."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib

import httpx
import numpy as np
import pytest
from integration_helpers import BACKENDS, serving_backend
from server_util import ServerProcess

from fusionrag.retriever.collection import Catalog
from fusionrag.server.auth import KeyRing, parse_entries
from fusionrag.server.config import ServerConfig

MAX_DOCS = 16
ADMIN = "admin-key-0123456789"
TEAM = "team-key-0123456789"


def _vec(i: int) -> list[float]:
    return np.random.default_rng(i).standard_normal(4).astype(np.float32).tolist()


def _docs(ids, **meta) -> list[dict]:
    return [{"id": d, "text": f"text of {d}", "vector": _vec(zlib.crc32(d.encode())), "metadata": {"name": d, **meta}}
            for d in ids]


def _write(c, name: str, docs: list[dict]) -> None:
    for i in range(0, len(docs), MAX_DOCS):
        r = c.post(f"/v1/collections/{name}/documents", json={"documents": docs[i:i + MAX_DOCS]})
        assert r.status_code == 200, r.text


def _create(c, name: str) -> None:
    r = c.post("/v1/collections", json={"name": name, "dimension": 4, "metric": "l2"})
    assert r.status_code == 201, r.text


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A service with two keys (every collection; team-* only) and max_documents 16."""
    root = tmp_path_factory.mktemp("documents-api")
    (root / "keys").write_text(f"{ADMIN}\n{TEAM} team-*\n")
    srv = ServerProcess(root / "data", root / "server.log", "--no-demo", "--max-documents", str(MAX_DOCS),
                        "--api-keys-file", str(root / "keys"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def admin(service):
    with service.client(headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        yield c


def test_batch_get_returns_documents_in_the_order_asked(admin):
    _create(admin, "team-get")
    docs = _docs([f"d{i}" for i in range(20)])
    _write(admin, "team-get", docs)
    r = admin.post("/v1/collections/team-get/documents/get", json={"ids": ["d5", "missing", "d1", "d5"]})
    assert r.status_code == 200, r.text
    got = r.json()["documents"]
    assert [d["id"] for d in got] == ["d5", "d1", "d5"]  # missing ids left out, the rest as asked
    assert got[0] == {"id": "d5", "text": "text of d5", "metadata": {"name": "d5"}}  # no vector unless asked
    r = admin.post("/v1/collections/team-get/documents/get", json={"ids": ["d7", "d3"], "with_vectors": True})
    by_id = {d["id"]: d for d in docs}
    for d in r.json()["documents"]:
        assert np.array_equal(np.float32(d["vector"]), np.float32(by_id[d["id"]]["vector"]))
    r = admin.post("/v1/collections/team-get/documents/get", json={"ids": [f"d{i}" for i in range(MAX_DOCS + 1)]})
    assert r.status_code == 422 and f"at most {MAX_DOCS} allowed (max_documents)" in r.json()["detail"]
    for body in ({"ids": []}, {"ids": [""]}, {"ids": ["a"], "extra": 1}, {"ids": ["a"], "with_vectors": "yes"}):
        assert admin.post("/v1/collections/team-get/documents/get", json=body).status_code == 422, body
    assert admin.post("/v1/collections/team-nope/documents/get", json={"ids": ["a"]}).status_code == 404
    # The verbs' paths are theirs (OpenAPI matches concrete paths first): documents named so are read by POST.
    _write(admin, "team-get", _docs(["get", "delete", "get\n"]))
    r = admin.get("/v1/collections/team-get/documents/get")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert admin.get("/v1/collections/team-get/documents/get%0A").json()["id"] == "get\n"
    r = admin.post("/v1/collections/team-get/documents/get", json={"ids": ["delete", "get"]})
    assert [d["id"] for d in r.json()["documents"]] == ["delete", "get"]


def _scroll(c, name: str, between=None, **params) -> tuple[list[str], list[int]]:
    """Every id a scroll returns, in order, and each page's size; between(page_number) runs after each page."""
    ids, sizes, cursor, page = [], [], None, 0
    while True:
        q = {**params, **({"cursor": cursor} if cursor else {})}
        r = c.get(f"/v1/collections/{name}/documents", params=q)
        assert r.status_code == 200, r.text
        body = r.json()
        ids += [d["id"] for d in body["documents"]]
        sizes.append(len(body["documents"]))
        cursor = body["next_cursor"]
        if cursor is None:
            return ids, sizes
        page += 1
        if between:
            between(page)


def test_scroll_sees_each_document_present_throughout_once_while_writes_go_on(admin):
    _create(admin, "team-scroll")
    _write(admin, "team-scroll", _docs([f"d{i:02d}" for i in range(40)], even=False))

    def writes(page: int) -> None:
        if page == 1:  # d00..d06 seen: replace one seen and one not, delete one not seen, add new ones
            _write(admin, "team-scroll", _docs(["d02", "d25", "new0", "new1"], even=False))
            assert admin.post("/v1/collections/team-scroll/documents/delete", json={"ids": ["d30"]}).json() == \
                {"deleted": 1}

    ids, sizes = _scroll(admin, "team-scroll", writes, limit=7)
    assert max(sizes) == 7 and sizes[-1] > 0  # no empty last page: next_cursor is null on the last one
    untouched = {f"d{i:02d}" for i in range(40)} - {"d02", "d25", "d30"}
    assert all(ids.count(d) == 1 for d in untouched), ids
    assert "d30" not in ids and ids.count("d25") == 1 and ids.count("new0") == ids.count("new1") == 1
    assert ids.count("d02") == 2 and ids[-4:] == ["d02", "d25", "new0", "new1"]  # a replaced one moves to the end
    # Default page: min(100, max_documents); a filter given as JSON.
    assert _scroll(admin, "team-scroll")[1][0] == MAX_DOCS
    _write(admin, "team-scroll", _docs(["e1", "e2", "e3"], even=True))
    flt = json.dumps({"even": True})
    assert _scroll(admin, "team-scroll", filter=flt, limit=2) == (["e1", "e2", "e3"], [2, 1])
    got = admin.get("/v1/collections/team-scroll/documents", params={"filter": flt, "with_vectors": "true"}).json()
    assert np.array_equal(np.float32(got["documents"][0]["vector"]), np.float32(_docs(["e1"])[0]["vector"]))
    r = admin.get("/v1/collections/team-scroll/documents", params={"filter": json.dumps({"even": "true"})})
    assert r.json()["documents"] == [] and "hold it as bools only" in r.json()["warnings"][0]


# A scroll's bad input, and the 4xx and words each gets (on every backend alike: the route checks it).
BAD_SCROLLS = [
    ({"limit": MAX_DOCS + 1}, 422, f"at most {MAX_DOCS} allowed (max_documents)"),
    ({"limit": 0}, 422, "limit"),
    ({"cursor": "abc"}, 422, "cursor"),
    ({"filter": "{"}, 400, "the filter query parameter: malformed JSON"),
    ({"filter": "[1]"}, 422, "must be a JSON object"),
    ({"filter": '{"a": {"$near": 1}}'}, 422, "unknown operator '$near'"),
    ({"filter": '{"a": ' + "[" * 200 + "]" * 200 + "}"}, 422, "more than 100 deep"),
]


@pytest.mark.parametrize("params, status, words", BAD_SCROLLS)
def test_scroll_refuses_bad_input_with_a_clear_4xx(admin, params, status, words):
    if admin.get("/v1/collections/team-bad").status_code == 404:
        _create(admin, "team-bad")
    r = admin.get("/v1/collections/team-bad/documents", params=params)
    assert r.status_code == status and words in r.json()["detail"], r.text


def test_delete_by_filter_is_one_write_that_survives_a_restart(tmp_path):
    srv = ServerProcess(tmp_path / "data", tmp_path / "a.log", "--no-demo")
    try:
        srv.wait_ready()
        with srv.client() as c:
            _create(c, "years")
            docs = [{"id": f"y{y}", "vector": _vec(y), "metadata": {"year": y, "tags": ["old"] if y < 2015 else []}}
                    for y in range(2000, 2025)]
            _write(c, "years", docs)
            r = c.post("/v1/collections/years/documents/delete", json={"filter": {"year": {"$lt": 2010}}})
            assert r.json() == {"deleted": 10}
            r = c.request("DELETE", "/v1/collections/years/documents", json={"filter": {"tags": {"$contains": "old"}}})
            assert r.json() == {"deleted": 5}  # 2010..2014
            r = c.request("DELETE", "/v1/collections/years/documents", json={"ids": ["y2015", "y1999"]})
            assert r.json() == {"deleted": 1}  # the ids contract as before: unknown ids ignored
            for body, words in (({}, "exactly one of 'ids' and 'filter'"),
                                ({"ids": ["y2016"], "filter": {"year": 2016}}, "exactly one of 'ids' and 'filter'"),
                                ({"filter": {}}, "non-empty"), ({"filter": None}, "filter"),
                                ({"filter": {"year": {"$lt": "x", "$foo": 1}}}, "unknown operator")):
                r = c.post("/v1/collections/years/documents/delete", json=body)
                assert r.status_code == 422 and words in r.json()["detail"], (body, r.text)
            assert c.get("/v1/collections/years").json()["count"] == 9
        assert srv.stop() == 0
        srv = ServerProcess(tmp_path / "data", tmp_path / "b.log", "--no-demo")
        srv.wait_ready()
        with srv.client() as c:
            ids, _ = _scroll(c, "years")
            assert ids == [f"y{y}" for y in range(2016, 2025)]
            hits = c.post("/v1/collections/years/search", json={"vectors": [_vec(2003)], "k": 25}).json()["results"][0]
            assert sorted(h["id"] for h in hits) == ids
    finally:
        srv.stop()


def test_search_hits_carry_their_vectors_when_asked(admin):
    _create(admin, "team-search")
    docs = _docs([f"s{i}" for i in range(12)])
    _write(admin, "team-search", docs)
    by_id = {d["id"]: np.float32(d["vector"]) for d in docs}
    body = {"vectors": [docs[3]["vector"], docs[8]["vector"]], "k": 5}
    plain = admin.post("/v1/collections/team-search/search", json=body).json()["results"]
    assert all("vector" not in h for q in plain for h in q)
    with_vectors = admin.post("/v1/collections/team-search/search", json={**body, "with_vectors": True}).json()
    for q, p in zip(with_vectors["results"], plain):
        assert [h["id"] for h in q] == [h["id"] for h in p]
        for h in q:
            assert np.array_equal(np.float32(h["vector"]), by_id[h["id"]]), h["id"]
    text = admin.post("/v1/collections/team-search/search",
                      json={"texts": ["text of s4"], "mode": "text", "k": 2, "with_vectors": True}).json()
    assert all(np.array_equal(np.float32(h["vector"]), by_id[h["id"]]) for h in text["results"][0])


def test_keys_scoped_to_other_collections_get_403(service, admin):
    _create(admin, "other")
    calls = [("POST", "/v1/collections/{}/documents/get", {"json": {"ids": ["a"]}}),
             ("GET", "/v1/collections/{}/documents", {}),
             ("POST", "/v1/collections/{}/documents/count", {"json": {}}),
             ("POST", "/v1/collections/{}/documents/delete", {"json": {"filter": {"a": 1}}}),
             ("DELETE", "/v1/collections/{}/documents", {"json": {"filter": {"a": 1}}})]
    with service.client(headers={"Authorization": f"Bearer {TEAM}"}) as team, service.client() as anonymous:
        for method, path, kw in calls:
            assert team.request(method, path.format("other"), **kw).status_code == 403, path
            assert anonymous.request(method, path.format("team-x"), **kw).status_code == 401, path
            assert admin.request(method, path.format("other"), **kw).status_code == 200, path


def test_openapi_document_declares_the_new_routes(service):
    with service.client() as c:
        doc = c.get("/openapi.json").json()
    paths, schemas = doc["paths"], doc["components"]["schemas"]

    def ref(op, status="200"):
        return op["responses"][status]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]

    get = paths["/v1/collections/{name}/documents/get"]["post"]
    assert get["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/GetRequest")
    assert schemas["GetRequest"]["properties"]["ids"]["maxItems"] == MAX_DOCS
    assert ref(get) == "Documents" and {"403", "404", "413", "422"} <= set(get["responses"])
    scroll = paths["/v1/collections/{name}/documents"]["get"]
    params = {p["name"]: p for p in scroll["parameters"]}
    assert params["limit"]["schema"]["maximum"] == MAX_DOCS and params["limit"]["schema"]["default"] == MAX_DOCS
    assert params["cursor"]["schema"]["pattern"] == "^[0-9]{1,19}$"  # 19: a sharded collection's ids
    assert params["filter"]["content"]["application/json"]["schema"] == {"type": "object"}
    assert ref(scroll) == "DocumentsPage" and set(schemas["DocumentsPage"]["required"]) == {"documents", "next_cursor"}
    for op in (paths["/v1/collections/{name}/documents/delete"]["post"],
               paths["/v1/collections/{name}/documents"]["delete"]):
        assert ref(op) == "Deleted" and "507" in op["responses"]
    assert [b["required"] for b in schemas["DeleteRequest"]["oneOf"]] == [["ids"], ["filter"]]
    assert schemas["DeleteRequest"]["properties"]["ids"]["maxItems"] == MAX_DOCS
    assert schemas["SearchRequest"]["properties"]["with_vectors"]["type"] == "boolean"
    count = paths["/v1/collections/{name}/documents/count"]["post"]
    assert ref(count) == "Counted" and count["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/CountRequest") and "filter" in schemas["CountRequest"]["properties"]
    metadata = paths["/v1/collections/{name}/documents/metadata"]["post"]
    assert schemas["MetadataRequest"]["properties"]["documents"]["maxItems"] == MAX_DOCS and ref(metadata) == "Updated"


def test_count_nested_fields_and_a_misspelled_field_over_http(admin, service):
    """#49: a count with a filter, filters on an object's values by dotted path, and a warning (with the nearest
    stored name) when a filter names a field no document holds, on search, scroll and count alike."""
    _create(admin, "counted")
    docs = [{"id": f"c{i}", "text": f"text {i}", "vector": _vec(i),
             "metadata": {"src": {"page": i % 4, "file": "a.md" if i < 6 else "b.md"}, "n": i}} for i in range(10)]
    _write(admin, "counted", docs)
    base = "/v1/collections/counted/documents"
    assert admin.post(f"{base}/count", json={}).json() == {"count": 10}
    assert admin.post(f"{base}/count").json() == {"count": 10}  # no body: all of them
    assert admin.post(f"{base}/count", json={"filter": {"src.page": {"$gte": 2}}}).json() == {"count": 4}
    assert admin.get(f"{base}/count").status_code == 405  # "count" is not a document id
    listed = admin.get(base, params={"filter": json.dumps({"src.file": "b.md"})}).json()["documents"]
    assert sorted(d["id"] for d in listed) == ["c6", "c7", "c8", "c9"]
    found = admin.post("/v1/collections/counted/search",
                       json={"vectors": [_vec(3)], "k": 3, "filter": {"src.page": 3, "n": {"$lt": 5}}}).json()
    assert [h["id"] for h in found["results"][0]] == ["c3"] and "warnings" not in found
    typo = admin.post(f"{base}/count", json={"filter": {"src.pgae": 1}}).json()
    assert typo["count"] == 0 and "'src.page'" in typo["warnings"][0] and "no document holds" in typo["warnings"][0]
    found = admin.post("/v1/collections/counted/search", json={"vectors": [_vec(3)], "k": 3, "filter": {"N": 1}}).json()
    assert found["results"] == [[]] and "'n'" in found["warnings"][0]
    assert admin.post(f"{base}/count", json={"filter": [1]}).status_code == 422
    assert admin.post(f"{base}/count", json={"filter": {"n": {"$regex": 1}}}).status_code == 422
    assert admin.post(f"{base}/count", json={"where": {}}).status_code == 422
    assert admin.post("/v1/collections/nope/documents/count", json={}).status_code == 404
    assert admin.get(f"{base}/c3").json()["id"] == "c3"  # ids still read; "count" is the route's
    from fusionrag.client import Client

    with Client(service.url, ADMIN) as client:
        assert client.count("counted") == 10 and client.count("counted", filter={"src.file": "a.md"}) == 6


CRASH_CHILD = """
import os, sys
from fusionrag.retriever.collection import Catalog, Document
from fusionrag.retriever.collection.store import LocalStore
col = Catalog(sys.argv[1]).create("c", 2, "l2")
col.upsert([Document(f"old{i}", None, [i, 0], {"kind": "draft" if i % 2 else "final"}) for i in range(6)])
LocalStore._apply_pending = lambda self: None  # logged and fsynced, never applied: as if killed just after
col.upsert([Document("a", None, [9, 9], {"kind": "draft"})])
col.delete_where({"kind": "draft"})
col.upsert([Document("b", None, [8, 8], {"kind": "draft"})])
os._exit(0)
"""


def test_delete_where_is_replayed_at_its_place_in_the_log(tmp_path):
    """A delete by filter logged (and fsynced) but not applied before the process died is applied on the next
    open, between the writes logged around it: it removes what matched then, not what was written after."""
    run = subprocess.run([sys.executable, "-c", CRASH_CHILD, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    cat = Catalog(tmp_path)
    try:
        col = cat.get("c")
        docs, after = col.scroll(100)
        assert [d.id for d in docs] == ["old0", "old2", "old4", "b"] and after is None
        assert col.delete_where({"kind": "final"}) == 3 and len(col) == 1
    finally:
        cat.close()


def test_set_metadata_over_http_and_the_client(admin, service):
    _create(admin, "meta")
    _write(admin, "meta", _docs(["m0", "m1", "m2"], kind="draft"))
    url = "/v1/collections/meta/documents/metadata"
    r = admin.post(url, json={"documents": [{"id": "m0", "metadata": {"kind": "final", "name": None}},
                                            {"id": "zz", "metadata": {}}]})
    assert r.status_code == 200 and r.json() == {"updated": 1}
    assert admin.get("/v1/collections/meta/documents/m0").json()["metadata"] == {"kind": "final"}
    r = admin.post(url, json={"documents": [{"id": "m1", "metadata": {"x": 1}}], "merge": False})
    assert r.json() == {"updated": 1} and admin.get("/v1/collections/meta/documents/m1").json()["metadata"] == {"x": 1}
    count = admin.post("/v1/collections/meta/documents/count", json={"filter": {"kind": "draft"}})
    assert count.json()["count"] == 1
    found = admin.post("/v1/collections/meta/search", json={"vectors": [_vec(zlib.crc32(b"m0"))], "k": 1,
                                                            "filter": {"kind": "final"}}).json()["results"][0]
    assert [h["id"] for h in found] == ["m0"] and found[0]["text"] == "text of m0"
    for body, status in (({"documents": []}, 422), ({"documents": [{"id": "m0"}]}, 422),
                         ({"documents": [{"id": "m0", "metadata": [1]}]}, 422),
                         ({"documents": [{"id": "m0", "metadata": {}}] * 2}, 422),
                         ({"documents": [{"id": f"d{i}", "metadata": {}} for i in range(MAX_DOCS + 1)]}, 422),
                         ({"documents": [{"id": "m0", "metadata": {}}], "merge": "yes"}, 422)):
        r = admin.post(url, json=body)
        assert r.status_code == status, (body, r.text)
    assert admin.get("/v1/collections/meta/documents/m0").json()["metadata"] == {"kind": "final"}  # none applied
    with service.client(headers={"Authorization": f"Bearer {TEAM}"}) as team:
        assert team.post(url, json={"documents": [{"id": "m0", "metadata": {}}]}).status_code == 403
    from fusionrag.client import Client

    with Client(service.url, ADMIN) as client:
        assert client.set_metadata("meta", {"m2": {"kind": None, "tag": "t"}}) == 1
        assert client.get("meta", ["m2"])[0].metadata == {"name": "m2", "tag": "t"}
        assert client.set_metadata("meta", {"m2": {"only": True}}, merge=False) == 1
        assert client.count("meta", filter={"only": True}) == 1


def test_a_text_analyzer_and_a_fusion_over_http(admin):
    """#49 item 2: a collection created with its text analyzer, searched in hybrid mode with a chosen fusion; the
    client passes both; bad values are a 422 that names them."""
    from fusionrag.client import Client

    plain = {"stemming": "none", "stop_words": "none"}
    r = admin.post("/v1/collections", json={"name": "analyzed", "dimension": 4, "metric": "l2", "text_analyzer": plain})
    assert r.status_code == 201 and r.json()["text_analyzer"] == plain, r.text
    _create(admin, "stemmed")
    docs = [{"id": "runs", "text": "the engine runs", "vector": [1, 0, 0, 0]},
            {"id": "running", "text": "running late", "vector": [0, 1, 0, 0]},
            {"id": "the", "text": "the the", "vector": [0, 0, 1, 0]}]
    for name in ("analyzed", "stemmed"):
        _write(admin, name, docs)

    def text(name, query):
        r = admin.post(f"/v1/collections/{name}/search", json={"texts": [query], "mode": "text", "k": 5})
        assert r.status_code == 200, r.text
        return {h["id"] for h in r.json()["results"][0]}

    assert text("stemmed", "run") == {"runs", "running"} and text("analyzed", "run") == set()
    assert text("stemmed", "the") == {"runs", "the"}  # a query of stop words alone keeps them
    assert text("analyzed", "the runs") == {"runs", "the"} and text("stemmed", "the runs") == {"runs", "running"}
    body = {"texts": ["running"], "vectors": [[1, 0, 0, 0]], "mode": "hybrid", "k": 3, "text_weight": 0.5}
    rrf = admin.post("/v1/collections/stemmed/search", json={**body, "fusion": {"method": "rrf", "k": 1}}).json()
    weighted = admin.post("/v1/collections/stemmed/search", json={**body, "fusion": {"method": "weighted"}}).json()
    # rrf, k 1: runs 0.5/2 + 0.5/3 (vector 1st, text 2nd), running 0.5/3 + 0.5/2: a tie, broken by insertion order
    assert [h["score"] for h in rrf["results"][0]][:2] == pytest.approx([0.5 / 2 + 0.5 / 3] * 2)
    # weighted: running is the text's best (1) and the vector's third of three (0); runs the vector's best (1),
    # the text's worst (0): 0.5 each; "the" is 1 - d/d_max of the vectors, 0.5 x 0.5 (equidistant with running)
    assert {h["id"]: round(h["score"], 6) for h in weighted["results"][0]}["runs"] == 0.5
    for bad, word in (({"method": "borda"}, "method"), ({"method": "rrf", "k": 0}, "k")):
        r = admin.post("/v1/collections/stemmed/search", json={**body, "fusion": bad})
        assert r.status_code == 422 and word in r.text, r.text
    r = admin.post("/v1/collections", json={"name": "bad-analyzer", "dimension": 4,
                                            "text_analyzer": {"stemming": "snowball"}})
    assert r.status_code == 422 and "stemming" in r.text
    with Client(str(admin.base_url), api_key=ADMIN) as c:
        assert c.create_collection("via-client", 4, metric="l2", text_analyzer={"stop_words": "none"}).name == \
            "via-client"
        assert admin.get("/v1/collections/via-client").json()["text_analyzer"] == {"stemming": "porter",
                                                                                   "stop_words": "none"}
        res = c.search("stemmed", [0, 1, 0, 0], texts=["running"], mode="hybrid", k=3,
                       fusion={"method": "rrf", "k": 1})
        assert res.hits[0][0].id == "running" and res.hits[0][0].score == pytest.approx(0.5 / 2 + 0.5 / 2)


# -- the same routes on every backend (#69 item 1) ---------------------------------------------------------------
# A collection "docs" of SHARED documents (all in its index) on each of integration_helpers.BACKENDS, served in this
# process behind the same two keys and max_documents; a sharded backend creates no collection of the test's own
# (test_server.py's new_collection), so these tests share the one the fixture made. Answers are checked against the
# documents as written (and an exact search in numpy), not against another backend.

SHARED = 200


def _shared_docs() -> list[dict]:
    return [{"id": f"d{i:03d}", "text": f"text of d{i:03d}", "vector": _vec(i),
             "metadata": {"name": f"d{i:03d}", "n": i, "src": {"page": i % 4, "file": "a.md" if i < 150 else "b.md"}}}
            for i in range(SHARED)]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tmp_path_factory):
    """(kind, base URL) of the service over "docs" on each backend, with the module's two keys."""
    root = tmp_path_factory.mktemp(f"documents-{request.param}")
    keys = KeyRing(parse_entries(f"{ADMIN}\n{TEAM} team-*", "test"))
    config = ServerConfig(data_dir=str(root / "data"), demo=False, log_level="warning", max_documents=MAX_DOCS)
    docs = _shared_docs()
    vectors = np.asarray([d["vector"] for d in docs], dtype=np.float32)
    with serving_backend(request.param, root, "docs", config, vectors, keys=keys, shards=2,
                         headers={"Authorization": f"Bearer {ADMIN}"},
                         documents=[{k: d[k] for k in ("id", "text", "metadata")} for d in docs]) as url:
        yield request.param, url


@pytest.fixture
def on(backend):
    kind, url = backend
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        yield kind, c


def test_every_backend_batch_gets_in_the_order_asked(on):
    _, c = on
    r = c.post("/v1/collections/docs/documents/get", json={"ids": ["d005", "missing", "d001", "d005"]})
    assert r.status_code == 200, r.text
    got = r.json()["documents"]
    assert [d["id"] for d in got] == ["d005", "d001", "d005"]
    want = _shared_docs()[5]
    assert got[0] == {"id": "d005", "text": want["text"], "metadata": want["metadata"]}  # no vector unless asked
    r = c.post("/v1/collections/docs/documents/get", json={"ids": ["d007", "d003"], "with_vectors": True})
    assert [d["id"] for d in r.json()["documents"]] == ["d007", "d003"]
    for d in r.json()["documents"]:
        assert np.array_equal(np.float32(d["vector"]), np.float32(_vec(int(d["id"][1:]))))
    r = c.post("/v1/collections/docs/documents/get", json={"ids": [f"d{i:03d}" for i in range(MAX_DOCS + 1)]})
    assert r.status_code == 422 and f"at most {MAX_DOCS} allowed (max_documents)" in r.json()["detail"]
    for body in ({"ids": []}, {"ids": [""]}, {"ids": ["a"], "extra": 1}, {"ids": ["a"], "with_vectors": "yes"}):
        assert c.post("/v1/collections/docs/documents/get", json=body).status_code == 422, body
    assert c.post("/v1/collections/team-nope/documents/get", json={"ids": ["a"]}).status_code == 404
    r = c.get("/v1/collections/docs/documents/get")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_every_backend_search_hits_carry_their_vectors_when_asked(on):
    _, c = on
    base = np.float32([_vec(i) for i in range(SHARED)])
    q = [_vec(3), _vec(150)]
    body = {"vectors": q, "k": 5, "params": {"nprobe": 4096, "rerank": SHARED, "beta": 0}}
    plain = c.post("/v1/collections/docs/search", json=body).json()["results"]
    for hits, x in zip(plain, q):  # the exact top 5 in numpy
        d = ((base.astype(np.float64) - np.float64(x)) ** 2).sum(1)
        assert [h["id"] for h in hits] == [f"d{j:03d}" for j in np.argsort(d, kind="stable")[:5]]
        assert all("vector" not in h for h in hits)
    with_vectors = c.post("/v1/collections/docs/search", json={**body, "with_vectors": True}).json()
    for hits, p in zip(with_vectors["results"], plain):
        assert [h["id"] for h in hits] == [h["id"] for h in p]
        for h in hits:
            assert np.array_equal(np.float32(h["vector"]), base[int(h["id"][1:])]), h["id"]
    text = c.post("/v1/collections/docs/search",
                  json={"texts": ["d004"], "mode": "text", "k": 2, "with_vectors": True}).json()
    assert [h["id"] for h in text["results"][0]] == ["d004"]  # the one text holding the token
    assert np.array_equal(np.float32(text["results"][0][0]["vector"]), base[4])


def test_every_backend_counts_nested_fields_and_warns_of_a_misspelled_one(on):
    _, c = on
    base = "/v1/collections/docs/documents"
    assert c.post(f"{base}/count", json={}).json() == {"count": SHARED}
    assert c.post(f"{base}/count").json() == {"count": SHARED}
    assert c.post(f"{base}/count", json={"filter": {"src.page": {"$gte": 2}}}).json() == {"count": SHARED // 2}
    assert c.get(f"{base}/count").status_code == 405
    ids, sizes = _scroll(c, "docs", filter=json.dumps({"src.file": "b.md"}))
    assert sorted(ids) == [f"d{i:03d}" for i in range(150, SHARED)] and max(sizes) == MAX_DOCS
    found = c.post("/v1/collections/docs/search",
                   json={"vectors": [_vec(3)], "k": 3, "filter": {"src.page": 3, "n": {"$lt": 5}}}).json()
    assert [h["id"] for h in found["results"][0]] == ["d003"] and "warnings" not in found
    typo = c.post(f"{base}/count", json={"filter": {"src.pgae": 1}}).json()
    assert typo["count"] == 0 and "no document holds" in typo["warnings"][0], typo
    found = c.post("/v1/collections/docs/search", json={"vectors": [_vec(3)], "k": 3, "filter": {"N": 1}}).json()
    assert found["results"] == [[]] and "'N'" in found["warnings"][0], found
    assert c.post(f"{base}/count", json={"filter": [1]}).status_code == 422
    assert c.post(f"{base}/count", json={"filter": {"n": {"$regex": 1}}}).status_code == 422
    assert c.post(f"{base}/count", json={"where": {}}).status_code == 422
    # docs/collections.md: the warning names "the stored fields nearest a missing one's name" (a collection's
    # does: 'src.page' for 'src.pgae', 'n' for 'N'); checked last, so the rest above holds on every backend.
    said = {"count {'src.pgae': 1}": (typo["warnings"][0], "'src.page'"),
            "search {'N': 1}": (found["warnings"][0], "'n'")}
    missing = {route: warning for route, (warning, nearest) in said.items() if nearest not in warning}
    assert not missing, f"the filter warnings name no nearest stored field on this backend: {missing}"


@pytest.mark.parametrize("params, status, words", BAD_SCROLLS)
def test_every_backend_refuses_a_bad_scroll_alike(on, params, status, words):
    _, c = on
    r = c.get("/v1/collections/docs/documents", params=params)
    assert r.status_code == status and words in r.json()["detail"], r.text


def test_every_backend_refuses_keys_scoped_elsewhere(backend, on):
    _, url = backend
    _, admin = on
    calls = [("POST", "/v1/collections/docs/documents/get", {"json": {"ids": ["d001"]}}),
             ("GET", "/v1/collections/docs/documents", {}),
             ("POST", "/v1/collections/docs/documents/count", {"json": {}}),
             ("POST", "/v1/collections/docs/documents/metadata",
              {"json": {"documents": [{"id": "zz", "metadata": {}}]}}),
             ("POST", "/v1/collections/docs/documents/delete", {"json": {"filter": {"a": 1}}}),
             ("DELETE", "/v1/collections/docs/documents", {"json": {"filter": {"a": 1}}})]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TEAM}"}) as team, \
            httpx.Client(base_url=url) as anonymous:
        for method, path, kw in calls:
            assert team.request(method, path, **kw).status_code == 403, path
            assert anonymous.request(method, path, **kw).status_code == 401, path
            assert admin.request(method, path, **kw).status_code == 200, path
    assert admin.post("/v1/collections/docs/documents/count", json={}).json() == {"count": SHARED}


def test_every_backend_scrolls_each_document_present_throughout_once_while_writes_go_on(on):
    """The scroll of test_scroll_sees_each_document_present_throughout_once_while_writes_go_on, over 40 documents
    written beside the shared ones (a filter scrolls them alone), deleted again after."""
    kind, c = on
    mark = json.dumps({"scrolled": True})
    _write(c, "docs", _docs([f"w{i:02d}" for i in range(40)], scrolled=True))

    def writes(page: int) -> None:
        if page == 1:  # w00..w06 seen: replace one seen and one not, delete one not seen, add new ones
            _write(c, "docs", _docs(["w02", "w25", "new0", "new1"], scrolled=True))
            assert c.post("/v1/collections/docs/documents/delete", json={"ids": ["w30"]}).json() == {"deleted": 1}

    try:
        ids, sizes = _scroll(c, "docs", writes, limit=7, filter=mark)
        assert max(sizes) == 7 and sizes[-1] > 0
        untouched = {f"w{i:02d}" for i in range(40)} - {"w02", "w25", "w30"}
        assert all(ids.count(d) == 1 for d in untouched), ids
        assert "w30" not in ids and ids.count("w25") == 1 and ids.count("new0") == ids.count("new1") == 1
        # docs/api.md: "a document present throughout a scroll is seen once while writes go on (one replaced
        # meanwhile comes again at the end of a collection's scroll ...; a sharded collection's keeps its id ...,
        # so it keeps its place and is seen once)"
        if kind == "single":
            assert ids.count("w02") == 2 and ids[-4:] == ["w02", "w25", "new0", "new1"], \
                f"w02 (seen on page 1, replaced before page 2) not seen again at the end; scrolled: {' '.join(ids)}"
        else:
            assert ids == [f"w{i:02d}" for i in range(40) if i != 30] + ["new0", "new1"], " ".join(ids)
    finally:
        c.post("/v1/collections/docs/documents/delete", json={"filter": {"scrolled": True}})
    assert c.post("/v1/collections/docs/documents/count", json={}).json() == {"count": SHARED}


def test_every_backend_sets_metadata(on):
    """Last of the backends' tests: it changes d010, d011 and d012 (their metadata put back after)."""
    _, c = on
    url = "/v1/collections/docs/documents/metadata"
    before = {d["id"]: d["metadata"] for d in _shared_docs()[10:13]}
    try:
        r = c.post(url, json={"documents": [{"id": "d010", "metadata": {"kind": "final", "name": None}},
                                            {"id": "zz", "metadata": {}}]})
        assert r.status_code == 200 and r.json() == {"updated": 1}, r.text
        assert c.get("/v1/collections/docs/documents/d010").json()["metadata"] == \
            {**{k: v for k, v in before["d010"].items() if k != "name"}, "kind": "final"}
        r = c.post(url, json={"documents": [{"id": "d011", "metadata": {"x": 1}}], "merge": False})
        assert r.json() == {"updated": 1}
        assert c.get("/v1/collections/docs/documents/d011").json()["metadata"] == {"x": 1}
        assert c.post("/v1/collections/docs/documents/count", json={"filter": {"kind": "final"}}).json()["count"] == 1
        found = c.post("/v1/collections/docs/search", json={"vectors": [_vec(200)], "k": 1,
                                                            "filter": {"kind": "final"}}).json()["results"][0]
        assert [h["id"] for h in found] == ["d010"] and found[0]["text"] == "text of d010"
        for body in ({"documents": []}, {"documents": [{"id": "d012"}]},
                     {"documents": [{"id": "d012", "metadata": [1]}]},
                     {"documents": [{"id": "d012", "metadata": {}}] * 2},
                     {"documents": [{"id": f"d{i:03d}", "metadata": {}} for i in range(MAX_DOCS + 1)]},
                     {"documents": [{"id": "d012", "metadata": {}}], "merge": "yes"}):
            assert c.post(url, json=body).status_code == 422, body
        assert c.get("/v1/collections/docs/documents/d012").json()["metadata"] == before["d012"]  # none applied
    finally:
        r = c.post(url, json={"documents": [{"id": i, "metadata": m} for i, m in before.items()], "merge": False})
        assert r.json() == {"updated": 3}
