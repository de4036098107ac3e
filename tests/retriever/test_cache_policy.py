"""The page buffer's policies (CLOCK, cache by use) and pinning by hotness, and the index manager
thread that re-pins: hit ratios and reads counted independently of the buffer, through the process's
own read counters (/proc/self/io: bytes read by read/pread system calls, which the pread backend
makes), residency, the thread's life, and answers that never depend on the policy. Every index here opens with
raw_in_ram 'off': the budget would hold these small indexes' raw vectors in RAM, with no page buffer to test."""

import threading
import time

import numpy as np
import pytest
from conftest import clustered

from fusionrag import native
from fusionrag.retriever import BuildConfig, ConfigError, EngineConfig, Index

RECORD = 4096  # one record a block, so a block is a request


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def blocks_read_since(before: int) -> int:
    """4 KiB blocks read since bytes_read() gave before (reading /proc/self/io itself counts some bytes)."""
    return (bytes_read() - before) // RECORD


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    """2048 blocks of random bytes: (path, crc)."""
    path = tmp_path_factory.mktemp("pages") / "p"
    rng = np.random.default_rng(0)
    rpb, ppb = native.page_layout(RECORD)
    with native.PageWriter(str(path), RECORD, rpb, ppb) as w:
        for lo in range(0, 2048, 256):
            w.write(np.arange(lo, lo + 256, dtype=np.uint32), rng.integers(0, 256, (256, RECORD), dtype=np.uint8))
    return path, w.close()


def open_store(page_file, capacity, policy, backend="pread"):
    path, crc = page_file
    try:
        return native.PageStore(str(path), RECORD, 1, 1, crc, capacity, io_backend=backend, buffer_policy=policy)
    except OSError as e:
        pytest.skip(f"{backend} is not available here: {e}")


def zipf_stream(n: int, blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, blocks + 1)
    p /= p.sum()
    return rng.permutation(blocks)[rng.choice(blocks, n, p=p)].astype(np.uint32)


def replay(store, stream, group: int = 8) -> float:
    """Hit ratio of the stream, read in groups as the re-ranker reads a round's blocks, from the
    bytes the process read meanwhile."""
    requests = 0
    before = bytes_read()
    for lo in range(0, len(stream), group):
        blocks = np.unique(stream[lo:lo + group])
        store.read_blocks(blocks)
        requests += len(blocks)
    read = blocks_read_since(before)
    return 1 - read / requests


def test_cache_by_use_beats_clock_on_a_skewed_stream(page_file):
    stream = zipf_stream(20000, 2048, seed=1)
    ratios = {}
    for policy in ("clock", "lfu"):
        store = open_store(page_file, 128, policy)  # 1/16 of the blocks
        assert store.buffer_policy == policy
        ratios[policy] = replay(store, stream)
        st = store.stats()
        # The buffer's own count agrees with the reads the kernel saw (a few bytes of other reads aside).
        assert abs(st["blocks_from_buffer"] / (st["blocks_read"] + st["blocks_from_buffer"]) - ratios[policy]) < 0.01
    # What an ideal frequency cache would hold: the 128 most likely of 2048 Zipf(1) blocks, ~0.65.
    assert ratios["lfu"] > ratios["clock"] + 0.03, ratios
    # No loss on a stream with no skew at all.
    uniform = np.random.default_rng(2).integers(0, 2048, 20000).astype(np.uint32)
    flat = {p: replay(open_store(page_file, 128, p), uniform) for p in ("clock", "lfu")}
    assert flat["lfu"] >= flat["clock"] - 0.01, flat


def back_soon_stream(n: int, blocks: int, lag: int) -> np.ndarray:
    """Each block asked for twice, lag steps apart, then not again for a cycle through `blocks` (a query's
    pages asked for again by the next queries, as consecutive questions about one topic do)."""
    i = np.arange(n)
    return np.stack([i % blocks, (i - lag) % blocks], 1).ravel().astype(np.uint32)


def test_auto_runs_the_policy_that_serves_more(page_file):
    """buffer_policy 'auto' simulates clock and lfu in miniature and runs as the one serving more: on a
    skewed stream lfu's hit ratio, where blocks come back soon and then never (TinyLFU's admission keeps
    them out), clock's. Hit ratios from the bytes the process read."""
    streams = {"skewed": zipf_stream(20000, 2048, seed=1), "back soon": back_soon_stream(10000, 2048, 32)}
    for name, stream in streams.items():
        ratios, mode = {}, {}
        for policy in ("clock", "lfu", "auto"):
            store = open_store(page_file, 128, policy)
            ratios[policy] = replay(store, stream)
            mode[policy] = store.buffer_mode
        best, worst = max(ratios["clock"], ratios["lfu"]), min(ratios["clock"], ratios["lfu"])
        assert best > worst + 0.05, (name, ratios)  # the stream tells the policies apart
        assert ratios["auto"] >= best - 0.03, (name, ratios)
        assert mode["auto"] == ("lfu" if ratios["lfu"] > ratios["clock"] else "clock"), (name, mode, ratios)
        assert mode["clock"] == "clock" and mode["lfu"] == "lfu"
    store = open_store(page_file, 128, "auto")
    replay(store, streams["back soon"])
    assert store.stats()["policy_switches"] >= 1 and store.buffer_mode == "clock"
    store.reset_buffer()  # forgets what it learned: starts as lfu again
    assert store.buffer_mode == "lfu"
    with pytest.raises(ValueError, match="buffer_policy must be 'auto', 'clock' or 'lfu'"):
        open_store(page_file, 128, "arc")


@pytest.mark.parametrize("policy", ["clock", "lfu", "auto"])
def test_looking_at_the_buffer_is_no_request(page_file, policy):
    """store.resident (PageBuffer::peek, what resident-first's copies go through) neither admits, counts nor
    feeds the frequency sketch or auto's shadows: a buffer looked at many times evicts as one not looked at,
    block for block (auto in the same mode), where asking for the same blocks as often (requests) keeps them
    under lfu (auto, its shadows fed, may then switch to clock)."""
    warm = np.arange(0, 128, dtype=np.uint32)  # fills the 128 frames
    newcomers = np.arange(1000, 1128, dtype=np.uint32)

    def run(between):
        store = open_store(page_file, 128, policy)
        store.read_blocks(warm)
        for _ in range(8):
            between(store)
        before = bytes_read()
        for _ in range(3):  # asked for thrice: more than a warm block that nothing asked for again
            store.read_blocks(newcomers)
        return store.resident(warm).astype(bool), blocks_read_since(before), store.buffer_mode

    plain = run(lambda store: None)
    looked = run(lambda store: store.resident(warm))
    asked = run(lambda store: store.read_blocks(warm))
    assert np.array_equal(looked[0], plain[0]) and looked[1:] == plain[1:]
    if policy == "lfu":  # the stream tells looking from asking: asked-for blocks keep their frames
        assert asked[0].sum() >= plain[0].sum() + 64, (asked[0].sum(), plain[0].sum())


@pytest.mark.parametrize("policy", ["clock", "lfu"])
def test_pinned_blocks_stay_resident_through_churn(page_file, policy):
    pinned = np.arange(0, 64, dtype=np.uint32) * 7  # blocks nothing else asks for
    churn = np.setdiff1d(np.arange(2048, dtype=np.uint32), pinned)
    stream = np.random.default_rng(3).choice(churn, 6000).astype(np.uint32)
    for pin in (True, False):
        store = open_store(page_file, 256, policy)
        before = bytes_read()
        if pin:
            assert store.pin(pinned) == len(pinned)
            assert blocks_read_since(before) == len(pinned)  # read once, to pin them
            assert store.stats()["pin_reads"] == len(pinned) and store.stats()["blocks_read"] == 0
        else:
            store.read_blocks(pinned)
        replay(store, stream)
        resident = store.resident(pinned)
        before = bytes_read()
        store.read_blocks(pinned)
        read_again = blocks_read_since(before)
        if pin:
            assert resident.all() and read_again == 0
            assert store.stats()["pinned"] == len(pinned)
        else:  # the control: the churn did push them out, and they had to be read again
            assert resident.mean() < 0.5 and read_again == len(pinned) - resident.sum()


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_pinning_is_bounded_and_replaced(page_file, backend):
    store = open_store(page_file, 256, "lfu", backend)
    assert store.backend == backend
    want = np.arange(2048, dtype=np.uint32)
    pinned = store.pin(want)  # more than the buffer
    assert 0 < pinned <= 256 * 3 // 4 and store.resident(want).sum() == pinned == store.stats()["pin_reads"]
    store.read_blocks(np.arange(1024, 1200, dtype=np.uint32))  # unpinned frames still turn over
    store.pin(np.array([5, 6], np.uint32))  # a new set replaces the old
    assert store.stats()["pinned"] == 2
    store.reset_buffer()
    assert store.stats()["pinned"] == 0 and not store.resident(np.array([5, 6], np.uint32)).any()
    with pytest.raises(ValueError, match="past the end"):
        store.pin(np.array([2048], np.uint32))
    with pytest.raises(ValueError, match="buffer_policy"):
        open_store(page_file, 8, "lru")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    base = clustered(4000, 24, 40, seed=1)
    queries = clustered(400, 24, 40, seed=2)
    path = tmp_path_factory.mktemp("cache") / "idx"
    Index.build(base, path, BuildConfig(metric="l2"), progress=False)
    return base, queries, path


def manager_threads():
    return [t for t in threading.enumerate() if t.name.startswith("fusionrag-index-manager")]


def test_engine_pins_hot_pages_and_stats_count_real_reads(small):
    _, queries, path = small
    index = Index.open(path, filter_tier="cpu", raw_in_ram="off", io_backend="pread", buffer_bytes=64 * 4096, pin_fraction=0.5,
                       manager_interval_s=0, threads=1)
    assert not manager_threads()  # interval 0: no thread, rounds by hand
    store = index.reranker.store
    hot = queries[:40]
    index.search(np.repeat(hot, 3, axis=0), k=10)
    assert index.refresh_hotness()["pinned"] > 0
    want = index.hot_blocks(int(0.5 * store.buffer_capacity))
    pinned = want[store.resident(want).astype(bool)]
    assert len(pinned) == store.stats()["pinned"] > 0
    # Other queries churn the buffer; the engine's pages_read are the reads the process did.
    before = bytes_read()
    r = index.search(queries[40:], k=10)
    assert store.block_bytes == RECORD
    assert int(r.stats["pages_read"].sum()) == blocks_read_since(before) > 0
    assert store.resident(pinned).all()
    before = bytes_read()
    store.read_blocks(pinned)
    assert blocks_read_since(before) == 0
    index.close()


def test_manager_thread_repins_in_the_background_and_stops_on_close(small):
    _, queries, path = small
    before = set(manager_threads())
    index = Index.open(path, filter_tier="cpu", raw_in_ram="off", buffer_bytes=64 * 4096, pin_fraction=0.5, manager_interval_s=0.01)
    mine = [t for t in manager_threads() if t not in before]
    assert len(mine) == 1 and mine[0].daemon
    index.search(queries[:50], k=10)
    deadline = time.monotonic() + 10
    while index.reranker.store.stats()["pinned"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert index.reranker.store.stats()["pinned"] > 0
    index.close()
    assert not mine[0].is_alive() and set(manager_threads()) == before
    # No pinning and a CPU tier: nothing to manage, no thread.
    Index.open(path, filter_tier="cpu", raw_in_ram="off").close()
    assert set(manager_threads()) == before


def test_manager_rebalances_a_tiered_gpu_tier_only_when_queries_came(small):
    _, _, path = small
    index = Index.open(path, filter_tier="cpu", raw_in_ram="off", manager_interval_s=0)

    class TieredTier:  # what refresh_hotness asks of a GPU tier holding only its hottest codes
        tiered, calls = True, 0
        visits = np.zeros(3, np.int64)

        def rebalance(self):
            self.calls += 1

    tier = index.filter = TieredTier()
    assert index.refresh_hotness() == {} and tier.calls == 0  # no query yet
    tier.visits[1] += 5
    assert index.refresh_hotness() == {"rebalanced": True} and tier.calls == 1
    assert index.refresh_hotness() == {} and tier.calls == 1
    tier.visits[2] += 1
    index.refresh_hotness()
    assert tier.calls == 2


@pytest.mark.parametrize("overrides", [dict(buffer_policy="lfu"), dict(buffer_policy="clock"),
                                       dict(buffer_policy="auto"), dict(pin_fraction=0.5),
                                       dict(buffer_policy="lfu", pin_fraction=0.75),
                                       dict(record_cache="on", record_cache_share=0.5),
                                       dict(buffer_policy="clock", record_cache="on")])
def test_answers_do_not_depend_on_the_policy(small, overrides):
    _, queries, path = small
    stream = np.concatenate([queries[:100], queries[:100], queries[100:300]])
    base = Index.open(path, filter_tier="cpu", raw_in_ram="off", buffer_bytes=32 * 4096, manager_interval_s=0)
    other = Index.open(path, filter_tier="cpu", raw_in_ram="off", buffer_bytes=32 * 4096, manager_interval_s=0, **overrides)
    for lo in range(0, len(stream), 50):
        want, got = base.search(stream[lo:lo + 50], k=10), other.search(stream[lo:lo + 50], k=10)
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.distances, want.distances)
        if "pin_fraction" in overrides:
            other.refresh_hotness()
    base.close(), other.close()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_record_cache_takes_its_share_of_the_buffer_and_counts_real_reads(small, fraction):
    """With record_cache on, record_cache_share of buffer_bytes goes to single records (each with its metadata),
    the rest to the page buffer; a repeated stream is served partly from cached records, and the pages the engine
    says it read are the bytes the process read (pread backend)."""
    _, queries, path = small
    budget = 32 * 4096
    index = Index.open(path, filter_tier="cpu", raw_in_ram="off", io_backend="pread", buffer_bytes=budget, buffer_policy="lfu",
                       record_cache="on", record_cache_share=fraction, manager_interval_s=0, threads=1)
    mem, store = index.memory(), index.reranker.store
    assert mem["record_cache_bytes"] == store.record_cache_capacity * (store.record_bytes + store.record_cache_overhead)
    assert mem["page_buffer_bytes"] + mem["record_cache_bytes"] <= budget
    # The share is of the budget less the buffer's bookkeeping (its entries' and the miniatures', within it: #68)
    assert mem["record_cache_bytes"] > ((budget - mem["parts"]["page_buffer_metadata"]) * fraction
                                        - store.record_bytes - store.record_cache_overhead)
    stream = np.concatenate([queries[:30]] * 4)
    index.search(stream, k=10)
    before = bytes_read()
    r = index.search(stream, k=10)
    assert int(r.stats["pages_read"].sum()) == blocks_read_since(before)
    assert r.stats["records_cached"].sum() > 0 and (r.stats["records_cached"] <= r.stats["reranked"]).all()
    index.close()


def test_adaptive_layout_gives_the_same_answers_in_either_layout(small):
    """record_cache 'auto': the whole buffer is blocks or records, one at a time (the index reports the one on
    and nothing for the other, within buffer_bytes); a stream re-ranked while the layout changes under it (every
    50 queries, held against the miniature) answers what a plain page buffer answers, and the record layout
    served some records from memory."""
    _, queries, path = small
    budget = 32 * 4096
    base = Index.open(path, filter_tier="cpu", raw_in_ram="off", buffer_bytes=budget, manager_interval_s=0)
    other = Index.open(path, filter_tier="cpu", raw_in_ram="off", buffer_bytes=budget, manager_interval_s=0)  # record_cache auto
    store = other.reranker.store
    assert store.adaptive_layout and store.layout == "blocks"  # 24-d: 96 + 96 bytes against 97.5 of a page
    stream = np.concatenate([queries[:100], queries[:100], queries[100:300]])
    for i, lo in enumerate(range(0, len(stream), 50)):
        store.set_layout(i % 2 == 1, hold=True)
        mem = other.memory()
        assert mem["page_buffer_bytes"] + mem["record_cache_bytes"] <= budget
        assert (mem["record_cache_bytes"] > 0) == (i % 2 == 1) and (mem["page_buffer_bytes"] > 0) == (i % 2 == 0)
        want, got = base.search(stream[lo:lo + 50], k=10), other.search(stream[lo:lo + 50], k=10)
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.distances, want.distances)
    assert store.stats()["records_from_cache"] > 0 and store.stats()["layout_switches"] == 7
    base.close(), other.close()


def test_config_validation():
    with pytest.raises(ConfigError, match="buffer_policy"):
        EngineConfig(buffer_policy="lru")
    with pytest.raises(ConfigError, match="pin_fraction"):
        EngineConfig(pin_fraction=0.9)
    with pytest.raises(ConfigError, match="manager_interval_s"):
        EngineConfig(manager_interval_s=-1)
    with pytest.raises(ConfigError, match="record_cache_share"):
        EngineConfig(record_cache_share=0)
    with pytest.raises(ConfigError, match="record_cache"):
        EngineConfig(record_cache="always")


def test_an_index_dropped_without_close_stops_its_manager(small):
    import gc

    _, _, path = small
    before = set(manager_threads())
    index = Index.open(path, filter_tier="cpu", raw_in_ram="off", pin_fraction=0.5, manager_interval_s=0.01)
    mine = [t for t in manager_threads() if t not in before]
    del index
    gc.collect()
    mine[0].join(timeout=10)
    assert not mine[0].is_alive()


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_cpu_pipeline_gives_the_same_answers(small, backend):
    _, queries, path = small
    try:
        plain = Index.open(path, filter_tier="cpu", raw_in_ram="off", batch_size=16, io_backend=backend, pipeline=False)
    except Exception as e:  # noqa: BLE001 - io_uring refused by this kernel or sandbox
        pytest.skip(f"{backend}: {e}")
    piped = Index.open(path, filter_tier="cpu", raw_in_ram="off", batch_size=16, io_backend=backend, pipeline=True)
    want, got = plain.search(queries, k=10), piped.search(queries, k=10)  # 25 batches
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.distances, want.distances)
    for key in ("candidates", "unique_candidates", "minibatches", "reranked"):
        np.testing.assert_array_equal(got.stats[key], want.stats[key])
    plain.close(), piped.close()


@pytest.mark.parametrize("dim,on", [(384, True), (768, True), (50, False), (24, False), (1024, False)])
def test_record_cache_auto_is_on_where_records_leave_pages_part_empty(tmp_path, dim, on):
    """record_cache 'auto' starts with records where a record alone, with its metadata, takes fewer bytes than its share of a
    block (384-d float32: 1536 + 96 bytes against 2048; 768-d: 3072 + 96 against 4096), off where pages are
    full of records (50-d: 200 + 96 against 205; 1024-d: one record fills a page)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "idx"
    Index.build(rng.standard_normal((300, dim)).astype(np.float32), path, BuildConfig(metric="l2"), progress=False)
    index = Index.open(path, filter_tier="cpu", raw_in_ram="off", buffer_bytes=256 * 4096, manager_interval_s=0)
    store = index.reranker.store
    share = (store.record_bytes + store.record_cache_overhead) / (store.block_bytes / store.records_per_block)
    assert (share < 1) == on
    assert store.adaptive_layout and (store.layout == "records") == on  # it starts so; its miniature may switch
    assert (index.memory()["record_cache_bytes"] > 0) == on and (index.memory()["page_buffer_bytes"] > 0) != on
    assert index.memory()["page_buffer_bytes"] + index.memory()["record_cache_bytes"] <= 256 * 4096
    r = index.search(rng.standard_normal((20, dim)).astype(np.float32), k=5)
    assert (r.ids >= 0).all()
    index.close()
