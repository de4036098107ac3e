"""Triton kernels of the GPU filter tier, one per file, each beside its plain PyTorch reference:
pq_table (lookup tables), dedup (parallel hash), adc_scan (dedup fused with the PQ scan), topn
(ragged top-n); and pool, the GPU memory budget and its working blocks.

Importing this package loads neither torch nor triton; its modules do.
"""

import os
import threading

# Triton's interpreter patches triton.language process-wide while a kernel runs: under it, one launch at a time.
INTERPRETER_LOCK = threading.Lock()


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter, where a launch's cost is per
    operation rather than per element: callers then choose fewer, larger programs."""
    return os.environ.get("TRITON_INTERPRET") == "1"
