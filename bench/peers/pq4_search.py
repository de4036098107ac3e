"""#68 item 2 end to end: an index built with 4-bit PQ codes (BuildConfig.pq_bits 4) against the runner's default
build (8-bit) of the same set, both searched with the raw vectors in RAM.

    python -m bench.peers.pq4_search SET [SET ...] [--queries 1000]

For each set: the 4-bit index is built at the defaults but pq_bits into bench/work/pq4/SET (kept for reruns); the
8-bit one is the runner's (bench/work/idx/SET/fusionrag). Both open with raw_in_ram 'on', 1 thread, and search the
set's first N queries (the runner's; nothing is chosen here) at three settings of (nprobe, rerank) the runner's
fusionrag-ram sweep reaches recall@10 0.90-0.96 with: recall@10 against the set's ground truth, QPS of one call of
all N (best of 5, alternated), and µs of a one-query call (300 calls, best of 3, alternated). Pin the process to one
core (taskset) for steadier figures. Results: bench/results/peers/pq4_search.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from bench.harness.paths import WORK, results
from bench.harness.sets import load_as_searched, prepare

import fusionrag.retriever as fr  # noqa: E402

KNOBS = ({"nprobe": 24, "rerank": 40}, {"nprobe": 32, "rerank": 50}, {"nprobe": 64, "rerank": 100})


def recall_of(ids: np.ndarray, truth: np.ndarray) -> float:
    return sum(len(np.intersect1d(a[a >= 0], b)) for a, b in zip(ids, truth)) / truth.size


def study(name: str, n_queries: int) -> dict:
    work = WORK.resolve()
    prepare(work, name)
    _, queries, gt, meta = load_as_searched(work, name)
    q = np.ascontiguousarray(queries[:n_queries], dtype=np.float32)
    truth = gt[:n_queries, :10]
    paths = {8: work / "idx" / name / "fusionrag", 4: work / "pq4" / name}
    build_s = None
    if not (paths[4] / "manifest.json").exists():
        t = time.perf_counter()
        fr.Index.build(work / "data" / name / "base.fbin", paths[4], fr.BuildConfig(metric=meta["metric"], pq_bits=4),
                       progress=False)
        build_s = round(time.perf_counter() - t, 1)
    config = fr.EngineConfig(threads=1, raw_in_ram="on", manager_interval_s=0)
    index = {bits: fr.Index.open(path, config) for bits, path in paths.items()}
    try:
        rows = []
        for knobs in KNOBS:
            batch, one, rec = {8: np.inf, 4: np.inf}, {8: np.inf, 4: np.inf}, {}
            for _ in range(5):
                for bits, ix in index.items():
                    ix.search(q[:300], 10, **knobs)
                    t = time.perf_counter()
                    res = ix.search(q, 10, **knobs)
                    batch[bits] = min(batch[bits], time.perf_counter() - t)
                    rec[bits] = round(recall_of(res.ids, truth), 4)
            for _ in range(3):
                for bits, ix in index.items():
                    t = time.perf_counter()
                    for i in range(300):
                        ix.search(q[i:i + 1], 10, **knobs)
                    one[bits] = min(one[bits], (time.perf_counter() - t) / 300 * 1e6)
            rows.append({"knobs": knobs, "recall": rec, "qps": {b: round(len(q) / s) for b, s in batch.items()},
                         "one_query_us": {b: round(v, 1) for b, v in one.items()}})
            print(name, rows[-1], flush=True)
        codes = {b: int(np.load(p / "pq_codes.npy", mmap_mode="r").nbytes) for b, p in paths.items()}
        return {"set": name, "queries": len(q), "build_4bit_s": build_s, "code_bytes": codes, "rows": rows}
    finally:
        for ix in index.values():
            ix.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sets", nargs="+")
    ap.add_argument("--queries", type=int, default=1000)
    args = ap.parse_args()
    res = [study(name, args.queries) for name in args.sets]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"
    d = results("peers")
    (d / "pq4_search.json").write_text(json.dumps({"machine": machine, "sets": res}, indent=1))
    lines = ["# 4-bit PQ codes end to end (#68 item 2)", "",
             f"`python -m bench.peers.pq4_search {' '.join(args.sets)}` on {machine}: the module's docstring says how. "
             "8: the runner's default build; 4: the same build with `pq_bits` 4 (the same code bytes). Raw vectors "
             "in RAM, 1 thread.", "",
             "| set | nprobe, rerank | recall@10 8 / 4 | QPS 8 / 4 | ratio | µs a one-query call 8 / 4 | ratio |",
             "|---|---|---|---|---:|---|---:|"]
    for r in res:
        for row in r["rows"]:
            rc, qps, one = row["recall"], row["qps"], row["one_query_us"]
            lines.append(f"| {r['set']} | {row['knobs']['nprobe']}, {row['knobs']['rerank']} | {rc[8]} / {rc[4]} | "
                         f"{qps[8]:,} / {qps[4]:,} | {qps[4] / qps[8]:.2f} | {one[8]} / {one[4]} | "
                         f"{one[8] / one[4]:.2f} |")
    (d / "pq4_search.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
