"""Calibration of a sharded index (docs/sharded.md): engine/calibrate.py's climb, measured through the router
over its shards, at build (calibrate_sharded), on an open index (calibrate_open_sharded) and again later
(recalibrate_sharded)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from fusionrag.retriever.engine.calibrate import (MIN_ROWS, K, calibrate_both, calibration_engine, calibration_entry,
                                                  exact_topk, sample_for_calibration)
from fusionrag.retriever.engine.config import SearchParams
from fusionrag.retriever.sharded.parts import merge_topk
from fusionrag.retriever.sharded.router import ShardedIndex


def sharded_found(index, self_id: np.ndarray, own: bool):
    """search(q, params) -> ids over an open ShardedIndex, as calibration reads them: where the queries are rows
    of the data (own), each searched for with K + 1 and its own id (self_id) dropped from what is found, since a
    sharded search has no exclude bitmap."""
    k = K + 1 if own else K

    def found(q: np.ndarray, p: SearchParams) -> np.ndarray:
        ids = index.search(q, k, p, partial=False).ids
        return np.array([r[r != s][:K] for r, s in zip(ids, self_id)])

    return found


def calibrate_sharded(index_dir: Path, rows, n: int, engine_metric: str, queries: int, target: float, seed: int,
                      threads: int, sample_queries: np.ndarray | None = None) -> dict:
    """calibrate() for a sharded index's router (staged in index_dir), its shards opened here, in this process,
    and the build's rows at hand for the truth. A sampled row is searched for with K + 1 and its own id dropped
    from what is found, as from the truth; the other sampled rows stay in the data."""
    t0 = time.perf_counter()
    if sample_queries is None and n < MIN_ROWS:
        return {"skipped": f"fewer than {MIN_ROWS} rows", "params": {}, "count": int(n)}
    own, q, source = sample_for_calibration(rows, n, queries, seed, sample_queries)
    self_id = np.full(len(q), -1, np.int64) if own is None else own.astype(np.int64)
    truth = exact_topk(rows, n, q, K, engine_metric, exclude=None if own is None else self_id)
    index = ShardedIndex.open(index_dir, calibration_engine(threads), verify=False)
    try:
        tried, chosen, ram = calibrate_both(sharded_found(index, self_id, own is not None), q, truth, target,
                                            graph=not index.nav.exhaustive)
    finally:
        index.close()
    return calibration_entry(q, source, target, tried, chosen, t0, n, ram)


def calibrate_open_sharded(index, queries: int, target: float, seed: int,
                           sample_queries: np.ndarray | None = None) -> dict:
    """calibrate() through an open ShardedIndex (its shards threads of this process or Ray actors), after it was
    built: rows sampled from its live vectors, built and written since (each shard's live ids; the sample's
    vectors fetched as its documents' are), or a query log; their truth by brute force on each shard over what
    it holds (ShardServer.exact), merged at the router. Nothing is gathered whole at the router."""
    t0 = time.perf_counter()
    live = np.unique(np.concatenate(index.every_shard("live_ids", (), "listing live ids")).astype(np.int64))
    n = len(live)
    if sample_queries is None and n < MIN_ROWS:
        return {"skipped": f"fewer than {MIN_ROWS} rows", "params": {}, "count": int(n)}

    def rows(pos: np.ndarray) -> np.ndarray:
        ids = live[pos]
        docs = index.documents(ids, with_vectors=True)
        return np.stack([np.asarray(docs[int(i)][3], np.float32) for i in ids])

    own, q, source = sample_for_calibration(rows, n, queries, seed, sample_queries)
    self_id = np.full(len(q), -1, np.int64) if own is None else live[own]
    truth = merge_topk(index.every_shard("exact", (q, K, self_id), "brute force for calibration"), K)[0]
    tried, chosen, ram = calibrate_both(sharded_found(index, self_id, own is not None), q, truth, target,
                                        graph=not index.nav.exhaustive)
    return calibration_entry(q, source, target, tried, chosen, t0, n, ram)


def recalibrate_sharded(path: Path, sample_queries, queries: int | None, target: float | None,
                         threads: int) -> dict:
    """recalibrate() for a sharded index: its shards opened here (refused while another process serves them:
    each shard part's lock), measured through them (ShardedIndex.calibrate)."""
    index = ShardedIndex.open(path, calibration_engine(threads))
    try:
        return index.calibrate(sample_queries, queries, target)
    finally:
        index.close()
