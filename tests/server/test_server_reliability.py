"""The service's reliability: what a request body may cost, filters past SQLite's limits, statuses and headers
that say what happened, names shown only to keys that may see them, and an OpenAPI document a schema fuzzer
finds true."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from server_util import ServerProcess

from fusionrag.server import bodies
from fusionrag.server.app import create_app
from fusionrag.server.bodies import Body
from fusionrag.server.config import ServerConfig

MiB = 1 << 20


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A server without the demo or keys, default limits, and one vector collection: `vecs` (dimension 2)."""
    root = tmp_path_factory.mktemp("plain")
    srv = ServerProcess(root / "data", root / "server.log", "--no-demo")
    try:
        srv.wait_ready()
        with srv.client() as c:
            assert c.post("/v1/collections", json={"name": "vecs", "dimension": 2, "metric": "l2"}).status_code == 201
            docs = [{"id": "a", "vector": [1, 0], "metadata": {"n": 1}},
                    {"id": "a\n", "vector": [0, 1], "metadata": {"n": -1}}]
            assert c.post("/v1/collections/vecs/documents", json={"documents": docs}).status_code == 200
        yield srv
    finally:
        srv.stop()


# -- 6: what a body may cost ------------------------------------------------------------------------

def test_bodies_over_the_query_limit_are_refused_at_little_memory(tmp_path):
    """16 concurrent 15 MiB search bodies of 4000 queries each (the limit is 256): every one gets its 422, and the
    server's peak RSS grows by far less than the 1150 MiB that parsing them whole into Python objects cost (each
    body's bytes are held once while it is read; its queries past the 257th are never parsed)."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo")
    try:
        srv.wait_ready()
        dim = 384
        with srv.client() as c:
            assert c.post("/v1/collections", json={"name": "big", "dimension": dim}).status_code == 201
        row = b"[" + b",".join(b"%.6f" % x for x in np.random.default_rng(0).standard_normal(dim)) + b"]"
        rows = 15 * MiB // (len(row) + 1)
        body = b'{"k": 10, "vectors": [' + b",".join([row] * rows) + b"]}"
        before = _status(srv.proc.pid)

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as ac:
                return await asyncio.gather(*(ac.post("/v1/collections/big/search", content=body,
                                                      headers={"content-type": "application/json"})
                                              for _ in range(16)))

        responses = asyncio.run(burst())
        after = _status(srv.proc.pid)
        assert [r.status_code for r in responses] == [422] * 16
        assert "more than 256 queries" in responses[0].json()["detail"]
        grown = after["VmHWM"] - before["VmHWM"]
        print(f"{rows} queries, {len(body) / MiB:.1f} MiB a body: RSS {before['VmRSS'] / MiB:.0f} MiB before, "
              f"peak {after['VmHWM'] / MiB:.0f} MiB after ({grown / MiB:.0f} MiB more)")
        assert grown < 1.25 * 16 * len(body) + 64 * MiB  # each body's bytes, once (1150 MiB more before)
    finally:
        srv.stop()


JSON_CASES = [
    '{"a": [1, -2.5e3, 0.0, 1E2, true, false, null], "b": {"c": "d\\u00e9\\n\\"q\\" \\ud83d\\ude00", "e": {}}}',
    '{"s": "" , "big": 123456789012345678901234567890, "neg": -0, "list": [[], [[]], [{}]]}',
    '  {"dup": 1, "dup": 2, "nan": NaN, "inf": [Infinity, -Infinity]}  ',
]


@pytest.mark.parametrize("text", JSON_CASES)
def test_body_reader_builds_what_json_loads_builds(text):
    got = Body(text.encode()).document({})
    want = json.loads(text)
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


def test_body_reader_reads_vectors_into_float32_and_counts_lists():
    def too_many():
        return bodies.HTTPException(422, "too many")

    def wrong_dim(n):
        return bodies.HTTPException(422, f"dimension {n}")

    def rows(b: Body, limit: int):
        return lambda i: b.array(i, 1, lambda n, j: b.vector(j, 2, ("rows", n), wrong_dim), limit, too_many)

    b = Body(b'{"rows": [[1, 2.5], [3e0 , -4]]}')
    out = b.document({"rows": rows(b, 2)})["rows"]
    assert [r.dtype for r in out] == [np.float32] * 2 and np.array_equal(np.stack(out), [[1, 2.5], [3, -4]])
    for text, detail in ((b'{"rows": [[1, 2], [3, 4], [5, 6]]}', "too many"),
                         (b'{"rows": [[1, 2], [3, 4, 5]]}', "dimension 3"),
                         (b'{"rows": [[1, NaN]]}', "not finite"),
                         (b'{"rows": [[1, 1e39]]}', "not finite"),
                         (b'{"rows": [[1, ' + b"9" * 5000 + b']]}', "digits")):
        b = Body(text)
        with pytest.raises(bodies.HTTPException) as e:
            b.document({"rows": rows(b, 2)})
        assert detail in e.value.detail, text


@pytest.mark.parametrize("text, status, words", [
    (b'{"a": [1, 2', 400, "malformed JSON at character 11"),
    (b'{"a": 1} x', 400, "Extra data"),
    (b'{"a" 1}', 400, "Expecting ':'"),
    (b'{"a": "\xff"}', 400, "malformed JSON"),
    (b'{"a": "\x01"}', 400, "Invalid control character"),
    (b"", 400, "Expecting value"),
    (b"[1]", 422, "must be a JSON object"),
    (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", 422, "more than 100 deep"),
    (b'{"a": [' + b"0," * (1 << 18) + b"0]}", 413, "JSON values"),
])
def test_body_reader_refuses_bad_and_costly_bodies(text, status, words):
    with pytest.raises(bodies.HTTPException) as e:
        Body(text).document({})
    assert e.value.status_code == status and words in e.value.detail, e.value.detail


# -- 7: statuses and contracts -----------------------------------------------------------------------

def _search(client, **body):
    return client.post("/v1/collections/vecs/search", json={"vectors": [[1, 0]], "k": 2, **body})


def _nested(depth: int) -> dict:
    f = {"n": 1}
    for _ in range(depth):
        f = {"$and": [f, {"n": {"$ne": 2}}]}
    return f


def test_filters_past_sqlites_limits_run_or_get_422(plain):
    with plain.client() as c:
        # Past SQLite's 500 terms of a compound and its parser's ~10 nested subqueries: answered.
        for flt, ids in (({"$or": [{"n": i} for i in range(1000)]}, {"a"}),
                         ({"$and": [{"n": {"$ne": i}} for i in range(2, 1000)]}, {"a", "a\n"}),
                         (_nested(32), {"a"})):
            r = _search(c, filter=flt)
            assert r.status_code == 200, r.text
            assert {h["id"] for h in r.json()["results"][0]} == ids
        for flt, words in (({"$or": [{"n": i} for i in range(5000)]}, "at most 1000 comparisons"),
                           ({"$and": [{"n": {"$ne": i}} for i in range(2000)]}, "at most 1000 comparisons"),
                           (_nested(33), "nest at most 32 deep"),
                           (_nested(200), "the body nests lists and objects more than 100 deep"),
                           ({"n": {"$in": list(range(40000))}}, "at most 10000 values")):
            r = _search(c, filter=flt)
            assert r.status_code == 422 and words in r.json()["detail"], r.text


def test_document_id_is_matched_whole(plain):
    with plain.client() as c:
        assert c.get("/v1/collections/vecs/documents/a").json()["id"] == "a"
        assert c.get("/v1/collections/vecs/documents/a%0A").json()["id"] == "a\n"
        r = c.get("/v1/collections/vecs/documents/b%0A")
        assert r.status_code == 404 and "'b\\n'" in r.json()["detail"]


@pytest.fixture
def app_client(tmp_path):
    def make(**settings):
        return TestClient(create_app(ServerConfig(data_dir=str(tmp_path / "data"), demo=False, **settings)),
                          raise_server_exceptions=False)
    return make


def test_a_500_says_the_connection_closes(app_client, monkeypatch):
    with app_client() as c:
        state = c.app.state.fusionrag
        assert state.ready.wait(30)
        monkeypatch.setattr(state.catalog, "names", lambda: 1 / 0)
        r = c.get("/v1/collections")
        assert r.status_code == 500 and r.headers["connection"] == "close"
        assert r.json() == {"detail": "internal error; see the service's log"}


def test_create_on_a_full_disk_gets_507_and_leaves_nothing(app_client, monkeypatch):
    real = sqlite3.connect

    def full(path, *a, **kw):
        if "fresh" in str(path):
            raise sqlite3.OperationalError("database or disk is full")
        return real(path, *a, **kw)

    with app_client() as c:
        monkeypatch.setattr(sqlite3, "connect", full)
        r = c.post("/v1/collections", json={"name": "fresh", "dimension": 2})
        assert r.status_code == 507, r.text
        monkeypatch.setattr(sqlite3, "connect", real)
        root = c.app.state.fusionrag.catalog.dir
        assert [p.name for p in root.iterdir()] == []
        assert c.post("/v1/collections", json={"name": "fresh", "dimension": 2}).status_code == 201


def test_names_only_for_keys_that_may_see_them(app_client):
    keys = "admin-key-0123456789;team-key-0123456789 team-*"
    admin = {"Authorization": "Bearer admin-key-0123456789"}
    team = {"Authorization": "Bearer team-key-0123456789"}
    with app_client(api_keys=keys) as c:
        for name in ("team-a", "other"):
            assert c.post("/v1/collections", json={"name": name, "dimension": 2}, headers=admin).status_code == 201
        c.app.state.fusionrag.ready.wait(30)
        assert c.get("/readyz").json() == {"status": "ready"}
        assert c.get("/readyz", headers={"Authorization": "Bearer wrong-key-000000"}).json() == {"status": "ready"}
        assert c.get("/readyz", headers=team).json()["collections"] == ["team-a"]
        assert c.get("/readyz", headers=admin).json()["collections"] == ["other", "team-a"]
        assert c.get("/metrics").status_code == 401
        r = c.get("/metrics", headers=team)
        assert r.status_code == 403 and "every collection" in r.json()["detail"]
        r = c.get("/metrics", headers=admin)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert 'fusionrag_collection_documents{collection="other"}' in r.text
    with app_client(api_keys=keys, metrics_auth=False) as c:
        assert c.get("/metrics").status_code == 200


def test_openapi_document_declares_what_the_api_does(app_client):
    with app_client() as c:
        doc = c.get("/openapi.json").json()
        schemas, paths = doc["components"]["schemas"], doc["paths"]
        assert "HTTPValidationError" not in schemas and set(schemas["Error"]["properties"]) == {"detail", "errors"}
        error = {"$ref": "#/components/schemas/Error"}
        search = paths["/v1/collections/{name}/search"]["post"]
        for status in ("400", "401", "403", "404", "413", "422", "503"):
            assert search["responses"][status]["content"]["application/json"]["schema"] == error, status
        assert paths["/v1/collections"]["post"]["responses"]["409"]["content"]["application/json"]["schema"] == error
        assert "507" in paths["/v1/collections/{name}/documents"]["post"]["responses"]
        name = next(p for p in search["parameters"] if p["name"] == "name")
        assert name["schema"]["pattern"] == "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
        body = search["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        assert [b["required"] for b in schemas[body]["oneOf"]] == [["vectors"], ["texts"], ["vectors", "texts", "mode"]]
        assert schemas[body]["oneOf"][2]["properties"]["mode"] == {"const": "hybrid"}
        assert schemas[body]["properties"]["k"]["maximum"] == 1000
        assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
        # A 405 names every method of the path, not those of its first route.
        r = c.put("/v1/collections/vecs")
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) >= {"GET", "DELETE"}


def test_schema_fuzzing_finds_no_server_error_and_no_nonconformance(plain, tmp_path):
    """Schemathesis, every check, against the document the service serves. The fuzzer's copy says the dimension
    of `vecs` (2), which the service's own document cannot, and names `vecs` and its document `a` often. Valid
    input may still get a 422: a filter's operators, tuning ranges and embedding models are checked against
    the engine, not declared."""
    doc = httpx.get(plain.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    schemas["SearchRequest"]["properties"]["vectors"]["anyOf"][0]["items"].update(minItems=2, maxItems=2)
    schemas["DocumentIn"]["properties"]["vector"]["anyOf"][0].update(minItems=2, maxItems=2)
    (tmp_path / "openapi.json").write_text(json.dumps(doc))
    (tmp_path / "schemathesis.toml").write_text('''
[dictionaries.collections]
values = ["vecs"]
[dictionaries.documents]
values = ["a"]
[parameters]
"path.name" = { dictionary = "collections", probability = 0.7 }
"path.doc_id" = { dictionary = "documents", probability = 0.5 }
[checks.positive_data_acceptance]
# 415: a file route refuses what is not UTF-8 text (documented); the schema cannot say "text" of a binary part
expected-statuses = ["2xx", "401", "403", "404", "409", "415", "422"]
''')
    st = Path(sys.executable).with_name("schemathesis")
    p = subprocess.run([str(st), "--config-file", str(tmp_path / "schemathesis.toml"), "--no-color", "run",
                        str(tmp_path / "openapi.json"), "--url", plain.url, "--checks", "all",
                        "--max-examples", "25", "--seed", "7", "--generation-database", "none", "--workers", "1",
                        # a text may wait for the embedding model's first load (seconds; more on a loaded machine)
                        "--request-timeout", "60", "--max-response-time", "60"],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)  # its .schemathesis/ there
    summary = p.stdout[p.stdout.find("SUMMARY"):]
    assert p.returncode == 0, p.stdout[-20000:] + p.stderr[-3000:]
    operations = sum(len(methods) for methods in doc["paths"].values())
    assert f"Tested: {operations}" in summary and "failures" not in summary.lower(), summary


def test_a_search_checks_and_normalises_its_queries_once(app_client, monkeypatch):
    """The route checks the vectors (a bad query fails its own request, not its batch) and hands them on
    prepared: neither the collection nor its index checks or normalises them again."""
    from fusionrag.retriever.engine import queries as queries_mod

    with app_client() as c:
        assert c.app.state.fusionrag.ready.wait(30)
        assert c.post("/v1/collections", json={"name": "cos", "dimension": 3, "metric": "cosine"}).status_code == 201
        docs = [{"id": f"d{i}", "vector": [1.0, float(i), 0.5]} for i in range(5)]
        assert c.post("/v1/collections/cos/documents", json={"documents": docs}).status_code == 200
        checks = []  # (rows, whether made unit length) of each pass that checks query rows
        real_rows = queries_mod._rows
        monkeypatch.setattr(queries_mod, "_rows", lambda q, m, w, unit: checks.append((len(q), unit)) or
                            real_rows(q, m, w, unit))
        r = c.post("/v1/collections/cos/search", json={"vectors": [[2.0, 6.0, 1.0]], "k": 2})
        assert r.status_code == 200, r.text
        assert [h["id"] for h in r.json()["results"][0]][0] == "d3"  # (2, 6, 1) points as (1, 3, 0.5)
        assert checks == [(1, True)]
