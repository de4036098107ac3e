"""Process-wide settings for a process that fusionrag owns (`fusionrag search`, `fusionrag serve`).

glibc keeps freed memory for reuse: after a large block is freed it raises its mmap threshold, so
later blocks of that size (a batch's PQ tables, candidate arrays) come from heaps it never hands
back, and the process holds its peak. Beside an LLM server, memory given back is memory the LLM
can use: on MiniLM 38.7k, 2 threads, this took the search process's peak from 26-31 to 19-21 MiB
over the opened index (10 MiB), at no measurable cost (a few mmap calls per batch).
A library caller's process is left as its owner set it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

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
