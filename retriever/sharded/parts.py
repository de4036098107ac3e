"""A sharded index directory (docs/sharded.md): a router part and S shard parts, and the names both sides use."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from fusionrag.retriever.engine.manifest import MANIFEST
from fusionrag.retriever.errors import UnavailableError

log = logging.getLogger(__name__)


KIND = "sharded"
PLACEMENTS = ("hotness", "round-robin", "locality")
ROUTER_FILES = {"graph.bin": True, "pq_codebooks.npy": True, "list_shards.npy": True, "list_local.npy": True,
                "list_sizes.npy": True, "list_visits.npy": True}
# Ids from here up are those of documents named by a string that is not an id (sharded/docs.py); below, a name
# that is an id's decimal digits names that id.
NAMED_IDS = 1 << 62
# An upsert goes to the nearest of this many nearest lists that has a live shard.
UPSERT_PROBE = 8
# A shard holds at most this multiple of its share of the postings, however its expected work falls.
STORAGE_SLACK = 1.25
# Locality placement moves boundary lists between regions until no shard expects more than this x the mean.
LOCALITY_TOLERANCE = 1.05
# A shard part's lock file: the one process that has it open (ShardServer) holds it (retriever/dirlock.py). A shard
# restarted as a Ray actor waits this long for the process it replaces, which ray.kill() stops but does not wait for.
SHARD_LOCK = "LOCK"
SHARD_LOCK_WAIT_S = 30.0


class ShardDown(UnavailableError):
    """A shard that is not running (its actor died, or it was closed): the router fails over."""


def part_name(s: int) -> str:
    return f"shard-{s:03d}"


def is_sharded(path) -> bool:
    """Whether the index directory at path is a sharded one (its manifest says so)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False

def merge_topk(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best k of each row over the parts' (ids, distances), a vector found by two shards once."""
    ids = np.concatenate([p[0] for p in parts], axis=1)
    d = np.concatenate([p[1] for p in parts], axis=1).astype(np.float32)
    d = np.where(ids < 0, np.inf, d)
    order = np.lexsort((d, ids), axis=-1)
    sid = np.take_along_axis(ids, order, axis=1)
    sd = np.take_along_axis(d, order, axis=1)
    dup = np.zeros_like(sid, dtype=bool)
    dup[:, 1:] = (sid[:, 1:] == sid[:, :-1]) & (sid[:, 1:] >= 0)
    sd[dup] = np.inf
    best = np.argsort(sd, axis=1, kind="stable")[:, :k]
    out_ids = np.take_along_axis(sid, best, axis=1)
    out_d = np.take_along_axis(sd, best, axis=1)
    out_ids[~np.isfinite(out_d)] = -1
    if out_ids.shape[1] < k:
        pad = k - out_ids.shape[1]
        out_ids = np.pad(out_ids, ((0, 0), (0, pad)), constant_values=-1)
        out_d = np.pad(out_d, ((0, 0), (0, pad)), constant_values=np.inf)
    return out_ids, out_d


def shards_resident(where: list[dict]) -> bool:
    """Whether every shard (where: each one's ShardServer.where()) holds its raw vectors in RAM
    (EngineConfig.raw_in_ram): then the router searches with its search_defaults_ram. A shard's residency is
    decided as it opens, within its share of the budget."""
    return bool(where) and all(w["memory"].get("raw_vectors_bytes", 0) > 0 for w in where)
