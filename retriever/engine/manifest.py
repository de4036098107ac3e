"""The index directory: a versioned manifest, a checksum for every file, published atomically.

An index is built in a temporary sibling directory; every file is fsynced, the manifest is
written last, then the directory is renamed into place and its parent fsynced. A directory
without a readable manifest, or whose files do not match it, never loads.

The page file is too large to hash on every open, so the manifest holds its size and the
checksum of its per-block CRC32C table; the re-ranker checks each block's CRC as it reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from fusionrag.retriever.errors import IndexFormatError

FORMAT = "fusionrag-index"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ManifestShape:
    """count, dim and metric of an opened index, read from its manifest (`self.manifest`)."""

    manifest: dict

    @property
    def count(self) -> int:
        return int(self.manifest["count"])

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @property
    def metric(self) -> str:
        return self.manifest["metric"]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rewrite_manifest(index_dir: Path, manifest: dict, sync_dir: bool = True) -> None:
    """Write an index's manifest whole: beside the old one, fsynced and renamed over it, so a reader sees the old
    one or the new one. Its files are not touched (the manifest lists them, not itself)."""
    tmp = Path(index_dir) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    fsync_path(tmp)
    os.replace(tmp, Path(index_dir) / MANIFEST)
    if sync_dir:
        fsync_path(Path(index_dir))


def _remove_abandoned(final_dir: Path) -> None:
    """Delete temporary build directories of this target left by builds that were killed."""
    for p in final_dir.parent.glob(f".{final_dir.name}.tmp-*-*"):
        try:
            pid = int(p.name.rsplit(".tmp-", 1)[1].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError):
            pass


class IndexWriter:
    """Collects the files of an index in a temporary directory, then publishes them at once."""

    def __init__(self, final_dir: Path, overwrite: bool = False):
        self.final_dir = Path(final_dir)
        if self.final_dir.exists() and not overwrite:
            raise FileExistsError(f"{self.final_dir} already exists (pass overwrite to replace it)")
        self.final_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(self.final_dir)
        self.dir = Path(tempfile.mkdtemp(prefix=f".{self.final_dir.name}.tmp-{os.getpid()}-", dir=self.final_dir.parent))
        self.files: dict[str, dict] = {}

    def path(self, name: str) -> Path:
        return self.dir / name

    def save_array(self, name: str, arr: np.ndarray) -> None:
        """arr saved as the .npy file name; an array already memory-mapped from that file (a build writes its
        largest arrays so) is flushed, not copied."""
        if isinstance(arr, np.memmap) and arr.filename and Path(arr.filename).resolve() == self.path(name).resolve():
            arr.flush()
        else:
            with open(self.path(name), "wb") as f:
                np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
        self.add_file(name)

    def add_file(self, name: str, hashed: bool = True) -> None:
        """Record a finished file: fsync it, note its size and (unless too large) its hash."""
        p = self.path(name)
        fsync_path(p)
        entry = {"bytes": p.stat().st_size}
        if hashed:
            entry["sha256"] = sha256_file(p)
        self.files[name] = entry

    def stage(self, manifest: dict) -> None:
        """Write the manifest into the temporary directory: the index there can then be opened (as a build's
        calibration does) before publish moves it into place."""
        rewrite_manifest(self.dir, {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest,
                                    "files": self.files}, sync_dir=False)

    def publish(self, manifest: dict) -> None:
        self.stage(manifest)
        fsync_path(self.dir)
        old = None
        if self.final_dir.exists():
            old = self.final_dir.with_name(f".{self.final_dir.name}.old-{os.getpid()}-{time.monotonic_ns()}")
            os.replace(self.final_dir, old)
        os.replace(self.dir, self.final_dir)
        fsync_path(self.final_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def writing_index(final_dir: Path, overwrite: bool = False):
    w = IndexWriter(final_dir, overwrite)
    try:
        yield w
    except BaseException:
        w.abort()
        raise


def read_manifest(index_dir: Path, verify: bool = True, required: dict[str, bool] | None = None) -> dict:
    """The manifest of a whole index, after checking every file it lists. required: file name ->
    whether it must carry a checksum; a required file the manifest does not list (or lists without
    its checksum) is an error, so taking an entry out does not make a file go unchecked."""
    index_dir = Path(index_dir)
    if not index_dir.is_dir():
        raise IndexFormatError(f"{index_dir}: no such index directory")
    mpath = index_dir / MANIFEST
    if not mpath.exists():
        raise IndexFormatError(f"{index_dir}: not a fusionrag index, or an incomplete one (no {MANIFEST})")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IndexFormatError(f"{mpath}: unreadable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IndexFormatError(f"{mpath}: not a fusionrag index manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise IndexFormatError(f"{mpath}: invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise IndexFormatError(
            f"{index_dir}: index format version {version} is newer than this fusionrag supports "
            f"({FORMAT_VERSION}); upgrade fusionrag to open it")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise IndexFormatError(f"{mpath}: no file list")
    for name, hashed in (required or {}).items():
        entry = files.get(name)
        if not isinstance(entry, dict) or "bytes" not in entry or (hashed and "sha256" not in entry):
            raise IndexFormatError(f"{index_dir}: the manifest does not list {name} with its size"
                                   f"{' and checksum' if hashed else ''}")
    for name, entry in files.items():
        p = index_dir / name
        if not p.exists():
            raise IndexFormatError(f"{index_dir}: file {name} listed in the manifest is missing")
        size = p.stat().st_size
        if size != entry["bytes"]:
            raise IndexFormatError(f"{p}: {size} bytes, manifest says {entry['bytes']} (truncated or replaced)")
        if verify and "sha256" in entry and sha256_file(p) != entry["sha256"]:
            raise IndexFormatError(f"{p}: checksum mismatch, the file is corrupt")
    return manifest


def load_array(index_dir: Path, name: str, dtype, ndim: int, mmap: bool = False) -> np.ndarray:
    """mmap: a read-only memory map of the file rather than a copy in the heap."""
    p = Path(index_dir) / name
    try:
        arr = np.load(p, allow_pickle=False, mmap_mode="r" if mmap else None)
    except (OSError, ValueError) as e:
        raise IndexFormatError(f"{p}: unreadable array ({e})") from e
    if arr.dtype != np.dtype(dtype) or arr.ndim != ndim:
        raise IndexFormatError(f"{p}: expected a {ndim}-D {np.dtype(dtype)} array, found {arr.ndim}-D {arr.dtype}")
    return arr
