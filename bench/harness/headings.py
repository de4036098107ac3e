"""The labelled set of the hybrid-search studies: questions from the Python 3.11 docs' own headings, whose answers
are that section's paragraphs (bench/service/hybrid.py says how it is made), split in two halves by a hash of the
question, and the collection of its paragraphs (embedded once under WORK/hybrid)."""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import BENCH, ROOT as REPO

ROOT = BENCH  # bench/: its work folder is ROOT / "work"
SOURCE = REPO.parent / "shared" / "data" / "python311-docs-paragraphs" / "paragraphs.jsonl.gz"
MODEL = "all-MiniLM-L6-v2"
K = 10


def load(path: Path):
    """Unique paragraph texts, and the questions: heading -> the indices of its section's paragraphs."""
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    texts = list(dict.fromkeys(r["text"] for r in rows))
    index = {t: i for i, t in enumerate(texts)}
    sections = collections.defaultdict(set)
    pages = collections.defaultdict(set)
    for r in rows:
        sections[(r["doc"], r["section"])].add(index[r["text"]])
        pages[r["section"]].add(r["doc"])
    questions = {}
    for (doc, heading), members in sections.items():
        q = re.sub(r"^[\d.]+\s+", "", heading).strip()  # "11.8. Decimal ..." -> "Decimal ..."
        if len(pages[heading]) == 1 and len(members) <= 15 and len(q) >= 4:
            questions[q] = sorted(members)
    return texts, questions


def half(question: str) -> int:
    return hashlib.sha256(question.encode()).digest()[0] & 1


def build(work: Path, texts: list[str]):
    from fusionrag.retriever.collection import Catalog, Document
    from fusionrag.retriever.collection.embedding import get_embedder

    embedder = get_embedder(MODEL)
    emb_path = work / "paragraphs.npy"
    if not emb_path.exists():
        t = time.perf_counter()
        emb = np.concatenate([embedder.embed(texts[s:s + 512]) for s in range(0, len(texts), 512)])
        np.save(emb_path, emb.astype(np.float32))
        print(f"embedded {len(texts)} paragraphs in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    catalog = Catalog(work / "data")
    if "docs" not in catalog.names():
        emb = np.load(emb_path)
        col = catalog.create("docs", emb.shape[1], "cosine", embedder.name)
        for s in range(0, len(texts), 2000):
            col.upsert([Document(str(i), texts[i], emb[i]) for i in range(s, min(s + 2000, len(texts)))])
        col.merge()
    return catalog, catalog.get("docs"), embedder
