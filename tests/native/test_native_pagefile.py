"""The SSD tier: page file writer, CRC32C, and the O_DIRECT page store with its buffer."""

import os
import shutil

import numpy as np
import pytest
from buffer_churn import churn
from threads import run_threads

from fusionrag import native

PAGE = 4096
ELEM_BYTES = {"f32": 4, "u8": 1, "i8": 1}


def _crc_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


CRC_TABLE = _crc_table()


def crc32c_reference(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ CRC_TABLE[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


def write_page_file(path, records, slots, calls=3):
    """Writes uint8 records at ascending slots in several write() calls; returns (layout, crc)."""
    rpb, ppb = native.page_layout(records.shape[1])
    with native.PageWriter(str(path), records.shape[1], rpb, ppb) as w:
        for part in np.array_split(np.arange(len(slots)), calls):
            w.write(slots[part], records[part])
    return (rpb, ppb), w.close()


def open_store(path, record_bytes, layout, crc, buffer_blocks=64, **kw):
    return native.PageStore(str(path), record_bytes, layout[0], layout[1], crc, buffer_blocks, **kw)


def store_or_skip(*args, **kw):
    try:
        return open_store(*args, **kw)
    except OSError as e:
        pytest.skip(f"not available on this machine: {e}")


@pytest.fixture
def page_file(tmp_path):
    """2000 f32 dim-100 records (10 a block) at sparse slots: 250 blocks."""
    rng = np.random.default_rng(1)
    slots = np.sort(rng.choice(2500, 2000, replace=False)).astype(np.uint32)
    records = rng.integers(1, 256, (2000, 400), dtype=np.uint8)
    path = tmp_path / "vectors.pages"
    layout, crc = write_page_file(path, records, slots)
    return path, layout, crc


def test_crc32c_check_value():
    for software in (False, True):
        assert native.crc32c(b"123456789", software=software) == 0xE3069283
        assert native.crc32c(np.frombuffer(b"123456789", np.uint8), software=software) == 0xE3069283
        assert native.crc32c(b"", software=software) == 0


def test_crc32c_hardware_matches_software():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 20000, dtype=np.uint8)
    for start, length in [(0, 1), (1, 7), (3, 8), (5, 63), (0, 4096), (7, 4097), (11, 19000)]:
        chunk = data[start : start + length]
        hw = native.crc32c(chunk)
        assert hw == native.crc32c(chunk, software=True)
        if length < 5000:
            assert hw == crc32c_reference(chunk.tobytes())


@pytest.mark.parametrize(
    "dtype,dim", [("f32", 50), ("f32", 100), ("u8", 784), ("i8", 100), ("f32", 1536)]
)
def test_writer_layout(tmp_path, dtype, dim):
    record_bytes = dim * ELEM_BYTES[dtype]
    rpb, ppb = native.page_layout(record_bytes)
    if record_bytes <= PAGE:
        assert (rpb, ppb) == (PAGE // record_bytes, 1)
    else:
        assert (rpb, ppb) == (1, -(-record_bytes // PAGE))
    rng = np.random.default_rng(dim)
    n = 300
    slots = np.sort(rng.choice(3 * n, n, replace=False)).astype(np.uint32)
    records = rng.integers(1, 256, (n, record_bytes), dtype=np.uint8)  # no zero byte: a record cannot hide
    path = tmp_path / "vectors.pages"
    _, crc = write_page_file(path, records, slots, calls=4)

    data = np.fromfile(path, np.uint8)
    block_bytes = ppb * PAGE
    num_blocks = int(slots[-1]) // rpb + 1
    assert data.size == num_blocks * block_bytes and data.size % PAGE == 0
    assert crc.dtype == np.uint32 and crc.shape == (num_blocks,)
    expected = np.zeros_like(data)
    for s, rec in zip(slots, records):
        off = (int(s) // rpb) * block_bytes + (int(s) % rpb) * record_bytes
        assert np.array_equal(data[off : off + record_bytes], rec)
        expected[off : off + record_bytes] = rec
    assert np.array_equal(data, expected)  # nothing else written: gaps and tails are zero
    for b in range(0, num_blocks, max(1, num_blocks // 12)):
        assert crc[b] == crc32c_reference(data[b * block_bytes : (b + 1) * block_bytes].tobytes())
    assert np.array_equal(crc, [native.crc32c(data[b * block_bytes : (b + 1) * block_bytes]) for b in range(num_blocks)])


def test_writer_rejects_bad_input(tmp_path):
    w = native.PageWriter(str(tmp_path / "a.pages"), 400, 10, 1)
    rec = np.ones((2, 400), np.uint8)
    with pytest.raises(ValueError, match="ascending"):
        w.write(np.array([5, 5], np.uint32), rec)
    with pytest.raises(ValueError, match="ascending"):
        w.write(np.array([7, 3], np.uint32), rec)
    w.write(np.array([3, 7], np.uint32), rec)
    with pytest.raises(ValueError, match="ascending"):
        w.write(np.array([7, 9], np.uint32), rec)  # across calls too
    with pytest.raises(ValueError, match="records"):
        w.write(np.array([8, 9], np.uint32), np.ones((2, 399), np.uint8))
    with pytest.raises(TypeError):  # raw bytes are never cast: view float records as uint8
        w.write(np.array([8, 9], np.uint32), np.ones((2, 400), np.float32))
    crc = w.close()
    assert np.array_equal(w.close(), crc)  # idempotent
    with pytest.raises(ValueError, match="closed"):
        w.write(np.array([10], np.uint32), rec[:1])
    with pytest.raises(ValueError, match="do not fit"):
        native.PageWriter(str(tmp_path / "b.pages"), 400, 11, 1)
    with pytest.raises(ValueError):
        native.PageWriter(str(tmp_path / "c.pages"), 0, 1, 1)


def test_writer_reports_write_errors():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    w = native.PageWriter("/dev/full", 400, 10, 1)
    w.write(np.array([0, 25], np.uint32), np.ones((2, 400), np.uint8))
    with pytest.raises(OSError, match="/dev/full.*No space left") as e:
        w.close()
    assert e.value.errno == 28
    with pytest.raises(RuntimeError, match="earlier write failed"):
        w.close()


def test_writer_collected_without_close(tmp_path):
    w = native.PageWriter(str(tmp_path / "a.pages"), 400, 10, 1)
    w.write(np.array([0], np.uint32), np.ones((1, 400), np.uint8))
    fds = len(os.listdir("/proc/self/fd"))
    del w
    assert len(os.listdir("/proc/self/fd")) == fds - 1


def test_direct_io_flag(page_file):
    path, layout, crc = page_file
    store = store_or_skip(path, 400, layout, crc, direct_io="on")
    assert store.direct

    def flags(fd):
        with open(f"/proc/self/fdinfo/{fd}") as f:
            return int(next(line for line in f if line.startswith("flags:")).split()[1], 8)

    assert flags(store.fd) & 0o40000
    assert store.read_block(3) == path.read_bytes()[3 * PAGE : 4 * PAGE]
    plain = open_store(path, 400, layout, crc, direct_io="off")
    assert not plain.direct and not flags(plain.fd) & 0o40000
    assert open_store(path, 400, layout, crc).direct  # auto takes O_DIRECT where the filesystem allows


def test_auto_direct_io_on_tmpfs(page_file):
    """tmpfs may refuse O_DIRECT (EINVAL); "auto" then opens the file without it."""
    path, layout, crc = page_file
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    shm = f"/dev/shm/fusionrag-test-{os.getpid()}.pages"
    shutil.copyfile(path, shm)
    try:
        store = open_store(shm, 400, layout, crc)
        assert store.read_block(5) == path.read_bytes()[5 * PAGE : 6 * PAGE]
        assert open_store(shm, 400, layout, crc, direct_io="off").read_block(5) == store.read_block(5)
    finally:
        os.unlink(shm)


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_backends_read_the_file(page_file, backend):
    path, layout, crc = page_file
    data = np.fromfile(path, np.uint8).reshape(-1, PAGE)
    store = store_or_skip(path, 400, layout, crc, buffer_blocks=0, io_backend=backend)
    assert store.backend == backend
    assert store.num_blocks == len(crc) == data.shape[0]
    blocks = np.random.default_rng(2).permutation(store.num_blocks).astype(np.uint32)
    assert np.array_equal(store.read_blocks(blocks[:150]), data[blocks[:150]])  # more than one ring's depth
    assert np.array_equal(store.read_blocks(blocks[150:]), data[blocks[150:]])
    assert store.read_block(17) == data[17].tobytes()
    assert store.stats() == {
        "blocks_read": store.num_blocks + 1,
        "blocks_from_buffer": 0,
        "read_calls": 3,
        "evictions": 0,
        "pin_reads": 0,
        "pinned": 0,
        "read_ahead": 0,
        "read_ahead_unused": 0,
        "policy_switches": 0,
        "record_lookups": 0,
        "records_from_cache": 0,
        "layout_switches": 0,
    }


def test_auto_backend(page_file):
    path, layout, crc = page_file
    store = open_store(path, 400, layout, crc)
    assert store.backend in ("io_uring", "pread")
    assert store.buffer_capacity == 64 and store.buffer_bytes == 64 * PAGE
    assert store.block_bytes == PAGE and store.records_per_block == 10 and store.pages_per_block == 1


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_checksum_error(page_file, backend):
    path, layout, crc = page_file
    with open(path, "r+b") as f:
        f.seek(17 * PAGE + 123)
        byte = f.read(1)
        f.seek(17 * PAGE + 123)
        f.write(bytes([byte[0] ^ 0x40]))
    store = store_or_skip(path, 400, layout, crc, io_backend=backend)
    for _ in range(2):  # the bad block was not cached: it fails again
        with pytest.raises(RuntimeError, match=r"vectors\.pages: block 17 fails its checksum.*corrupt"):
            store.read_block(17)
    with pytest.raises(RuntimeError, match="block 17"):
        store.read_blocks(np.array([3, 17, 40], np.uint32))
    assert store.stats()["blocks_from_buffer"] == 0
    store.read_block(16)


def test_size_errors(page_file):
    path, layout, crc = page_file
    with pytest.raises(RuntimeError, match="vectors.pages.*truncated"):
        open_store(path, 400, layout, crc[:-1])
    size = path.stat().st_size
    os.truncate(path, size - PAGE)
    with pytest.raises(RuntimeError, match="vectors.pages.*truncated"):
        open_store(path, 400, layout, crc)
    with pytest.raises(FileNotFoundError, match="missing.pages"):
        open_store(path.with_name("missing.pages"), 400, layout, crc)


def test_bad_arguments(page_file):
    path, layout, crc = page_file
    with pytest.raises(ValueError, match="io_backend"):
        open_store(path, 400, layout, crc, io_backend="aio")
    with pytest.raises(ValueError, match="direct_io"):
        open_store(path, 400, layout, crc, direct_io="yes")
    with pytest.raises(ValueError, match="io_threads"):
        open_store(path, 400, layout, crc, io_threads=0)
    with pytest.raises(ValueError, match="buffer_blocks"):
        open_store(path, 400, layout, crc, buffer_blocks=-1)
    store = open_store(path, 400, layout, crc)
    for b in (-1, len(crc)):
        with pytest.raises(ValueError, match="out of range"):
            store.read_block(b)
    with pytest.raises(ValueError, match="past the end"):
        store.read_blocks(np.array([1, len(crc)], np.uint32))


def test_buffer_capacity_and_clock(page_file):
    path, layout, crc = page_file
    store = open_store(path, 400, layout, crc, buffer_blocks=8)
    first, second = np.arange(8, dtype=np.uint32), np.arange(8, 16, dtype=np.uint32)
    data = np.fromfile(path, np.uint8).reshape(-1, PAGE)

    def delta(fn):
        before = store.stats()
        fn()
        after = store.stats()
        return {k: after[k] - before[k] for k in after}

    assert delta(lambda: store.read_blocks(first))["blocks_read"] == 8
    d = delta(lambda: store.read_blocks(first))
    assert d["blocks_from_buffer"] == 8 and d["blocks_read"] == 0 and d["read_calls"] == 0
    d = delta(lambda: store.read_blocks(second))  # beyond capacity: every old block goes
    assert d["blocks_read"] == 8 and d["evictions"] == 8
    assert np.array_equal(store.read_blocks(second), data[second])
    assert delta(lambda: store.read_block(0))["blocks_read"] == 1
    store.reset_buffer()
    assert delta(lambda: store.read_blocks(second))["blocks_read"] == 8

    # CLOCK: blocks hit since they came in survive a scan of cold ones.
    store.reset_buffer()
    store.read_blocks(first)
    store.read_blocks(first[:4])
    store.read_blocks(second[:4])
    d = delta(lambda: store.read_blocks(first[:4]))
    assert d["blocks_from_buffer"] == 4

    nobuf = open_store(path, 400, layout, crc, buffer_blocks=0)
    nobuf.read_blocks(first)
    nobuf.read_blocks(first)
    assert nobuf.stats()["blocks_read"] == 16 and nobuf.stats()["blocks_from_buffer"] == 0


@pytest.mark.parametrize("policy", ["clock", "lfu", "auto"])
def test_buffer_finds_its_blocks_through_churn(page_file, policy):
    """Thousands of blocks in and out of a small buffer (its shards' block -> frame tables deleting by shifting
    entries back): every block it serves is the right one, and under CLOCK, which admits every block read, a
    block just read is served from memory the next time (a lost table entry would read it again)."""
    path, layout, crc = page_file
    data = np.fromfile(path, np.uint8).reshape(-1, PAGE)
    store = open_store(path, 400, layout, crc, buffer_blocks=48, buffer_policy=policy)
    churn(store, data, policy)
    st = store.stats()
    assert st["evictions"] > 1000  # LFU admits fewer than CLOCK (1,300 here against 10,000)
    assert st["blocks_from_buffer"] > 0


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_concurrent_readers(page_file, backend):
    path, layout, crc = page_file
    data = np.fromfile(path, np.uint8).reshape(-1, PAGE)
    store = store_or_skip(path, 400, layout, crc, buffer_blocks=32, io_backend=backend, io_threads=3)
    errors = []

    def reader(seed):
        rng = np.random.default_rng(seed)
        for _ in range(60):
            blocks = rng.choice(store.num_blocks, 20, replace=False).astype(np.uint32)
            if not np.array_equal(store.read_blocks(blocks), data[blocks]):
                errors.append(f"thread {seed}: wrong bytes")
            b = int(rng.integers(store.num_blocks))
            if store.read_block(b) != data[b].tobytes():
                errors.append(f"thread {seed}: wrong block {b}")

    errors += run_threads(reader, range(6))
    assert not errors
    st = store.stats()
    assert st["blocks_read"] + st["blocks_from_buffer"] == 6 * 60 * 21
    assert st["blocks_from_buffer"] > 0 and st["evictions"] > 0
