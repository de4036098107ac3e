"""The service's life: its shared state (catalog, batcher, keys, metrics), loading, start and stop. Used by
`fusionrag serve` (server/app.py) and by the vLLM plugin, which runs the same life inside vLLM's process."""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import threading

from fusionrag.retriever.collection import Catalog, CollectionConfig, docstore, quota
from fusionrag.retriever.directory import catalog as data_catalog
from fusionrag.retriever.collection.embedding import get_embedder, set_endpoint_deadline, set_runtime, set_threads
from fusionrag.retriever.engine.config import BuildConfig, EngineConfig
from fusionrag.retriever.errors import NotFoundError, UnavailableError, UnsupportedError
from fusionrag.server.auth import KeyRing
from fusionrag.server.batcher import MicroBatcher
from fusionrag.server.config import ServerConfig, data_path
from fusionrag.server.demo import ensure_demo
from fusionrag.server.metrics import Metrics
from fusionrag.server.snapshots import SnapshotShelf
from fusionrag.server.vector_stores import FileLimits, VectorStores

log = logging.getLogger("fusionrag.server")


def engine_config(config: ServerConfig) -> EngineConfig:
    """How the service opens an index: its engine flags (--buffer-mb, --raw-in-ram, --filter-tier, ...), for a data
    directory's collections and for a sharded index served on Ray alike."""
    return EngineConfig(buffer_bytes=int(config.buffer_mb * (1 << 20)), filter_tier=config.filter_tier,
                        buffer_policy=config.buffer_policy, record_cache=config.record_cache,
                        buffer_compression=config.buffer_compression, raw_in_ram=config.raw_in_ram,
                        pipeline=config.pipeline, rerank_prefetch=config.rerank_prefetch,
                        gpu_budget_bytes=int(config.gpu_budget_mb * (1 << 20)),
                        gpu_memory_utilization=config.gpu_memory_utilization,
                        gpu_tiered_share=config.gpu_tiered_share, gpu_search=config.gpu_search)


def open_catalog(config: ServerConfig) -> Catalog:
    docstore.ROW_CACHE.resize(int(config.doc_cache_mb * (1 << 20)))
    engine = engine_config(config)
    limits = quota.Limits(max_collections=config.max_collections, max_open_collections=config.max_open_collections,
                          descriptor_reserve=config.descriptor_reserve,
                          disk_reserve_bytes=int(config.disk_reserve_mb * (1 << 20)),
                          max_restore_bytes=config.max_restore_bytes)
    collection = CollectionConfig(min_index_count=config.min_index_count,
                                  build=BuildConfig(probe_model=config.probe_model))
    return data_catalog(data_path(config), engine, collection, limits)


class Refused:
    """What a service over a sharded collection does not offer (snapshots, the OpenAI vector stores): each use
    refused with 405 and why."""

    def __init__(self, what: str):
        self.what = what

    def __getattr__(self, name: str):
        def refuse(*_, **__):
            raise UnsupportedError(f"{self.what} are not served over a sharded collection")
        return refuse


class State:
    """What the routes share: the catalog, the batcher, the keys, and whether loading has finished.
    catalog: the collections served (default: the Catalog of config's data directory); a ShardedCatalog
    (retriever/sharded/catalog.py) serves one sharded collection with the same routes, no snapshots, no vector
    stores and no demo. keys: the API keys (default: those config names)."""

    def __init__(self, config: ServerConfig, catalog=None, keys: KeyRing | None = None):
        self.config = config
        set_threads(config.embed_threads, config.embed_bulk_threads)
        set_runtime(config.embed_runtime)
        set_endpoint_deadline(config.embedding_timeout_s)
        self.keys = keys if keys is not None else KeyRing.from_config(config.api_keys, config.api_keys_file)
        self.open_files_limit = quota.raise_descriptor_limit()  # before the catalog sizes its pool of open files
        self.own_catalog = catalog is None
        if catalog is not None:
            self.config = config = config.with_overrides(demo=False)
            self.catalog = catalog
            self.snapshots = Refused("snapshots")
            self.vector_stores = Refused("the OpenAI files and vector stores")
        else:
            self.catalog = open_catalog(config)
            shutil.rmtree(data_path(config) / "uploads", ignore_errors=True)  # what a crash cut short
            self.snapshots = SnapshotShelf(data_path(config) / "snapshots", config.max_snapshots,
                                           config.max_snapshot_bytes, self.catalog.limits.disk_reserve_bytes)
            self.vector_stores = VectorStores(
                data_path(config) / "openai", self.catalog, config.embedding,
                FileLimits(config.max_files_per_key, config.max_file_bytes_per_key, config.max_collections_per_key,
                           self.catalog.limits.disk_reserve_bytes, config.max_file_tokens), config.file_workers)
        self.metrics = Metrics(self.collections_info)
        self.batcher = MicroBatcher(config.batch_wait_ms / 1000, config.batch_max_queries,
                                    config.search_threads, self.metrics, config.gpu_batch_wait_ms / 1000)
        self.ready = threading.Event()
        self.demo_error: str | None = None
        self.building: set[str] = set()
        self.lock = threading.Lock()

    def load(self) -> None:
        """Open every collection (building the demo on a first start) and warm the embedding models.
        One that fails is set aside with the reason (/readyz and its info say it) while the others serve."""
        if self.config.demo:
            with self.lock:
                self.building.add("demo")
            try:
                ensure_demo(self.catalog, self.config.embedding)
            except UnavailableError:  # on disk but broken: reported like any other collection
                pass
            except Exception as e:  # noqa: BLE001 - reported by /readyz and the log; the rest still serves
                self.demo_error = f"building the demo collection failed: {type(e).__name__}: {e}"
                log.exception("building the demo collection failed")
            finally:
                with self.lock:
                    self.building.discard("demo")
        failed = self.catalog.open_all()
        for name in self.catalog.names():
            try:
                coll = self.catalog.get(name)
                if coll.embedding:
                    get_embedder(coll.embedding).load()
            except (NotFoundError, UnavailableError):  # dropped meanwhile, or failed to open
                pass
            except Exception:  # noqa: BLE001 - its text queries will fail with the reason; vectors still work
                log.exception("loading the embedding model of collection %r failed", name)
        if self.own_catalog:
            self.vector_stores.start()  # after the collections: it takes up the files a stop left in progress
        # What the start made (the models' libraries: torch and transformers are millions of objects) is kept out of the
        # garbage collector's passes: with it in, each full pass held the GIL for ~0.1-0.2 s, every request waiting
        # (32-query searches at one connection, bf16 model loaded: p99 244 and 207 ms, 7.4 and 8.4 with it out).
        gc.freeze()
        self.ready.set()
        log.info("ready", extra={"collections": self.catalog.names(), "failed": failed})

    def collections_info(self) -> dict[str, dict]:
        """Info of every collection that serves (those that failed to open are in failed_info)."""
        if not self.ready.is_set():
            return {}
        out = {}
        for name in self.catalog.names():
            try:
                out[name] = self.catalog.get(name).info()
            except (NotFoundError, UnavailableError):  # dropped meanwhile, or failed to open
                pass
        return out

    def failed_info(self, name: str) -> dict:
        return {"name": name, "state": "failed", "reason": self.catalog.failed().get(name, "")}


class Service:
    """The service's life around its State: `start` (the batcher, then loading the collections in the background)
    and `stop` (requests in flight answered, loading finished, collections closed). `fusionrag serve` runs it as
    its app's lifespan; the vLLM plugin from vLLM's."""

    def __init__(self, config: ServerConfig, catalog=None, keys: KeyRing | None = None):
        self.state = State(config, catalog, keys)
        self._loader: threading.Thread | None = None

    async def start(self) -> None:
        await self.state.batcher.start()
        self._loader = threading.Thread(target=self.state.load, name="fusionrag-load", daemon=True)
        self._loader.start()

    async def stop(self) -> None:
        # The server has let the requests in flight finish; what they queued is answered before we close.
        await self.state.batcher.stop()
        if self._loader is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._loader.join)
        if self.state.own_catalog:
            await asyncio.get_running_loop().run_in_executor(None, self.state.vector_stores.stop)
        self.state.catalog.close()
        log.info("stopped")
