"""Hybrid search vs vector search vs BM25 on the Python 3.11 docs, with questions that share rare words
with their answers.

The labelled set comes from the docs' own headings: every section whose heading names one section of
one page (2,800 of them) gives a question, the heading itself ("Can I end a raw string with an odd
number of backslashes?", "Certificate chains", "PEP 353: Using ssize_t as the index type"), and its
answers are that section's paragraphs. A question is answered at k when one of them is in the top k.

The questions are split in two halves by a hash of their text: the defaults (text weight, depth) are
chosen on the first half (`--sweep`), and the figures reported on the second.

    python -m bench.service.hybrid [--work bench/work/hybrid] [--sweep]

Writes bench/results/service/hybrid.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


from fusionrag.retriever.collection import DEFAULT_TEXT_WEIGHT, HYBRID_DEPTH
from fusionrag.retriever.collection import api as collection_module  # where searches read HYBRID_DEPTH

from bench.harness.headings import K, MODEL, ROOT, SOURCE, build, half, load  # noqa: F401  (the labelled set)
from bench.harness.paths import results


def evaluate(col, qvecs, questions: list[str], answers: list[set], mode: str, **kw) -> dict:
    t = time.perf_counter()
    res = col.search(None if mode == "text" else qvecs, K, texts=None if mode == "vector" else questions,
                     mode=mode, **kw)
    seconds = time.perf_counter() - t
    found, rr = 0, 0.0
    for hits, good in zip(res.hits, answers):
        ranks = [r for r, h in enumerate(hits, 1) if int(h.id) in good]
        found += bool(ranks)
        rr += 1 / ranks[0] if ranks else 0.0
    n = len(questions)
    return {"mode": mode, **kw, f"answered@{K}": round(found / n, 4), f"mrr@{K}": round(rr / n, 4),
            "ms_per_query": round(1000 * seconds / n, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "hybrid")
    ap.add_argument("--sweep", action="store_true", help="sweep text weight and depth on the tuning half")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    texts, questions = load(SOURCE)
    catalog, col, embedder = build(args.work, texts)
    out = {"data": f"{len(texts)} unique Python 3.11 docs paragraphs, {len(questions)} heading questions",
           "model": MODEL, "k": K}
    try:
        for part, name in ((0, "tune"), (1, "report")):
            qs = sorted(q for q in questions if half(q) == part)
            answers = [set(questions[q]) for q in qs]
            qvecs = embedder.embed(qs)
            rows = [evaluate(col, qvecs, qs, answers, "vector"), evaluate(col, qvecs, qs, answers, "text")]
            if name == "tune" and args.sweep:
                for depth in (10, 20, 50, 100):
                    collection_module.HYBRID_DEPTH = depth
                    for w in (0.3, 0.4, 0.5, 0.6, 0.7):
                        rows.append({"depth": depth, **evaluate(col, qvecs, qs, answers, "hybrid", text_weight=w)})
                collection_module.HYBRID_DEPTH = HYBRID_DEPTH
            rows.append({"depth": HYBRID_DEPTH, **evaluate(col, qvecs, qs, answers, "hybrid",
                                                           text_weight=DEFAULT_TEXT_WEIGHT)})
            out[name] = {"questions": len(qs), "rows": rows}
            print(f"\n{name} half: {len(qs)} questions")
            for r in rows:
                print("  " + "  ".join(f"{k}={v}" for k, v in r.items()))
    finally:
        catalog.close()
    results("service").mkdir(exist_ok=True)
    (results("service") / "hybrid.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
