"""Product quantization of raw vectors (not residuals: a replicated vector keeps one code).

M sub-spaces of dsub dimensions (the vector zero-padded to M * dsub), 256 centroids each, one
byte per sub-space; or 16 centroids each (BuildConfig.pq_bits 4), two sub-spaces a byte (sub-space 2b
in byte b's low nibble, 2b + 1 in its high one), scanned 32 codes at a time with the table in registers
(native/scan4.h). The lookup table (LUT) of a query holds its distance to every sub-centroid;
a candidate's PQ distance is the sum of M table entries (ADC). `luts` here is also the reference
that the GPU kernel of the same step is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fusionrag.retriever.engine.kmeans import kmeans, sq_dists

KSUB = 256
KSUB4 = 16  # centroids a sub-space of 4-bit codes


def code_bytes(m: int, ksub: int) -> int:
    """Bytes of a vector's code of m sub-spaces of ksub centroids: m, or ceil(m / 2) for 4-bit codes."""
    return m if ksub == KSUB else -(-m // 2)


def auto_m(dim: int) -> int:
    """One code byte per two dimensions, at most 64 and at least min(8, dim).

    Codes this fine rank candidates well enough that the re-ranker's early stop ends after a
    few small mini-batches: a byte of GPU memory per vector saves pages of SSD reads per query.
    """
    return int(min(dim, max(8, min(64, -(-dim // 2)))))


@dataclass
class ProductQuantizer:
    codebooks: np.ndarray  # float32 (M, 256, dsub)
    dim: int

    @property
    def m(self) -> int:
        return self.codebooks.shape[0]

    @property
    def dsub(self) -> int:
        return self.codebooks.shape[2]

    @property
    def ksub(self) -> int:
        """Centroids a sub-space: 256 (8-bit codes) or 16 (4-bit)."""
        return self.codebooks.shape[1]

    @property
    def code_bytes(self) -> int:
        """Bytes of a vector's code: M, or ceil(M / 2) for 4-bit codes."""
        return code_bytes(self.m, self.ksub)

    def _split(self, x: np.ndarray) -> np.ndarray:
        """(n, dim) -> (n, M, dsub), zero-padded."""
        x = np.asarray(x, dtype=np.float32)
        pad = self.m * self.dsub - self.dim
        if pad:
            x = np.pad(x, ((0, 0), (0, pad)))
        return x.reshape(len(x), self.m, self.dsub)

    @classmethod
    def train(cls, x: np.ndarray, m: int, iters: int, rng: np.random.Generator,
              progress: Callable[[int], None] = lambda n: None, ksub: int = KSUB) -> "ProductQuantizer":
        """progress(1) is called as each sub-space's codebook is trained. ksub: 256 or 16 (4-bit codes)."""
        if ksub not in (KSUB, KSUB4):
            raise ValueError(f"ksub must be {KSUB} or {KSUB4}, not {ksub}")
        dim = x.shape[1]
        dsub = -(-dim // m)
        pq = cls(np.zeros((m, ksub, dsub), dtype=np.float32), dim)
        xs = pq._split(x)
        for j in range(m):
            pq.codebooks[j], _ = kmeans(xs[:, j, :], ksub, iters, rng)
            progress(1)
        return pq

    def encode(self, x: np.ndarray) -> np.ndarray:
        """uint8 (n, code_bytes): a byte a sub-space, or two 4-bit codes a byte."""
        xs = self._split(x)
        codes = np.zeros((len(x), self.m + (self.m % 2 if self.ksub == KSUB4 else 0)), dtype=np.uint8)
        for j in range(self.m):
            codes[:, j] = sq_dists(np.ascontiguousarray(xs[:, j, :]), self.codebooks[j]).argmin(axis=1)
        if self.ksub == KSUB4:
            return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))
        return codes

    def sub_codes(self, codes: np.ndarray) -> np.ndarray:
        """(n, M): each sub-space's centroid number, from codes as encode gives them."""
        if self.ksub == KSUB:
            return codes
        return np.stack([codes & 15, codes >> 4], axis=2).reshape(len(codes), -1)[:, :self.m]

    def decode(self, codes: np.ndarray) -> np.ndarray:
        parts = self.codebooks[np.arange(self.m)[None, :], self.sub_codes(codes).astype(np.int64)]
        return parts.reshape(len(codes), -1)[:, : self.dim]

    def luts(self, queries: np.ndarray, metric: str) -> np.ndarray:
        """float32 (q, M, 256): squared L2 ('l2') or negative inner product ('ip') per sub-space."""
        qs = self._split(queries)
        # One (q, M, 256) array, worked in place: the tables are most of a search's working memory.
        dots = np.empty((len(qs), self.m, self.ksub), dtype=np.float32)
        np.matmul(qs.transpose(1, 0, 2), self.codebooks.transpose(0, 2, 1), out=dots.transpose(1, 0, 2))
        if metric == "ip":
            return np.negative(dots, out=dots)
        dots *= -2
        dots += np.einsum("qmd,qmd->qm", qs, qs)[:, :, None]
        dots += np.einsum("mkd,mkd->mk", self.codebooks, self.codebooks)[None]
        return dots
