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

from fusionrag.retriever import BuildConfig, ConfigError, EngineConfig, Index
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.engine import device_tier as device_tier_mod
from fusionrag.retriever.engine import gpu_tier as gpu_tier_mod
from fusionrag.retriever.engine.device_tier import DeviceTier
from fusionrag.retriever.engine.gpu_tier import GpuFilterTier

DIM = 24
DEVICE = dict(filter_tier="gpu", gpu_search="device", gpu_budget_bytes=128 << 20, batch_size=16)


pytestmark = pytest.mark.usefixtures("device_tier_bookkeeping")  # tests/conftest.py


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
        for key in ("lists_probed", "candidates", "unique_candidates"):
            assert np.array_equal(a.stats[key], b.stats[key]), key
        assert recall(b.ids, truth) >= recall(a.ids, truth) - 0.005
        _common_distances_equal(a, b)
        if raw:
            assert b.stats["pages_read"].sum() == 0 and b.stats["pages_buffered"].sum() == 0
    assert b.info["gpu_search"] == "device" and dev.memory()["filter"]["raw_vectors_resident"] is raw
    dev.close()


def test_a_filtered_search_widens_the_device_tiers_lists_as_the_cpu_tiers(built):
    """An exclusion passing a tenth of the vectors: the device navigates the lists NavigationTier.probe widens
    (nprobe and the ratio rule's floor over the share passing), the same count as the CPU tier's, ten times or
    so those of the search given passing=1.0, and returns no excluded vector."""
    metric, base, queries, path = built
    cpu = Index.open(path, EngineConfig(filter_tier="cpu"))
    dev = Index.open(path, EngineConfig(**DEVICE))
    ok = np.random.default_rng(3).random(len(base)) < 0.1
    exclude = np.packbits(~ok, bitorder="little")
    a = cpu.search(queries, 10, nprobe=4, exclude=exclude)
    b = dev.search(queries, 10, nprobe=4, exclude=exclude)
    narrow = dev.search(queries, 10, nprobe=4, exclude=exclude, passing=1.0)
    assert np.array_equal(a.stats["lists_probed"], b.stats["lists_probed"])
    assert b.stats["lists_probed"].mean() >= 5 * narrow.stats["lists_probed"].mean()
    assert np.isin(b.ids[b.ids >= 0], np.flatnonzero(ok)).all()
    truth = np.flatnonzero(ok)[_truth(metric, base[ok], queries)]
    assert recall(b.ids, truth) >= recall(a.ids, truth) - 0.01 and recall(b.ids, truth) > recall(narrow.ids, truth)
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


POSTING_PARTS = ("working memory", "list ids", "PQ codes in list order", "raw vectors")


def _tiered_floor(parts: dict, n_lists: int) -> int:
    """What a tiered device tier needs before any posting: the parts but the postings, raw vectors and working
    memory, the list places and visits, and the least working memory."""
    a = device_tier_mod._aligned
    rest = sum(v for k, v in parts.items() if k not in POSTING_PARTS)
    return rest + 2 * a(n_lists * 8) + a(n_lists) + device_tier_mod.MIN_WORK


def test_the_budget_holds_what_the_tier_holds_and_too_small_a_budget_falls_back(built):
    """The account's parts are the bytes of the tensors the tier holds (counted here from the tensors); a budget
    that cannot hold every posting tiers them (the next test), one that cannot hold the other parts gets the lists
    tier under 'auto' and a clear error under 'device'; raw vectors go up only where they fit their share."""
    metric, base, queries, path = built
    dev = Index.open(path, EngineConfig(**DEVICE))
    t = dev.filter
    held = sum(x.numel() * x.element_size() for x in (t.codebooks, t.centroids, t.centroid_norms, t.starts, t.sizes,
                                                       t.ids, t.codes, t.bitmap, t.raw))
    parts = dict(t.account.parts)
    assert held <= sum(parts.values()) - parts["working memory"] <= held + 16 * 256
    assert not t.tiered and t.host_ids is None and t.describe()["resident_code_fraction"] == 1.0
    assert t.codes.shape == (len(t.list_ids), t.m) and t.raw.shape == (len(base), DIM)
    assert t.memory_bytes() == t.codes.numel()
    dev.close()
    assert t.account.used == 0
    fixed = sum(parts.values()) - parts["working memory"] - parts["raw vectors"]
    small = fixed + device_tier_mod.MIN_WORK - 4096  # every posting does not fit beside the working memory
    tiered = Index.open(path, EngineConfig(filter_tier="gpu", gpu_budget_bytes=small, batch_size=16))
    assert isinstance(tiered.filter, DeviceTier) and tiered.filter.tiered  # auto: the device tier, tiered
    tiered.close()
    floor = _tiered_floor(parts, len(t.sizes_host))
    with pytest.raises(ConfigError, match="device tier needs"):
        Index.open(path, EngineConfig(filter_tier="gpu", gpu_search="device", gpu_budget_bytes=floor - 4096))
    lists = Index.open(path, EngineConfig(filter_tier="gpu", gpu_budget_bytes=floor - 4096, batch_size=16))
    assert isinstance(lists.filter, GpuFilterTier)  # auto: the lists tier, which keeps its blocks and hot codes
    lists.close()
    raw = parts["raw vectors"]
    for share, resident in ((0.5, False), (1.0, True)):  # room for the raw vectors beside the working memory
        t = Index.open(path, EngineConfig(filter_tier="gpu", gpu_search="device", gpu_tiered_share=share,
                                          gpu_budget_bytes=fixed + device_tier_mod.MIN_WORK + raw, batch_size=16))
        assert t.filter.raw_resident is resident and (t.filter.raw is not None) is resident
        t.close()


def _placement(t: DeviceTier) -> np.ndarray:
    """Where each list's postings lie, read back from the tier's tensors and checked against the index's lists:
    True on the device, False in pinned host memory; each list one run, in list order, IDs and codes both."""
    starts, cold = t.starts.cpu().numpy(), t.cold_list.cpu().numpy()
    codes = t._codes_src
    for i in range(len(t.sizes_host)):
        lo, hi = t.list_offsets[i], t.list_offsets[i + 1]
        ids, cds = (t.host_ids, t.host_codes) if cold[i] else (t.ids, t.codes)
        s, e = int(starts[i]), int(starts[i]) + (hi - lo)
        want = np.asarray(t.list_ids[lo:hi], np.int64)
        assert np.array_equal(ids[s:e].cpu().numpy().view(np.uint32), want)
        assert np.array_equal(cds[s:e].cpu().numpy(), codes[want])
    return cold == 0


def test_larger_than_its_budget_the_cold_lists_stream_from_host_memory(built):
    """#47, larger than its budget: a tenth of the postings on the device, the rest pinned on the host, in list
    order; the answers are the all-resident tier's, the device holds no more than its budget, the host's pinned
    bytes are the cold postings, the bytes read over the bus are the cold lists' postings the queries probe, and
    placing by the lists probed since open moves the probed lists onto the device."""
    metric, base, queries, path = built
    whole = Index.open(path, EngineConfig(**DEVICE, gpu_tiered_share=1e-9))
    parts, n_lists = dict(whole.filter.account.parts), len(whole.filter.sizes_host)
    postings, m = len(whole.filter.list_ids), whole.filter.m
    q = whole.prepare_queries(queries)
    lists, _, _ = whole.nav.probe(q, whole.params.with_overrides(nprobe=12))
    want = whole.search(queries, 10, nprobe=16)
    want_top = whole.filter.topn(q, lists, 80)
    whole.close()
    budget = _tiered_floor(parts, n_lists) + postings * (m + 4) // 10
    idx = Index.open(path, EngineConfig(filter_tier="gpu", gpu_search="device", gpu_tiered_share=1.0,
                                        gpu_budget_bytes=budget, batch_size=16, manager_interval_s=0))
    t = idx.filter
    assert t.tiered and not t.raw_resident
    hot = _placement(t)
    resident = int(t.sizes_host[hot].sum())
    assert 0.05 * postings < resident <= 0.1 * postings  # a tenth, less what the next list would not fit
    on_device = sum(x.numel() * x.element_size() for x in (t.ids, t.codes))
    assert on_device <= postings * (m + 4) // 10 + 2 * 256
    assert t.account.budget.used <= budget
    cold_bytes = (postings - resident) * (m + 4)
    pinned = t.host_ids.numel() * 4 + t.host_codes.numel()
    assert cold_bytes <= pinned <= cold_bytes + int(t.sizes_host.max()) * (m + 4)
    assert t.memory_bytes() == t.codes.numel() + pinned and t.describe()["gpu_host_pinned_bytes"] == pinned
    # Longer lists first until queries have come: no list left on the host is longer than a device list
    assert t.sizes_host[~hot].max() <= t.sizes_host[hot].min()
    got = idx.search(queries, 10, nprobe=16)
    assert np.array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.distances, want.distances)
    before, visits = t.phases["bytes_over_bus"], t.visits.copy()
    top = t.topn(q, lists, 80)
    assert np.array_equal(top.ids, want_top.ids) and np.array_equal(top.unique, want_top.unique)
    probed = lists[lists >= 0]
    assert np.array_equal(t.visits - visits, np.bincount(probed, minlength=n_lists))
    read = int(t.sizes_host[probed][~hot[probed]].sum()) * (m + 4)
    assert t.phases["bytes_over_bus"] - before == read > 0
    # Re-placed by the probes so far, the lists these queries probe are on the device: less read over the bus
    visits = t.visits
    t.rebalance()
    hot = _placement(t)
    assert visits[~hot].max() <= visits[hot].min()  # the most probed lists are the device's now
    before = t.phases["bytes_over_bus"]
    again = t.topn(q, lists, 80)
    assert np.array_equal(again.ids, want_top.ids)
    now = t.phases["bytes_over_bus"] - before
    assert now == int(t.sizes_host[probed][~hot[probed]].sum()) * (m + 4) and now < 0.7 * read
    assert idx.refresh_hotness().get("rebalanced")  # the index manager's round (its thread is off here) calls it
    idx.close()
    assert t.host_codes is None and t.account.used == 0


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


def test_the_kernels_the_device_tier_compiles_are_those_its_searches_launch(built, monkeypatch):
    """On CUDA the device tier compiles DeviceTier.variants() when it opens (both scans: whether its postings are
    tiered is known only after): its searches, all postings resident and tiered, with and without exclusions,
    launch only those, recorded at each launch with the choices a GPU makes (the interpreter's are patched away)."""
    from fusionrag.kernels import adc_stream as adc_stream_mod
    from fusionrag.kernels import pq_table as pq_table_mod
    from fusionrag.kernels.variants import launched

    metric, base, queries, path = built
    for mod in (adc_stream_mod, pq_table_mod):
        monkeypatch.setattr(mod, "interpreted", lambda: False)
    launches = set()
    for kernel in (pq_table_mod.pq_table_kernel, adc_stream_mod.adc_stream_kernel):
        def record(*args, grid, warmup, _kernel=kernel, _run=kernel.run, **kw):
            if not warmup:
                launches.add(launched(_kernel, args, kw))
            return _run(*args, grid=grid, warmup=warmup, **kw)
        monkeypatch.setattr(kernel, "run", record)
    exclude = np.packbits(np.arange(len(base)) % 7 == 0, bitorder="little")
    whole = Index.open(path, EngineConfig(**DEVICE, manager_interval_s=0))
    t = whole.filter
    budget = _tiered_floor(dict(t.account.parts), len(t.sizes_host)) + len(t.list_ids) * (t.m + 4) // 10
    compiled = set(t.variants())
    for idx in range(2):
        idx = whole if idx == 0 else Index.open(path, EngineConfig(**{**DEVICE, "gpu_budget_bytes": budget},
                                                                   gpu_tiered_share=1.0, manager_interval_s=0))
        assert idx.filter.tiered is (idx is not whole)
        idx.search(queries[:4], 10, nprobe=8)
        idx.search(queries[:4], 10, nprobe=8, exclude=exclude)
        idx.close()
    assert launches <= compiled, [str(v) for v in launches - compiled]
    assert {dict(v.constexprs).get("TIERED") for v in launches if v.name == "adc_stream_kernel"} == {False, True}
