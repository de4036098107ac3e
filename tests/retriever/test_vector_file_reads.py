"""A build reads its source larger than memory: a gather of scattered rows reads from disk the pages it touches,
not the kernel's read-around of each fault (read_ahead_kb, 8 MiB on the development machine's disk), and a
range of rows still reads as one. Measured by the bytes this process read from storage (/proc/self/io
read_bytes, counted by the kernel), with the file dropped from the page cache first."""

from __future__ import annotations

import os
import pickle

import numpy as np

from fusionrag.retriever.engine.vectors import open_vectors

N, DIM = 100_000, 128  # 51 MB


def read_bytes() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def cold(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_scattered_gather_reads_the_pages_it_touches_and_a_range_reads_whole(tmp_path):
    x = np.random.default_rng(0).standard_normal((N, DIM), dtype=np.float32)
    path = tmp_path / "base.npy"
    np.save(path, x)
    ids = np.sort(np.random.default_rng(1).choice(N, 500, replace=False))
    src = open_vectors(path)
    cold(path)
    before = read_bytes()
    got = src[ids]
    gathered = read_bytes() - before
    np.testing.assert_array_equal(got, x[ids])
    # 500 rows of 512 bytes on at most 500 distinct 4 KiB pages: ~2 MB, where read-around read the whole file.
    assert gathered <= 500 * 4096 * 2, gathered
    cold(path)
    before = read_bytes()
    part = src[np.arange(20_000, 60_000)]
    ranged = read_bytes() - before
    np.testing.assert_array_equal(part, x[20_000:60_000])
    # the range, read once (less the pages the gather left mapped, which the cache keeps)
    assert 0.8 * 40_000 * DIM * 4 <= ranged <= 2 * 40_000 * DIM * 4, ranged
    np.testing.assert_array_equal(src[5:9], x[5:9])
    again = pickle.loads(pickle.dumps(src))  # a source sent to a worker process: no map pickled
    np.testing.assert_array_equal(again[ids[:5]], x[ids[:5]])
