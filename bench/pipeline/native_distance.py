"""Exact re-rank distances, one build of the native extension against another (not a test).

Times native.exact_distances and native.rerank (every candidate re-ranked, beta 0) on random
records of each element type, all blocks already in the page buffer, one thread: what is left is
the distance kernels, the buffer's copies and the bookkeeping. The "kernel" rows take their ids
from two blocks only, so the copies are few and the distances are nearly all of the time. Each
build runs in a process of its own (two builds of one nanobind module cannot share a process), the
builds alternating, --reps times; the table gives medians of the per-run best-of-5.

    python -m bench.pipeline.native_distance --baseline /tmp/fr_base/_native.cpython-311-x86_64-linux-gnu.so
    python -m bench.pipeline.native_distance --baseline OLD.so --out bench/results/pipeline/native_distance.md

With no --candidate, the candidate is the installed fusionrag.native.
"""

import argparse
import importlib.machinery
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from bench.harness.paths import ROOT

# (element type, dims): GloVe 50/100-d float32, MiniLM 384-d, Fashion-MNIST 784 bytes, odd sizes.
CASES = [("f32", 100), ("f32", 384), ("f32", 385), ("u8", 784), ("i8", 96), ("i8", 385)]
NP_DTYPE = {"f32": np.float32, "u8": np.uint8, "i8": np.int8}


def load(path):
    if not path:
        from fusionrag.native import _native

        return _native
    loader = importlib.machinery.ExtensionFileLoader("_native", path)
    spec = importlib.util.spec_from_file_location("_native", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def best_of(fn, repeat=5):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(native, n=20000, nq=32, cands=2000):
    """Seconds per query for each case, metric and entry point."""
    rng = np.random.default_rng(0)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, dim in CASES:
            if dtype == "f32":
                vectors = rng.standard_normal((n, dim)).astype(np.float32)
            else:
                lo, hi = (0, 256) if dtype == "u8" else (-128, 128)
                vectors = rng.integers(lo, hi, (n, dim)).astype(NP_DTYPE[dtype])
            records = np.ascontiguousarray(vectors).view(np.uint8)
            rpb, ppb = native.page_layout(records.shape[1])
            path = os.path.join(tmp, f"{dtype}-{dim}.pages")
            writer = native.PageWriter(path, records.shape[1], rpb, ppb)
            slots = np.arange(n, dtype=np.uint32)
            writer.write(slots, records)
            blocks = -(-n // rpb)
            store = native.PageStore(path, records.shape[1], rpb, ppb, writer.close(), 2 * blocks)
            queries = rng.standard_normal((nq, dim)).astype(np.float32)
            cand = np.stack([rng.permutation(n)[:cands] for _ in range(nq)]).astype(np.int64)
            native.exact_distances(store, queries[:1], np.arange(n)[None], slots, dtype, "l2", 1)  # fills the buffer
            assert store.stats()["blocks_read"] == blocks
            # Ids on two blocks: a read (a copy out of the buffer) per 64 distances, the kernel's cost alone.
            hot = rng.integers(0, 2 * rpb, (nq, cands)).astype(np.int64)
            for metric in ("l2", "ip"):
                t = best_of(lambda: native.exact_distances(store, queries, hot, slots, dtype, metric, 1))
                out[f"kernel (exact_distances, 2 blocks) {dtype} d={dim} {metric}"] = t / nq
                t = best_of(lambda: native.exact_distances(store, queries, cand, slots, dtype, metric, 1))
                out[f"exact_distances {dtype} d={dim} {metric}"] = t / nq
                t = best_of(lambda: native.rerank(store, queries, cand, slots, dtype, metric, 10, 16, 0.0, 0, 1))
                out[f"rerank {dtype} d={dim} {metric}"] = t / nq
            assert store.stats()["blocks_read"] == blocks  # all from the buffer
            del store
    return out


def run_child(so):
    cmd = [sys.executable, "-m", __spec__.name, "--child"] + (["--so", so] if so else [])
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="the extension (.so) to compare against")
    ap.add_argument("--candidate", help="the extension (.so) measured (default: the installed one)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="write a Markdown table here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--so", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(load(args.so))))
        return
    runs = {"baseline": [], "candidate": []}
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    loads = [os.getloadavg()[0]]
    for rep in range(args.reps):
        order = ["baseline", "candidate"] if rep % 2 == 0 else ["candidate", "baseline"]
        for name in order:
            runs[name].append(run_child(args.baseline if name == "baseline" else args.candidate))
            loads.append(os.getloadavg()[0])
            print(f"rep {rep + 1}/{args.reps} {name} done", file=sys.stderr)
    keys = list(runs["baseline"][0])
    lines = [
        f"Run {started}, {args.reps} runs per build alternating, medians of per-run best-of-5; "
        f"load average (1 min) {min(loads):.1f}-{max(loads):.1f}; {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}.",
        "",
        "| µs per query (2000 candidates, 1 thread) | baseline | candidate | candidate / baseline |",
        "|---|---|---|---|",
    ]
    for key in keys:
        b = statistics.median(r[key] for r in runs["baseline"]) * 1e6
        c = statistics.median(r[key] for r in runs["candidate"]) * 1e6
        lines.append(f"| {key} | {b:.0f} | {c:.0f} | {c / b:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
