"""4-bit PQ codes (BuildConfig.pq_bits 4) through the engine: built, searched on the CPU tier (native
scan_topn_pq4) and the device tier (kernels/adc_stream.py), searched among a filter's ids, merged, and refused by
the lists tier. Retrieval is measured on real data (SIFT5k: 5,000 x 128, its own queries and ground truth) against
the same build with 8-bit codes."""

import numpy as np
import pytest
from conftest import clustered, exact_knn, recall

from fusionrag.retriever import BuildConfig, EngineConfig, Index
from fusionrag.retriever.engine.merge import merge_index
from fusionrag.retriever.engine.pq import ProductQuantizer
from fusionrag.retriever.engine.vectors import open_vectors
from fusionrag.retriever.errors import ConfigError


@pytest.fixture(scope="module")
def sift(tmp_path_factory, data_dir):
    d = data_dir / "sift5k-ngt-texmexq"
    tmp = tmp_path_factory.mktemp("pq4")
    for bits in (8, 4):
        Index.build(d / "sift5k_base.fvecs", tmp / f"idx{bits}", BuildConfig(pq_bits=bits), progress=False)
    base = np.asarray(open_vectors(d / "sift5k_base.fvecs")[:], np.float32)
    queries = np.asarray(open_vectors(d / "sift5k_query.fvecs")[:], np.float32)
    gt = open_vectors(d / "sift5k_groundtruth.ivecs")[:, :10]
    return tmp, base, queries, gt


def test_four_bit_codes_take_the_same_bytes_and_find_as_much(sift):
    tmp, base, queries, gt = sift
    eight, four = Index.open(tmp / "idx8"), Index.open(tmp / "idx4")
    assert eight.manifest["pq"] == {"m": 64, "dsub": 2, "bits": 8}
    assert four.manifest["pq"] == {"m": 128, "dsub": 1, "bits": 4}  # twice the sub-spaces in the same bytes
    assert four.filter.four_bit and not eight.filter.four_bit
    codes4, codes8 = np.load(tmp / "idx4" / "pq_codes.npy"), np.load(tmp / "idx8" / "pq_codes.npy")
    assert codes4.shape == codes8.shape == (5000, 64)
    # each vector's code is its nearest centroid in every sub-space, two to a byte
    pq = four.pq
    assert pq.ksub == 16 and np.array_equal(codes4[:200], pq.encode(base[:200]))
    sub = pq.sub_codes(codes4[:200]).astype(np.int64)
    dist = (base[:200, :, None] - pq.codebooks[None, :, :, 0]) ** 2  # (n, 128 sub-spaces, 16 centroids)
    chosen = np.take_along_axis(dist, sub[:, :, None], axis=2)[:, :, 0]
    assert (chosen <= dist.min(axis=2) + 1e-3).all()  # (centroids of a sparse dimension may tie)
    assert eight.memory_parts()[0]["pq_codes"] == four.memory_parts()[0]["pq_codes"] == codes8.nbytes
    # at the defaults both reach the recall the engine promises; at a small re-rank, within 0.02 of each other
    r8, r4 = (recall(i.search(queries, k=10).ids, gt) for i in (eight, four))
    assert r8 >= 0.95 and r4 >= 0.95
    lean = dict(nprobe=16, rerank=20)
    lean8, lean4 = (recall(i.search(queries, k=10, **lean).ids, gt) for i in (eight, four))
    assert abs(lean8 - lean4) <= 0.02, (lean8, lean4)
    res = four.search(queries[:5], k=10, **lean)
    assert (res.stats["unique_candidates"] > 20).all() and (res.stats["scan_s"] > 0).all()
    # every list probed and every candidate re-ranked: exact
    assert recall(four.search(queries, k=10, nprobe=10**6, rerank=5000, beta=0).ids, gt) == 1.0


def test_filtered_searches_over_four_bit_codes(sift):
    tmp, base, queries, _ = sift
    four = Index.open(tmp / "idx4")
    rng = np.random.default_rng(4)
    passing = np.sort(rng.choice(len(base), 300, replace=False))
    truth = passing[exact_knn(base[passing], queries[:40], 10)]
    # among the ids: every one scored, and with a re-rank of all of them the answer is exact
    got = four.search_among(queries[:40], passing, k=10, rerank=300)
    assert recall(got.ids, truth) == 1.0
    near = four.search_among(queries[:40], passing, k=10, rerank=40)
    assert recall(near.ids, truth) >= 0.9
    # through the lists, widened by the share the bitmap lets through
    ok = np.zeros(len(base), bool)
    ok[passing] = True
    res = four.search(queries[:40], k=10, exclude=np.packbits(~ok, bitorder="little"))
    assert ok[res.ids[res.ids >= 0]].all() and recall(res.ids, truth) >= 0.9


def test_the_device_tier_scans_four_bit_codes_and_the_lists_tier_refuses_them(sift, monkeypatch):
    """The device tier (Triton's interpreter here, CPU tensors) over 4-bit codes: the CPU tier's lists, postings and
    distinct candidates, its recall within 0.01 (the device sums float tables, the CPU tier byte-quantized ones),
    and the PQ distances of its top-n those of the 4-bit codes by their codebooks, computed here with numpy. The
    lists tier refuses such an index; too small a budget falls back to the CPU tier under 'auto'."""
    from fusionrag.retriever.engine.device_tier import DeviceTier

    tmp, base, queries, gt = sift
    q = queries[:40]
    cpu = Index.open(tmp / "idx4", filter_tier="cpu")
    dev = Index.open(tmp / "idx4", EngineConfig(filter_tier="gpu", gpu_search="device", gpu_budget_bytes=128 << 20,
                                                batch_size=16))
    try:
        assert isinstance(dev.filter, DeviceTier) and (dev.filter.m, dev.filter.ksub, dev.filter.code_bytes) == \
            (128, 16, 64)
        for nprobe in (8, 32):
            a, b = cpu.search(q, 10, nprobe=nprobe), dev.search(q, 10, nprobe=nprobe)
            for key in ("lists_probed", "candidates", "unique_candidates"):
                assert np.array_equal(a.stats[key], b.stats[key]), key
            assert recall(b.ids, gt[:40]) >= recall(a.ids, gt[:40]) - 0.01
        prepared = cpu.prepare_queries(q)
        lists, _, _ = cpu.nav.probe(prepared, cpu.params.with_overrides(nprobe=8))
        got = dev.filter.topn(dev.filter.tables(prepared), lists, 60)
        pq, codes = cpu.pq, np.load(tmp / "idx4" / "pq_codes.npy")
        luts = pq.luts(prepared, "l2").astype(np.float64)
        offsets, ids = np.load(tmp / "idx4" / "list_offsets.npy"), np.load(tmp / "idx4" / "list_ids.npy")
        for i in range(len(q)):
            cands = np.unique(np.concatenate([ids[offsets[c]:offsets[c + 1]] for c in lists[i] if c >= 0]))
            adc = luts[i][np.arange(pq.m), pq.sub_codes(codes[cands]).astype(np.int64)].sum(1)
            mine = got.ids[i][got.ids[i] >= 0]
            np.testing.assert_allclose(got.pq_dists[i][:len(mine)], adc[np.searchsorted(cands, mine)], rtol=1e-4,
                                       atol=1e-2)
            assert len(mine) == min(60, len(cands)) and got.pq_dists[i][len(mine) - 1] <= \
                np.sort(adc)[len(mine) - 1] * (1 + 1e-4) + 1e-2  # the nearest by ADC, ties aside
    finally:
        dev.close()
        cpu.close()
    with pytest.raises(ConfigError, match="lists tier"):
        Index.open(tmp / "idx4", filter_tier="gpu", gpu_search="lists")
    with pytest.raises(ConfigError, match="8-bit PQ codes"):  # the device tier does not fit, and no lists tier
        Index.open(tmp / "idx4", filter_tier="gpu", gpu_budget_bytes=1 << 20)
    monkeypatch.setattr("fusionrag.retriever.engine.pipeline.cuda_available", lambda: True)
    for extra in (dict(gpu_search="lists"), dict(gpu_budget_bytes=1 << 20)):
        index = Index.open(tmp / "idx4", filter_tier="auto", **extra)
        assert index.filter.name == "cpu" and index.cpu_beside is None
        index.close()


def test_a_merge_encodes_new_vectors_in_four_bits(tmp_path):
    base = clustered(1500, 16, 30, seed=1)
    cfg = BuildConfig(pq_bits=4)
    Index.build(base, tmp_path / "g1", cfg, progress=False)
    old = Index.open(tmp_path / "g1")
    dead = np.zeros(len(base), bool)
    dead[::4] = True
    new = clustered(400, 16, 30, seed=5)
    merge_index(old, dead, new, tmp_path / "g2", cfg)
    merged = np.load(tmp_path / "g2" / "pq_codes.npy")
    old_codes = np.load(tmp_path / "g1" / "pq_codes.npy")
    assert merged.shape == (int((~dead).sum()) + 400, 8)  # 16 dims: 8 bytes, 16 sub-spaces of 4 bits
    assert np.array_equal(merged[:int((~dead).sum())], old_codes[~dead])
    assert np.array_equal(merged[-400:], old.pq.encode(new))
    idx = Index.open(tmp_path / "g2")
    vecs = np.concatenate([base[~dead], new])
    q = clustered(40, 16, 30, seed=7)
    truth = exact_knn(vecs, q, 10)
    assert recall(idx.search(q, 10).ids, truth) >= 0.95


def test_pq_bits_is_eight_or_four_or_measured():
    assert BuildConfig().pq_bits == 0 and BuildConfig().pq_subspaces(128) == 64  # measured: 8-bit codes first
    assert BuildConfig(pq_bits=8).pq_subspaces(128) == 64
    assert BuildConfig(pq_bits=4).pq_subspaces(128) == 128 and BuildConfig(pq_bits=4, pq_m=100).pq_subspaces(8) == 200
    for bad in (5, 16):
        with pytest.raises(ConfigError, match="pq_bits"):
            BuildConfig(pq_bits=bad)
    with pytest.raises(ConfigError, match="at most 128"):
        BuildConfig(pq_bits=4, pq_m=129)
    with pytest.raises(ValueError, match="ksub"):
        ProductQuantizer.train(np.zeros((300, 4), np.float32), 2, 2, np.random.default_rng(0), ksub=32)


def test_a_sharded_build_with_four_bit_codes_equals_the_single_index(tmp_path):
    """Every shard holds 4-bit codes under the router's one set of codebooks; with every candidate of the probed
    lists re-ranked the router answers as the single index does."""
    from fusionrag.retriever.engine.config import SearchParams
    from fusionrag.retriever.sharded.build import build_sharded
    from fusionrag.retriever.sharded.router import ShardedIndex

    base = clustered(3000, 24, 30, seed=3, spread=0.6)
    q = clustered(60, 24, 30, seed=4, spread=0.6)
    cfg = BuildConfig(threads=1, centroid_ratio=0.05, pq_bits=4)
    Index.build(base, tmp_path / "single", cfg, progress=False)
    build_sharded(base, tmp_path / "sharded", 3, cfg, progress=False)
    single, sharded = Index.open(tmp_path / "single"), ShardedIndex.open(tmp_path / "sharded")
    try:
        every = SearchParams(rerank=3000, beta=0)
        a, b = single.search(q, 10, every), sharded.search(q, 10, every)
        assert np.array_equal(a.ids, b.ids)
        truth = exact_knn(base, q, 10)
        assert recall(sharded.search(q, 10).ids, truth) >= recall(single.search(q, 10).ids, truth) > 0.9
        for part in sorted(p for p in (tmp_path / "sharded").iterdir() if p.is_dir()):
            if (part / "pq_codes.npy").exists():
                assert np.load(part / "pq_codes.npy").shape[1] == 12  # 24 sub-spaces of 4 bits
    finally:
        sharded.close()
