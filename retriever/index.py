"""An index opened for search: the three tiers behind one `search` call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fusionrag import native
from fusionrag.retriever.build import build_index
from fusionrag.retriever.config import BuildConfig, EngineConfig, SearchParams, cpu_threads
from fusionrag.retriever.errors import IndexFormatError, InputError
from fusionrag.retriever.layout import PageLayout
from fusionrag.retriever.manifest import load_array, read_manifest
from fusionrag.retriever.overlap import overlapped
from fusionrag.retriever.pq import ProductQuantizer
from fusionrag.retriever.tiers import NavigationTier, RerankTier, open_filter_tier
from fusionrag.retriever.vectors import check_vectors, normalize

# The files an index is read from, and whether each is checksummed whole (the page file is too large:
# its per-block CRC table is, and each block is checked as it is read).
REQUIRED_FILES = {"vectors.pages": False, "block_crc.npy": True, "graph.bin": True, "list_offsets.npy": True,
                  "list_ids.npy": True, "pq_codebooks.npy": True, "pq_codes.npy": True, "locations.npy": True}
STAT_KEYS = ("centroids_probed", "candidates", "unique_candidates", "minibatches", "reranked",
             "page_mates", "pages_read", "pages_buffered", "graph_s", "lut_s", "scan_s", "rerank_s")


@dataclass
class SearchResult:
    ids: np.ndarray  # int64 (q, k): row numbers of the source, -1 where fewer than k exist
    distances: np.ndarray  # float32 (q, k), ascending: squared L2, 1 - cos, or -inner product
    stats: dict[str, np.ndarray] = field(default_factory=dict)  # per query, keys STAT_KEYS
    info: dict = field(default_factory=dict)  # which tier implementations served the query


class Index:
    """A built index, opened. Thread-safe for concurrent `search` calls."""

    def __init__(self, path: Path, manifest: dict, nav: NavigationTier, pq: ProductQuantizer,
                 filter_tier, rerank: RerankTier, config: EngineConfig, params: SearchParams):
        self.path, self.manifest = path, manifest
        self.nav, self.pq, self.filter, self.reranker = nav, pq, filter_tier, rerank
        self.config, self.params = config, params

    @staticmethod
    def build(source, out_dir, config: BuildConfig | None = None, progress: bool | None = None,
              overwrite: bool = False) -> dict:
        return build_index(source, out_dir, config or BuildConfig(), progress, overwrite)

    @classmethod
    def open(cls, path, config: EngineConfig | None = None, params: SearchParams | None = None,
             **engine_overrides) -> "Index":
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
        try:
            graph = native.Graph.load(str(path / "graph.bin"), quantize=config.graph_sq8)
        except ValueError as e:
            raise IndexFormatError(str(e)) from e
        offsets = load_array(path, "list_offsets.npy", np.int64, 1)
        list_ids = load_array(path, "list_ids.npy", np.uint32, 1)
        codebooks = load_array(path, "pq_codebooks.npy", np.float32, 3)
        codes = load_array(path, "pq_codes.npy", np.uint8, 2)
        locations = load_array(path, "locations.npy", np.uint32, 1)
        block_crc = load_array(path, "block_crc.npy", np.uint32, 1)
        problems = [
            graph.size != n_lists and f"graph has {graph.size} nodes, manifest says {n_lists}",
            graph.dim != dim + (metric == "ip") and f"graph dimension {graph.dim} does not fit dimension {dim}",
            len(offsets) != n_lists + 1 and "list_offsets.npy does not match the list count",
            (len(offsets) and (offsets[0] != 0 or offsets[-1] != len(list_ids) or np.any(np.diff(offsets) < 0)))
            and "list_offsets.npy is not a valid CSR offset array",
            len(list_ids) and int(list_ids.max()) >= count and "list_ids.npy holds ids beyond the vector count",
            codes.shape[0] != count and "pq_codes.npy does not hold one code per vector",
            codes.shape[1] != codebooks.shape[0] and "pq_codes.npy and pq_codebooks.npy disagree on M",
            codebooks.shape[1] != 256 or codebooks.shape[0] * codebooks.shape[2] < dim and "pq_codebooks.npy has the wrong shape",
            len(locations) != count and "locations.npy does not hold one slot per vector",
            len(block_crc) != layout.num_blocks and "block_crc.npy does not match the page file's block count",
            len(locations) and int(locations.max()) >= layout.num_blocks * layout.records_per_block
            and "locations.npy points beyond the page file",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise IndexFormatError(f"{path}: inconsistent index: " + "; ".join(problems))
        buffer_blocks = config.buffer_bytes // layout.block_bytes
        try:
            store = native.PageStore(str(path / "vectors.pages"), layout.record_bytes, layout.records_per_block,
                                     layout.pages_per_block, block_crc, buffer_blocks, config.io_backend,
                                     config.direct_io, config.io_threads)
        except (OSError, RuntimeError, ValueError) as e:
            raise IndexFormatError(f"{path}: cannot open the SSD tier: {e}") from e
        return cls(
            path, m,
            NavigationTier(graph, metric == "ip", threads),
            ProductQuantizer(codebooks, dim),
            open_filter_tier(config, offsets, list_ids, codes, codebooks, threads, str(path), engine_metric),
            RerankTier(store, locations, dtype, engine_metric, threads, config.rerank_inflight, config.page_mates),
            config, params or SearchParams(),
        )

    @property
    def count(self) -> int:
        return int(self.manifest["count"])

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @property
    def metric(self) -> str:
        return self.manifest["metric"]

    def __len__(self) -> int:
        return self.count

    def memory(self) -> dict:
        """Bytes held per tier (DESIGN.md's table)."""
        nav, rr, f = self.nav, self.reranker, self.filter
        host = (nav.memory_bytes() + f.list_offsets.nbytes + f.list_ids.nbytes + rr.locations.nbytes
                + rr.store.num_blocks * 4)
        return {
            "host_index_bytes": int(host),
            "pq_bytes": int(f.memory_bytes() + self.pq.codebooks.nbytes),
            "pq_tier": f.name,
            "filter": f.describe(),
            "page_buffer_bytes": int(rr.store.buffer_bytes),
            "ssd_bytes": int((self.path / "vectors.pages").stat().st_size),
        }

    def prepare_queries(self, queries) -> np.ndarray:
        q = np.asarray(queries)
        if q.ndim == 1:
            q = q[None, :]
        if q.ndim != 2 or q.shape[0] == 0:
            raise InputError(f"queries must be a non-empty (count, {self.dim}) array, got shape {q.shape}")
        if q.dtype.kind not in "fiu":
            raise InputError(f"queries must be numeric, got {q.dtype}")
        if q.shape[1] != self.dim:
            raise InputError(f"queries have dimension {q.shape[1]}, the index has dimension {self.dim}")
        q = np.ascontiguousarray(q, dtype=np.float32)
        check_vectors(q, self.metric, "queries")
        if self.metric == "cosine":
            q = normalize(q)
        return q

    def search(self, queries, k: int = 10, params: SearchParams | None = None, exclude: np.ndarray | None = None,
               **overrides) -> SearchResult:
        """Top-k of each query with exact distances; see SearchParams for the knobs. exclude: a
        bitmap (uint8[ceil(count/8)], bit i little-endian) of vectors never to return."""
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"k must be a positive integer, got {k!r}")
        p = (params or self.params).with_overrides(**overrides)
        q = self.prepare_queries(queries)
        nq = len(q)
        ids = np.empty((nq, k), dtype=np.int64)
        dists = np.empty((nq, k), dtype=np.float32)
        stats = {key: np.zeros(nq, dtype=np.float64 if key.endswith("_s") else np.int64) for key in STAT_KEYS}
        bs = self.config.batch_for(self.filter.name)
        batches = [slice(s, min(nq, s + bs)) for s in range(0, nq, bs)]

        def outputs(sl):
            return ids[sl], dists[sl], {key: v[sl] for key, v in stats.items()}

        if self.filter.name == "gpu" and len(batches) > 1:
            # The CPU searches the graph and re-ranks while the GPU filters the batch between.
            overlapped(batches,
                       lambda sl: (sl, self.nav.probe(q[sl], p)),
                       lambda job: (job[0], self._filter_stage(q[job[0]], k, p, exclude, *job[1])),
                       lambda job: self._rerank_stage(q[job[0]], k, p, *outputs(job[0]), *job[1]),
                       middle_workers=self.filter.in_flight)
        else:
            for sl in batches:
                self._search_batch(q[sl], k, p, exclude, *outputs(sl))
        if self.metric == "cosine":
            dists /= 2  # squared L2 between unit vectors is 2 - 2cos
        info = {**self.filter.describe(), "io_backend": self.reranker.store.backend,
                "direct_io": bool(self.reranker.store.direct)}
        return SearchResult(ids, dists, stats, info)

    def _search_batch(self, q, k, p, exclude, ids_out, dists_out, st) -> None:
        self._rerank_stage(q, k, p, ids_out, dists_out, st,
                           *self._filter_stage(q, k, p, exclude, *self.nav.probe(q, p)))

    def _filter_stage(self, q, k, p, exclude, lists, probed, t_graph):
        t = time.perf_counter()
        luts = self.filter.luts(self.pq, q, self.reranker.metric)
        t_lut = time.perf_counter() - t
        return self.filter.topn(luts, lists, max(p.rerank, k), exclude), probed, t_graph, t_lut

    def _rerank_stage(self, q, k, p, ids_out, dists_out, st, cand, probed, t_graph, t_lut) -> None:
        ids, dists, rstats, rsec = self.reranker.rerank(q, cand.ids, k, p)
        ids_out[:], dists_out[:] = ids, dists
        st["centroids_probed"][:] = probed
        st["candidates"][:] = cand.gathered
        st["unique_candidates"][:] = cand.unique
        st["minibatches"][:], st["reranked"][:] = rstats[:, 0], rstats[:, 1]
        st["pages_read"][:], st["pages_buffered"][:], st["page_mates"][:] = rstats[:, 2], rstats[:, 3], rstats[:, 4]
        # Graph search and tables built before topn are timed per batch; their share is spread
        # evenly. Tables the filter tier builds inside topn (CPU) are timed per query.
        st["graph_s"][:] = t_graph / len(q)
        st["lut_s"][:] = t_lut / len(q) + cand.lut_seconds
        st["scan_s"][:] = cand.seconds
        st["rerank_s"][:] = rsec

    def close(self) -> None:
        """Give back what the tiers hold (GPU memory to the process's budget); call it once no search
        runs on this index, as Collection does when it retires a generation."""
        self.filter.close()
        self.reranker.store = None
