"""PQ distance lookup tables for a batch of queries (docs/design.md, step 6 of a query, first part).

For query q and sub-space m the table holds the distance from q's m-th slice to each of the
256 sub-centroids (16 for 4-bit codes, BuildConfig.pq_bits 4): squared L2 ('l2') or negative inner
product ('ip'). One program computes one (query, sub-space) row of KSUB entries from a [KSUB, dsub]
tile of the codebook. L2 uses
|x|^2 - 2<x, c> + |c|^2, the formula of the CPU reference (retriever/engine/pq.py), so both tiers see
the same tables up to rounding.

The tables stay in GPU memory for the scan (adc_scan.py, adc_stream.py): q x M x 1 KiB (64 bytes for
4-bit codes), where copying the host's tables would cross PCIe again for every batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusionrag.kernels import interpreted
from fusionrag.kernels.variants import Variant, variant

KSUB = 256
KSUBS = (256, 16)  # centroids a sub-space: 8-bit codes, 4-bit codes


@triton.jit(do_not_specialize=["dim"])
def pq_table_kernel(queries_ptr, codebooks_ptr, out_ptr, dim, M: tl.constexpr, DSUB: tl.constexpr,
                    DSUB_P2: tl.constexpr, SUBS: tl.constexpr, IP: tl.constexpr, KSUB: tl.constexpr):
    q = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * SUBS + tl.arange(0, SUBS)[:, None, None]  # [SUBS, 1, 1]
    k = tl.arange(0, KSUB)[None, :, None]
    d = tl.arange(0, DSUB_P2)[None, None, :]
    col = m * DSUB + d
    # The query is zero-padded to M * DSUB dimensions, like the codebooks were trained.
    x = tl.load(queries_ptr + q * dim + col, mask=(m < M) & (d < DSUB) & (col < dim), other=0.0)
    c = tl.load(codebooks_ptr + (m * KSUB + k) * DSUB + d, mask=(m < M) & (d < DSUB), other=0.0)
    dot = tl.sum(c * x, axis=2)
    if IP:
        rows = -dot
    else:
        rows = tl.sum(x * x, axis=2) - 2 * dot + tl.sum(c * c, axis=2)
    m2 = tl.reshape(m, [SUBS, 1])
    tl.store(out_ptr + (q * M + m2) * KSUB + tl.arange(0, KSUB)[None, :], rows, mask=m2 < M)


def pq_tables(queries: torch.Tensor, codebooks: torch.Tensor, metric: str,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 (q, M, ksub) tables of float32 queries (q, dim) against codebooks (M, ksub, dsub), ksub 256 or 16."""
    if metric not in ("l2", "ip"):
        raise ValueError(f"metric must be 'l2' or 'ip', got {metric!r}")
    m, ksub, dsub = codebooks.shape
    q, dim = queries.shape
    if ksub not in KSUBS or m * dsub < dim:
        raise ValueError(f"codebooks of shape {tuple(codebooks.shape)} do not fit queries of dimension {dim}")
    if out is None:
        out = torch.empty((q, m, ksub), dtype=torch.float32, device=queries.device)
    if q:
        params = _params(m, dsub, metric, interpreted(), ksub)
        pq_table_kernel[(q, triton.cdiv(m, params["SUBS"]))](queries, codebooks, out, dim, **params)
    return out


def _params(m: int, dsub: int, metric: str, interpret: bool, ksub: int = KSUB) -> dict:
    # One sub-space per program on a GPU (a [ksub, dsub] tile in registers); the interpreter
    # pays per operation, not per element, so there a program takes every sub-space.
    subs = triton.next_power_of_2(m) if interpret else 1
    return dict(M=m, DSUB=dsub, DSUB_P2=triton.next_power_of_2(dsub), SUBS=subs, IP=metric == "ip", KSUB=ksub,
                num_warps=4)


def variants(m: int, dsub: int, metric: str, ksub: int = KSUB) -> list[Variant]:
    """What pq_tables compiles on a GPU for codebooks (m, ksub, dsub) and this metric."""
    params = _params(m, dsub, metric, interpret=False, ksub=ksub)
    return [variant(pq_table_kernel, ("*fp32", "*fp32", "*fp32", "i32"), params.pop("num_warps"), **params)]


def pq_tables_reference(queries: torch.Tensor, codebooks: torch.Tensor, metric: str) -> torch.Tensor:
    """Plain PyTorch, in float64 so that it is the better answer of the two."""
    m, _, dsub = codebooks.shape
    x = torch.nn.functional.pad(queries.double(), (0, m * dsub - queries.shape[1])).reshape(-1, m, dsub)
    c = codebooks.double()
    if metric == "ip":
        return -torch.einsum("qmd,mkd->qmk", x, c).float()
    return ((x[:, :, None, :] - c[None]) ** 2).sum(-1).float()
