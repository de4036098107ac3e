"""Micro-benchmark of the SSD tier: random 4 KiB O_DIRECT reads (io_uring vs the
pread pool) and re-ranking throughput, on a ~1 GiB page file of f32 dim-128 records.

    python -m bench.cache.micro_io [--gib 1.0] [--seconds 3] [--dir bench-tmp]

The page file is written under --dir and deleted at the end.
"""

import argparse
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from fusionrag import native

from bench.harness.paths import ROOT

DIM = 128
BATCH = 16


def build(path: Path, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    record_bytes = DIM * 4
    rpb, ppb = native.page_layout(record_bytes)
    vectors = np.empty((n, DIM), np.float32)
    writer = native.PageWriter(str(path), record_bytes, rpb, ppb)
    step = 1 << 16
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        vectors[lo:hi] = rng.standard_normal((hi - lo, DIM), dtype=np.float32)
        writer.write(np.arange(lo, hi, dtype=np.uint32), vectors[lo:hi].view(np.uint8))
    crc = writer.close()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold, even for a buffered open
    os.close(fd)
    return vectors, crc


def open_store(path, crc, backend, buffer_blocks=0):
    rpb, ppb = native.page_layout(DIM * 4)
    return native.PageStore(str(path), DIM * 4, rpb, ppb, crc, buffer_blocks, io_backend=backend, direct_io="on")


def random_reads(store, threads: int, seconds: float) -> dict:
    """Each thread reads batches of BATCH random blocks back to back."""
    latencies = [[] for _ in range(threads)]
    stop = time.perf_counter() + seconds

    def worker(t):
        rng = np.random.default_rng(t)
        batches = rng.integers(0, store.num_blocks, (4096, BATCH)).astype(np.uint32)
        i = 0
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            store.read_blocks(batches[i % len(batches)])
            latencies[t].append(time.perf_counter() - t0)
            i += 1

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for p in pool:
        p.start()
    for p in pool:
        p.join()
    elapsed = time.perf_counter() - t0
    lat = np.concatenate([np.asarray(x) for x in latencies]) * 1e6
    return {
        "reads_per_s": len(lat) * BATCH / elapsed,
        "batch_p50_us": np.percentile(lat, 50),
        "batch_p99_us": np.percentile(lat, 99),
        "read_mean_us": lat.mean() / BATCH,  # a batch's latency shared by its reads
    }


def rerank_qps(store, vectors, threads: int, beta: int, seconds: float, rng) -> dict:
    nq, n = 256, 200
    queries = (vectors[rng.integers(0, len(vectors), nq)] + 0.3 * rng.standard_normal((nq, DIM))).astype(np.float32)
    cand = rng.integers(0, len(vectors), (nq, n))
    # A PQ-like order: exact distances blurred by noise.
    d = ((queries[:, None, :] - vectors[cand]) ** 2).sum(-1) * rng.uniform(0.8, 1.2, (nq, n))
    cand = np.take_along_axis(cand, np.argsort(d, 1), 1).astype(np.int64)
    locations = np.arange(len(vectors), dtype=np.uint32)
    done, stats = 0, []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _, _, st, _ = native.rerank(store, queries, cand, locations, "f32", "l2", 10, 32, 0.1, beta, threads)
        done += nq
        stats.append(st)
    elapsed = time.perf_counter() - t0
    st = np.concatenate(stats)
    return {"qps": done / elapsed, "minibatches": st[:, 0].mean(), "blocks_read": st[:, 2].mean()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--dir", default=str(ROOT / "bench-tmp"))
    args = ap.parse_args()

    workdir = Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "vectors.pages"
    rng = np.random.default_rng(0)
    n = int(args.gib * (1 << 30)) // (DIM * 4)
    try:
        t0 = time.perf_counter()
        vectors, crc = build(path, n, rng)
        build_s = time.perf_counter() - t0
        print(f"page file: {path.stat().st_size / 2**30:.2f} GiB, {n} records, {len(crc)} blocks, "
              f"written in {build_s:.1f} s ({path.stat().st_size / 2**20 / build_s:.0f} MiB/s)")

        print(f"\nrandom 4 KiB O_DIRECT reads, batches of {BATCH}, no page buffer")
        print(f"{'backend':>9} {'threads':>7} {'reads/s':>10} {'batch p50 us':>13} {'batch p99 us':>13} "
              f"{'us/read':>8}")
        for backend in ("io_uring", "pread"):
            try:
                store = open_store(path, crc, backend)
            except OSError as e:
                print(f"{backend:>9}: unavailable ({e})")
                continue
            for threads in (1, 2):
                r = random_reads(store, threads, args.seconds)
                print(f"{backend:>9} {threads:>7} {r['reads_per_s']:>10.0f} {r['batch_p50_us']:>13.0f} "
                      f"{r['batch_p99_us']:>13.0f} {r['read_mean_us']:>8.1f}")

        print("\nrerank: n=200 candidates, minibatch 32, k=10, eps 0.1, no page buffer")
        print(f"{'backend':>9} {'threads':>7} {'beta':>5} {'queries/s':>10} {'minibatches':>11} {'blocks/q':>9}")
        for backend in ("io_uring", "pread"):
            try:
                store = open_store(path, crc, backend)
            except OSError:
                continue
            for threads in (1, 2):
                for beta in (0, 2):
                    r = rerank_qps(store, vectors, threads, beta, args.seconds, rng)
                    print(f"{backend:>9} {threads:>7} {beta:>5} {r['qps']:>10.0f} {r['minibatches']:>11.2f} "
                          f"{r['blocks_read']:>9.1f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
