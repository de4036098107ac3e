"""The search kernels' per-thread scratch (native/scratch_meter.h): native.scratch_bytes() says what the threads that
searched hold between calls, checked against the process's anonymous resident memory, and gives it back when they
end."""

import json
import subprocess
import sys
import threading
import time

import numpy as np

from fusionrag import native


def _rss_anon() -> int:
    """Anonymous resident bytes of this process (/proc, not the meter)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


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

    before, rss_before = native.scratch_bytes(), _rss_anon()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    try:
        ready.wait(timeout=120)
        held, rss_held = native.scratch_bytes() - before, _rss_anon() - rss_before
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
    p = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads(p.stdout.strip().splitlines()[-1])
    assert not m["errors"], m["errors"]
    assert m["held"] >= m["floor"], m
    # What the meter says is memory the process holds: the threads' resident growth matches it (their stacks and
    # the arrays the calls returned are the slack).
    assert 0.85 * m["held"] <= m["rss_held"] <= 1.1 * m["held"] + (4 << 20), m
    assert m["after"] == m["before"], m


if __name__ == "__main__":
    print(json.dumps(_measure()))
