"""The compressed page buffer: blocks held zero-run coded in 256-byte chunks of the same memory, so that blocks
with many zero bytes fit several times as many. Checked against the page file's own bytes, the process's
resident memory and a plain buffer of the same bytes."""

import ctypes
import gc

import numpy as np
import pytest
from buffer_churn import churn
from rss import rss_anon

from fusionrag import native

PAGE = 4096
CHUNK = 256


def _zeroed(rng, shape, density):
    """Random nonzero bytes with zero runs (pixels of a background): a share `density` of each row zero."""
    data = rng.integers(1, 256, shape, dtype=np.uint8)
    for row in data.reshape(-1, shape[-1]):
        at = 0
        while at < len(row):
            run = int(rng.integers(1, 40))
            if rng.random() < density:
                row[at:at + run] = 0
            at += run
    return data


def reference_code_bytes(data: np.ndarray) -> int:
    """The code's length as its token rule gives it, counted in Python: a token of two bytes per (zero run,
    literal) pair, a literal run ending at three zero bytes in a row (or the end), each count at most 255."""
    n, i, out = len(data), 0, 0
    zero = np.append(data == 0, [True, True, True])
    while i < n:
        z = 0
        while i + z < n and z < 255 and zero[i + z]:
            z += 1
        f, lit = i + z, 0
        while f + lit < n and lit < 255 and not (zero[f + lit] and zero[f + lit + 1] and zero[f + lit + 2]):
            lit += 1
        out += 2 + lit
        i = f + lit
    return out


def test_zero_run_code_round_trips():
    rng = np.random.default_rng(0)
    cases = [np.zeros(4096, np.uint8), np.ones(4096, np.uint8), np.zeros(1, np.uint8), np.zeros(3, np.uint8),
             np.array([5, 0, 0], np.uint8), np.array([0, 0, 0, 7] * 300, np.uint8)]
    cases += [_zeroed(rng, (1, int(n)), d)[0] for n, d in zip(rng.integers(1, 9000, 300), rng.random(300))]
    for data in cases:
        code, back = native.zero_runs(data)
        want = reference_code_bytes(data)
        if want < len(data):
            assert len(code) == want, (len(data), len(code), want)
            np.testing.assert_array_equal(back, data)
        else:  # not shorter: kept as it is
            assert len(code) == 0 and len(back) == 0
    # 4096 zeros: runs of 255, 16 of them and one of 16, each a token of two bytes.
    assert len(native.zero_runs(np.zeros(4096, np.uint8))[0]) == 34


def test_zero_runs_gain_counts_whole_chunks():
    rng = np.random.default_rng(1)
    assert native.zero_runs_gain(rng.integers(1, 256, (8, PAGE), dtype=np.uint8)) == 1.0
    assert native.zero_runs_gain(np.zeros((4, PAGE), np.uint8)) == PAGE / CHUNK  # 34 bytes take one chunk
    blocks = _zeroed(rng, (16, PAGE), 0.5)
    chunks = [-(-reference_code_bytes(b) // CHUNK) for b in blocks]
    assert native.zero_runs_gain(blocks) == pytest.approx(16 * PAGE / (CHUNK * sum(min(c, 16) for c in chunks)))
    with pytest.raises(ValueError):
        native.zero_runs_gain(np.zeros((2, 1000), np.uint8))


def _page_file(tmp_path, blocks, rng, density=0.6, record_bytes=400):
    """A page file of `blocks` blocks of records with zero runs; every 9th block random bytes (not shorter
    coded: kept as it is, in 16 chunks)."""
    rpb, ppb = native.page_layout(record_bytes)
    records = _zeroed(rng, (blocks * rpb, record_bytes), density)
    by_block = records.reshape(blocks, -1)
    by_block[::9] = rng.integers(1, 256, by_block[::9].shape, dtype=np.uint8)
    path = tmp_path / "z.pages"
    with native.PageWriter(str(path), record_bytes, rpb, ppb) as w:
        w.write(np.arange(len(records), dtype=np.uint32), records)
        crc = w.close()
    return path, (rpb, ppb), crc, np.fromfile(path, np.uint8).reshape(-1, PAGE)


def trimmed_rss_anon() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_anon()


def _within(store):
    assert store.buffer_chunk_bytes <= store.buffer_bytes


def _resident(store, blocks) -> np.ndarray:
    return store.resident(np.asarray(list(blocks), np.uint32))


def _store(path, layout, crc, blocks, gain, **kw):
    return native.PageStore(str(path), 400, layout[0], layout[1], crc, blocks, io_backend="pread",
                            compress_gain=gain, **kw)


@pytest.mark.parametrize("policy", ["clock", "lfu", "auto"])
def test_compressed_buffer_serves_its_blocks_through_churn(tmp_path, policy):
    """Thousands of blocks of 1 to 16 chunks in and out of a small compressed buffer: every block it serves is
    the page file's, and under CLOCK a block just read is served from memory the next time."""
    rng = np.random.default_rng(2)
    path, layout, crc, data = _page_file(tmp_path, 400, rng)
    gain = native.zero_runs_gain(data[::7].copy())
    store = _store(path, layout, crc, 48, gain, buffer_policy=policy)
    assert store.buffer_compressed and store.buffer_entries > 48 and store.buffer_bytes == 48 * PAGE
    hot = churn(store, data, policy, each=lambda: _within(store))
    assert store.stats()["evictions"] > 1000 and store.stats()["blocks_from_buffer"] > 0
    store.reset_buffer()
    assert store.buffer_chunk_bytes == 0 and not _resident(store, [hot[0]]).any()
    assert store.read_block(int(hot[0])) == data[hot[0]].tobytes()


def test_compressed_buffer_holds_more_blocks_in_the_same_resident_memory(tmp_path):
    """4,000 frames' worth of memory (16 MB) over 12,000 blocks coded ~3x shorter: read once each, the buffer
    ends up holding well over 4,000 of them (counted by asking for each, nothing read again), and the process's
    anonymous resident set grew by no more than the 16 MB and 1 MiB (entries, chains, sketch). A plain buffer of
    the same bytes holds 4,000."""
    rng = np.random.default_rng(3)
    path, layout, crc, data = _page_file(tmp_path, 12_000, rng, density=0.75)
    gain = native.zero_runs_gain(data[::100].copy())
    assert 2 < gain < 4
    # Memory freed but kept by malloc (the 2 MB results of the reads, the read threads' scratch) is handed back
    # before each reading: what stays resident is what is held.
    before = trimmed_rss_anon()
    store = _store(path, layout, crc, 4000, gain, buffer_policy="clock")
    for first in range(0, 12_000, 500):
        store.read_blocks(np.arange(first, first + 500, dtype=np.uint32))
    grown = trimmed_rss_anon() - before
    held = int(_resident(store, range(12_000)).sum())
    assert held > 1.6 * 4000, held
    assert 0.8 * 4000 * PAGE < grown <= 4000 * PAGE + (1 << 20), grown
    assert 0.8 * 4000 * PAGE < store.buffer_chunk_bytes <= 4000 * PAGE
    plain = _store(path, layout, crc, 4000, 0.0, buffer_policy="clock")
    for first in range(0, 12_000, 500):
        plain.read_blocks(np.arange(first, first + 500, dtype=np.uint32))
    assert int(_resident(plain, range(12_000)).sum()) == 4000
    for b in rng.choice(12_000, 300, replace=False):
        assert store.read_block(int(b)) == data[b].tobytes()


def test_compressed_buffer_pins_and_still_turns_over(tmp_path):
    """Pinned blocks stay through churn and never take more than 3/4 of the memory: the rest still turns over
    (a sweep that found no chunks to free would never return)."""
    rng = np.random.default_rng(4)
    path, layout, crc, data = _page_file(tmp_path, 600, rng, density=0.2)
    store = _store(path, layout, crc, 64, 1.5, buffer_policy="lfu")
    want = rng.choice(600, 200, replace=False).astype(np.uint32)
    pinned = store.pin(want)
    assert 0 < pinned <= 48  # 3/4 of 64 blocks' memory, whatever they code to
    kept = want[_resident(store, want).astype(bool)]
    assert len(kept) == pinned
    for step in range(1500):
        blocks = rng.choice(600, 8, replace=False).astype(np.uint32)
        assert np.array_equal(store.read_blocks(blocks), data[blocks]), step
    assert _resident(store, kept).all()
    assert store.stats()["evictions"] > 100
    assert store.buffer_chunk_bytes <= store.buffer_bytes


def test_incompressible_blocks_in_a_compressed_buffer(tmp_path):
    """compress_gain asked for on blocks that code no shorter: each is kept as it is in 16 chunks, so the
    buffer holds what a plain one does and serves the same bytes."""
    rng = np.random.default_rng(5)
    rpb, ppb = native.page_layout(400)
    records = rng.integers(1, 256, (300 * rpb, 400), dtype=np.uint8)
    path = tmp_path / "r.pages"
    with native.PageWriter(str(path), 400, rpb, ppb) as w:
        w.write(np.arange(len(records), dtype=np.uint32), records)
        crc = w.close()
    data = np.fromfile(path, np.uint8).reshape(-1, PAGE)
    assert native.zero_runs_gain(data) == 1.0
    store = _store(path, (rpb, ppb), crc, 32, 1.01, buffer_policy="clock")
    store.read_blocks(np.arange(300, dtype=np.uint32))
    assert int(_resident(store, range(300)).sum()) == 32 and store.buffer_chunk_bytes == 32 * PAGE
    for b in range(268, 300):
        assert store.read_block(b) == data[b].tobytes()
    assert store.stats()["blocks_from_buffer"] == 32


def test_compressed_buffer_refuses_what_it_cannot_hold(tmp_path):
    rng = np.random.default_rng(6)
    path, layout, crc, _ = _page_file(tmp_path, 20, rng)
    with pytest.raises(ValueError, match="adaptive layout"):
        _store(path, layout, crc, 8, 2.0, record_cache=50, adaptive_layout=True)
