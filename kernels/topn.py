"""Top-n per query over a ragged batch of rank keys (step 5 of DESIGN.md, last part).

A candidate travels as one int64 rank key: its PQ distance's bits in the high half, mapped so
that signed integer order is float order, and its uint32 vector ID in the low half. Comparing
keys compares (distance, id), which is the CPU tier's order and tie rule (native/scan.cpp), so
both tiers pick the same candidates. `EMPTY` (int64 max) marks a position holding no candidate
(a duplicate, an excluded ID, padding) and sorts after every real key.

One program per query walks its segment in tiles of NP >= n keys (a power of two), keeping the n
smallest seen so far sorted in registers: sort the tile, take the element-wise minimum of the
buffer and the tile sorted the other way (a bitonic sequence holding the NP smallest of both, the bitonic
top-k step) and merge it back into order. Selection is not fused into the scan kernel
(adc_scan.py): it needs a whole segment in one program, and the scan spreads a segment over
many programs, which matters when a batch has few queries with many candidates each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
# tl.bitonic_merge itself fails under TRITON_INTERPRET in triton 3.7 (a reshape by x.shape);
# its hypercube step with explicit shapes works in both modes.
from triton.language.standard import _bitonic_merge_hypercube

EMPTY = (1 << 63) - 1
# NP bounds: tiles shorter than 64 keys waste the launch; above 4096 keys one program's
# registers spill, and selection falls back to a torch sort.
MIN_NP, MAX_NP = 64, 4096


@triton.jit
def pack_key(dist, ids):
    """float32 distances and int64 IDs in [0, 2^32) -> int64 keys ordered by (distance, id)."""
    d = tl.where(dist == 0.0, 0.0, dist)  # -0 and +0 must tie
    bits = d.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (bits.to(tl.int64) << 32) | ids


@triton.jit
def _merge_ascending(x, NP: tl.constexpr, LOG: tl.constexpr):
    """A bitonic sequence of NP = 2^LOG keys into ascending order."""
    return tl.reshape(_bitonic_merge_hypercube(tl.reshape(x, [2] * LOG), LOG, 0), [NP])


@triton.jit
def topn_kernel(keys_ptr, offsets_ptr, out_ids_ptr, out_dists_ptr, n, NP: tl.constexpr, LOG: tl.constexpr):
    q = tl.program_id(0)
    start = tl.load(offsets_ptr + q)
    end = tl.load(offsets_ptr + q + 1)
    lane = tl.arange(0, NP)
    best = tl.full([NP], EMPTY, tl.int64)
    for tile in range(start, end, NP):
        p = tile + lane
        x = tl.sort(tl.load(keys_ptr + p, mask=p < end, other=EMPTY), descending=True)
        best = _merge_ascending(tl.minimum(best, x), NP, LOG)
    found = best != EMPTY
    bits = (best >> 32).to(tl.int32)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    dists = tl.where(found, bits.to(tl.float32, bitcast=True), float("inf"))
    ids = tl.where(found, best & 0xFFFFFFFF, -1)
    out = q.to(tl.int64) * n + lane
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
         out_dists: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per segment keys[offsets[i]:offsets[i+1]], the n smallest keys decoded, ascending:
    (ids int64 (q, n), -1 padded; dists float32 (q, n), inf padded). out_* may be given
    (views into a working block) so that nothing is allocated."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    q = offsets.numel() - 1
    if out_ids is None:
        out_ids = torch.empty((q, n), dtype=torch.int64, device=keys.device)
        out_dists = torch.empty((q, n), dtype=torch.float32, device=keys.device)
    if q == 0:
        return out_ids, out_dists
    np_ = max(MIN_NP, triton.next_power_of_2(n))
    if np_ > MAX_NP:
        ids, dists = _topn_sorted(keys, offsets, n)
        out_ids.copy_(ids)
        out_dists.copy_(dists)
        return out_ids, out_dists
    topn_kernel[(q,)](keys, offsets, out_ids, out_dists, n, NP=np_, LOG=np_.bit_length() - 1, num_warps=4 if np_ <= 1024 else 8)
    return out_ids, out_dists


def _topn_sorted(keys: torch.Tensor, offsets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Large n: a padded (q, longest segment) matrix sorted by torch; allocates."""
    off = offsets.to(torch.int64)
    counts = off[1:] - off[:-1]
    q, width = counts.numel(), max(int(counts.max()) if counts.numel() else 0, n)
    grid = torch.full((q, width), EMPTY, dtype=torch.int64, device=keys.device)
    col = torch.arange(width, device=keys.device)
    inside = col[None, :] < counts[:, None]
    grid[inside] = keys[(off[:-1, None] + col[None, :])[inside]]
    return unpack_keys(torch.sort(grid, dim=1).values[:, :n])


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
