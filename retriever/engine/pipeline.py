"""The query pipeline's parts above the tiers: the record of one internal batch passed from stage to
stage (QueryBatch: Index._graph_stage, then _filter_stage, then _rerank_stage), and the choice of filter
tier when an index opens (open_filter_tier, the one module that knows both tiers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from fusionrag.retriever.engine.config import EngineConfig, SearchParams
from fusionrag.retriever.engine.filtering import Candidates, FilterTier
from fusionrag.retriever.engine.tiers import CpuFilterTier, cuda_available
from fusionrag.retriever.engine.vectors import normalize
from fusionrag.retriever.errors import ConfigError

COUNT_KEYS = ("lists_probed", "candidates", "unique_candidates", "minibatches", "reranked",
              "page_mates", "resident_scored", "records_cached", "pages_read", "pages_buffered")
SECONDS_KEYS = ("graph_s", "lut_s", "scan_s", "rerank_s")
STAT_KEYS = COUNT_KEYS + SECONDS_KEYS


def stat_arrays(nq: int) -> dict[str, np.ndarray]:
    """A call's per-query statistics, zero: STAT_KEYS in order, each (nq,) and a row of one of two blocks (int64
    counts, float64 seconds). Two allocations, not one a key: fourteen cost a one-query search ~10 us."""
    stats = dict(zip(COUNT_KEYS, np.zeros((len(COUNT_KEYS), nq), np.int64)))
    stats.update(zip(SECONDS_KEYS, np.zeros((len(SECONDS_KEYS), nq), np.float64)))
    return stats


@dataclass(eq=False)
class QueryBatch:
    """One internal batch of a search call on its way through the stages. The call's request and the
    batch's rows of its results come in; each stage fills its part: the graph stage (or the caller,
    given lists) lists, probed and graph_s; the filter stage lut_s and candidates; the re-rank stage
    writes ids, distances and stats, which are views of the call's result arrays."""

    queries: np.ndarray  # float32 (q, dim), prepared (unit rows under cosine) once ready() ran
    k: int
    params: SearchParams
    exclude: np.ndarray | None  # uint8 bitmap of vector ids never to return
    ids: np.ndarray  # int64 (q, k), a view of the call's result
    distances: np.ndarray  # float32 (q, k), a view of the call's result
    stats: dict[str, np.ndarray]  # STAT_KEYS, each a (q,) view of the call's
    lists: np.ndarray | None = None  # int32 (q, m) posting lists to probe, -1 where none
    probed: np.ndarray | None = None  # int64 (q,): lists probed
    graph_s: float = 0.0  # the batch's graph search
    lut_s: float = 0.0  # the batch's PQ tables built before topn
    candidates: Candidates | None = None
    unit_pending: bool = False  # queries are the caller's rows, not yet unit length (cosine)
    final: bool = False  # the device tier gave the exact top-k (candidates hold them): no host re-rank
    passing: float = 1.0  # the share of the index's vectors exclude lets through (the probe widens by it)

    def ready(self) -> "QueryBatch":
        """The batch's queries in the engine's form, made now (its first stage calls it): a normalised copy
        of this batch's rows only."""
        if self.unit_pending:
            self.queries, self.unit_pending = normalize(self.queries), False
        return self

    @property
    def n(self) -> int:
        """Candidates the filter tier hands the re-ranker per query."""
        return max(self.params.rerank, self.k)


def cut(queries: np.ndarray, k: int, params: SearchParams, exclude: np.ndarray | None, size: int,
        lists: np.ndarray | None = None, unit_pending: bool = False, passing: float = 1.0,
        ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], list[QueryBatch]]:
    """A call's result arrays (ids, distances, stats) and its batches of at most `size` queries, each
    writing its rows of them; lists (q, m), when given, are cut alongside (the graph stage is skipped).
    unit_pending: the queries are checked but not yet unit length (queries.checked_for_search): each batch
    normalises its own rows when ready() is called. passing: the share of the vectors exclude lets through."""
    nq = len(queries)
    ids = np.empty((nq, k), dtype=np.int64)
    dists = np.empty((nq, k), dtype=np.float32)
    stats = stat_arrays(nq)
    batches = []
    for s in range(0, nq, size):
        sl = slice(s, min(nq, s + size))
        # one batch (a one-query call among them) writes the call's statistics as they are: no fourteen views
        rows = stats if nq <= size else {key: v[sl] for key, v in stats.items()}
        b = QueryBatch(queries[sl], k, params, exclude, ids[sl], dists[sl], rows, unit_pending=unit_pending,
                       passing=passing)
        if lists is not None:
            b.lists = lists[sl]
            b.probed = (b.lists >= 0).sum(axis=1)
        batches.append(b)
    return ids, dists, stats, batches


def passing_share(exclude: np.ndarray, count: int) -> float:
    """The share of an index's `count` vectors an exclude bitmap lets through (bits past count not counted), at
    least one vector's: a bitmap excluding them all makes the probe find every list. ~40 us at 1M vectors. A bitmap
    of another size counts as excluding none: the scan refuses it (native/scan.cpp exclude_bitmap)."""
    b = np.asarray(exclude)
    if count <= 0 or b.dtype != np.uint8 or b.shape != ((count + 7) // 8,):
        return 1.0
    whole = count // 8
    excluded = int(np.bitwise_count(b[:whole]).sum())
    if count % 8:
        excluded += int(np.bitwise_count(b[whole] & np.uint8((1 << count % 8) - 1)))
    return max(count - excluded, 1) / count

@dataclass
class DeviceParts:
    """What the device tier takes beside the filter tier's arrays: the navigation graph's centroids (augmented
    for ip), and raw(start, stop), the stored vectors of those ids as float32 (device_tier.raw_reader)."""

    centroids: Callable[[], np.ndarray]
    augmented: bool
    raw: Callable[[int, int], np.ndarray] | None
    dim: int


def filter_kind(config: EngineConfig) -> str:
    """'cpu' or 'gpu': config.filter_tier, 'gpu' under 'auto' when CUDA is there (and torch and triton installed)."""
    kind = config.filter_tier
    return ("gpu" if cuda_available() else "cpu") if kind == "auto" else kind


def open_filter_tier(config: EngineConfig, list_offsets: np.ndarray, list_ids: np.ndarray, codes: np.ndarray,
                     codebooks: np.ndarray, threads: int, owner: str, metric: str,
                     device: DeviceParts | None = None) -> FilterTier:
    """The filter tier filter_kind(config) names. Either tier builds its tables for `metric` ('l2' or 'ip'). A GPU
    tier holds an account, named by owner, in the process's one budget on its device, and compiles its kernels for
    that metric; with `device` given and config.gpu_search 'auto' or 'device', it is the device tier (the whole
    batch on the GPU) where its parts fit the budget, else (under 'auto') the lists tier, which scans 8-bit codes
    only: 4-bit codes (codebooks of 16 centroids) then go to the CPU tier under filter_tier 'auto', and are refused
    under 'gpu'."""
    kind = filter_kind(config)
    if kind == "cpu":
        return CpuFilterTier(list_offsets, list_ids, codes, codebooks, threads, metric=metric,
                             batch_size=config.batch_for("cpu"), pipeline=config.pipeline,
                             batch_plan=config.batch_plan)
    # Imported here, not above: the GPU tiers import torch, which a CPU-only process never needs.
    from fusionrag.kernels.pool import BudgetError
    from fusionrag.retriever.engine.gpu_tier import GpuFilterTier, gpu_device, shared_account

    account = shared_account(gpu_device(), config.gpu_budget_bytes, config.gpu_memory_utilization, owner)
    if device is not None and config.gpu_search != "lists":
        from fusionrag.retriever.engine.device_tier import DeviceTier

        try:
            return DeviceTier(device.centroids(), device.augmented, list_offsets, list_ids, codes, codebooks,
                              account=account, metric=metric, batch_size=config.batch_for("gpu"), threads=threads,
                              raw=device.raw, dim=device.dim, raw_share=config.gpu_tiered_share)
        except BudgetError as e:
            if codebooks.shape[1] == 16:  # 4-bit codes, which the lists tier below does not scan
                if config.filter_tier == "auto":
                    return open_filter_tier(config.with_overrides(filter_tier="cpu"), list_offsets, list_ids, codes,
                                            codebooks, threads, owner, metric)
                raise ConfigError(f"{e}; raise gpu_budget_bytes, or open it with filter_tier 'cpu' or 'auto' (the "
                                  "lists tier, which takes the device tier's place, scans 8-bit PQ codes only)") from e
            if config.gpu_search == "device":
                raise ConfigError(f"{e}; raise gpu_budget_bytes, or set gpu_search 'auto' or 'lists'") from e
            account = shared_account(gpu_device(), config.gpu_budget_bytes, config.gpu_memory_utilization, owner)
    return GpuFilterTier(list_offsets, list_ids, codes, codebooks, account=account, metric=metric,
                         batch_size=config.batch_for("gpu"), threads=threads, tiered_share=config.gpu_tiered_share)
