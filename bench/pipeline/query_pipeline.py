"""Speed of one Index.search call on the CPU tier: single queries, and calls of 256 queries (four internal
batches through the overlapped stages), at a fixed nprobe, with recall@10. A before/after check for
changes to the query pipeline's plumbing (issue #19 item 3), not a comparison with peers.

    python -m bench.pipeline.query_pipeline --dataset glove --repeat 3
    python -m bench.pipeline.query_pipeline --code /tmp/old/retriever   # the same with an older copy of retriever/

Uses the index bench/cache/cache_policy.py builds under bench/work (built once). Each repeat opens the
index afresh, warms it, and times both call sizes; the medians over repeats are printed last. On a
shared machine, alternate runs of the two versions (--repeat 1 each) and compare their medians.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK

from bench.harness import sets
from bench.harness.streams import build  # noqa: E402


class _OtherRetriever(importlib.abc.MetaPathFinder):
    """fusionrag.retriever and its submodules from another directory (the rest of fusionrag as installed)."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != "fusionrag.retriever" and not name.startswith("fusionrag.retriever."):
            return None
        where = self.root.joinpath(*name.split(".")[2:])
        if where.is_dir():
            return importlib.util.spec_from_file_location(name, where / "__init__.py",
                                                          submodule_search_locations=[str(where)])
        if where.with_suffix(".py").exists():
            return importlib.util.spec_from_file_location(name, where.with_suffix(".py"))
        return None


def recall(found: np.ndarray, gt: np.ndarray, k: int = 10) -> float:
    return float(np.mean([len(np.intersect1d(a[a >= 0], b[:k])) / k for a, b in zip(found, gt)]))


def one_round(idx_path: Path, queries: np.ndarray, gt: np.ndarray, singles: int, batched: int,
              nprobe: int) -> dict:
    from fusionrag.retriever import EngineConfig, Index

    index = Index.open(idx_path, EngineConfig(filter_tier="cpu"))
    try:
        index.search(queries[:256], 10, nprobe=nprobe)  # warm the page buffer and the code
        t, c = time.perf_counter(), time.process_time()
        single_ids = [index.search(queries[i], 10, nprobe=nprobe).ids for i in range(singles)]
        single_s, single_cpu = time.perf_counter() - t, time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        batch_ids = [index.search(queries[lo:lo + 256], 10, nprobe=nprobe).ids for lo in range(0, batched, 256)]
        batch_s, batch_cpu = time.perf_counter() - t, time.process_time() - c
    finally:
        index.close()
    # CPU time per query (every thread of the process) moves less than wall time with a shared machine's load.
    return {"single_qps": singles / single_s, "batch256_qps": batched / batch_s,
            "single_cpu_ms": 1e3 * single_cpu / singles, "batch256_cpu_ms": 1e3 * batch_cpu / batched,
            "single_recall10": recall(np.concatenate(single_ids), gt[:singles]),
            "batch256_recall10": recall(np.concatenate(batch_ids), gt[:batched])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="glove")
    ap.add_argument("--singles", type=int, default=500, help="queries searched one per call")
    ap.add_argument("--batched", type=int, default=2048, help="queries searched 256 per call")
    ap.add_argument("--nprobe", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--code", type=Path, help="import fusionrag.retriever from this directory instead")
    args = ap.parse_args()
    if args.code:
        sys.meta_path.insert(0, _OtherRetriever(args.code.resolve()))
    idx_path = build(args.work, args.dataset)
    _, queries, gt, _ = sets.load(args.work, args.dataset)
    rounds = []
    for r in range(args.repeat):
        row = one_round(idx_path, queries, gt, args.singles, args.batched, args.nprobe)
        rounds.append(row)
        print(json.dumps({"round": r, "load": os.getloadavg()[0], **{k: round(v, 4) for k, v in row.items()}}),
              flush=True)
    print(json.dumps({"median": {k: round(statistics.median(r[k] for r in rounds), 4) for k in rounds[0]},
                      "dataset": args.dataset, "nprobe": args.nprobe, "code": sys.modules["fusionrag.retriever.engine.index"].__file__}),
          flush=True)


if __name__ == "__main__":
    main()
