"""The service's snapshots: snapshots/<collection>/<id>.tar (the archive, retriever/collection/snapshot.py) and <id>.json (what
it holds), beside the collections so that they outlive a drop. Bounded: at most max_snapshots per collection, a
collection's within max_snapshot_bytes (so a tenant's are bounded by its collections), and none written into the
disk reserve."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from pathlib import Path

from fusionrag.retriever.collection import quota
from fusionrag.retriever.collection.contract import CollectionContract
from fusionrag.retriever.errors import NotFoundError, QuotaError, StorageError

SNAPSHOT_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{8}")


class SnapshotShelf:
    def __init__(self, root: Path, max_per_collection: int, max_bytes: int, reserve: int):
        """max_bytes 0: half the data disk."""
        self.root = root
        self.max_per_collection, self.reserve = max_per_collection, reserve
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._writing: dict[tuple[str, str], int] = {}  # (collection, id) -> bytes it may take, while written
        self.clean()

    def clean(self) -> None:
        """Remove what a crash left: archives cut short and doc-store copies (hidden names), and descriptions
        whose archive is gone."""
        for folder in self.root.glob("*") if self.root.is_dir() else ():
            for p in folder.glob(".*"):
                p.unlink(missing_ok=True)
            for desc in folder.glob("*.json"):
                if not desc.with_suffix(".tar").exists():
                    desc.unlink(missing_ok=True)

    def folder(self, name: str) -> Path:
        return self.root / name

    def _bytes_limit(self) -> int:
        return self.max_bytes or quota.disk_bytes(self.root) // 2

    def take(self, coll: CollectionContract) -> dict:
        """Write a snapshot of coll: QuotaError when it would be one too many of coll's or pass the bytes coll's
        may take, StorageError when it would write into the disk reserve."""
        folder = self.folder(coll.name)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot make the snapshot folder: {e}") from e
        snapshot_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]
        need = quota.tree_bytes(coll.path)  # about what the archive takes: the generation and the doc store
        with self._lock:
            kept = len(self._ids(coll.name)) + sum(c == coll.name for c, _ in self._writing)
            if kept >= self.max_per_collection:
                raise QuotaError(f"collection {coll.name!r} has {kept} snapshots, its limit (max_snapshots): delete "
                                 "one before taking another")
            held = quota.tree_bytes(folder) + sum(b for (c, _), b in self._writing.items() if c == coll.name)
            limit = self._bytes_limit()
            if held + need > limit:
                raise QuotaError(f"collection {coll.name!r}'s snapshots take {held} bytes and this one about {need} "
                                 f"more, past the {limit} they may take (max_snapshot_bytes): delete some first")
            quota.check_room(folder, need + sum(self._writing.values()), self.reserve, "the snapshot")
            self._writing[(coll.name, snapshot_id)] = need
        try:
            try:
                info = {"id": snapshot_id, **coll.snapshot(folder / f"{snapshot_id}.tar")}
            except StorageError as e:
                # A drop waits for a snapshot in progress and refuses one that comes after it (NotFoundError,
                # 404); should the collection's files be gone all the same, that is what the caller is told.
                if not coll.path.is_dir():
                    raise NotFoundError(f"collection {coll.name!r} was deleted") from e
                raise
            try:
                (folder / f"{snapshot_id}.json").write_text(json.dumps(info))
            except OSError as e:
                (folder / f"{snapshot_id}.tar").unlink(missing_ok=True)
                raise StorageError(f"cannot write the snapshot's description: {e}") from e
            return info
        finally:
            with self._lock:
                self._writing.pop((coll.name, snapshot_id), None)

    def _ids(self, name: str) -> list[str]:
        folder = self.folder(name)
        return sorted(p.stem for p in folder.glob("*.tar") if SNAPSHOT_ID.fullmatch(p.stem)) if folder.is_dir() else []

    def list(self, name: str) -> list[dict]:
        """The snapshots of a collection, oldest first (one deleted meanwhile is left out)."""
        found = []
        for snapshot_id in self._ids(name):
            tar = self.folder(name) / f"{snapshot_id}.tar"
            try:
                found.append(json.loads(tar.with_suffix(".json").read_text()))
                continue
            except (OSError, ValueError):  # a description cut short by a crash, or deleted meanwhile
                pass
            try:
                found.append({"id": snapshot_id, "bytes": tar.stat().st_size})
            except OSError:  # deleted meanwhile
                pass
        return found

    def path(self, name: str, snapshot_id: str) -> Path:
        path = self.folder(name) / f"{snapshot_id}.tar"
        if not SNAPSHOT_ID.fullmatch(snapshot_id) or not path.is_file():
            raise NotFoundError(f"no snapshot {snapshot_id[:80]!r} of collection {name!r}")
        return path

    def delete(self, name: str, snapshot_id: str) -> None:
        path = self.path(name, snapshot_id)
        path.unlink(missing_ok=True)
        path.with_suffix(".json").unlink(missing_ok=True)
