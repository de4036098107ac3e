"""Typed configuration, validated at the edge (CLI, HTTP, Python callers) so the engine can trust it."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace

from fusionrag.retriever.errors import ConfigError

METRICS = ("l2", "ip", "cosine")
IO_BACKENDS = ("auto", "io_uring", "pread")
DIRECT_IO = ("auto", "on", "off")
FILTER_TIERS = ("auto", "cpu", "gpu")
BUFFER_POLICIES = ("clock", "lfu")
# Automatic EngineConfig.batch_size per filter tier.
CPU_BATCH, GPU_BATCH = 64, 1024


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


class _Config:
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        _check(not unknown, f"unknown {cls.__name__} option(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def with_overrides(self, **kw):
        """A copy with the non-None keyword arguments applied (and validated)."""
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


@dataclass(frozen=True)
class BuildConfig(_Config):
    """How an index is built. Defaults are meant to be good on real data without tuning."""

    metric: str = "l2"
    # Posting lists: about count * centroid_ratio centroids, so lists of ~1/ratio vectors.
    centroid_ratio: float = 0.1
    # A list is split again while larger than this multiple of its target size.
    max_list_factor: float = 2.0
    kmeans_branching: int = 16
    kmeans_iters: int = 12
    # Boundary replication: v joins list i if dist(v, c_i) <= (1 + eps) * dist(v, c_1).
    replica_eps: float = 0.1
    max_replicas: int = 8
    # PQ code bytes per vector; 0 picks one byte per 2 dimensions (at most 64).
    pq_m: int = 0
    pq_train_size: int = 32768
    graph_m: int = 16
    graph_ef_construction: int = 200
    threads: int = 0
    seed: int = 0

    def __post_init__(self):
        _check(self.metric in METRICS, f"metric must be one of {METRICS}, got {self.metric!r}")
        _check(0 < self.centroid_ratio <= 0.5, f"centroid_ratio must be in (0, 0.5], got {self.centroid_ratio}")
        _check(self.max_list_factor >= 1.0, f"max_list_factor must be >= 1, got {self.max_list_factor}")
        _check(2 <= self.kmeans_branching <= 256, f"kmeans_branching must be in [2, 256], got {self.kmeans_branching}")
        _check(1 <= self.kmeans_iters <= 100, f"kmeans_iters must be in [1, 100], got {self.kmeans_iters}")
        _check(self.replica_eps >= 0, f"replica_eps must be >= 0, got {self.replica_eps}")
        _check(1 <= self.max_replicas <= 8, f"max_replicas must be in [1, 8], got {self.max_replicas}")
        _check(0 <= self.pq_m <= 256, f"pq_m must be in [0, 256] (0 = automatic), got {self.pq_m}")
        _check(self.pq_train_size >= 256, f"pq_train_size must be >= 256, got {self.pq_train_size}")
        _check(4 <= self.graph_m <= 64, f"graph_m must be in [4, 64], got {self.graph_m}")
        _check(self.graph_ef_construction >= self.graph_m, "graph_ef_construction must be >= graph_m")
        _check(self.threads >= 0, f"threads must be >= 0, got {self.threads}")


@dataclass(frozen=True)
class SearchParams(_Config):
    """Per-request knobs of the query path (steps 3-6 of the design)."""

    # m: posting lists probed at most; the distance-ratio rule may probe fewer per query. 256 lists of
    # ~10 vectors: GloVe 390k (all 10k queries) needs it for recall@10 >= 0.95 (128 gave 0.922).
    nprobe: int = 256
    # Keep list i only if dist(q, c_i) <= (1 + probe_ratio) * dist(q, c_1); 0 disables the rule.
    probe_ratio: float = 1.0
    # Navigation graph beam; at least nprobe.
    graph_ef: int = 0
    # n: PQ candidates handed to the re-ranker.
    rerank: int = 200
    # Algorithm 1 of FusionANNS: mini-batch size, and stop after beta batches with delta <= eps.
    minibatch: int = 8
    eps: float = 0.0
    beta: int = 2

    def __post_init__(self):
        _check(1 <= self.nprobe <= 1 << 20, f"nprobe must be in [1, 1048576], got {self.nprobe}")
        _check(self.probe_ratio >= 0, f"probe_ratio must be >= 0, got {self.probe_ratio}")
        _check(self.graph_ef >= 0, f"graph_ef must be >= 0, got {self.graph_ef}")
        _check(1 <= self.rerank <= 1_000_000, f"rerank must be in [1, 1000000], got {self.rerank}")
        _check(self.minibatch >= 1, f"minibatch must be >= 1, got {self.minibatch}")
        _check(0 <= self.eps <= 1, f"eps must be in [0, 1], got {self.eps}")
        _check(self.beta >= 0, f"beta must be >= 0 (0 disables early stop), got {self.beta}")


@dataclass(frozen=True)
class EngineConfig(_Config):
    """How an opened index uses the machine."""

    # DRAM page buffer shared by all queries.
    buffer_bytes: int = 64 << 20
    io_backend: str = "auto"
    direct_io: str = "auto"
    io_threads: int = 8
    threads: int = 0
    # Queries each re-rank thread keeps in flight: their mini-batches' SSD reads go out together,
    # so I/O latency overlaps instead of being waited out one mini-batch at a time; 1 is one
    # query at a time. Results do not depend on it. 16: with a page buffer of raw/16 and io_uring
    # it took the re-rank stage from 4491 to 7069 queries/s (synthetic 100k) and from 1282 to 2226
    # (Fashion-MNIST) on one thread; 32 gained little more, and the pread pool mostly peaks at 4-8.
    # Memory: 16 x minibatch blocks per thread (bench/results/rerank_inflight.md).
    rerank_inflight: int = 16
    # Queries per internal batch; 0 picks by filter tier (batch_for). On the CPU a batch's float32
    # PQ tables (M KiB per query) were most of a search's working memory (since built one per thread,
    # in the scan: bench/results/lut_scan.md), and small batches cost no
    # speed: Fashion-MNIST 60k (M=64), 2 threads, 64 queries per batch took the process's peak
    # from 86 to ~44 MiB at the same QPS (256: 523-545 q/s, 64: 653-696). The GPU wants big ones.
    batch_size: int = 0
    # Check every file against the manifest's checksums when opening.
    verify: bool = True
    # Hold the navigation graph's centroids as 8-bit codes per dimension (SQ8): they are most of the graph,
    # the largest part of the host-RAM tier, and it only has to pick the top-m lists. float32 -> SQ8:
    # GloVe 390k (40.6k x 50-d) 14.7 -> 8.6 MB, Fashion-MNIST (6k x 784-d) 19.6 -> 5.6 MB, MiniLM
    # (3.6k x 384-d) 6.0 -> 1.9 MB; the top-256 lists agree with float32's for 98.9-99.9% (bench sets,
    # 1000 queries). Coded while read, in chunks: opening never holds the float matrix.
    graph_sq8: bool = True
    # A block the re-ranker reads for a mini-batch also scores the query's later candidates stored in it
    # (its page-mates), and their own mini-batch later reads nothing for them: no read, and the build puts near
    # vectors on the same page (layout.chain_order), so the top-k settles after fewer pages. No memory.
    page_mates: bool = True
    # Page buffer policy: 'clock' (CLOCK), or 'lfu', cache by use: requests counted per block (weighted by
    # how many queries asked, halved every 10 requests a frame), a missed block admitted only if asked for
    # more often than the block it would evict (TinyLFU). 'lfu' had the fewer SSD pages per query, averaged
    # over uniform, skewed and drifting streams, at buffers of 1/64, 1/16 and 1/4 of the raw vectors on GloVe
    # and MiniLM (bench/results/cache_policy.md); skewed at 1/16, hit ratio GloVe 0.22 -> 0.31, MiniLM
    # 0.42 -> 0.55. It lost only on MiniLM's own queries at 1/64 (0.094 -> 0.060).
    buffer_policy: str = "lfu"
    # Fraction of the page buffer pinned to the pages of the posting lists visited most since start-up
    # (0: none), re-chosen by the index manager thread every manager_interval_s seconds, never on the
    # request path. Results never depend on it. Off: on top of 'lfu' it saved at most 2% of the SSD pages
    # (GloVe 1/64) and cost up to 21% (MiniLM 1/4); over CLOCK alone it helps skewed streams a little.
    pin_fraction: float = 0.0
    # Seconds between the index manager thread's rounds: re-pinning hot pages and, on a GPU tier that
    # holds only its hottest lists' codes, GpuFilterTier.rebalance(). 0: no thread (call
    # Index.refresh_hotness() yourself).
    manager_interval_s: float = 1.0
    # On the CPU filter tier, a call of several batches runs them as a pipeline, as the GPU tier always does:
    # batch b+1's graph search, batch b's PQ scan and batch b-1's re-rank at once, so one batch's SSD waits
    # overlap another's computing. Results do not depend on it. Calls of 256 queries (4 batches), default
    # search, busy 2-core VM: GloVe 353 -> 416 q/s (1 thread), 551 -> 601 (2); MiniLM 304 -> 579, 483 -> 528
    # (bench/results/cpu_pipeline.md). A call of one batch (<= 64 queries) is the same either way.
    pipeline: bool = True
    # PQ filtering on the GPU ('gpu', Triton) or the CPU ('cpu'); 'auto' takes the GPU when
    # torch sees CUDA.
    filter_tier: str = "auto"
    # GPU memory the filter tiers of all the process's indexes share (codes, codebooks, working blocks);
    # 0: what an LLM server on the same GPU leaves, (1 - gpu_memory_utilization) of the device, at most what is free.
    gpu_budget_bytes: int = 0
    # The LLM server's share of GPU memory (vLLM's --gpu-memory-utilization).
    gpu_memory_utilization: float = 0.9
    # Every index of a process shares one GPU budget: one whose codes do not all fit keeps its hottest
    # lists' codes in at most this fraction of what is left, so later indexes still start (1: all).
    gpu_tiered_share: float = 0.5

    def __post_init__(self):
        _check(self.buffer_bytes >= 0, f"buffer_bytes must be >= 0, got {self.buffer_bytes}")
        _check(self.io_backend in IO_BACKENDS, f"io_backend must be one of {IO_BACKENDS}, got {self.io_backend!r}")
        _check(self.direct_io in DIRECT_IO, f"direct_io must be one of {DIRECT_IO}, got {self.direct_io!r}")
        _check(1 <= self.io_threads <= 256, f"io_threads must be in [1, 256], got {self.io_threads}")
        _check(self.threads >= 0, f"threads must be >= 0, got {self.threads}")
        _check(1 <= self.rerank_inflight <= 1024,
               f"rerank_inflight must be in [1, 1024] (1: one query at a time), got {self.rerank_inflight}")
        _check(0 <= self.batch_size <= 65536, f"batch_size must be in [0, 65536] (0 = automatic), got {self.batch_size}")
        _check(self.buffer_policy in BUFFER_POLICIES,
               f"buffer_policy must be one of {BUFFER_POLICIES}, got {self.buffer_policy!r}")
        _check(0 <= self.pin_fraction <= 0.75, f"pin_fraction must be in [0, 0.75], got {self.pin_fraction}")
        _check(self.manager_interval_s >= 0, f"manager_interval_s must be >= 0, got {self.manager_interval_s}")
        _check(self.filter_tier in FILTER_TIERS, f"filter_tier must be one of {FILTER_TIERS}, got {self.filter_tier!r}")
        _check(self.gpu_budget_bytes >= 0, f"gpu_budget_bytes must be >= 0 (0 = automatic), got {self.gpu_budget_bytes}")
        _check(0 <= self.gpu_memory_utilization < 1,
               f"gpu_memory_utilization must be in [0, 1), got {self.gpu_memory_utilization}")
        _check(0 < self.gpu_tiered_share <= 1, f"gpu_tiered_share must be in (0, 1], got {self.gpu_tiered_share}")

    def batch_for(self, filter_tier: str) -> int:
        """Queries per internal batch with this filter tier ('cpu' or 'gpu')."""
        return self.batch_size or (CPU_BATCH if filter_tier == "cpu" else GPU_BATCH)


def cpu_threads(requested: int = 0) -> int:
    """Threads to use: the request, or every core this process may run on."""
    return requested or len(os.sched_getaffinity(0))
