"""Which text analyzer and which fusion make hybrid search beat vector search (#49, part 2; a study, not a test).

On bench/service/hybrid.py's labelled set (the Python 3.11 docs' headings as questions, their sections' paragraphs as
answers, split in halves by a hash of the question), with its collection (all-MiniLM-L6-v2, bench/work/hybrid):

- the text ranking under three stop-word lists: Lucene's English ones (the engine's today), those plus the
  words of questions ("how", "do", "I", "what", "does", ...), and none; and under two tokenizers: Porter
  stemming (the engine's today) and none (a second FTS5 table over the same texts, in a scratch SQLite file);
- fusion of the vector ranking with each text ranking: reciprocal rank (k 10, 30, 60, 100; text weight 0.3-0.7)
  and weighted normalised scores (each ranking's scores min-max normalised over its depth; weight 0.3-0.7), the
  rankings taken 20 and 50 deep.

Every variant is scored on the tuning half (answered@10, then MRR@10); the best is then reported on the other
half beside vector alone, text alone and today's hybrid. Nothing here changes the engine: the analyzer and the
fusion the study chooses become its defaults in a later change.

    python -m bench.service.hybrid_analyzer [--work bench/work/hybrid] [--out bench/results/service/hybrid_analyzer.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sqlite3
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness import headings  # the labelled set and its collection (bench/service/hybrid.py says how)

from fusionrag.retriever.collection import docstore  # noqa: E402
from bench.harness.paths import WORK, results

K = 10
# Words of English questions that Lucene's list keeps: asked in nearly every question, they rank FAQ titles
# ("How do I ...") over the paragraphs that answer.
QUESTION_WORDS = frozenset(
    "how what why when where which who whom whose do does did doing done i me my we our you your can could should "
    "would may might must shall have has had having get gets got use using used way ways am been being "
    "about from any some".split())
STOP_LISTS = {"lucene": docstore.STOP_WORDS, "lucene+questions": docstore.STOP_WORDS | QUESTION_WORDS,
              "none": frozenset()}


def words(text: str, stop: frozenset) -> list[str]:
    found = list(dict.fromkeys(docstore._TERM.findall(text.lower())))
    return ([w for w in found if w not in stop] or found)[:docstore.MAX_TEXT_TERMS]


class TextIndex:
    """The paragraphs in an FTS5 table of a scratch file, with a tokenizer; BM25 rankings of queries."""

    def __init__(self, path: Path, texts: list[str], tokenize: str):
        fresh = not path.exists()
        self.con = sqlite3.connect(path)
        if fresh:
            self.con.execute(f"CREATE VIRTUAL TABLE t USING fts5(text, tokenize='{tokenize}')")
            self.con.executemany("INSERT INTO t (rowid, text) VALUES (?, ?)", enumerate(texts))
            self.con.commit()

    def rank(self, query: str, stop: frozenset, depth: int) -> tuple[list[int], list[float]]:
        terms = words(query, stop)
        if not terms:
            return [], []
        match = " OR ".join(docstore._phrase(t) for t in terms)
        rows = self.con.execute("SELECT rowid, bm25(t) FROM t WHERE t MATCH ? ORDER BY 2 LIMIT ?",
                                (match, depth)).fetchall()
        return [r for r, _ in rows], [-s for _, s in rows]  # higher is better


def rrf(vec: list[int], text: list[int], w: float, k: int) -> list[int]:
    score: dict = {}
    for rank, r in enumerate(vec, 1):
        score[r] = (1 - w) / (k + rank)
    for rank, r in enumerate(text, 1):
        score[r] = score.get(r, 0.0) + w / (k + rank)
    return [r for r, _ in sorted(score.items(), key=lambda item: -item[1])]


def weighted(vec: list[int], vec_s: list[float], text: list[int], text_s: list[float], w: float) -> list[int]:
    def norm(s):
        s = np.asarray(s, np.float64)
        return (s - s.min()) / (s.max() - s.min()) if len(s) and s.max() > s.min() else np.ones(len(s))
    score: dict = {}
    for r, s in zip(vec, norm(vec_s)):
        score[r] = (1 - w) * s
    for r, s in zip(text, norm(text_s)):
        score[r] = score.get(r, 0.0) + w * s
    return [r for r, _ in sorted(score.items(), key=lambda item: -item[1])]


def score(rankings: list[list[int]], answers: list[set]) -> dict:
    found, rr = 0, 0.0
    for ranked, good in zip(rankings, answers):
        ranks = [i for i, r in enumerate(ranked[:K], 1) if r in good]
        found += bool(ranks)
        rr += 1 / ranks[0] if ranks else 0.0
    return {f"answered@{K}": round(found / len(answers), 4), f"mrr@{K}": round(rr / len(answers), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=WORK / "hybrid")
    ap.add_argument("--out", type=Path, default=results("service") / "hybrid_analyzer.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    texts, questions = headings.load(headings.SOURCE)
    catalog, col, embedder = headings.build(args.work, texts)
    indexes = {"porter": TextIndex(args.work / "fts-porter.sqlite", texts, "porter unicode61"),
               "none": TextIndex(args.work / "fts-plain.sqlite", texts, "unicode61")}
    halves = {}
    try:
        for part, name in ((0, "tune"), (1, "report")):
            qs = sorted(q for q in questions if headings.half(q) == part)
            answers = [set(questions[q]) for q in qs]
            qvecs = embedder.embed(qs)
            res = col.search(qvecs, 100)  # the vector ranking, 100 deep: each fusion takes its depth of it
            vec = [[int(h.id) for h in hits] for hits in res.hits]
            vec_s = [[h.score for h in hits] for hits in res.hits]
            text = {(tok, stop): [indexes[tok].rank(q, STOP_LISTS[stop], 100) for q in qs]
                    for tok in indexes for stop in STOP_LISTS}
            halves[name] = (qs, answers, vec, vec_s, text)
        qs, answers, vec, vec_s, text = halves["tune"]
        variants = []
        t = time.perf_counter()
        for (tok, stop), ranked in text.items():
            variants.append({"mode": "text", "tokenizer": tok, "stop_words": stop,
                             **score([r for r, _ in ranked], answers)})
            for depth in (20, 50):
                for k, w in itertools.product((10, 30, 60, 100), (0.3, 0.4, 0.5, 0.6, 0.7)):
                    fused = [rrf(v[:depth], r[:depth], w, k) for v, (r, _) in zip(vec, ranked)]
                    variants.append({"mode": "hybrid", "tokenizer": tok, "stop_words": stop, "fusion": "rrf",
                                     "rrf_k": k, "text_weight": w, "depth": depth, **score(fused, answers)})
                for w in (0.3, 0.4, 0.5, 0.6, 0.7):
                    fused = [weighted(v[:depth], vs[:depth], r[:depth], s[:depth], w)
                             for v, vs, (r, s) in zip(vec, vec_s, ranked)]
                    variants.append({"mode": "hybrid", "tokenizer": tok, "stop_words": stop, "fusion": "weighted",
                                     "text_weight": w, "depth": depth, **score(fused, answers)})
        key = lambda v: (v[f"answered@{K}"], v[f"mrr@{K}"])  # noqa: E731
        best = max((v for v in variants if v["mode"] == "hybrid"), key=key)
        best_text = max((v for v in variants if v["mode"] == "text"), key=key)
        print(f"{len(variants)} variants on the tuning half in {time.perf_counter() - t:.0f} s; best {best}",
              file=sys.stderr)
        today = next(v for v in variants if v["mode"] == "hybrid" and v["tokenizer"] == "porter"
                     and v["stop_words"] == "lucene" and v["fusion"] == "rrf" and v["rrf_k"] == 60
                     and v["text_weight"] == 0.5 and v["depth"] == 20)
        qs, answers, vec, vec_s, text = halves["report"]

        def again(v: dict) -> dict:
            ranked = text[(v["tokenizer"], v["stop_words"])]
            if v["mode"] == "text":
                return score([r for r, _ in ranked], answers)
            d = v["depth"]
            if v["fusion"] == "rrf":
                return score([rrf(a[:d], r[:d], v["text_weight"], v["rrf_k"]) for a, (r, _) in zip(vec, ranked)],
                             answers)
            return score([weighted(a[:d], s_[:d], r[:d], s[:d], v["text_weight"])
                          for a, s_, (r, s) in zip(vec, vec_s, ranked)], answers)

        report = {"vector": score(vec, answers),
                  "text, today (porter, lucene)": again(next(v for v in variants if v["mode"] == "text" and
                                                             v["tokenizer"] == "porter" and
                                                             v["stop_words"] == "lucene")),
                  "text, chosen": {**{k: best_text[k] for k in ("tokenizer", "stop_words")}, **again(best_text)},
                  "hybrid, today": {**{k: today[k] for k in ("tokenizer", "stop_words", "fusion", "rrf_k",
                                                              "text_weight", "depth")}, **again(today)},
                  "hybrid, chosen": {**{k: best[k] for k in best if not k.endswith(f"@{K}") and k != "mode"},
                                     **again(best)}}
        out = {"data": f"{len(texts)} unique Python 3.11 docs paragraphs, {len(questions)} heading questions",
               "model": headings.MODEL, "k": K, "tune_questions": len(halves["tune"][0]),
               "report_questions": len(qs), "question_words": sorted(QUESTION_WORDS),
               "chosen_on_tune": {"hybrid": best, "text": best_text}, "report": report,
               "tune_variants": sorted(variants, key=key, reverse=True)}
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(report, indent=1))
    finally:
        catalog.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
