"""#67 item 7: the text-contains filter ({"$document": {"$contains": s}}, Chroma's where_document) with metadata
filters, in the collection: every search mode, count, scroll and delete by filter, whether the filter is answered by
exact search among the few passing documents or by the index with the rest excluded (filter_exact_max), over the
main index and the fresh tier. Each answer is checked against a brute force over the documents in Python: the ids
whose text holds the string (Python's `in`: case-sensitive, a substring) and whose metadata passes, and their exact
nearest by numpy."""

import numpy as np
import pytest
from conftest import exact_knn

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.collection.filters import compile_filter
from fusionrag.retriever.engine.config import SearchParams
from fusionrag.retriever.errors import InputError

DIM, N, BEFORE = 8, 700, 560
WORDS = ["alpha", "Alpha", "alphabet", "beta", "gamma", "delta", "kappa", "omega", "sigma,", "x-ray"]
EVERYTHING = SearchParams(nprobe=1 << 12, rerank=N, beta=0, probe_ratio=0)


def corpus():
    rng = np.random.default_rng(67)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    texts, metas = [], []
    for i in range(N):
        if i % 11 == 5:
            texts.append(None)  # a document without text: $not_contains passes it, $contains never
        else:
            words = list(rng.choice(WORDS, 4))
            if i % 29 == 0:
                words.insert(2, "Zeta-9")  # rare: about 24 documents
            texts.append(" ".join(words))
        metas.append({"n": i % 7, "tag": "ab"[i % 2]})
    return x, texts, metas


def has(t, s) -> bool:
    return t is not None and s in t


# (filter, the brute force over (text, metadata)): every form of the text condition, with metadata beside it
CASES = [
    ({"$document": {"$contains": "eta-9"}}, lambda t, m: has(t, "eta-9")),
    ({"$document": {"$contains": "zeta"}}, lambda t, m: has(t, "zeta")),  # case-sensitive: none
    ({"$document": {"$contains": "lpha"}, "n": {"$lt": 4}}, lambda t, m: has(t, "lpha") and m["n"] < 4),
    ({"$document": {"$not_contains": "alpha"}}, lambda t, m: not has(t, "alpha")),
    ({"$or": [{"$document": {"$contains": "Alpha"}}, {"tag": "b"}]}, lambda t, m: has(t, "Alpha") or m["tag"] == "b"),
    ({"$document": {"$and": [{"$contains": "beta"}, {"$or": [{"$contains": "gamma"}, {"$not_contains": "kappa"}]}]},
      "tag": "a"},
     lambda t, m: has(t, "beta") and (has(t, "gamma") or not has(t, "kappa")) and m["tag"] == "a"),
    ({"$document": {"$contains": "a, x-r", "$not_contains": "omega"}},
     lambda t, m: has(t, "a, x-r") and not has(t, "omega")),
    ({"$and": [{"$document": {"$contains": "sigma"}}, {"$document": {"$not_contains": "delta"}}, {"n": {"$ne": 3}}]},
     lambda t, m: has(t, "sigma") and not has(t, "delta") and m["n"] != 3),
]


@pytest.fixture(params=[20000, 0], ids=["exact-among", "index-excluding"])
def coll(request, tmp_path):
    x, texts, metas = corpus()
    cfg = CollectionConfig(min_index_count=100, background_merge=False, filter_exact_max=request.param)
    cat = Catalog(tmp_path, collection_config=cfg)
    col = cat.create("t", DIM, "l2")
    col.add([Document(str(i), texts[i], x[i], metas[i]) for i in range(BEFORE)])
    col.merge()  # the first BEFORE in the main index, the rest in the fresh tier
    col.add([Document(str(i), texts[i], x[i], metas[i]) for i in range(BEFORE, N)])
    yield col, x, texts, metas, request.param
    cat.close()


def passing(texts, metas, pred) -> np.ndarray:
    return np.array([i for i in range(N) if pred(texts[i], metas[i])], dtype=np.int64)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_vector_search_count_and_scroll_match_the_brute_force(coll, case):
    col, x, texts, metas, exact_max = coll
    flt, pred = CASES[case]
    ok = passing(texts, metas, pred)
    assert col.count(flt) == len(ok)
    seen, after = [], -1
    while after is not None:
        page, after = col.scroll(50, after, flt)
        seen += [int(d.id) for d in page]
        assert all(pred(d.text, d.metadata) for d in page)
    assert sorted(seen) == ok.tolist()
    q = np.random.default_rng(case).standard_normal((3, DIM)).astype(np.float32)
    res = col.search(q, k=10, filter=flt, params=EVERYTHING)
    for i, hits in enumerate(res.hits):
        want = ok[exact_knn(x[ok], q[i:i + 1], min(10, len(ok)))[0]].tolist() if len(ok) else []
        assert [int(h.id) for h in hits] == want
        assert res.stats[i]["filtered_exact"] == (len(ok) <= exact_max)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_text_and_hybrid_searches_return_only_and_all_passing_matches(coll, case):
    col, x, texts, metas, _ = coll
    flt, pred = CASES[case]
    ok = set(passing(texts, metas, pred).tolist())
    # text: BM25 matches any word of the query, case-folded: the word "kappa" (a whole token) is in these texts
    kappa = {i for i in range(N) if texts[i] is not None and "kappa" in texts[i].lower().split()}
    res = col.search(texts=["kappa"], k=N, mode="text", filter=flt)
    assert {int(h.id) for h in res.hits[0]} == ok & kappa
    # hybrid: the vector ranking among the passing is all of them (k = N), fused with the text ranking
    q = np.random.default_rng(case).standard_normal((1, DIM)).astype(np.float32)
    res = col.search(q, texts=["kappa"], k=N, mode="hybrid", filter=flt, params=EVERYTHING)
    assert {int(h.id) for h in res.hits[0]} == ok
    res = col.search(q, texts=["kappa"], k=5, mode="hybrid", filter=flt, params=EVERYTHING)
    assert len(res.hits[0]) == min(5, len(ok)) and {int(h.id) for h in res.hits[0]} <= ok


def test_delete_by_a_text_filter_removes_exactly_the_passing_documents(coll):
    col, x, texts, metas, _ = coll
    flt, pred = CASES[2]
    ok = passing(texts, metas, pred)
    assert col.delete_where(flt) == len(ok) > 0
    left = sorted(int(d.id) for d in col.scroll(N, -1)[0])
    assert left == sorted(set(range(N)) - set(ok.tolist()))
    assert col.count(flt) == 0


def test_a_replaced_text_is_filtered_by_its_new_words(coll):
    col, x, texts, metas, _ = coll
    col.upsert([Document("1", "now it says Zeta-9", x[1], metas[1])])
    assert "1" in {d.id for d in col.scroll(N, -1, {"$document": {"$contains": "eta-9"}})[0]}
    col.upsert([Document("0", "plain", x[0], metas[0])])  # 0 held Zeta-9 (0 % 29 == 0)
    assert "0" not in {d.id for d in col.scroll(N, -1, {"$document": {"$contains": "eta-9"}})[0]}


@pytest.mark.parametrize("flt, words", [
    ({"$document": {"$contains": 3}}, "filter $document $contains: the value must be a string, not int"),
    ({"$document": {"$not_contains": ["a"]}}, "filter $document $not_contains: the value must be a string, not list"),
    ({"$document": {"$contains": ""}}, "filter $document $contains: the value must be a non-empty string"),
    ({"$document": {"$regex": "a"}}, "filter $document: unknown operator '$regex'"),
    ({"$document": "alpha"}, "filter $document: expects a non-empty dict"),
    ({"$document": {}}, "filter $document: expects a non-empty dict"),
    ({"$document": {"$or": []}}, "filter $document $or: expects a non-empty list"),
    ({"$document": {"$and": [{"$contains": None}]}}, "filter $document $contains: the value must be a string"),
    ({"$documents": {"$contains": "a"}}, "unknown operator '$documents' at the top level"),
    ({"$document": {"$contains": "\ud800"}}, "lone surrogate"),
])
def test_bad_text_conditions_are_refused_naming_the_part(flt, words):
    with pytest.raises(InputError) as e:
        compile_filter(flt)
    assert words in str(e.value)
