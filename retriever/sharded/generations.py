"""A shard's index generations (docs/sharded.md, "Merging a shard"): its fresh tier and tombstones folded into a
new generation of its index part, as a collection's merge does (retriever/engine/merge.py), while it goes on serving.

A shard part's directory holds generation 0, the build's files, itself. A merge writes generation g to
`gen-00000g/` (merge.merge_index with no list split, so the router's list numbers stay the shard's: the same
lists, the same centroids, the graph unchanged), its vectors in ascending global-id order with `global_ids.npy`
(int64: documents named by a string have ids from 2**62 up), `lists.npy` and `list_writes.npy` (the upserts per
router list up to it, which the router compares across a list's replicas) beside them, then names it in
`CURRENT.json` (written to a temporary file, fsynced and renamed: a crash leaves the old name or the new one):
`{"generation", "dir", "manifest_sha256", "count", "merged_lsn"}`. merged_lsn is the last log record the
generation holds: opened again, the shard replays into its fresh tier and tombstones only the records after it
(its doc store, kept across generations, gets what it lacks as always). The records up to merged_lsn are then
cut from the log (the doc store made durable first). The previous generation's directory goes once no search
reads it; generation 0's files stay.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection.generations import read_json_record, write_json_atomic
from fusionrag.retriever.engine.manifest import MANIFEST, load_array
from fusionrag.retriever.errors import IndexFormatError

CURRENT = "CURRENT.json"
LIST_WRITES = "list_writes.npy"  # (n, 2) int64: router list, upserts to it the generation holds
# No posting list of a shard is split by its merge: the router holds the list structure (its graph, the list ->
# shard map), which one shard's merge must not change. A list grown this many times over its build size is still
# searched (its postings scanned by PQ); the sharded index is rebuilt before lists grow that far.
NO_SPLIT_FACTOR = 1e9


def current_part(path) -> tuple[Path, dict | None]:
    """The directory of a shard part's current index generation (the part's own until a merge) and the record
    naming it (None for generation 0). IndexFormatError when the record is garbled or names a generation that is
    not there as it was written."""
    path = Path(path)
    f = path / CURRENT
    if not f.exists():
        return path, None
    rec = read_json_record(f, {"dir": str, "generation": int, "count": int, "merged_lsn": int, "manifest_sha256": str})
    d = path / rec["dir"]
    try:
        sha = hashlib.sha256((d / MANIFEST).read_bytes()).hexdigest()
    except OSError as e:
        raise IndexFormatError(f"{path}: generation {rec['generation']} ({rec['dir']}) is missing: {e}") from e
    if sha != rec["manifest_sha256"]:
        raise IndexFormatError(f"{path}: generation {rec['generation']} ({rec['dir']}) was replaced or is corrupt "
                               "(its manifest does not match CURRENT.json)")
    return d, rec


def load_global_ids(gen_dir: Path) -> np.ndarray:
    """A generation's global ids (int64, ascending): uint32 as the build writes them, int64 after a merge."""
    try:
        ids = load_array(gen_dir, "global_ids.npy", np.uint32, 1)
    except IndexFormatError:
        ids = load_array(gen_dir, "global_ids.npy", np.int64, 1)
    ids = ids.astype(np.int64)
    if len(ids) > 1 and not (ids[1:] > ids[:-1]).all():
        raise IndexFormatError(f"{gen_dir}: global_ids.npy is not strictly ascending")
    return ids


def publish(path: Path, rec: dict) -> None:
    """Name a generation in CURRENT.json, atomically and durably (as a collection's CURRENT is written)."""
    write_json_atomic(path / CURRENT, rec)


def manifest_sha(gen_dir: Path) -> str:
    return hashlib.sha256((gen_dir / MANIFEST).read_bytes()).hexdigest()
