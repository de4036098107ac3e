"""A search that may return only some of the index's vectors (a filter's, or those tombstones leave) probes lists
widened by the share passing (config.probe_widening, Index.search's passing): the scan skips the excluded vectors
before scoring them, so as many passing vectors are scored as an unfiltered search scores. Recall is measured
against brute force over the passing vectors; the lists probed are the engine's own statistics, checked against
the arithmetic of the rule."""

import math

import numpy as np
import pytest
from conftest import clustered, exact_knn, recall

from fusionrag.retriever import BuildConfig, Index
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.engine.config import SearchParams, probe_widening
from fusionrag.retriever.engine.pipeline import passing_share
from fusionrag.retriever.engine.tiers import EXACT_NAVIGATION_MIN, exact_navigation
from fusionrag.retriever.errors import InputError

DIM = 24


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    x = clustered(6000, DIM, 60, seed=3)
    q = clustered(60, DIM, 60, seed=4)
    path = tmp_path_factory.mktemp("filtered") / "idx"
    Index.build(x, path, BuildConfig(metric="l2"), progress=False)
    return x, q, path


def _filters(x):
    rng = np.random.default_rng(5)
    proj = x @ rng.standard_normal(x.shape[1])
    # a random tenth, and the tenth beyond a half-space's quantile: passing vectors together, far from most queries
    return [("random", rng.random(len(x)) < 0.1), ("half-space", proj > np.quantile(proj, 0.9))]


def test_the_widening_divides_nprobe_and_the_floor_by_the_share_passing():
    p = SearchParams(nprobe=40, rerank=120)
    assert probe_widening(p, 1.0) == (40, 120)
    assert probe_widening(p, 0.1) == (math.ceil(40 / 0.1), math.ceil(120 / 0.1))
    assert probe_widening(p, 0.3) == (134, 400)
    assert probe_widening(p, 1e-12)[0] == 2**31 - 1  # capped; the navigation then finds every list
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(InputError, match="passing"):
            probe_widening(p, bad)


@pytest.mark.parametrize("count", [1, 8, 13, 1000, 4099])
def test_the_share_passing_counts_the_bits_of_the_vectors_alone(count):
    rng = np.random.default_rng(count)
    excluded = rng.random(count) < 0.3
    bitmap = np.packbits(excluded, bitorder="little")
    if count % 8:
        bitmap[-1] |= np.uint8(0xFF << (count % 8) & 0xFF)  # bits past the last vector: not vectors, not counted
    assert passing_share(bitmap, count) == pytest.approx(max(count - excluded.sum(), 1) / count)
    assert passing_share(np.packbits(np.ones(count, bool), bitorder="little"), count) == 1 / count
    assert passing_share(np.zeros(len(bitmap) + 1, np.uint8), count) == 1.0  # the scan refuses this size


def test_exact_navigation_where_the_graphs_beam_would_cost_more():
    assert not exact_navigation(256, 40_000) and not exact_navigation(EXACT_NAVIGATION_MIN - 1, 1000)
    assert exact_navigation(EXACT_NAVIGATION_MIN, 1000) and exact_navigation(300, 300)
    assert not exact_navigation(EXACT_NAVIGATION_MIN, 64 * EXACT_NAVIGATION_MIN * 2)
    assert exact_navigation(2 * EXACT_NAVIGATION_MIN, 64 * EXACT_NAVIGATION_MIN * 2)


def test_a_filtered_search_probes_widened_lists_and_keeps_its_recall(built):
    """At nprobe 16 of 660 lists (rerank 50): the lists an unfiltered search probes hold a tenth of the vectors a
    search may return, and lose most of the top-10; widened tenfold (less what the ratio rule cuts) they hold as
    many as an unfiltered search's, and the recall comes back."""
    x, q, path = built
    index = Index.open(path)
    try:
        for label, ok in _filters(x):
            truth = np.flatnonzero(ok)[exact_knn(x[ok], q, 10)]
            exclude = np.packbits(~ok, bitorder="little")
            narrow = index.search(q, 10, exclude=exclude, passing=1.0, nprobe=16, rerank=50)
            wide = index.search(q, 10, exclude=exclude, nprobe=16, rerank=50)
            assert np.isin(wide.ids[wide.ids >= 0], np.flatnonzero(ok)).all(), label
            assert narrow.stats["lists_probed"].max() <= 16
            widened, _ = probe_widening(SearchParams(nprobe=16), ok.mean())
            assert wide.stats["lists_probed"].max() <= widened
            assert wide.stats["lists_probed"].mean() >= 0.8 * widened, label  # the ratio rule cuts a few
            assert recall(narrow.ids, truth) < 0.8, label  # the case the widening is for
            assert recall(wide.ids, truth) >= (0.95 if label == "random" else 0.85), label
            # The same share given by the caller (a collection counts its live rows) searches as counted.
            given = index.search(q, 10, exclude=exclude, passing=float(ok.mean()), nprobe=16, rerank=50)
            assert np.array_equal(given.ids, wide.ids)
    finally:
        index.close()


def test_without_an_exclusion_nothing_widens(built):
    x, q, path = built
    index = Index.open(path)
    try:
        a = index.search(q, 10, nprobe=16)
        b = index.search(q, 10, nprobe=16, exclude=np.zeros((len(x) + 7) // 8, np.uint8))
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.stats["lists_probed"], b.stats["lists_probed"])
    finally:
        index.close()


def test_widened_lists_past_the_crossover_are_the_exact_nearest(built, tmp_path):
    """The graph is asked for m lists with a beam of m: from EXACT_NAVIGATION_MIN (and size / 64) the navigation
    scores every centroid instead, and the lists are the exact nearest; below it, the graph's."""
    x, q, _ = built
    Index.build(x, tmp_path / "graph", BuildConfig(metric="l2", navigation="graph"), progress=False)
    index = Index.open(tmp_path / "graph")
    try:
        nav = index.nav
        assert not nav.exhaustive
        size = nav.graph.size
        qs = index.prepare_queries(q)
        for m in (64, EXACT_NAVIGATION_MIN, size):
            lists, dists = nav.nearest(qs, SearchParams(nprobe=1), m)
            by = (nav.graph.exact_search(qs, min(m, size), nav.threads) if exact_navigation(m, size)
                  else nav.graph.search(qs, m, m, nav.threads))
            assert np.array_equal(lists, by[0]) and np.array_equal(dists, by[1]), m
        assert exact_navigation(EXACT_NAVIGATION_MIN, size) and not exact_navigation(64, size)
    finally:
        index.close()


def test_a_collections_filter_widens_the_lists_by_the_live_share(tmp_path):
    """Through a collection: a filter passing a tenth of the documents (more than filter_exact_max, so the index
    searches with the rest excluded) probes about ten times the lists of the same search unfiltered, and finds
    the filtered top-10."""
    n = 6000
    x = clustered(n, DIM, 60, seed=3)
    q = clustered(30, DIM, 60, seed=4)
    bucket = np.arange(n) % 10
    cfg = CollectionConfig(min_index_count=500, background_merge=False, filter_exact_max=100)
    cat = Catalog(tmp_path, collection_config=cfg)
    try:
        col = cat.create("f", DIM, "l2")
        col.add([Document(str(i), None, x[i], {"bucket": int(bucket[i])}) for i in range(n)])
        col.merge()
        params = {"nprobe": 16, "rerank": 50}
        plain = col.search(q, k=10, params=params)
        res = col.search(q, k=10, filter={"bucket": 3}, params=params)
        assert not res.stats[0]["filtered_exact"]
        lists = np.array([s["lists_probed"] for s in res.stats])
        assert lists.mean() >= 8 * np.mean([s["lists_probed"] for s in plain.stats])
        ok = np.flatnonzero(bucket == 3)
        found = np.array([[int(h.id) for h in hits] + [-1] * (10 - len(hits)) for hits in res.hits])
        assert recall(found, ok[exact_knn(x[ok], q, 10)]) >= 0.95
    finally:
        cat.close()
