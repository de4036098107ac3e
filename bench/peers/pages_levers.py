"""Would smaller records or scoring a page's other records cut the pages a query reads?

    python -m bench.peers.pages_levers minilm|fashion|glove|synth200k

Replays Algorithm 1 in numpy on the real PQ candidates of a benchmark index (bench/work/idx/SET/
fusionrag, nprobe 32, 60 candidates, 1000 queries) with exact distances from the base vectors,
and counts the distinct pages each query touches (page buffer left out): with the index's records
per page, with 2.5x (2 -> 5: float32 stored as float16) or 2x as many, and with "co-resident"
scoring (every record of a page read gets an exact distance, not only the candidates on it).
Pages are slot // records-per-page: the layout's bucket order, packed denser.
Results: bench/results/peers/pages_levers.md.
"""
import sys, numpy as np
from bench.harness.sets import load_as_searched
from bench.harness.page_replay import pq_candidates, replay
from pathlib import Path
import fusionrag.retriever as fr
ds = sys.argv[1] if len(sys.argv) > 1 else "minilm"
X, queries, gt, meta = load_as_searched(Path("bench/work").resolve(), ds)
idx = fr.Index.open(f"bench/work/idx/{ds}/fusionrag", threads=1)
nq = 1000
q, cand = pq_candidates(idx, queries[:nq], nprobe=32, n=60)
loc = idx.reranker.locations.astype(np.int64)
rpb0 = idx.manifest["pages"]["records_per_block"]
slot2id = np.full(loc.max() + 1, -1, np.int64); slot2id[loc] = np.arange(len(loc))

orders = [c[c >= 0] for c in cand]


def run(rpb, coresident, mb, beta):
    pages, _, rec = replay(X, q, gt, orders, loc, rpb, mb, beta, "every record" if coresident else "no", slot2id)
    return pages, rec


print(ds, "records per page now", rpb0)
for rpb in (rpb0, int(rpb0 * 2.5) if rpb0 == 2 else rpb0 * 2):
    for co in (False, True):
        for mb, beta in ((4, 2), (4, 1), (8, 2)):
            pg, rec = run(rpb, co, mb, beta)
            print(f"rpb {rpb} coresident {co} mb {mb} beta {beta}: pages {pg:.1f} recall {rec:.3f}")
