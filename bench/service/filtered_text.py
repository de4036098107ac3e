"""What a metadata filter costs vector, text and hybrid search (#49, part 1; not a test; runs on any machine).

On the Python 3.11 docs paragraphs (../shared/data/python311-docs-paragraphs: 42,428 paragraphs, each a document
with its page's area as metadata: library, whatsnew, c-api, howto, faq, ...), at 5k and at all of them: vector,
text and hybrid search (k=3) with no filter and with filters passing 1%, 10% and 60% of the documents (a
`bucket` field, the paragraph's number mod 100) and the issue's two, {"area": "library"} (~61%) and
{"area": "faq"} (~2%). Each search is timed in the service's process, around Collection.search (what the search
route runs once the body is parsed): p50 and p99 over the questions and --repeat rounds.

Beside each filtered cell, in the same run, the same searches as they were before #49 (`_AsBefore`):
- the text half's filter as `rowid IN (...)`, which SQLite's planner hands to FTS5 as its driving constraint (one
  full-text lookup per passing document, not a check per match);
- a filter at most filter_exact_max documents pass answered by reading every passing vector from the doc store's
  rows (now: Index.search_among, PQ over their codes in RAM and the best re-ranked from the SSD);
- the filter's rows read from SQLite every time (now: kept until the next commit).
The before cells run --repeat-before rounds (they take up to seconds a query). `hybrid_uncached` is hybrid now
with the filter's rows read from SQLite every time, as the first search after a write pays.

The vectors are random unit vectors of 384 dimensions (the shape of MiniLM's): the vector half costs what it
would, its answers mean nothing; the text half is the real BM25 over the real paragraphs.

    python -m bench.service.filtered_text [--sizes 5000 42428] [--out bench/results/service/filtered_text.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document, docstore
from fusionrag.retriever.collection.fresh import FreshView
from fusionrag.retriever.collection.records import engine_form

from bench.harness.paths import ROOT
SOURCE = ROOT.parent / "shared" / "data" / "python311-docs-paragraphs" / "paragraphs.jsonl.gz"
QUESTIONS = ["run a shell command and capture its output", "how do I read a file line by line",
             "what does the with statement do", "sort a list of dictionaries by a key",
             "how to parse command line arguments", "convert a string to a datetime",
             "why is my thread not running in parallel", "format a float with two decimals",
             "remove duplicates from a list", "read environment variables", "send an http request",
             "measure the time a function takes", "merge two dictionaries", "write a csv file",
             "catch several exceptions at once", "create a temporary directory"]
FILTERS = {"none": None, "1%": {"bucket": 0}, "10%": {"bucket": {"$lt": 10}}, "60%": {"bucket": {"$lt": 60}},
           "area library": {"area": "library"}, "area faq": {"area": "faq"}}
MODES = ("vector", "text", "hybrid")


def paragraphs(limit: int) -> list[dict]:
    out = []
    with gzip.open(SOURCE, "rt") as f:
        for line in f:
            p = json.loads(line)
            out.append({"id": p["id"], "text": p["text"], "area": p["doc"].split("/")[0].removesuffix(".html")})
    step = max(1, len(out) // limit)
    return out[::step][:limit]


def old_text_search(store, text, limit, where=None):
    """docstore.DocStore.text_search as it was before the filter stopped driving FTS5."""
    terms = docstore.query_words(text)
    if not terms:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    match = " OR ".join(docstore._phrase(t) for t in terms)
    sql = "SELECT rowid, bm25(docs_fts) AS s FROM docs_fts WHERE docs_fts MATCH ?"
    params = [match]
    if where is not None:
        sql += f" AND rowid IN (SELECT row FROM ({where[0]}))"
        params += where[1]
    with store._reader() as con:
        found = con.execute(sql + " ORDER BY s LIMIT ?", params + [int(limit)]).fetchall()
    return np.asarray([r for r, _ in found], np.int64), np.asarray([s for _, s in found], np.float64)


def old_rows_where(store, query, params, con=None):
    """rows_where as it was: read from SQLite on every call (a connection given reads through it, as now)."""
    import contextlib

    with contextlib.nullcontext(con) if con is not None else store._reader() as c:
        (text,) = c.execute(f"SELECT group_concat(row) FROM ({query})", params).fetchone()
    rows = np.sort(np.fromstring(text or "", dtype=np.int64, sep=","))
    return rows[np.concatenate([[True], rows[1:] != rows[:-1]])] if len(rows) else rows


class _AsBefore:
    """The collection's search as it was before #49: the old text query, the filter's rows read every time, and a
    filter at most filter_exact_max documents pass answered exactly over vectors read from the doc store."""

    def __init__(self, col):
        self.col = col

    def _search(self, snap, q, k, where, params):
        col = self.col
        if where is not None and len(col.store.rows_where(*where)) <= col.config.filter_exact_max:
            rows, vecs = col.store.vectors_where(*where)
            nq = len(q)
            stats = [{"filtered_exact": True} for _ in range(nq)]
            if len(rows) == 0:
                return np.full((nq, 0), -1, np.int64), np.empty((nq, 0), np.float32), stats
            view = FreshView(x := engine_form(vecs, col.metric), (x * x).sum(1), rows, np.ones(len(rows), bool))
            return (*view.search(q.vectors, k, col.metric), stats)
        return self.new_search(snap, q, k, where, params)

    def __enter__(self):
        col, store = self.col, self.col.store
        store.text_search = lambda text, limit, w=None: old_text_search(store, text, limit, w)
        store.rows_where = lambda query, params, con=None: old_rows_where(store, query, params, con)
        self.new_search = col._search
        col._search = self._search
        return self

    def __exit__(self, *exc):
        del self.col.store.text_search, self.col.store.rows_where, self.col._search


def latencies(col, queries, flt, mode, repeat: int) -> list[float]:
    """Seconds of each search: every question (with its query vector) once a round, after one warm-up round."""
    out = []
    for r in range(repeat + 1):
        for text, q in zip(QUESTIONS, queries):
            kw = {"vector": dict(vectors=q[None]), "text": dict(texts=[text]),
                  "hybrid": dict(vectors=q[None], texts=[text])}[mode]
            t = time.perf_counter()
            col.search(k=3, filter=flt, mode=mode, **kw)
            if r:
                out.append(time.perf_counter() - t)
    return out


def summary(seconds: list[float]) -> dict:
    ms = 1000 * np.asarray(seconds)
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "n": len(ms)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[5000, 42428])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--repeat-before", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    from fusionrag.retriever.collection.filters import compile_filter

    rows = []
    rng = np.random.default_rng(0)
    for size in args.sizes:
        docs = paragraphs(size)
        with tempfile.TemporaryDirectory() as tmp:
            cat = Catalog(tmp, collection_config=CollectionConfig(background_merge=False))
            col = cat.create("docs", 384, "cosine")
            x = rng.standard_normal((len(docs), 384)).astype(np.float32)
            for s in range(0, len(docs), 1000):
                col.upsert([Document(d["id"], d["text"], x[s + i], {"area": d["area"], "bucket": (s + i) % 100})
                            for i, d in enumerate(docs[s:s + 1000])])
            col.merge()
            queries = rng.standard_normal((len(QUESTIONS), 384)).astype(np.float32)
            for name, f in FILTERS.items():
                passing = len(col.store.rows_where(*compile_filter(f))) if f else len(docs)
                row = {"documents": len(docs), "filter": name, "passing": passing}
                for mode in MODES:
                    row[mode] = summary(latencies(col, queries, f, mode, args.repeat))
                    if f is not None:
                        with _AsBefore(col):
                            row[mode + "_before"] = summary(latencies(col, queries, f, mode, args.repeat_before))
                if f is not None:  # hybrid now with the filter's rows read from SQLite each time, as after a write
                    store = col.store
                    store.rows_where = lambda query, params, con=None: old_rows_where(store, query, params, con)
                    row["hybrid_uncached"] = summary(latencies(col, queries, f, "hybrid", args.repeat))
                    del store.rows_where
                if f is not None:  # the text query alone, before and now: the same answers
                    where = compile_filter(f)
                    row["text_same_answers"] = all(np.array_equal(old_text_search(col.store, t, 3, where)[0],
                                                                  col.store.text_search(t, 3, where)[0])
                                                   for t in QUESTIONS)
                rows.append(row)
                print(json.dumps(row), flush=True)
            cat.close()
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "questions": len(QUESTIONS), "k": 3,
              "repeat": args.repeat, "repeat_before": args.repeat_before,
              "timed": "Collection.search in the service's process, per query", "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
