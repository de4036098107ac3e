"""#66 finding 1 over HTTP: a value no store can hold (a metadata integer of 10^400 or 2^70, a lone surrogate sent as
JSON's \\ud800 escape) is refused with a 422 naming the field by every route that takes metadata, text or a filter,
the collection's routes and the OpenAI vector stores' alike; and after a restart every collection written to is
still ready and holds its acknowledged documents (each such write poisoned its collection for good: 500 to every
later write, 503 to everything after a restart)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from integration_helpers import BACKENDS, serving, serving_backend
from server_util import ServerProcess

from fusionrag.server.app import create_app
from fusionrag.server.config import ServerConfig

BIG = "1" + "0" * 400  # 10^400, written into raw JSON: json.loads keeps it an exact int
DIM = 4
SEEDED = 200  # the documents of the backends' collection (a sharded build wants more than a few)
JSON = {"content-type": "application/json"}


def _raw(c, method: str, path: str, body: str):
    return c.request(method, path, content=body, headers=JSON)


def _doc(doc_id: str, meta: str = "{}", text: str = '"t"') -> str:
    return '{"id": "%s", "text": %s, "vector": [1, 0, 0, 0], "metadata": %s}' % (doc_id, text, meta)


def _check_refused(r, *words: str) -> None:
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert all(w in detail for w in words), detail


def test_values_no_store_can_hold_get_422_on_every_route_and_poison_nothing(tmp_path):
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo")
    try:
        srv.wait_ready()
        with srv.client() as c:
            assert c.post("/v1/collections", json={"name": "c", "dimension": DIM, "metric": "cosine"}).status_code == 201
            ok = _raw(c, "POST", "/v1/collections/c/documents",
                      '{"documents": [%s, %s]}' % (_doc("a", '{"n": 1}'), _doc("b", '{"n": 2}')))
            assert ok.status_code == 200, ok.text
            _refuse_on_every_collection_route(c, "c", 2)

            # The OpenAI vector stores: a file's attributes, a store's metadata, a search's query.
            fid = c.post("/v1/files", files={"file": ("f.txt", b"some words about planets")},
                         data={"purpose": "assistants"}).json()["id"]
            vs = c.post("/v1/vector_stores", json={"name": "s"}).json()["id"]
            for attrs in ['{"n": %s}' % BIG, '{"k": "\\ud800"}', '{"\\ud800": "v"}']:
                r = _raw(c, "POST", f"/v1/vector_stores/{vs}/files", '{"file_id": "%s", "attributes": %s}' % (fid, attrs))
                _check_refused(r, "attributes")
                assert r.json()["error"]["type"] == "invalid_request_error"
            _check_refused(_raw(c, "POST", "/v1/vector_stores", '{"name": "t", "metadata": {"k": "\\udfff"}}'),
                           "metadata")
            _check_refused(_raw(c, "POST", f"/v1/vector_stores/{vs}/search", '{"query": "planets \\ud800"}'),
                           "query[0]", "lone surrogate")
            _check_refused(_raw(c, "POST", f"/v1/vector_stores/{vs}/search",
                                '{"query": "planets", "filters": {"type": "eq", "key": "n", "value": %s}}' % BIG),
                           "outside the signed 64-bit range")
            r = c.post(f"/v1/vector_stores/{vs}/files", json={"file_id": fid, "attributes": {"n": 1}})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()

    # After a restart: every collection ready, the acknowledged documents all there.
    srv = ServerProcess(tmp_path / "data", tmp_path / "server2.log", "--no-demo")
    try:
        ready = srv.wait_ready()
        assert ready["status"] == "ready", ready
        with srv.client() as c:
            info = c.get("/v1/collections/c").json()
            assert info["count"] == 3 and info["set_aside"]["count"] == 0, json.dumps(info)
            got = c.post("/v1/collections/c/documents/get", json={"ids": ["a", "b", "c", "p"]}).json()
            assert [d["id"] for d in got["documents"]] == ["a", "b", "c"]
            assert c.post("/v1/collections/c/documents", json={"documents": [{"id": "d", "vector": [0, 0, 1, 0]}]}
                          ).status_code == 200
    finally:
        srv.stop()


def _refuse_on_every_collection_route(c, name: str, held: int) -> None:
    """The collection routes' half of the test: every value no store can hold refused with a 422 naming it, by the
    writes (documents, metadata), the filters (search, count, delete, scroll) and the delete by ids; then a write is
    taken and nothing refused was kept. The collection holds `held` documents, "a" and "b" among them."""
    docs = f"/v1/collections/{name}/documents"
    for meta, field in [('{"n": %s}' % BIG, "'n'"), ('{"l": [1, {"z": %s}]}' % BIG, "'l[1].z'"),
                        ('{"n": 1180591620717411303424}', "'n'"), ('{"s": "x\\ud800"}', "'s'"),
                        ('{"\\udc00": 1}', "lone surrogate")]:
        _check_refused(_raw(c, "POST", docs, '{"documents": [%s]}' % _doc("p", meta)), "'p'", field)
        _check_refused(_raw(c, "POST", docs + "/metadata", '{"documents": [{"id": "a", "metadata": %s}]}'
                            % meta), "'a'", field)
    _check_refused(_raw(c, "POST", docs, '{"documents": [%s]}' % _doc("p", text='"abc\\ud800"')),
                   "documents.text[0]", "lone surrogate")
    _check_refused(_raw(c, "POST", docs, '{"documents": [%s]}' % _doc("\\ud800")), "documents.0.id")
    for flt in ['{"n": %s}' % BIG, '{"n": {"$gt": 1180591620717411303423}}', '{"s": "\\ud800"}']:
        what = "lone surrogate" if "ud800" in flt else "outside the signed 64-bit range"
        _check_refused(_raw(c, "POST", f"/v1/collections/{name}/search",
                            '{"vectors": [[1, 0, 0, 0]], "k": 2, "filter": %s}' % flt), what)
        _check_refused(_raw(c, "POST", docs + "/count", '{"filter": %s}' % flt), what)
        _check_refused(_raw(c, "POST", docs + "/delete", '{"filter": %s}' % flt), what)
        _check_refused(c.get(docs, params={"filter": flt}), what)
    _check_refused(_raw(c, "POST", docs + "/delete", '{"ids": ["\\ud800"]}'), "ids.0")
    # Every write after the refused ones is taken; nothing refused was kept.
    assert c.post(docs, json={"documents": [{"id": "c", "vector": [0, 1, 0, 0]}]}).status_code == 200
    assert c.post(docs + "/count", json={}).json()["count"] == held + 1


@pytest.mark.parametrize("kind", BACKENDS)
def test_every_backend_refuses_them_alike_and_keeps_its_documents_after_a_restart(tmp_path, kind):
    """#69 item 1: the collection routes' refusals above, on every backend (integration_helpers.BACKENDS), the
    collection holding SEEDED documents ("a", "b" and unnamed ones) in its index; then the service started again on
    the same files (a collection and a hosted sharded one: the data directory; the sharded one: its index directory
    opened again) answers ready and holds exactly the acknowledged documents, and takes a write."""
    rng = np.random.default_rng(66)
    vectors = rng.standard_normal((SEEDED, DIM)).astype(np.float32)
    documents = [{"id": "a", "text": "t", "metadata": {"n": 1}}, {"id": "b", "text": "t", "metadata": {"n": 2}}] + \
        [{"id": f"s{i}", "text": "t", "metadata": {"n": i}} for i in range(2, SEEDED)]
    config = ServerConfig(data_dir=str(tmp_path / "data"), demo=False, log_level="warning")
    with serving_backend(kind, tmp_path, "c", config, vectors, documents=documents, metric="cosine",
                         shards=2) as url, httpx.Client(base_url=url, timeout=60) as c:
        _refuse_on_every_collection_route(c, "c", SEEDED)
    if kind == "sharded":  # its writes are in its index directory, which serving_backend opened as tmp_path / "idx"
        from fusionrag.retriever.sharded.docs import ShardedCollection
        from fusionrag.retriever.sharded.router import ShardedIndex
        from fusionrag.server.ray_serve import replica_app

        coll = ShardedCollection(ShardedIndex.open(tmp_path / "idx"), "c")
        app = replica_app(coll, config)
    else:
        coll, app = None, create_app(config)
    try:
        with serving(app) as url, httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/readyz").json()["status"] == "ready"
            info = c.get("/v1/collections/c").json()
            assert info["count"] == SEEDED + 1, json.dumps(info)
            if "set_aside" in info:
                assert info["set_aside"]["count"] == 0, json.dumps(info)
            got = c.post("/v1/collections/c/documents/get", json={"ids": ["a", "b", "c", "p"]}).json()
            assert [d["id"] for d in got["documents"]] == ["a", "b", "c"]
            assert [d["metadata"] for d in got["documents"][:2]] == [{"n": 1}, {"n": 2}]  # no refused update kept
            assert c.post("/v1/collections/c/documents", json={"documents": [{"id": "d", "vector": [0, 0, 1, 0]}]}
                          ).status_code == 200
            hits = c.post("/v1/collections/c/search", json={"vectors": [[0, 0, 1, 0]], "k": 1}).json()["results"]
            assert [h["id"] for h in hits[0]] == ["d"]
    finally:
        if coll is not None:
            coll.close()
