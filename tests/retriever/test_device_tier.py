"""The device tier (retriever/engine/device_tier.py: a batch's navigation, lists, scan, top-n and re-rank on the GPU)
against the CPU tier on real indexes. Without a GPU it runs on CPU tensors through Triton's interpreter
(conftest.py sets TRITON_INTERPRET=1), holding its parts as tensors of its device and crossing to it only through
its uploads, as on a GPU.

The two tiers sum PQ distances in different orders and the device navigates by exact distance (the CPU tier by
the graph where the index does), so answers are compared by recall and by the exact distances of the hits both
return; candidate counts and top-n sets where both probe the same lists."""

import numpy as np
import pytest
import torch
from conftest import clustered, exact_knn, recall

from fusionrag.kernels.pool import DeviceBudget
from fusionrag.retriever import BuildConfig, ConfigError, EngineConfig, Index
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.engine import device_tier as device_tier_mod
from fusionrag.retriever.engine import gpu_tier as gpu_tier_mod
from fusionrag.retriever.engine.device_tier import DeviceTier
from fusionrag.retriever.engine.gpu_tier import GpuFilterTier

DIM = 24
DEVICE = dict(filter_tier="gpu", gpu_search="device", gpu_budget_bytes=128 << 20, batch_size=16)


@pytest.fixture(autouse=True)
def bookkeeping_budgets(monkeypatch):
    """As test_gpu_tier.py: each test starts with no process budget, and budgets count the tiers' parts only."""
    monkeypatch.setattr(gpu_tier_mod, "_budgets", {})
    monkeypatch.setattr(DeviceBudget, "true_up", lambda self: None)
    monkeypatch.setattr(device_tier_mod, "ALLOCATOR_SLACK", 0)


def _build(tmp_path_factory, metric):
    base = clustered(3000, DIM, 30, seed=1)
    queries = clustered(40, DIM, 30, seed=2)
    path = tmp_path_factory.mktemp(f"device-{metric}") / "idx"
    Index.build(base, path, BuildConfig(metric=metric), progress=False)
    return metric, base, queries, path


@pytest.fixture(scope="module", params=["l2", "ip", "cosine"])
def every_metric(request, tmp_path_factory):
    return _build(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(tmp_path_factory, "l2")


def _truth(metric, base, queries, k=10):
    return exact_knn(base, queries, k, metric)


def _common_distances_equal(a, b, atol=1e-4):
    for ai, ad, bi, bd in zip(a.ids, a.distances, b.ids, b.distances):
        _, at_a, at_b = np.intersect1d(ai[ai >= 0], bi[bi >= 0], return_indices=True)
        np.testing.assert_allclose(ad[at_a], bd[at_b], rtol=1e-5, atol=atol)


@pytest.mark.parametrize("raw", [True, False])
def test_device_search_answers_as_the_cpu_tier(every_metric, raw):
    """The raw vectors on the device (re-ranked there, no page read) or on the SSD (the host re-ranks the device's
    top-n): the same lists probed, the same postings scanned and distinct candidates, recall at least the CPU
    tier's, and the hits both return at the same exact distance."""
    metric, base, queries, path = every_metric
    cpu = Index.open(path, EngineConfig(filter_tier="cpu"))
    dev = Index.open(path, EngineConfig(**DEVICE, gpu_tiered_share=0.5 if raw else 1e-9))
    assert isinstance(dev.filter, DeviceTier) and dev.filter.raw_resident is raw
    truth = _truth(metric, base, queries)
    for nprobe in (4, 16):
        a, b = cpu.search(queries, 10, nprobe=nprobe), dev.search(queries, 10, nprobe=nprobe)
        for key in ("centroids_probed", "candidates", "unique_candidates"):
            assert np.array_equal(a.stats[key], b.stats[key]), key
        assert recall(b.ids, truth) >= recall(a.ids, truth) - 0.005
        _common_distances_equal(a, b)
        if raw:
            assert b.stats["pages_read"].sum() == 0 and b.stats["pages_buffered"].sum() == 0
    assert b.info["gpu_search"] == "device" and dev.memory()["filter"]["raw_vectors_resident"] is raw
    dev.close()


def test_top_n_of_the_lists_given_equals_the_cpu_tiers(every_metric):
    """What a shard of a sharded index (and learned pruning) asks: the top-n of lists the caller gives."""
    metric, base, queries, path = every_metric
    cpu = Index.open(path, EngineConfig(filter_tier="cpu"))
    dev = Index.open(path, EngineConfig(**DEVICE))
    q = cpu.prepare_queries(queries)
    lists, _, _ = cpu.nav.probe(q, cpu.params.with_overrides(nprobe=8))
    want = cpu.filter.topn(cpu.filter.tables(q), lists, 60)
    got = dev.filter.topn(dev.filter.tables(q), lists, 60)
    assert np.array_equal(got.gathered, want.gathered) and np.array_equal(got.unique, want.unique)
    for gi, gd, wi, wd in zip(got.ids, got.pq_dists, want.ids, want.pq_dists):
        kept = wd[wi >= 0]
        only = set(gi[gi >= 0]) ^ set(wi[wi >= 0])  # near-ties at the boundary may swap
        assert not only or np.all(np.abs(np.asarray([*gd[np.isin(gi, list(only))], *wd[np.isin(wi, list(only))]])
                                          - kept.max()) <= 1e-4 * max(1.0, abs(kept.max())))
    a = cpu.search_lists(queries, lists, 10)
    b = dev.search_lists(queries, lists, 10)
    assert recall(b.ids, _truth(metric, base, queries)) >= recall(a.ids, _truth(metric, base, queries)) - 0.01
    dev.close()


def test_what_crosses_to_and_from_the_device_is_the_queries_and_the_answers(built):
    """A batch sends its queries (4 bytes a coordinate) and, once, the exclusion bitmap's changed bytes; it receives
    k answers (12 bytes each) and four counts a query. The lists tier sent every gathered ID (4 bytes each)."""
    metric, base, queries, path = built
    dev = Index.open(path, EngineConfig(**DEVICE))
    tier = dev.filter
    before = dict(tier.phases)
    res = dev.search(queries, 10, nprobe=16)
    nq = len(queries)
    assert tier.phases["bytes_up"] - before["bytes_up"] == nq * DIM * 4
    assert tier.phases["bytes_down"] - before["bytes_down"] == nq * (10 * 12 + 32)
    assert res.stats["candidates"].sum() * 4 > 5 * nq * DIM * 4  # what the lists tier would have sent
    bitmap = np.zeros((len(base) + 7) // 8, np.uint8)
    bitmap[10:20] = 0xFF
    start = dict(tier.phases)
    first = dev.search(queries, 10, nprobe=16, exclude=bitmap)
    sent = tier.phases["bytes_up"] - start["bytes_up"]
    assert sent == nq * DIM * 4 + len(bitmap)  # the first bitmap goes whole
    again = dict(tier.phases)
    bitmap[15] = 0x0F
    dev.search(queries, 10, nprobe=16, exclude=bitmap)
    assert tier.phases["bytes_up"] - again["bytes_up"] == nq * DIM * 4 + 1  # then only what changed
    hit = first.ids[first.ids >= 0]
    assert not np.any((hit >= 80) & (hit < 160))
    dev.close()


def test_a_batch_larger_than_the_working_memory_goes_in_chunks_with_the_same_answers(built):
    metric, base, queries, path = built
    whole = Index.open(path, EngineConfig(**DEVICE))
    tier = whole.filter
    want = whole.search(queries, 10, nprobe=32)
    small = DeviceTier(whole.nav.graph.vectors(), metric == "ip", tier.list_offsets, tier.list_ids,
                       np.load(path / "pq_codes.npy"), np.load(path / "pq_codebooks.npy"),
                       account=gpu_tier_mod.shared_account(torch.device("cpu"), 0, 0.9, "small"),
                       metric=tier.metric, batch_size=16, threads=1, raw=None, dim=DIM, work_bytes=1 << 16)
    chunks = list(small._chunks(want.stats["candidates"][:8], 0))
    assert len(chunks) > 3  # the plan splits the batch
    got = small.search(whole.prepare_queries(queries[:8]), whole.params.with_overrides(nprobe=32), 200, 10)
    assert not got.final  # raw=None: the top-n go back to the host
    ref = tier.search(whole.prepare_queries(queries[:8]), whole.params.with_overrides(nprobe=32), 200, 10,
                      rerank=False)
    assert np.array_equal(got.gathered, ref.gathered) and np.array_equal(got.unique, ref.unique)
    assert all(set(a[a >= 0]) == set(b[b >= 0]) for a, b in zip(got.ids, ref.ids))
    small.close()
    whole.close()


def test_the_budget_holds_what_the_tier_holds_and_too_small_a_budget_falls_back(built):
    """The account's parts are the bytes of the tensors the tier holds (counted here from the tensors); a budget
    that cannot hold the fixed parts gets the lists tier under 'auto' and a clear error under 'device'; raw
    vectors go up only where they fit their share."""
    metric, base, queries, path = built
    dev = Index.open(path, EngineConfig(**DEVICE))
    t = dev.filter
    held = sum(x.numel() * x.element_size() for x in (t.codebooks, t.centroids, t.centroid_norms, t.offsets, t.sizes,
                                                       t.ids, t.codes, t.bitmap, t.raw))
    parts = dict(t.account.parts)
    assert held <= sum(parts.values()) - parts["working memory"] <= held + 16 * 256
    assert t.codes.shape == (len(t.list_ids), t.m) and t.raw.shape == (len(base), DIM)
    assert t.memory_bytes() == t.codes.numel()
    dev.close()
    assert t.account.used == 0
    fixed = sum(parts.values()) - parts["working memory"] - parts["raw vectors"]
    small = fixed + device_tier_mod.MIN_WORK - (1 << 20)  # the lists tier fits, the device tier does not
    lists = Index.open(path, EngineConfig(filter_tier="gpu", gpu_budget_bytes=small, batch_size=16))
    assert isinstance(lists.filter, GpuFilterTier)  # auto: the lists tier
    lists.close()
    with pytest.raises(ConfigError, match="device tier needs"):
        Index.open(path, EngineConfig(filter_tier="gpu", gpu_search="device", gpu_budget_bytes=small))
    raw = parts["raw vectors"]
    for share, resident in ((0.5, False), (1.0, True)):  # room for the raw vectors beside the working memory
        t = Index.open(path, EngineConfig(filter_tier="gpu", gpu_search="device", gpu_tiered_share=share,
                                          gpu_budget_bytes=fixed + device_tier_mod.MIN_WORK + raw, batch_size=16))
        assert t.filter.raw_resident is resident and (t.filter.raw is not None) is resident
        t.close()


def test_a_collection_on_the_device_tier_answers_as_on_the_cpu(tmp_path):
    """Writes, deletes (tombstones excluded on the device), a merge, filtered searches: the same hits as a
    collection on the CPU tier, and nothing deleted comes back."""
    x = clustered(2500, DIM, 20, seed=5)
    docs = [Document(f"d{i}", f"text {i}", v, {"n": i % 5}) for i, v in enumerate(x)]
    cfg = CollectionConfig(min_index_count=500, background_merge=False)
    out = {}
    for tier in ("cpu", "gpu"):
        cat = Catalog(tmp_path / tier, EngineConfig(filter_tier=tier, gpu_search="device",
                                                    gpu_budget_bytes=128 << 20, batch_size=64), cfg)
        col = cat.create("c", DIM, "l2")
        col.upsert(docs[:2000])
        col.merge()
        col.delete([f"d{i}" for i in range(0, 2000, 7)])
        col.upsert(docs[2000:])
        q = clustered(20, DIM, 20, seed=6)
        plain = col.search(q, k=10)
        filtered = col.search(q, k=10, filter={"n": {"$in": [1, 2]}})
        out[tier] = (plain, filtered)
        if tier == "gpu":
            assert col.info()["tiers"]["filter"]["gpu_search"] == "device"
        cat.close()
    for a, b in zip(out["cpu"], out["gpu"]):
        for ha, hb in zip(a.hits, b.hits):
            ia, ib = [h.id for h in ha], [h.id for h in hb]
            assert len(set(ia) & set(ib)) >= 9, (ia, ib)
            assert not [i for i in ib if int(i[1:]) < 2000 and int(i[1:]) % 7 == 0]
    for h in (h for hits in out["gpu"][1].hits for h in hits):
        assert h.metadata["n"] in (1, 2)


def test_auto_opens_both_tiers_and_sends_each_call_to_the_cheaper_one(built, monkeypatch):
    """#47 part 7: under filter_tier 'auto' with CUDA both tiers are open, over the same host parts; each call
    goes to the tier measured cheaper for its size (TierChoice), says which served it, and answers as that tier
    alone does. The costs are set here (the interpreter's are not a GPU's): the device cheaper from 8 queries."""
    from fusionrag.retriever.engine import pipeline

    _, base, queries, path = built
    monkeypatch.setattr(pipeline, "cuda_available", lambda: True)
    auto = Index.open(path, EngineConfig(**{**DEVICE, "filter_tier": "auto"}))
    cpu = Index.open(path, EngineConfig(filter_tier="cpu"))
    assert isinstance(auto.filter, DeviceTier) and auto.cpu_beside is not None
    assert auto.cpu_beside.codes is auto._codes  # the same codes (a memory map), no second copy
    first = [auto.search(queries[:n], 10).info["filter_tier"] for n in (1, 1, 1, 1)]
    assert first == ["gpu", "gpu", "cpu", "cpu"]  # each tier measured first (its first call, once-only, not counted)
    choice = auto.choice
    choice.explore, choice.alpha = 2, 0.0  # the set costs stay (the interpreter's calls are not a GPU's)
    for b in range(choice.per_query.shape[1]):  # the device: 1 ms a call; the CPU: 0.2 ms a query
        choice.per_query[0, b], choice.per_query[1, b] = 1e-3 / (1 << b), 2e-4
        choice.calls[:, b] = 1
    assert auto.crossover() == 8
    served = {n: [] for n in (1, 16)}
    for _ in range(choice.explore):
        for n in served:
            res = auto.search(queries[:n], 10)
            served[n].append(res.info["filter_tier"])
            alone = (cpu if res.info["filter_tier"] == "cpu" else None)
            if alone is not None:
                np.testing.assert_array_equal(res.ids, alone.search(queries[:n], 10).ids)
    for n, tiers in served.items():
        usual = "gpu" if n >= 8 else "cpu"
        assert tiers.count(usual) == choice.explore - 1, (n, tiers)  # and once the other, to measure it again
    mem = auto.memory()
    assert mem["pq_tier"] == "gpu" and mem["cpu_beside_pq_mapped_bytes"] >= auto._codes.nbytes
    assert sum(mem["filter_choice"]["calls_served"].values()) == 4 + len(served) * choice.explore
    auto.close()
    cpu.close()
    forced = Index.open(path, EngineConfig(**DEVICE))  # filter_tier 'gpu': every call there, nothing beside
    assert forced.cpu_beside is None and forced.crossover() is None
    assert forced.search(queries[:1], 10).info["filter_tier"] == "gpu"
    forced.close()
