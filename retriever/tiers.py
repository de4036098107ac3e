"""The three tiers of an open index, each a part with one interface (docs/design.md, "A query").

- NavigationTier (host RAM): graph search for the top-m posting lists of each query (the coarse quantizer).
- FilterTier (GPU memory, or host RAM here; filtering.py): PQ lookup tables; gather the lists' IDs,
  de-duplicate, PQ distance, top-n (the codec). CpuFilterTier is the native one; GpuFilterTier
  (gpu_tier.py, Triton) implements the same interface; pipeline.open_filter_tier picks one.
- RerankTier (SSD + DRAM page buffer): exact distances of the top-n, Algorithm 1 early stop (the refinement).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from fusionrag import native
from fusionrag.retriever.config import EngineConfig, SearchParams
from fusionrag.retriever.errors import ConfigError
from fusionrag.retriever.filtering import Candidates
from fusionrag.retriever.kmeans import sq_dists
from fusionrag.retriever.learned_probe import ProbeModel, probe_features


@dataclass(frozen=True)
class BatchTables:
    """A batch's PQ tables, not built: CpuFilterTier.topn builds each query's table (as
    ProductQuantizer.luts) in the thread that scans it, so a search holds one M x 256 table
    per thread instead of one per query of the batch."""
    queries: np.ndarray  # float32 (q, dim)
    codebooks: object  # native.PqCodebooks (laid out once per index), or float32 (M, 256, dsub)
    metric: str  # 'l2' or 'ip'


class NavigationTier:
    """The l2 graph over the centroids; for an ip index the centroids carry one extra
    coordinate (see build.mips_augment) and queries get a zero there."""

    def __init__(self, graph, augmented: bool, threads: int, model: ProbeModel | None = None):
        self.graph, self.augmented, self.threads = graph, augmented, threads
        self.model = model  # learned pruning's, where the index has one (SearchParams.probe 'learned')
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

    def nearest(self, queries: np.ndarray, p: SearchParams) -> tuple[np.ndarray, np.ndarray]:
        """The nprobe nearest lists of each query and their squared distances, nearest first (no cut)."""
        q = np.hstack([queries, np.zeros((len(queries), 1), np.float32)]) if self.augmented else queries
        m = min(p.nprobe, self.graph.size)
        if m == self.graph.size:
            return self._exhaustive(q, m)
        return self.graph.search(q, m, max(m, p.graph_ef), self.threads)

    def probe(self, queries: np.ndarray, p: SearchParams) -> tuple[np.ndarray, np.ndarray, float]:
        """Posting lists to probe per query (-1 where p.probe's rule cuts), their count, seconds."""
        t = time.perf_counter()
        if p.probe == "learned" and self.model is None:
            raise ConfigError("probe 'learned' needs an index built with a probe model (build with --probe-model, "
                              "BuildConfig(probe_model=True))")
        lists, dists = self.nearest(queries, p)
        m = lists.shape[1]
        if p.probe == "learned":
            keep = self.model.lists(probe_features(dists), p.probe_scale, m)
            lists[np.arange(m)[None, :] >= keep[:, None]] = -1
        elif p.probe_ratio > 0 and not self.augmented and m > 1:
            # Lists much farther than the nearest one rarely hold a top-k neighbour.
            d = np.sqrt(np.maximum(dists, 0))
            lists[d > (1 + p.probe_ratio) * d[:, :1]] = -1
        return lists, (lists >= 0).sum(axis=1), time.perf_counter() - t


class CpuFilterTier:
    """The filter tier in host RAM (native/scan.cpp). metric: the tables' ('l2' or 'ip'); pipeline: whether
    a call's batches overlap (EngineConfig.pipeline); batch_plan: whether queries that share posting lists
    are scanned list by list (EngineConfig.batch_plan; same results)."""

    name = "cpu"
    in_flight = 1
    tiered = False

    def __init__(self, list_offsets: np.ndarray, list_ids: np.ndarray, codes: np.ndarray, codebooks: np.ndarray,
                 threads: int, *, metric: str = "l2", batch_size: int = 0, pipeline: bool = EngineConfig.pipeline,
                 batch_plan: bool = EngineConfig.batch_plan):
        self.list_offsets, self.list_ids, self.codes, self.threads = list_offsets, list_ids, codes, threads
        self.metric, self.overlaps, self.batch_plan = metric, pipeline, batch_plan
        self.batch_size = batch_size or EngineConfig().batch_for(self.name)
        # Laid out for building tables once, not per call: ~0.1 ms a one-query request would pay every time.
        self.codebooks = native.PqCodebooks(codebooks)

    def memory_bytes(self) -> int:
        return int(self.codes.nbytes + self.codebooks.nbytes)

    def describe(self) -> dict:
        return {"filter_tier": self.name}

    def close(self) -> None:
        """Nothing to give back: the codes are the index's own arrays."""

    def tables(self, queries: np.ndarray) -> BatchTables:
        return BatchTables(queries, self.codebooks, self.metric)

    def topn(self, tables: BatchTables | np.ndarray, probe_lists: np.ndarray, n: int,
             exclude: np.ndarray | None = None) -> Candidates:
        index = (self.list_offsets, self.list_ids, self.codes, n, self.threads, exclude)
        if isinstance(tables, BatchTables):
            ids, dists, counts, seconds, lut_seconds = native.scan_topn_pq(
                tables.queries, tables.codebooks, tables.metric, probe_lists, *index, batch_plan=self.batch_plan)
            return Candidates(ids, dists, counts[:, 0], counts[:, 1], seconds, lut_seconds)
        ids, dists, counts, seconds = native.scan_topn(tables, probe_lists, *index)
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


class RerankTier:
    """The exact re-ranker over the page file. With page_mates, a block read for a mini-batch also
    scores the query's later candidates stored in it (EngineConfig.page_mates); with prefetch, the next
    mini-batch's blocks are read while the current one's are scored (EngineConfig.rerank_prefetch)."""

    def __init__(self, store, locations: np.ndarray, dtype: str, metric: str, threads: int,
                 inflight: int = EngineConfig.rerank_inflight, page_mates: bool = EngineConfig.page_mates,
                 prefetch: bool = EngineConfig.rerank_prefetch):
        self.store, self.locations, self.dtype, self.metric = store, locations, dtype, metric
        self.threads, self.inflight, self.page_mates, self.prefetch = threads, inflight, page_mates, prefetch

    def rerank(self, queries: np.ndarray, cand: np.ndarray, k: int, p: SearchParams):
        """(ids, exact distances, stats int64 (q, 6), seconds): see native.rerank."""
        return native.rerank(self.store, queries, cand, self.locations, self.dtype, self.metric, k,
                             p.minibatch, p.eps, p.beta, self.threads, inflight=self.inflight,
                             page_mates=self.page_mates, prefetch=self.prefetch, resident_first=p.resident_first)
