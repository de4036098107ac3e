"""Text search over shards: each shard's own BM25 statistics vs the collection's (sharded mode's two rounds).

The Python 3.11 docs' paragraphs, in one doc store (the reference: one collection) and split over S doc
stores as a sharded collection's shards hold them: `topic` keeps each docs page on one shard and the pages in
path order, so a shard holds whole areas of the docs (library/..., c-api/..., whatsnew/...), as placement by
vector keeps topics together; `random` spreads paragraphs by a hash of their text. The questions are
bench/service/hybrid.py's (section headings; answers: that section's paragraphs), the report half (no setting here is
chosen from them). Per split and S: answered@10 and MRR@10, how many of the one store's top 10 each ranking
keeps (and exact score agreement), and the time a query takes in this process (the shards one after another:
what the shards' CPUs spend, not the wall time of parallel shards).

    python -m bench.sharded.sharded_text [--shards 3 8] [--work bench/work/sharded_text]

Writes bench/results/sharded_text.{json,md}.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import platform
import time
from pathlib import Path

import numpy as np
from bench.harness.headings import SOURCE, half, load

from fusionrag.retriever.collection.docstore import DocStore
from fusionrag.retriever.sharded.shard import best_text_hits, sum_text_stats

from bench.harness.paths import BENCH as ROOT, results
K = 10


def pages_of(texts: list[str]) -> list[str]:
    """The page of each unique text (its first paragraph's)."""
    page: dict[str, str] = {}
    with gzip.open(SOURCE, "rt") as f:
        for line in f:
            r = json.loads(line)
            page.setdefault(r["text"], r["doc"])
    return [page[t] for t in texts]


def make_store(path: Path, texts: list[str], rows: list[int]) -> DocStore:
    path.unlink(missing_ok=True)
    store = DocStore(path, 1, create=True)
    store.begin()
    store.insert(rows, [str(r) for r in rows], [texts[r] for r in rows], ["{}"] * len(rows),
                 np.zeros((len(rows), 1), np.float32))
    store.commit(1, max(rows) + 1)
    return store


def split(texts: list[str], pages: list[str], s: int, how: str) -> list[list[int]]:
    if how == "random":
        return [[i for i, t in enumerate(texts) if hashlib.sha256(t.encode()).digest()[0] % s == j] for j in range(s)]
    order = sorted(range(len(texts)), key=lambda i: (pages[i], i))  # pages in path order, cut in S equal parts
    cuts = [len(order) * j // s for j in range(s + 1)]
    parts, j = [[] for _ in range(s)], 0
    for n, i in enumerate(order):
        while n >= cuts[j + 1] and (n == 0 or pages[order[n - 1]] != pages[i]):  # never cut inside a page
            j += 1
        parts[j].append(i)
    return parts


def merged(found: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[int, float]]:
    """The stores' answers merged as the router merges them: (id, score) of the K best."""
    ids, scores = best_text_hits(found, K)
    return list(zip(ids.tolist(), scores.tolist()))


def quality(rankings: list[list[tuple[int, float]]], answers: list[set], reference: list[list[tuple[int, float]]]):
    found = rr = keep = same = 0.0
    for ranked, good, ref in zip(rankings, answers, reference):
        ids = [d for d, _ in ranked]
        ranks = [r for r, d in enumerate(ids, 1) if d in good]
        found += bool(ranks)
        rr += 1 / ranks[0] if ranks else 0.0
        keep += len(set(ids) & {d for d, _ in ref}) / len(ref) if ref else float(not ids)
        same += len(ranked) == len(ref) and all(a == b and abs(x - y) <= 1e-9 * abs(y) + 1e-12
                                                 for (a, x), (b, y) in zip(ranked, ref))
    n = len(rankings)
    return {f"answered@{K}": round(found / n, 4), f"mrr@{K}": round(rr / n, 4),
            "top10_kept": round(keep / n, 4), "rankings_equal": round(same / n, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, nargs="+", default=[3, 8])
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "sharded_text")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    texts, questions = load(SOURCE)
    pages = pages_of(texts)
    qs = sorted(q for q in questions if half(q) == 1)
    answers = [set(questions[q]) for q in qs]
    one = make_store(args.work / "one.db", texts, list(range(len(texts))))
    t = time.perf_counter()
    reference = [merged([one.text_search(q, K)]) for q in qs]
    one_ms = 1000 * (time.perf_counter() - t) / len(qs)
    rows = [{"split": "one store", "shards": 1, "stats": "own", **quality(reference, answers, reference),
             "ms_per_query": round(one_ms, 3)}]
    for s in args.shards:
        for how in ("topic", "random"):
            stores = [make_store(args.work / f"{how}-{s}-{j}.db", texts, part)
                      for j, part in enumerate(split(texts, pages, s, how))]
            t = time.perf_counter()
            local = [merged([st.text_search(q, K) for st in stores]) for q in qs]
            local_ms = 1000 * (time.perf_counter() - t) / len(qs)
            t = time.perf_counter()
            glob = []
            for q in qs:
                docs, tokens, hits = sum_text_stats([st.text_stats([q]) for st in stores], 1)
                glob.append(merged([st.global_bm25(q, K, None, docs, tokens, hits[0]) for st in stores]))
            global_ms = 1000 * (time.perf_counter() - t) / len(qs)
            for name, ranked, ms in (("own", local, local_ms), ("collection's", glob, global_ms)):
                rows.append({"split": how, "shards": s, "stats": name, **quality(ranked, answers, reference),
                             "ms_per_query": round(ms, 3)})
            for st in stores:
                st.close()
            print(rows[-2], rows[-1], flush=True)
    one.close()
    out = {"machine": f"{platform.machine()} {platform.node()}", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "data": f"{len(texts)} unique paragraphs, {len(qs)} questions (report half)", "rows": rows}
    res = results("sharded")
    (res / "sharded_text.json").write_text(json.dumps(out, indent=1))
    cols = list(rows[0])
    md = [f"# Text search over shards: own vs collection statistics ({out['when']})", "",
          f"Machine: {platform.machine()} 2-core VM, one thread. {out['data']}. `bench/sharded/sharded_text.py`.", "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    (res / "sharded_text.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
