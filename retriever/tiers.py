"""The three tiers of an open index, each a part with one interface (docs/design.md, "A query").

- NavigationTier (host RAM): graph search for the top-m posting lists of each query.
- FilterTier (GPU memory, or host RAM here): PQ lookup tables; gather the lists' IDs,
  de-duplicate, PQ distance, top-n. CpuFilterTier is the native fallback; GpuFilterTier
  (gpu_tier.py, Triton) implements the same interface; `open_filter_tier` picks one.
- RerankTier (SSD + DRAM page buffer): exact distances of the top-n, Algorithm 1 early stop.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fusionrag import native
from fusionrag.retriever.config import EngineConfig, SearchParams
from fusionrag.retriever.kmeans import sq_dists


@dataclass
class Candidates:
    ids: np.ndarray  # int64 (q, n), best PQ distance first, -1 padding
    pq_dists: np.ndarray  # float32 (q, n)
    gathered: np.ndarray  # int64 (q,): IDs gathered, duplicates included
    unique: np.ndarray  # int64 (q,): after de-duplication
    seconds: np.ndarray  # float64 (q,)
    # float64 (q,): building PQ tables inside topn (the CPU tier's BatchTables); 0 where
    # the tables came built (timed by whoever built them).
    lut_seconds: np.ndarray | float = 0.0


@dataclass(frozen=True)
class BatchTables:
    """A batch's PQ tables, not built: CpuFilterTier.topn builds each query's table (as
    ProductQuantizer.luts) in the thread that scans it, so a search holds one M x 256 table
    per thread instead of one per query of the batch."""
    queries: np.ndarray  # float32 (q, dim)
    codebooks: object  # native.PqCodebooks (laid out once per index), or float32 (M, 256, dsub)
    metric: str  # 'l2' or 'ip'


class FilterTier(Protocol):
    name: str

    def memory_bytes(self) -> int: ...

    def describe(self) -> dict: ...

    def close(self) -> None:
        """Give back what the tier holds (GPU memory); no search may run meanwhile or after."""

    def luts(self, pq, queries: np.ndarray, metric: str):
        """The queries' PQ tables in the form topn takes best: BatchTables on the CPU (built
        during topn), tables in device memory on the GPU."""

    def topn(self, luts, probe_lists: np.ndarray, n: int, exclude: np.ndarray | None = None) -> Candidates:
        """luts: from self.luts, or float32 (q, M, 256) host tables as ProductQuantizer.luts gives.
        exclude: bitmap of vector ids never to return (a collection's tombstones and filter)."""


class NavigationTier:
    """The l2 graph over the centroids; for an ip index the centroids carry one extra
    coordinate (see build.mips_augment) and queries get a zero there."""

    def __init__(self, graph, augmented: bool, threads: int):
        self.graph, self.augmented, self.threads = graph, augmented, threads
        self._all = None

    def memory_bytes(self) -> int:
        return int(self.graph.memory_bytes())

    def _exhaustive(self, q: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Every centroid, by exact distance: what probing all lists must mean."""
        if self._all is None:
            self._all = self.graph.vectors()
        d = sq_dists(q, self._all)
        order = np.argsort(d, axis=1, kind="stable")[:, :m]
        return order.astype(np.int32), np.take_along_axis(d, order, axis=1)

    def probe(self, queries: np.ndarray, p: SearchParams) -> tuple[np.ndarray, np.ndarray, float]:
        """Posting lists to probe per query (-1 where the ratio rule cuts), their count, seconds."""
        t = time.perf_counter()
        q = np.hstack([queries, np.zeros((len(queries), 1), np.float32)]) if self.augmented else queries
        m = min(p.nprobe, self.graph.size)
        if m == self.graph.size:
            lists, dists = self._exhaustive(q, m)
        else:
            lists, dists = self.graph.search(q, m, max(m, p.graph_ef), self.threads)
        if p.probe_ratio > 0 and not self.augmented and m > 1:
            # Lists much farther than the nearest one rarely hold a top-k neighbour.
            d = np.sqrt(np.maximum(dists, 0))
            lists[d > (1 + p.probe_ratio) * d[:, :1]] = -1
        return lists, (lists >= 0).sum(axis=1), time.perf_counter() - t


class CpuFilterTier:
    name = "cpu"

    def __init__(self, list_offsets: np.ndarray, list_ids: np.ndarray, codes: np.ndarray, codebooks: np.ndarray,
                 threads: int):
        self.list_offsets, self.list_ids, self.codes, self.threads = list_offsets, list_ids, codes, threads
        # Laid out for building tables once, not per call: ~0.1 ms a one-query request would pay every time.
        self.codebooks = native.PqCodebooks(codebooks)

    def memory_bytes(self) -> int:
        return int(self.codes.nbytes + self.codebooks.nbytes)

    def describe(self) -> dict:
        return {"filter_tier": self.name}

    def close(self) -> None:
        """Nothing to give back: the codes are the index's own arrays."""

    def luts(self, pq, queries: np.ndarray, metric: str) -> BatchTables:
        return BatchTables(queries, self.codebooks, metric)

    def topn(self, luts: BatchTables | np.ndarray, probe_lists: np.ndarray, n: int,
             exclude: np.ndarray | None = None) -> Candidates:
        index = (self.list_offsets, self.list_ids, self.codes, n, self.threads, exclude)
        if isinstance(luts, BatchTables):
            ids, dists, counts, seconds, lut_seconds = native.scan_topn_pq(
                luts.queries, luts.codebooks, luts.metric, probe_lists, *index)
            return Candidates(ids, dists, counts[:, 0], counts[:, 1], seconds, lut_seconds)
        ids, dists, counts, seconds = native.scan_topn(luts, probe_lists, *index)
        return Candidates(ids, dists, counts[:, 0], counts[:, 1], seconds)


# A CUDA (or ROCm) driver makes one of these; without any, torch cannot see a GPU.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def _cuda_available() -> bool:
    """Without a GPU driver's device nodes there is no CUDA: say so without importing torch,
    which alone would add ~200 MB to the resident memory of a CPU-only search process."""
    if "torch" not in sys.modules:
        if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() == "-1" or not any(
                os.path.exists(p) for p in GPU_DEVICE_NODES):
            return False
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        return False
    import torch

    return torch.cuda.is_available()


def open_filter_tier(config: EngineConfig, list_offsets: np.ndarray, list_ids: np.ndarray, codes: np.ndarray,
                     codebooks: np.ndarray, threads: int, owner: str, metric: str) -> FilterTier:
    """config.filter_tier: 'gpu' when CUDA is there (and torch and triton installed) under 'auto'.
    A GPU tier holds an account, named by owner, in the process's one budget on its device, and
    compiles its kernels for the tables' metric ('l2' or 'ip')."""
    kind = config.filter_tier
    if kind == "auto":
        kind = "gpu" if _cuda_available() else "cpu"
    if kind == "cpu":
        return CpuFilterTier(list_offsets, list_ids, codes, codebooks, threads)
    from fusionrag.retriever.gpu_tier import GpuFilterTier, gpu_device, shared_account

    account = shared_account(gpu_device(), config.gpu_budget_bytes, config.gpu_memory_utilization, owner)
    return GpuFilterTier(list_offsets, list_ids, codes, codebooks, account=account, metric=metric,
                         batch_size=config.batch_for("gpu"), threads=threads, tiered_share=config.gpu_tiered_share)


class RerankTier:
    """The exact re-ranker over the page file. With page_mates, a block read for a mini-batch also
    scores the query's later candidates stored in it (EngineConfig.page_mates)."""

    def __init__(self, store, locations: np.ndarray, dtype: str, metric: str, threads: int,
                 inflight: int = EngineConfig.rerank_inflight, page_mates: bool = EngineConfig.page_mates):
        self.store, self.locations, self.dtype, self.metric = store, locations, dtype, metric
        self.threads, self.inflight, self.page_mates = threads, inflight, page_mates

    def rerank(self, queries: np.ndarray, cand: np.ndarray, k: int, p: SearchParams):
        """(ids, exact distances, stats int64 (q, 5), seconds): see native.rerank."""
        return native.rerank(self.store, queries, cand, self.locations, self.dtype, self.metric, k,
                             p.minibatch, p.eps, p.beta, self.threads, inflight=self.inflight,
                             page_mates=self.page_mates)
