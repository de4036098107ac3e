"""#70 item 2: the device tier's navigation with float16 centroids against float32, on real sets, without a GPU
(the device tier's CPU reference: the same float16 values, multiplied and summed in float32, as the device's GEMM
with float32 accumulation).

    python -m bench.gpu.half_navigation [--sets sift5k fashion-mnist glove] [--queries 100]
        [--out bench/results/gpu/half_navigation.json]

For each set (sift5k: 5,000 x 128, L2; Fashion-MNIST: 60,000 x 784, L2; GloVe 50d: 390,000, cosine, its base rebuilt by
the set's make_base.py into $GLOVE_BASE; ground truth from shared/data) the index
is built at the build's defaults and opened twice on the device tier (float32 centroids; float16 forced by
HALF_CENTROIDS_SHARE 0). Reported, at each nprobe:
- lists: over every query of the set, the share of the nprobe nearest lists (no ratio rule) the half navigation
  picks that float32 picks too, and the share of queries with the very same lists;
- reach: the share of each query's true top-10 lying in a list probed (either navigation), the recall navigation
  bounds;
- recall@10 of the whole search (the device tier under Triton's interpreter, --queries of them, at the index's
  search defaults but nprobe), float32 and half, and the CPU tier's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fusionrag.retriever import BuildConfig, EngineConfig, Index  # noqa: E402
from fusionrag.retriever.engine import device_tier as dt  # noqa: E402
from fusionrag.retriever.engine.config import SearchParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NPROBES = (8, 16, 32, 64, 128)


def _vecio(d: Path):
    spec = importlib.util.spec_from_file_location("vecio", d / "vecio.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(name: str, d: Path):
    v = _vecio(d)
    if name == "sift5k":
        f = d / "sift5k-ngt-texmexq"
        return (v.read_fvecs(f / "sift5k_base.fvecs"), v.read_fvecs(f / "sift5k_query.fvecs"),
                v.read_ivecs(f / "sift5k_groundtruth.ivecs")[:, :10])
    if name == "glove":  # the 390k base rebuilt by shared/data/glove-6b-50d-angular/make_base.py
        f = d / "glove-6b-50d-angular"
        base = v.read_bin(os.environ.get("GLOVE_BASE", "/tmp/glove_base.fbin"), np.float32)
        return base, v.read_bin(f / "query_10k.fbin", np.float32), v.read_bin(f / "groundtruth_cosine_top100.ibin",
                                                                               np.int32)[:, :10]
    f = d / "fashion-mnist-784-euclidean"
    base = v.read_idx_gz(f / "train-images-idx3-ubyte.gz").reshape(60000, -1).astype(np.float32)
    queries = v.read_idx_gz(f / "t10k-images-idx3-ubyte.gz").reshape(10000, -1).astype(np.float32)
    return base, queries, v.read_ivecs(f / "groundtruth_l2_top100.ivecs")[:, :10]


def recall(ids, gt) -> float:
    return float(np.mean([len(np.intersect1d(a[a >= 0], b)) / len(b) for a, b in zip(ids, gt)]))


def reach(lists: np.ndarray, gt: np.ndarray, vector_lists: list[set]) -> float:
    """Share of the true top-10 with a posting in one of the lists probed."""
    hit = 0
    for row, truth in zip(lists, gt):
        probed = set(row[row >= 0].tolist())
        hit += sum(bool(vector_lists[v] & probed) for v in truth)
    return hit / gt.size


def run(name: str, d: Path, n_queries: int, search_nprobes: tuple[int, ...]) -> dict:
    base, queries, gt = load(name, d)
    path = Path(tempfile.mkdtemp(prefix=f"halfnav-{name}-")) / "idx"
    t0 = time.perf_counter()
    metric = "cosine" if name == "glove" else "l2"
    Index.build(base, path, BuildConfig(metric=metric), progress=False)
    build_s = time.perf_counter() - t0
    conf = EngineConfig(filter_tier="gpu", gpu_search="device", gpu_budget_bytes=2 << 30, batch_size=64)
    out = {"set": name, "metric": metric, "n": len(base), "dim": base.shape[1], "queries_lists": len(queries),
           "queries_search": n_queries, "build_s": round(build_s, 1)}
    tiers = {}
    for dtype, share in (("float32", 1.0), ("float16", 0.0)):
        dt.HALF_CENTROIDS_SHARE = share
        idx = Index.open(path, conf)
        assert idx.filter.half is (dtype == "float16")
        tiers[dtype] = idx
    f32, f16 = tiers["float32"], tiers["float16"]
    offsets, ids = f32.filter.list_offsets, np.asarray(f32.filter.list_ids)
    vector_lists = [set() for _ in range(len(base))]
    for li in range(len(offsets) - 1):
        for v in ids[offsets[li]:offsets[li + 1]]:
            vector_lists[int(v)].add(li)
    out["lists"] = len(offsets) - 1
    out["postings"] = len(ids)
    q = torch.from_numpy(f32.prepare_queries(queries))
    rows = []
    for nprobe in NPROBES:
        p = SearchParams(nprobe=nprobe, probe_ratio=0.0)
        a = f32.filter._navigate(q, p).numpy()
        b = f16.filter._navigate(q, p).numpy()
        same = np.array([len(np.intersect1d(x, y)) for x, y in zip(a, b)]) / a.shape[1]
        row = {"nprobe": nprobe, "lists_shared": round(float(same.mean()), 5),
               "queries_same_lists": round(float((same == 1).mean()), 4),
               "reach_float32": round(reach(a, gt, vector_lists), 4),
               "reach_float16": round(reach(b, gt, vector_lists), 4)}
        rows.append(row)
        print(name, row, flush=True)
    cpu = Index.open(path, EngineConfig(filter_tier="cpu"))
    sub, sub_gt = queries[:n_queries], gt[:n_queries]
    for row in rows:
        if row["nprobe"] not in search_nprobes or not n_queries:
            continue
        for label, idx in (("float32", f32), ("float16", f16), ("cpu", cpu)):
            t0 = time.perf_counter()
            res = idx.search(sub, 10, nprobe=row["nprobe"])
            row[f"recall_{label}"] = round(recall(res.ids, sub_gt), 4)
            row[f"search_s_{label}"] = round(time.perf_counter() - t0, 2)
        print(name, row, flush=True)
    out["rows"] = rows
    out["centroid_bytes"] = {k: t.filter.account.parts["centroids"] for k, t in tiers.items()}
    for idx in (f32, f16, cpu):
        idx.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", nargs="+", default=["sift5k", "fashion-mnist"])
    ap.add_argument("--queries", type=int, default=100, help="queries of the whole search (interpreter: slow)")
    ap.add_argument("--search-nprobe", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu/half_navigation.json"))
    args = ap.parse_args(argv)
    d = Path(os.environ.get("FUSIONRAG_DATA", ROOT.parent / "shared" / "data"))
    torch.set_num_threads(2)
    results = [run(name, d, args.queries, tuple(args.search_nprobe)) for name in args.sets]
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
