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
from fusionrag.retriever.engine.config import EngineConfig, SearchParams, probe_widening
from fusionrag.retriever.engine.filtering import Candidates
from fusionrag.retriever.engine.kmeans import sq_dists
from fusionrag.retriever.engine.learned_probe import ProbeModel, probe_features
from fusionrag.retriever.errors import ConfigError, IndexFormatError


@dataclass(frozen=True)
class BatchTables:
    """A batch's PQ tables, not built: CpuFilterTier.topn builds each query's table (as
    ProductQuantizer.luts) in the thread that scans it, so a search holds one M x 256 table
    per thread instead of one per query of the batch."""
    queries: np.ndarray  # float32 (q, dim)
    codebooks: object  # native.PqCodebooks (laid out once per index), or float32 (M, 256, dsub)
    metric: str  # 'l2' or 'ip'


def exhaustive_is_cheap(centroids: int, dim: int, max_floats: int | None = None) -> bool:
    """Whether a new build's rows and queries find their nearest centroids by exact distances to all of them
    (Graph.exact_search over the graph's SQ8 codes) rather than by the graph (BuildConfig.navigation 'auto').
    Exact is what the graph approximates, and a graph over the centroids of tightly clustered data can miss a
    query's cluster however long it searches (Gaussian clusters of 100 in 128-d, 5,208 centroids: 14% of them
    out of reach at ef 256 before the graph linked every node into reach; 200k such vectors reached recall@10
    0.93 at nprobe 256 by the graph then, 0.998 exactly). Exact costs a pass over every centroid whatever the lists wanted, the graph about m of them: at
    MiniLM's 3,550 x 384, 35 us a query at m 64 against the graph's 66 (bench/results/peers/exact_navigation.md,
    batches of 64, one thread). Beyond 3M floats the graph is the cheaper where real data is searched: on
    Fashion-MNIST's 5,954 x 784, recall@10 0.90 is reached at nprobe 16, where exact took 122 us a query and the
    graph 37 (exact_navigation_fashion.md), and exactly navigated builds found the same recall at each
    setting and lost a third of their QPS (docs/tuning.md, "Exact navigation's limit"). max_floats: another limit
    on centroids x dim (recorded_navigation's, for builds before the record)."""
    limit = EXHAUSTIVE_MAX_FLOATS if max_floats is None else max_floats
    return centroids <= EXHAUSTIVE_MAX_CENTROIDS and centroids * dim <= limit


EXHAUSTIVE_MAX_CENTROIDS = 32768
EXHAUSTIVE_MAX_FLOATS = 3 << 20
LEGACY_MAX_FLOATS = 3 << 20  # the rule of builds that did not record their navigation (list_navigation)
NAVIGATIONS = ("exact", "graph")


def build_navigation(choice: str, centroids: int, dim: int) -> str:
    """'exact' or 'graph': how a new build's rows and queries find their lists (BuildConfig.navigation; dim:
    the graph's, one more than the data's for ip)."""
    if choice == "auto":
        return "exact" if exhaustive_is_cheap(centroids, dim) else "graph"
    if choice not in NAVIGATIONS:
        raise ConfigError(f"navigation must be auto, exact or graph, not {choice!r}")
    return choice


def recorded_navigation(manifest: dict, centroids: int, dim: int, path="") -> str:
    """'exact' or 'graph': how an index's queries find their lists, as its manifest records ("list_navigation");
    an index built before the record goes the way its build's rows went: exactly where the centroids were at
    most EXHAUSTIVE_MAX_CENTROIDS and centroids x dim at most LEGACY_MAX_FLOATS."""
    mode = manifest.get("list_navigation")
    if mode is None:
        return "exact" if exhaustive_is_cheap(centroids, dim, LEGACY_MAX_FLOATS) else "graph"
    if mode not in NAVIGATIONS:
        raise IndexFormatError(f"{path}: the manifest's list_navigation must be exact or graph, not {mode!r}")
    return mode


EXHAUSTIVE_CHUNK = 1 << 18  # distances held at once: a chunk of queries' rows of them, and their partial sort


def nearest_exhaustive(q: np.ndarray, centroids: np.ndarray, m: int,
                       c_sq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The m nearest of the centroids by exact squared l2, nearest first (ties by number): (int32, float32).
    The build's, over its float centroids (build.nearest_rows; queries take Graph.exact_search over the graph's
    codes, NavigationTier). In chunks of queries, so that a batch holds at most EXHAUSTIVE_CHUNK distances (and
    the partial sort's int64 indices: 3 MiB) at a time: 1024 rows over 3,868 centroids held 47 MiB."""
    rows = max(1, EXHAUSTIVE_CHUNK // max(1, len(centroids)))
    if len(q) > rows:
        if c_sq is None:
            c_sq = np.einsum("ij,ij->i", centroids, centroids)
        parts = [nearest_exhaustive(q[lo:lo + rows], centroids, m, c_sq) for lo in range(0, len(q), rows)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    d = sq_dists(q, centroids, c_sq)
    if m < d.shape[1]:
        part = np.argpartition(d, m - 1, axis=1)[:, :m]
        pd = np.take_along_axis(d, part, axis=1)
        order = _by_distance_then_id(part, pd)
        return np.take_along_axis(part, order, axis=1).astype(np.int32), np.take_along_axis(pd, order, axis=1)
    order = np.argsort(d, axis=1, kind="stable")
    return order.astype(np.int32), np.take_along_axis(d, order, axis=1)


def _by_distance_then_id(ids: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Per row, the order of (d, ids) ascending: the same order a stable sort over all centroids gives."""
    by_id = np.argsort(ids, axis=1, kind="stable")
    by_d = np.argsort(np.take_along_axis(d, by_id, axis=1), axis=1, kind="stable")
    return np.take_along_axis(by_id, by_d, axis=1)


class NavigationTier:
    """The l2 graph over the centroids; for an ip index the centroids carry one extra
    coordinate (see build.mips_augment) and queries get a zero there. Where the index navigates
    exactly (its manifest's list_navigation), queries go to the centroids' exact distances instead (Graph.exact_search, over the graph's own
    codes: no copy of the centroids, no BLAS buffers)."""

    def __init__(self, graph, augmented: bool, threads: int, navigation: str, model: ProbeModel | None = None,
                 list_sizes: np.ndarray | None = None):
        self.graph, self.augmented, self.threads = graph, augmented, threads
        self.model = model  # learned pruning's, where the index has one (SearchParams.probe 'learned')
        # postings per list (int64, as the native rule reads them): the ratio rule keeps lists up to p.rerank of them
        self.list_sizes = None if list_sizes is None else np.ascontiguousarray(list_sizes, dtype=np.int64)
        # 'exact' or 'graph', as the build's rows went (build_navigation, recorded_navigation)
        self.exhaustive = navigation == "exact"

    def memory_bytes(self) -> int:
        return int(self.graph.memory_bytes())

    def _exhaustive(self, q: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """The m nearest of every centroid, by exact distance: what probing all lists must mean."""
        return self.graph.exact_search(q, m, self.threads)

    def nearest(self, queries: np.ndarray, p: SearchParams, m: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The m (else p.nprobe) nearest lists of each query and their squared distances, nearest first (no cut).
        By exact distances to every centroid where the build's rows went so, or where the graph's beam would be
        wide (exact_navigation): a filtered search's widened m."""
        q = np.hstack([queries, np.zeros((len(queries), 1), np.float32)]) if self.augmented else queries
        m = min(p.nprobe if m is None else m, self.graph.size)
        if self.exhaustive or exact_navigation(m, self.graph.size):
            return self._exhaustive(q, m)
        return self.graph.search(q, m, max(m, p.graph_ef), self.threads)

    def probe(self, queries: np.ndarray, p: SearchParams,
              passing: float = 1.0) -> tuple[np.ndarray, np.ndarray, float]:
        """Posting lists to probe per query (-1 where p.probe's rule cuts), their count, seconds. passing: the share
        of the index's vectors the search may return (a filter's, tombstones'): the lists probed are widened to
        hold as many of those as an unfiltered search's lists hold vectors (probe_widening)."""
        t = time.perf_counter()
        if p.probe == "learned" and self.model is None:
            raise ConfigError("probe 'learned' needs an index built with a probe model (build with --probe-model, "
                              "BuildConfig(probe_model=True))")
        m, floor = probe_widening(p, passing)
        lists, dists = self.nearest(queries, p, m)
        m = lists.shape[1]
        if p.probe == "learned":
            keep = self.model.lists(probe_features(dists), p.probe_scale, m)
            if passing < 1:
                keep = np.minimum(np.ceil(keep / passing), m)
            lists[np.arange(m)[None, :] >= keep[:, None]] = -1
        elif p.probe_ratio > 0 and not self.augmented and m > 1:
            # Lists much farther than the nearest one rarely hold a top-k neighbour. But never fewer lists
            # than hold the p.rerank candidates the re-rank wants (scaled by passing): a query near a centroid
            # of one vector (an outlier's own list) or of none kept that list alone, and got fewer than k answers.
            # In one native pass (native/probe_cut.cpp: numpy's dozen calls cost ~15-20 us of a one-query search).
            lists = np.ascontiguousarray(lists, dtype=np.int32)
            probed = native.ratio_cut(lists, np.ascontiguousarray(dists, dtype=np.float32), self.list_sizes,
                                      float(p.probe_ratio), floor)
            return lists, probed, time.perf_counter() - t
        return lists, (lists >= 0).sum(axis=1), time.perf_counter() - t


# The graph's search costs ~0.3-0.5 us a list found (its beam is at least m), exact distances to every centroid a
# fixed ~0.15-0.2 ms plus ~0.1 us a list (measured one query at a time, 1 thread: GloVe 40,555 centroids x 50,
# Fashion-MNIST 5,954 x 784); the two cross near m = 500 on both, and the exact scan grows with the centroids
# (size / 64: ~600 on GloVe's). Reached only by a filtered search's widened lists or an nprobe set that high.
EXACT_NAVIGATION_MIN = 512


def exact_navigation(m: int, size: int) -> bool:
    """Whether finding a query's m nearest of `size` centroids is cheaper by exact distances than by the graph."""
    return m >= size or m >= max(EXACT_NAVIGATION_MIN, size // 64)


def laid_out_codebooks(codebooks: np.ndarray):
    """float32 (M, 256 or 16, dsub) codebooks laid out for building tables: native.PqCodebooks, or
    native.Pq4Codebooks for 4-bit codes."""
    return (native.Pq4Codebooks if codebooks.shape[1] == 16 else native.PqCodebooks)(codebooks)


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
        # 4-bit codes (16 centroids a sub-space, BuildConfig.pq_bits) are scanned by scan_topn_pq4.
        self.codebooks = laid_out_codebooks(codebooks)
        self.four_bit = isinstance(self.codebooks, native.Pq4Codebooks)

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
        if isinstance(tables, BatchTables) and self.four_bit:
            ids, dists, counts, seconds, lut_seconds = native.scan_topn_pq4(
                tables.queries, tables.codebooks, tables.metric, probe_lists, *index)
            return Candidates(ids, dists, counts[:, 0], counts[:, 1], seconds, lut_seconds)
        if isinstance(tables, BatchTables):
            ids, dists, counts, seconds, lut_seconds = native.scan_topn_pq(
                tables.queries, tables.codebooks, tables.metric, probe_lists, *index, batch_plan=self.batch_plan)
            return Candidates(ids, dists, counts[:, 0], counts[:, 1], seconds, lut_seconds)
        ids, dists, counts, seconds = native.scan_topn(tables, probe_lists, *index)
        return Candidates(ids, dists, counts[:, 0], counts[:, 1], seconds)


# A CUDA (or ROCm) driver makes one of these; without any, torch cannot see a GPU.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def cuda_available() -> bool:
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


RAW_LOAD_BLOCKS = 256  # blocks read at a time while the raw vectors are loaded into RAM (1 MiB of 4 KiB blocks)


def raw_bytes(count: int, record_bytes: int) -> int:
    """The bytes of the raw vectors held in RAM (EngineConfig.raw_in_ram): one record a vector."""
    return int(count) * int(record_bytes)


def raw_in_ram(choice: str, count: int, record_bytes: int, budget: int) -> bool:
    """Whether an index's raw vectors are held in RAM (EngineConfig.raw_in_ram): 'auto' where the page buffer's
    budget (buffer_bytes, as fitted to the process's memory) holds them all."""
    if choice == "auto":
        return raw_bytes(count, record_bytes) <= budget
    if choice not in ("on", "off"):
        raise ConfigError(f"raw_in_ram must be auto, on or off, not {choice!r}")
    return choice == "on"


def load_raw(store, locations: np.ndarray, count: int) -> np.ndarray:
    """The raw vectors as uint8 (count, record_bytes), row = vector id: the page file read once, RAW_LOAD_BLOCKS
    blocks at a time, through the store (each block's CRC checked; a store with no page buffer keeps none), and
    each record put at its id's row (locations: id -> slot)."""
    per, width = int(store.records_per_block), int(store.record_bytes)
    raw = np.empty((count, width), np.uint8)
    order = np.argsort(locations, kind="stable")  # ids by slot
    slots = locations[order].astype(np.int64)
    for b0 in range(0, int(store.num_blocks), RAW_LOAD_BLOCKS):
        b1 = min(int(store.num_blocks), b0 + RAW_LOAD_BLOCKS)
        lo, hi = np.searchsorted(slots, [b0 * per, b1 * per])
        if lo == hi:
            continue
        data = store.read_blocks(np.arange(b0, b1, dtype=np.uint32))
        records = data[:, :per * width].reshape((b1 - b0) * per, width)
        raw[order[lo:hi]] = records[slots[lo:hi] - b0 * per]
    return raw


class RerankTier:
    """The exact re-ranker over the page file. With page_mates, a block read for a mini-batch also
    scores the query's later candidates stored in it (EngineConfig.page_mates); with prefetch, the next
    mini-batch's blocks are read while the current one's are scored (EngineConfig.rerank_prefetch).
    With raw (the raw vectors resident in RAM, load_raw: EngineConfig.raw_in_ram), every candidate is scored
    from there (native.rerank_resident) and nothing is read."""

    def __init__(self, store, locations: np.ndarray, dtype: str, metric: str, threads: int,
                 inflight: int = EngineConfig.rerank_inflight, page_mates: bool = EngineConfig.page_mates,
                 prefetch: bool = EngineConfig.rerank_prefetch, raw: np.ndarray | None = None):
        self.store, self.locations, self.dtype, self.metric = store, locations, dtype, metric
        self.threads, self.inflight, self.page_mates, self.prefetch = threads, inflight, page_mates, prefetch
        self.raw = raw

    @property
    def resident(self) -> bool:
        """Whether the raw vectors are in RAM and the re-rank reads nothing."""
        return self.raw is not None

    def memory_bytes(self) -> int:
        """The resident raw vectors' bytes (0 on the SSD path: the page buffer is counted by its store)."""
        return 0 if self.raw is None else int(self.raw.nbytes)

    def rerank(self, queries: np.ndarray, cand: np.ndarray, k: int, p: SearchParams):
        """(ids, exact distances, stats int64 (q, 7), seconds): see native.rerank (native.rerank_resident where
        the raw vectors are in RAM: every candidate scored, no early stop)."""
        if self.raw is not None:
            return native.rerank_resident(self.raw, queries, cand, self.dtype, self.metric, k, self.threads)
        return native.rerank(self.store, queries, cand, self.locations, self.dtype, self.metric, k,
                             p.minibatch, p.eps, p.beta, self.threads, inflight=self.inflight,
                             page_mates=self.page_mates, prefetch=self.prefetch, resident_first=p.resident_first)
