"""Compile every Triton kernel, in each specialisation the engine launches, for an sm_90 GPU
(H100/H200) without one: Triton's own LLVM and ptxas do the work. The interpreter runs Python
semantics and misses what only the compiler refuses (globals, constexpr rules, layouts).
Run by test_kernels.py in a process without TRITON_INTERPRET; prints one line per kernel."""

import os
from concurrent.futures import ThreadPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusionrag.kernels import adc_scan, adc_stream, pq_table, topn  # noqa: E402
from fusionrag.kernels.dedup import dedup_kernel  # noqa: E402
from fusionrag.kernels.variants import variant  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# What the GPU tier compiles when an index opens (kernels/variants.py), for two index shapes, and
# dedup, which only tools launch.
CASES = [
    *pq_table.variants(64, 12, "l2"), *pq_table.variants(5, 1, "ip"),
    *adc_scan.variants(48, tiered=False), *adc_scan.variants(48, tiered=True),
    *topn.variants(), *adc_stream.variants(64), *adc_stream.variants(64, tiered=True),
    *adc_stream.variants(64, wide=False), *adc_stream.variants(64, tiered=True, wide=False),  # under 2^31 postings
    # 4-bit codes (BuildConfig.pq_bits 4): 128 sub-spaces of 16 centroids in 64 bytes, and an odd count
    *pq_table.variants(128, 1, "l2", ksub=16), *adc_stream.variants(128, ksub=16),
    *adc_stream.variants(25, tiered=True, wide=False, ksub=16),
    variant(dedup_kernel, ("*i32", "*i64", "*i64", "*i8", "*i64"), 4, BLOCK=256),
]



def compile_one(v):
    constexprs = dict(v.constexprs)
    runtime = iter(v.signature)
    signature = {name: "constexpr" if name in constexprs else next(runtime) for name in v.kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=v.kernel, signature=signature, constexprs=constexprs), target=TARGET,
                              options={"num_warps": v.num_warps})
    assert compiled.asm["cubin"], v
    return v


# Several at a time, as the GPU tier compiles them (variants.compile_all): Triton's compiler in threads.
with ThreadPoolExecutor(4) as pool:
    for v in pool.map(compile_one, CASES):
        print("compiled", v, flush=True)
