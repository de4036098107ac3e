"""A collection on the GPU tier, end to end (step b of `make gpu-accept`): writes, a merge that builds
the index, deletes and more writes, a second (incremental) merge, and searches after each, every
answer checked against exact search over the collection's live vectors; and the process's GPU
memory, measured by the driver, against its budget.

    python -m bench.gpu.gpu_collection --out b.json [--count 200000] [--dim 128]

Exits 0 when every check holds. Without CUDA it runs at toy size through Triton's interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (torch does not import it)

from fusionrag.loadtests.queryset import near_queries, synthetic_vectors  # noqa: E402
from fusionrag.retriever import EngineConfig  # noqa: E402
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document  # noqa: E402

K = 10


def exact(vectors: np.ndarray, live: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Row numbers of the exact top-K among the live rows (squared L2, float64)."""
    rows = np.flatnonzero(live)
    x = vectors[rows].astype(np.float64)
    q = queries.astype(np.float64)
    d = (q * q).sum(1)[:, None] - 2 * q @ x.T + (x * x).sum(1)[None]
    return rows[np.argsort(d, axis=1, kind="stable")[:, :K]]


def check(col, vectors, live, queries, label: str) -> dict:
    """Search, and compare with exact search over the live vectors: recall@K, and no hit deleted."""
    t = time.perf_counter()
    res = col.search(queries, k=K)
    seconds = time.perf_counter() - t
    found = [[int(h.id[1:]) for h in hits] for hits in res.hits]
    truth = exact(vectors, live, queries)
    hits = sum(len(set(f) & set(t)) for f, t in zip(found, truth))
    dead = sum(not live[r] for f in found for r in f)
    out = {"queries": len(queries), "qps": round(len(queries) / seconds, 1), "recall@10": round(hits / truth.size, 4),
           "deleted_returned": dead, "full_answers": all(len(f) == K for f in found)}
    print(json.dumps({label: out}), flush=True)
    return out


def upsert(col, vectors: np.ndarray, rows: np.ndarray) -> None:
    for s in range(0, len(rows), 5000):
        col.upsert([Document(id=f"v{r}", vector=vectors[r]) for r in rows[s:s + 5000]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200_000 if CUDA else 2000)
    ap.add_argument("--dim", type=int, default=128 if CUDA else 16)
    ap.add_argument("--queries", type=int, default=500 if CUDA else 8)
    ap.add_argument("--gpu-budget-mb", type=int, default=2048 if CUDA else 64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    added = args.count // 10
    vectors = synthetic_vectors(args.count + added, args.dim)
    live = np.zeros(len(vectors), dtype=bool)
    queries = near_queries(vectors[:args.count], args.queries)
    rng = np.random.default_rng(7)
    root = Path(tempfile.mkdtemp(prefix="fusionrag-gpu-collection-"))
    engine = EngineConfig(filter_tier="gpu", gpu_budget_bytes=args.gpu_budget_mb << 20)
    catalog = Catalog(root, engine, CollectionConfig(background_merge=False, min_index_count=100))
    result = {"device": torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter)",
              "vectors": args.count, "dim": args.dim, "phase_seconds": {}}
    sec = result["phase_seconds"]
    try:
        col = catalog.create("accept", dim=args.dim, metric="l2")
        t = time.perf_counter()
        upsert(col, vectors, np.arange(args.count))
        live[:args.count] = True
        sec["write"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        col.merge()  # the first generation: an index on the GPU tier
        sec["first_merge"] = round(time.perf_counter() - t, 2)
        result["tier"] = col.info()["tiers"]["pq_tier"]
        result["after_first_merge"] = check(col, vectors, live, queries, "after_first_merge")
        # Deletes (tombstones, excluded inside the PQ scan) and new vectors (the exact fresh tier).
        gone = rng.choice(args.count, args.count // 10, replace=False)
        t = time.perf_counter()
        col.delete([f"v{r}" for r in gone])
        live[gone] = False
        new = np.arange(args.count, args.count + added)
        upsert(col, vectors, new)
        live[new] = True
        sec["delete_and_write"] = round(time.perf_counter() - t, 2)
        result["before_second_merge"] = check(col, vectors, live, queries, "before_second_merge")
        t = time.perf_counter()
        col.merge()  # incremental: tombstones dropped, new vectors into their lists, codes appended
        sec["second_merge"] = round(time.perf_counter() - t, 2)
        info = col.info()
        result["build_state"] = info["build_state"]
        result["after_second_merge"] = check(col, vectors, live, queries, "after_second_merge")
        # A new vector is its own nearest neighbour.
        probe = new[:: max(1, len(new) // 20)]
        own = col.search(vectors[probe], k=1)
        result["new_vectors_found"] = sum(h[0].id == f"v{r}" for h, r in zip(own.hits, probe)) / len(probe)
        f = info["tiers"]["filter"]
        result["gpu_memory"] = {k: f.get(k) for k in ("gpu_budget_bytes", "gpu_reserved_bytes", "gpu_overhead_bytes",
                                                       "gpu_process_bytes", "resident_code_fraction")}
        held = f.get("gpu_process_bytes")
        result["gpu_memory"]["process_within_budget"] = None if held is None else held <= f["gpu_budget_bytes"]
    finally:
        catalog.close()
        shutil.rmtree(root, ignore_errors=True)
    searches = [result[k] for k in ("after_first_merge", "before_second_merge", "after_second_merge")]
    result["checks"] = {
        "gpu_tier": result["tier"] == "gpu",
        "recall_at_least_0.9": all(s["recall@10"] >= 0.9 for s in searches),
        "no_deleted_returned": all(s["deleted_returned"] == 0 for s in searches),
        "full_answers": all(s["full_answers"] for s in searches),
        "merged_twice": result["build_state"]["generation"] == 2 and result["build_state"]["fresh"] == 0,
        "new_vectors_found": result["new_vectors_found"] >= 0.95,
        "memory_within_budget": result["gpu_memory"]["process_within_budget"] is not False
        and (not CUDA or result["gpu_memory"]["process_within_budget"] is not None),
    }
    result["passed"] = all(result["checks"].values())
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"passed": result["passed"], **result["checks"]}))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
