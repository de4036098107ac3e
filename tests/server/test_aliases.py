"""#67 item 7: collection aliases (Qdrant's), switched atomically for re-indexing without downtime. Over HTTP and
through the Python client: every collection route takes an alias and acts on its target (each answer compared with
the same call by the target's name, and with what was written); POST /v1/aliases applies its actions together or
none of them; an alias never shadows a collection, nor the other way round; a collection an alias points to is not
dropped (409); a key reaches a collection through an alias only where it reaches both the alias's name and the
collection (vector stores' `vs_` collections included); searches through an alias switched between two collections
while they run never fail and answer from one of them only, each as that collection answers; aliases survive a
restart of the service."""

from __future__ import annotations

import io
import json
import threading

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from server_util import ServerProcess

from fusionrag.client import Client, Document
from fusionrag.retriever.errors import ConflictError, NotFoundError
from fusionrag.server.app import create_app
from fusionrag.server.config import ServerConfig

DIM = 4
KEYS = ("admin-key-0123456789;team-key-0123456789 team-*;other-key-0123456789 team-*,vs_*;"
        "owner-key-0123456789 team-*,own-*,vs_*")  # other: its patterns cover the stores, it owns none
ADMIN = {"Authorization": "Bearer admin-key-0123456789"}
TEAM = {"Authorization": "Bearer team-key-0123456789"}
OTHER = {"Authorization": "Bearer other-key-0123456789"}
OWNER = {"Authorization": "Bearer owner-key-0123456789"}


def _vec(seed: int) -> list[float]:
    return np.random.default_rng(seed).standard_normal(DIM).astype(np.float32).tolist()


def _docs(prefix: str, n: int = 12) -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": f"{prefix} passage number {i}", "vector": _vec(hash(prefix) % 1000 + i),
             "metadata": {"i": i}} for i in range(n)]


def _make(c, name: str, docs: list[dict], headers=ADMIN) -> None:
    r = c.post("/v1/collections", json={"name": name, "dimension": DIM, "metric": "l2"}, headers=headers)
    assert r.status_code == 201, r.text
    r = c.post(f"/v1/collections/{name}/documents", json={"documents": docs}, headers=headers)
    assert r.status_code == 200, r.text


def _aliases(c, headers=ADMIN, **body) -> httpx.Response:
    return c.post("/v1/aliases", json=body, headers=headers)


def _create(alias: str, target: str) -> dict:
    return {"create_alias": {"alias_name": alias, "collection_name": target}}


@pytest.fixture
def app_client(tmp_path):
    with TestClient(create_app(ServerConfig(data_dir=str(tmp_path / "data"), demo=False, api_keys=KEYS)),
                    raise_server_exceptions=False) as c:
        assert c.app.state.fusionrag.ready.wait(60)
        yield c


def test_every_collection_route_takes_an_alias_and_acts_on_its_target(app_client):
    c = app_client
    _make(c, "team-v1", _docs("a"))
    _make(c, "team-v2", _docs("b"))
    r = _aliases(c, actions=[_create("team-live", "team-v1")])
    assert r.status_code == 200 and r.json() == {"aliases": [{"alias_name": "team-live", "collection_name": "team-v1"}]}
    q = {"vectors": [_vec(7)], "k": 5}
    for path, body in (("/search", q), ("/search", {"texts": ["passage 3"], "k": 3, "mode": "text"}),
                       ("/recommend", {"positive": ["a1"], "k": 3}), ("/documents/get", {"ids": ["a2", "b2"]}),
                       ("/documents/count", {"filter": {"i": {"$lt": 5}}})):
        by_alias = c.post(f"/v1/collections/team-live{path}", json=body, headers=ADMIN)
        by_name = c.post(f"/v1/collections/team-v1{path}", json=body, headers=ADMIN)
        assert by_alias.status_code == 200 and by_alias.json() == by_name.json(), (path, by_alias.text)
    assert [h["id"][0] for h in c.post("/v1/collections/team-live/search", json=q, headers=ADMIN)
            .json()["results"][0]] == ["a"] * 5
    info = c.get("/v1/collections/team-live", headers=ADMIN).json()
    assert info["name"] == "team-v1" and info["count"] == 12
    assert c.get("/v1/collections/team-live/documents", headers=ADMIN).json() == \
        c.get("/v1/collections/team-v1/documents", headers=ADMIN).json()
    assert c.get("/v1/collections/team-live/documents/a4", headers=ADMIN).json()["id"] == "a4"
    # writes through the alias land in the target
    new = {"id": "a-new", "text": "written through the alias", "vector": _vec(99)}
    assert c.post("/v1/collections/team-live/documents", json={"documents": [new]}, headers=ADMIN).status_code == 200
    assert c.post("/v1/collections/team-live/documents/metadata", json={"documents": [{"id": "a0", "metadata": {
        "i": 100}}]}, headers=ADMIN).json() == {"updated": 1}
    assert c.post("/v1/collections/team-live/documents/delete", json={"ids": ["a11"]}, headers=ADMIN).json() == \
        {"deleted": 1}
    got = c.post("/v1/collections/team-v1/documents/get", json={"ids": ["a-new", "a0", "a11"]}, headers=ADMIN).json()
    assert [(d["id"], d["metadata"]) for d in got["documents"]] == [("a-new", {}), ("a0", {"i": 100})]
    assert c.get("/v1/collections/team-v2", headers=ADMIN).json()["count"] == 12  # untouched
    snap = c.post("/v1/collections/team-live/snapshots", headers=ADMIN)
    assert snap.status_code == 201, snap.text
    assert [s["id"] for s in c.get("/v1/collections/team-v1/snapshots", headers=ADMIN).json()["snapshots"]] == \
        [snap.json()["id"]]
    assert c.get("/v1/collections/team-v1/aliases", headers=ADMIN).json() == \
        {"aliases": [{"alias_name": "team-live", "collection_name": "team-v1"}]}
    assert c.get("/v1/collections/team-live/aliases", headers=ADMIN).json() == \
        c.get("/v1/collections/team-v1/aliases", headers=ADMIN).json()
    # listings name collections only
    assert sorted(x["name"] for x in c.get("/v1/collections", headers=ADMIN).json()["collections"]) == \
        ["team-v1", "team-v2"]


def test_actions_apply_together_or_not_at_all_and_names_never_clash(app_client):
    c = app_client
    _make(c, "team-v1", _docs("a"))
    _make(c, "team-v2", _docs("b"))
    assert _aliases(c, actions=[_create("team-live", "team-v1"), _create("team-old", "team-v1")]).status_code == 200
    before = c.get("/v1/aliases", headers=ADMIN).json()
    for actions, status, words in (
            ([_create("team-live", "team-v2"), {"delete_alias": {"alias_name": "nope"}}], 404, "alias 'nope'"),
            ([_create("team-live", "team-v2"), _create("team-x", "missing")], 404, "collection 'missing'"),
            ([_create("team-live", "team-v2"), _create("team-v1", "team-v2")], 409, "may not shadow a collection"),
            ([_create("team-y", "team-live")], 422, "an alias points to a collection, not to an alias"),
            ([{"rename_alias": {"old_alias_name": "team-live", "new_alias_name": "team-old"}}], 409, "already exists"),
            ([_create("bad name!", "team-v1")], 422, "must be 1-64 letters"),
            ([{"create_alias": {"alias_name": "team-z"}}], 422, "collection_name"),
            ([{"delete_alias": {"alias_name": "team-old"}, "create_alias": {"alias_name": "a", "collection_name": "b"}}],
             422, "exactly one of"),
            ([], 422, "actions")):
        r = _aliases(c, actions=actions)
        assert r.status_code == status and words in r.text, (actions, r.text)
        assert c.get("/v1/aliases", headers=ADMIN).json() == before  # nothing of it applied
    # a switch and a rename in one request
    r = _aliases(c, actions=[_create("team-live", "team-v2"),
                             {"rename_alias": {"old_alias_name": "team-old", "new_alias_name": "team-prev"}}])
    assert r.json()["aliases"] == [{"alias_name": "team-live", "collection_name": "team-v2"},
                                   {"alias_name": "team-prev", "collection_name": "team-v1"}]
    assert c.get("/v1/collections/team-live", headers=ADMIN).json()["name"] == "team-v2"
    # a collection may not take an alias's name (create or restore)
    r = c.post("/v1/collections", json={"name": "team-live", "dimension": DIM, "metric": "l2"}, headers=ADMIN)
    assert r.status_code == 409 and "is an alias" in r.text
    snap = c.post("/v1/collections/team-v1/snapshots", headers=ADMIN).json()["id"]
    tar = c.get(f"/v1/collections/team-v1/snapshots/{snap}", headers=ADMIN).content
    r = c.post("/v1/collections/team-live/restore", files={"snapshot": ("s.tar", io.BytesIO(tar))}, headers=ADMIN)
    assert r.status_code == 409 and "is an alias" in r.text, r.text
    # a collection an alias points to is not dropped, by its name or the alias's
    for name in ("team-v1", "team-prev"):
        r = c.delete(f"/v1/collections/{name}", headers=ADMIN)
        assert r.status_code == 409 and "alias 'team-prev'" in r.text, r.text
    assert c.get("/v1/collections/team-v1", headers=ADMIN).status_code == 200
    assert _aliases(c, actions=[{"delete_alias": {"alias_name": "team-prev"}}]).status_code == 200
    assert c.delete("/v1/collections/team-v1", headers=ADMIN).status_code == 200
    assert c.get("/v1/collections/team-prev", headers=ADMIN).status_code == 404


def test_an_alias_never_lets_a_key_reach_a_collection_it_could_not_reach_by_name(app_client):
    c = app_client
    _make(c, "secret", _docs("s"))
    _make(c, "team-v1", _docs("a"), TEAM)
    # an unrestricted key points an alias that the team keys' pattern covers at a collection it does not
    assert _aliases(c, actions=[_create("team-secret", "secret")]).status_code == 200
    for headers in (TEAM, OTHER):
        for method, path, body in (("POST", "/search", {"vectors": [_vec(1)], "k": 3}),
                                   ("POST", "/search", {"texts": ["passage"], "k": 3, "mode": "text"}),
                                   ("GET", "", None), ("GET", "/documents", None), ("GET", "/documents/s1", None),
                                   ("POST", "/documents/count", {}), ("POST", "/documents", {"documents": [
                                       {"id": "x", "vector": _vec(2)}]}),
                                   ("POST", "/documents/delete", {"ids": ["s1"]}), ("DELETE", "", None),
                                   ("GET", "/aliases", None), ("POST", "/snapshots", None)):
            r = c.request(method, f"/v1/collections/team-secret{path}", json=body, headers=headers)
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["detail"] == "this API key has no rights to collection 'team-secret'"
        assert c.get("/v1/aliases", headers=headers).json() == {"aliases": []}
        # nor may it make, switch, rename or delete one that points there
        for actions in ([_create("team-mine", "secret")], [_create("team-secret", "team-v1")],
                        [{"delete_alias": {"alias_name": "team-secret"}}],
                        [{"rename_alias": {"old_alias_name": "team-secret", "new_alias_name": "team-s2"}}],
                        [_create("elsewhere", "team-v1")]):
            r = _aliases(c, headers, actions=actions)
            assert r.status_code == 403 and "no rights to" in r.text, (actions, r.text)
    assert c.post("/v1/collections/secret/documents/count", json={}, headers=ADMIN).json()["count"] == 12
    assert c.get("/v1/aliases", headers=ADMIN).json()["aliases"] == [{"alias_name": "team-secret",
                                                                      "collection_name": "secret"}]
    # within its patterns a key makes and uses aliases as any
    assert _aliases(c, TEAM, actions=[_create("team-live", "team-v1")]).status_code == 200
    assert c.get("/v1/collections/team-live", headers=TEAM).json()["name"] == "team-v1"
    assert c.get("/v1/aliases", headers=TEAM).json()["aliases"] == [{"alias_name": "team-live",
                                                                     "collection_name": "team-v1"}]


def test_a_vector_stores_collection_is_reached_through_an_alias_only_by_its_owner(app_client):
    c = app_client
    r = c.post("/v1/vector_stores", json={"name": "notes"}, headers=OWNER)
    assert r.status_code == 200, r.text
    vsid = r.json()["id"]
    dim = c.get(f"/v1/collections/{vsid}", headers=ADMIN).json()["dimension"]
    doc = {"id": "chunk", "vector": [1.0] + [0.0] * (dim - 1), "text": "the owner's chunk"}
    assert c.post(f"/v1/collections/{vsid}/documents", json={"documents": [doc]}, headers=OWNER).status_code == 200
    # another key whose patterns cover the alias name cannot make one to the store, nor use the admin's
    r = _aliases(c, OTHER, actions=[_create("team-vs", vsid)])
    assert r.status_code == 403 and f"no rights to collection {vsid!r}" in r.text, r.text
    assert _aliases(c, actions=[_create("team-vs", vsid)]).status_code == 200
    search = {"vectors": [doc["vector"]], "k": 1}
    for path, body in (("/search", search), ("/documents/count", {})):
        r = c.post(f"/v1/collections/team-vs{path}", json=body, headers=OTHER)
        assert r.status_code == 403 and r.json()["detail"] == "this API key has no rights to collection 'team-vs'"
    assert c.get("/v1/collections/team-vs/documents", headers=OTHER).status_code == 403
    assert c.get("/v1/aliases", headers=OTHER).json() == {"aliases": []}
    # the owner reaches it by the alias as by its name
    r = c.post("/v1/collections/team-vs/search", json=search, headers=OWNER)
    assert r.status_code == 200 and [h["id"] for h in r.json()["results"][0]] == ["chunk"]
    assert _aliases(c, OWNER, actions=[_create("own-vs", vsid)]).status_code == 200
    # an alias may not take the stores' form
    r = _aliases(c, actions=[_create("vs_" + "0" * 24, "team-vs")])
    assert r.status_code == 422 and "reserved for vector stores" in r.text


def _exact(docs: list[dict], q, k: int) -> list[str]:
    x = np.array([d["vector"] for d in docs], dtype=np.float64)
    return [docs[i]["id"] for i in np.argsort(((x - np.asarray(q, np.float64)) ** 2).sum(axis=1), kind="stable")[:k]]


def test_searches_through_a_switched_alias_never_fail_and_aliases_survive_a_restart(tmp_path):
    gens = {"gen1": _docs("g1-", 40), "gen2": _docs("g2-", 40)}
    queries = [_vec(1000 + i) for i in range(8)]
    want = {name: [_exact(docs, q, 5) for q in queries] for name, docs in gens.items()}
    srv = ServerProcess(tmp_path / "data", tmp_path / "a.log", "--no-demo")
    try:
        srv.wait_ready()
        with Client(srv.url) as client:
            for name, docs in gens.items():
                client.create_collection(name, DIM, metric="l2")
                client.upsert(name, [Document(d["id"], d["text"], d["vector"], d["metadata"]) for d in docs])
            assert client.create_alias("live", "gen1") == {"live": "gen1"}
            stop = threading.Event()
            answers, errors = [], []

            def search_forever():
                with httpx.Client(base_url=srv.url, timeout=60) as h:
                    i = 0
                    while not stop.is_set():
                        q = i % len(queries)
                        r = h.post("/v1/collections/live/search", json={"vectors": [queries[q]], "k": 5})
                        if r.status_code != 200:
                            errors.append(r.text)
                        else:
                            answers.append((q, [hit["id"] for hit in r.json()["results"][0]]))
                        i += 1

            threads = [threading.Thread(target=search_forever) for _ in range(3)]
            for t in threads:
                t.start()
            try:
                for switch in range(30):
                    target = ("gen2", "gen1")[switch % 2]
                    assert client.create_alias("live", target) == {"live": target}
                    # once the switch is answered, a search through the alias answers from the new target
                    hits = client.search("live", queries[switch % 8], k=5).hits[0]
                    assert [h.id for h in hits] == want[target][switch % 8]
            finally:
                stop.set()
                for t in threads:
                    t.join(60)
            assert errors == [] and len(answers) > 0
            for q, ids in answers:  # each answer is one target's whole answer, never a mix
                assert ids in (want["gen1"][q], want["gen2"][q]), (q, ids)
            client.update_aliases([_create("live", "gen2"), _create("old", "gen1")])
            assert client.aliases() == {"live": "gen2", "old": "gen1"}
            assert client.aliases("gen1") == {"old": "gen1"}
            with pytest.raises(ConflictError):
                client.drop_collection("gen1")
            assert client.delete_alias("old") == {"live": "gen2"}
            with pytest.raises(NotFoundError):
                client.delete_alias("old")
            client.create_alias("old", "gen1")
        assert json.loads((tmp_path / "data" / "aliases.json").read_text())["aliases"] == {"live": "gen2",
                                                                                           "old": "gen1"}
        assert srv.stop() == 0
        srv = ServerProcess(tmp_path / "data", tmp_path / "b.log", "--no-demo")
        srv.wait_ready()
        with Client(srv.url) as client:
            assert client.aliases() == {"live": "gen2", "old": "gen1"}
            for i, q in enumerate(queries):
                assert [h.id for h in client.search("live", q, k=5).hits[0]] == want["gen2"][i]
                assert [h.id for h in client.search("old", q, k=5).hits[0]] == want["gen1"][i]
            assert client.info("live").name == "gen2" and client.count("old") == 40
    finally:
        srv.stop()
