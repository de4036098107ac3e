"""The write-ahead log of a collection: every write is appended and fsynced before it is
acknowledged, and replayed on open over what the doc store already holds.

A record is a 16-byte header (payload length, CRC32 of lsn + payload, lsn) then the payload. A
crash can leave a torn last record; `open` finds the first record whose length or checksum does
not hold, drops it and everything after it, and truncates the file there so later appends never
follow garbage.

Group commit: `append` only writes (under the caller's lock); `sync(lsn)` makes everything up to
lsn durable. Concurrent writers queue on one fsync: the first to arrive (the leader) fsyncs every
record appended so far, the others wake up to find their record already covered.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from pathlib import Path

from fusionrag.retriever.engine.manifest import fsync_path

_HEADER = struct.Struct("<IIQ")  # payload bytes, crc32(lsn || payload), lsn
_MAX_PAYLOAD = 1 << 30


def _crc(lsn: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(struct.pack("<Q", lsn)))


def _parse(data: bytes) -> tuple[list[tuple[int, bytes]], int]:
    """The whole records at the start of a log's bytes, (lsn, payload) each, and where they end: a torn or
    corrupt record, or one whose lsn does not grow, ends them."""
    records, pos, last = [], 0, 0
    while pos + _HEADER.size <= len(data):
        size, crc, lsn = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + size
        if size > _MAX_PAYLOAD or end > len(data) or lsn <= last:
            break
        payload = data[pos + _HEADER.size:end]
        if _crc(lsn, payload) != crc:
            break
        records.append((lsn, payload))
        pos, last = end, lsn
    return records, pos


class WriteAheadLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._sync_lock = threading.Lock()
        self._durable_lsn = 0
        self._fd = -1
        self.fsyncs = 0  # how many fsyncs served the appends: fewer than writes under group commit

    def open(self) -> list[tuple[int, bytes]]:
        """Open for appending; returns the whole records in the log as (lsn, payload)."""
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if created:
            fsync_path(self.path.parent)
        with open(self.path, "rb") as f:
            data = f.read()
        records, pos = _parse(data)
        last = records[-1][0] if records else 0
        if pos != len(data):  # a torn or corrupt tail: never half-applied, never appended after
            os.ftruncate(self._fd, pos)
            os.fsync(self._fd)
        self.end = pos
        self._durable_lsn = last
        return records

    def append(self, lsn: int, payload: bytes) -> int:
        """Write one record at the end (not yet durable); returns its offset. On a failed or
        short write the file is cut back, so the log holds only whole records."""
        rec = _HEADER.pack(len(payload), _crc(lsn, payload), lsn) + payload
        start = self.end
        try:
            written = os.pwrite(self._fd, rec, start)
            if written != len(rec):
                raise OSError(28, f"short write to {self.path} ({written} of {len(rec)} bytes)")
        except OSError:
            self.cut(start)
            raise
        self.end = start + len(rec)
        return start

    def cut(self, offset: int, lsn: int | None = None) -> None:
        """Drop every record from offset on (records that failed before being acknowledged). lsn: the first of them,
        whose number a later record may take again: none from it on counts as durable any more (taken after any
        fsync under way, which may have counted them)."""
        with self._sync_lock:
            os.ftruncate(self._fd, offset)
            self.end = offset
            if lsn is not None:
                self._durable_lsn = min(self._durable_lsn, lsn - 1)

    def sync(self, lsn: int, last_appended) -> None:
        """Make every record up to lsn durable. last_appended() gives the newest appended lsn;
        it is read just before the fsync, so one fsync covers every writer queued behind it."""
        with self._sync_lock:
            if self._durable_lsn >= lsn:
                return
            target = last_appended()
            os.fsync(self._fd)
            self.fsyncs += 1
            self._durable_lsn = max(self._durable_lsn, target)

    def durable(self, lsn: int) -> bool:
        return self._durable_lsn >= lsn

    def rewrite(self, keep) -> int:
        """Rewrite the log with only the records keep(lsn) is true of (the others are durable elsewhere): they
        are written to a temporary file, fsynced, and renamed over the log, so a crash leaves one log or the
        other, whole. Returns the bytes dropped. No append may run meanwhile."""
        with self._sync_lock:
            with open(self.path, "rb") as f:
                records, _ = _parse(f.read())
            tmp = self.path.with_name(self.path.name + ".rewrite")
            with open(tmp, "wb") as f:
                for lsn, payload in records:
                    if keep(lsn):
                        f.write(_HEADER.pack(len(payload), _crc(lsn, payload), lsn) + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            fsync_path(self.path.parent)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDWR)
            before, self.end = self.end, os.path.getsize(self.path)
            return before - self.end

    def reset(self) -> None:
        """Empty the log (everything in it is durable elsewhere)."""
        with self._sync_lock:
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
            self.end = 0

    @property
    def bytes(self) -> int:
        return self.end

    def release(self) -> None:
        """Close the file while nothing is appended (every record durable); reopen() takes it up again."""
        self.close()

    def reopen(self) -> None:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDWR)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
