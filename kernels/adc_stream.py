"""The device tier's ADC scan (retriever/engine/device_tier.py): codes laid out in posting-list order, each query's
probed lists streamed. bench/gpu/gpu_tier.py also measures it alone (`scan_stream`).

The lists tier's scan (adc_scan.py) takes each query's gathered vector IDs and reads each ID's code from a table
indexed by ID: a random 32-64-byte read per candidate, and on the H100 it moved 9-11% of the device's copy
bandwidth (docs/gpu.md). Laid out as IVF indexes usually are, every posting's code stored in its list's
order (a vector with replicas in several lists stored once per list), a query's probed lists are contiguous
runs: the scan streams them, and the host sends each query's list numbers instead of its gathered IDs.
Replicas go to top-n as repeats (equal keys), which drops them there.

One program per (query, probed list): it walks the list's postings in tiles of BLOCK, reads their codes
and IDs contiguously, sums the table entries each code selects, and writes rank keys (topn.pack_key) at the
segment's place in the query's output.

Offsets (#70): the segments' positions are int32 where an index's postings fit (below 2^31: every index up to a
few hundred million vectors) and int64 past that (device_tier.py picks per index at open); a code's byte address is
computed in int64 either way, since it passes 2^31 from 2^31 / M postings on. Vector IDs stay uint32 (4 bytes a
posting) up to 2^32 - 1 vectors.

4-bit codes (BuildConfig.pq_bits 4): M sub-spaces of 16 centroids, two a byte (sub-space 2b in byte b's low
nibble, 2b + 1 in its high one, as retriever/engine/pq.py packs them), their tables 16 entries a sub-space. A lane
reads its sub-space's byte and shifts its nibble out: the same program, half the bytes a posting read.

Tiered (TIERED): where not every list's postings fit the device, the cold lists' IDs and codes lie in pinned host
memory, in list order too, and a segment flagged cold streams them from there over the bus (zero-copy, as the
lists tier reads its cold codes): a list is one contiguous run in one of the two memories.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusionrag.kernels import interpreted
from fusionrag.kernels.pq_table import KSUBS
from fusionrag.kernels.topn import pack_key
from fusionrag.kernels.variants import Variant, variant


@triton.jit(do_not_specialize=["nprobe"])
def adc_stream_kernel(segments_ptr, out_ptr, list_ids_ptr, codes_ptr, luts_ptr, keys_ptr, cold_ptr, host_ids_ptr,
                      host_codes_ptr, nprobe, M: tl.constexpr, M_P2: tl.constexpr, BLOCK: tl.constexpr,
                      TIERED: tl.constexpr, KSUB: tl.constexpr, CODE_BYTES: tl.constexpr):
    pid = tl.program_id(0)
    q = pid // nprobe
    start = tl.load(segments_ptr + 2 * pid)
    end = tl.load(segments_ptr + 2 * pid + 1)
    first = tl.load(out_ptr + pid)  # where this segment's keys start in keys
    m = tl.arange(0, M_P2)
    lut = luts_ptr + q.to(tl.int64) * M * KSUB + m[None, :] * KSUB
    if KSUB == 16:  # 4-bit codes: sub-space m in byte m // 2, its nibble (m % 2)
        byte = m // 2
        shift = (m % 2) * 4
    else:
        byte = m
    if TIERED:
        cold = tl.load(cold_ptr + pid) != 0  # the list's run lies in pinned host memory
    for tile in range(start, end, BLOCK):
        p = tile + tl.arange(0, BLOCK)
        inside = p < end
        cols = inside[:, None] & (m[None, :] < M)
        at = p.to(tl.int64)[:, None] * CODE_BYTES + byte[None, :]  # past 2^31 from 2^31 / M postings on
        if TIERED:
            code = tl.load(tl.where(cold, host_codes_ptr + at, codes_ptr + at), mask=cols, other=0)
            raw = tl.load(tl.where(cold, host_ids_ptr + p, list_ids_ptr + p), mask=inside, other=0)
        else:
            code = tl.load(codes_ptr + at, mask=cols, other=0)
            raw = tl.load(list_ids_ptr + p, mask=inside, other=0)
        code = code.to(tl.int32)
        if KSUB == 16:
            code = (code >> shift[None, :]) & 15
        dist = tl.sum(tl.load(lut + code, mask=cols, other=0.0), axis=1)
        ids = raw.to(tl.uint32, bitcast=True).to(tl.int64)
        tl.store(keys_ptr + first + (p - start), pack_key(dist, ids), mask=inside)


def adc_stream(luts: torch.Tensor, segments: torch.Tensor, list_ids: torch.Tensor, codes: torch.Tensor,
               keys: torch.Tensor | None = None, cold: torch.Tensor | None = None,
               host_ids: torch.Tensor | None = None, host_codes: torch.Tensor | None = None,
               total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank keys of every posting in each query's probed lists. luts float32 (q, M, 256), or (q, M, 16) for 4-bit
    codes; segments int64 or int32 (q, nprobe, 2): [start, end) of each probed list in posting order (start == end:
    none); list_ids int32 (P,) holding uint32 vector IDs and codes uint8 (P, M), or (P, ceil(M / 2)) two 4-bit
    codes a byte, both in posting order. Tiered where cold (int8
    (q, nprobe), nonzero: the segment's run is in host_ids / host_codes, pinned host memory laid out as list_ids
    and codes) is given. Returns (keys int64, offsets int64 (q + 1,)): query i's keys are
    keys[offsets[i]:offsets[i + 1]], its segments' in probe order. total: the segments' postings, where the caller
    knows them (device_tier: from the sizes it planned the batch's chunks by); else they are read from the device
    (a sync), with a check that no segment ends before it starts (another)."""
    q, m, ksub = luts.shape
    if ksub not in KSUBS:
        raise ValueError(f"tables must have 256 or 16 entries a sub-space, got {ksub}")
    width = code_bytes(m, ksub)
    if segments.shape[:1] != (q,) or segments.dim() != 3 or segments.shape[2] != 2:
        raise ValueError(f"segments must be ({q}, nprobe, 2), got {tuple(segments.shape)}")
    if codes.shape != (list_ids.numel(), width):
        raise ValueError(f"codes must be ({list_ids.numel()}, {width}), got {tuple(codes.shape)}")
    tiered = cold is not None
    if tiered != (host_ids is not None) or tiered != (host_codes is not None):
        raise ValueError("tiered postings need cold, host_ids and host_codes together")
    if tiered:
        if cold.shape != segments.shape[:2]:
            raise ValueError(f"cold must be {tuple(segments.shape[:2])}, got {tuple(cold.shape)}")
        if host_codes.shape != (host_ids.numel(), width):
            raise ValueError(f"host_codes must be ({host_ids.numel()}, {width}), got {tuple(host_codes.shape)}")
    nprobe = segments.shape[1]
    lengths = (segments[..., 1] - segments[..., 0]).reshape(-1)
    if total is None and bool((lengths < 0).any()):
        raise ValueError("a segment ends before it starts")
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=luts.device)
    torch.cumsum(lengths, 0, out=out[1:])
    if total is None:
        total = int(out[-1])
    if keys is None:
        keys = torch.empty(total, dtype=torch.int64, device=luts.device)
    if q and nprobe and total:
        params = _params(m, interpreted(), tiered, ksub)
        where = (cold.to(torch.int8).contiguous(), host_ids, host_codes) if tiered else \
            (segments.new_zeros(1, dtype=torch.int8), list_ids, codes)  # unread: TIERED is off
        adc_stream_kernel[(q * nprobe,)](segments.contiguous(), out, list_ids, codes, luts, keys, *where, nprobe,
                                         **params)
    return keys, out[::nprobe].contiguous()


def code_bytes(m: int, ksub: int) -> int:
    """Bytes of a posting's code of m sub-spaces of ksub centroids (retriever/engine/pq.py's rule)."""
    return m if ksub == 256 else (m + 1) // 2


def _params(m: int, interpret: bool, tiered: bool = False, ksub: int = 256) -> dict:
    return dict(M=m, M_P2=triton.next_power_of_2(m), BLOCK=1024 if interpret else 128, TIERED=tiered, KSUB=ksub,
                CODE_BYTES=code_bytes(m, ksub), num_warps=4)


def variants(m: int, tiered: bool = False, wide: bool = True, ksub: int = 256) -> list[Variant]:
    """What adc_stream compiles on a GPU for codes of M sub-spaces of ksub centroids (kernels_compile.py builds it
    for sm_90); wide: the segments int64 (else int32)."""
    params = _params(m, interpret=False, tiered=tiered, ksub=ksub)
    signature = ("*i64" if wide else "*i32", "*i64", "*i32", "*u8", "*fp32", "*i64", "*i8", "*i32", "*u8", "i32")
    return [variant(adc_stream_kernel, signature, params.pop("num_warps"), **params)]


def adc_stream_reference(luts: torch.Tensor, segments: torch.Tensor, list_ids: torch.Tensor,
                         codes: torch.Tensor, cold: torch.Tensor | None = None, host_ids: torch.Tensor | None = None,
                         host_codes: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Plain PyTorch: per query, (vector IDs int64, ADC distances float32) of its segments' postings in order."""
    luts, segments = luts.cpu().double(), segments.cpu()
    m, ksub = luts.shape[1], luts.shape[2]

    def sub_codes(c: torch.Tensor) -> torch.Tensor:  # (P, M) centroid numbers
        c = c.cpu().long()
        return c if ksub == 256 else torch.stack([c & 15, c >> 4], dim=2).reshape(len(c), -1)[:, :m]

    parts = [(list_ids.cpu().long() & 0xFFFFFFFF, sub_codes(codes))]
    if cold is not None:
        parts.append((host_ids.cpu().long() & 0xFFFFFFFF, sub_codes(host_codes)))
    out = []
    for i in range(luts.shape[0]):
        ids, d = [], []
        for j, (s, e) in enumerate(segments[i].tolist()):
            where_ids, where_codes = parts[int(cold[i, j] != 0) if cold is not None else 0]
            rows = torch.arange(s, e)
            ids.append(where_ids[rows])
            d.append(luts[i].gather(1, where_codes[rows].T).sum(0) if len(rows) else
                     torch.zeros(0, dtype=torch.float64))
        out.append((torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64),
                    torch.cat(d).float() if d else torch.zeros(0)))
    return out
