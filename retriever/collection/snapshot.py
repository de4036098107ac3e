"""Snapshots of a collection: one tar archive of its state at one point, written while writes go on, and
restored (under any name, on any data directory) as a collection that answers the same searches.

An archive holds collection.json, the published generation (CURRENT and gen-NNNNNN/: rows.npy and the
index), a consistent copy of the doc store made by SQLite's online backup, and last snapshot.json: the
format, what the collection is, and the size and SHA-256 of every other member. The generation's files
never change once published, and merges wait while they are read; the doc store's copy holds every
write acknowledged before it was taken, so the log is not needed. A restore accepts only those members,
as regular files, each matching snapshot.json, and opens the result (every check a collection's open
makes) before it is renamed into place.

A sharded collection's archive (write_tree) holds collection.json and its index/ tree: the router's files and each
shard part's (its generations, its log, a backup of its doc store), copied while its writes and merges wait; it is
restored by the same extract and opened as its shards open (every part's manifest checked against the router's).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sqlite3
import tarfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from fusionrag.retriever.collection import quota
from fusionrag.retriever.collection.generations import gen_dir_name
from fusionrag.retriever.engine.manifest import fsync_path
from fusionrag.retriever.errors import IndexFormatError, InputError

if TYPE_CHECKING:
    from fusionrag.retriever.collection import Collection

FORMAT = "fusionrag-snapshot"
FORMAT_VERSION = 1
MANIFEST = "snapshot.json"
_PART = r"[A-Za-z0-9_-][A-Za-z0-9_.-]*"  # a file or folder name: no leading dot, no separator
# A collection's members; a sharded one's (retriever/sharded/hosted.py) are collection.json and its index/ tree.
_MEMBER = re.compile(r"(collection\.json|CURRENT|docs\.sqlite|gen-\d{6}/rows\.npy|gen-\d{6}/index/%s"
                     r"|index/(?:%s/){0,3}%s)" % (_PART, _PART, _PART))
# What a sharded collection's tree holds that no snapshot takes: locks, and SQLite's journals (a store is copied by
# its online backup, which reads them).
_NOT_COPIED = re.compile(r"LOCK|.*\.sqlite-(wal|shm|journal)|\..*")
_CHUNK = 1 << 20


class _Hashing(io.RawIOBase):
    """A file read through: what tarfile copies is hashed on the way."""

    def __init__(self, f: IO[bytes]):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = self.f.readinto(buf)
        self.sha.update(memoryview(buf)[:n])
        self.bytes += n
        return n


def _backup(store: Path, copy: Path) -> int:
    """A consistent copy of the SQLite database `store` (its online backup: writers wait only page by page);
    returns the documents it holds."""
    src = sqlite3.connect(store)
    try:
        dst = sqlite3.connect(copy)
        try:
            src.backup(dst)
            return dst.execute("SELECT COUNT(*) FROM docs").fetchone()[0]
        finally:
            dst.close()
    finally:
        src.close()


def _archive(dest: Path, fill) -> dict:
    """Write a snapshot archive to dest, atomically (a temporary name, fsynced, renamed): fill(tar, files, scratch)
    adds the members (_add, which records each in files), with scratch a free path beside dest for a store's
    backup, and returns what snapshot.json says the collection is; snapshot.json goes last. Returns the manifest
    without its member list, and the archive's bytes."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp")
    scratch = dest.with_name(f".{dest.name}.docs.sqlite")
    files: dict[str, dict] = {}
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **fill(tar, files, scratch),
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": files}
            data = json.dumps(manifest, indent=1).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        fsync_path(dest.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        scratch.unlink(missing_ok=True)
    return {k: v for k, v in manifest.items() if k != "files"} | {"bytes": dest.stat().st_size}


def write_tree(path: Path, describe: dict, dest: Path) -> dict:
    """Write the snapshot of a sharded collection (retriever/sharded/hosted.py) at `path` to dest, atomically:
    collection.json and every file of its index/ tree (a shard's doc store by SQLite's online backup; locks and
    journals left out). The caller holds the tree still (no write, no merge). describe: what snapshot.json says
    the collection is (name, dimension, metric, embedding, documents, shards)."""
    path = Path(path)

    def fill(tar: tarfile.TarFile, files: dict, scratch: Path) -> dict:
        _add(tar, path / "collection.json", "collection.json", files)
        for p in sorted((path / "index").rglob("*")) if (path / "index").is_dir() else []:
            rel = p.relative_to(path)
            if not p.is_file() or any(_NOT_COPIED.fullmatch(part) for part in rel.parts):
                continue
            if p.suffix == ".sqlite":
                _backup(p, scratch)
                _add(tar, scratch, rel.as_posix(), files)
                scratch.unlink()
            else:
                _add(tar, p, rel.as_posix(), files)
        return describe

    return _archive(dest, fill)


def _add(tar: tarfile.TarFile, path: Path, name: str, files: dict) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = path.stat().st_size, int(time.time()), 0o644
    with open(path, "rb") as f:
        hashing = _Hashing(f)
        tar.addfile(info, io.BufferedReader(hashing, _CHUNK))
    files[name] = {"bytes": hashing.bytes, "sha256": hashing.sha.hexdigest()}


def write(col: Collection, current: dict | None, dest: Path) -> dict:
    """Write col's snapshot to dest (atomically: a temporary name, fsynced, renamed). The caller holds
    col's merge lock, so `current` (CURRENT's contents, None before a first merge) stays published."""

    def fill(tar: tarfile.TarFile, files: dict, scratch: Path) -> dict:
        count = _backup(col.store.path, scratch)  # a consistent copy while writers go on
        _add(tar, col.path / "collection.json", "collection.json", files)
        if current is not None:
            _add(tar, col.path / "CURRENT", "CURRENT", files)
            gen = gen_dir_name(current["generation"])
            for p in sorted((col.path / gen).rglob("*")):
                if p.is_file():
                    _add(tar, p, p.relative_to(col.path).as_posix(), files)
        _add(tar, scratch, "docs.sqlite", files)
        return {"collection": col.name, "dimension": col.dim, "metric": col.metric, "embedding": col.embedding,
                "documents": count, "generation": current["generation"] if current else 0}

    return _archive(dest, fill)


_PLAIN = (tarfile.REGTYPE, tarfile.AREGTYPE)
# The PAX keys tarfile's writer may give a member of ours (a size past 8 GiB, say); any other (GNU.sparse.*,
# a charset, a link) is not of a snapshot.
_PAX_KEYS = frozenset({"path", "size", "mtime", "uid", "gid", "uname", "gname"})


def _check_member(member: tarfile.TarInfo, seen) -> None:
    """InputError unless member is one snapshot.write writes: a plain regular file (not sparse: its data would
    expand to whatever size its header claims), named as a snapshot's member, and not seen before."""
    name = member.name
    if member.type not in _PLAIN or member.sparse is not None or set(member.pax_headers) - _PAX_KEYS:
        kind = "sparse file" if member.sparse is not None or member.type == tarfile.GNUTYPE_SPARSE else \
            f"tar member of type {member.type!r}" if member.type not in _PLAIN else "file with foreign PAX headers"
        raise InputError(f"snapshot: member {name!r:.120} is a {kind}; a snapshot holds only plain files")
    if (name != MANIFEST and not _MEMBER.fullmatch(name)) or name in seen:
        raise InputError(f"snapshot: unexpected member {name!r:.120} (not a fusionrag snapshot, or altered)")


def _read_manifest(tar: tarfile.TarFile, member: tarfile.TarInfo) -> dict:
    if member.size >= (16 << 20):
        raise InputError(f"snapshot: {MANIFEST} of {member.size} bytes is not a snapshot's")
    try:
        manifest = json.loads(tar.extractfile(member).read())
    except ValueError as e:
        raise InputError(f"snapshot: {MANIFEST} is not JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InputError(f"snapshot: {MANIFEST} is not a fusionrag snapshot's")
    if not isinstance(manifest.get("format_version"), int) or manifest["format_version"] > FORMAT_VERSION:
        raise InputError(f"snapshot: format version {manifest.get('format_version')!r} is newer than this "
                         f"fusionrag reads ({FORMAT_VERSION}); upgrade fusionrag to restore it")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and type(v.get("bytes")) is int and v["bytes"] >= 0 for v in files.values()):
        raise InputError(f"snapshot: {MANIFEST} does not list its members' sizes")
    return manifest


def _mismatch(files: dict, seen: dict, key) -> InputError:
    missing = sorted(set(files) - set(seen))
    wrong = sorted(n for n in seen if n not in files or key(files[n]) != key(seen[n]))
    return InputError(f"snapshot: members do not match {MANIFEST} (missing {missing[:10]}, altered {wrong[:10]})")


def _declared(archive: IO[bytes]) -> dict[str, int]:
    """A first pass over a seekable archive's headers (its data skipped): each member's size, once every member
    is of a snapshot and the sizes are those its manifest declares."""
    start = archive.tell()
    sizes: dict[str, int] = {}
    manifest = None
    with tarfile.open(fileobj=archive, mode="r:") as tar:
        for member in tar:
            _check_member(member, sizes)
            if member.name == MANIFEST:
                manifest = _read_manifest(tar, member)
            else:
                sizes[member.name] = member.size
    archive.seek(start)
    if manifest is None:
        raise InputError(f"snapshot: no {MANIFEST} (not a fusionrag snapshot, or cut short)")
    if set(manifest["files"]) != set(sizes) or any(manifest["files"][n]["bytes"] != b for n, b in sizes.items()):
        raise _mismatch(manifest["files"], {n: {"bytes": b} for n, b in sizes.items()}, lambda v: v["bytes"])
    return sizes


def _seekable(f) -> bool:
    try:
        return f.seekable()
    except (AttributeError, OSError, ValueError):
        return False


def extract(archive: IO[bytes], into: Path, max_bytes: int = 0, reserve: int = 0) -> dict:
    """Unpack a snapshot into the empty directory `into`, checking every member against snapshot.json;
    returns the manifest. Raises InputError for an archive that is not a whole, valid snapshot or that would
    write more than max_bytes (0: no limit), StorageError where it would leave less than `reserve` bytes free
    on into's disk. A seekable archive's headers are read first, and nothing is written unless every member is
    a plain file of a snapshot whose size its manifest declares and the total fits both bounds; a stream is
    checked member by member, before each is written."""
    seen: dict[str, dict] = {}
    manifest = None
    written = 0
    try:
        declared = _declared(archive) if _seekable(archive) else None
        if declared is not None:
            _check_bytes(sum(declared.values()), max_bytes, into, reserve)
        with tarfile.open(fileobj=archive, mode="r|") as tar:  # a stream: members in order, nothing held
            for member in tar:
                _check_member(member, seen if member.name != MANIFEST or manifest is None else {MANIFEST})
                name = member.name
                if name == MANIFEST:
                    manifest = _read_manifest(tar, member)
                    continue
                if declared is not None and declared.get(name) != member.size:
                    raise InputError(f"snapshot: member {name!r} changed while it was read")
                written += member.size
                _check_bytes(written, max_bytes, into, reserve, member.size)
                path = into / name
                path.parent.mkdir(parents=True, exist_ok=True)
                sha, size = hashlib.sha256(), 0
                src = tar.extractfile(member)
                with open(path, "wb") as out:
                    while size < member.size and (chunk := src.read(min(_CHUNK, member.size - size))):
                        sha.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                seen[name] = {"bytes": size, "sha256": sha.hexdigest()}
    except tarfile.TarError as e:
        raise InputError(f"snapshot: not a readable tar archive ({e})") from e
    if manifest is None:
        raise InputError(f"snapshot: no {MANIFEST} (not a fusionrag snapshot, or cut short)")
    files = manifest["files"]
    if files != seen:
        raise _mismatch(files, seen, lambda v: v)
    for p in sorted({p for p in into.rglob("*") if p.is_dir()}, key=lambda p: -len(p.parts)) + [into]:
        fsync_path(p)
    return manifest


def _check_bytes(total: int, max_bytes: int, into: Path, reserve: int, now: int | None = None) -> None:
    """The bounds of a restore: `total` bytes written in all (of which `now`, when given, are about to be)."""
    if max_bytes and total > max_bytes:
        raise InputError(f"snapshot: its members hold {'over ' if now is not None else ''}{total} bytes, more than "
                         f"the {max_bytes} a restore may write (max_restore_bytes)")
    quota.check_room(into, total if now is None else now, reserve, "restoring the snapshot")


def rename_collection(into: Path, name: str) -> dict:
    """The restored collection takes the name it is restored under; returns its collection.json."""
    path = into / "collection.json"
    try:
        desc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise IndexFormatError(f"snapshot: collection.json is unreadable ({e})") from e
    if not isinstance(desc, dict):
        raise InputError("snapshot: collection.json is not an object")
    desc["name"] = name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(desc))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return desc


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
