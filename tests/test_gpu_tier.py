"""The GPU filter tier against the CPU tier on real indexes: same candidates, same end-to-end
results; the memory budget; tier selection. Without a GPU it runs on CPU tensors through
Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), so the shapes stay small."""

import gc
import json
import os
import re
import threading
import time

import numpy as np
import pytest
import torch
from conftest import clustered, exact_knn, recall

from fusionrag.cli import main
from fusionrag.kernels.pool import DeviceBudget
from fusionrag.retriever import BuildConfig, ConfigError, EngineConfig, Index
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.gpu_tier import GpuFilterTier, default_budget, gpu_device
from fusionrag.retriever.overlap import overlapped
from fusionrag.retriever.tiers import CpuFilterTier
from fusionrag.retriever.vectors import open_vectors

CUDA = torch.cuda.is_available()
GPU = dict(filter_tier="gpu", gpu_budget_bytes=32 << 20, batch_size=16)


@pytest.fixture(scope="module")
def l2_index(tmp_path_factory):
    base = clustered(3000, 24, 30, seed=1)
    queries = clustered(20, 24, 30, seed=2)
    path = tmp_path_factory.mktemp("gpu") / "idx"
    Index.build(base, path, BuildConfig(metric="l2"), progress=False)
    return base, queries, path


def same_results(a, b) -> None:
    assert all(set(x) == set(y) for x, y in zip(a.ids, b.ids))
    np.testing.assert_allclose(a.distances, b.distances, rtol=1e-5, atol=1e-5)


def test_search_through_gpu_tier_equals_cpu_tier(l2_index):
    base, queries, path = l2_index
    cpu = Index.open(path, filter_tier="cpu").search(queries, k=10)
    gpu_index = Index.open(path, **GPU)
    gpu = gpu_index.search(queries, k=10)  # 20 queries in batches of 16: two batches
    same_results(cpu, gpu)
    for key in ("candidates", "unique_candidates", "reranked"):
        assert np.array_equal(cpu.stats[key], gpu.stats[key]), key
    assert recall(gpu.ids, exact_knn(base, queries, 10)) >= 0.95
    info = gpu.info
    assert info["filter_tier"] == "gpu" and info["gpu_budget_bytes"] == 32 << 20
    assert 0 < info["gpu_reserved_bytes"] <= info["gpu_budget_bytes"]
    if not CUDA:  # on CUDA the peak is the allocator's, and may count other tensors of the process
        assert info["gpu_peak_bytes"] == info["gpu_reserved_bytes"]
    assert info["resident_code_fraction"] == 1.0
    assert gpu_index.memory()["pq_tier"] == "gpu"


def test_exhaustive_ip_search_is_exact_on_both_tiers(tmp_path):
    base = clustered(1500, 16, 20, seed=3)
    queries = clustered(6, 16, 20, seed=4)
    Index.build(base, tmp_path / "idx", BuildConfig(metric="ip"), progress=False)
    every = dict(nprobe=100000, probe_ratio=0, rerank=2000, beta=0)
    cpu = Index.open(tmp_path / "idx", filter_tier="cpu").search(queries, k=10, **every)
    gpu = Index.open(tmp_path / "idx", **GPU).search(queries, k=10, **every)
    same_results(cpu, gpu)
    assert recall(gpu.ids, exact_knn(base, queries, 10, "ip")) == 1.0


def open_tiers(path, budget: int, **kw):
    """The CPU tier and a GPU tier with the given budget over one index's arrays."""
    index = Index.open(path, filter_tier="cpu")
    f = index.filter
    gpu = GpuFilterTier(f.list_offsets, f.list_ids, f.codes, index.pq.codebooks,
                        account=DeviceBudget(gpu_device(), budget).account("test"), batch_size=16, threads=1, **kw)
    return index, f, gpu


def test_codes_beyond_the_budget_are_read_from_host_memory(l2_index):
    _, queries, path = l2_index
    index, cpu, _ = open_tiers(path, 32 << 20)
    count, m = cpu.codes.shape
    tables = 16 * m * 256 * 4 + 16 * 24 * 4  # a block's LUTs and queries, batch_size 16
    # Room for the codebooks, the slot map, two blocks and about a third of the codes.
    budget = index.pq.codebooks.nbytes + 4 * count + 2 * (tables + (1 << 20)) + count * m // 3
    _, _, gpu = open_tiers(path, budget, work_bytes=1 << 20, tiered_share=1.0)
    assert gpu.tiered and 0.2 < gpu.describe()["resident_code_fraction"] < 0.5
    assert gpu.account.budget.used <= budget
    q = index.prepare_queries(queries[:8])
    lists, _, _ = index.nav.probe(q, index.params)
    luts = index.pq.luts(q, "l2")
    n = 50
    want = cpu.topn(luts, lists, n)
    for tables in (luts, gpu.luts(index.pq, q, "l2")):  # host tables, and tables built on the device
        got = gpu.topn(tables, lists, n)
        assert np.array_equal(got.gathered, want.gathered) and np.array_equal(got.unique, want.unique)
        assert all(set(a) == set(b) for a, b in zip(got.ids, want.ids))
        np.testing.assert_allclose(got.pq_dists, want.pq_dists, rtol=1e-4, atol=1e-4)
    # Hotness follows the visits: after a rebalance, the lists just probed are resident.
    gpu.rebalance()
    probed = np.unique(lists[lists >= 0])
    hottest = probed[np.argsort(-gpu.visits[probed], kind="stable")][:3]
    slots = gpu.slots.cpu().numpy()
    for c in hottest:
        assert np.all(slots[cpu.list_ids[cpu.list_offsets[c]:cpu.list_offsets[c + 1]]] >= 0)
    assert all(set(a) == set(b) for a, b in zip(gpu.topn(luts, lists, n).ids, want.ids))


def test_exclude_bitmap_and_bad_input_match_cpu_tier(l2_index):
    _, queries, path = l2_index
    index, cpu, gpu = open_tiers(path, 32 << 20)
    q = index.prepare_queries(queries[:4])
    lists, _, _ = index.nav.probe(q, index.params)
    luts = index.pq.luts(q, "l2")
    first = cpu.topn(luts, lists, 20)
    drop = np.zeros(len(cpu.codes), dtype=bool)
    drop[first.ids[:, :5].ravel()] = True
    exclude = np.packbits(drop, bitorder="little")
    want, got = cpu.topn(luts, lists, 20, exclude), gpu.topn(luts, lists, 20, exclude)
    assert not np.isin(got.ids, np.flatnonzero(drop)).any()
    assert np.array_equal(got.unique, want.unique)
    assert all(set(a) == set(b) for a, b in zip(got.ids, want.ids))
    with pytest.raises(ValueError, match="not a list"):
        gpu.topn(luts, np.full_like(lists, len(cpu.list_offsets) + 5), 20)
    with pytest.raises(ValueError, match="exclude"):
        gpu.topn(luts, lists, 20, exclude[:-1])
    # Every block is back in the pool after the errors.
    assert len(gpu.pool._free) == len(gpu.pool.blocks)


def test_batch_larger_than_a_block_goes_in_passes(l2_index, monkeypatch):
    _, queries, path = l2_index
    index, cpu, gpu = open_tiers(path, 32 << 20, work_bytes=200 << 10)
    q = index.prepare_queries(queries[:16])
    lists, _, _ = index.nav.probe(q, index.params)
    luts = index.pq.luts(q, "l2")
    passes = []
    run_pass = gpu._pass
    monkeypatch.setattr(gpu, "_pass", lambda *a: passes.append(1) or run_pass(*a))
    want, got = cpu.topn(luts, lists, 30), gpu.topn(luts, lists, 30)
    assert len(passes) > 1
    assert all(set(a) == set(b) for a, b in zip(got.ids, want.ids))
    assert np.array_equal(got.unique, want.unique)
    every = np.arange(len(cpu.list_offsets) - 1, dtype=np.int32)[None, :]  # one query, every list
    _, _, small = open_tiers(path, 32 << 20, work_bytes=16 << 10)
    with pytest.raises(ValueError, match="gathers .* candidate IDs, more than a working block"):
        small.topn(luts[:1], every, 30)


def test_budget_too_small_is_a_clear_startup_error(l2_index):
    _, _, path = l2_index
    with pytest.raises(ConfigError, match="GPU memory budget of 100000 bytes is too small.*gpu_budget_bytes"):
        Index.open(path, filter_tier="gpu", gpu_budget_bytes=100_000)


def test_tier_selection_and_config(l2_index, monkeypatch):
    _, queries, path = l2_index
    auto = Index.open(path).search(queries[:2], k=5)
    assert auto.info["filter_tier"] == ("gpu" if CUDA else "cpu")
    with pytest.raises(ConfigError, match="filter_tier must be one of"):
        EngineConfig(filter_tier="tpu")
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if CUDA:
        assert gpu_device().type == "cuda"
    else:
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            Index.open(path, filter_tier="gpu")
    if not CUDA:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert default_budget(torch.device("cpu"), 0.75) == int(ram * 0.25)


def test_cli_filter_tier_flag(l2_index, tmp_path, capsys):
    _, queries, path = l2_index
    np.save(tmp_path / "q.npy", queries[:3])
    for tier in ("cpu", "gpu"):
        assert main(["search", str(path), str(tmp_path / "q.npy"), "--k", "5", "--out", str(tmp_path / "ids.npy"),
                     "--filter-tier", tier, "--gpu-budget-bytes", str(32 << 20)]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["filter_tier"] == tier and report["memory"]["pq_tier"] == tier
    assert main(["info", str(path), "--no-verify", "--filter-tier", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["filter"] == {"filter_tier": "cpu"}
    assert main(["search", str(path), str(tmp_path / "q.npy"), "--out", str(tmp_path / "ids.npy"),
                 "--filter-tier", "fpga"]) == 2
    assert "filter_tier must be one of" in capsys.readouterr().err


def test_overlapped_stages_run_at_once_in_order():
    started, done = threading.Event(), []

    def first(i):
        if i == 1:
            started.set()
        return i

    def last(i):
        if i == 0:  # batch 1's first stage runs while batch 0 is still in its last
            assert started.wait(timeout=30)
        done.append(i)

    overlapped(range(6), first, lambda i: i * 10, lambda i: last(i // 10))
    assert done == list(range(6))
    # Two middles at once (two batches on a GPU): the last stage still sees the items in order.
    done.clear()
    started.clear()
    overlapped(range(9), first, lambda i: time.sleep(0.01 * (i % 3 == 0)) or i * 10, lambda i: last(i // 10),
               middle_workers=2)
    assert done == list(range(9))
    with pytest.raises(ZeroDivisionError):
        overlapped(range(4), lambda i: i, lambda i: 1 / (i - 2), lambda i: None)


def test_real_sift5k_gpu_tier_equals_cpu_tier(tmp_path, data_dir):
    d = data_dir / "sift5k-ngt-texmexq"
    Index.build(d / "sift5k_base.fvecs", tmp_path / "idx", progress=False)
    queries = open_vectors(d / "sift5k_query.fvecs")[:12]
    cpu = Index.open(tmp_path / "idx", filter_tier="cpu").search(queries, k=10)
    gpu = Index.open(tmp_path / "idx", **GPU).search(queries, k=10)
    same_results(cpu, gpu)
    assert np.array_equal(cpu.stats["unique_candidates"], gpu.stats["unique_candidates"])
    assert recall(gpu.ids, open_vectors(d / "sift5k_groundtruth.ivecs")[:12, :10]) >= 0.95


# -- one budget per device per process, shared by every open index ----------------------------

@pytest.fixture(scope="module")
def second_index(tmp_path_factory):
    base = clustered(2000, 24, 30, seed=5)
    path = tmp_path_factory.mktemp("gpu2") / "idx"
    Index.build(base, path, BuildConfig(metric="l2"), progress=False)
    return base, path


def test_indexes_share_one_budget_and_one_that_does_not_fit_fails(l2_index, second_index):
    _, queries, path_a = l2_index
    _, path_b = second_index
    budget = 6 << 20
    kw = dict(filter_tier="gpu", gpu_budget_bytes=budget, batch_size=16)
    a, b = Index.open(path_a, **kw), Index.open(path_b, **kw)
    shared = a.filter.account.budget
    assert b.filter.account.budget is shared and shared.owners == {str(path_a), str(path_b)}
    used_a, used_b = a.filter.account.used, b.filter.account.used
    assert shared.used == used_a + used_b <= budget and used_a > 0 and used_b > 0
    # The first index took its codes whole, and working blocks out of half of what they left.
    first = a.filter.account.parts
    assert used_a <= first["PQ codebooks"] + first["PQ codes"] + (budget - first["PQ codebooks"] - first["PQ codes"]) // 2
    info = a.memory()["filter"]
    assert info["gpu_budget_bytes"] == budget and info["gpu_reserved_bytes"] == shared.used
    assert info["gpu_index_reserved_bytes"] == used_a and info["gpu_index_parts"] == first
    assert info["gpu_budget_holders"] == 2 and info["gpu_peak_bytes"] >= shared.used
    # A third does not fit: the error names the budget, what is held and by whom; nothing leaks.
    with pytest.raises(ConfigError, match=(
            rf"GPU memory budget of {budget} bytes is too small: {re.escape(str(path_a))} #2: working block .* "
            rf"left after {re.escape(str(path_a))} holds {used_a} bytes: .*; "
            rf"{re.escape(str(path_b))} holds {used_b} bytes: .*gpu_budget_bytes")):
        Index.open(path_a, **kw)
    assert shared.used == used_a + used_b and shared.owners == {str(path_a), str(path_b)}
    with pytest.raises(ConfigError, match=f"budget on .* is {budget} bytes, held by .*every index of a process"):
        Index.open(path_a, **{**kw, "gpu_budget_bytes": 2 * budget})
    # The two still search as the CPU tier does.
    for index, path in ((a, path_a), (b, path_b)):
        same_results(Index.open(path, filter_tier="cpu").search(queries, k=10), index.search(queries, k=10))
    a.close()
    assert shared.used == used_b and shared.owners == {str(path_b)}
    a.close()  # twice is harmless
    b.close()
    assert shared.used == 0 and not shared.owners and shared.peak >= used_a + used_b


def test_close_gives_the_bytes_back(l2_index):
    _, queries, path = l2_index
    kw = dict(filter_tier="gpu", gpu_budget_bytes=3 << 20, batch_size=16)  # holds one index, not two
    first = Index.open(path, **kw)
    shared = first.filter.account.budget
    with pytest.raises(ConfigError, match="too small"):
        Index.open(path, **kw)
    want = first.search(queries[:4], k=5).ids
    first.close()
    assert shared.used == 0
    for _ in range(4):
        index = Index.open(path, **kw)
        assert index.filter.account.budget is shared and 0 < shared.used <= 3 << 20
        index.close()
        assert shared.used == 0 and not shared.owners
    # An index dropped without close() gives its share back when collected.
    index = Index.open(path, **kw)
    assert np.array_equal(index.search(queries[:4], k=5).ids, want)
    del index
    gc.collect()
    assert shared.used == 0 and not shared.owners


def test_catalog_collections_share_one_budget_and_merges_do_not_leak(tmp_path):
    budget = 16 << 20
    engine = EngineConfig(filter_tier="gpu", gpu_budget_bytes=budget, batch_size=16)
    catalog = Catalog(tmp_path, engine, CollectionConfig(min_index_count=100, background_merge=False))
    data = {}
    for name, seed in (("a", 11), ("b", 12)):
        col = catalog.create(name, dim=24, metric="l2")
        data[name] = clustered(600, 24, 12, seed=seed)
        col.upsert([Document(id=str(i), vector=v) for i, v in enumerate(data[name])])
        col.merge()  # the first generation: an index with a GPU tier
    a, b = catalog.get("a"), catalog.get("b")
    old, index_b = a._main.index, b._main.index
    shared = old.filter.account.budget
    assert index_b.filter.account.budget is shared
    assert shared.used == old.filter.account.used + index_b.filter.account.used <= budget
    tiers = a.info()["tiers"]
    assert tiers["pq_tier"] == "gpu" and tiers["filter"]["gpu_reserved_bytes"] == shared.used
    assert tiers["filter"]["gpu_index_reserved_bytes"] == old.filter.account.used
    # A search still reading the old generation when the merge publishes the next one keeps it
    # open; the last reader out closes it.
    reading, merged, found = threading.Event(), threading.Event(), []
    search = old.search

    def slow_search(*args, **kw):
        reading.set()
        assert merged.wait(timeout=60)
        return search(*args, **kw)

    old.search = slow_search
    t = threading.Thread(target=lambda: found.append(a.search(data["a"][:3], k=5)))
    t.start()
    assert reading.wait(timeout=60)
    a.upsert([Document(id=f"new{i}", vector=v) for i, v in enumerate(clustered(50, 24, 12, seed=13))])
    a.merge()
    new = a._main.index
    assert new is not old and not old.filter.account.closed
    assert shared.used == sum(i.filter.account.used for i in (old, new, index_b)) <= budget
    merged.set()
    t.join(timeout=60)
    assert [h.id for h in found[0].hits[0]][0] == "0"  # the query is document 0 itself
    assert old.filter.account.closed
    assert shared.used == new.filter.account.used + index_b.filter.account.used
    # A merge with no reader in flight closes the old generation at once.
    a.upsert([Document(id="late", vector=data["a"][1] + 0.01)])
    a.merge()
    assert new.filter.account.closed
    assert shared.used == a._main.index.filter.account.used + index_b.filter.account.used
    catalog.drop("b")
    assert shared.used == a._main.index.filter.account.used and shared.owners == {str(a._main.index.path)}
    catalog.close()
    assert shared.used == 0 and not shared.owners


def test_an_index_whose_codes_do_not_fit_leaves_room_for_the_next():
    rng = np.random.default_rng(0)
    count, m = 10_000, 32
    codes = rng.integers(0, 256, (count, m), dtype=np.uint8)
    codebooks = rng.standard_normal((m, 256, 1)).astype(np.float32)
    offsets = np.arange(0, count + 1, 100, dtype=np.int64)
    ids = rng.permutation(count).astype(np.uint32)
    cpu = CpuFilterTier(offsets, ids, codes, codebooks, threads=1)
    luts = rng.random((3, m, 256), dtype=np.float32)
    lists = rng.choice(len(offsets) - 1, (3, 3), replace=False).astype(np.int32)
    want = cpu.topn(luts, lists, 40)
    # Codebooks 32 KiB, slot map 40 KB, two blocks ~97 KiB: the codes (320 KB) fit in neither tier's share.
    budget = DeviceBudget(gpu_device(), 440_000)

    def open_tier(owner, share=0.5):
        return GpuFilterTier(offsets, ids, codes, codebooks, account=budget.account(owner), batch_size=1, threads=1,
                             work_bytes=16 << 10, tiered_share=share)

    first = open_tier("first")
    room = budget.budget - first.account.parts["PQ codebooks"]
    slots = first.account.parts["code slot map"]
    assert first.tiered and 0 < first.codes.shape[0] < count
    assert budget.left >= (room - slots) // 2  # half of what it found is left for the next one
    second = open_tier("second")
    assert second.tiered and second.codes.shape[0] == 0 and budget.used <= budget.budget
    for tier in (first, second):  # the second keeps no code resident: every one is read from host memory
        for i in range(len(lists)):  # blocks of one query's tables (batch_size=1)
            got = tier.topn(luts[i:i + 1], lists[i:i + 1], 40)
            assert set(got.ids[0]) == set(want.ids[i])
            np.testing.assert_allclose(got.pq_dists[0], want.pq_dists[i], rtol=1e-5, atol=1e-5)
    first.close()
    second.close()
    assert budget.used == 0
    greedy = open_tier("greedy", share=1.0)  # takes all it finds: the next one cannot start
    with pytest.raises(ConfigError, match="greedy holds"):
        open_tier("late")
    greedy.close()
