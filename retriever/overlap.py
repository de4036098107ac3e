"""Overlap of consecutive batches (DESIGN.md: the CPU walks the graph and re-ranks while the GPU
filters). Batch b+1's graph search, batch b's GPU filtering and batch b-1's re-ranking run at
once: each stage has one thread, so every stage sees the batches in order, and the native
stages release the GIL. The GPU side of the overlap lives in the filter tier: each working
block has its own CUDA stream and pinned staging buffers (kernels/pool.py).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable


def overlapped(items: Iterable, first: Callable, middle: Callable, last: Callable, depth: int = 2) -> None:
    """last(middle(first(item))) for every item, the three stages of different items at once;
    at most `depth` items past their first stage wait on the last. Re-raises a stage's error."""
    with ThreadPoolExecutor(1) as a, ThreadPoolExecutor(1) as b, ThreadPoolExecutor(1) as c:
        pending: deque = deque()
        for item in items:
            fa = a.submit(first, item)
            fb = b.submit(lambda fa=fa: middle(fa.result()))
            pending.append(c.submit(lambda fb=fb: last(fb.result())))
            if len(pending) > depth:
                pending.popleft().result()
        while pending:
            pending.popleft().result()
