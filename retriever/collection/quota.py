"""What one tenant may take from the others: room on the data disk, open files, and the counts that bound both.

- Disk: writes (upserts, deletes, merges) may use the disk to its last byte, but a snapshot, an import and a
  restore are refused (StorageError, 507) when they would leave less than a reserve free, so bulk operations
  run out of room before a tenant's ordinary writes do. Each checks before it writes what it declares it
  will write, and again as it writes. An upload claims its room (DiskClaim: what its request declares, else a
  few MiB at a time) before it writes, and every check counts the room the writers in flight have claimed and
  not yet written, so writers at once never each take the same room above the reserve.
- Descriptors: the soft limit is raised to the hard one at start; collections keep their files open only
  while they are among the most recently used (OpenFiles below; an idle one closes its doc store and log and
  reopens them on its next call; an idle sharded collection closes its shards whole), and no collection opens
  files once fewer than a reserve of descriptors is left, so the service can always accept a connection,
  answer and log. Each collection counts in the pool for the descriptors it may hold: a collection's, or a
  sharded one's per shard.
"""

from __future__ import annotations

import collections
import os
import resource
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fusionrag.retriever.errors import StorageError, UnavailableError

if TYPE_CHECKING:
    from fusionrag.retriever.collection import Collection

# Descriptors one collection holds at most while its files are open: the doc store's writer (database, -wal,
# -shm), the log, up to docstore.MAX_READERS read connections (database and -wal each), a merge's snapshot
# connection, and the index's page file with its io_uring ring.
DESCRIPTORS_PER_COLLECTION = 3 + 1 + 2 * 8 + 2 + 2
# Descriptors one shard of a sharded collection (retriever/sharded/hosted.py) holds at most while its files are
# open: its lock, its doc store's writer (database, -wal, -shm), its log, up to docstore.MAX_READERS read
# connections (database and -wal each), and its index's page file with its io_uring rings (one per read in
# progress), again for the next generation a merge opens beside the current one. What a 2-shard collection was
# measured to hold (/proc/self/fd) after searches and writes: 9 to 10 a shard.
DESCRIPTORS_PER_SHARD = 1 + 3 + 1 + 2 * 8 + 2 * 3
MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """A catalog's bounds (0: none, or derived where said)."""

    max_collections: int = 0  # collections in the data directory at most
    # collections with their files open at most, a sharded one counted for its shards' descriptors (0: derived
    # from the fd limit)
    max_open_collections: int = 0
    descriptor_reserve: int = 64  # descriptors collections never take
    disk_reserve_bytes: int = 0  # snapshots, imports and restores leave at least this free
    max_restore_bytes: int = 0  # bytes one restore may write at most

    def open_collections(self) -> int:
        """max_open_collections, or what the descriptor limit allows past the reserve."""
        if self.max_open_collections:
            return self.max_open_collections
        return max(4, (descriptor_limit() - self.descriptor_reserve) // DESCRIPTORS_PER_COLLECTION)


# -- the disk ----------------------------------------------------------------------------------------

def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still write on path's file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def disk_bytes(path: str | os.PathLike) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


# Room claimed on each file system (by st_dev) by writers in flight (DiskClaim) and not yet written: what
# the free space does not show yet, and every check_room there counts.
_claims_lock = threading.Lock()
_claimed: dict[int, int] = {}


def check_room(path: str | os.PathLike, need: int, reserve: int, what: str) -> None:
    """StorageError unless writing `need` more bytes under `path` leaves `reserve` free, besides the room the
    writers in flight on its file system have claimed (DiskClaim) and not yet written."""
    with _claims_lock:
        _check(path, os.stat(path).st_dev, need, reserve, what)


def _check(path, dev: int, need: int, reserve: int, what: str) -> None:
    """check_room's test; caller holds _claims_lock."""
    free, claimed = free_bytes(path), _claimed.get(dev, 0)
    if free - claimed - need < reserve:
        held = f", {_size(claimed)} of it claimed by uploads in progress" if claimed else ""
        raise StorageError(f"{what} needs {_size(need)} and the data disk has {_size(free)} free{held}, of which "
                           f"{_size(reserve)} is kept in reserve (disk_reserve_mb) for the collections' writes")


class DiskClaim:
    """Room on the file system of `path` that one writer in flight (an upload as it arrives) has claimed and not
    yet written: every check_room there counts it (other uploads', snapshots', imports', restores'), so writers
    at once cannot each take the same room above the reserve. take() before writing, wrote() after, release()
    at the end, whatever happened (what was claimed and not written is given back). Thread-safe."""

    def __init__(self, path: str | os.PathLike, reserve: int, what: str):
        self.path, self.reserve, self.what = path, reserve, what
        self.held = 0  # claimed, not yet written
        self._dev: int | None = None

    def take(self, n: int) -> None:
        """Claim n bytes more: StorageError, claiming nothing, unless they fit above the reserve besides every
        claim on the file system (this one's included)."""
        with _claims_lock:
            dev = os.stat(self.path).st_dev if self._dev is None else self._dev
            _check(self.path, dev, n, self.reserve, self.what)
            self._dev = dev
            _claimed[dev] = _claimed.get(dev, 0) + n
            self.held += n

    def wrote(self, n: int) -> None:
        """n bytes of what it claimed are written now (the free space counts them)."""
        self._give(min(n, self.held))

    def release(self) -> None:
        self._give(self.held)

    def _give(self, n: int) -> None:
        if n <= 0:
            return
        with _claims_lock:
            self.held -= n
            left = _claimed.get(self._dev, 0) - n
            if left > 0:
                _claimed[self._dev] = left
            else:
                _claimed.pop(self._dev, None)

    def __enter__(self) -> "DiskClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _size(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} bytes"


def tree_bytes(path: Path) -> int:
    """Bytes of the files under path (0 where it is gone)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


# -- descriptors -------------------------------------------------------------------------------------

def descriptor_limit() -> int:
    """The soft limit on open files (an unlimited one counted as 2**20)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def raise_descriptor_limit(cap: int = 1 << 20) -> int:
    """The soft limit on open files raised to the hard limit (at most `cap`); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError):
        return soft
    return want


def open_descriptors() -> int | None:
    """Descriptors this process has open (None where /proc does not say)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir opened
    except OSError:
        return None


class OpenFiles:
    """The collections whose files are open, least recently used first, each counted for the descriptors it may
    hold (its `descriptors`: DESCRIPTORS_PER_COLLECTION for a collection, its shards' for a sharded one; 0, one
    that holds none, is not counted). Once those of the open ones pass `limit` collections' worth (`budget`), the
    longest unused of those idle (no call in progress, no merge, no import) close their files; and before a
    collection opens its files, idle ones close theirs until the process, as /proc/self/fd counts it, has a
    reserve of descriptors free besides what the collection may open, else the call is refused with
    UnavailableError (503) rather than taking the last ones."""

    def __init__(self, limits: Limits):
        self.limit = limits.open_collections()
        self.budget = self.limit * DESCRIPTORS_PER_COLLECTION  # descriptors the open collections may hold in all
        self.reserve = limits.descriptor_reserve
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[Collection, int] = collections.OrderedDict()  # -> its descriptors
        self._held = 0  # the descriptors of those in _lru, summed

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    @property
    def held(self) -> int:
        """Descriptors the open collections may hold, summed (what `budget` bounds)."""
        with self._lock:
            return self._held

    def used(self, col: Collection, opened: bool) -> None:
        """col is in use; opened: it has just opened its files."""
        need = getattr(col, "descriptors", DESCRIPTORS_PER_COLLECTION)
        with self._lock:
            self._held += need - self._lru.pop(col, 0)
            if not need:  # it holds no file (a sharded collection not built yet)
                return
            self._lru[col] = need
            if not opened or self._held <= self.budget:
                return
            idle = [c for c in self._lru if c is not col]
        self._release(idle, lambda: self.held <= self.budget)

    def forget(self, col: Collection) -> None:
        with self._lock:
            self._held -= self._lru.pop(col, 0)

    def make_room(self, need: int = DESCRIPTORS_PER_COLLECTION) -> None:
        """Before a collection opens its files (need: the descriptors they may take): UnavailableError unless the
        process keeps `reserve` descriptors free after they are open (idle collections close theirs first where
        that is needed)."""
        limit = descriptor_limit()
        room = limit - self.reserve - need
        n = open_descriptors()
        if n is None or n <= room:
            return
        with self._lock:
            idle = list(self._lru)

        def enough() -> bool:
            now = open_descriptors()
            return now is None or now <= room

        self._release(idle, enough)
        if not enough():
            raise UnavailableError(f"the service has {open_descriptors()} of its {limit} files open and keeps "
                                   f"{self.reserve} for connections and logs: retry once calls in progress have ended")

    def fits(self, need: int) -> bool:
        """Whether a collection that may hold `need` descriptors can ever open its files here: past the reserve,
        within the open-files limit."""
        return need <= descriptor_limit() - self.reserve

    def _release(self, candidates: list, done) -> None:
        for c in candidates:
            if done():
                return
            if c.release_files():
                with self._lock:
                    if c.dormant:
                        self._held -= self._lru.pop(c, 0)
