"""The GPU tier's host side of a batch, before and after gathering IDs straight into the working block (not a
test; runs on any machine, no GPU needed).

Per batch the GPU tier sends the device every candidate ID of its queries' probed lists. It gathered them into
an array made for the batch (native.gather) and copied that into the block's pinned staging memory; it now
gathers them into the staging memory itself (native.gather_offsets, then native.gather_into). Both are timed
here on one index (bench/gpu/gpu_tier.py's 1M x 128 clustered set by default, built if missing), its queries'
lists found as a search finds them, batches of 1,024 (the GPU tier's), into a reused staging buffer touched
once (pinned memory is, on a GPU machine): best and median of --repeat, alternating, per thread count.

    python -m bench.gpu.gpu_staging [--count 1000000] [--nprobe 64] [--repeat 7] [--out bench/results/gpu/gpu_staging.json]
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from fusionrag import native
from fusionrag.loadtests.queryset import synthetic_vectors
from fusionrag.retriever import BuildConfig, Index

from bench.harness.paths import ROOT


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--nprobe", type=int, default=64)
    ap.add_argument("--rerank", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--work", default=str(ROOT / "bench" / "work"))
    ap.add_argument("--out")
    args = ap.parse_args()
    # As bench/gpu/gpu_tier.py makes its set (the last 2,000 held out as queries): the same index directory.
    x = synthetic_vectors(args.count + 2000, args.dim)
    path = Path(args.work) / f"gpu_tier_synthetic_{args.count}x{args.dim}"
    if not (path / "manifest.json").exists():
        Index.build(x[:args.count], path, BuildConfig(metric="l2"), progress=False, overwrite=True)
    index = Index.open(path, filter_tier="cpu", batch_size=args.batch)
    f = index.filter
    q = index.prepare_queries(x[args.count:args.count + args.batch])
    lists, _, _ = index.nav.probe(q, index.params.with_overrides(nprobe=args.nprobe, rerank=args.rerank))
    total = int(native.gather_offsets(lists, f.list_offsets, f.list_ids)[-1])
    staging = torch.empty(total, dtype=torch.int32)
    staging.numpy()[:] = 0

    def before(threads):
        ids, _ = native.gather(lists, f.list_offsets, f.list_ids, threads)
        staging.numpy()[:] = ids.view(np.int32)

    def after(threads):
        offsets = native.gather_offsets(lists, f.list_offsets, f.list_ids)
        native.gather_into(lists, f.list_offsets, f.list_ids, staging.numpy().view(np.uint32), threads)
        return offsets

    rows = []
    for threads in sorted({1, os.cpu_count() or 1}):
        times = {"before": [], "after": []}
        for _ in range(args.repeat):
            for name, fn in (("before", before), ("after", after)):
                t = time.perf_counter()
                fn(threads)
                times[name].append(time.perf_counter() - t)
        want, _ = native.gather(lists, f.list_offsets, f.list_ids, threads)
        assert np.array_equal(staging.numpy().view(np.uint32), want)  # the last run was after()'s
        row = {"threads": threads, **{f"{k}_ms_{s}": round(float(fn(v)) * 1e3, 2) for k, v in times.items()
                                      for s, fn in (("best", np.min), ("median", np.median))}}
        row["median_ratio"] = round(row["before_ms_median"] / row["after_ms_median"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "index": path.name, "batch": args.batch, "nprobe": args.nprobe, "ids_per_batch": total,
              "ids_per_query": round(total / len(q), 1), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
