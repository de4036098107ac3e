"""Micro-benchmark of the native hot paths (not a test).

Prints navigation-graph search queries/s (40k centroids x 50 dims, ef=128) and
CPU scan_topn candidates/s (q=1000, M=25, ~5000 candidates per query), each
with 1 and 2 threads. Run: python -m bench.pipeline.micro_native
"""

import argparse
import time

import numpy as np

from fusionrag.native import Graph, scan_topn


def best_of(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def clustered(rng, n, dim, clusters=200):
    centers = rng.normal(size=(clusters, dim)) * 3
    return (centers[rng.integers(0, clusters, n)] + rng.normal(size=(n, dim))).astype(np.float32)


def bench_graph(rng, threads, repeat):
    n, dim, ef, k = 40_000, 50, 128, 10
    x = clustered(rng, n + 2000, dim)
    queries, x = x[:2000], x[2000:]
    graph = Graph(dim, "l2", M=16, ef_construction=200, seed=0)
    start = time.perf_counter()
    graph.add(x)
    print(f"graph: built {n} x {dim} (M=16, ef_construction=200) in {time.perf_counter() - start:.2f} s")
    sample = queries[:200]
    d2 = (sample**2).sum(1)[:, None] - 2 * sample @ x.T + (x**2).sum(1)[None]
    truth = np.argsort(d2, axis=1)[:, :k]
    ids, _ = graph.search(sample, k, ef)
    recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, truth)])
    print(f"graph: recall@{k} at ef={ef}: {recall:.4f}")
    for t in threads:
        seconds = best_of(lambda: graph.search(queries, k, ef, num_threads=t), repeat)
        print(f"graph search ef={ef} k={k}, {t} thread(s): {len(queries) / seconds:,.0f} queries/s")


def bench_scan(rng, threads, repeat):
    # 1M vectors in 100k posting lists (~2 replicas each, ~20 ids per list);
    # 250 probed lists give ~5000 ids per query, a few of them duplicates.
    n_vectors, n_lists, m_sub, q, n_probe, top_n = 1_000_000, 100_000, 25, 1000, 250, 500
    list_of = rng.integers(0, n_lists, 2 * n_vectors)
    order = np.argsort(list_of, kind="stable")
    list_ids = (np.arange(2 * n_vectors) % n_vectors)[order].astype(np.uint32)
    offsets = np.zeros(n_lists + 1, np.int64)
    offsets[1:] = np.cumsum(np.bincount(list_of, minlength=n_lists))
    codes = rng.integers(0, 256, (n_vectors, m_sub), dtype=np.uint8)
    luts = rng.random((q, m_sub, 256), dtype=np.float32)
    probes = rng.integers(0, n_lists, (q, n_probe)).astype(np.int32)
    _, _, counts, _ = scan_topn(luts, probes, offsets, list_ids, codes, top_n)
    gathered, unique = counts.sum(axis=0)
    print(f"scan: N={n_vectors:,} M={m_sub} q={q} n={top_n}: {gathered / q:,.0f} ids gathered, "
          f"{unique / q:,.0f} unique per query")
    for t in threads:
        seconds = best_of(lambda: scan_topn(luts, probes, offsets, list_ids, codes, top_n, num_threads=t), repeat)
        print(f"scan_topn, {t} thread(s): {unique / seconds / 1e6:,.1f} M candidates/s "
              f"({gathered / seconds / 1e6:,.1f} M ids gathered/s, {q / seconds:,.0f} queries/s)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    bench_graph(rng, args.threads, args.repeat)
    bench_scan(rng, args.threads, args.repeat)


if __name__ == "__main__":
    main()
