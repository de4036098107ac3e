"""A vector store's collection (`vs_<24 hex>`) through the collection routes (#66, finding 3): reached only by
the key that owns the store or by a key unrestricted, whatever a restricted key's glob patterns are; the `vs_`
form is reserved, so a restricted key can neither create nor restore a collection of that form; listings, the
quota's count and /readyz leave out the stores a key does not own."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fusionrag.server.app import create_app
from fusionrag.server.config import ServerConfig

KEYS = ("admin-key-0123456789;owner-key-0123456789 v*,own-*;vee-key-0123456789 v*;"
        "under-key-0123456789 *_*;class-key-0123456789 [a-z]*")
ADMIN = {"Authorization": "Bearer admin-key-0123456789"}
OWNER = {"Authorization": "Bearer owner-key-0123456789"}
INTRUDERS = {"v*": {"Authorization": "Bearer vee-key-0123456789"},
             "*_*": {"Authorization": "Bearer under-key-0123456789"},
             "[a-z]*": {"Authorization": "Bearer class-key-0123456789"}}
UNUSED = "vs_" + "0123456789abcdef01234567"  # the store form, no store of that id


@pytest.fixture
def service(tmp_path):
    def make(**settings):
        client = TestClient(create_app(ServerConfig(data_dir=str(tmp_path / "data"), demo=False, api_keys=KEYS,
                                                    **settings)), raise_server_exceptions=False)
        return client
    return make


def _ready(c: TestClient) -> None:
    assert c.app.state.fusionrag.ready.wait(60)


def _store(c: TestClient, headers: dict) -> tuple[str, int]:
    r = c.post("/v1/vector_stores", json={"name": "notes"}, headers=headers)
    assert r.status_code == 200, r.text
    vsid = r.json()["id"]
    return vsid, c.get(f"/v1/collections/{vsid}", headers=ADMIN).json()["dimension"]


def _names(c: TestClient, headers: dict) -> list[str]:
    return [x["name"] for x in c.get("/v1/collections", headers=headers).json()["collections"]]


def _no_rights(r, name: str) -> None:
    """The answer for a name the key does not cover: 403, the same words whether the collection exists or not."""
    assert r.status_code == 403, (r.status_code, r.text)
    assert r.json()["detail"] == f"this API key has no rights to collection {name!r}"


@pytest.mark.parametrize("pattern", list(INTRUDERS))
def test_a_key_whose_patterns_cover_vs_cannot_reach_another_keys_store(service, pattern):
    bad = INTRUDERS[pattern]
    with service() as c:
        _ready(c)
        vsid, dim = _store(c, OWNER)
        doc = {"id": "secret", "vector": [1.0] + [0.0] * (dim - 1), "text": "the owner's chunk"}
        # The owner (its patterns cover the name) and an unrestricted key reach the store's collection.
        assert c.post(f"/v1/collections/{vsid}/documents", json={"documents": [doc]}, headers=OWNER).status_code == 200
        assert c.get(f"/v1/collections/{vsid}", headers=OWNER).json()["count"] == 1
        assert c.get(f"/v1/collections/{vsid}/documents/secret", headers=ADMIN).json()["text"] == "the owner's chunk"
        search = {"vectors": [doc["vector"]], "k": 5}
        assert [h["id"] for h in c.post(f"/v1/collections/{vsid}/search", json=search, headers=OWNER).json()[
            "results"][0]] == ["secret"]
        snap = c.post(f"/v1/collections/{vsid}/snapshots", headers=OWNER)
        assert snap.status_code == 201, snap.text
        sid = snap.json()["id"]
        assert c.get(f"/v1/collections/{vsid}/snapshots/{sid}", headers=OWNER).status_code == 200
        assert vsid in _names(c, OWNER) and vsid in _names(c, ADMIN)
        assert vsid in c.get("/v1/stats", headers=OWNER).json()["collections"]

        # Another restricted key, whatever its patterns: 403 for every collection route, as for a name it
        # does not cover; the store is not in its listings.
        for r in (c.get(f"/v1/collections/{vsid}", headers=bad),
                  c.get(f"/v1/collections/{vsid}/documents/secret", headers=bad),
                  c.post(f"/v1/collections/{vsid}/documents/get", json={"ids": ["secret"]}, headers=bad),
                  c.post(f"/v1/collections/{vsid}/documents/count", json={}, headers=bad),
                  c.get(f"/v1/collections/{vsid}/documents", headers=bad),
                  c.post(f"/v1/collections/{vsid}/search", json=search, headers=bad),
                  c.post(f"/v1/collections/{vsid}/documents",
                         json={"documents": [{**doc, "id": "planted", "text": "forged"}]}, headers=bad),
                  c.post(f"/v1/collections/{vsid}/documents/metadata",
                         json={"ids": ["secret"], "metadata": {"x": 1}}, headers=bad),
                  c.post(f"/v1/collections/{vsid}/documents/delete", json={"ids": ["secret"]}, headers=bad),
                  c.post(f"/v1/collections/{vsid}/snapshots", headers=bad),
                  c.get(f"/v1/collections/{vsid}/snapshots", headers=bad),
                  c.get(f"/v1/collections/{vsid}/snapshots/{sid}", headers=bad),
                  c.delete(f"/v1/collections/{vsid}/snapshots/{sid}", headers=bad),
                  c.post(f"/v1/collections/{vsid}/import", content=b'{"id": "x"}\n',
                         headers={**bad, "content-type": "application/x-ndjson"}),
                  c.delete(f"/v1/collections/{vsid}", headers=bad)):
            _no_rights(r, vsid)
        r = c.post(f"/v1/collections/{vsid}/restore", content=b"x", headers=bad)
        assert r.status_code == 403 and "reserved" in r.json()["detail"], r.text
        assert vsid not in _names(c, bad)
        assert vsid not in c.get("/v1/stats", headers=bad).json()["collections"]
        assert vsid not in c.get("/readyz", headers=bad).json()["collections"]
        assert vsid in c.get("/readyz", headers=OWNER).json()["collections"]

        # Nothing changed: the owner's search finds its chunk alone, its snapshot is there.
        assert [h["id"] for h in c.post(f"/v1/collections/{vsid}/search", json=search, headers=OWNER).json()[
            "results"][0]] == ["secret"]
        assert [s["id"] for s in c.get(f"/v1/collections/{vsid}/snapshots", headers=OWNER).json()["snapshots"]] == [sid]
        # The owner and an unrestricted key may drop it.
        assert c.delete(f"/v1/collections/{vsid}/snapshots/{sid}", headers=ADMIN).status_code == 200
        assert c.delete(f"/v1/collections/{vsid}", headers=OWNER).status_code == 200


def test_the_vs_form_is_reserved_for_stores(service):
    bad = INTRUDERS["v*"]
    with service() as c:
        _ready(c)
        vsid, dim = _store(c, OWNER)
        for headers in (bad, OWNER):  # even the owner of a store cannot make (or forge) one through these routes
            r = c.post("/v1/collections", json={"name": UNUSED, "dimension": 2}, headers=headers)
            assert r.status_code == 403 and "vs_" in r.json()["detail"] and "reserved" in r.json()["detail"], r.text
            r = c.post(f"/v1/collections/{UNUSED}/restore", content=b"not an archive", headers=headers)
            assert r.status_code == 403 and "reserved" in r.json()["detail"], r.text
        r = c.post("/v1/collections", json={"name": vsid, "dimension": 2}, headers=bad)  # the same words for a store
        assert r.status_code == 403 and "reserved" in r.json()["detail"] and "exist" not in r.json()["detail"], r.text
        assert UNUSED not in _names(c, ADMIN)
        # A name of the form that no store owns (an unrestricted key made it): unrestricted keys only.
        assert c.post("/v1/collections", json={"name": UNUSED, "dimension": 2}, headers=ADMIN).status_code == 201
        for headers in (bad, OWNER):
            _no_rights(c.get(f"/v1/collections/{UNUSED}", headers=headers), UNUSED)
            assert UNUSED not in _names(c, headers)
        assert c.get(f"/v1/collections/{UNUSED}", headers=ADMIN).status_code == 200
        # Names near the form are ordinary names.
        assert c.post("/v1/collections", json={"name": "vs_mine", "dimension": 2}, headers=bad).status_code == 201
        assert "vs_mine" in _names(c, bad)


def test_others_stores_do_not_count_against_a_keys_quota(service):
    """max_collections_per_key counts the collections a key reaches: another key's stores, which a `v*` key
    cannot reach, neither use its allowance nor show in the refusal's count."""
    bad = INTRUDERS["v*"]
    with service(max_collections_per_key=2) as c:
        _ready(c)
        _store(c, OWNER)
        _store(c, OWNER)
        for name in ("v-one", "v-two"):
            r = c.post("/v1/collections", json={"name": name, "dimension": 2}, headers=bad)
            assert r.status_code == 201, r.text
        r = c.post("/v1/collections", json={"name": "v-three", "dimension": 2}, headers=bad)
        assert r.status_code == 409 and "number 2" in r.json()["detail"], r.text
