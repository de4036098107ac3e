"""Process-wide settings for a process that fusionrag owns (`fusionrag search`, `fusionrag serve`).

glibc keeps freed memory for reuse: after a large block is freed it raises its mmap threshold, so
later blocks of that size (a batch's PQ tables, candidate arrays) come from heaps it never hands
back, and the process holds its peak. Beside an LLM server, memory given back is memory the LLM
can use: on MiniLM 38.7k, 2 threads, this took the search process's peak from 26-31 to 19-21 MiB
over the opened index (10 MiB), at no measurable cost (a few mmap calls per batch).
A library caller's process is left as its owner set it.

memory_limit() is what a process may hold: its cgroup's memory limit where it has one (a container, a systemd
slice, `docker run -m`), else the machine's memory. A build's default memory budget is a quarter of it
(BuildConfig.memory_budget_bytes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from pathlib import Path

# mallopt parameters (malloc.h); values fixed, so the dynamic threshold stays off.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = TRIM_THRESHOLD = 128 << 10


def return_freed_memory() -> bool:
    """Blocks of 128 KiB and more are mapped and unmapped on their own, and free heap tops past
    128 KiB go back to the kernel. Returns False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge page-rounded number


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_memory_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory limit of this process's cgroup in bytes (the least of its own and its ancestors'), or None where
    it has none: cgroup v2's memory.max up the tree; v1's memory.limit_in_bytes and, where the kernel gives it,
    memory.stat's hierarchical_memory_limit. Also the root's own files, for a container whose cgroup namespace
    shows its cgroup as /."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    limits = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip("/")
        if controllers == "":  # v2, the unified hierarchy
            d = root / rel if rel else root
            while True:
                value = _read(d / "memory.max")
                if value and value != "max" and value.isdigit():
                    limits.append(int(value))
                if d == root or root not in d.parents:
                    break
                d = d.parent
        elif "memory" in controllers.split(","):
            base = root / "memory"
            for d in dict.fromkeys((base / rel if rel else base, base)):
                value = _read(d / "memory.limit_in_bytes")
                if value and value.isdigit():
                    limits.append(int(value))
                for stat in (_read(d / "memory.stat") or "").splitlines():
                    if stat.startswith("hierarchical_memory_limit "):
                        limits.append(int(stat.split()[1]))
    limits = [x for x in limits if 0 < x < NO_LIMIT]
    return min(limits) if limits else None


def machine_memory() -> int:
    """The machine's memory in bytes (MemTotal)."""
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def memory_limit() -> int:
    """The memory this process may use, bytes: its cgroup's limit where it has one, else the machine's memory."""
    limit, total = cgroup_memory_limit(), machine_memory()
    return min(limit, total) if limit else total


def anonymous_bytes() -> int:
    """This process's resident anonymous memory (RssAnon: its heaps and arrays, not its mapped files), bytes; 0
    where /proc does not say."""
    for line in (_read(Path("/proc/self/status")) or "").splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


BACKGROUND_NICE = 10


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Make the calling thread's CPU time yield to the process's other threads (Linux: a thread is scheduled by its
    own nice value; setpriority on its thread id sets it): background work (a vector store's file embedded, an
    import's build) then takes the cores the requests leave, rather than half of them. False where the system
    does not allow it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return True
    except (AttributeError, OSError):
        return False
