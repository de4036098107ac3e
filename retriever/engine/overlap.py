"""Overlap of consecutive batches (docs/design.md, step 8: the CPU walks the graph and re-ranks while the GPU
filters). Batch b+1's graph search, batch b's GPU filtering and batch b-1's re-ranking run at
once: the CPU stages have one thread each, so they see the batches in order, and the native
stages release the GIL. On CUDA two batches are on the GPU at once, each in its own working
block with its own stream and pinned staging buffers (kernels/pool.py), so one batch's copies
overlap the other's kernels.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable


def overlapped(items: Iterable, first: Callable, middle: Callable, last: Callable, middle_workers: int = 1) -> None:
    """last(middle(first(item))) for every item, the three stages of different items at once;
    the middle stage may run several items at once (the last still takes them in order). At most
    middle_workers + 1 items past their first stage wait on the last. Re-raises a stage's error."""
    depth = middle_workers + 1
    with ThreadPoolExecutor(1) as a, ThreadPoolExecutor(middle_workers) as b, ThreadPoolExecutor(1) as c:
        pending: deque = deque()
        for item in items:
            fa = a.submit(first, item)
            fb = b.submit(lambda fa=fa: middle(fa.result()))
            pending.append(c.submit(lambda fb=fb: last(fb.result())))
            if len(pending) > depth:
                pending.popleft().result()
        while pending:
            pending.popleft().result()
