"""Prometheus metrics, and the recent figures the web page shows. One registry per app, so apps never share."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from fusionrag import native

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Engine statistics (Collection.search) reported per query as stage times.
ENGINE_STAGES = {"graph_s": "graph", "lut_s": "lut", "scan_s": "scan", "rerank_s": "rerank"}


class Recent:
    """The last few hundred searches, for the live figures of the web page."""

    def __init__(self, size: int = 512):
        self._rows: deque[tuple[float, float, int, int, int]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, seconds: float, queries: int, pages_read: int, pages_buffered: int) -> None:
        with self._lock:
            self._rows.append((time.time(), seconds, queries, pages_read, pages_buffered))

    def summary(self) -> dict:
        with self._lock:
            rows = list(self._rows)
        if not rows:
            return {"searches": 0}
        lat = sorted(r[1] for r in rows)
        queries = sum(r[2] for r in rows)
        read, buffered = sum(r[3] for r in rows), sum(r[4] for r in rows)
        return {
            "searches": len(rows),
            "queries": queries,
            "latency_ms_p50": round(1000 * lat[len(lat) // 2], 3),
            "latency_ms_p95": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.95))], 3),
            "pages_read_per_query": round(read / queries, 3),
            "page_buffer_hit_ratio": round(buffered / (read + buffered), 4) if read + buffered else None,
        }


class Metrics:
    def __init__(self, collections_info):
        """`collections_info()` returns {name: Collection.info()} of the open collections, read at scrape time."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fusionrag_http_requests", "HTTP requests answered",
                                ["method", "route", "status"], registry=r)
        self.request_seconds = Histogram("fusionrag_http_request_seconds", "HTTP request latency",
                                         ["route"], buckets=_LATENCY, registry=r)
        self.stage_seconds = Histogram(
            "fusionrag_stage_seconds",
            "Time per search stage: queue (waiting for a batch, per request), embed and engine (per batch), "
            "graph, lut, scan, rerank (per query, from the engine)",
            ["stage"], buckets=_LATENCY, registry=r)
        self.batch_requests = Histogram("fusionrag_batch_requests", "Search requests gathered into one micro-batch",
                                        buckets=_SIZES, registry=r)
        self.batch_queries = Histogram("fusionrag_batch_queries", "Queries in one engine call",
                                       buckets=_SIZES, registry=r)
        self.queries = Counter("fusionrag_queries", "Queries searched", ["collection"], registry=r)
        self.loop_searches = Counter("fusionrag_searches_on_event_loop", "Searches run on the event loop itself: "
                                     "quick ones, alone, while requests do not overlap (others go to the search threads)",
                                     registry=r)
        self.batches_held = Counter("fusionrag_batches_held_for_gpu", "Micro-batches held open (gpu_batch_wait_ms) "
                                    "to reach the size from which the GPU serves them cheaper", registry=r)
        self.tier_queries = Counter("fusionrag_filter_tier_queries", "Queries whose main-index search a filter tier "
                                    "served (cpu or gpu; under filter_tier auto with CUDA, each call the cheaper)",
                                    ["collection", "tier"], registry=r)
        self.pages_read = Counter("fusionrag_ssd_pages_read", "Pages read from the SSD tier",
                                  ["collection"], registry=r)
        self.pages_buffered = Counter("fusionrag_page_buffer_hits", "Pages served by the DRAM page buffer",
                                      ["collection"], registry=r)
        # Where the raw vectors are in RAM (raw_in_ram) no page is read: this counts the re-rank's work either way.
        self.reranked = Counter("fusionrag_reranked_candidates", "Candidates the exact re-rank scored, from the raw "
                                "vectors in RAM or from SSD pages", ["collection"], registry=r)
        self._hits: dict[str, list[int]] = {}  # collection -> [read, buffered], for the hit ratio
        # HTTP requests in progress now, and when two last were (ObserveMiddleware's, on the event loop): the
        # batcher runs a quick search on the loop itself only for the one request in progress, and only while
        # requests have not overlapped for a while (batcher.QUIET_S).
        self.active = 0
        self.overlapped_at = float("-inf")
        self._lock = threading.Lock()
        self._collections_info = collections_info
        r.register(_CollectionCollector(self))
        self.recent = Recent()
        # Labelled series looked up once (a labels() call takes a lock and builds a key: ~1 us, a dozen a search).
        self.stage = {name: self.stage_seconds.labels(name)
                      for name in ("queue", "embed", "engine", *ENGINE_STAGES.values())}
        self._series: dict[tuple, object] = {}

    def series(self, metric, *labels):
        """metric.labels(*labels), kept: the same child Prometheus would give, without its lookup each time."""
        key = (id(metric), labels)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*labels)
        return child

    def observe_search(self, collection: str, stats: list[dict]) -> None:
        read = sum(int(s.get("pages_read", 0)) for s in stats)
        buffered = sum(int(s.get("pages_buffered", 0)) for s in stats)
        reranked = sum(int(s.get("reranked", 0)) for s in stats)
        series = self.series
        series(self.queries, collection).inc(len(stats))
        tiers: dict[str, int] = {}
        for s in stats:
            if "filter_tier" in s:
                tiers[s["filter_tier"]] = tiers.get(s["filter_tier"], 0) + 1
        for tier, n in tiers.items():
            series(self.tier_queries, collection, tier).inc(n)
        series(self.pages_read, collection).inc(read)
        series(self.pages_buffered, collection).inc(buffered)
        series(self.reranked, collection).inc(reranked)
        with self._lock:
            tot = self._hits.setdefault(collection, [0, 0])
            tot[0] += read
            tot[1] += buffered
        for key, stage in ENGINE_STAGES.items():
            child = self.stage[stage]
            for s in stats:
                if key in s:
                    child.observe(float(s[key]))

    def hit_ratios(self) -> dict[str, float]:
        with self._lock:
            return {c: b / (r + b) for c, (r, b) in self._hits.items() if r + b}


class _CollectionCollector:
    """Figures read from the collections when Prometheus scrapes: documents and memory per tier."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        docs = GaugeMetricFamily("fusionrag_collection_documents", "Live documents", labels=["collection"])
        tiers = GaugeMetricFamily("fusionrag_tier_bytes", "Bytes held per tier", labels=["collection", "tier"])
        gpu = GaugeMetricFamily("fusionrag_gpu_memory_bytes",
                                "GPU memory of the process's filter tiers: used (their reservations plus the "
                                "measured CUDA context, kernels and allocator rounding), peak, the budget every "
                                "collection shares, and what the driver reports the process holds (process; "
                                "where it gives a per-process figure)", labels=["kind"])
        ratio = GaugeMetricFamily("fusionrag_page_buffer_hit_ratio",
                                  "Share of page requests served by the DRAM page buffer", labels=["collection"])
        process = {"used": 0, "peak": 0, "budget": 0}
        measured = None
        for name, info in self.m._collections_info().items():
            docs.add_metric([name], info.get("count", 0))
            t = info.get("tiers", {})
            for key, value in t.items():
                if key.endswith("_bytes") and isinstance(value, (int, float)):
                    tiers.add_metric([name, key.removesuffix("_bytes")], value)
            gpu_tier = t.get("filter", {})
            if "gpu_index_reserved_bytes" in gpu_tier:  # this collection's share of the budget
                tiers.add_metric([name, "gpu"], gpu_tier["gpu_index_reserved_bytes"])
                # and the host memory its cold postings (or codes) are pinned in, which the GPU reads over the bus
                tiers.add_metric([name, "gpu_host_pinned"], gpu_tier.get("gpu_host_pinned_bytes", 0))
            # Every collection reports the one budget: read at slightly different times, take the largest.
            for kind, key in (("used", "gpu_reserved_bytes"), ("peak", "gpu_peak_bytes"), ("budget", "gpu_budget_bytes")):
                process[kind] = max(process[kind], gpu_tier.get(key, 0))
            if gpu_tier.get("gpu_process_bytes") is not None:
                measured = max(measured or 0, gpu_tier["gpu_process_bytes"])
        for kind, value in process.items():
            gpu.add_metric([kind], value)
        if measured is not None:
            gpu.add_metric(["process"], measured)
        for name, value in self.m.hit_ratios().items():
            ratio.add_metric([name], value)
        scratch = GaugeMetricFamily("fusionrag_search_scratch_bytes",
                                    "Host memory the search kernels keep per thread between calls, summed over the "
                                    "process's threads (native.scratch_bytes(): it grows with the indexes searched, "
                                    "one copy per search thread, and the re-rank's kept for its next call; no collection's tier holds it)",
                                    value=native.scratch_bytes())
        return [docs, tiers, gpu, ratio, scratch]
