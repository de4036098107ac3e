"""Sustained mixed workload on a collection (issue 5): search throughput and recall while
writing, against the same collection read-only.

1. load: upsert the base in batches (log + doc store + fresh tier), then merge (the full build);
2. read-only: single-query searches, recall@10 against the data set's ground truth;
3. mixed: one client, each operation a search with probability 1 - write_frac, else a write
   (half upserts of 10 new documents near existing ones, half deletes of 10 live ones); background
   merges fold the writes in as the fresh tier fills. Recall@10 of every 10th search is checked
   against exact search over the documents live at that moment (not timed).

    python -m bench.service.collection_mixed                      # GloVe 390k (bench/work/glove/base.fbin)
    python -m bench.service.collection_mixed --n 100000 --ops 20000

The base file is rebuilt by glove-6b-50d-angular/make_base.py in shared/data beside the checkout (or FUSIONRAG_DATA).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.engine.vectors import open_vectors

from bench.harness.paths import BENCH, WORK, results
DATA = Path(os.environ.get("FUSIONRAG_DATA", BENCH.parents[1] / "shared" / "data")) / "glove-6b-50d-angular"


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem = next(int(line.split()[1]) >> 20 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "ram_gib": mem, "python": platform.python_version(),
            "kernel": platform.release()}


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def latency_summary(lat: list[float]) -> dict:
    a = np.asarray(lat) * 1e3
    return {"count": len(a), "qps": len(a) / (a.sum() / 1e3), "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=str(WORK / "glove" / "base.fbin"))
    ap.add_argument("--n", type=int, default=0, help="use the first n base vectors (0: all)")
    ap.add_argument("--ops", type=int, default=20000, help="operations in the mixed phase")
    ap.add_argument("--searches", type=int, default=5000, help="searches in the read-only phase")
    ap.add_argument("--write-frac", type=float, default=0.1)
    ap.add_argument("--merge-count", type=int, default=2000, help="fresh vectors that start a merge")
    ap.add_argument("--work", default=str(WORK / "collection_mixed"))
    ap.add_argument("--out", default=str(results("service") / "collection_mixed.json"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)

    base = open_vectors(args.base)[:]
    n = args.n or len(base)
    base = np.ascontiguousarray(base[:n], dtype=np.float32)
    queries = open_vectors(DATA / "query_10k.fbin")[:]
    gt = open_vectors(DATA / "groundtruth_cosine_top100.ibin")[:, :10] if n == 390000 else None
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    result = {"machine": machine(), "args": vars(args), "n": n}

    # 1. Load and the first (full) build, with no merge in between.
    cat = Catalog(work, collection_config=CollectionConfig(background_merge=False))
    col = cat.create("glove", base.shape[1], "cosine")
    t = time.perf_counter()
    batch = 10000
    for s in range(0, n, batch):
        col.upsert([Document(str(i), None, base[i], {"bucket": i % 100}) for i in range(s, min(n, s + batch))])
    result["load_docs_per_s"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    col.merge()
    result["build_s"] = time.perf_counter() - t
    cat.close()
    cat = Catalog(work, collection_config=CollectionConfig(merge_fresh_count=args.merge_count))
    col = cat.get("glove")
    print(json.dumps({k: result[k] for k in ("n", "load_docs_per_s", "build_s")}), flush=True)

    # Ground truth for a smaller base: exact search over it.
    vecs = unit(base)
    if gt is None:
        pick = np.arange(2000)
        gt = np.argsort(-(unit(queries[pick]) @ vecs.T), axis=1)[:, :10]
    qn = len(gt)

    # 2. Read-only.
    # The engine alone on the same index and query, interleaved so both see the same caches:
    # the difference is what the collection layer (snapshot, fresh tier, documents) adds.
    eng = col._main.index
    lat, eng_lat, hits = [], [], 0
    for qi in rng.integers(qn, size=args.searches).tolist():
        t = time.perf_counter()
        eng.search(queries[qi:qi + 1], 10)
        eng_lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        res = col.search(queries[qi:qi + 1], k=10)
        lat.append(time.perf_counter() - t)
        hits += len({int(h.id) for h in res.hits[0]} & set(gt[qi].tolist()))
    result["read_only"] = latency_summary(lat) | {"recall_at_10": hits / (10 * args.searches),
                                                  "engine_only": latency_summary(eng_lat)}
    print(json.dumps({"read_only": result["read_only"]}), flush=True)

    # 3. Mixed: the live set is tracked here to compute exact recall at any moment.
    all_vecs = [vecs]
    live = np.ones(n, bool)
    next_id = n
    s_lat, w_lat, s_lat_merging = [], [], []
    checked, found = 0, 0
    generations = col.info()["build_state"]["generation"]
    t_phase = time.perf_counter()
    for op in range(args.ops):
        if rng.random() >= args.write_frac:
            qi = int(rng.integers(len(queries)))
            merging = col._merging
            t = time.perf_counter()
            res = col.search(queries[qi:qi + 1], k=10)
            dt = time.perf_counter() - t
            (s_lat_merging if merging else s_lat).append(dt)
            if op % 10 == 0:
                cur = np.concatenate(all_vecs)
                alive = np.flatnonzero(live)
                truth = alive[np.argsort(-(cur[alive] @ unit(queries[qi:qi + 1])[0]))[:10]]
                found += len({int(h.id) for h in res.hits[0]} & set(truth.tolist()))
                checked += 1
        elif rng.random() < 0.5:
            src = vecs[rng.integers(n, size=10)]
            new = (src + 0.05 * rng.standard_normal(src.shape)).astype(np.float32)
            ids = list(range(next_id, next_id + 10))
            t = time.perf_counter()
            col.upsert([Document(str(i), None, v, {"bucket": i % 100}) for i, v in zip(ids, new)])
            w_lat.append(time.perf_counter() - t)
            all_vecs.append(unit(new))
            live = np.concatenate([live, np.ones(10, bool)])
            next_id += 10
        else:
            gone = rng.choice(np.flatnonzero(live), 10, replace=False)
            t = time.perf_counter()
            col.delete([str(i) for i in gone])
            w_lat.append(time.perf_counter() - t)
            live[gone] = False
    phase_s = time.perf_counter() - t_phase
    info = col.info()
    result["mixed"] = {
        "search": latency_summary(s_lat + s_lat_merging),
        "search_while_merging": latency_summary(s_lat_merging) if s_lat_merging else None,
        "writes": latency_summary(w_lat) | {"docs_per_write": 10},
        "recall_at_10": found / (10 * max(1, checked)),
        "recall_checked_searches": checked,
        "merges_published": info["build_state"]["generation"] - generations,
        "phase_s": phase_s,
        "final_state": info["build_state"],
    }
    print(json.dumps({"mixed": result["mixed"]}), flush=True)

    # 4. Filtered searches on the final state: 1% and 10% of documents pass.
    cur = np.concatenate(all_vecs)
    buckets = np.arange(len(cur)) % 100
    result["filtered"] = {}
    for name, flt, sel in [("1%", {"bucket": 7}, buckets == 7), ("10%", {"bucket": {"$lt": 10}}, buckets < 10)]:
        ok = np.flatnonzero(live & sel)
        lat, hits, exact = [], 0, False
        for j in range(200):
            qv = queries[j:j + 1]
            t = time.perf_counter()
            res = col.search(qv, k=10, filter=flt)
            lat.append(time.perf_counter() - t)
            truth = ok[np.argsort(-(cur[ok] @ unit(qv)[0]))[:10]]
            hits += len({int(h.id) for h in res.hits[0]} & set(truth.tolist()))
            exact = res.stats[0]["filtered_exact"]
        result["filtered"][name] = latency_summary(lat) | {"recall_at_10": hits / 2000, "filtered_exact": exact}
    print(json.dumps({"filtered": result["filtered"]}), flush=True)
    col.merge()
    cat.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
