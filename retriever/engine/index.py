"""An index opened for search: the three tiers behind one `search` call."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from fusionrag import native
from fusionrag.retriever.engine.config import (BuildConfig, EngineConfig, SearchOverrides, SearchParams, cpu_threads,
                                               calibrated_defaults, resolve_params)
from fusionrag.retriever.engine.filtering import Candidates
from fusionrag.retriever.engine.layout import PageLayout, raw_reader
from fusionrag.retriever.engine.learned_probe import load_probe_model
from fusionrag.retriever.engine.manifest import ManifestShape, load_array, read_manifest
from fusionrag.retriever.engine.memory import held_bytes, search_call_bytes, split_buffer
from fusionrag.retriever.engine.overlap import overlapped
from fusionrag.retriever.engine.pipeline import (STAT_KEYS, DeviceParts, QueryBatch, cut, filter_kind, open_filter_tier,
                                                 passing_share, stat_arrays)
from fusionrag.retriever.engine.pq import ProductQuantizer, code_bytes
from fusionrag.retriever.engine.queries import checked_for_search
from fusionrag.retriever.engine.queries import prepare_queries as prepared
from fusionrag.retriever.engine.tier_choice import TierChoice
from fusionrag.retriever.engine.tiers import (CpuFilterTier, NavigationTier, RerankTier, laid_out_codebooks, load_raw,
                                              raw_in_ram, recorded_navigation)
from fusionrag.retriever.engine.vectors import STORAGE_DTYPES, normalize
from fusionrag.retriever.errors import ConfigError, IndexFormatError, InputError

# The files an index is read from, and whether each is checksummed whole (the page file is too large:
# its per-block CRC table is, and each block is checked as it is read).
REQUIRED_FILES = {"vectors.pages": False, "block_crc.npy": True, "graph.bin": True, "list_offsets.npy": True,
                  "list_ids.npy": True, "pq_codebooks.npy": True, "pq_codes.npy": True, "locations.npy": True}
log = logging.getLogger(__name__)
# A query's nearest posting lists are where its re-ranked candidates, and so its pages, come from:
# only its first HOT_PROBES lists count as visited for choosing the pages to pin.
HOT_PROBES = 8


@dataclass
class SearchResult:
    ids: np.ndarray  # int64 (q, k): row numbers of the source, -1 where fewer than k exist
    distances: np.ndarray  # float32 (q, k), ascending: squared L2, 1 - cos, or -inner product
    stats: dict[str, np.ndarray] = field(default_factory=dict)  # per query, keys STAT_KEYS
    info: dict = field(default_factory=dict)  # which tier implementations served the query



# The columns of native.rerank's stats, in order.
RERANK_STATS = ("minibatches", "reranked", "pages_read", "pages_buffered", "page_mates", "resident_scored",
                "records_cached")


def _rerank_stats(stats: dict[str, np.ndarray], rstats: np.ndarray) -> None:
    for key, column in zip(RERANK_STATS, rstats.T):
        stats[key][:] = column


def prepare_queries(queries, dim: int, metric: str) -> np.ndarray:
    """Query vectors as an index searches them: a non-empty (count, dim) float32 matrix of usable vectors,
    normalised for cosine; InputError saying what is wrong (queries.check_queries, in the index's words).
    PreparedQueries of this dimension and metric are taken as they are. Shared by Index and the sharded router."""
    return prepared(queries, dim, metric).vectors


# buffer_compression 'auto' codes the blocks where they fit at least this many times as many in the same bytes.
COMPRESS_MIN_GAIN = 1.25
COMPRESS_SAMPLE_BLOCKS = 64


def buffer_gain(pages: Path, layout, config: EngineConfig) -> float:
    """The page buffer's compress_gain: how many times as many blocks of this page file it holds zero-run coded
    (native.zero_runs_gain of up to 64 blocks spread over the file), where config.buffer_compression asks for it
    ('on': always, 'auto': from COMPRESS_MIN_GAIN up); 0.0 for a plain buffer."""
    if config.buffer_compression == "off" or not config.buffer_bytes:
        return 0.0
    n = layout.num_blocks
    picks = np.unique(np.linspace(0, n - 1, min(n, COMPRESS_SAMPLE_BLOCKS)).astype(np.int64)) if n else []
    with open(pages, "rb") as f:
        rows = [np.frombuffer(os.pread(f.fileno(), layout.block_bytes, int(b) * layout.block_bytes), np.uint8)
                for b in picks]
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # searches read with O_DIRECT: not kept
    rows = [r for r in rows if len(r) == layout.block_bytes]  # a short file fails the store's own size check
    if not rows:
        return 0.0
    gain = native.zero_runs_gain(np.stack(rows))
    if config.buffer_compression == "on":
        return max(gain, 1.01)
    return gain if gain >= COMPRESS_MIN_GAIN else 0.0


BUFFER_SHARE = 8  # a page buffer takes at most this fraction (1/8) of the memory the process may use
# ... and 1/16 where the index's arrays are memory-mapped for want of room (map_arrays): the codes a scan reads
# every query are worth more of it than the vectors a re-rank may find cached.
MAPPED_BUFFER_SHARE = 16


def fitted_buffer(buffer_bytes: int, path=None, share: int = BUFFER_SHARE) -> int:
    """buffer_bytes, or 1/share of what this process may use (process.memory_limit: its cgroup's limit, else the
    machine's memory) where that is less, so a buffer sized for a server does not take a container's memory
    (#51). Logged when cut."""
    from fusionrag.retriever.process import memory_limit

    limit = memory_limit()
    room = limit // share
    if buffer_bytes > room:
        log.warning("%s: page buffer of %d MiB cut to %d MiB, 1/%d of the %d MiB this process may use",
                    path or "index", buffer_bytes >> 20, room >> 20, share, limit >> 20)
        return room
    return buffer_bytes


def _shared_graph(other: "Index | None", manifest: dict, config: EngineConfig, navigation: str):
    """other's graph where this index's graph file is the same and would be loaded the same way, else None."""
    if other is None:
        return None
    mine, theirs = manifest.get("files", {}).get("graph.bin", {}), other.manifest.get("files", {}).get("graph.bin", {})
    g = other.nav.graph
    if (mine.get("sha256") is None or mine.get("sha256") != theirs.get("sha256")
            or g.quantized != config.graph_sq8 or g.linked != (navigation != "exact")):
        return None
    return g


IN_RAM_FILES = ("pq_codes.npy", "list_ids.npy", "locations.npy", "graph.bin")
MAP_ARRAYS_SHARE = 8  # map_arrays "auto": mapped where the in-RAM files exceed 1/this of what the process may use


def arrays_mapped(config: EngineConfig, path: Path) -> bool:
    """Whether the codes, list IDs and slots are read through memory maps (EngineConfig.map_arrays)."""
    if config.map_arrays != "auto":
        return config.map_arrays == "on"
    from fusionrag.retriever.process import memory_limit

    wanted = sum((Path(path) / name).stat().st_size for name in IN_RAM_FILES)
    return wanted > memory_limit() // MAP_ARRAYS_SHARE


class Index(ManifestShape):
    """A built index, opened. Thread-safe for concurrent `search` calls."""

    def __init__(self, path: Path, manifest: dict, nav: NavigationTier, filter_tier, rerank: RerankTier,
                 config: EngineConfig, params: SearchParams, codes: np.ndarray | None = None,
                 cpu_beside: CpuFilterTier | None = None):
        self.path, self.manifest = path, manifest
        self.nav, self.filter, self.reranker = nav, filter_tier, rerank
        # Under filter_tier 'auto' with CUDA, the CPU tier beside the GPU one, and the measured costs that choose
        # between them call by call (tier_choice.py).
        self.cpu_beside = cpu_beside
        self.choice = TierChoice((filter_tier.name, "cpu")) if cpu_beside is not None else None
        self.config, self.params = config, params
        # The PQ codes on the host (the CPU tier's own array; a memory map under the GPU tiers) and laid-out
        # codebooks, for search_among: taken when first asked for.
        self._codes, self._among_codebooks = codes, None
        # Per posting list: queries that had it among their HOT_PROBES nearest, since opening. Kept only when
        # pages are pinned; racy under concurrent searches, and harmless: it only orders the pinning.
        self.visits = np.zeros(len(filter_tier.list_offsets) - 1, np.int64) if config.pin_fraction > 0 else None
        self._rebalanced_at = 0  # visits summed at the GPU tier's last rebalance
        # The page buffer's budget as opened (config.buffer_bytes, or less where fitted_buffer cut it) and the zero-run
        # gain its blocks are held at (buffer_gain; 0.0: plain): what memory() bounds the buffer's parts by.
        self.buffer_budget, self.buffer_gain = config.buffer_bytes, 0.0
        self._closing = threading.Event()
        self._manager = None
        if config.manager_interval_s > 0 and (self.visits is not None or filter_tier.tiered):
            # The thread holds the index only weakly: one dropped without close() stops it too.
            self._manager = threading.Thread(target=Index._manage, name=f"fusionrag-index-manager {path}",
                                             args=(weakref.ref(self), self._closing, config.manager_interval_s),
                                             daemon=True)
            weakref.finalize(self, self._closing.set)
            self._manager.start()

    @staticmethod
    def build(source, out_dir, config: BuildConfig | None = None, progress: bool | None = None,
              overwrite: bool = False, sample_queries=None, resume: bool = True) -> dict:
        """build.build_index (imported here only: a search never loads the build)."""
        from fusionrag.retriever.engine.build import build_index

        return build_index(source, out_dir, config or BuildConfig(), progress, overwrite,
                           sample_queries=sample_queries, resume=resume)

    @classmethod
    def open(cls, path, config: EngineConfig | None = None, params: SearchParams | None = None,
             graph_of: "Index | None" = None, **engine_overrides) -> "Index":
        """params: the index's default search settings (self.params); None: those its build's calibration
        chose (the manifest's search_defaults, or its search_defaults_ram where the raw vectors are held in RAM),
        else the class defaults. graph_of: an open index (the generation a
        merge grew this one out of) whose navigation graph this one shares, not loads again, where both graph
        files are the same (by their manifests' SHA-256) and were loaded alike: a merge without splits keeps it,
        and a second copy was the largest thing a service held while a merge was published."""
        config = (config or EngineConfig()).with_overrides(**engine_overrides)
        path = Path(path)
        m = read_manifest(path, config.verify, REQUIRED_FILES)
        try:
            count, dim, metric = int(m["count"]), int(m["dim"]), m["metric"]
            engine_metric, dtype = m["internal_metric"], m["storage_dtype"]
            layout = PageLayout(**m["pages"])
            n_lists = int(m["centroids"])
        except (KeyError, TypeError, ValueError) as e:
            raise IndexFormatError(f"{path}: manifest lacks or garbles a field ({e!r})") from e
        threads = cpu_threads(config.threads)
        navigation = recorded_navigation(m, n_lists, dim + (metric == "ip"), path)
        graph = _shared_graph(graph_of, m, config, navigation)
        try:  # an index that navigates exactly never follows the graph's links: they stay on disk
            graph = graph or native.Graph.load(str(path / "graph.bin"), quantize=config.graph_sq8,
                                               links=navigation != "exact")
        except ValueError as e:
            raise IndexFormatError(str(e)) from e
        mapped = arrays_mapped(config, path)
        offsets = load_array(path, "list_offsets.npy", np.int64, 1)
        list_ids = load_array(path, "list_ids.npy", np.uint32, 1, mmap=mapped)
        codebooks = load_array(path, "pq_codebooks.npy", np.float32, 3)
        code_width = code_bytes(codebooks.shape[0], codebooks.shape[1])
        if codebooks.shape[1] == 16 and filter_kind(config) == "gpu" and config.gpu_search == "lists":
            # 4-bit codes (BuildConfig.pq_bits) are scanned by the CPU tier and the device tier, not the lists tier.
            if config.filter_tier == "gpu":
                raise ConfigError(f"{path}: the index's PQ codes are 4-bit (pq_bits 4, or kept by the build's "
                                  "measurement), which the lists tier (gpu_search 'lists') does not scan: open it "
                                  "with gpu_search 'device' or 'auto', or filter_tier 'cpu', or build it with "
                                  "pq_bits 8")
            config = config.with_overrides(filter_tier="cpu")
        # The GPU tiers copy the codes to the device (the lists tier keeps the cold ones in pinned memory): a memory
        # map, not a second copy in the heap.
        codes = load_array(path, "pq_codes.npy", np.uint8, 2, mmap=filter_kind(config) == "gpu" or mapped)
        locations = load_array(path, "locations.npy", np.uint32, 1, mmap=mapped)
        block_crc = load_array(path, "block_crc.npy", np.uint32, 1)
        problems = [
            graph.size != n_lists and f"graph has {graph.size} nodes, manifest says {n_lists}",
            graph.dim != dim + (metric == "ip") and f"graph dimension {graph.dim} does not fit dimension {dim}",
            len(offsets) != n_lists + 1 and "list_offsets.npy does not match the list count",
            (len(offsets) and (offsets[0] != 0 or offsets[-1] != len(list_ids) or np.any(np.diff(offsets) < 0)))
            and "list_offsets.npy is not a valid CSR offset array",
            len(list_ids) and int(list_ids.max()) >= count and "list_ids.npy holds ids beyond the vector count",
            codes.shape[0] != count and "pq_codes.npy does not hold one code per vector",
            codes.shape[1] != code_width and "pq_codes.npy and pq_codebooks.npy disagree on M",
            (codebooks.shape[1] not in (256, 16) or codebooks.shape[0] * codebooks.shape[2] < dim
             or codebooks.shape[1] == 16 and codebooks.shape[0] > 256) and "pq_codebooks.npy has the wrong shape",
            len(locations) != count and "locations.npy does not hold one slot per vector",
            len(block_crc) != layout.num_blocks and "block_crc.npy does not match the page file's block count",
            len(locations) and int(locations.max()) >= layout.num_blocks * layout.records_per_block
            and "locations.npy points beyond the page file",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise IndexFormatError(f"{path}: inconsistent index: " + "; ".join(problems))
        defaults = None if params is not None else calibrated_defaults(m, path)  # what its build's calibration chose
        device = None  # what the GPU's device tier takes beside the filter tier's arrays
        if filter_kind(config) == "gpu":
            stored = {v: k for k, v in STORAGE_DTYPES.items()}[dtype]
            device = DeviceParts(graph.vectors, metric == "ip",
                                 raw_reader(path / "vectors.pages", layout, locations, stored, dim), dim)
        raw = None
        try:
            room = fitted_buffer(config.buffer_bytes, path, MAPPED_BUFFER_SHARE if mapped else BUFFER_SHARE)
            # Where the budget holds the raw vectors (EngineConfig.raw_in_ram), they are its one tenant: the page
            # buffer is not opened, so nothing is held twice.
            resident = raw_in_ram(config.raw_in_ram, count, layout.record_bytes, room)
            gain = 0.0 if resident else buffer_gain(path / "vectors.pages", layout, config)
            buffer_blocks, cache_records, adaptive = (0, 0, False) if resident else split_buffer(
                room, config, layout, gain > 1, gain)
            store = native.PageStore(str(path / "vectors.pages"), layout.record_bytes, layout.records_per_block,
                                     layout.pages_per_block, block_crc, buffer_blocks, config.io_backend,
                                     config.direct_io, config.io_threads, config.buffer_policy, cache_records,
                                     adaptive, gain)
            if resident:
                raw = load_raw(store, locations, count)
        except (OSError, RuntimeError, ValueError) as e:
            raise IndexFormatError(f"{path}: cannot open the SSD tier: {e}") from e
        if defaults is not None:
            params = defaults[int(resident)]
        filter_tier = open_filter_tier(config, offsets, list_ids, codes, codebooks, threads, str(path), engine_metric,
                                       device)
        cpu_beside = None
        if config.filter_tier == "auto" and filter_tier.name != "cpu":  # a GPU box is never slower than its CPUs
            cpu_beside = open_filter_tier(config.with_overrides(filter_tier="cpu"), offsets, list_ids, codes,
                                          codebooks, threads, str(path), engine_metric)
        index = cls(
            path, m,
            NavigationTier(graph, metric == "ip", threads, navigation, load_probe_model(path, m), np.diff(offsets)),
            filter_tier,
            RerankTier(store, locations, dtype, engine_metric, threads, config.rerank_inflight, config.page_mates,
                       config.rerank_prefetch, raw),
            config, params, codes, cpu_beside,
        )
        index.buffer_budget, index.buffer_gain = room, gain
        return index

    def __len__(self) -> int:
        return self.count

    def memory_parts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(host parts, mapped parts): the bytes of every part a search of this index holds in host memory, by
        name, and of the arrays read through memory maps (EngineConfig.map_arrays; the page cache's, resident as
        searches read them, at most their files' bytes). The page buffer's parts are what it holds full, within
        buffer_budget; search_scratch is the process's (native.scratch_bytes(): every thread that searched keeps
        its kernels' scratch, docs/design.md), not this index's alone. A GPU tier's device memory is not here
        (memory()["filter"]); its pinned host part is."""
        nav, rr, f, store = self.nav, self.reranker, self.filter, self.reranker.store
        arrays = {"list_offsets": f.list_offsets, "list_ids": f.list_ids, "slot_map": rr.locations}
        if f.name == "cpu":
            arrays["pq_codes"] = f.codes
        host = {"navigation_graph": int(nav.memory_bytes())}
        mapped = {}
        for name, a in arrays.items():
            (mapped if isinstance(a, np.memmap) else host)[name] = int(a.nbytes)
        host["list_sizes"] = int(nav.list_sizes.nbytes) if nav.list_sizes is not None else 0
        host["block_crc"] = int(store.num_blocks * 4) if store is not None else 0
        if f.name == "cpu":
            host["pq_codebooks"] = int(f.codebooks.nbytes)
        elif hasattr(f, "host_pinned_bytes"):
            host["pq_host_pinned"] = int(f.host_pinned_bytes())
        if self.cpu_beside is not None:  # scans the codes file memory-mapped
            mapped["cpu_beside_pq_codes"] = int(self.cpu_beside.codes.nbytes)
        if self.visits is not None:
            host["list_visits"] = int(self.visits.nbytes)
        if nav.model is not None:
            host["probe_model"] = int(sum(a.nbytes for a in vars(nav.model).values() if isinstance(a, np.ndarray)))
        if store is not None:
            # The layout on (an adaptive layout's other one holds nothing), its bookkeeping, and the miniatures.
            layout = PageLayout(**self.manifest["pages"])
            records_on = store.layout == "records"
            blocks, records = store.buffer_capacity, store.record_cache_capacity
            host["page_buffer"] = int(store.buffer_bytes)
            host["record_cache"] = int(store.record_cache_bytes)  # records and their metadata
            host["page_buffer_metadata"] = int(
                held_bytes(blocks, records, store.adaptive_layout, layout, store.buffer_policy, self.buffer_gain,
                           records_on) - host["page_buffer"] - host["record_cache"])
        if rr.resident:  # the raw vectors in RAM (EngineConfig.raw_in_ram), in place of the page buffer
            host["raw_vectors"] = rr.memory_bytes()
        host["search_scratch"] = int(native.scratch_bytes())
        return host, mapped

    def memory(self, params: SearchParams | SearchOverrides | dict | None = None, queries: int | None = None,
               k: int = 10) -> dict:
        """Bytes held per tier (docs/design.md, "The three tiers"), and every part a search holds (memory_parts,
        and search_call: what a call of `queries` queries (default: one internal batch) at `params` (default: the
        index's) holds at most while it runs, memory.search_call_bytes): parts, mapped (by name), total_bytes
        (their sum: what a process searching this index alone holds for it beyond the engine's code, as the
        benchmark runner's net search RSS measures it) and buffer_budget_bytes (what the page buffer, its
        bookkeeping and the record cache stay within). docs/engine.md, "Memory a search holds"."""
        nav, rr, f = self.nav, self.reranker, self.filter
        host = (nav.memory_bytes() + f.list_offsets.nbytes + f.list_ids.nbytes + rr.locations.nbytes
                + rr.store.num_blocks * 4)
        parts, mapped = self.memory_parts()
        p = resolve_params(params, self.params)
        parts["search_call"] = search_call_bytes(
            f.batch_size if queries is None else int(queries), k, p.nprobe, p.rerank, self.dim, f.batch_size,
            len(f.list_offsets) - 1, bool(getattr(f, "overlaps", False)), len(STAT_KEYS))
        return {
            "parts": parts,
            "mapped": mapped,
            "total_bytes": int(sum(parts.values()) + sum(mapped.values())),
            "buffer_budget_bytes": int(self.buffer_budget),
            "host_index_bytes": int(host),
            "pq_bytes": int(f.memory_bytes()),
            "pq_tier": f.name,
            # The codes and list IDs through memory maps (EngineConfig.map_arrays): page cache, not heap.
            "pq_mapped": isinstance(getattr(f, "codes", None), np.memmap),
            "lists_mapped": isinstance(f.list_ids, np.memmap),
            "filter": f.describe(),
            "page_buffer_bytes": int(rr.store.buffer_bytes),
            "page_buffer_compressed": bool(rr.store.buffer_compressed),
            "record_cache_bytes": int(rr.store.record_cache_bytes),
            "raw_in_ram": rr.resident,
            "raw_vectors_bytes": rr.memory_bytes(),
            "ssd_bytes": int((self.path / "vectors.pages").stat().st_size),
        } | ({} if self.cpu_beside is None else {
            # The CPU tier beside a GPU one scans the codes file memory-mapped: page cache, resident as it reads.
            "cpu_beside_pq_mapped_bytes": int(self.cpu_beside.memory_bytes()),
            "filter_choice": self.choice.describe(),
        })

    @property
    def pq(self) -> ProductQuantizer:
        """The index's product quantizer (a merge encodes new vectors with it), read from its file when asked:
        searches use the filter tier's own laid-out codebooks, and a copy kept here was dim x 1 KiB of host
        memory per opened index for nothing."""
        return ProductQuantizer(load_array(self.path, "pq_codebooks.npy", np.float32, 3), self.dim)

    def prepare_queries(self, queries) -> np.ndarray:
        return prepare_queries(queries, self.dim, self.metric)

    def search(self, queries, k: int = 10, params: SearchParams | SearchOverrides | dict | None = None,
               exclude: np.ndarray | None = None, passing: float | None = None, **overrides) -> SearchResult:
        """Top-k of each query with exact distances; see SearchParams for the knobs. params: all of them, or the
        knobs to change (SearchOverrides, a dict) of the index's defaults (self.params). exclude: a
        bitmap (uint8[ceil(count/8)], bit i little-endian) of vectors never to return; the lists probed widen
        by the share it lets through (config.probe_widening), counted from it unless the caller knows it
        (passing: a collection counts its live rows anyway). queries: PreparedQueries (a collection's) are
        searched as they are; anything else is checked first."""
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"k must be a positive integer, got {k!r}")
        p = resolve_params(params, self.params).with_overrides(**overrides)
        q, unit_pending = checked_for_search(queries, self.dim, self.metric)
        share = 1.0 if exclude is None else passing_share(exclude, self.count) if passing is None else passing
        chosen = self.choice.choose(len(q)) if self.choice is not None else 0
        f = self.filter if chosen == 0 else self.cpu_beside
        t = time.perf_counter()
        ids, dists, stats, batches = cut(q, k, p, exclude, f.batch_size, unit_pending=unit_pending, passing=share)
        if getattr(f, "navigates", False) and p.probe != "learned":
            # The whole batch on the device; where the raw vectors are not there, the host re-ranks batch b
            # while the device searches batch b+1.
            overlapped(batches, lambda b: b.ready(), self._device_stage, self._rerank_or_done)
        elif len(batches) > 1 and f.overlaps:
            # The CPU searches the graph and re-ranks while the GPU filters the batch between; on the CPU
            # tier (pipeline), one batch's re-rank waits on the SSD while the next is scanned.
            overlapped(batches, self._graph_stage, partial(self._filter_stage, f=f), self._rerank_stage,
                       middle_workers=f.in_flight)
        else:
            for b in batches:
                self._rerank_stage(self._filter_stage(self._graph_stage(b), f))
        info = {**f.describe(), "io_backend": self.reranker.store.backend,
                "direct_io": bool(self.reranker.store.direct), "buffer_policy": self.reranker.store.buffer_policy,
                "raw_in_ram": self.reranker.resident}
        if self.choice is not None:
            self.choice.record(chosen, len(q), time.perf_counter() - t)
            info["chosen_by_cost"] = True
        return self._result(ids, dists, stats, info)

    def crossover(self) -> int | None:
        """Under filter_tier 'auto' with CUDA: the call size from which the GPU tier is measured cheaper per query
        than the CPU tier beside it (TierChoice.crossover); None otherwise, or until measured."""
        return None if self.choice is None else self.choice.crossover()

    def search_lists(self, queries, lists, k: int = 10, params: SearchParams | SearchOverrides | dict | None = None,
                     exclude: np.ndarray | None = None, **overrides) -> SearchResult:
        """search() over the posting lists given per query (integer (q, m), -1 where none) instead of
        the navigation graph's: a shard of a sharded index searches the lists its router sends it."""
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"k must be a positive integer, got {k!r}")
        p = resolve_params(params, self.params).with_overrides(**overrides)
        q, unit_pending = checked_for_search(queries, self.dim, self.metric)
        lists = np.asarray(lists)
        if lists.ndim != 2 or len(lists) != len(q) or lists.dtype.kind not in "iu":
            raise InputError(f"lists must be an integer ({len(q)}, m) array, got {lists.dtype} {lists.shape}")
        lists = np.ascontiguousarray(lists, dtype=np.int32)
        ids, dists, stats, batches = cut(q, k, p, exclude, self.filter.batch_size, lists, unit_pending)
        for b in batches:
            self._rerank_stage(self._filter_stage(b))
        return self._result(ids, dists, stats, dict(self.filter.describe()))

    def search_among(self, queries, ids, k: int = 10, params: SearchParams | SearchOverrides | dict | None = None,
                     **overrides) -> SearchResult:
        """Top-k of each query among the given vector ids only (a metadata filter's passing vectors): every one
        of them scored by PQ from the codes in host RAM, then each query's best n (params.rerank, at least k)
        re-ranked exactly from the SSD as a search's candidates are (its mini-batches and early stop). No list
        is probed, so none of them is lost to the probe, and where n >= len(ids) the answer is exact. Its cost
        grows with len(ids) (~1 ns a PQ sub-code), a search's does not: for the filters few vectors pass."""
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"k must be a positive integer, got {k!r}")
        p = resolve_params(params, self.params).with_overrides(**overrides)
        q, unit_pending = checked_for_search(queries, self.dim, self.metric)
        if unit_pending:
            q = normalize(q)
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or (len(ids) and (ids.min() < 0 or ids.max() >= self.count)):
            raise InputError(f"ids must be vector ids in [0, {self.count}), one dimension")
        # A filter's rows come sorted and distinct (np.flatnonzero): checked in ~20 us, where np.unique's hash and
        # sort took 2.6 ms of a 4.8 ms call over 20,000 ids (GloVe, 1 thread).
        if len(ids) > 1 and not (ids[1:] > ids[:-1]).all():
            ids = np.unique(ids)
        ids = ids.astype(np.int64, copy=False)
        nq, n = len(q), min(max(p.rerank, k), len(ids))
        out_ids = np.full((nq, k), -1, np.int64)
        out_d = np.full((nq, k), np.inf, np.float32)
        stats = stat_arrays(nq)
        info = {"filter_tier": "cpu", "among": True}  # PQ on the host, whatever tier the index's searches use
        if n == 0:
            return self._result(out_ids, out_d, stats, info)
        codes, codebooks = self._among_parts()
        metric = self.manifest["internal_metric"]
        four = isinstance(codebooks, native.Pq4Codebooks)
        t = time.perf_counter()
        luts = None if four else native.pq_luts(q, codebooks, metric, self.nav.threads)
        lut_s = time.perf_counter() - t  # 4-bit: each query's table is built inside pq4_distances
        cand = np.empty((nq, n), np.int64)
        for i in range(nq):  # one query's distances at a time: (1, len(ids)), not a (q, len(ids)) copy of the ids
            if four:
                d = native.pq4_distances(q[i:i + 1], codebooks, metric, ids[None, :], codes, self.nav.threads)[0]
            else:
                d = native.pq_distances(luts[i:i + 1], ids[None, :], codes, self.nav.threads)[0]
            best = np.argpartition(d, n - 1)[:n] if n < len(ids) else np.arange(len(ids))
            cand[i] = ids[best[np.argsort(d[best], kind="stable")]]
        scan_s = time.perf_counter() - t - lut_s
        got, dists, rstats, rsec = self.reranker.rerank(q, cand, k, p)
        out_ids[:], out_d[:] = got, dists
        stats["candidates"][:] = stats["unique_candidates"][:] = len(ids)
        _rerank_stats(stats, rstats)
        stats["lut_s"][:], stats["scan_s"][:], stats["rerank_s"][:] = lut_s / nq, scan_s / nq, rsec
        return self._result(out_ids, out_d, stats, info)

    def _among_parts(self):
        """(host PQ codes, laid-out codebooks) for search_among: the CPU tier's own; under a GPU tier, which holds
        them on the device, the codes file memory-mapped and the codebooks laid out once."""
        if self._among_codebooks is None:
            if self._codes is None:
                self._codes = load_array(self.path, "pq_codes.npy", np.uint8, 2, mmap=True)
            own = getattr(self.filter, "codebooks", None)
            self._among_codebooks = own if isinstance(own, (native.PqCodebooks, native.Pq4Codebooks)) else \
                laid_out_codebooks(load_array(self.path, "pq_codebooks.npy", np.float32, 3))
        return self._codes, self._among_codebooks

    def _result(self, ids, dists, stats, info) -> SearchResult:
        if self.metric == "cosine":
            dists /= 2  # squared L2 between unit vectors is 2 - 2cos
        return SearchResult(ids, dists, stats, info)

    def _graph_stage(self, b: QueryBatch) -> QueryBatch:
        """The coarse quantizer: each query's posting lists by the navigation graph."""
        b.lists, b.probed, b.graph_s = self.nav.probe(b.ready().queries, b.params, b.passing)
        return b

    def _filter_stage(self, b: QueryBatch, f=None) -> QueryBatch:
        """The codec: PQ tables, then each query's top-n candidates in its lists (on f, else the filter tier)."""
        f = f or self.filter
        if self.visits is not None:
            near = b.lists[:, :HOT_PROBES]
            self.visits += np.bincount(near[near >= 0], minlength=len(self.visits))
        t = time.perf_counter()
        tables = f.tables(b.ready().queries)
        b.lut_s = time.perf_counter() - t
        b.candidates = f.topn(tables, b.lists, b.n, b.exclude)
        b.lists = None  # a call's batches live until it returns: what a batch is done with goes now
        return b

    def _device_stage(self, b: QueryBatch) -> QueryBatch:
        """Navigation, lists, scan, top-n and (where the raw vectors are on the device) the re-rank, on the device."""
        d = self.filter.search(b.queries, b.params, b.n, b.k, b.exclude, passing=b.passing)
        b.probed = d.probed
        b.candidates = Candidates(d.ids, d.dists, d.gathered, d.unique, np.full(len(b.queries), d.seconds /
                                                                                 max(1, len(b.queries))))
        b.final = d.final
        return b

    def _rerank_or_done(self, b: QueryBatch) -> None:
        if not b.final:
            return self._rerank_stage(b)
        cand, st = b.candidates, b.stats
        k = b.ids.shape[1]
        b.ids[:] = -1
        b.distances[:] = np.inf
        w = min(k, cand.ids.shape[1])
        b.ids[:, :w], b.distances[:, :w] = cand.ids[:, :w], cand.pq_dists[:, :w]
        st["lists_probed"][:] = b.probed
        st["candidates"][:] = cand.gathered
        st["unique_candidates"][:] = cand.unique
        st["reranked"][:] = np.minimum(cand.unique, b.n)
        st["scan_s"][:] = cand.seconds
        b.candidates = b.probed = b.queries = None

    def _rerank_stage(self, b: QueryBatch) -> None:
        """The refinement: exact distances from the SSD, written into the batch's rows of the results."""
        cand, st = b.candidates, b.stats
        ids, dists, rstats, rsec = self.reranker.rerank(b.queries, cand.ids, b.k, b.params)
        b.ids[:], b.distances[:] = ids, dists
        st["lists_probed"][:] = b.probed
        st["candidates"][:] = cand.gathered
        st["unique_candidates"][:] = cand.unique
        _rerank_stats(st, rstats)
        # Graph search and tables built before topn are timed per batch; their share is spread
        # evenly. Tables the filter tier builds inside topn (CPU) are timed per query.
        st["graph_s"][:] = b.graph_s / len(b.queries)
        st["lut_s"][:] = b.lut_s / len(b.queries) + cand.lut_seconds
        st["scan_s"][:] = cand.seconds
        st["rerank_s"][:] = rsec
        # ~5 KB a query at rerank=400 and the batch's normalised queries: a 1000-query call held them all before
        b.candidates = b.probed = b.queries = None

    def read_vectors(self, ids) -> np.ndarray:
        """The stored vectors of these vector ids (float32 (n, dim): as the index holds them, unit length under
        cosine), read from the page file with plain reads: for answers that ask for vectors back, not for a
        search's re-rank."""
        layout = PageLayout(**self.manifest["pages"])
        dtype = np.dtype({v: k for k, v in STORAGE_DTYPES.items()}[self.reranker.dtype])
        if self.reranker.resident:
            rows = self.reranker.raw[np.asarray(ids, dtype=np.int64)]
            return rows[:, :self.dim * dtype.itemsize].copy().view(dtype).astype(np.float32)
        slots = self.reranker.locations[np.asarray(ids, dtype=np.int64)].astype(np.int64)
        out = np.empty((len(slots), self.dim), np.float32)
        with open(self.path / "vectors.pages", "rb") as fh:
            for n, s in enumerate(slots.tolist()):
                at = (s // layout.records_per_block) * layout.block_bytes + (s % layout.records_per_block) * \
                    layout.record_bytes
                out[n] = np.frombuffer(os.pread(fh.fileno(), self.dim * dtype.itemsize, at), dtype)
        return out

    def hot_blocks(self, count: int) -> np.ndarray:
        """The page-file blocks most visited through the posting lists (self.visits), hottest first, up to
        count blocks (uint32): a block scores the visits of every list holding one of its vectors, so the
        pages of the hottest lists come first, and among them the pages those lists share."""
        f, rr = self.filter, self.reranker
        if self.visits is None or count <= 0:
            return np.empty(0, np.uint32)
        lens = np.diff(f.list_offsets)
        score = np.bincount(rr.locations[f.list_ids] // rr.store.records_per_block,
                            weights=np.repeat(self.visits.astype(np.float64), lens), minlength=rr.store.num_blocks)
        n = min(count, int(np.count_nonzero(score)))
        if n == 0:
            return np.empty(0, np.uint32)
        top = np.argpartition(-score, n - 1)[:n]
        return top[np.argsort(-score[top], kind="stable")].astype(np.uint32)

    def refresh_hotness(self) -> dict:
        """One round of the index manager: pin the pages of the hottest posting lists (pin_fraction of
        the page buffer) and, when the GPU tier holds only its hottest lists' codes and queries came since
        the last round, let it re-place them (GpuFilterTier.rebalance). Never called on the request path:
        the manager thread calls it every manager_interval_s seconds."""
        done = {}
        store = self.reranker.store
        if self.visits is not None and store is not None:
            want = self.hot_blocks(int(self.config.pin_fraction * store.buffer_capacity))
            done["pinned"] = int(store.pin(want)) if len(want) else 0
        if self.filter.tiered:
            seen = int(self.filter.visits.sum())
            if seen != self._rebalanced_at:
                self.filter.rebalance()
                self._rebalanced_at = seen
                done["rebalanced"] = True
        return done

    @staticmethod
    def _manage(ref, closing: threading.Event, interval: float) -> None:
        while not closing.wait(interval):
            index = ref()
            if index is None:
                return
            try:
                index.refresh_hotness()
            except Exception:  # a failed round must not end the thread; the next may succeed
                if not closing.is_set():
                    log.exception("%s: index manager round failed", index.path)
            del index

    def close(self) -> None:
        """Give back what the tiers hold (GPU memory to the process's budget); call it once no search
        runs on this index, as Collection does when it retires a generation. Stops the index manager
        thread first."""
        self._closing.set()
        if self._manager is not None:
            self._manager.join()
            self._manager = None
        self.filter.close()
        self.reranker.store = None
        self.reranker.raw = None  # the raw vectors in RAM (raw_in_ram), given back with the generation
