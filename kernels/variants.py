"""The compiled forms (specialisations) of the engine's kernels.

Triton compiles a kernel once per specialisation: its constexpr values, launch options and the
types of its runtime arguments (pointer element types, 16-byte alignment of each pointer, integer
widths). Each kernel file says which specialisations its launch site picks (`variants`), from the
same function that picks them at launch, so that the GPU tier compiles all of them when an index
opens instead of during the first requests. Scalar integer arguments are never specialised on
their value (`do_not_specialize`), so they add no variants.
"""

from __future__ import annotations

import time
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

    def compile(self) -> float:
        """Compile for the current CUDA device and load the module (Triton loads it, and builds its
        launcher, on the first launch otherwise); seconds taken, near zero when already cached."""
        start = time.perf_counter()
        args = [_DTYPES[t] if t.startswith("*") else 0 for t in self.signature]
        compiled = self.kernel.warmup(*args, grid=(1,), num_warps=self.num_warps, **dict(self.constexprs))
        if hasattr(compiled, "result"):  # a future where Triton compiles asynchronously
            compiled = compiled.result()
        compiled._init_handles()
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
