"""Any index directory, single or sharded: the one place above both layers that tells them apart (engine/ knows
nothing of shards; sharded/ builds on engine/), so each of them imports only what lies below it."""

from __future__ import annotations

from pathlib import Path

from fusionrag.retriever.sharded.parts import is_sharded

__all__ = ["catalog", "is_sharded", "recalibrate"]


def catalog(root, engine_config=None, collection_config=None, limits=None):
    """The collections of a data directory (collection.catalog.Catalog), its sharded ones among them
    (sharded.hosted.HostedSharded): what the service, the CLI and the embedded integrations open."""
    from fusionrag.retriever.collection.catalog import Catalog

    return Catalog(root, engine_config, collection_config, limits, open_sharded=_open_sharded)


def _open_sharded(path, desc: dict, catalog):
    from fusionrag.retriever.sharded.hosted import HostedSharded

    return HostedSharded(path, desc, catalog.engine_config, catalog.collection_config, catalog.limits, catalog.files)


def recalibrate(index_dir, sample_queries=None, queries: int | None = None, target: float | None = None,
                threads: int = 0) -> dict:
    """Measure the default search settings of an index already built again and write them into its manifest
    (engine.calibrate.recalibrate; a sharded index's through its shards, sharded.calibrate.recalibrate_sharded).
    Returns the calibration."""
    from fusionrag.retriever.engine.config import cpu_threads

    if is_sharded(Path(index_dir)):
        from fusionrag.retriever.sharded.calibrate import recalibrate_sharded

        return recalibrate_sharded(Path(index_dir), sample_queries, queries, target, cpu_threads(threads))
    from fusionrag.retriever.engine.calibrate import recalibrate as recalibrate_index

    return recalibrate_index(index_dir, sample_queries, queries, target, threads)
