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


# A large file a merge writes (a copy of the page file, the codes, the stored vectors of a rebuild) is made durable
# and dropped from the page cache every this many bytes: a memory cgroup counts dirty page cache, and v1 cannot
# throttle a writer by it, so a process near its limit was killed while copying a page file it could not write
# back fast enough (#51).
DIRTY_BYTES = 32 << 20


def written_back(fd: int, upto: int) -> None:
    """A file's first `upto` bytes made durable and dropped from the page cache (a memory cgroup counts dirty
    pages; v1 cannot throttle a writer by them)."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, upto, os.POSIX_FADV_DONTNEED)


def copy_file(src: Path, dst: Path, every: int = DIRTY_BYTES) -> None:
    """src copied to dst (copy_file_range: in-kernel, a reflink where the file system has them; read and write
    where it cannot), at most `every` bytes of it dirty in the page cache at a time; src's pages are dropped from
    the cache as they are copied (an index reads its page file with O_DIRECT and its graph file once, at open, not
    through the cache)."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        size, done = os.fstat(fi.fileno()).st_size, 0
        kernel = hasattr(os, "copy_file_range")
        while done < size:
            n = min(every, size - done)
            got = 0
            if kernel:
                try:
                    got = os.copy_file_range(fi.fileno(), fo.fileno(), n, done, done)
                except OSError:  # another file system, or a kernel without it
                    kernel = False
            if not kernel:
                data = os.pread(fi.fileno(), n, done)
                got = os.pwrite(fo.fileno(), data, done)
            if got <= 0:
                raise OSError(f"{src}: copy stopped at {done} of {size} bytes")
            done += got
            written_back(fo.fileno(), done)
            os.posix_fadvise(fi.fileno(), 0, done, os.POSIX_FADV_DONTNEED)


class ArrayFileWriter:
    """A .npy file of a known shape written row chunks at a time, in order, at most DIRTY_BYTES of it dirty at a
    time (see copy_file); array() then maps it, read-only."""

    def __init__(self, path: Path, dtype, shape: tuple):
        self.path = Path(path)
        header = np.lib.format.open_memmap(self.path, mode="w+", dtype=dtype, shape=shape)
        self.offset, self.dtype, self.shape = header.offset, np.dtype(dtype), shape
        del header
        self._f = open(self.path, "r+b")
        self._f.seek(self.offset)
        self._dirty = 0
        self.rows = 0

    def write(self, rows: np.ndarray) -> None:
        data = np.ascontiguousarray(rows, dtype=self.dtype)
        self._f.write(data.data)
        self.rows += len(data)
        self._dirty += data.nbytes
        if self._dirty >= DIRTY_BYTES:
            self._f.flush()
            written_back(self._f.fileno(), self._f.tell())
            self._dirty = 0

    def array(self) -> np.ndarray:
        """The file, memory-mapped read-only (its rows past those written are zeros)."""
        self._f.flush()
        written_back(self._f.fileno(), self._f.tell())
        self._f.close()
        return np.load(self.path, mmap_mode="r", allow_pickle=False)


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

    def add_file(self, name: str, hashed: bool = True, sha256: str | None = None) -> None:
        """Record a finished file: fsync it, note its size and (unless too large) its hash; sha256: the hash where
        the caller computed it already (of these bytes)."""
        p = self.path(name)
        fsync_path(p)
        entry = {"bytes": p.stat().st_size}
        if hashed:
            entry["sha256"] = sha256 or sha256_file(p)
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


    # A writer whose build cannot resume records no steps (ResumableWriter records them).
    elapsed_before = 0.0  # seconds earlier runs of the build spent on the steps recorded

    @property
    def steps(self) -> dict:
        return {}

    @property
    def timings(self) -> dict:
        return {}

    def step_done(self, name: str, payload: dict | None = None, paths=(), rng=None, timings=None) -> None:
        """A build's step `name` finished (see ResumableWriter); nothing to record here."""

    def restore_rng(self, rng) -> None:
        """Nothing was recorded, so nothing to restore (see ResumableWriter)."""


@contextmanager
def writing_index(final_dir: Path, overwrite: bool = False):
    w = IndexWriter(final_dir, overwrite)
    try:
        yield w
    except BaseException:
        w.abort()
        raise


BUILD_STATE = "build_state.json"
BUILD_STATE_VERSION = 1


def partial_dir(final_dir: Path) -> Path:
    """Where a resumable build of final_dir writes until it publishes (ResumableWriter): `.NAME.partial` beside it."""
    final_dir = Path(final_dir)
    return final_dir.with_name(f".{final_dir.name}.partial")


class ResumableWriter(IndexWriter):
    """An index written in `.NAME.partial` beside its target, with a record of the build's finished steps
    (build_state.json: the build's key, each finished step's figures, the files recorded so far, the random
    generator's state and the timings after it), so a build killed however it was (SIGKILL, the OOM killer, a lost
    machine) resumes from its last finished step when it is run again with the same key (the source, as a
    fingerprint of its file or its contents, and the build's settings). Another key, or resume=False, starts over
    in the same directory. The partial directory has no manifest until calibration stages one, and never the
    target's name, so it is never taken for a whole index. While a build runs it holds an exclusive flock on the
    partial directory: a second build of the same target is refused (ConflictError), and the lock goes with its
    process however it ends."""

    def __init__(self, final_dir: Path, overwrite: bool, key: dict, resume: bool = True):
        import fcntl

        from fusionrag.retriever.errors import ConflictError

        self.final_dir = Path(final_dir)
        if self.final_dir.exists() and not overwrite:
            raise FileExistsError(f"{self.final_dir} already exists (pass overwrite to replace it)")
        self.final_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(self.final_dir)
        self.dir = partial_dir(self.final_dir)
        self.dir.mkdir(exist_ok=True)
        self._lock = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise ConflictError(f"{self.final_dir}: another process is building this index now ({self.dir})") from None
        self.key = json.loads(json.dumps(key))  # as it reads back
        state = self._read_state() if resume else None
        if state is None or state.get("key") != self.key:
            for child in self.dir.iterdir():  # what a build of another key (or a fresh start) left
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
            state = {"version": BUILD_STATE_VERSION, "key": self.key, "steps": {}, "files": {}, "timings": {}}
        self.state = state
        self.files = dict(state["files"])
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        self._started = time.perf_counter()

    def _read_state(self) -> dict | None:
        try:
            state = json.loads((self.dir / BUILD_STATE).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(state, dict) or state.get("version") != BUILD_STATE_VERSION:
            return None
        return state

    def step_done(self, name: str, payload: dict | None = None, paths=(), rng=None, timings=None) -> None:
        """Record step `name` as finished: its files (paths, and those add_file recorded) fsynced first, then the
        state written beside the old one, fsynced and renamed over it; payload: what a resumed build needs of the
        step's results; rng: the generator whose state later steps continue from; timings: the build's so far."""
        for p in paths:
            fsync_path(Path(p))
        self.steps[name] = dict(payload or {})
        if rng is not None:
            self.state["rng"] = rng.bit_generator.state
        if timings is not None:
            self.state["timings"] = dict(timings)
        self.state["elapsed_s"] = self.elapsed_before + time.perf_counter() - self._started
        self.state["files"] = dict(self.files)
        tmp = self.dir / (BUILD_STATE + ".tmp")
        tmp.write_text(json.dumps(self.state))
        fsync_path(tmp)
        os.replace(tmp, self.dir / BUILD_STATE)
        fsync_path(self.dir)

    def restore_rng(self, rng) -> None:
        """rng set to the state the last finished step left it in (where one recorded it)."""
        if "rng" in self.state:
            rng.bit_generator.state = self.state["rng"]

    @property
    def steps(self) -> dict:
        return self.state["steps"]

    @property
    def timings(self) -> dict:
        return dict(self.state.get("timings", {}))

    def publish(self, manifest: dict) -> None:
        (self.dir / BUILD_STATE).unlink(missing_ok=True)
        super().publish(manifest)
        self.release()

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def abort(self) -> None:
        super().abort()
        self.release()


@contextmanager
def resumable_index(final_dir: Path, overwrite: bool, key: dict, resume: bool = True, discard=()):
    """A ResumableWriter for the duration of a build. An exception of a type in discard (bad input, bad settings:
    a rerun would meet it again) removes the partial directory; any other (an interrupt, a full disk) keeps it
    for a rerun to resume."""
    w = ResumableWriter(final_dir, overwrite, key, resume)
    try:
        yield w
    except BaseException as e:
        if isinstance(e, tuple(discard)):
            w.abort()
        else:
            w.release()
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
