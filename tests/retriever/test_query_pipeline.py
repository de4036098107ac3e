"""The query pipeline's plumbing (issue #19 item 3): queries checked and normalised once at the edge they come
in by, a batch record through the stages, filter tiers chosen by what they can do, no import loop."""

import ast
from pathlib import Path

import numpy as np
import pytest
from conftest import clustered

from fusionrag.retriever import BuildConfig, Index, InputError
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.engine import index as index_mod
from fusionrag.retriever.engine import queries as queries_mod
from fusionrag.retriever.engine.pipeline import QueryBatch
from fusionrag.retriever.engine.queries import PreparedQueries, check_queries, prepare_queries
from fusionrag.retriever.engine.tiers import CpuFilterTier

RETRIEVER = Path(index_mod.__file__).resolve().parent
DIM = 16


@pytest.fixture(scope="module")
def cosine_index(tmp_path_factory):
    base = clustered(2000, DIM, 20, seed=11)
    queries = clustered(40, DIM, 20, seed=12)
    path = tmp_path_factory.mktemp("qp") / "idx"
    Index.build(base, path, BuildConfig(metric="cosine"), progress=False)
    return base, queries, path


def imports_of(module: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_neither_filter_tier_module_imports_the_other():
    assert "fusionrag.retriever.engine.gpu_tier" not in imports_of(RETRIEVER / "tiers.py")
    assert "fusionrag.retriever.engine.tiers" not in imports_of(RETRIEVER / "gpu_tier.py")
    assert "fusionrag.retriever.engine.filtering" in imports_of(RETRIEVER / "tiers.py") & imports_of(RETRIEVER / "gpu_tier.py")


def test_the_cpu_tier_says_what_it_can_do(cosine_index):
    _, _, path = cosine_index
    on = Index.open(path, filter_tier="cpu")
    off = Index.open(path, filter_tier="cpu", pipeline=False, batch_size=5)
    assert isinstance(on.filter, CpuFilterTier)
    assert (on.filter.overlaps, on.filter.in_flight, on.filter.tiered) == (True, 1, False)
    assert on.filter.batch_size == on.config.batch_for("cpu") and on.filter.metric == "l2"  # cosine: l2 on unit rows
    assert (off.filter.overlaps, off.filter.batch_size) == (False, 5)


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_call_overlaps_its_batches_when_the_tier_does(cosine_index, monkeypatch, pipeline):
    _, queries, path = cosine_index
    index = Index.open(path, filter_tier="cpu", batch_size=8, pipeline=pipeline)
    calls = []
    real = index_mod.overlapped
    monkeypatch.setattr(index_mod, "overlapped", lambda items, *a, **kw: calls.append(len(items)) or real(items, *a, **kw))
    seen, had = [], []
    stage = index._rerank_stage
    monkeypatch.setattr(index, "_rerank_stage",
                        lambda b: seen.append(b) or had.append((b.lists, b.candidates is not None, len(b.queries)))
                        or stage(b))
    res = index.search(queries, k=5)
    assert calls == ([5] if pipeline else [])
    assert all(isinstance(b, QueryBatch) for b in seen)
    assert all(b.n == max(index.params.rerank, 5) for b in seen)
    # Each stage lets go of what the later ones do not need: lists after the scan, candidates and the batch's
    # normalised queries after the re-rank, so a call of many batches holds only those in flight, not all of
    # them until it returns.
    assert had == [(None, True, 8)] * 5
    assert all(b.lists is None and b.candidates is None and b.probed is None and b.queries is None for b in seen)
    single = Index.open(path, filter_tier="cpu", batch_size=64).search(queries, k=5)
    np.testing.assert_array_equal(res.ids, single.ids)
    for key in ("lists_probed", "candidates", "unique_candidates", "minibatches", "reranked"):
        np.testing.assert_array_equal(res.stats[key], single.stats[key])


def test_a_collection_checks_and_normalises_queries_once(tmp_path, monkeypatch):
    cat = Catalog(tmp_path, collection_config=CollectionConfig(min_index_count=200, background_merge=False))
    try:
        col = cat.create("c", DIM, "cosine")
        vecs = clustered(600, DIM, 10, seed=3)
        col.upsert([Document(f"d{i}", None, v) for i, v in enumerate(vecs)])
        col.merge()
        col.upsert([Document(f"f{i}", None, v) for i, v in enumerate(vecs[:20])])  # a fresh tier too
        checks = []  # each a (whether it made unit rows) of the one pass that checks rows (and normalises them)
        rows = queries_mod._rows
        monkeypatch.setattr(queries_mod, "_rows", lambda q, m, w, unit: checks.append(unit) or rows(q, m, w, unit))
        got = col.search(vecs[:7] * 3.0, k=4)
        assert checks == [True]
        assert all(s["lists_probed"] > 0 and s["fresh_candidates"] == 20 for s in got.stats)  # both tiers searched
        assert all(h[0].distance < 1e-5 for h in got.hits)  # each query's own vector (d_i, or its copy f_i)
    finally:
        cat.close()


def test_prepared_queries_are_searched_as_they_are(cosine_index, monkeypatch):
    _, queries, path = cosine_index
    index = Index.open(path, filter_tier="cpu")
    prepared = prepare_queries(queries, DIM, "cosine")
    assert isinstance(prepared, PreparedQueries) and prepared.vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(prepared.vectors, axis=1), 1, rtol=1e-6)
    assert prepare_queries(prepared, DIM, "cosine") is prepared
    assert index.prepare_queries(prepared) is prepared.vectors
    want = index.search(prepared.vectors, k=10)
    monkeypatch.setattr(queries_mod, "_rows", lambda *a, **k: pytest.fail("checked again"))
    got = index.search(prepared, k=10)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.distances, want.distances)
    sub = prepared.rows(np.array([3, 1]))
    np.testing.assert_array_equal(index.search(sub, k=10).ids, want.ids[[3, 1]])


def test_queries_prepared_for_another_index_are_checked_again(cosine_index):
    _, queries, path = cosine_index
    index = Index.open(path, filter_tier="cpu")
    other = prepare_queries(np.ones((2, DIM + 1), np.float32), DIM + 1, "cosine")
    with pytest.raises(InputError, match=f"queries have dimension {DIM + 1}, the index has dimension {DIM}"):
        index.search(other)
    l2 = prepare_queries(queries * 5, DIM, "l2")  # not unit rows: normalised here
    np.testing.assert_array_equal(index.search(l2, k=5).ids, index.search(queries, k=5).ids)


def test_each_edge_keeps_its_words(tmp_path):
    with pytest.raises(InputError, match=r"queries must be a non-empty \(count, 4\) array, got shape \(2, 2, 4\)"):
        check_queries(np.zeros((2, 2, 4)), 4, "l2")
    with pytest.raises(InputError, match="queries must be numeric, got <U1"):
        check_queries(np.array([["a"] * 4]), 4, "l2")
    with pytest.raises(InputError, match=r"queries must be a non-empty \(count, 4\) array, got shape \(0, 4\)"):
        check_queries(np.zeros((0, 4)), 4, "l2")
    with pytest.raises(InputError, match="queries: row 1 is a zero vector"):
        check_queries(np.eye(4)[[0, 3, 1]] * [[1], [0], [1]], 4, "cosine")
    cat = Catalog(tmp_path, collection_config=CollectionConfig(background_merge=False))
    try:
        col = cat.create("c", 4, "cosine")
        col.upsert([Document("a", None, [1.0, 0, 0, 0])])
        for bad, words in [(np.zeros((3, 7)), r"queries: expected dimension 4, got shape \(3, 7\)"),
                           ([1.0, 2.0], r"queries: expected dimension 4, got shape \(2,\)"),
                           (np.zeros((0, 4)), "queries: no query vectors given"),
                           ([[1, 2, 3, 4], [1, 2]], "queries: not numeric"),
                           ([[1, 2, 3, 4], [np.nan, 0, 0, 0]], "queries: row 1 contains NaN or infinity"),
                           ([[1, 2, 3, 4], [0, 0, 0, 0]], "queries: row 1 is a zero vector")]:
            with pytest.raises(InputError, match=words):
                col.search(bad, k=1)
        assert col.search([2.0, 0, 0, 0], k=1).hits[0][0].id == "a"
    finally:
        cat.close()


def test_a_large_call_holds_little_more_than_its_queries(tmp_path):
    """What numpy allocates during a search of 4000 256-d cosine queries (tracemalloc counts every numpy array):
    the checks work on chunks, each batch normalises its own rows when it comes to them, and a batch's lists,
    candidates and normalised rows go once it is done with them. Before, the float64 copies alone were ~4.5x
    the queries' bytes; then a unit copy of all the queries was held for the whole call (1x)."""
    import tracemalloc

    Index.build(clustered(3000, 256, 20, seed=5), tmp_path / "idx", BuildConfig(metric="cosine"), progress=False)
    q = clustered(4000, 256, 20, seed=6)
    index = Index.open(tmp_path / "idx", filter_tier="cpu", threads=1)
    index.search(q[:10], k=10)
    tracemalloc.start()
    try:
        res = index.search(q, k=10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        index.close()
    assert res.ids.shape == (4000, 10)
    # The results and stats (~1.3 MB) and a few batches in flight (64 queries: 64 KiB of unit rows each), not a
    # copy of the queries (3.9 MiB; 1.55 MiB in all measured on the 2-core VM).
    assert peak < 0.6 * q.nbytes, (peak, q.nbytes)
    unit = q / np.linalg.norm(q.astype(np.float64), axis=1, keepdims=True)
    np.testing.assert_array_equal(res.ids, Index.open(tmp_path / "idx", filter_tier="cpu", threads=1).search(
        prepare_queries(unit.astype(np.float32), 256, "cosine"), k=10).ids)  # the same as prepared beforehand
