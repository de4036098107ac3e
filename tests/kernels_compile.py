"""Compile every Triton kernel, in each specialisation the engine launches, for an sm_90 GPU
(H100/H200) without one: Triton's own LLVM and ptxas do the work. The interpreter runs Python
semantics and misses what only the compiler refuses (globals, constexpr rules, layouts).
Run by test_kernels.py in a process without TRITON_INTERPRET; prints one line per kernel."""

import os

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusionrag.kernels.adc_scan import adc_scan_kernel  # noqa: E402
from fusionrag.kernels.dedup import dedup_kernel  # noqa: E402
from fusionrag.kernels.pq_table import pq_table_kernel  # noqa: E402
from fusionrag.kernels.topn import topn_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PQ = {"queries_ptr": "*fp32", "codebooks_ptr": "*fp32", "out_ptr": "*fp32", "dim": "i32", "M": "constexpr",
      "DSUB": "constexpr", "DSUB_P2": "constexpr", "SUBS": "constexpr", "IP": "constexpr"}
SCAN = {"ids_ptr": "*i32", "offsets_ptr": "*i64", "table_base_ptr": "*i64", "table_ptr": "*i64", "luts_ptr": "*fp32",
        "codes_ptr": "*u8", "host_codes_ptr": "*u8", "slots_ptr": "*i32", "exclude_ptr": "*u8", "keys_ptr": "*i64",
        "unique_ptr": "*i64", "M": "constexpr", "M_P2": "constexpr", "BLOCK": "constexpr", "TIERED": "constexpr",
        "EXCLUDE": "constexpr"}
TOPN = {"keys_ptr": "*i64", "offsets_ptr": "*i64", "out_ids_ptr": "*i64", "out_dists_ptr": "*fp32", "n": "i32",
        "LT": "constexpr", "LOG": "constexpr"}
DEDUP = {"ids_ptr": "*i32", "offsets_ptr": "*i64", "table_base_ptr": "*i64", "keep_ptr": "*i8", "table_ptr": "*i64",
         "BLOCK": "constexpr"}

CASES = [
    (pq_table_kernel, PQ, dict(M=64, DSUB=12, DSUB_P2=16, SUBS=1, IP=False), 4),
    (pq_table_kernel, PQ, dict(M=5, DSUB=1, DSUB_P2=1, SUBS=1, IP=True), 4),
    (dedup_kernel, DEDUP, dict(BLOCK=256), 4),
    *[(adc_scan_kernel, SCAN, dict(M=48, M_P2=64, BLOCK=128, TIERED=t, EXCLUDE=e), 4)
      for t in (False, True) for e in (False, True)],
    (topn_kernel, TOPN, dict(LT=6, LOG=6), 4),
    (topn_kernel, TOPN, dict(LT=12, LOG=8), 8),
    (topn_kernel, TOPN, dict(LT=12, LOG=12), 8),
]

for fn, signature, constexprs, warps in CASES:
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                              options={"num_warps": warps})
    assert compiled.asm["cubin"], fn.__name__
    print("compiled", fn.__name__, constexprs, flush=True)
