"""Tightly clustered data: Gaussian clusters of about 100 vectors in 128-d (conftest.clustered with
n // 100 clusters, the load tests' synthetic_vectors). A graph over the posting lists' centroids
cannot reach every cluster of such data however long it searches. Found on a GPU machine (make
gpu-accept, 2026-11-27) and then on the CPU tier too: rows assigned by the graph alone left their own
cluster's lists empty and sat in far lists, so a collection answered some queries with fewer than k
hits, or none, and recall stopped near 0.89 on 1M such vectors whatever the nprobe. Where the centroids
are few enough (tiers.exhaustive_is_cheap), queries and rows now find lists by exact distance; the ratio
rule keeps lists until they hold the candidates the re-rank wants; a collection's re-search of queries
left short probes every list."""

import numpy as np
import pytest
from conftest import clustered, exact_knn, recall, status_bytes

from fusionrag.retriever import BuildConfig, EngineConfig, Index
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.engine.kmeans import sq_dists
from fusionrag.retriever.engine.tiers import exhaustive_is_cheap

N, DIM = 20000, 128


def near(base: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Queries near the data but not on it (as loadtests.queryset.near_queries makes them)."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(base), n, replace=False)
    return (base[rows] + 0.1 * float(base.std()) * rng.standard_normal((n, base.shape[1]))).astype(np.float32)


def test_rows_and_queries_find_the_same_lists_and_those_are_the_nearest(tmp_path):
    x = clustered(N, DIM, N // 100, seed=3)
    Index.build(x, tmp_path / "idx", BuildConfig(metric="l2"), progress=False)
    idx = Index.open(tmp_path / "idx")
    cents = idx.nav.graph.vectors()
    assert exhaustive_is_cheap(*cents.shape) and idx.nav.exhaustive  # 2,000 centroids x 128
    assert idx.manifest["list_navigation"] == "exact"
    sizes = np.diff(idx.filter.list_offsets)
    owner = np.repeat(np.arange(len(sizes)), sizes)  # the list of each (list, vector) posting
    held = set(zip(owner.tolist(), idx.filter.list_ids.astype(np.int64).tolist()))
    # Measured from the centroids, apart from the build: each vector's nearest centroid's list holds it
    # (by the graph alone, before its reachability repair: 96% here, 86% of 50k such vectors, whose lists were then
    # 13% empty; with it, 99.5% here).
    nearest = sq_dists(x, cents).argmin(axis=1)
    assert all((int(c), v) in held for v, c in enumerate(nearest))
    # And a query finds the lists nearest to it: the nprobe nearest centroids, exactly.
    q = near(x, 50, seed=6)
    lists, _ = idx.nav.nearest(q, idx.params.with_overrides(nprobe=16))
    assert np.array_equal(lists, np.argsort(sq_dists(q, cents), axis=1, kind="stable")[:, :16])
    assert (sizes == 0).mean() <= 0.02 and sizes.max() <= 10 / BuildConfig().centroid_ratio


def test_the_ratio_rule_keeps_lists_until_they_hold_the_candidates_wanted(tmp_path):
    """A query next to an outlier's own list of one vector: measured from that list alone the ratio rule
    kept it alone, and the query got one answer."""
    x = clustered(N // 10, DIM, N // 1000, seed=7)
    outlier = x[:1] + 6.0  # far from every cluster, a list of its own
    x = np.vstack([x, outlier]).astype(np.float32)
    Index.build(x, tmp_path / "idx", BuildConfig(metric="l2"), progress=False)
    idx = Index.open(tmp_path / "idx")
    q = (outlier + 0.5).astype(np.float32)
    res = idx.search(q, k=10)
    assert (res.ids >= 0).sum() == 10
    assert res.stats["unique_candidates"][0] >= 10
    assert recall(res.ids, exact_knn(x, q, 10)) >= 0.9


def test_a_collection_answers_every_query_in_full(tmp_path):
    x = clustered(N, DIM, N // 100, seed=4)
    queries = near(x, 300, seed=5)
    catalog = Catalog(tmp_path / "data", EngineConfig(filter_tier="cpu"),
                      CollectionConfig(background_merge=False, min_index_count=100))
    try:
        col = catalog.create("c", dim=DIM, metric="l2")
        col.upsert([Document(id=str(i), vector=v) for i, v in enumerate(x)])
        col.merge()
        assert col.info()["build_state"]["indexed"] == N  # the index answers, not the exact fresh tier
        hits = col.search(queries, k=10).hits
        assert all(len(h) == 10 for h in hits)
        found = np.array([[int(h.id) for h in row] for row in hits])
        assert recall(found, exact_knn(x, queries, 10)) >= 0.95
        # A query whose whole cluster is deleted: its nearest lists hold only tombstones, and every other
        # list is past the ratio rule's cut (twice the nearest list's distance), so the collection's
        # re-search of queries left short must probe every list, not only those the rule keeps.
        q = queries[:1]
        gone = np.flatnonzero(((x - q) ** 2).sum(axis=1) < np.sort(((x - q) ** 2).sum(axis=1))[10] * 4)
        assert len(gone) >= 20
        col.delete([str(i) for i in gone])
        live = np.setdiff1d(np.arange(N), gone)
        row = col.search(q, k=10).hits[0]
        assert len(row) == 10
        truth = live[exact_knn(x[live], q, 10)[0]]
        assert len({int(h.id) for h in row} & set(truth.tolist())) >= 8
    finally:
        catalog.close()


def test_exact_nearest_in_chunks_of_queries_is_the_same(monkeypatch):
    """A batch larger than a chunk (a GPU tier's 1024 queries) is cut into chunks of queries: the same lists and
    distances as one pass, checked against a full sort of the distances computed apart."""
    import fusionrag.retriever.engine.tiers as tiers

    rng = np.random.default_rng(3)
    centroids = rng.standard_normal((500, 16)).astype(np.float32)
    q = rng.standard_normal((300, 16)).astype(np.float32)
    monkeypatch.setattr(tiers, "EXHAUSTIVE_CHUNK", 500 * 7)  # chunks of 7 queries
    ids, d = tiers.nearest_exhaustive(q, centroids, 20)
    want = ((q.astype(np.float64)[:, None, :] - centroids[None]) ** 2).sum(-1)
    order = np.argsort(want, axis=1, kind="stable")[:, :20]
    assert ids.shape == (300, 20) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids, order)
    np.testing.assert_allclose(d, np.take_along_axis(want, order, 1), rtol=1e-4, atol=1e-4)


def test_exact_navigation_holds_no_copy_of_the_centroids(tmp_path):
    """Exact navigation scores the graph's own SQ8 codes in place (Graph.exact_search). It held a float32 copy of
    the centroids and OpenBLAS's buffers before (7.4 MiB on MiniLM's 3,550 x 384): measured here as the process's
    peak resident set while 1,024 queries navigate in the CPU tier's batches of 64, against 8,000 x 256 centroids
    (an 8 MiB copy), and checked against brute force over the decoded codes."""
    from fusionrag import native
    from fusionrag.retriever.engine.config import SearchParams
    from fusionrag.retriever.engine.tiers import NavigationTier

    cents = clustered(8000, 256, 400, seed=11)
    g = native.Graph(256, "l2", M=4, ef_construction=8, seed=1)  # never searched: exact navigation
    g.add(cents)
    g.save(tmp_path / "graph.bin")
    del g
    graph = native.Graph.load(str(tmp_path / "graph.bin"), quantize=True)
    nav = NavigationTier(graph, augmented=False, threads=2, navigation="exact")
    assert nav.exhaustive and exhaustive_is_cheap(8000, 256)
    q = near(cents, 1024, seed=12)
    p = SearchParams().with_overrides(nprobe=64)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from here
    before = status_bytes("VmRSS")
    out = [nav.nearest(q[lo:lo + 64], p) for lo in range(0, 1024, 64)]
    grown = status_bytes("VmHWM") - before
    copy = cents.nbytes  # what a float32 copy of the centroids takes: 8 MiB
    assert grown < copy / 4, f"navigation grew the peak resident set by {grown / 2**20:.2f} MiB"
    assert nav.memory_bytes() == graph.memory_bytes() < copy / 2  # codes (a quarter), links and norms
    lists = np.concatenate([o[0] for o in out])
    dists = np.concatenate([o[1] for o in out])
    decoded, q64 = graph.vectors().astype(np.float64), q.astype(np.float64)
    want = (q64 ** 2).sum(1)[:, None] - 2 * q64 @ decoded.T + (decoded ** 2).sum(1)[None]  # float64
    order = np.argsort(want, axis=1, kind="stable")[:, :64]
    assert np.mean(lists == order) > 0.999  # the rest: float32 rounding of near ties
    np.testing.assert_allclose(dists, np.take_along_axis(want, lists, 1), rtol=1e-4)


def _manifest_without_navigation(path):
    """What a build before list_navigation was recorded left (the manifest is not among its own checksums)."""
    import json

    mpath = path / "manifest.json"
    m = json.loads(mpath.read_text())
    del m["list_navigation"]
    mpath.write_text(json.dumps(m))


def held_by_nearest(idx: Index, x: np.ndarray) -> float:
    """The share of rows x (the index's, in order) its lists hold in their exact nearest centroid's list, measured
    from the centroids, apart from the build."""
    sizes = np.diff(idx.filter.list_offsets)
    held = set(zip(np.repeat(np.arange(len(sizes)), sizes).tolist(), idx.filter.list_ids.astype(np.int64).tolist()))
    nearest = sq_dists(x, idx.nav.graph.vectors()).argmin(axis=1)
    return float(np.mean([(int(c), v) in held for v, c in enumerate(nearest)]))


def test_a_graph_built_on_two_threads_places_rows_as_one_threads_does(tmp_path):
    """The navigation graph's build threads insert contiguous blocks of the centroids (native Graph.add). Handed
    out node by node, two threads inserted neighbours at once (a build numbers centroids near ones together),
    which did not find each other; a full list's heuristic then dropped one for the other, and nodes fell out of
    reach: on this data 0.984-0.995 of the rows were held by their exact nearest list from run to run, against
    0.9993 on one thread; with a block a thread, 0.9942-0.99995 in 16 runs (bench/results/peers/graph_threads.md)."""
    x = clustered(N, DIM, N // 100, seed=3)
    Index.build(x, tmp_path / "two", BuildConfig(navigation="graph", metric="l2", threads=2, calibrate=False),
                progress=False)
    idx = Index.open(tmp_path / "two")
    try:
        assert held_by_nearest(idx, x) >= 0.99
    finally:
        idx.close()


def test_a_build_records_how_its_rows_found_their_lists_and_its_queries_go_so(tmp_path, monkeypatch):
    """BuildConfig.navigation: 'graph' assigns rows by the graph, as queries then find lists, even where exact
    distances are cheap; 'exact' assigns them exactly, and queries go exactly, even beyond auto's limit. The
    choice is the manifest's, not the rule's of the day: a build whose rows went one way is searched that way."""
    from fusionrag.retriever.engine import build, tiers

    x = clustered(N, DIM, N // 100, seed=3)
    # Rows assigned by exact distances to every centroid (build.nearest_rows), per build.
    exactly: dict[str, int] = {}
    plain = build.nearest_rows

    def counted(name):
        def nearest_rows(rows, *a, **kw):
            exactly[name] = exactly.get(name, 0) + len(rows)
            return plain(rows, *a, **kw)
        monkeypatch.setattr(build, "nearest_rows", nearest_rows)

    # One build thread: a graph built on two depends on how their insertions interleave; one thread's is the same
    # every run.
    one = dict(metric="l2", threads=1)
    counted("graph")
    Index.build(x, tmp_path / "graph", BuildConfig(navigation="graph", **one), progress=False)
    monkeypatch.setattr(tiers, "EXHAUSTIVE_MAX_FLOATS", 1000)  # 'auto' would now take the graph
    counted("exact")
    Index.build(x, tmp_path / "exact", BuildConfig(navigation="exact", **one), progress=False)
    counted("auto")
    Index.build(x, tmp_path / "auto", BuildConfig(**one), progress=False)
    assert exactly.get("exact", 0) >= N and "graph" not in exactly and "auto" not in exactly
    held_by_exact_nearest = {}
    for name in ("graph", "exact", "auto"):
        idx = Index.open(tmp_path / name)
        cents = idx.nav.graph.vectors()
        held_by_exact_nearest[name] = held_by_nearest(idx, x)
        q = near(x, 50, seed=6)
        lists, _ = idx.nav.nearest(q, idx.params.with_overrides(nprobe=16))
        exact_lists = np.argsort(sq_dists(q, cents), axis=1, kind="stable")[:, :16]
        want = "graph" if name in ("graph", "auto") else "exact"
        assert idx.manifest["list_navigation"] == want and idx.nav.exhaustive == (want == "exact"), name
        assert idx.nav.graph.linked == (want == "graph"), name  # exact navigation leaves the links on disk
        assert np.array_equal(lists, exact_lists) == (want == "exact"), name
        idx.close()
    assert held_by_exact_nearest["exact"] == 1.0
    # By the graph, nearly all (each row's search starts at its leaf of the clustering: all of them here; from the
    # graph's entry point 99.9%, on two build threads 98.4-99.5%, and before the graph linked the nodes its
    # heuristic left out of reach, 96%).
    for name in ("graph", "auto"):
        assert held_by_exact_nearest[name] >= 0.99, name


def test_an_index_without_the_record_navigates_as_its_build_did_and_a_merge_records_it(tmp_path, monkeypatch):
    """An index built before list_navigation was recorded: exact where its build's rule (at most 3M centroid
    floats) took it, else by the graph, whatever the limit for new builds says; its next merge writes the
    record, so that lists split later do not move it across the limit. A garbled record is refused by name."""
    import json

    from fusionrag.retriever.engine import tiers
    from fusionrag.retriever.engine.merge import merge_index
    from fusionrag.retriever.errors import IndexFormatError

    x = clustered(4000, 16, 40, seed=8)  # 400 centroids x 16
    Index.build(x, tmp_path / "old", BuildConfig(metric="l2"), progress=False)
    _manifest_without_navigation(tmp_path / "old")
    idx = Index.open(tmp_path / "old")
    assert idx.nav.exhaustive  # 6,400 floats: exact by the old rule
    idx.close()
    monkeypatch.setattr(tiers, "LEGACY_MAX_FLOATS", 400 * 16 - 1)  # one float short: the graph
    old = Index.open(tmp_path / "old")
    assert not old.nav.exhaustive
    rng = np.random.default_rng(9)
    new = (x[5] + 0.3 * rng.standard_normal((300, 16))).astype(np.float32)  # crowds one list: splits
    stats = merge_index(old, np.zeros(len(x), bool), new, tmp_path / "g2", BuildConfig())
    assert stats.splits > 0
    monkeypatch.setattr(tiers, "LEGACY_MAX_FLOATS", 1 << 30)  # the rule would say exact now; the record holds
    merged = Index.open(tmp_path / "g2")
    assert merged.manifest["list_navigation"] == "graph" and not merged.nav.exhaustive
    merged.close()
    old.close()
    mpath = tmp_path / "g2" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["list_navigation"] = "fast"
    mpath.write_text(json.dumps(m))
    with pytest.raises(IndexFormatError, match="list_navigation must be exact or graph, not 'fast'"):
        Index.open(tmp_path / "g2")
