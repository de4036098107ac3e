"""PQ tables built inside the CPU scan (native.scan_topn_pq, CpuFilterTier's BatchTables)
against ProductQuantizer.luts, the numpy reference: the tables, the candidates on real data,
the search end to end, bad input."""

import numpy as np
import pytest
from conftest import recall, tiny_lists

from fusionrag.native import PqCodebooks, pq_luts, scan_topn_pq
from fusionrag.retriever import BuildConfig, Index
from fusionrag.retriever.engine.pq import ProductQuantizer
from fusionrag.retriever.engine.tiers import BatchTables, CpuFilterTier
from fusionrag.retriever.engine.vectors import open_vectors

EPS = np.finfo(np.float32).eps


def rounding_bound(pq: ProductQuantizer, queries: np.ndarray) -> np.ndarray:
    """How far two float32 evaluations of one table entry may differ, per entry (q, M, 256).

    Each of ||q||^2, q.c, ||c||^2 sums dsub products in float32 (relative error <= dsub * eps of
    its sum of |products|, and sum |q_d c_d| <= (||q||^2 + ||c||^2) / 2); two more roundings add the
    three. So one evaluation is within (dsub + 2) * eps * S of the exact value, S = ||q||^2 + ||c||^2,
    and two evaluations within twice that: a bound relative to S, not to the entry, which l2's
    cancellation (q close to c) can make far smaller than S."""
    qs = pq._split(queries).astype(np.float64)
    c = pq.codebooks.astype(np.float64)
    s = (qs**2).sum(-1)[:, :, None] + (c**2).sum(-1)[None]
    return 2 * (pq.dsub + 2) * EPS * s


def check_tables(pq: ProductQuantizer, queries: np.ndarray, metric: str) -> None:
    got = pq_luts(queries, pq.codebooks, metric)
    want = pq.luts(queries, metric)
    assert got.shape == want.shape == (len(queries), pq.m, 256) and got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= rounding_bound(pq, queries)), err.max()


@pytest.mark.parametrize("dim,m", [(10, 4), (7, 1), (24, 1), (100, 64), (384, 64), (50, 25)])
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_tables_equal_numpy_reference(dim, m, metric):
    """Random codebooks and queries: dims not divisible by M (zero padding), M=1, M=64."""
    rng = np.random.default_rng(dim * 100 + m)
    dsub = -(-dim // m)
    pq = ProductQuantizer(rng.standard_normal((m, 256, dsub)).astype(np.float32), dim)
    queries = (3 * rng.standard_normal((9, dim))).astype(np.float32)
    queries[0] = 0  # a zero query: l2 entries are ||c||^2 alone
    check_tables(pq, queries, metric)
    # Threads build whole tables each: any count gives the same bits.
    np.testing.assert_array_equal(pq_luts(queries, pq.codebooks, metric, num_threads=1),
                                  pq_luts(queries, pq.codebooks, metric, num_threads=2))


@pytest.fixture(scope="module")
def sift(tmp_path_factory, data_dir):
    d = data_dir / "sift5k-ngt-texmexq"
    path = tmp_path_factory.mktemp("sift") / "idx"
    Index.build(d / "sift5k_base.fvecs", path, progress=False)
    truth = open_vectors(d / "sift5k_groundtruth.ivecs")[:, :10]
    return open_vectors(d / "sift5k_query.fvecs")[:], path, "l2", truth


@pytest.fixture(scope="module")
def glove_ip(tmp_path_factory, data_dir):
    """GloVe's raw (unnormalised) word vectors under inner product: the 'ip' tables on real data."""
    vectors = open_vectors(data_dir / "glove-6b-50d-angular" / "query_10k.fbin")[:]
    path = tmp_path_factory.mktemp("glove") / "idx"
    Index.build(vectors[:6000], path, BuildConfig(metric="ip"), progress=False)
    return vectors[6000:6200], path, "ip", None


@pytest.fixture(params=["sift", "glove_ip"])
def real(request):
    return request.getfixturevalue(request.param)


def test_tables_of_real_codebooks(real):
    queries, path, metric, _ = real
    index = Index.open(path, filter_tier="cpu")
    check_tables(index.pq, index.prepare_queries(queries), metric)


def test_candidates_equal_numpy_table_path(real):
    """The deferred tables against the numpy ones, through the same scan. Counts are equal
    exactly (tables do not choose lists); distances within float rounding; an id may differ
    only where rounding reorders near-equal distances at the n-th place (the last one kept)."""
    queries, path, metric, _ = real
    index = Index.open(path, filter_tier="cpu")
    cpu = index.filter
    assert isinstance(cpu, CpuFilterTier)
    q = index.prepare_queries(queries)
    lists, _, _ = index.nav.probe(q, index.params)
    n = 200
    tables = cpu.tables(q)
    assert isinstance(tables, BatchTables)  # nothing built yet: the batch's queries, the index's codebooks
    assert tables.queries is q and tables.metric == metric
    assert isinstance(tables.codebooks, PqCodebooks) and tables.codebooks.M == index.pq.m
    assert cpu.tables(q[:1]).codebooks is tables.codebooks  # laid out once per index
    drop = np.zeros(len(cpu.codes), dtype=bool)
    drop[::7] = True  # the exclude bitmap goes the same way
    exclude = np.packbits(drop, bitorder="little")
    for ex in (None, exclude):
        got = cpu.topn(tables, lists, n, ex)
        want = cpu.topn(index.pq.luts(q, metric), lists, n, ex)
        np.testing.assert_array_equal(got.gathered, want.gathered)
        np.testing.assert_array_equal(got.unique, want.unique)
        assert got.lut_seconds.shape == (len(q),) and np.all(got.lut_seconds > 0)
        assert got.seconds.shape == (len(q),) and np.all(got.seconds > 0)
        if ex is not None:
            assert not drop[got.ids[got.ids >= 0]].any()
        # The largest table entry bounds |each of the M summands|: M * that * a few eps is what
        # two summations of rounded entries may differ by.
        tol = 1e-5 * np.abs(got.pq_dists).max() + 4 * index.pq.m * EPS * np.abs(want.pq_dists).max()
        np.testing.assert_allclose(got.pq_dists, want.pq_dists, rtol=1e-5, atol=tol)
        same = 0
        for a, da, b, db in zip(got.ids, got.pq_dists, want.ids, want.pq_dists):
            sa, sb = set(a), set(b)
            same += len(sa & sb)
            # Swapped ids lie at the cut: within rounding of the n-th distance.
            assert all(abs(d - db[-1]) <= tol for i, d in zip(a, da) if i not in sb)
            assert all(abs(d - da[-1]) <= tol for i, d in zip(b, db) if i not in sa)
        assert same / got.ids.size >= 0.99


def test_search_end_to_end_with_tables_in_the_scan(sift, monkeypatch):
    """Index.search on the CPU tier: recall as before, lut_s and scan_s per query from the scan,
    and the same results as with numpy tables (exact re-ranking of near-identical candidates)."""
    queries, path, _, truth = sift
    index = Index.open(path, filter_tier="cpu")
    res = index.search(queries, k=10)
    assert recall(res.ids, truth) >= 0.95
    assert res.stats["lut_s"].shape == (len(queries),) and np.all(res.stats["lut_s"] > 0)
    assert np.all(res.stats["scan_s"] > 0)
    built = []
    monkeypatch.setattr(index.filter, "tables", lambda q: built.append(len(q)) or index.pq.luts(q, index.filter.metric))
    numpy_tables = index.search(queries, k=10)
    assert sum(built) == len(queries)  # the search took the numpy tables
    assert np.mean(res.ids == numpy_tables.ids) >= 0.99
    assert np.all(numpy_tables.stats["lut_s"] > 0)


def _valid():
    rng = np.random.default_rng(0)
    return dict(
        queries=rng.standard_normal((2, 10)).astype(np.float32),
        codebooks=rng.standard_normal((4, 256, 3)).astype(np.float32),  # dims 9..12
        metric="l2",
        **tiny_lists(),
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(queries=np.zeros((2, 13), np.float32)), r"queries have dimension 13, .* for dimensions 9\.\.12"),
        (dict(queries=np.zeros((2, 8), np.float32)), "queries have dimension 8"),
        (dict(queries=np.zeros((2, 10), np.float64)), "queries must be float32, got float64"),
        (dict(queries=np.zeros((2, 10), np.int32)), "queries must be float32, got int32"),
        (dict(queries=np.zeros(10, np.float32)), "queries must be 2-D"),
        (dict(queries=np.zeros((2, 20), np.float32)[:, ::2]), "queries must be C-contiguous"),
        (dict(codebooks=np.zeros((4, 256, 3), np.float16)), "codebooks must be float32, got float16"),
        (dict(codebooks=np.zeros((4, 255, 3), np.float32)), r"codebooks must have shape \(M, 256, dsub\)"),
        (dict(codebooks=np.zeros((4, 256, 0), np.float32)), "codebooks must have shape"),
        (dict(metric="cosine"), "metric must be 'l2' or 'ip', not 'cosine'"),
        (dict(codes=np.zeros((10, 5), np.uint8)), r"codes must have shape \(N, 4\) to match codebooks"),
        (dict(probe_lists=np.array([[0, 1]], np.int32)), "probe_lists has 1 rows for 2 queries"),
        (dict(n=0), "n must be positive"),
        (dict(exclude=np.zeros(1, np.uint8)), "exclude"),
    ],
)
def test_bad_input_is_refused(change, match):
    args = _valid()
    args.update(change)
    with pytest.raises(ValueError, match=match):
        scan_topn_pq(**args)
    if {"queries", "codebooks", "metric"} & set(change):
        with pytest.raises(ValueError, match=match):
            pq_luts(args["queries"], args["codebooks"], args["metric"])


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_codebooks_laid_out_once_give_the_same_tables_and_candidates(metric):
    a = _valid()
    laid = PqCodebooks(a["codebooks"])
    assert (laid.M, laid.dsub) == (4, 3) and laid.nbytes == (4 * 3 * 256 + 4 * 256) * 4
    np.testing.assert_array_equal(pq_luts(a["queries"], laid, metric), pq_luts(a["queries"], a["codebooks"], metric))
    a["codes"] = np.random.default_rng(1).integers(0, 256, (10, 4), dtype=np.uint8)
    got = scan_topn_pq(**{**a, "codebooks": laid, "metric": metric})
    want = scan_topn_pq(**{**a, "metric": metric})
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match="queries have dimension 13"):
        pq_luts(np.zeros((2, 13), np.float32), laid, metric)
    with pytest.raises(ValueError, match="codebooks must be a float32 .* array or a PqCodebooks"):
        pq_luts(a["queries"], "codebooks", metric)
    with pytest.raises(ValueError, match="codebooks must be float32, got float64"):
        PqCodebooks(np.zeros((4, 256, 3)))


def test_bad_input_through_the_tier():
    a = _valid()
    tier = CpuFilterTier(a["list_offsets"], a["list_ids"], a["codes"], a["codebooks"], threads=1)
    pq = ProductQuantizer(a["codebooks"], 10)
    ok = tier.topn(tier.tables(a["queries"]), a["probe_lists"], 4)
    assert ok.ids.shape == (2, 4) and ok.lut_seconds.shape == (2,)
    want = tier.topn(pq.luts(a["queries"], "l2"), a["probe_lists"], 4)
    np.testing.assert_array_equal(ok.unique, want.unique)
    with pytest.raises(ValueError, match="metric must be 'l2' or 'ip'"):
        tier.topn(BatchTables(a["queries"], tier.codebooks, "cosine"), a["probe_lists"], 4)
    with pytest.raises(ValueError, match="queries have dimension 13"):
        tier.topn(tier.tables(np.zeros((2, 13), np.float32)), a["probe_lists"], 4)
