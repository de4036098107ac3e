"""Would smaller records or scoring a page's other records cut the pages a query reads?

    python bench/pages_levers.py minilm|fashion|glove|synth200k

Replays Algorithm 1 in numpy on the real PQ candidates of a benchmark index (bench/work/idx/SET/
fusionrag, nprobe 32, 60 candidates, 1000 queries) with exact distances from the base vectors,
and counts the distinct pages each query touches (page buffer left out): with the index's records
per page, with 2.5x (2 -> 5: float32 stored as float16) or 2x as many, and with "co-resident"
scoring (every record of a page read gets an exact distance, not only the candidates on it).
Pages are slot // records-per-page: the layout's bucket order, packed denser.
Results: bench/results/pages_levers.md.
"""
import sys, numpy as np
sys.path.insert(0, "bench")
from datasets import load
from pathlib import Path
import fusionrag.retriever as fr
ds = sys.argv[1] if len(sys.argv) > 1 else "minilm"
base, queries, gt, meta = load(Path("bench/work").resolve(), ds)
X = np.asarray(base, dtype=np.float32)
if meta["metric"] == "cosine":
    X = X / np.linalg.norm(X, axis=1, keepdims=True)
idx = fr.Index.open(f"bench/work/idx/{ds}/fusionrag", threads=1)
nq = 1000
q = idx.prepare_queries(np.asarray(queries[:nq]))
p = idx.params.with_overrides(nprobe=32, rerank=60)
lists, _, _ = idx.nav.probe(q, p)
cand = idx.filter.topn(idx.filter.luts(idx.pq, q, "l2"), lists, 60).ids
loc = idx.reranker.locations.astype(np.int64)
rpb0 = idx.manifest["pages"]["records_per_block"]
slot2id = np.full(loc.max() + 1, -1, np.int64); slot2id[loc] = np.arange(len(loc))

def run(rpb, coresident, mb, beta, k=10):
    pages_tot, hits = 0, 0
    for i in range(nq):
        c = cand[i][cand[i] >= 0]
        best = {}  # id -> dist
        prev, stable, seen_pages = None, 0, set()
        for b in range(0, len(c), mb):
            batch = c[b:b + mb]
            pg = set((loc[batch] // rpb).tolist())
            new_pages = pg - seen_pages
            seen_pages |= pg
            ids = set(batch.tolist())
            if coresident:
                for page in new_pages:
                    s = slot2id[page * rpb:(page + 1) * rpb]
                    ids |= set(s[s >= 0].tolist())
            ids = np.array(sorted(ids - best.keys()))
            if len(ids):
                d = ((X[ids] - q[i]) ** 2).sum(1)
                best.update(zip(ids.tolist(), d.tolist()))
            top = set(sorted(best, key=lambda j: (best[j], j))[:k])
            if prev is not None and top == prev:
                stable += 1
            else:
                stable = 0
            prev = top
            if stable >= beta:
                break
        pages_tot += len(seen_pages)
        hits += len(top & set(gt[i, :k].tolist()))
    return pages_tot / nq, hits / (nq * k)

print(ds, "records per page now", rpb0)
for rpb in (rpb0, int(rpb0 * 2.5) if rpb0 == 2 else rpb0 * 2):
    for co in (False, True):
        for mb, beta in ((4, 2), (4, 1), (8, 2)):
            pg, rec = run(rpb, co, mb, beta)
            print(f"rpb {rpb} coresident {co} mb {mb} beta {beta}: pages {pg:.1f} recall {rec:.3f}")
