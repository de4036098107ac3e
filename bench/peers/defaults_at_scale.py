"""Recall and QPS of the search defaults on a large built index, against larger probes (not a test).

    fusionrag build bench/work/data/synth3m/base.fbin IDX --threads 2
    python -m bench.peers.defaults_at_scale synth3m IDX

2 threads, page buffer = raw vectors / 16, 300 warm-up queries (noisy base rows), then 1000
queries: recall@10, QPS, lists probed and pages read per query. Results: bench/results/defaults_*.log.
"""
import sys, time, numpy as np
from bench.harness.sets import load
from pathlib import Path
import fusionrag.retriever as fr
base, queries, gt, meta = load(Path("bench/work").resolve(), sys.argv[1])
rng = np.random.default_rng(1)
rows = np.sort(rng.choice(len(base), 300, replace=False))
warm = (np.asarray(base[rows]) + 0.01 * np.std(base[rows[:100]]) * rng.standard_normal((300, meta["dim"]), dtype=np.float32)).astype(np.float32)
buf = len(base) * base.shape[1] * 4 // 16
idx = fr.Index.open(sys.argv[2], threads=2, buffer_bytes=buf)
print(len(base), "vectors,", idx.manifest["centroids"], "lists; buffer", buf >> 20, "MiB; 2 threads; 1000 queries", flush=True)
idx.search(warm, k=10)
q = np.ascontiguousarray(queries[:1000])
for pt in [dict(), dict(nprobe=512, rerank=400), dict(nprobe=1024, rerank=800), dict(nprobe=512, rerank=400, probe_ratio=0), dict(nprobe=1024, rerank=800, probe_ratio=0), dict(nprobe=2048, rerank=800, probe_ratio=0)]:
    t = time.perf_counter(); r = idx.search(q, k=10, **pt); s = time.perf_counter() - t
    rec = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(r.ids, gt[:1000, :10])])
    print(f"{pt or 'defaults'}: recall@10 {rec:.3f}, {1000 / s:.0f} q/s, probed {r.stats['lists_probed'].mean():.0f}, pages {r.stats['pages_read'].mean():.1f}", flush=True)
