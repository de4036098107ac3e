"""The GPU filter tier against the CPU tier on real indexes: same candidates, same end-to-end
results; the memory budget's sharing; tier selection; the kernels compiled when a tier opens.
Without a GPU it runs on CPU tensors through Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1), so the shapes stay small.

The two tiers sum PQ distances in different orders, so where float sums differ (a GPU) near-tied
candidates may swap places: candidate sets are compared up to such ties, end-to-end results by
recall and by the exact distances of the hits both return (test_gpu_memory.py measures memory)."""

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
from fusionrag.kernels import adc_scan, pq_table, topn
from fusionrag.kernels.pool import DeviceBudget
from fusionrag.kernels.variants import launched
from fusionrag.retriever import BuildConfig, ConfigError, EngineConfig, Index
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.engine import gpu_tier as gpu_tier_mod
from fusionrag.retriever.engine.gpu_tier import CHUNK, GpuFilterTier, default_budget, gpu_device
from fusionrag.retriever.engine.overlap import overlapped
from fusionrag.retriever.engine.tiers import CpuFilterTier
from fusionrag.retriever.engine.vectors import open_vectors

CUDA = torch.cuda.is_available()
# The lists tier (gpu_tier.py); the device tier has its own tests (test_device_tier.py).
GPU = dict(filter_tier="gpu", gpu_search="lists", gpu_budget_bytes=32 << 20, batch_size=16)


@pytest.fixture(autouse=True)
def bookkeeping_budgets(monkeypatch):
    """Each test starts with no process budget, and budgets here count the tiers' parts only: on
    CUDA a process's budget also holds the CUDA context and what else the process holds there
    (DeviceBudget.true_up), and a tier leaves the allocator's slack out of its share, which these tests
    of sharing do not size for (test_gpu_memory.py does). On an H100 the slack (24 MiB) alone had a
    6 MiB budget's first index go tiered (make gpu-accept, 2026-11-27)."""
    monkeypatch.setattr(gpu_tier_mod, "_budgets", {})
    monkeypatch.setattr(DeviceBudget, "true_up", lambda self: None)
    monkeypatch.setattr(gpu_tier_mod, "ALLOCATOR_SLACK", 0)


@pytest.fixture(scope="module")
def l2_index(tmp_path_factory):
    base = clustered(3000, 24, 30, seed=1)
    queries = clustered(20, 24, 30, seed=2)
    path = tmp_path_factory.mktemp("gpu") / "idx"
    Index.build(base, path, BuildConfig(metric="l2"), progress=False)
    return base, queries, path


def same_results(a, b) -> None:
    """Every candidate re-ranked: both tiers return the exact top-k."""
    assert all(set(x) == set(y) for x, y in zip(a.ids, b.ids))
    np.testing.assert_allclose(a.distances, b.distances, rtol=1e-5, atol=1e-5)


def agree(cpu, gpu, truth, slack: float = 0.02) -> None:
    """With the early stop the re-rank follows the candidates' PQ order, which near-ties may change:
    the same IDs gathered and de-duplicated, recall within `slack`, and a hit both return has the same
    exact distance."""
    for key in ("candidates", "unique_candidates"):
        assert np.array_equal(cpu.stats[key], gpu.stats[key]), key
    assert abs(recall(gpu.ids, truth) - recall(cpu.ids, truth)) <= slack
    for ci, cd, gi, gd in zip(cpu.ids, cpu.distances, gpu.ids, gpu.distances):
        common, at_c, at_g = np.intersect1d(ci[ci >= 0], gi[gi >= 0], return_indices=True)
        np.testing.assert_allclose(cd[at_c], gd[at_g], rtol=1e-5, atol=1e-5)


def same_candidates(got, want, rtol: float = 1e-4) -> None:
    """Filter-tier candidates: the same IDs gathered and kept, and the same top-n up to near-ties at
    its boundary: an ID only one side kept lies within rtol of the last distance kept."""
    assert np.array_equal(got.gathered, want.gathered) and np.array_equal(got.unique, want.unique)
    for gi, gd, wi, wd in zip(got.ids, got.pq_dists, want.ids, want.pq_dists):
        assert np.array_equal(gi >= 0, wi >= 0)
        common, at_g, at_w = np.intersect1d(gi, wi, return_indices=True)
        np.testing.assert_allclose(gd[at_g], wd[at_w], rtol=rtol, atol=rtol)
        kept = wd[wi >= 0]
        if len(kept):
            edge = kept[-1]
            for d in np.concatenate([gd[np.isin(gi, wi, invert=True)], wd[np.isin(wi, gi, invert=True)]]):
                assert abs(d - edge) <= rtol * max(1.0, abs(edge)), (d, edge)


def test_search_through_gpu_tier_equals_cpu_tier(l2_index):
    base, queries, path = l2_index
    cpu = Index.open(path, filter_tier="cpu").search(queries, k=10)
    gpu_index = Index.open(path, **GPU)
    gpu = gpu_index.search(queries, k=10)  # 20 queries in batches of 16: two batches
    truth = exact_knn(base, queries, 10)
    agree(cpu, gpu, truth)
    assert recall(gpu.ids, truth) >= 0.95
    info = gpu.info
    assert info["filter_tier"] == "gpu" and info["gpu_budget_bytes"] == 32 << 20
    assert 0 < info["gpu_reserved_bytes"] <= info["gpu_budget_bytes"]
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


def open_tiers(path, budget: int, batch_size: int = 16, **kw):
    """The CPU tier and a GPU tier with the given budget over one index's arrays."""
    index = Index.open(path, filter_tier="cpu")
    f = index.filter
    gpu = GpuFilterTier(f.list_offsets, f.list_ids, f.codes, index.pq.codebooks, metric=index.reranker.metric,
                        account=DeviceBudget(gpu_device(), budget).account("test"), batch_size=batch_size, threads=1,
                        **kw)
    return index, f, gpu


def test_codes_beyond_the_budget_are_read_from_host_memory(l2_index):
    _, queries, path = l2_index
    index, cpu, _ = open_tiers(path, 32 << 20)
    count, m = cpu.codes.shape
    tables = 16 * m * 256 * 4 + 16 * 24 * 4  # a block's LUTs and queries, batch_size 16
    # Room for the codebooks, the slot map, two blocks with their exclusion bitmaps and about a third of the codes.
    budget = index.pq.codebooks.nbytes + 4 * count + 2 * (tables + CHUNK + (1 << 20)) + count * m // 3
    _, _, gpu = open_tiers(path, budget, work_bytes=1 << 20, tiered_share=1.0)
    assert gpu.tiered and 0.2 < gpu.describe()["resident_code_fraction"] < 0.5
    assert gpu.account.budget.used <= budget
    q = index.prepare_queries(queries[:8])
    lists, _, _ = index.nav.probe(q, index.params)
    luts = index.pq.luts(q, "l2")
    n = 50
    want = cpu.topn(luts, lists, n)
    for tables in (luts, gpu.tables(q)):  # host tables, and tables built on the device
        same_candidates(gpu.topn(tables, lists, n), want)
    # Hotness follows the visits: after a rebalance, the lists just probed are resident.
    gpu.rebalance()
    probed = np.unique(lists[lists >= 0])
    hottest = probed[np.argsort(-gpu.visits[probed], kind="stable")][:3]
    slots = gpu.slots.cpu().numpy()
    for c in hottest:
        assert np.all(slots[cpu.list_ids[cpu.list_offsets[c]:cpu.list_offsets[c + 1]]] >= 0)
    same_candidates(gpu.topn(luts, lists, n), want)


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
    same_candidates(got, want)
    with pytest.raises(ValueError, match="not a list"):
        gpu.topn(luts, np.full_like(lists, len(cpu.list_offsets) + 5), 20)
    with pytest.raises(ValueError, match="exclude"):
        gpu.topn(luts, lists, 20, exclude[:-1])
    # Every block is back in the pool after the errors.
    assert len(gpu.pool._free) == len(gpu.pool.blocks)


def count_passes(tier, monkeypatch) -> list:
    passes = []
    run_pass = tier._pass
    monkeypatch.setattr(tier, "_pass", lambda *a: passes.append(1) or run_pass(*a))
    return passes


def test_batch_larger_than_a_block_goes_in_passes(l2_index, monkeypatch):
    _, queries, path = l2_index
    index, cpu, gpu = open_tiers(path, 32 << 20, work_bytes=200 << 10)
    q = index.prepare_queries(queries[:16])
    lists, _, _ = index.nav.probe(q, index.params)
    luts = index.pq.luts(q, "l2")
    passes = count_passes(gpu, monkeypatch)
    before = dict(gpu.phases)
    want, got = cpu.topn(luts, lists, 30), gpu.topn(luts, lists, 30)
    assert len(passes) > 1
    same_candidates(got, want)
    # The tier's own phase count (bench/gpu/gpu_tier.py reports it) agrees with the passes counted from outside.
    assert gpu.phases["passes"] - before["passes"] == len(passes)
    assert all(gpu.phases[k] > before[k] for k in ("gather_s", "stage_s", "device_s"))


def test_a_query_larger_than_a_block_is_split(l2_index, monkeypatch):
    """A query left short by exclusions re-probes every list (Collection): past a working block's
    size its IDs go in several passes, and it gets the CPU tier's answer, not an error."""
    _, queries, path = l2_index
    index, cpu, _ = open_tiers(path, 32 << 20)
    _, _, small = open_tiers(path, 32 << 20, work_bytes=16 << 10)
    every = np.arange(len(cpu.list_offsets) - 1, dtype=np.int32)[None, :]  # one query, every list
    luts = index.pq.luts(index.prepare_queries(queries[:2]), "l2")
    drop = np.zeros(len(cpu.codes), dtype=bool)
    drop[::3] = True
    exclude = np.packbits(drop, bitorder="little")
    passes = count_passes(small, monkeypatch)
    for i, ex, n in ((0, None, 30), (1, exclude, 300)):
        passes.clear()
        want, got = cpu.topn(luts[i:i + 1], every, n, ex), small.topn(luts[i:i + 1], every, n, ex)
        assert got.gathered[0] > 4000 and len(passes) > 2
        same_candidates(got, want)
        if ex is not None:
            assert not np.isin(got.ids, np.flatnonzero(drop)).any()
    with pytest.raises(ValueError, match="cannot hold the top n=20000 of a query"):
        small.topn(luts[:1], every, 20_000)


def test_budget_too_small_is_a_clear_startup_error(l2_index):
    _, _, path = l2_index
    with pytest.raises(ConfigError, match="GPU memory budget of 100000 bytes is too small.*gpu_budget_bytes"):
        Index.open(path, filter_tier="gpu", gpu_search="lists", gpu_budget_bytes=100_000)


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
    truth = open_vectors(d / "sift5k_groundtruth.ivecs")[:12, :10]
    agree(cpu, gpu, truth)
    assert recall(gpu.ids, truth) >= 0.95


# -- one budget per device per process, shared by every open index ----------------------------

@pytest.fixture(scope="module")
def second_index(tmp_path_factory):
    base = clustered(2000, 24, 30, seed=5)
    path = tmp_path_factory.mktemp("gpu2") / "idx"
    Index.build(base, path, BuildConfig(metric="l2"), progress=False)
    return base, path


def test_indexes_share_one_budget_and_one_that_does_not_fit_fails(l2_index, second_index):
    base_a, queries, path_a = l2_index
    base_b, path_b = second_index
    budget = 6 << 20
    kw = dict(filter_tier="gpu", gpu_search="lists", gpu_budget_bytes=budget, batch_size=16)
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
    for index, path, base in ((a, path_a, base_a), (b, path_b, base_b)):
        agree(Index.open(path, filter_tier="cpu").search(queries, k=10), index.search(queries, k=10),
              exact_knn(base, queries, 10))
    a.close()
    assert shared.used == used_b and shared.owners == {str(path_b)}
    a.close()  # twice is harmless
    b.close()
    assert shared.used == 0 and not shared.owners and shared.peak >= used_a + used_b


def test_close_gives_the_bytes_back(l2_index):
    _, queries, path = l2_index
    kw = dict(filter_tier="gpu", gpu_search="lists", gpu_budget_bytes=3 << 20, batch_size=16)  # holds one index, not two
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
    engine = EngineConfig(filter_tier="gpu", gpu_search="lists", gpu_budget_bytes=budget, batch_size=16)
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
    # Codebooks 32 KiB, slot map 40 KB, two blocks ~97 KiB: the codes (320 KB) fit in neither tier's share.
    budget = DeviceBudget(gpu_device(), 440_000)

    def open_tier(owner, share=0.5):
        return GpuFilterTier(offsets, ids, codes, codebooks, account=budget.account(owner), metric="l2", batch_size=1,
                             threads=1, work_bytes=16 << 10, tiered_share=share)

    first = open_tier("first")
    room = budget.budget - first.account.parts["PQ codebooks"]
    slots = first.account.parts["code slot map"]
    assert first.tiered and 0 < first.codes.shape[0] < count
    assert budget.left >= (room - slots) // 2  # half of what it found is left for the next one
    second = open_tier("second")
    assert second.tiered and second.codes.shape[0] == 0 and budget.used <= budget.budget
    for tier in (first, second):  # the second keeps no code resident: every one is read from host memory
        for i in range(len(lists)):  # blocks of one query's tables (batch_size=1)
            same_candidates(tier.topn(luts[i:i + 1], lists[i:i + 1], 40), cpu.topn(luts[i:i + 1], lists[i:i + 1], 40))
    first.close()
    second.close()
    assert budget.used == 0
    greedy = open_tier("greedy", share=1.0)  # takes all it finds: the next one cannot start
    with pytest.raises(ConfigError, match="greedy holds"):
        open_tier("late")
    greedy.close()


def test_an_exclusion_bitmap_stays_on_the_device_and_only_its_changes_go_up(monkeypatch):
    """A collection passes its tombstones with every search: bytes moved to the device by a search
    with the bitmap of the search before it are those of the same search without one, and one more
    deletion moves one 4 KiB chunk. Measured on every tensor copy (torch.Tensor.copy_)."""
    rng = np.random.default_rng(1)
    count, m = 100_000, 4  # a bitmap of 12 500 bytes: three whole chunks and a tail
    codes = rng.integers(0, 256, (count, m), dtype=np.uint8)
    codebooks = rng.standard_normal((m, 256, 1)).astype(np.float32)
    offsets = np.arange(0, count + 1, 1000, dtype=np.int64)
    ids = rng.permutation(count).astype(np.uint32)
    cpu = CpuFilterTier(offsets, ids, codes, codebooks, threads=1)
    gpu = GpuFilterTier(offsets, ids, codes, codebooks, account=DeviceBudget(gpu_device(), 32 << 20).account("t"),
                        metric="l2", batch_size=2, threads=1, blocks=1)
    luts = rng.random((2, m, 256), dtype=np.float32)
    lists = np.array([[3, 50], [7, 99]], dtype=np.int32)
    moved = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, non_blocking=False: (
        moved.append(t.numel() * t.element_size()), copy(t, src, non_blocking))[1])

    def search(exclude):
        moved.clear()
        got = gpu.topn(luts, lists, 50, exclude)
        same_candidates(got, cpu.topn(luts, lists, 50, exclude))
        if exclude is not None:
            assert not np.isin(got.ids, np.flatnonzero(np.unpackbits(exclude, bitorder="little"))).any()
        return sum(moved)

    dead = np.zeros(count, dtype=bool)
    dead[ids[offsets[3]:offsets[3] + 400:2]] = True  # half of list 3, spread over the bitmap
    tombs = np.packbits(dead, bitorder="little")
    without = search(None)
    assert search(tombs) > without  # the first time, its chunks go up
    assert search(tombs.copy()) == without  # the same bitmap again (a new array): nothing
    dead[ids[offsets[7]]] = True
    one_more = np.packbits(dead, bitorder="little")
    chunk = ids[offsets[7]] // 8 // CHUNK
    assert search(one_more) - without == min(CHUNK, len(one_more) - chunk * CHUNK)
    assert search(one_more) == without


def test_the_kernels_a_tier_compiles_are_those_its_searches_launch(l2_index, monkeypatch):
    """On CUDA a tier compiles GpuFilterTier.variants() when it opens, so that no request waits for
    Triton: searches of every kind (device and host tables, short and long segments, n from 1 to
    past one program's 4096, with and without exclusions, a query split over passes, tiered codes)
    launch exactly those, recorded at each launch with the launch choices a GPU makes (the
    interpreter's own are patched away). On CUDA, searching also adds nothing to Triton's caches."""
    _, queries, path = l2_index
    monkeypatch.setattr(adc_scan, "interpreted", lambda: False)
    monkeypatch.setattr(pq_table, "interpreted", lambda: False)
    launches = set()
    kernel_fns = (pq_table.pq_table_kernel, adc_scan.adc_scan_kernel, topn.topn_kernel)
    for kernel in kernel_fns:
        def record(*args, grid, warmup, _kernel=kernel, _run=kernel.run, **kw):
            if not warmup:  # the tier's own compiling, on CUDA
                launches.add(launched(_kernel, args, kw))
            return _run(*args, grid=grid, warmup=warmup, **kw)
        monkeypatch.setattr(kernel, "run", record)
    index, cpu, _ = open_tiers(path, 32 << 20)
    count, m = cpu.codes.shape
    q = index.prepare_queries(queries[:3])
    luts = index.pq.luts(q, "l2")
    every = np.tile(np.arange(len(cpu.list_offsets) - 1, dtype=np.int32), (3, 1))  # > 4096 IDs a query
    one = every[:, :1]  # ~10 IDs a query
    drop = np.zeros(count, dtype=bool)
    drop[::7] = True
    exclude = np.packbits(drop, bitorder="little")
    # Tiered, and blocks of 160 KiB beyond 3 queries' tables: a query of every list is split.
    work = 160 << 10
    tiered = index.pq.codebooks.nbytes + 4 * count + 2 * (3 * m * 1024 + 3 * 24 * 4 + CHUNK + work) + count * m // 3
    for budget, kw in ((32 << 20, {}), (tiered, dict(batch_size=3, work_bytes=work, tiered_share=1.0))):
        _, _, gpu = open_tiers(path, budget, **kw)
        assert gpu.tiered == bool(kw)
        passes = count_passes(gpu, monkeypatch)
        cached = compiled_counts(kernel_fns)
        launches.clear()
        tables = gpu.tables(q)
        gpu.topn(tables, one, 1)
        for lists, n in ((one, 100), (every, 1), (every, 200), (every, 600), (one, 5000), (every, 5000)):
            same_candidates(gpu.topn(luts, lists, n, exclude), cpu.topn(luts, lists, n, exclude))
        gpu.topn(luts, one, 300)
        gpu.topn(luts, one, 1000)
        assert launches == set(gpu.variants()), [str(v) for v in launches ^ set(gpu.variants())]
        # Nine calls, a pass each; tiered, the four of every list are split, in at least two passes each.
        assert len(passes) > 12 if kw else len(passes) == 9
        assert compiled_counts(kernel_fns) == cached
        assert set(gpu.compile_seconds) == ({"pq_table_kernel", "adc_scan_kernel", "topn_kernel"} if CUDA else set())


def compiled_counts(kernel_fns) -> list[int]:
    """Specialisations Triton holds compiled per kernel for the current device (none in the interpreter)."""
    if not CUDA:
        return []
    return [len(k.device_caches[torch.cuda.current_device()][0]) for k in kernel_fns]


def test_the_index_manager_rebalances_a_tiered_tier_in_the_background(l2_index):
    _, queries, path = l2_index
    index, cpu, _ = open_tiers(path, 32 << 20)
    count, m = cpu.codes.shape
    tables = 16 * m * 256 * 4 + 16 * 24 * 4
    budget = index.pq.codebooks.nbytes + 4 * count + 2 * (tables + CHUNK + (1 << 20)) + count * m // 3
    _, _, gpu = open_tiers(path, budget, work_bytes=1 << 20, tiered_share=1.0)
    assert gpu.tiered
    parts = (index.path, index.manifest, index.nav, gpu, index.reranker)
    Index(*parts, EngineConfig(filter_tier="gpu", manager_interval_s=0), index.params).search(queries[:8], k=10)
    hottest = np.argsort(-gpu.visits, kind="stable")[:3]
    members = np.concatenate([cpu.list_ids[cpu.list_offsets[c]:cpu.list_offsets[c + 1]] for c in hottest])
    # Out of GPU memory: every list holding one of their vectors (boundary replicas) ranks coldest.
    holds = np.isin(cpu.list_ids, members)
    sizes = np.diff(cpu.list_offsets)  # a build may leave lists empty, the last ones too
    per_list = np.bincount(np.repeat(np.arange(len(sizes)), sizes), weights=holds, minlength=len(sizes))
    gpu.place(-per_list.astype(np.int64))
    assert not np.all(gpu.slots.cpu().numpy()[members] >= 0)
    managed = Index(*parts, EngineConfig(filter_tier="gpu", manager_interval_s=0.01), index.params)
    deadline = time.monotonic() + 60
    while not np.all(gpu.slots.cpu().numpy()[members] >= 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert np.all(gpu.slots.cpu().numpy()[members] >= 0)  # placed by the manager: nothing here rebalanced
    thread = managed._manager
    managed.close()
    assert not thread.is_alive()
