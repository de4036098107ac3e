"""What the studies under a memory cap share (bench/service/capped_collection.py, bench/peers/scale_table.py,
bench/service/docstore_reads.py): files dropped from the page cache before a cold start, and a sampler of a
cgroup's anonymous memory and of the bytes its processes read from storage."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def drop_cache(root: Path) -> None:
    """A file, or every file under a directory, out of the page cache (fsynced first, so none of it is dirty)."""
    root = Path(root)
    for p in [root] if root.is_file() else root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Sampler:
    """A cgroup's anonymous memory (memory.stat total_rss) sampled every `every` seconds, its peak kept per phase
    (set `phase` as the study moves on), and the bytes each of its processes read from storage (/proc/PID/io
    read_bytes, as last seen: up to `every` before each ended)."""

    def __init__(self, cg, every: float = 0.1, phase: str = "run"):
        self.cg, self.every, self.phase = cg, every, phase
        self.peak: dict[str, int] = {}
        self._read: dict[int, int] = {}
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                st = dict(line.split() for line in (self.cg.path / "memory.stat").read_text().splitlines())
                self.peak[self.phase] = max(self.peak.get(self.phase, 0), int(st["total_rss"]))
                for pid in (self.cg.path / "cgroup.procs").read_text().split():
                    for line in open(f"/proc/{pid}/io"):
                        if line.startswith("read_bytes:"):
                            self._read[int(pid)] = int(line.split()[1])
            except (OSError, KeyError, ValueError):
                pass
            time.sleep(self.every)

    def read_bytes(self) -> int:
        return sum(self._read.values())

    def stop(self) -> int:
        """Stops sampling; the highest peak of any phase."""
        self._stop = True
        self._t.join()
        return max(self.peak.values(), default=0)
