"""De-duplication of gathered candidate IDs with a parallel hash (docs/design.md, step 6 of a query).

Boundary replication puts a vector in up to 8 posting lists, so a query's gathered IDs repeat.
Each query owns a slice of one open-addressing table (a power of two at least twice its ID
count, so linear probing stays short); every lane inserts its ID with a compare-and-swap and
the lane whose CAS fills the empty slot owns the ID. Exactly one position per distinct ID wins,
whichever reaches the table first: the kept set is deterministic, the kept positions are not.

IDs are uint32 carried in int32 tensors (torch has no general uint32); a table slot holds the
ID zero-extended to int64, so every uint32 value, 0xFFFFFFFF included, is a key and -1 is free.

`hash_insert` is shared with the fused scan (adc_scan.py); `dedup` alone serves tests and tools.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FREE = -1
_FREE = tl.constexpr(FREE)  # kernels may read module globals only as constexpr


@triton.jit
def hash_insert(table_ptr, cap, ids, active):
    """Insert uint32 `ids` where `active` into the table of `cap` (a power of two) int64 slots
    at table_ptr; True where this lane's insert was the first of its ID."""
    key = ids.to(tl.int64)
    h = ids * 0x9E3779B1  # Fibonacci hashing: spreads consecutive IDs (lists hold runs of them)
    h = (h ^ (h >> 16)).to(tl.int64)
    step = tl.zeros_like(key)
    pending = active
    won = active & False
    while tl.max(pending.to(tl.int32), 0) > 0:
        slot = (h + step) & (cap - 1)
        # atomic_cas has no mask: idle lanes compare against a value no slot holds, a no-op.
        seen = tl.atomic_cas(table_ptr + slot, tl.where(pending, _FREE, -2).to(tl.int64), key)
        won = won | (pending & (seen == _FREE))
        pending = pending & (seen != _FREE) & (seen != key)
        step += 1
    return won


@triton.jit
def dedup_kernel(ids_ptr, offsets_ptr, table_base_ptr, keep_ptr, table_ptr, BLOCK: tl.constexpr):
    q = tl.program_id(0)
    start = tl.load(offsets_ptr + q)
    end = tl.load(offsets_ptr + q + 1)
    p = start + tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = p < end
    ids = tl.load(ids_ptr + p, mask=inside, other=0).to(tl.uint32, bitcast=True)
    base = tl.load(table_base_ptr + q)
    cap = tl.load(table_base_ptr + q + 1) - base
    won = hash_insert(table_ptr + base, cap, ids, inside)
    tl.store(keep_ptr + p, won.to(tl.int8), mask=inside)


def table_layout(counts: torch.Tensor) -> torch.Tensor:
    """int64 (q + 1,) slice starts of each query's table (last = total slots): next_pow2(2 * count),
    at least 2."""
    caps = torch.clamp(2 * counts.to(torch.int64), min=2)
    caps = torch.exp2(torch.ceil(torch.log2(caps.double()))).to(torch.int64)  # exact below 2^53
    return torch.cat([caps.new_zeros(1), torch.cumsum(caps, 0)])


def dedup(ids: torch.Tensor, offsets: torch.Tensor, block: int = 256) -> torch.Tensor:
    """bool mask: one True position per distinct ID within each segment ids[offsets[i]:offsets[i+1]].
    ids: int32 holding uint32 bits; offsets: int64 (q + 1,)."""
    keep = torch.zeros(ids.shape, dtype=torch.int8, device=ids.device)
    counts = offsets[1:] - offsets[:-1]
    q = counts.numel()
    if q == 0 or ids.numel() == 0:
        return keep.bool()
    bases = table_layout(counts)
    table = torch.full((int(bases[-1]),), FREE, dtype=torch.int64, device=ids.device)
    grid = (q, triton.cdiv(int(counts.max()), block))
    dedup_kernel[grid](ids, offsets, bases, keep, table, BLOCK=block)
    return keep.bool()


def dedup_reference(ids: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor]:
    """Plain PyTorch: the sorted distinct IDs (int64) of each segment."""
    u = ids.cpu().to(torch.int64) & 0xFFFFFFFF
    return [torch.unique(u[int(offsets[i]):int(offsets[i + 1])]) for i in range(offsets.numel() - 1)]
