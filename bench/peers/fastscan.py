"""#68 item 2: 4-bit PQ codes scanned with tables in registers (pshufb, as Faiss's
IVFPQFastScan) against the engine's 8-bit codes with float tables, on the candidates the index's own navigation
gives.

    python -m bench.peers.fastscan SET [SET ...] [--nprobe 24,64] [--queries 500] [--rerank 20,40,60,100]

For each set, on the runner's default index (bench/work/idx/SET/fusionrag) and N queries of the report half (the
second; nothing is chosen here):
- 4-bit codebooks (16 centroids a sub-space, the engine's k-means, 30,000 rows, 12 iterations) at the same bytes
  as the index's 8-bit codes (twice the sub-spaces) and at half of them, rounded up to a multiple of 8 sub-spaces
  (the kernel reads 4 bytes a candidate at a time; the padding sub-spaces are all-zero codes and tables).
- Recall@10 (against the set's ground truth) of the n best by each code's distance, re-ranked exactly, over the
  lists the index probes at each nprobe (NavigationTier.probe, the ratio rule on): the 4-bit distances with the
  tables quantized to uint8 as the kernel does.
- Time a query of what the engine's scan does after navigation (de-duplication, scoring, the n best), in C++
  (bench/peers/fastscan_kernels.cpp, g++ -O3 -march=x86-64-v3, best of 9 passes, pinned to one core where taskset
  is at hand) on the same candidates and tables; the 4-bit kernel's answers are checked against a scalar
  transposition of the same blocks. Beside it, the engine's own LUT and scan seconds (Index.search, one query a
  call, the same nprobe and n, raw vectors in RAM) from its per-query stats, and a call of the engine's native
  scans, one query a call, table built inside: scan_topn_pq over the index's 8-bit codes, scan_topn_pq4 over the
  4-bit ones at the same bytes (native/scan4_kernel.cpp).
Results: bench/results/peers/fastscan.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK, results
from bench.harness.sets import load_as_searched, prepare

import fusionrag.retriever as fr  # noqa: E402
from fusionrag.retriever.engine.kmeans import kmeans, sq_dists  # noqa: E402

KERNELS = Path(__file__).with_name("fastscan_kernels.cpp")
K4 = 16


def train4(x: np.ndarray, m4: int, rng: np.random.Generator, sample: int = 30_000, iters: int = 12):
    """(codebooks float32 (m4, 16, dsub), codes uint8 (n, m4)): the sub-spaces past the data's are padding, with
    all-zero codebooks and codes."""
    dim = x.shape[1]
    dsub = -(-dim // m4)
    real = -(-dim // dsub)
    xs = np.pad(x, ((0, 0), (0, real * dsub - dim))).reshape(len(x), real, dsub)
    rows = xs[rng.choice(len(x), min(len(x), sample), replace=False)]
    books = np.zeros((m4, K4, dsub), np.float32)
    codes = np.zeros((len(x), m4), np.uint8)
    for j in range(real):
        books[j], _ = kmeans(np.ascontiguousarray(rows[:, j]), K4, iters, rng)
        codes[:, j] = sq_dists(np.ascontiguousarray(xs[:, j]), books[j]).argmin(axis=1)
    return books, codes


def tables4(q: np.ndarray, books: np.ndarray) -> np.ndarray:
    """float32 (q, m4, 16) squared l2 per sub-space (zero on the padding ones)."""
    m4, _, dsub = books.shape
    real = -(-q.shape[1] // dsub)
    qs = np.pad(q, ((0, 0), (0, real * dsub - q.shape[1]))).reshape(len(q), real, dsub)
    out = np.zeros((len(q), m4, K4), np.float32)
    out[:, :real] = ((qs[:, :, None, :] - books[None, :real]) ** 2).sum(-1)
    return out


def quantized(luts: np.ndarray) -> np.ndarray:
    """The kernel's uint8 tables (as int64): (entry - its sub-space's least) * 255 / the widest sub-space's range."""
    lo = luts.min(axis=2, keepdims=True)
    widest = (luts.max(axis=2, keepdims=True) - lo).max(axis=1, keepdims=True)
    inv = np.where(widest > 0, np.float32(255) / np.maximum(widest, 1e-30), 0).astype(np.float32)
    return ((luts - lo) * inv + np.float32(0.5)).astype(np.int64)


def recall_after_rerank(x, q, truth, cands, distance, ns) -> dict[int, float]:
    """Recall@10 of the n best candidates by distance(i, ids), re-ranked exactly, for each n."""
    hits = {n: 0 for n in ns}
    for i, c in enumerate(cands):
        order = c[np.argsort(distance(i, c), kind="stable")]
        for n in ns:
            top = order[:n]
            exact = ((x[top] - q[i]) ** 2).sum(axis=1)
            hits[n] += len(np.intersect1d(top[np.argsort(exact)[:10]], truth[i]))
    return {n: round(h / (10 * len(cands)), 4) for n, h in hits.items()}


def build_kernels(out: Path) -> Path | None:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None
    exe = out / "fastscan_kernels"
    subprocess.run([cxx, "-O3", "-march=x86-64-v3", "-std=c++17", "-o", str(exe), str(KERNELS)], check=True)
    return exe


def time_kernels(exe: Path, tmp: Path, codes8, luts8, codes4, luts4, lists, probed, offsets, list_ids, n):
    codes8.tofile(tmp / "codes8.bin")
    luts8.astype(np.float32).tofile(tmp / "luts8.bin")
    np.ascontiguousarray(codes4[:, 0::2] | (codes4[:, 1::2] << 4), dtype=np.uint8).tofile(tmp / "codes4.bin")
    luts4.astype(np.float32).tofile(tmp / "luts4.bin")
    kept = [row[:p][row[:p] >= 0] for row, p in zip(lists, probed)]
    np.array([len(r) for r in kept], np.int64).tofile(tmp / "nlists.bin")
    np.concatenate(kept).astype(np.int32).tofile(tmp / "lists.bin")
    offsets.astype(np.int64).tofile(tmp / "offsets.bin")
    list_ids.astype(np.uint32).tofile(tmp / "list_ids.bin")
    (tmp / "shape.txt").write_text(f"{len(codes8)} {codes8.shape[1]} {codes4.shape[1]} {len(lists)} "
                                   f"{len(offsets) - 1} {len(list_ids)}\n")
    cmd = [str(exe), str(tmp), str(n)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(os.cpu_count() - 1)] + cmd
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def engine_kernels(q, lists, probed, offsets, list_ids, books8, codes8, books4, codes4, metric, n,
                   passes: int = 3) -> dict:
    """µs a call of the engine's own scans, one query a call, 1 thread, best of `passes` passes: native.scan_topn_pq
    (8-bit) and native.scan_topn_pq4 (4-bit, native/scan4_kernel.cpp), each building its query's table inside, on
    the same probed lists."""
    from fusionrag import native

    probes = np.where(np.arange(lists.shape[1])[None, :] < probed[:, None], lists, -1).astype(np.int32)
    cb8, cb4 = native.PqCodebooks(books8), native.Pq4Codebooks(books4)
    packed = np.ascontiguousarray(codes4[:, 0::2] | (codes4[:, 1::2] << 4), dtype=np.uint8)
    calls = {"pq8": lambda i: native.scan_topn_pq(q[i:i + 1], cb8, metric, probes[i:i + 1], offsets, list_ids,
                                                   codes8, n, 1),
             "pq4": lambda i: native.scan_topn_pq4(q[i:i + 1], cb4, metric, probes[i:i + 1], offsets, list_ids,
                                                    packed, n, 1)}
    best = {name: float("inf") for name in calls}
    for _ in range(passes):
        for name, call in calls.items():
            t = time.perf_counter()
            for i in range(len(q)):
                call(i)
            best[name] = min(best[name], (time.perf_counter() - t) / len(q) * 1e6)
    return {name: round(v, 2) for name, v in best.items()}


def engine_stages(index, q, nprobe, n) -> dict:
    """Mean µs a query of the engine's LUT and scan stages, one query a call."""
    lut = scan = 0.0
    for i in range(len(q)):
        st = index.search(q[i:i + 1], 10, nprobe=nprobe, rerank=n).stats
        lut += float(st["lut_s"][0])
        scan += float(st["scan_s"][0])
    return {"lut_us": round(lut / len(q) * 1e6, 2), "scan_us": round(scan / len(q) * 1e6, 2)}


def study(name: str, args, exe: Path | None, tmp: Path) -> dict:
    work = WORK.resolve()
    prepare(work, name)
    x, queries, gt, meta = load_as_searched(work, name)
    idx = work / "idx" / name / "fusionrag"
    half = len(queries) // 2
    q = np.ascontiguousarray(queries[half:][:args.queries], dtype=np.float32)
    truth = gt[half:][:args.queries, :10]
    if meta["metric"] == "cosine":
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
    index = fr.Index.open(idx, fr.EngineConfig(threads=1, raw_in_ram="on", manager_interval_s=0))
    try:
        offsets, list_ids = np.load(idx / "list_offsets.npy"), np.load(idx / "list_ids.npy")
        codes8, books8 = np.load(idx / "pq_codes.npy"), np.load(idx / "pq_codebooks.npy")
        from fusionrag import native

        luts8 = native.pq_luts(q, books8, "l2")
        m8 = codes8.shape[1]
        rng = np.random.default_rng(0)
        fours = {}
        for m4 in sorted({-(-2 * m8 // 8) * 8, -(-m8 // 8) * 8}, reverse=True):
            books, codes = train4(x, m4, rng)
            fours[m4] = (codes, tables4(q, books), books)
        out = {"set": name, "count": len(x), "dim": x.shape[1], "m8": m8, "queries": len(q), "points": []}
        ns = [int(v) for v in args.rerank.split(",")]
        for nprobe in (int(v) for v in args.nprobe.split(",")):
            lists, probed, _ = index.nav.probe(q, index.params.with_overrides(nprobe=nprobe))
            cands = [np.unique(np.concatenate([list_ids[offsets[c]:offsets[c + 1]] for c in row[:p] if c >= 0]))
                     for row, p in zip(lists, probed)]
            point = {"nprobe": nprobe, "recall": {}, "kernels": {}, "engine": {}}
            rows = np.arange(m8)[None, :]
            point["recall"][f"pq8 x {m8} ({m8} B)"] = recall_after_rerank(
                x, q, truth, cands, lambda i, c: luts8[i][rows, codes8[c]].sum(axis=1), ns)
            for m4, (codes, luts, _) in fours.items():
                qt, r4 = quantized(luts), np.arange(m4)[None, :]
                point["recall"][f"pq4 x {m4} ({m4 // 2} B)"] = recall_after_rerank(
                    x, q, truth, cands, lambda i, c, qt=qt, r4=r4, codes=codes: qt[i][r4, codes[c]].sum(axis=1), ns)
            print(name, nprobe, point["recall"], flush=True)
            m4 = max(fours)
            for n in ns:
                if exe is not None:
                    point["kernels"][n] = time_kernels(exe, tmp, codes8, luts8, fours[m4][0], fours[m4][1], lists,
                                                       probed, offsets, list_ids, n)
                point["engine"][n] = engine_stages(index, q, nprobe, n) | engine_kernels(
                    q, lists, probed, offsets, list_ids, books8, codes8, fours[m4][2], fours[m4][0],
                    index.manifest["internal_metric"], n)
                print(name, nprobe, n, point["kernels"].get(n), point["engine"][n], flush=True)
            out["points"].append(point)
        return out
    finally:
        index.close()


def report(res: list[dict], machine: str) -> str:
    lines = ["# 4-bit PQ scanned in registers against the engine's 8-bit scan (#68 item 2)", "",
             f"`python -m bench.peers.fastscan` on {machine}; the module's docstring says what each column is. "
             "µs are a query's, one thread, best of 9 passes over the queries.", ""]
    for r in res:
        lines += [f"## {r['set']}: {r['count']:,} x {r['dim']}, the index's codes {r['m8']} B", "",
                  "Recall@10 after the n best are re-ranked exactly:", ""]
        names = list(r["points"][0]["recall"])
        ns = list(r["points"][0]["recall"][names[0]])
        lines += ["| nprobe | codes | " + " | ".join(f"n {n}" for n in ns) + " |",
                  "|---:|---|" + "---:|" * len(ns)]
        for p in r["points"]:
            lines += [f"| {p['nprobe']} | {c} | " + " | ".join(str(p["recall"][c][n]) for n in ns) + " |"
                      for c in names]
        lines += ["", "µs a query: de-duplication, scoring and the n best (C++), and the engine's stages:", "",
                  "| nprobe | n | candidates (unique) | pq8 | pq4 rows | pq4 gathers | pq4 per list | select alone "
                  "| SIMD = scalar | engine LUT | engine scan | engine pq8 call | engine pq4 call |",
                  "|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
        for p in r["points"]:
            for n, e in p["engine"].items():
                k = p["kernels"].get(n)
                if k is None:
                    lines.append(f"| {p['nprobe']} | {n} | | | | | | | | {e['lut_us']} | {e['scan_us']} | "
                                 f"{e['pq8']} | {e['pq4']} |")
                    continue
                us = k["us"]
                lines.append(f"| {p['nprobe']} | {n} | {k['gathered']:.0f} ({k['unique']:.0f}) | {us['pq8']} | "
                             f"{us['pq4-rows']} | {us['pq4']} | {us['pq4-lists']} | {us['select']} | "
                             f"{k['rows_equal_scalar']} / {k['pq4_equals_scalar']} | {e['lut_us']} | {e['scan_us']} | "
                             f"{e['pq8']} | {e['pq4']} |")
        k = next((k for p in r["points"] for k in p["kernels"].values()), None)
        if k:
            lines += ["", f"Code bytes: pq8 {k['pq8_bytes'] / 2**20:.1f} MiB, pq4 by id {k['pq4_bytes'] / 2**20:.1f} "
                      f"MiB, pq4 copied per list in blocks of 32 {k['list_block_bytes'] / 2**20:.1f} MiB.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sets", nargs="+")
    ap.add_argument("--nprobe", default="24,64")
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--rerank", default="20,40,60,100")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_kernels(Path(tmp))
        res = [study(name, args, exe, Path(tmp)) for name in args.sets]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"
    d = results("peers")
    (d / "fastscan.json").write_text(json.dumps({"machine": machine, "sets": res}, indent=1))
    (d / "fastscan.md").write_text(report(res, machine))


if __name__ == "__main__":
    main()
