"""#67 item 7: the text-contains filter over HTTP and in the Python client, on every backend
(integration_helpers.BACKENDS): a collection, a sharded collection in the service's process (2 shards, built by
build_sharded, the app every Ray Serve router replica builds) and one in the service's data directory (2 shards,
built by its import), each with documents written after it was built: vector,
text and hybrid search, count, scroll and delete by filter, each answer checked against a brute force over the
documents in Python (the ids whose text holds the string, case-sensitive, and whose metadata passes; their exact
nearest by numpy); a bad text condition gets 422 naming it on every route that takes a filter."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from integration_helpers import BACKENDS, serving_filled_backend

from fusionrag.client import Document, with_document
from fusionrag.server.config import ServerConfig

DIM, N, BEFORE, NAME = 8, 400, 340, "texts"
WORDS = ["alpha", "Alpha", "alphabet", "beta", "gamma", "kappa", "omega", "sigma,", "x-ray"]
EVERYTHING = {"nprobe": 4096, "rerank": N, "beta": 0}


def corpus():
    rng = np.random.default_rng(76)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    texts, metas = [], []
    for i in range(N):
        words = list(rng.choice(WORDS, 4))
        if i % 23 == 0:
            words.insert(1, "Zeta-9")
        texts.append(None if i % 13 == 4 else " ".join(words))
        metas.append({"n": i % 5, "tag": "ab"[i % 2]})
    return x, texts, metas


X, TEXTS, METAS = corpus()


def has(t, s) -> bool:
    return t is not None and s in t


def passing(pred) -> list[int]:
    return [i for i in range(N) if pred(TEXTS[i], METAS[i])]


# (filter, where_document for the client's form of it or None, brute force)
CASES = [
    ({"$document": {"$contains": "eta-9"}}, None, lambda t, m: has(t, "eta-9")),
    ({"$document": {"$contains": "zeta"}}, None, lambda t, m: has(t, "zeta")),  # case-sensitive: none
    ({"n": {"$lt": 3}}, {"$contains": "lpha"}, lambda t, m: has(t, "lpha") and m["n"] < 3),
    (None, {"$not_contains": "alpha"}, lambda t, m: not has(t, "alpha")),
    ({"$or": [{"$document": {"$contains": "Alpha"}}, {"tag": "b"}]}, None,
     lambda t, m: has(t, "Alpha") or m["tag"] == "b"),
    ({"tag": "a"}, {"$or": [{"$contains": "a, x-r"}, {"$and": [{"$contains": "beta"}, {"$not_contains": "kappa"}]}]},
     lambda t, m: m["tag"] == "a" and (has(t, "a, x-r") or (has(t, "beta") and not has(t, "kappa")))),
]


def _doc(i: int) -> dict:
    d = {"id": str(i), "vector": X[i].tolist(), "metadata": METAS[i]}
    if TEXTS[i] is not None:
        d["text"] = TEXTS[i]
    return d


@pytest.fixture(scope="module", params=BACKENDS)
def service(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"text-filter-{request.param}")
    config = ServerConfig(data_dir=str(root / "data"), demo=False, log_level="warning")
    with serving_filled_backend(request.param, root, config, NAME, DIM,
                        [_doc(i) for i in range(BEFORE)],
                        [Document(str(i), TEXTS[i], X[i].tolist(), METAS[i]) for i in range(BEFORE, N)]
                        ) as (url, c):
        yield request.param, url, c


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_mode_count_and_scroll_match_the_brute_force(service, case):
    _, url, c = service
    flt, where_document, pred = CASES[case]
    ok = passing(pred)
    full = with_document(flt, where_document)
    assert c.count(NAME, filter=flt, where_document=where_document) == len(ok)
    assert httpx.post(f"{url}/v1/collections/{NAME}/documents/count", json={"filter": full}).json() == {"count": len(ok)}
    seen, cursor = [], None
    while True:
        page = c.scroll(NAME, limit=40, cursor=cursor, filter=flt, where_document=where_document)
        assert all(pred(d.text, d.metadata) for d in page.documents)
        seen += [int(d.id) for d in page.documents]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert sorted(seen) == ok and not page.warnings
    q = np.random.default_rng(case).standard_normal((2, DIM)).astype(np.float32)
    res = c.search(NAME, q, k=10, filter=flt, where_document=where_document, params=EVERYTHING, stats=True)
    for i, hits in enumerate(res.hits):
        d = ((X[ok] - q[i]) ** 2).sum(axis=1) if ok else np.empty(0)
        assert [int(h.id) for h in hits] == [ok[j] for j in np.argsort(d)[:10]]
    # the same filter sent as the service takes it, over HTTP
    r = httpx.post(f"{url}/v1/collections/{NAME}/search", json={"vectors": q.tolist(), "k": 10, "filter": full,
                                                                  "params": EVERYTHING})
    assert [[h["id"] for h in hits] for hits in r.json()["results"]] == [[h.id for h in hits] for hits in res.hits]
    # text: BM25 over the words, case-folded: the documents holding the token "kappa" that pass
    kappa = {i for i in range(N) if TEXTS[i] is not None and "kappa" in TEXTS[i].lower().split()}
    res = c.search(NAME, texts=["kappa"], k=N, mode="text", filter=flt, where_document=where_document)
    assert {int(h.id) for h in res.hits[0]} == set(ok) & kappa
    # hybrid: with k = N the vector ranking holds every passing document
    res = c.search(NAME, q[:1], texts=["kappa"], k=N, mode="hybrid", filter=flt, where_document=where_document,
                   params=EVERYTHING)
    assert {int(h.id) for h in res.hits[0]} == set(ok)
    res = c.search(NAME, q[:1], texts=["kappa"], k=3, mode="hybrid", filter=flt, where_document=where_document)
    assert len(res.hits[0]) == min(3, len(ok)) and {int(h.id) for h in res.hits[0]} <= set(ok)


BAD = [
    ({"$document": {"$contains": 3}}, "filter $document $contains: the value must be a string, not int"),
    ({"$document": {"$contains": ""}}, "filter $document $contains: the value must be a non-empty string"),
    ({"$document": {"$startswith": "a"}}, "filter $document: unknown operator '$startswith'"),
    ({"tag": "a", "$document": {"$or": [{"$not_contains": None}]}},
     "filter $document $not_contains: the value must be a string, not NoneType"),
]


@pytest.mark.parametrize("flt, words", BAD)
def test_a_bad_text_condition_is_a_422_naming_it_on_every_route(service, flt, words):
    _, url, _ = service
    base = f"{url}/v1/collections/{NAME}"
    for r in (httpx.post(f"{base}/search", json={"vectors": [X[0].tolist()], "k": 3, "filter": flt}),
              httpx.post(f"{base}/search", json={"texts": ["kappa"], "mode": "text", "k": 3, "filter": flt}),
              httpx.post(f"{base}/documents/count", json={"filter": flt}),
              httpx.get(f"{base}/documents", params={"filter": json.dumps(flt)}),
              httpx.post(f"{base}/documents/delete", json={"filter": flt})):
        assert r.status_code == 422 and words in r.json()["detail"], (r.request.url, r.text)
    assert httpx.post(f"{base}/documents/count").json()["count"] == N  # nothing deleted


def test_delete_by_a_text_filter_deletes_exactly_the_passing_documents(service):
    """Last: it changes the collection."""
    _, url, c = service
    ok = passing(lambda t, m: has(t, "a, x-r") and m["n"] != 0)
    assert c.delete(NAME, filter={"n": {"$ne": 0}}, where_document={"$contains": "a, x-r"}) == len(ok) > 0
    left = []
    cursor = None
    while True:
        page = c.scroll(NAME, limit=100, cursor=cursor)
        left += [int(d.id) for d in page.documents]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert sorted(left) == sorted(set(range(N)) - set(ok))
    left = sorted(left)
    q = X[ok[0]]
    hits = c.search(NAME, q, k=20, params=EVERYTHING).hits[0]
    d = ((X[left] - q) ** 2).sum(axis=1)
    assert [int(h.id) for h in hits] == [left[j] for j in np.argsort(d)[:20]]
