"""bench/cache/cache_sim.py: the page store's block trace, and its replays of the native buffer policies, checked
against what the native buffer did on the same requests (the reads the kernel saw, and the engine's counts)."""


import numpy as np
import pytest
from conftest import clustered

from fusionrag import native
from fusionrag.retriever import BuildConfig, EngineConfig, Index

from bench.cache import cache_sim

RECORD = 4096


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pages") / "p"
    rpb, ppb = native.page_layout(RECORD)
    rng = np.random.default_rng(0)
    with native.PageWriter(str(path), RECORD, rpb, ppb) as w:
        for lo in range(0, 2048, 256):
            w.write(np.arange(lo, lo + 256, dtype=np.uint32), rng.integers(0, 256, (256, RECORD), dtype=np.uint8))
    return path, w.close()


@pytest.mark.parametrize("policy", ["clock", "lfu"])
def test_replay_reads_what_the_buffer_read(page_file, policy):
    """Zipf requests in calls of up to 8 blocks through a real pread store of 600 frames (2 shards): the trace
    holds each call as asked, and the replay of it reads exactly the blocks the kernel was asked for."""
    path, crc = page_file
    store = native.PageStore(str(path), RECORD, 1, 1, crc, 600, io_backend="pread", buffer_policy=policy)
    rng = np.random.default_rng(1)
    p = 1.0 / np.arange(1, 2049)
    stream = rng.permutation(2048)[rng.choice(2048, 12000, p=p / p.sum())].astype(np.uint32)
    groups = [np.unique(stream[lo:lo + 8]) for lo in range(0, len(stream), 8)]
    store.set_trace(True)
    before = rchar()
    for g in groups:
        store.read_blocks(g)
    kernel_blocks = (rchar() - before) // RECORD
    trace = store.take_trace()
    store.set_trace(False)
    calls = cache_sim.calls(trace)
    assert len(calls) == len(groups)
    assert all(np.array_equal(c[1:, 0], g) and (c[1:, 1] == 1).all() for c, g in zip(calls, groups))
    assert len(store.take_trace()) == 0  # taken, and off
    store.read_blocks(groups[0])
    assert len(store.take_trace()) == 0

    read, served = cache_sim.replay(cache_sim.NativeReplay(600, policy), trace, 0)
    assert read + served == sum(len(g) for g in groups)
    assert read == store.stats()["blocks_read"]
    assert abs(read - kernel_blocks) <= 2  # reading /proc/self/io itself counts a few bytes
    # Belady's reads no more than any policy, and a policy that forgets everything reads every block.
    opt_read, _ = cache_sim.belady(trace, 600, 0)
    assert opt_read < read
    assert cache_sim.replay(cache_sim.NativeReplay(1, policy), trace, 0)[0] > read


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("idx")
    np.save(d / "x.npy", clustered(20000, 32, 64, seed=3))
    Index.build(str(d / "x.npy"), str(d / "idx"), BuildConfig(threads=2), progress=False)
    return d / "idx"


@pytest.mark.parametrize("policy", ["clock", "lfu"])
def test_replay_of_a_search_trace_matches_the_engine(small, policy):
    """The re-ranker's own calls (queries in flight, weights: how many asked) replayed give the engine's
    counts of pages read and served, to the block; a wrong aging or weight would not."""
    raw = (small / "vectors.pages").stat().st_size
    index = Index.open(small, EngineConfig(buffer_bytes=raw // 8, threads=1, filter_tier="cpu", buffer_policy=policy,
                                           manager_interval_s=0.0, record_cache="off"))  # a replay of blocks
    try:
        store = index.reranker.store
        rng = np.random.default_rng(4)
        base = clustered(20000, 32, 64, seed=3)
        queries = base[rng.choice(200, 800)] + 0.01  # 200 queries asked again and again
        store.set_trace(True)
        read = served = 0
        for lo in range(0, len(queries), 16):
            r = index.search(queries[lo:lo + 16], 10)
            read += int(r.stats["pages_read"].sum())
            served += int(r.stats["pages_buffered"].sum())
        trace = store.take_trace()
        frames = int(store.buffer_capacity)
    finally:
        index.close()
    assert (trace[trace[:, 0] != cache_sim.CALL, 1] > 1).any(), "no block was asked for by several queries"
    assert cache_sim.replay(cache_sim.NativeReplay(frames, policy), trace, 0) == (read, served)
    if policy == "lfu":  # another aging is another policy: it must not replay the same
        assert cache_sim.replay(cache_sim.NativeReplay(frames, policy, aging=2), trace, 0) != (read, served)


def test_lfu_variants_change_only_what_they_say(page_file):
    """LfuVariant with no change replays exactly as the native lfu's replay (checked against the kernel above); each
    change reads a different number of blocks on Zipf requests, and none fewer than Belady's."""
    rng = np.random.default_rng(4)
    p = 1.0 / np.arange(1, 2049) ** 0.8
    stream = rng.permutation(2048)[rng.choice(2048, 12000, p=p / p.sum())].astype(np.uint32)
    rows = []
    for lo in range(0, len(stream), 8):
        g = np.unique(stream[lo:lo + 8])
        rows += [[cache_sim.CALL, len(g)], *([int(b), 1 + int(b) % 3] for b in g)]
    trace = np.asarray(rows, np.uint32)
    lfu = cache_sim.replay(cache_sim.NativeReplay(300, "lfu"), trace, 0)
    assert cache_sim.replay(cache_sim.LfuVariant(300), trace, 0) == lfu
    opt_read, _ = cache_sim.belady(trace, 300, 0)
    for name, change in cache_sim.VARIANTS.items():
        read, served = cache_sim.replay(cache_sim.LfuVariant(300, **change), trace, 0)
        assert read + served == sum(lfu) and read != lfu[0] and read > opt_read, name
