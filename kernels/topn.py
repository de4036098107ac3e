"""Top-n per query over a ragged batch of rank keys (docs/design.md, step 6 of a query, last part).

A candidate travels as one int64 rank key: its PQ distance's bits in the high half, mapped so
that signed integer order is float order, and its uint32 vector ID in the low half. Comparing
keys compares (distance, id), which is the CPU tier's order and tie rule (native/scan.cpp), so
both tiers pick the same candidates. `EMPTY` (int64 max) marks a position holding no candidate
(a duplicate, an excluded ID, padding) and sorts after every real key.

One program per query walks its segment in tiles, keeping the NP >= n (a power of four) smallest
keys seen so far sorted in registers. A tile is cut to its NP smallest by bitonic top-k (sort
runs of NP, then halve by element-wise minimum of opposite runs and merge, Shanbhag et al.
2018), and the buffer takes the element-wise minimum of itself and that run and merges again.
n beyond one program's registers (4096) goes in rounds of 4096, each taking the keys after the
last one the previous round kept (a segment's keys are distinct: the scan keeps each ID once): no
sort outside the kernel, and nothing allocated.

Selection is not fused into the scan kernel (adc_scan.py): it needs a whole segment in one program, and the scan spreads a segment over
many programs, which matters when a batch has few queries with many candidates each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _elementwise_min

from fusionrag.kernels.variants import Variant, variant

EMPTY = (1 << 63) - 1
EMPTY_KEY = tl.constexpr(EMPTY)  # kernels may read module globals only as constexpr
BEFORE_ALL = -(1 << 63)  # a round bound below every key
# NP bounds: tiles shorter than 64 keys waste the launch; above 4096 keys one program's registers
# spill, and selection goes in rounds. NP and the tile are powers of four: each (tile, NP) pair is
# a kernel compiled when an index opens (variants), and this keeps them to seven.
MIN_NP, MAX_NP = 64, 4096


@triton.jit
def pack_key(dist, ids):
    """float32 distances and int64 IDs in [0, 2^32) -> int64 keys ordered by (distance, id)."""
    d = tl.where(dist == 0.0, 0.0, dist)  # -0 and +0 must tie
    bits = d.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (bits.to(tl.int64) << 32) | ids


@triton.jit
def _smallest(x, LT: tl.constexpr, LOG: tl.constexpr):
    """The 2^LOG smallest of 2^LT keys, descending (bitonic top-k). The keys are held as a
    [2] * LT hypercube, so a compare-exchange of the keys whose indices differ in one bit is a
    min and a max over one axis. Not tl.sort: its xor-reduction runs element by element in
    Triton's interpreter (a second per 256 keys), and jit helpers cost a language patch per
    call there, so the exchange is written inline with the bare reductions, handed to numpy."""
    h = tl.reshape(x, [2] * LT)
    idx = tl.reshape(tl.arange(0, 2**LT), [2] * LT)
    # Sort runs of 2^LOG keys, runs alternately ascending and descending (one run: descending).
    # (Index bit b is hypercube axis LT-1-b. Expressions stay inline: a constexpr assigned to a
    # local stops being one in compiled code.)
    for stage in tl.static_range(1, LOG + 1):
        desc = (idx >> stage) & 1 if stage < LT else idx * 0 + 1
        for i in tl.static_range(stage):  # bit stage-1-i
            lo = tl.reduce(h, LT - stage + i, _elementwise_min, keep_dims=True)
            hi = tl.reduce(h, LT - stage + i, _elementwise_max, keep_dims=True)
            h = tl.where((((idx >> (stage - 1 - i)) & 1) ^ desc) != 0, hi, lo)
    # Halve: the element-wise min of an ascending and a descending run is a bitonic run holding
    # the 2^LOG smallest of both; merge it, again alternating, until one run is left.
    for r in tl.static_range(LT - LOG):  # LT-r-1 dimensions after the halving
        h = tl.reduce(h, LT - r - 1 - LOG, _elementwise_min)
        idx = tl.reshape(tl.arange(0, 2 ** (LT - r - 1)), [2] * (LT - r - 1))
        desc = (idx >> LOG) & 1 if LOG < LT - r - 1 else idx * 0 + 1
        for i in tl.static_range(LOG):  # bit LOG-1-i
            lo = tl.reduce(h, LT - r - 1 - LOG + i, _elementwise_min, keep_dims=True)
            hi = tl.reduce(h, LT - r - 1 - LOG + i, _elementwise_max, keep_dims=True)
            h = tl.where((((idx >> (LOG - 1 - i)) & 1) ^ desc) != 0, hi, lo)
    return tl.reshape(h, [2**LOG])


@triton.jit(do_not_specialize=["n", "stride"])
def topn_kernel(keys_ptr, offsets_ptr, after_ptr, out_ids_ptr, out_dists_ptr, n, stride, LT: tl.constexpr,
                LOG: tl.constexpr):
    q = tl.program_id(0)
    start = tl.load(offsets_ptr + q)
    end = tl.load(offsets_ptr + q + 1)
    after = tl.load(after_ptr + q)  # keys up to this one went to an earlier round
    lane = tl.arange(0, 2**LOG)
    idx = tl.reshape(lane, [2] * LOG)
    best = tl.reshape(tl.full([2**LOG], EMPTY_KEY, tl.int64), [2] * LOG)  # ascending
    for tile in range(start, end, 2**LT):
        p = tile + tl.arange(0, 2**LT)
        x = tl.load(keys_ptr + p, mask=p < end, other=EMPTY_KEY)
        x = _smallest(tl.where(x > after, x, EMPTY_KEY), LT, LOG)
        # best ascending, x descending: their element-wise min is bitonic; merge it ascending.
        h = tl.minimum(best, tl.reshape(x, [2] * LOG))
        for i in tl.static_range(LOG):  # bit LOG-1-i
            lo = tl.reduce(h, i, _elementwise_min, keep_dims=True)
            hi = tl.reduce(h, i, _elementwise_max, keep_dims=True)
            h = tl.where(((idx >> (LOG - 1 - i)) & 1) != 0, hi, lo)
        best = h
    best = tl.reshape(best, [2**LOG])
    tl.store(after_ptr + q, tl.max(tl.where(lane < n, best, after), 0))  # the next round's bound
    found = best != EMPTY_KEY
    bits = (best >> 32).to(tl.int32)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    dists = tl.where(found, bits.to(tl.float32, bitcast=True), float("inf"))
    ids = tl.where(found, best & 0xFFFFFFFF, -1)
    out = q.to(tl.int64) * stride + lane
    tl.store(out_ids_ptr + out, ids, mask=lane < n)
    tl.store(out_dists_ptr + out, dists, mask=lane < n)


def pack_keys(dists: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Torch twin of `pack_key`; ids < 0 give EMPTY."""
    d = torch.where(dists == 0, torch.zeros_like(dists), dists).to(torch.float32)
    bits = d.view(torch.int32)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    keys = (bits << 32) | (ids.to(torch.int64) & 0xFFFFFFFF)
    return torch.where(ids < 0, torch.full_like(keys, EMPTY), keys)


def unpack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 with -1 for EMPTY, distances float32 with inf for EMPTY)."""
    found = keys != EMPTY
    bits = (keys >> 32).to(torch.int32)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    dists = torch.where(found, bits.view(torch.float32), torch.full_like(bits, float("inf"), dtype=torch.float32))
    return torch.where(found, keys & 0xFFFFFFFF, torch.full_like(keys, -1)), dists


def topn(keys: torch.Tensor, offsets: torch.Tensor, n: int, out_ids: torch.Tensor | None = None,
         out_dists: torch.Tensor | None = None, max_count: int | None = None,
         after: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per segment keys[offsets[i]:offsets[i+1]], the n smallest keys decoded, ascending:
    (ids int64 (q, n), -1 padded; dists float32 (q, n), inf padded). out_* and after (int64
    (q,), the rounds' bounds) may be given (views into a working block) so that nothing is
    allocated, and max_count (the longest segment) so that nothing is read back from the device."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    q = offsets.numel() - 1
    if out_ids is None:
        out_ids = torch.empty((q, n), dtype=torch.int64, device=keys.device)
        out_dists = torch.empty((q, n), dtype=torch.float32, device=keys.device)
    if q == 0:
        return out_ids, out_dists
    if max_count is None:
        max_count = int((offsets[1:] - offsets[:-1]).max())
    if after is None:
        after = torch.empty(q, dtype=torch.int64, device=keys.device)
    after.fill_(BEFORE_ALL)
    for first in range(0, n, MAX_NP):
        width = min(MAX_NP, n - first)
        params = _params(width, max_count)
        topn_kernel[(q,)](keys, offsets, after, out_ids[:, first:], out_dists[:, first:], width, n, **params)
    return out_ids, out_dists


def _params(n: int, max_count: int) -> dict:
    """NP: the power of four >= n (at least MIN_NP); the tile: NP when every segment fits in one,
    else MAX_NP keys, which go into each halving round with fewer merges per key than tiles of NP."""
    log = max(MIN_NP, triton.next_power_of_2(n)).bit_length() - 1
    log += log % 2
    lt = log if max_count <= 1 << log else MAX_NP.bit_length() - 1
    return dict(LT=lt, LOG=log, num_warps=4 if lt <= 10 else 8)


def variants() -> list[Variant]:
    """What topn compiles on a GPU: every (tile, NP) pair _params can pick."""
    signature = ("*i64", "*i64", "*i64", "*i64", "*fp32", "i32", "i32")
    out = []
    for n in (MIN_NP, 256, 1024, MAX_NP):
        for max_count in (1, MAX_NP + 1):
            params = _params(n, max_count)
            v = variant(topn_kernel, signature, params.pop("num_warps"), **params)
            if v not in out:
                out.append(v)
    return out


def topn_reference(dists: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, n: int):
    """Plain PyTorch: per segment, the candidates with id >= 0 ordered by (distance, id), first n."""
    q = offsets.numel() - 1
    out_ids = torch.full((q, n), -1, dtype=torch.int64)
    out_dists = torch.full((q, n), float("inf"), dtype=torch.float32)
    for i in range(q):
        s, e = int(offsets[i]), int(offsets[i + 1])
        d, x = dists[s:e].cpu().float(), ids[s:e].cpu().long()
        keep = x >= 0
        d, x = d[keep], x[keep]
        d = torch.where(d == 0, torch.zeros_like(d), d)
        by_id = torch.sort(x, stable=True).indices
        order = by_id[torch.sort(d[by_id], stable=True).indices][:n]
        out_ids[i, : len(order)] = x[order]
        out_dists[i, : len(order)] = d[order]
    return out_ids, out_dists
