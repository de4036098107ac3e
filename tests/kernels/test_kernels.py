"""Each Triton kernel against its PyTorch reference: odd shapes, empty inputs, all duplicates,
IDs at the top of the uint32 range. On a machine without a GPU, conftest.py sets
TRITON_INTERPRET=1 and the kernels run on CPU tensors in Triton's interpreter."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from threads import run_threads

from fusionrag.kernels.adc_scan import adc_scan, adc_scan_reference
from fusionrag.kernels.adc_stream import adc_stream, adc_stream_reference
from fusionrag.kernels.dedup import dedup, dedup_reference
from fusionrag.kernels.pool import BlockPool, BudgetError, DeviceBudget
from fusionrag.kernels.pq_table import pq_tables, pq_tables_reference
from fusionrag.kernels.topn import EMPTY, MAX_NP, pack_keys, topn, topn_reference, unpack_keys
from fusionrag.kernels.variants import compile_all, variant

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOP = 0xFFFFFFFF


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def as_u32(ids) -> torch.Tensor:
    """uint32 values (python ints or int64) as the int32 bit patterns the kernels take."""
    t = torch.as_tensor(ids, dtype=torch.int64) & TOP
    return torch.where(t >= 1 << 31, t - (1 << 32), t).to(torch.int32).to(DEVICE)


def offsets_of(*lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("ksub", [256, 16])  # 16: 4-bit codes' tables (BuildConfig.pq_bits 4)
@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("q,dim,m", [(5, 13, 5), (1, 3, 3), (3, 16, 8), (0, 7, 2), (5, 13, 26)])
def test_pq_tables_match_reference(metric, q, dim, m, ksub):
    g = gen(q * 100 + dim)
    codebooks = torch.randn(m, ksub, -(-dim // m), generator=g)
    queries = torch.randn(q, dim, generator=g)
    got = pq_tables(queries.to(DEVICE), codebooks.to(DEVICE), metric)
    assert got.shape == (q, m, ksub)
    torch.testing.assert_close(got.cpu(), pq_tables_reference(queries, codebooks, metric), rtol=1e-4, atol=1e-4)


def pack4(sub: torch.Tensor) -> torch.Tensor:
    """(P, M) centroid numbers below 16 as 4-bit codes, two a byte (retriever/engine/pq.py's layout, written here
    again: sub-space 2b in byte b's low nibble, 2b + 1 in its high one)."""
    if sub.shape[1] % 2:
        sub = torch.nn.functional.pad(sub, (0, 1))
    return (sub[:, 0::2] | (sub[:, 1::2] << 4)).to(torch.uint8)


@pytest.mark.parametrize("m", [9, 16])
def test_adc_stream_of_four_bit_codes_matches_reference_and_the_engines_packing(m):
    """4-bit codes streamed from the device and from host memory: each posting's distance the sum of its M
    sub-spaces' entries (checked against the unpacked sums computed here and against the reference), an odd M's
    last byte's high nibble unread, and codes packed by the engine's ProductQuantizer read the same way."""
    from fusionrag.retriever.engine.pq import ProductQuantizer

    g = gen(11 + m)
    postings, q = 1500, 3
    sub = torch.randint(0, 16, (postings, m), generator=g)
    codes = pack4(sub)
    if m % 2:
        codes[:, -1] |= 0xF0  # the unused nibble holds junk: it must not be read
    raw = torch.randint(0, 1 << 32, (postings,), generator=g)
    luts = torch.randn(q, m, 16, generator=g)
    segments = torch.tensor([[[0, 1100], [1200, 1500]], [[5, 5], [0, 3]], [[1400, 1500], [1100, 1200]]])
    cold = torch.tensor([[0, 1], [0, 0], [1, 0]], dtype=torch.int8)
    for tiered in (False, True):
        extra = dict(cold=cold.to(DEVICE), host_ids=as_u32(raw), host_codes=codes.to(DEVICE)) if tiered else {}
        keys, offsets = adc_stream(luts.to(DEVICE), segments.to(DEVICE), as_u32(raw), codes.to(DEVICE), **extra)
        want = adc_stream_reference(luts, segments, as_u32(raw).cpu(), codes,
                                    *((cold, as_u32(raw).cpu(), codes) if tiered else ()))
        ids, dists = unpack_keys(keys.cpu())
        for i, (want_ids, want_dists) in enumerate(want):
            s, e = int(offsets[i]), int(offsets[i + 1])
            assert torch.equal(ids[s:e], want_ids)
            torch.testing.assert_close(dists[s:e], want_dists, rtol=1e-5, atol=1e-5)
            rows = torch.cat([torch.arange(a, b) for a, b in segments[i].tolist()])
            by_hand = luts[i].double().gather(1, sub[rows].T).sum(0).float()
            torch.testing.assert_close(dists[s:e], by_hand, rtol=1e-5, atol=1e-5)
    pq = ProductQuantizer(torch.randn(m, 16, 1, generator=g).numpy(), m)
    x = torch.randn(200, m, generator=g).numpy()
    engine_codes = torch.from_numpy(pq.encode(x))
    assert torch.equal(pack4(torch.from_numpy(pq.sub_codes(engine_codes.numpy()).astype("int64"))), engine_codes)
    with pytest.raises(ValueError, match=f"\\(1500, {(m + 1) // 2}\\)"):
        adc_stream(luts.to(DEVICE), segments.to(DEVICE), as_u32(raw), torch.zeros(postings, m, dtype=torch.uint8,
                                                                                   device=DEVICE))


def test_pq_tables_refuse_bad_input():
    with pytest.raises(ValueError, match="metric"):
        pq_tables(torch.zeros(1, 4, device=DEVICE), torch.zeros(2, 256, 2, device=DEVICE), "cosine")
    with pytest.raises(ValueError, match="do not fit"):
        pq_tables(torch.zeros(1, 9, device=DEVICE), torch.zeros(2, 256, 2, device=DEVICE), "l2")


def check_dedup(ids: torch.Tensor, offsets: torch.Tensor) -> None:
    keep = dedup(ids, offsets).cpu()
    want = dedup_reference(ids, offsets)
    for i, expected in enumerate(want):
        s, e = int(offsets[i]), int(offsets[i + 1])
        kept = ids.cpu()[s:e][keep[s:e]].to(torch.int64) & TOP
        assert torch.equal(torch.sort(kept).values, expected)  # each distinct ID exactly once


def test_dedup_ragged_with_empty_segments_and_top_ids():
    g = gen(1)
    lengths = (7, 0, 300, 1, 0, 129)
    raw = torch.randint(0, 40, (sum(lengths),), generator=g)
    raw[10:60] = TOP  # the top of the range, repeated
    raw[60:70] = TOP - 1
    raw[70:75] = 1 << 31
    raw[-20:] = 0
    check_dedup(as_u32(raw), offsets_of(*lengths))


def test_dedup_all_duplicates_and_empty_inputs():
    check_dedup(as_u32([TOP] * 513), offsets_of(513))
    check_dedup(as_u32([5] * 64 + [TOP] * 64), offsets_of(64, 64))
    assert dedup(as_u32([]), offsets_of(0, 0)).numel() == 0
    assert dedup(as_u32([]), offsets_of()).numel() == 0


def tiered(codes: torch.Tensor, resident: int, seed: int):
    """The codes split as the GPU tier splits them: slots map an ID to a resident or host row."""
    n = len(codes)
    perm = torch.randperm(n, generator=gen(seed))
    hot, cold = perm[:resident], perm[resident:]
    slots = torch.empty(n, dtype=torch.int32)
    slots[hot] = torch.arange(resident, dtype=torch.int32)
    slots[cold] = -1 - torch.arange(n - resident, dtype=torch.int32)
    return dict(codes=codes[hot].contiguous().to(DEVICE), host_codes=codes[cold].contiguous(),
                slots=slots.to(DEVICE))


@pytest.mark.parametrize("placement", ["resident", "tiered", "tiered-all-host"])
@pytest.mark.parametrize("with_exclude", [False, True])
def test_adc_scan_matches_reference(placement, with_exclude):
    g = gen(2)
    n, m = 301, 7
    codes = torch.randint(0, 256, (n, m), generator=g, dtype=torch.uint8)
    luts = torch.randn(5, m, 256, generator=g)
    lengths = (0, 37, 400, 1, 64)
    raw = torch.randint(0, n, (sum(lengths),), generator=g)
    raw[438:502] = n - 1  # a segment of one ID, 64 times
    exclude = None
    if with_exclude:
        exclude = torch.zeros((n + 7) // 8, dtype=torch.uint8)
        exclude[3], exclude[10], exclude[(n - 1) // 8] = 0xFF, 0x55, 1 << ((n - 1) % 8)
    if placement == "resident":
        where = dict(codes=codes.to(DEVICE))
    else:
        where = tiered(codes, 120 if placement == "tiered" else 0, seed=3)
        if DEVICE.type == "cuda":
            where["host_codes"] = where["host_codes"].pin_memory()
    offsets = offsets_of(*lengths)
    on_device = None if exclude is None else exclude.to(DEVICE)
    keys, unique = adc_scan(luts.to(DEVICE), as_u32(raw), offsets, exclude=on_device, **where)
    want = adc_scan_reference(luts, raw, offsets.cpu(), codes, exclude)
    ids, dists = unpack_keys(keys.cpu())
    for i, (want_ids, want_dists) in enumerate(want):
        s, e = int(offsets[i]), int(offsets[i + 1])
        got = ids[s:e] >= 0
        order = torch.argsort(ids[s:e][got])
        assert torch.equal(ids[s:e][got][order], want_ids)
        torch.testing.assert_close(dists[s:e][got][order], want_dists, rtol=1e-5, atol=1e-5)
        assert int(unique[i]) == len(want_ids)
    if with_exclude:
        assert (n - 1) not in ids.tolist()


def test_adc_stream_over_lists_in_posting_order_matches_reference():
    """The experiment bench/gpu/gpu_tier.py measures (kernels/adc_stream.py): codes in posting order, each query's
    probed lists streamed, IDs with the top bit set among them, lists empty and longer than a tile."""
    g = gen(5)
    postings, m, q = 2500, 9, 4
    codes = torch.randint(0, 256, (postings, m), generator=g, dtype=torch.uint8)
    raw = torch.randint(0, 1 << 32, (postings,), generator=g)
    raw[7] = TOP
    luts = torch.randn(q, m, 256, generator=g)
    bounds = [0, 0, 3, 10, 1100, 1101, 2400, 2500]  # lists [b[i], b[i+1]): one empty, one of 1,299
    lists = torch.tensor([[0, 2, 4], [5, 6, 1], [3, 3, 3], [6, 0, 5]])
    b = torch.tensor(bounds)
    segments = torch.stack([b[lists], b[lists + 1]], -1)
    keys, offsets = adc_stream(luts.to(DEVICE), segments.to(DEVICE), as_u32(raw), codes.to(DEVICE))
    want = adc_stream_reference(luts, segments, as_u32(raw).cpu(), codes)
    ids, dists = unpack_keys(keys.cpu())
    assert offsets.tolist() == [0, *torch.cumsum(torch.tensor([len(w[0]) for w in want]), 0).tolist()]
    for i, (want_ids, want_dists) in enumerate(want):
        s, e = int(offsets[i]), int(offsets[i + 1])
        assert torch.equal(ids[s:e], want_ids)  # every posting, repeats too, in probe and posting order
        torch.testing.assert_close(dists[s:e], want_dists, rtol=1e-5, atol=1e-5)
    assert TOP in ids[int(offsets[0]):int(offsets[1])].tolist()  # posting 7, in list 2, which query 0 probes
    with pytest.raises(ValueError, match="ends before it starts"):
        adc_stream(luts.to(DEVICE), segments.flip(-1).to(DEVICE), as_u32(raw), codes.to(DEVICE))


def test_adc_stream_with_cold_lists_in_host_memory_matches_reference():
    """The device tier larger than its budget: a segment flagged cold streams its run from the second (pinned host)
    pair of arrays, the others from the device's; the keys are the reference's over each segment's own arrays."""
    g = gen(6)
    m, q = 7, 3
    hot_codes = torch.randint(0, 256, (1300, m), generator=g, dtype=torch.uint8)
    cold_codes = torch.randint(0, 256, (900, m), generator=g, dtype=torch.uint8)
    hot_ids, cold_ids = torch.randint(0, 1 << 32, (1300,), generator=g), torch.randint(0, 1 << 32, (900,), generator=g)
    cold_ids[5] = TOP
    luts = torch.randn(q, m, 256, generator=g)
    segments = torch.tensor([[[0, 1200], [0, 10], [30, 30]], [[1200, 1300], [10, 900], [0, 0]],
                             [[0, 0], [600, 650], [100, 101]]])
    cold = torch.tensor([[0, 1, 0], [0, 1, 1], [0, 1, 0]], dtype=torch.int8)
    keys, offsets = adc_stream(luts.to(DEVICE), segments.to(DEVICE), as_u32(hot_ids), hot_codes.to(DEVICE),
                               cold=cold.to(DEVICE), host_ids=as_u32(cold_ids), host_codes=cold_codes.to(DEVICE))
    want = adc_stream_reference(luts, segments, as_u32(hot_ids).cpu(), hot_codes, cold, as_u32(cold_ids).cpu(),
                                cold_codes)
    ids, dists = unpack_keys(keys.cpu())
    assert offsets.tolist() == [0, 1210, 2200, 2251]
    for i, (want_ids, want_dists) in enumerate(want):
        s, e = int(offsets[i]), int(offsets[i + 1])
        assert torch.equal(ids[s:e], want_ids)
        torch.testing.assert_close(dists[s:e], want_dists, rtol=1e-5, atol=1e-5)
    assert TOP in ids[1200:1210].tolist()  # query 0's second segment: cold posting 5
    with pytest.raises(ValueError, match="together"):
        adc_stream(luts.to(DEVICE), segments.to(DEVICE), as_u32(hot_ids), hot_codes.to(DEVICE), cold=cold.to(DEVICE))


def test_adc_scan_checks_shapes():
    luts = torch.zeros(2, 4, 256, device=DEVICE)
    with pytest.raises(ValueError, match="q \\+ 1"):
        adc_scan(luts, as_u32([1]), offsets_of(1), torch.zeros(5, 4, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="bytes per vector"):
        adc_scan(luts, as_u32([1]), offsets_of(1, 0), torch.zeros(5, 3, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="both"):
        adc_scan(luts, as_u32([1]), offsets_of(1, 0), torch.zeros(5, 4, dtype=torch.uint8, device=DEVICE),
                 slots=torch.zeros(5, dtype=torch.int32, device=DEVICE))


def test_rank_keys_order_as_distance_then_id():
    d = torch.tensor([1.5, -2.0, 0.0, -0.0, 1.5, float("inf"), -1e-30, 3e38])
    ids = torch.tensor([7, 3, TOP, 2, 1, 0, 5, 6])
    keys = pack_keys(d, ids)
    order = torch.argsort(keys).tolist()
    # -2, -1e-30, then 0 and -0 tie (id 2 before TOP), then 1.5 by id, 3e38, inf.
    assert order == [1, 6, 3, 2, 4, 0, 7, 5]
    back_ids, back_d = unpack_keys(keys)
    assert torch.equal(back_ids, ids)
    assert torch.equal(back_d, torch.where(d == 0, torch.zeros_like(d), d))
    assert int(pack_keys(torch.tensor([1.0]), torch.tensor([-1]))[0]) == EMPTY


@pytest.mark.parametrize("n", [1, 5, 64, 200])
def test_topn_matches_reference(n):
    g = gen(n)
    lengths = (0, 3, 1000, 70, 1, 0, 257)
    total = sum(lengths)
    dists = torch.randn(total, generator=g)
    dists[::5] = 0.25  # ties: broken by ID
    dists[1::9] = -0.0
    dists[2::9] = 0.0
    ids = torch.randint(0, 1 << 32, (total,), generator=g)
    ids[::13] = TOP - torch.arange(len(ids[::13]))
    ids[3::7] = -1  # positions holding no candidate
    offsets = offsets_of(*lengths)
    got_ids, got_dists = topn(pack_keys(dists, ids).to(DEVICE), offsets, n)
    want_ids, want_dists = topn_reference(dists, ids, offsets.cpu(), n)
    assert torch.equal(got_ids.cpu(), want_ids)
    assert torch.equal(got_dists.cpu(), want_dists)


def test_topn_all_duplicates_empty_and_large_n():
    keys = torch.full((300,), EMPTY, dtype=torch.int64)
    keys[17] = pack_keys(torch.tensor([2.0]), torch.tensor([TOP]))[0]
    ids, dists = topn(keys.to(DEVICE), offsets_of(300), 10)
    assert ids.tolist() == [[TOP] + [-1] * 9] and dists[0, 0] == 2.0 and torch.isinf(dists[0, 1:]).all()
    ids, _ = topn(keys.to(DEVICE), offsets_of(0, 0), 3)
    assert ids.tolist() == [[-1] * 3] * 2
    assert topn(keys.to(DEVICE), offsets_of(), 3)[0].shape == (0, 3)
    with pytest.raises(ValueError):
        topn(keys.to(DEVICE), offsets_of(300), 0)
    # n beyond one program's registers: the sorted fallback, same answer.
    g = gen(9)
    d, x = torch.randn(6000, generator=g), torch.randperm(6000, generator=g)
    n = MAX_NP + 100
    got = topn(pack_keys(d, x).to(DEVICE), offsets_of(5000, 1000), n)
    want = topn_reference(d, x, offsets_of(5000, 1000).cpu(), n)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_budget_counts_every_byte_and_names_the_shortfall():
    budget = DeviceBudget(DEVICE, 10_000)
    budget.upload("codebooks", torch.zeros(1000, dtype=torch.float32))  # 4000 bytes
    assert budget.used == 4096 and budget.peak == 4096  # rounded up to the alignment
    with pytest.raises(BudgetError, match="codes needs 8192 bytes and 5904 are left after codebooks"):
        budget.empty("codes", (8000,), torch.uint8)
    assert budget.used == 4096
    with pytest.raises(BudgetError, match="positive"):
        DeviceBudget(DEVICE, 0)


def test_budget_accounts_name_their_parts_and_give_them_back():
    budget = DeviceBudget(DEVICE, 20_000)
    a, b = budget.account("idx"), budget.account("idx")
    assert (a.owner, b.owner) == ("idx", "idx #2") and budget.owners == {"idx", "idx #2"}
    a.empty("codes", (5000,), torch.uint8)
    b.upload("codebooks", torch.zeros(1000, dtype=torch.float32))
    assert budget.used == a.used + b.used == 5120 + 4096 and a.parts == {"codes": 5120}
    with pytest.raises(BudgetError, match=r"left after idx holds 5120 bytes: codes \(5120 bytes\); idx #2 holds 4096"):
        b.empty("codes", (20_000,), torch.uint8)
    with pytest.raises(BudgetError, match="cannot be resized"):
        budget.resize(40_000)
    a.release()
    assert budget.used == 4096 and budget.owners == {"idx #2"} and budget.peak == 9216
    with pytest.raises(BudgetError, match="closed"):
        a.empty("codes", (10,), torch.uint8)
    b.release()
    b.release()  # twice is harmless
    budget.resize(40_000)
    assert budget.used == 0 and budget.budget == 40_000 and budget.peak == 9216


def test_pool_blocks_are_never_shared():
    """Four threads through a pool of two blocks: each writes its own mark into the block it holds,
    yields, and reads the mark back; a block handed to two holders at once shows the other's mark.
    At most two are held at any time, and every block comes back."""
    pool = BlockPool(DeviceBudget(DEVICE, 1 << 20), 2, 4096, 1024)
    lock, holding, most, clashes = threading.Lock(), [0], [0], []

    def worker(mark: int):
        for _ in range(200):
            b = pool.take()
            with lock:
                holding[0] += 1
                most[0] = max(most[0], holding[0])
            b.arena[:8].fill_(mark)
            time.sleep(0)  # let another thread run while the block is held
            if int(b.arena[:8].sum()) != 8 * mark:
                clashes.append(mark)
            with lock:
                holding[0] -= 1
            pool.give(b)

    assert not run_threads(worker, (1, 2, 3, 4))
    assert not clashes and most[0] == 2 and len(pool._free) == 2 and {id(b) for b in pool._free} == {
        id(b) for b in pool.blocks}
    b = pool.take()
    b.reset()
    assert b.device((10,), torch.int64).shape == (10,)
    with pytest.raises(BudgetError, match="working block"):
        b.device((4096,), torch.int64)


def test_kernels_compile_for_a_gpu():
    """Without a GPU the tests above run the interpreter; this compiles the real thing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("kernels_compile.py"))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # kernels_compile.CASES: each variant the GPU tier compiles, both offset widths, and 4-bit codes
    assert out.stdout.count("compiled ") == 21


class _FakeKernel:
    """A kernel that compiles as Triton's JIT does (kernels/variants.compile_all drives Triton's own): inside
    AsyncCompileMode its warmup submits the compile job and returns a future; outside, it compiles at once.
    Each job waits at a barrier of `together` parties, so jobs that do not run at the same time break it."""

    arg_names = ["x_ptr", "BLOCK"]

    def __init__(self, name: str, barrier: threading.Barrier, loaded: list):
        self.__name__, self.barrier, self.loaded, self.compiled = name, barrier, loaded, []

    def warmup(self, *args, grid, num_warps, **constexprs):
        from triton.runtime import _async_compile

        kernel = self

        class Compiled:
            def _init_handles(self):
                kernel.loaded.append((kernel.__name__, constexprs["BLOCK"]))

        def job():
            self.barrier.wait(timeout=30)
            self.compiled.append(constexprs["BLOCK"])
            return Compiled()

        mode = _async_compile.active_mode.get()
        if mode is None:
            return job()
        return mode.submit((self.__name__, constexprs["BLOCK"]), job, lambda k: None)


def test_variants_compile_several_at_a_time_and_all_load():
    loaded = []
    barrier = threading.Barrier(4)
    kernels = [_FakeKernel("a_kernel", barrier, loaded), _FakeKernel("b_kernel", barrier, loaded)]
    vs = [variant(k, ("*fp32",), 4, BLOCK=b) for k in kernels for b in (64, 128)]
    seconds = compile_all(vs, workers=4)  # four jobs at one barrier: run one by one, the first would time out
    assert sorted(loaded) == sorted((v.name, dict(v.constexprs)["BLOCK"]) for v in vs)
    assert [sorted(k.compiled) for k in kernels] == [[64, 128], [64, 128]]
    assert set(seconds) == {"a_kernel", "b_kernel", "all loaded"}
    assert 0 < seconds["a_kernel"] <= seconds["all loaded"] and 0 < seconds["b_kernel"] <= seconds["all loaded"]
    # One at a time (workers=1) they compile in order without the async mode, each loaded once.
    loaded.clear()
    one = threading.Barrier(1)
    k = _FakeKernel("c_kernel", one, loaded)
    assert set(compile_all([variant(k, ("*fp32",), 4, BLOCK=32)], workers=1)) == {"c_kernel"}
    assert loaded == [("c_kernel", 32)] and k.compiled == [32]
