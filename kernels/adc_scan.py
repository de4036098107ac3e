"""ADC scan fused with de-duplication (docs/design.md, step 6 of a query, middle part).

For each query's segment of gathered IDs: insert every ID into the query's hash table
(dedup.py); the lane that owns an ID reads its M-byte PQ code, sums the M table entries the
code selects (asymmetric distance computation) and writes the candidate's rank key (topn.py);
duplicate, excluded and out-of-segment lanes write EMPTY.

Why fused: the owning lane already holds the ID in a register, so it reads the code at once.
Unfused, dedup would write a compacted ID list (and need a prefix sum to place it) that the scan
reads back: two more passes over the candidates and a launch, for a kernel bound by memory
traffic. Keys keep their gathered positions instead of being compacted; top-n (topn.py) skips
EMPTY keys at 8 bytes each, cheaper than compacting.

Codes live in one of two places. Resident: codes[id] in GPU memory. Tiered (the budget does not
hold every code): slots[id] >= 0 is a row of the resident table, slots[id] < 0 is row -slot-1 of
a table in pinned host memory that the GPU reads over PCIe without a copy (zero-copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusionrag.kernels import interpreted
from fusionrag.kernels.dedup import FREE, hash_insert, table_layout
from fusionrag.kernels.topn import EMPTY_KEY, pack_key
from fusionrag.kernels.variants import Variant, variant


@triton.jit
def adc_scan_kernel(ids_ptr, offsets_ptr, table_base_ptr, table_ptr, luts_ptr, codes_ptr, host_codes_ptr, slots_ptr,
                    exclude_ptr, keys_ptr, unique_ptr, M: tl.constexpr, M_P2: tl.constexpr, BLOCK: tl.constexpr,
                    TIERED: tl.constexpr, EXCLUDE: tl.constexpr):
    q = tl.program_id(0)
    start = tl.load(offsets_ptr + q)
    end = tl.load(offsets_ptr + q + 1)
    p = start + tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = p < end
    ids = tl.load(ids_ptr + p, mask=inside, other=0).to(tl.uint32, bitcast=True)
    id64 = ids.to(tl.int64)
    live = inside
    if EXCLUDE:  # a bitmap, bit i of byte i // 8 (little-endian bit order) set = left out
        byte = tl.load(exclude_ptr + (id64 >> 3), mask=inside, other=0).to(tl.int32)
        live = live & (((byte >> (id64 & 7).to(tl.int32)) & 1) == 0)
    base = tl.load(table_base_ptr + q)
    own = hash_insert(table_ptr + base, tl.load(table_base_ptr + q + 1) - base, ids, live)

    m = tl.arange(0, M_P2)
    cols = own[:, None] & (m[None, :] < M)
    if TIERED:
        slot = tl.load(slots_ptr + id64, mask=own, other=0).to(tl.int64)
        near = slot >= 0
        row = tl.where(near, slot, -slot - 1) * M
        rows = tl.where(near, codes_ptr + row, host_codes_ptr + row)  # a pointer per lane, either memory
        code = tl.load(rows[:, None] + m[None, :], mask=cols, other=0)
    else:
        code = tl.load(codes_ptr + id64[:, None] * M + m[None, :], mask=cols, other=0)
    lut = luts_ptr + q.to(tl.int64) * M * 256 + m[None, :] * 256
    dist = tl.sum(tl.load(lut + code.to(tl.int32), mask=cols, other=0.0), axis=1)
    tl.store(keys_ptr + p, tl.where(own, pack_key(dist, id64), EMPTY_KEY), mask=inside)
    tl.atomic_add(unique_ptr + q, tl.sum(own.to(tl.int64), 0))


def adc_scan(luts: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor,
             host_codes: torch.Tensor | None = None, slots: torch.Tensor | None = None,
             exclude: torch.Tensor | None = None, *, table: torch.Tensor | None = None,
             table_base: torch.Tensor | None = None, keys: torch.Tensor | None = None,
             unique: torch.Tensor | None = None, max_count: int | None = None):
    """Rank keys int64 (len(ids),) and unique-ID counts int64 (q,) of ragged segments
    ids[offsets[i]:offsets[i+1]] (int32 holding uint32 IDs) against luts float32 (q, M, 256).

    codes: uint8 (rows, M); tiered when slots (int32 (N,)) and host_codes are given.
    exclude: uint8 bitmap (ceil(N/8),). Working buffers (table: int64 (table_base[-1],) all FREE,
    table_base from dedup.table_layout, keys, unique zeroed) may be given as views into a
    preallocated block, with max_count the longest segment; otherwise they are allocated here.
    A program takes 128 IDs (under the interpreter, whole segments up to 4096).
    """
    q, m = luts.shape[0], luts.shape[1]
    if offsets.numel() != q + 1:
        raise ValueError(f"offsets must hold q + 1 = {q + 1} entries, got {offsets.numel()}")
    if codes.shape[1] != m:
        raise ValueError(f"codes have {codes.shape[1]} bytes per vector, the tables {m} sub-spaces")
    if (slots is None) != (host_codes is None):
        raise ValueError("tiered codes need both slots and host_codes")
    dev = ids.device
    if table_base is None:
        counts = offsets[1:] - offsets[:-1]
        max_count = int(counts.max()) if q else 0
        table_base = table_layout(counts)
        table = torch.full((int(table_base[-1]),), FREE, dtype=torch.int64, device=dev)
        keys = torch.empty(ids.shape, dtype=torch.int64, device=dev)
        unique = torch.zeros(q, dtype=torch.int64, device=dev)
    if q and max_count:
        tiered = slots is not None
        params = _params(m, max_count, tiered, exclude is not None, interpreted())
        adc_scan_kernel[(q, triton.cdiv(max_count, params["BLOCK"]))](
            ids, offsets, table_base, table, luts, codes, host_codes if tiered else codes, slots if tiered else ids,
            exclude if exclude is not None else ids, keys, unique, **params)
    return keys, unique


def _params(m: int, max_count: int, tiered: bool, exclude: bool, interpret: bool) -> dict:
    block = min(4096, triton.next_power_of_2(max_count)) if interpret else 128
    return dict(M=m, M_P2=triton.next_power_of_2(m), BLOCK=block, TIERED=tiered, EXCLUDE=exclude, num_warps=4)


def variants(m: int, tiered: bool) -> list[Variant]:
    """What adc_scan compiles on a GPU for M-byte codes, resident or tiered: with and without an
    exclusion bitmap (without one, the IDs stand in for its pointer: an int32 pointer)."""
    out = []
    for exclude in (False, True):
        params = _params(m, 1, tiered, exclude, interpret=False)
        signature = ("*i32", "*i64", "*i64", "*i64", "*fp32", "*u8", "*u8", "*i32", "*u8" if exclude else "*i32",
                     "*i64", "*i64")
        out.append(variant(adc_scan_kernel, signature, params.pop("num_warps"), **params))
    return out


def adc_scan_reference(luts: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor,
                       exclude: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Plain PyTorch: per segment, (distinct live IDs ascending int64, their ADC distances float32)."""
    luts, codes = luts.cpu().double(), codes.cpu().long()
    out = []
    for i in range(offsets.numel() - 1):
        u = torch.unique(ids[int(offsets[i]):int(offsets[i + 1])].cpu().long() & 0xFFFFFFFF)
        if exclude is not None:
            bits = (exclude.cpu().long()[u >> 3] >> (u & 7)) & 1
            u = u[bits == 0]
        d = luts[i].gather(1, codes[u].T).sum(0) if len(u) else torch.zeros(0, dtype=torch.float64)
        out.append((u, d.float()))
    return out
