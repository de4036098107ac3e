"""#67 item 7: hits grouped by a metadata field (POST /v1/collections/{name}/search/groups, the client's
search_groups), on every backend (integration_helpers.BACKENDS): a collection (index and fresh tier), a sharded
collection in the service's process (2 shards, built by build_sharded, written to after; the app every Ray Serve
router replica builds) and one in the service's data directory (2 shards, built by its import, written to after).
Vector answers are checked against a brute force in Python: every passing document's exact distance in numpy,
ranked, the top max_k grouped by the rule docs/collections.md states (a list value in each of its values' groups, no
string or integer value in none, "1" and 1 apart); text answers against the grouping of the service's own BM25
ranking at depth max_k. Bad input gets 422."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from integration_helpers import BACKENDS, serving_filled_backend

from fusionrag.client import Document
from fusionrag.server.config import ServerConfig

DIM, N, BEFORE, BIG, NAME, MAX_K = 8, 600, 480, 150, "grouped", 300
EVERYTHING = {"nprobe": 4096, "rerank": N, "beta": 0}
CENTRE = np.full(DIM, 4.0, dtype=np.float32)
_NONE = object()


def _file(i: int):
    if i < BIG:  # a tight cluster far from the rest, nearly all one group: a query there must search deeper
        return ["big", "f3"] if i % 50 == 7 else "big"
    if i % 7 == 0:
        return _NONE  # no field
    if i % 11 == 0:
        return [f"f{i % 20}", f"f{(i + 3) % 20}", f"f{i % 20}"]
    if i % 13 == 0:
        return i % 2 + 1  # integers 1, 2
    if i % 17 == 0:
        return "1"  # not the integer 1's group
    if i % 19 == 0:
        return [None, 2.5, True, {"a": 1}][i % 4]  # none of these makes a group
    return f"f{i % 20}"


def corpus():
    rng = np.random.default_rng(67)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    x[:BIG] = CENTRE + 0.3 * rng.standard_normal((BIG, DIM)).astype(np.float32)
    metas, texts = [], []
    for i in range(N):
        m = {"n": i % 5, "src": {"kind": f"k{i % 4}"}}
        if (f := _file(i)) is not _NONE:
            m["file"] = f
        metas.append(m)
        # "kappa" tf times in a text of a length no other document with the same tf has: BM25 scores all differ
        tf = 1 + i % 5
        words = ["kappa"] * tf if i % 3 == 0 else []
        texts.append(" ".join(words + [f"w{(i * 7 + j) % 97}" for j in range(1 + i // 5)]))
    return x, metas, texts


X, METAS, TEXTS = corpus()


def values(meta: dict, field: str) -> list:
    """The groups of a document (the rule of docs/collections.md), written here apart from the service's."""
    if field in meta:
        v = meta[field]
    else:
        v = meta
        for part in field.split("."):
            if not isinstance(v, dict) or part not in v:
                return []
            v = v[part]
    out = []
    for e in v if isinstance(v, list) else [v]:
        if (type(e) is str or type(e) is int) and not any(type(e) is type(o) and e == o for o in out):
            out.append(e)
    return out


def grouped(ranking: list[int], field: str, limit: int, size: int) -> list[tuple[object, list[str]]]:
    groups: list[tuple[object, list[str]]] = []
    for i in ranking:
        for v in values(METAS[i], field):
            g = next((g for g in groups if type(g[0]) is type(v) and g[0] == v), None)
            if g is None:
                if len(groups) == limit:
                    continue
                g = (v, [])
                groups.append(g)
            if len(g[1]) < size:
                g[1].append(str(i))
    return groups


def exact_ranking(q: np.ndarray, ok: list[int]) -> list[int]:
    d = ((X[ok].astype(np.float64) - q.astype(np.float64)) ** 2).sum(1)
    return [ok[j] for j in np.argsort(d, kind="stable")]


def answer(result: list[dict]) -> list[tuple[object, list[str]]]:
    return [(g["id"], [h["id"] for h in g["hits"]]) for g in result]


def _doc(i: int) -> dict:
    return {"id": str(i), "vector": X[i].tolist(), "text": TEXTS[i], "metadata": METAS[i]}


@pytest.fixture(scope="module", params=BACKENDS)
def service(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"groups-{request.param}")
    config = ServerConfig(data_dir=str(root / "data"), demo=False, log_level="warning", max_k=MAX_K)
    with serving_filled_backend(request.param, root, config, NAME, DIM,
                        [_doc(i) for i in range(BEFORE)],
                        [Document(str(i), TEXTS[i], X[i].tolist(), METAS[i]) for i in range(BEFORE, N)]
                        ) as (url, c):
        yield request.param, url, c


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/collections/{NAME}/search/groups", json=body, timeout=60)


# (group_by, limit, group_size, filter, predicate on (i, metadata))
CASES = [
    ("file", 5, 2, None, lambda i, m: True),
    ("file", 8, 3, {"n": {"$lt": 3}}, lambda i, m: m["n"] < 3),
    ("src.kind", 3, 4, {"$document": {"$contains": "kappa"}}, lambda i, m: "kappa" in TEXTS[i]),
    ("file", 30, 5, None, lambda i, m: True),  # more groups than the top max_k fill: cut there
    ("n", 2, 1, {"file": "f4"}, lambda i, m: m.get("file") == "f4"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_vector_groups_equal_the_brute_force(service, case):
    _, url, c = service
    field, limit, size, flt, pred = CASES[case]
    ok = [i for i in range(N) if pred(i, METAS[i])]
    rng = np.random.default_rng(case)
    q = np.stack([CENTRE + 0.1 * rng.standard_normal(DIM), rng.standard_normal(DIM)]).astype(np.float32)
    body = {"vectors": q.tolist(), "group_by": field, "limit": limit, "group_size": size, "params": EVERYTHING}
    if flt is not None:
        body["filter"] = flt
    r = post(url, body)
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert len(res) == 2
    for i in range(2):
        ranking = exact_ranking(q[i], ok)
        want = grouped(ranking[:MAX_K], field, limit, size)  # the rule: at most max_k deep
        assert answer(res[i]) == want
        assert [type(v) for v, _ in answer(res[i])] == [type(v) for v, _ in want]  # 1 and "1" apart
        for g in res[i]:
            for h in g["hits"]:
                assert g["id"] in values(h["metadata"], field)
                assert h["distance"] == pytest.approx(float(((X[int(h["id"])] - q[i]) ** 2).sum()), abs=1e-3)
        if case == 3 and i == 0:  # the bound matters here: deeper, the groups would hold more
            assert grouped(ranking, field, limit, size) != want
    # near the cluster, the first depth (2 x limit x group_size) holds the one group "big": the answer searched deeper
    if case == 0:
        assert len(res[0]) == limit and all(len(hits) == size for _, hits in answer(res[0]))
        assert res[0][0]["id"] == "big"
    # the client, the same answer
    got = c.search_groups(NAME, q, group_by=field, limit=limit, group_size=size, filter=flt, params=EVERYTHING)
    assert [[(g.id, [h.id for h in g.hits]) for g in groups] for groups in got.groups] == \
        [answer(x) for x in res]


def test_list_values_join_each_group_and_missing_fields_none(service):
    _, url, c = service
    q = X[7] + 0.001  # document 7 is in "big" and "f3"
    r = post(url, {"vectors": [q.tolist()], "group_by": "file", "limit": 2, "group_size": 1, "params": EVERYTHING})
    assert answer(r.json()["results"][0]) == [("big", ["7"]), ("f3", ["7"])]
    # a document without the field (0 mod 7 past the cluster) is in no group, however near
    q = X[154]  # 154 = 7 x 22
    groups = c.search_groups(NAME, q, group_by="file", limit=40, group_size=MAX_K // 40, params=EVERYTHING).groups[0]
    assert "154" not in {h.id for g in groups for h in g.hits}
    assert {type(g.id) for g in groups} == {str, int}
    assert not any(g.id in ("", None) for g in groups)


def test_text_groups_are_the_grouping_of_the_text_ranking(service):
    _, url, c = service
    ranking = c.search(NAME, texts=["kappa"], k=MAX_K, mode="text").hits[0]
    assert {h.id for h in ranking} == {str(i) for i in range(N) if "kappa" in TEXTS[i]}  # fewer than max_k
    r = post(url, {"texts": ["kappa"], "mode": "text", "group_by": "file", "limit": 6, "group_size": 3})
    assert r.status_code == 200, r.text
    assert answer(r.json()["results"][0]) == grouped([int(h.id) for h in ranking], "file", 6, 3)


def test_bad_input_is_422_and_a_misspelt_field_is_warned(service):
    kind, url, _ = service
    v = [X[0].tolist()]
    cases = [({"vectors": v}, "group_by"), ({"vectors": v, "group_by": ""}, "group_by"),
             ({"vectors": v, "group_by": "file", "group_size": 0}, "group_size"),
             ({"vectors": v, "group_by": "file", "limit": 0}, "limit"),
             ({"vectors": v, "group_by": "file", "limit": 31, "group_size": 10}, "max_k"),
             ({"vectors": v, "group_by": "file", "group_size": MAX_K + 1, "limit": 1}, "max_k"),
             ({"vectors": v, "group_by": "file", "k": 3}, "k"),
             ({"vectors": v, "group_by": "file", "filter": {"$nope": 1}}, "$nope"),
             ({"texts": ["kappa"], "group_by": "file"}, "embedding model")]
    for body, words in cases:
        r = post(url, body)
        assert r.status_code == 422 and words in r.text, (body, r.text)
    r = post(url, {"vectors": v, "group_by": "fille"})
    assert r.status_code == 200 and r.json()["results"] == [[]]
    said = [w for w in r.json()["warnings"] if w.startswith("group_by 'fille': no document holds")]
    assert said, r.json()
    if kind == "single":  # a collection names the fields nearest (a sharded one's shards do not)
        assert "'file'" in said[0]


def test_openapi_declares_the_route_and_its_limits(service):
    _, url, _ = service
    spec = httpx.get(f"{url}/openapi.json").json()
    assert "post" in spec["paths"]["/v1/collections/{name}/search/groups"]
    props = spec["components"]["schemas"]["GroupSearchRequest"]["properties"]
    assert props["limit"]["maximum"] == props["group_size"]["maximum"] == MAX_K
    assert spec["components"]["schemas"]["GroupSearchRequest"]["required"] == ["group_by"]
