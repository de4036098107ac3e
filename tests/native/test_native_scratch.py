"""The search kernels' scratch (native/scratch_meter.h): native.scratch_bytes() says what the threads that searched
hold between calls (and the re-rank's scratch kept for the next call), checked against the process's anonymous
resident memory, and gives a thread's back when it ends."""

import json
import sys
import threading
import time

import numpy as np
from rss import rss_anon, run_alone

from fusionrag import native


def _measure(threads: int = 6) -> dict:
    """Six threads each search a graph exactly and scan 16M codes on their own (num_threads=1), then wait: what
    the meter says they hold, what the process's resident memory grew by, and the meter once they ended."""
    rng = np.random.default_rng(3)
    nodes, dim = 100_000, 2
    graph = native.Graph(dim, "l2", M=4, ef_construction=8)
    graph.add(rng.standard_normal((nodes, dim)).astype(np.float32), num_threads=2)
    queries = rng.standard_normal((8, dim)).astype(np.float32)  # one block of exact_search: 8 rows of distances
    # A scan whose list names the last of 16M codes: its seen-bitmap covers all of them (2 MiB).
    n_codes = 1 << 24
    codes = np.zeros((n_codes, 1), np.uint8)
    list_ids = np.concatenate([np.arange(1000), [n_codes - 1]]).astype(np.uint32)
    offsets = np.array([0, len(list_ids)], np.int64)
    luts = rng.random((1, 1, 256), dtype=np.float32)
    probes = np.zeros((1, 1), np.int32)
    ready, done = threading.Barrier(threads + 1), threading.Event()
    errors = []

    def work():
        try:
            ids, _ = graph.exact_search(queries, 10, num_threads=1, screen=False)
            assert (ids >= 0).all()
            got, _, _, _ = native.scan_topn(luts, probes, offsets, list_ids, codes, 5, num_threads=1)
            assert (got >= 0).all()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
        ready.wait()
        done.wait()

    before, rss_before = native.scratch_bytes(), rss_anon()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    try:
        ready.wait(timeout=120)
        held, rss_held = native.scratch_bytes() - before, rss_anon() - rss_before
    finally:
        done.set()
        for t in pool:
            t.join()
    # A thread's thread-local scratch goes as its OS thread exits, which can be just after join() returns.
    deadline = time.monotonic() + 30
    while native.scratch_bytes() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    # Each thread's own scratch at least: the block's distances and cut band over every node (8 x 4 B + 4 B each)
    # and the bitmap (1 bit a code).
    floor = threads * (nodes * (8 * 4 + 4) + n_codes // 8)
    return {"errors": errors, "held": held, "rss_held": rss_held, "floor": floor, "before": before,
            "after": native.scratch_bytes()}


def test_thread_scratch_is_counted_as_held_and_given_back_when_its_threads_end():
    # In a process of its own: memory an earlier test freed, reused, would not show as resident growth.
    m = json.loads(run_alone(__file__))
    assert not m["errors"], m["errors"]
    assert m["held"] >= m["floor"], m
    # What the meter says is memory the process holds: the threads' resident growth matches it (their stacks and
    # the arrays the calls returned are the slack).
    assert 0.85 * m["held"] <= m["rss_held"] <= 1.1 * m["held"] + (4 << 20), m
    assert m["after"] == m["before"], m


def _measure_rerank(tmp: str) -> dict:
    """One thread re-ranks 16 queries at a time, 15 blocks of 4 KiB each a mini-batch with the next read ahead, 21
    times over a page file with no page buffer: what the meter says the call's scratch holds after the first call
    and after the last, and what the process's resident memory grew by."""
    from pathlib import Path

    rng = np.random.default_rng(5)
    n, dim, minibatch = 1024, 1024, 15  # 4 KiB records: a block each
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    record_bytes = dim * 4
    rpb, ppb = native.page_layout(record_bytes)
    path = Path(tmp) / "vectors.pages"
    w = native.PageWriter(str(path), record_bytes, rpb, ppb)
    w.write(np.arange(n, dtype=np.uint32), vectors.view(np.uint8))
    store = native.PageStore(str(path), record_bytes, rpb, ppb, w.close(), 0)
    locations = np.arange(n, dtype=np.uint32)
    queries = vectors[:16] + 0.01
    cand = np.stack([rng.permutation(n)[:120] for _ in range(16)]).astype(np.int64)
    before, rss_before = native.scratch_bytes(), rss_anon()
    first = None
    for _ in range(21):
        ids, _, stats, _ = native.rerank(store, queries, cand, locations, "f32", "l2", 10, minibatch, 0.0, 0,
                                         num_threads=1, prefetch=True)
        assert (ids >= 0).all() and stats[:, 2].sum() > 0
        first = native.scratch_bytes() - before if first is None else first
    return {"first": first, "held": native.scratch_bytes() - before, "rss_held": rss_anon() - rss_before,
            "floor": 16 * minibatch * 4096}


def test_rerank_scratch_is_kept_between_calls_and_counted(tmp_path):
    # A call's fetch buffer and read-ahead are taken from scratch kept between calls, not allocated anew each time:
    # the meter counts them once, the same after 20 more calls, and the process holds what it says.
    m = json.loads(run_alone(__file__, "rerank", str(tmp_path)))
    assert m["first"] >= m["floor"], m  # a round's blocks: 16 queries' mini-batches
    assert m["held"] == m["first"], m
    assert 0.85 * m["held"] <= m["rss_held"] <= 1.1 * m["held"] + (2 << 20), m


if __name__ == "__main__":
    if sys.argv[1:2] == ["rerank"]:
        print(json.dumps(_measure_rerank(sys.argv[2])))
    else:
        print(json.dumps(_measure()))
