"""Splitting one GPU between vLLM and the retriever: pure arithmetic on byte counts.

What vLLM (0.32) does with the GPU, and why the order of start-up matters:
- At start-up it requires free memory >= gpu_memory_utilization x total, and refuses to start
  otherwise. That check holds even when `kv_cache_memory_bytes` is given.
- With only `gpu_memory_utilization`, vLLM takes that whole fraction of the GPU (weights,
  activations, then KV cache sized to fill the rest), measured by profiling that assumes no other
  process changes its GPU memory meanwhile. So a retriever in a process of its own must hold its GPU
  memory before vLLM starts (open the index first), and the fraction must leave room for it.
- With `kv_cache_memory_bytes`, vLLM skips sizing the KV cache from the fraction and takes weights
  + activations + that KV cache; either may start first, as long as the start-up check passes.

The endpoint plugin is the other order, by construction: vLLM calls it (init_state) only once its
engine is up, weights loaded, memory profiled and KV cache allocated, so the plugin's collections
take their GPU budget after vLLM's profiling and never during it, whichever way vLLM sized its KV
cache. What remains is that both fit: `plan_plugin_split` says so from the device's sizes at that
moment, and the plugin refuses to start when they do not (`vllm_first=True` in `plan_gpu_split`).

`reserve_bytes` covers what neither budget counts: the CUDA context of each process (a few hundred
MiB each), allocator fragmentation, NCCL buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fusionrag.retriever.errors import ConfigError

GiB = 1 << 30
VLLM_DEFAULT_UTILIZATION = 0.92  # vllm.config.CacheConfig.gpu_memory_utilization in vLLM 0.32
DEFAULT_RESERVE_BYTES = 1 * GiB
_STEP = 1000  # utilizations are suggested in steps of 0.001, rounded down


@dataclass(frozen=True)
class GPUSplit:
    """The verdict on one split, and what to set."""

    fits: bool
    total_bytes: int
    retriever_bytes: int
    reserve_bytes: int
    vllm_bytes: int                    # what vLLM will hold with the settings given
    available_bytes: int               # what is left for vLLM beside the retriever and the reserve
    max_gpu_memory_utilization: float  # the largest fraction vLLM may be given here (0.001 steps)
    max_kv_cache_memory_bytes: int | None  # with model_bytes known: the largest fixed KV cache that fits
    retriever_first: bool              # the retriever must allocate before vLLM starts
    vllm_args: dict                    # vLLM engine arguments to use (the given ones when they fit)
    advice: str

    def check(self) -> GPUSplit:
        """This split, or ConfigError saying what to set when it does not fit."""
        if not self.fits:
            raise ConfigError(self.advice)
        return self


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _nonneg_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer number of bytes, got {value!r}")
    return value


def _utilization(value) -> float:
    util = VLLM_DEFAULT_UTILIZATION if value is None else value
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {value!r}")
    return util


def plan_gpu_split(total_bytes: int, retriever_bytes: int, *, gpu_memory_utilization: float | None = None,
                   kv_cache_memory_bytes: int | None = None, model_bytes: int = 0,
                   reserve_bytes: int = DEFAULT_RESERVE_BYTES, vllm_first: bool = False) -> GPUSplit:
    """Check that vLLM and the retriever fit on one GPU of `total_bytes`, and say what to set.

    total_bytes: the GPU's memory (`torch.cuda.mem_get_info()[1]`).
    retriever_bytes: fusionrag's GPU budget (PQ codes and codebooks plus its working pool).
    gpu_memory_utilization: vLLM's fraction (vLLM's default, 0.92, when not given).
    kv_cache_memory_bytes: vLLM's fixed KV cache, when used instead of sizing it from the fraction.
    model_bytes: vLLM's weights plus activation peak (its log prints both); needed with
        `kv_cache_memory_bytes`, and used to report the largest KV cache that would fit.
    reserve_bytes: CUDA contexts and allocator slack of both processes.
    vllm_first: the retriever takes its memory only once vLLM is up, as the endpoint plugin does;
        vLLM's start-up check then sees none of it, so only the sum has to fit.
    """
    total = _nonneg_int("total_bytes", total_bytes)
    retriever = _nonneg_int("retriever_bytes", retriever_bytes)
    model = _nonneg_int("model_bytes", model_bytes)
    reserve = _nonneg_int("reserve_bytes", reserve_bytes)
    if total == 0:
        raise ConfigError("total_bytes must be > 0")
    util = _utilization(gpu_memory_utilization)
    if kv_cache_memory_bytes is not None:
        kv = _nonneg_int("kv_cache_memory_bytes", kv_cache_memory_bytes)
        if kv == 0:
            raise ConfigError("kv_cache_memory_bytes must be > 0 (leave it out to size the KV cache from "
                              "gpu_memory_utilization)")
        if model == 0:
            raise ConfigError("with kv_cache_memory_bytes, give model_bytes (vLLM's weights plus activation peak, "
                              "from its start-up log) so that its whole footprint can be checked")

    available = total - retriever - reserve
    # vLLM's start-up check is ceil(total * u) <= free; step down to a representable fraction below.
    max_util = max(0, math.floor(available * _STEP / total)) / _STEP
    while max_util > 0 and math.ceil(total * max_util) > available:
        max_util = round(max_util - 1 / _STEP, 3)
    max_kv = available - model if model else None
    startup_ok = math.ceil(total * util) <= available

    if max_util == 0:
        return GPUSplit(False, total, retriever, reserve, 0, available, 0.0, None, not vllm_first, {},
                        f"the retriever's budget ({_gib(retriever)}) and the reserve ({_gib(reserve)}) leave less "
                        f"than 0.1% of the GPU ({_gib(total)}) to vLLM: lower the retriever's GPU budget")

    if kv_cache_memory_bytes is None:
        vllm_bytes = math.ceil(total * util)
        fits = startup_ok
        args = {"gpu_memory_utilization": util if fits else max_util}
        order = "the retriever opens once vLLM is up" if vllm_first else "open the index before starting vLLM"
        if fits:
            advice = (f"fits: vLLM holds {_gib(vllm_bytes)}, the retriever {_gib(retriever)}, "
                      f"{_gib(available - vllm_bytes)} spare beside the reserve; {order}")
        else:
            advice = (f"does not fit: gpu_memory_utilization={util} gives vLLM {_gib(vllm_bytes)}, but beside the "
                      f"retriever ({_gib(retriever)}) and the reserve ({_gib(reserve)}) only {_gib(available)} "
                      f"of {_gib(total)} is left: set gpu_memory_utilization={max_util} (or lower the retriever's "
                      f"budget)" + ("" if vllm_first else f"; {order}"))
        return GPUSplit(fits, total, retriever, reserve, vllm_bytes, available, max_util, max_kv, not vllm_first,
                        args, advice)

    vllm_bytes = model + kv
    fits = vllm_bytes <= available
    # Suggest a fraction that also passes the start-up check with the index already open: then
    # either may start first.
    args = {"kv_cache_memory_bytes": kv if fits else max(max_kv, 0),
            "gpu_memory_utilization": util if startup_ok or vllm_first else max_util}
    order = ("the retriever opens once vLLM is up" if vllm_first else "either may start first" if startup_ok else
             f"with gpu_memory_utilization={util} vLLM's start-up check wants {_gib(math.ceil(total * util))} free, "
             f"so start vLLM before opening the index, or set gpu_memory_utilization={max_util} and start in "
             f"either order")
    if fits:
        advice = (f"fits: vLLM holds {_gib(vllm_bytes)} (weights and activations {_gib(model)}, KV cache "
                  f"{_gib(kv)}), the retriever {_gib(retriever)}, {_gib(available - vllm_bytes)} spare beside the "
                  f"reserve; {order}")
    elif max_kv > 0:
        advice = (f"does not fit: weights and activations ({_gib(model)}) plus the KV cache ({_gib(kv)}) exceed the "
                  f"{_gib(available)} left beside the retriever ({_gib(retriever)}) and the reserve "
                  f"({_gib(reserve)}): set kv_cache_memory_bytes={max_kv} (or lower the retriever's budget)")
    else:
        advice = (f"does not fit: vLLM's weights and activations alone ({_gib(model)}) exceed the {_gib(available)} "
                  f"left beside the retriever ({_gib(retriever)}) and the reserve ({_gib(reserve)}): lower the "
                  f"retriever's budget")
    return GPUSplit(fits, total, retriever, reserve, vllm_bytes, available, max_util, max_kv, False,
                    args, advice)


def plan_plugin_split(total_bytes: int, free_bytes: int, *, budget_bytes: int = 0,
                      gpu_memory_utilization: float | None = None, kv_cache_memory_bytes: int | None = None,
                      reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> GPUSplit:
    """The split as the endpoint plugin finds it when vLLM calls it: vLLM is up, `free_bytes` of the
    device's `total_bytes` are free. `retriever_bytes` of the answer is the budget to give the
    collections: `budget_bytes`, or with 0 the largest that fits beside vLLM and the reserve.

    With `kv_cache_memory_bytes`, vLLM's weights and activations are taken as what the device holds
    now beside that KV cache (measured, so whatever else holds device memory counts too); with the
    fraction, vLLM may grow to `gpu_memory_utilization` of the device. Either way the budget must
    also be free now.
    """
    total = _nonneg_int("total_bytes", total_bytes)
    free = _nonneg_int("free_bytes", free_bytes)
    budget = _nonneg_int("budget_bytes", budget_bytes)
    reserve = _nonneg_int("reserve_bytes", reserve_bytes)
    if free > total:
        raise ConfigError(f"free_bytes ({free}) exceeds total_bytes ({total})")
    util = _utilization(gpu_memory_utilization)
    model = 0
    if kv_cache_memory_bytes is not None:
        model = max(total - free - _nonneg_int("kv_cache_memory_bytes", kv_cache_memory_bytes), 1)
        vllm_bytes = model + kv_cache_memory_bytes
    else:
        vllm_bytes = math.ceil(total * util)
    room = min(total - vllm_bytes, free) - reserve
    budget = budget or max(room, 0)
    if budget == 0:
        return GPUSplit(False, total, 0, reserve, vllm_bytes, total - reserve, 0.0, None, False, {},
                        f"does not fit: vLLM holds {_gib(vllm_bytes)} of {_gib(total)} and {_gib(free)} is free: "
                        f"nothing is left for the retriever beside the reserve ({_gib(reserve)}); lower vLLM's "
                        f"gpu_memory_utilization or kv_cache_memory_bytes")
    split = plan_gpu_split(total, budget, gpu_memory_utilization=util, kv_cache_memory_bytes=kv_cache_memory_bytes,
                           model_bytes=model, reserve_bytes=reserve, vllm_first=True)
    if split.fits and budget + reserve > free:
        return replace(split, fits=False, advice=(
            f"does not fit: the retriever's budget ({_gib(budget)}) and the reserve ({_gib(reserve)}) exceed the "
            f"{_gib(free)} free on the device now: lower the retriever's budget to {max(free - reserve, 0)} bytes"))
    return split
