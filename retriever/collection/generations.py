"""A collection's published generations on disk: CURRENT names the generation whose index (gen-NNNNNN/index)
and row map (gen-NNNNNN/rows.npy, checksummed in CURRENT) searches read; a search reads one through a ReadView."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection.config import CURRENT_FORMAT
from fusionrag.retriever.collection.fresh import FreshView
from fusionrag.retriever.engine.config import EngineConfig
from fusionrag.retriever.engine.index import Index
from fusionrag.retriever.engine.manifest import BUILD_STATE, fsync_path, partial_dir
from fusionrag.retriever.errors import IndexFormatError

log = logging.getLogger(__name__)


def gen_dir_name(generation: int) -> str:
    """The directory of a generation, a collection's or a shard part's: gen-NNNNNN."""
    return f"gen-{generation:06d}"


def write_json_atomic(path: Path, obj: dict) -> None:
    """obj as JSON at path, durably and atomically (a crash leaves the old file or the new one): written to
    path.tmp, fsynced, renamed over path, the directory fsynced. CURRENT of a collection and of a shard part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def read_json_record(path: Path, fields: dict[str, type]) -> dict:
    """A record write_json_atomic wrote (CURRENT of a collection, CURRENT.json of a shard part), each of `fields`
    there and of its type: IndexFormatError naming the file when it is unreadable or garbled."""
    try:
        rec = json.loads(path.read_text())
        for name, kind in fields.items():
            if kind is str and not isinstance(rec[name], str):
                raise TypeError(f"{name} is not a string")
            kind(rec[name])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise IndexFormatError(f"{path}: unreadable ({e!r})") from e
    return rec


@dataclass(eq=False)
class Generation:
    """A published generation: the engine index over the rows live when it was built."""
    generation: int
    index: Index | None
    rows: np.ndarray  # int64, sorted: vector id -> row
    max_row: int  # rows above this were written after the build
    # Searches reading it now. Once replaced (a merge) or closed it is retired, and its index is
    # closed by whoever leaves it last unread, giving its GPU memory back to the shared budget.
    readers: int = 0
    retired: bool = False
    unsearchable: int | None = None  # live rows a rebuild left out (see Collection._usable)


@dataclass
class ReadView:
    main: Generation
    tomb: np.ndarray  # uint8 bitmap over main vector ids, as of the snapshot (the collection replaces, never writes it)
    tomb_count: int
    fresh: FreshView


def rows_digest(rows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows, np.int64).tobytes()).hexdigest()


def load_published(path: Path, engine_config: EngineConfig, name: str) -> Generation:
    """The generation CURRENT names, its index opened and its row map checked; generations a crash or a merge
    left behind are removed. With no CURRENT, generation 0: nothing indexed."""
    cur = path / "CURRENT"
    keep = None
    main = Generation(0, None, np.empty(0, np.int64), -1)
    if cur.exists():
        c = read_json_record(cur, {"generation": int, "indexed": bool, "max_row": int})
        generation, indexed, max_row = int(c["generation"]), bool(c["indexed"]), int(c["max_row"])
        keep = gen_dir_name(generation)
        rows = _load_rows(path, keep, c, name) if indexed else np.empty(0, np.int64)
        index = Index.open(path / keep / "index", engine_config) if indexed else None
        if index is not None and len(rows) != index.count:
            index.close()
            raise IndexFormatError(f"{keep}/rows.npy maps {len(rows)} vectors, {keep}/index has {index.count}")
        main = Generation(generation, index, rows, max_row)
    for p in path.glob("gen-*"):  # generations a crash or a merge left behind
        if p.name == gen_dir_name(main.generation + 1):  # but the finished steps of a rebuild, to resume from
            clear_but_rebuild(p)
        elif p.name != keep:
            shutil.rmtree(p, ignore_errors=True)
    return main

def rebuild_partial(gdir: Path) -> Path:
    """Where a rebuild of generation directory gdir keeps its finished steps until it publishes."""
    return partial_dir(gdir / "index")


def clear_but_rebuild(gdir: Path) -> None:
    """Everything in gdir removed but a rebuild's finished steps (rebuild_partial), which a rebuild resumes from;
    gdir itself too where it holds none."""
    keep = rebuild_partial(gdir)
    if not (keep / BUILD_STATE).is_file():
        shutil.rmtree(gdir, ignore_errors=True)
        return
    for child in gdir.iterdir():
        if child != keep:
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def _load_rows(path: Path, gen: str, current: dict, collection: str) -> np.ndarray:
    """A generation's vector id -> row map, checked against the digest CURRENT holds for it: a
    flipped byte or a permutation would make answers wrong with no error."""
    name = f"{gen}/rows.npy"
    legacy = current.get("format", 1) < CURRENT_FORMAT
    if not legacy and "rows_sha256" not in current:
        raise IndexFormatError(f"CURRENT holds no checksum of {name}")
    try:
        rows = np.load(path / name, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise IndexFormatError(f"{name} is missing or unreadable ({e})") from e
    if rows.dtype != np.int64 or rows.ndim != 1:
        raise IndexFormatError(f"{name} is not a 1-D int64 array: the file is corrupt")
    if legacy:  # written before CURRENT held the digest: record it from now on
        log.warning("collection %r: CURRENT had no checksum of %s; recording one", collection, name)
        write_json_atomic(path / "CURRENT", current | {"format": CURRENT_FORMAT,
                                                             "rows_sha256": rows_digest(rows)})
    elif rows_digest(rows) != current["rows_sha256"]:
        raise IndexFormatError(f"{name} does not match its checksum in CURRENT: the file is corrupt")
    return rows


def write_rows(gdir: Path, rows: np.ndarray) -> None:
    """A generation's row map (vector id -> row), durable before CURRENT names it."""
    with open(gdir / "rows.npy", "wb") as f:
        np.save(f, np.ascontiguousarray(rows, np.int64))
        f.flush()
        os.fsync(f.fileno())
    fsync_path(gdir)
