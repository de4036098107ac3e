"""The merge's disk work: the next generation of a collection's index, grown out of the current one (merge.py)
or rebuilt from every stored vector, written under gen-NNNNNN/ beside it. When a merge runs, and how its result
is published, is the collection's (api.py): this module only writes files and opens the index it wrote."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection.config import CURRENT_FORMAT, CollectionConfig
from fusionrag.retriever.collection.generations import (Generation, clear_but_rebuild, gen_dir_name, rebuild_partial,
                                                        rows_digest, write_rows)
from fusionrag.retriever.engine.build import build_index
from fusionrag.retriever.engine.config import BuildConfig, EngineConfig
from fusionrag.retriever.engine.index import Index
from fusionrag.retriever.engine.merge import can_store, merge_index


def can_grow(config: CollectionConfig, old: Generation, live: int, fresh_vecs: np.ndarray) -> bool:
    """Whether the next generation can grow out of the current one (see CollectionConfig)."""
    if not config.incremental_merge or old.index is None or live < config.min_index_count:
        return False
    m = old.index.manifest
    layout = m["pages"]
    slots = layout["num_blocks"] * layout["records_per_block"]
    unsplit = int((m.get("merge") or {}).get("unsplit_postings", 0))
    return (live <= config.rebuild_growth * int(m.get("full_build_count", m["count"]))
            and live >= config.rebuild_live_fraction * slots
            and unsplit <= config.rebuild_unsplit_share * int(m.get("postings", 0) or 1)
            and can_store(old.index, fresh_vecs))


def next_generation(path: Path, old: Generation, dead: np.ndarray, fresh_rows: np.ndarray, fresh_vecs: np.ndarray,
                    max_row: int, read_all: Callable[[Path], tuple[np.ndarray, np.ndarray, int]] | None,
                    build_config: BuildConfig, engine_config: EngineConfig, min_index_count: int,
                    progress: bool | None, on_step: Callable[[str, int, int], None]) -> tuple[Generation, dict]:
    """Write generation old + 1 into path/gen-NNNNNN and open it: without `read_all`, grown from `old` (its
    `dead` vector ids dropped, the fresh rows and vectors added); with it, rebuilt from what read_all(staged)
    gives (rows, their vectors as written to the memory-mapped file `staged`, how many stored vectors were
    unusable), or left unindexed below `min_index_count`.
    Returns the generation, not yet published, and the record CURRENT is to hold for it."""
    gen = old.generation + 1
    gdir = path / gen_dir_name(gen)
    build_config = build_config.beside_resident()  # the service's open indexes and buffers hold memory too
    if read_all is None:
        shutil.rmtree(gdir, ignore_errors=True)
    else:
        clear_but_rebuild(gdir)
    gdir.mkdir(exist_ok=True)
    unsearchable = None
    if read_all is None:
        merge_index(old.index, dead, fresh_vecs, gdir / "index", build_config, progress, on_step)
        rows = np.concatenate([old.rows[~dead], fresh_rows])
    else:
        staged = gdir / "staged.npy"  # the stored vectors, memory-mapped: a rebuild reads them in passes
        try:
            rows, vecs, unsearchable = read_all(staged)
            if len(rows) >= min_index_count:
                # A rebuild killed or failed before (this process or another) resumes from its last finished step
                # where the vectors read are the same ones (build_index's key: their contents and the settings);
                # else it starts over in the same place.
                build_index(vecs, gdir / "index", build_config, progress, on_progress=on_step, resume=True)
            else:
                rows, max_row = np.empty(0, np.int64), -1
                shutil.rmtree(rebuild_partial(gdir), ignore_errors=True)
            del vecs
        finally:
            staged.unlink(missing_ok=True)
    index = None
    current = {"format": CURRENT_FORMAT, "generation": gen, "indexed": bool(len(rows)), "max_row": max_row}
    if len(rows):
        rows = np.ascontiguousarray(rows, np.int64)
        write_rows(gdir, rows)
        current["rows_sha256"] = rows_digest(rows)
        # Grown without splits, it shares the open generation's graph (Index.open graph_of)
        index = Index.open(gdir / "index", engine_config, graph_of=old.index if read_all is None else None)
    new = Generation(gen, index, rows, max_row)
    new.unsearchable = unsearchable
    return new, current
