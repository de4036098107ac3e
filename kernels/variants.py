"""The compiled forms (specialisations) of the engine's kernels.

Triton compiles a kernel once per specialisation: its constexpr values, launch options and the
types of its runtime arguments (pointer element types, 16-byte alignment of each pointer, integer
widths). Each kernel file says which specialisations its launch site picks (`variants`), from the
same function that picks them at launch, so that the GPU tier compiles all of them when an index
opens instead of during the first requests. Scalar integer arguments are never specialised on
their value (`do_not_specialize`), so they add no variants.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

_TYPES = {torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8"}
_DTYPES = {f"*{name}": dtype for dtype, name in _TYPES.items()}


@dataclass(frozen=True)
class Variant:
    kernel: object  # the @triton.jit function
    signature: tuple[str, ...]  # each runtime argument's Triton type: "*fp32", "*i64", ..., "i32"
    constexprs: tuple[tuple[str, object], ...]  # sorted by name
    num_warps: int

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__

    def __str__(self) -> str:
        return f"{self.name}[{', '.join(f'{k}={v}' for k, v in self.constexprs)}, num_warps={self.num_warps}]"

    def start(self):
        """Start compiling for the current CUDA device: the compiled kernel, or a future of it where Triton
        compiles asynchronously (inside its AsyncCompileMode)."""
        args = [_DTYPES[t] if t.startswith("*") else 0 for t in self.signature]
        return self.kernel.warmup(*args, grid=(1,), num_warps=self.num_warps, **dict(self.constexprs))

    @staticmethod
    def load(compiled) -> None:
        """Load a compiled kernel's module and build its launcher (Triton does both on the first launch
        otherwise)."""
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        compiled._init_handles()

    def compile(self) -> float:
        """Compile and load; seconds taken, near zero when already cached."""
        start = time.perf_counter()
        self.load(self.start())
        return time.perf_counter() - start


def variant(kernel, signature, num_warps: int, **constexprs) -> Variant:
    return Variant(kernel, tuple(signature), tuple(sorted(constexprs.items())), num_warps)


def launched(kernel, args: tuple, kwargs: dict) -> Variant:
    """The specialisation a launch kernel[grid](*args, **kwargs) compiles (runtime arguments
    positional, constexprs and num_warps by name, as every launch site here passes them). A pointer
    not 16-byte aligned is its own specialisation: it is marked so, and matches no variant."""
    signature = []
    for a in args:
        if isinstance(a, torch.Tensor):
            signature.append(f"*{_TYPES[a.dtype]}" + ("" if a.data_ptr() % 16 == 0 else " unaligned"))
        else:
            signature.append("i32" if -(1 << 31) <= int(a) < 1 << 31 else "i64")
    constexprs = {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    return variant(kernel, signature, kwargs.get("num_warps", 4), **constexprs)


class _NamedTimes(ThreadPoolExecutor):
    """Runs Triton's compile jobs, noting when each kernel's last job ended (seconds since `start`). Triton
    submits a variant's job inside its warmup call, so the name set before that call is the job's."""

    def __init__(self, workers: int, start: float):
        super().__init__(workers, thread_name_prefix="triton-compile")
        self.start, self.name, self.done, self.lock = start, "", {}, threading.Lock()

    def submit(self, fn, /, *args, **kwargs):
        name = self.name

        def timed():
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.done[name] = max(self.done.get(name, 0.0), time.perf_counter() - self.start)

        return super().submit(timed)


def async_compile_mode():
    """Triton's AsyncCompileMode (a private module since Triton 3.4), or None where this Triton has none."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


def compile_all(variants: list[Variant], workers: int | None = None) -> dict[str, float]:
    """Compile and load every variant, `workers` compiles at a time (default: one per CPU, at most one per
    variant): Triton's passes and ptxas run outside the GIL. The seven top-n variants took 37 s one after
    another on an H100 machine (16 CPUs); compiled for sm_90 on a 2-core VM, 67 s, the largest alone 28 s.
    Per kernel, the seconds from the start until its last variant was compiled, and until all were loaded."""
    start = time.perf_counter()
    workers = min(len(variants), workers or os.cpu_count() or 1)
    mode = async_compile_mode()
    ready: dict[str, float] = {}
    if mode is None or workers <= 1:
        for v in variants:
            v.compile()
            ready[v.name] = time.perf_counter() - start
        return ready
    with _NamedTimes(workers, start) as pool:
        with mode(pool):  # on leaving, every job has ended and its kernel is in the JIT's cache
            started = []
            for v in variants:
                pool.name = v.name
                started.append(v.start())
        for compiled in started:
            Variant.load(compiled)
    ready = {name: pool.done.get(name, 0.0) for name in dict.fromkeys(v.name for v in variants)}
    ready["all loaded"] = time.perf_counter() - start
    return ready
