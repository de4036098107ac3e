"""Metadata filters: the contract's syntax, typed semantics, and recall at 1%, 10% and 100%."""

import numpy as np
import pytest
from conftest import clustered, exact_knn, recall

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.errors import InputError
from fusionrag.retriever.filters import compile_filter

DIM = 16
META = [
    {"color": "red", "size": 1, "price": 9.5, "ok": True, "tags": "a"},
    {"color": "blue", "size": 2, "price": 20.0, "ok": False},
    {"color": "red", "size": 3, "ok": True},
    {"color": "green", "size": "3", "price": 5, "odd key \"'": "x", "nested": {"a": 1}, "big": 2 ** 70},
    {},
]


@pytest.fixture
def small(tmp_path):
    cat = Catalog(tmp_path, collection_config=CollectionConfig(background_merge=False))
    col = cat.create("s", DIM, "l2")
    rng = np.random.default_rng(0)
    col.add([Document(str(i), None, rng.standard_normal(DIM), m) for i, m in enumerate(META)])
    yield col
    cat.close()


@pytest.mark.parametrize("flt, expect", [
    ({"color": "red"}, {"0", "2"}),
    ({"color": {"$eq": "red"}, "size": {"$gt": 1}}, {"2"}),
    ({"size": 3}, {"2"}),  # the string "3" is not the number 3
    ({"size": "3"}, {"3"}),
    ({"color": {"$ne": "red"}}, {"1", "3", "4"}),  # a missing field passes $ne
    ({"price": {"$gte": 9.5, "$lt": 20}}, {"0"}),
    ({"price": {"$lte": 9.5}}, {"0", "3"}),
    ({"size": {"$in": [1, 2, "3"]}}, {"0", "1", "3"}),
    ({"color": {"$nin": ["red", "blue"]}}, {"3", "4"}),
    ({"ok": True}, {"0", "2"}),
    ({"ok": 1}, set()),  # a number never equals a bool
    ({"$or": [{"color": "blue"}, {"tags": "a"}]}, {"0", "1"}),
    ({"$and": [{"color": "red"}, {"$or": [{"size": 3}, {"price": {"$gt": 100}}]}]}, {"2"}),
    ({"nothing": {"$gt": 0}}, set()),
    ({"odd key \"'": "x"}, {"3"}),
    ({"nested": {"$ne": 1}}, {"0", "1", "2", "3", "4"}),  # a nested value is never equal to a scalar
    ({"big": {"$gt": 2 ** 64}}, {"3"}),
    ({"size": {"$gte": 2}, "$or": [{"ok": False}, {"ok": {"$nin": [True, False]}}]}, {"1"}),
])
def test_filter_semantics(small, flt, expect):
    res = small.search(np.zeros((1, DIM)), k=10, filter=flt)
    assert {h.id for h in res.hits[0]} == expect
    assert res.stats[0]["filtered_exact"] is True


@pytest.mark.parametrize("flt, msg", [
    ([], "non-empty dict"),
    ({}, "non-empty dict"),
    ({"$not": {"a": 1}}, "unknown operator"),
    ({"a": {"$regex": "x"}}, "unknown operator"),
    ({"a": {"$in": []}}, "non-empty list"),
    ({"a": {"$in": "abc"}}, "non-empty list"),
    ({"a": [1, 2]}, "must be a string, number or bool"),
    ({"a": {"$gt": True}}, "cannot be ordered"),
    ({"a": {"$gt": float("nan")}}, "finite"),
    ({"$or": []}, "non-empty list"),
    ({"": 1}, "non-empty string"),
])
def test_bad_filters_name_the_problem(flt, msg):
    with pytest.raises(InputError, match=msg):
        compile_filter(flt)


def test_selective_filters_keep_recall(tmp_path):
    """1% and 10% answered exactly (few pass) and through the index with the rest excluded; 100%
    through the index. The main index plus a fresh tier, with some documents deleted."""
    n = 5000
    x = clustered(n, DIM, 60, seed=7)
    q = clustered(40, DIM, 60, seed=8)
    bucket = np.arange(n) % 100
    for exact_max in (20000, 100):
        cfg = CollectionConfig(min_index_count=500, background_merge=False, filter_exact_max=exact_max)
        cat = Catalog(tmp_path / str(exact_max), collection_config=cfg)
        col = cat.create("f", DIM, "l2")
        col.add([Document(str(i), None, x[i], {"bucket": int(bucket[i])}) for i in range(4500)])
        col.merge()
        col.add([Document(str(i), None, x[i], {"bucket": int(bucket[i])}) for i in range(4500, n)])
        dead = np.arange(0, n, 37)
        col.delete([str(i) for i in dead])
        alive = np.setdiff1d(np.arange(n), dead)
        for flt, sel in [({"bucket": 7}, bucket == 7), ({"bucket": {"$lt": 10}}, bucket < 10),
                         ({"bucket": {"$gte": 0}}, bucket >= 0)]:
            ok = np.intersect1d(alive, np.flatnonzero(sel))
            truth = ok[exact_knn(x[ok], q, 10)]
            res = col.search(q, k=10, filter=flt)
            found = np.array([[int(h.id) for h in hits] + [-1] * (10 - len(hits)) for hits in res.hits])
            assert recall(found, truth) >= 0.95, (flt, exact_max)
            assert all(sel[int(h.id)] for hits in res.hits for h in hits)
            assert res.stats[0]["filtered_exact"] == (len(ok) <= exact_max)
        cat.close()


LISTS = [
    {"tags": ["a", "b"], "years": [2020, 2021], "flags": [True]},
    {"tags": ["b"], "years": [2019]},
    {"tags": "a"},  # a scalar: equality sees it, $contains does not
    {"tags": []},
    {"tags": ["a", 1, True, {"x": 1}, ["nested"]]},
]


@pytest.fixture
def listed(tmp_path):
    cat = Catalog(tmp_path, collection_config=CollectionConfig(background_merge=False, min_index_count=1))
    col = cat.create("l", DIM, "l2")
    rng = np.random.default_rng(1)
    col.add([Document(str(i), None, rng.standard_normal(DIM), m) for i, m in enumerate(LISTS)])
    yield col
    cat.close()


def _ids(col, flt) -> set[str]:
    return {h.id for h in col.search(np.zeros((1, DIM)), k=10, filter=flt).hits[0]}


@pytest.mark.parametrize("flt, expect", [
    ({"tags": {"$contains": "a"}}, {"0", "4"}),
    ({"tags": {"$contains": "b"}}, {"0", "1"}),
    ({"years": {"$contains": 2020}}, {"0"}),
    ({"years": {"$contains": 2020.0}}, {"0"}),
    ({"years": {"$contains": "2020"}}, set()),  # typed, as every comparison
    ({"tags": {"$contains": 1}}, {"4"}),
    ({"tags": {"$contains": True}}, {"4"}),
    ({"flags": {"$contains": True}}, {"0"}),
    ({"tags": "a"}, {"2"}),  # the comparison operators see scalar values only
    ({"tags": {"$ne": "a"}}, {"0", "1", "3", "4"}),
    ({"$or": [{"tags": {"$contains": "b"}}, {"years": {"$contains": 2019}}]}, {"0", "1"}),
    ({"tags": {"$contains": "a"}, "years": {"$contains": 2021}}, {"0"}),
    ({"tags": {"$contains": "zzz"}}, set()),
])
def test_contains_tests_the_elements_of_lists(listed, flt, expect):
    assert _ids(listed, flt) == expect
    listed.merge()  # the same from the main index
    assert _ids(listed, flt) == expect


def test_contains_is_an_index_range_and_follows_writes(listed):
    sql, params = compile_filter({"tags": {"$contains": "a"}})
    with listed.store._reader() as con:
        plan = " | ".join(row[-1] for row in con.execute(f"EXPLAIN QUERY PLAN {sql}", params))
    assert "USING COVERING INDEX fields_by_value" in plan and "SCAN fields" not in plan, plan
    listed.upsert([Document("0", None, np.ones(DIM), {"tags": ["c"]})])  # replaced: its old elements go
    listed.delete(["4"])
    assert _ids(listed, {"tags": {"$contains": "a"}}) == set()
    assert _ids(listed, {"tags": {"$contains": "c"}}) == {"0"}


@pytest.mark.parametrize("value", [["a"], {"a": 1}, None, float("nan")])
def test_contains_takes_one_scalar(listed, value):
    with pytest.raises(InputError, match=r"\$contains on 'tags'"):
        listed.search(np.zeros((1, DIM)), k=1, filter={"tags": {"$contains": value}})


def test_a_store_written_before_lists_were_indexed_indexes_them_when_opened(tmp_path):
    import sqlite3

    cat = Catalog(tmp_path, collection_config=CollectionConfig(background_merge=False))
    cat.create("old", DIM, "l2").add([Document(str(i), None, np.full(DIM, i + 1.0), m) for i, m in enumerate(LISTS)])
    cat.close()
    # What an older version wrote: scalar values alone in the field table, and no mark of list elements.
    with sqlite3.connect(tmp_path / "collections" / "old" / "docs.sqlite") as con:
        con.execute("DELETE FROM fields WHERE t LIKE 'l%'")
        con.execute("DELETE FROM meta WHERE key = 'list_elements'")
    cat = Catalog(tmp_path, collection_config=CollectionConfig(background_merge=False))
    try:
        col = cat.get("old")
        assert _ids(col, {"tags": {"$contains": "a"}}) == {"0", "4"}
        assert _ids(col, {"tags": "a"}) == {"2"}
    finally:
        cat.close()


@pytest.mark.parametrize("flt, words", [
    ({"price": "9.5"}, ["'price'", "numbers only", "looks for strings"]),
    ({"ok": 1}, ["'ok'", "bools only", "looks for numbers"]),
    ({"color": {"$in": [1, 2]}}, ["'color'", "strings only"]),
    ({"$or": [{"color": "red"}, {"price": {"$gt": "1"}}]}, ["'price'"]),
    ({"color": {"$contains": "red"}}, ["'color'", "looks for lists of strings", "$contains tests the elements of lists"]),
])
def test_a_filter_on_values_of_another_type_says_why_it_matches_nothing(small, flt, words):
    warnings = small.filter_warnings(flt)
    assert len(warnings) == 1 and all(w in warnings[0] for w in words), warnings
    assert not any(h.metadata.get("price") == "9.5" for h in small.search(np.zeros((1, DIM)), k=10, filter=flt).hits[0])


@pytest.mark.parametrize("flt", [
    {"size": 3}, {"size": "3"},  # the field holds both types: each can match
    {"nothing": 1},  # no document has it: nothing to say of its type
    {"color": "purple"}, {"price": {"$gt": 100}},  # the right type, no match: that is an answer
])
def test_filters_that_can_match_have_no_warning(small, flt):
    assert small.filter_warnings(flt) == []


def test_a_scalar_comparison_on_a_list_field_points_to_contains(listed):
    [warning] = listed.filter_warnings({"years": 2020})
    assert "lists of numbers only" in warning and '{"$contains": value}' in warning
    assert listed.filter_warnings({"years": {"$contains": 2020}}) == []
