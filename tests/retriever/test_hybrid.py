"""Full-text and hybrid search: BM25 over the documents' texts (SQLite FTS5 in the doc store), fused with
the vector ranking by reciprocal rank; in the engine (through a built index), over HTTP, and in the
LangChain and LlamaIndex stores."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest
from conftest import clustered
from server_util import ServerProcess

from fusionrag.retriever.collection import RRF_K, Catalog, CollectionConfig, Document
from fusionrag.retriever.errors import InputError

DIM = 16
N = 1500
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def text_of(i: int) -> str:
    # Common words everywhere; one rare word per document ("zebra<i>"), and every 100th is about giraffes.
    common = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(4))
    return f"{common} zebra{i}" + (" giraffes graze" if i % 100 == 0 else "")


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """A collection whose documents were folded into a built index (and a few written after it)."""
    root = tmp_path_factory.mktemp("hybrid")
    cat = Catalog(root, collection_config=CollectionConfig(min_index_count=500, background_merge=False))
    col = cat.create("h", DIM, "l2")
    x = clustered(N + 20, DIM, 20, seed=4)
    col.add([Document(f"d{i}", text_of(i), x[i], {"n": i}) for i in range(N)])
    col.merge()
    col.add([Document(f"d{i}", text_of(i), x[i], {"n": i}) for i in range(N, N + 20)])  # the fresh tier
    yield cat, col, x
    cat.close()


def test_text_mode_ranks_by_bm25(indexed):
    _, col, _ = indexed
    res = col.search(k=5, texts=["where is zebra42 in alpha?", "giraffes"], mode="text")
    assert res.hits[0][0].id == "d42" and len(res.hits[0]) == 5  # the rare word first, then common ones
    assert {h.id for h in res.hits[1]} <= {f"d{i}" for i in range(0, N + 20, 100)}
    assert [h.distance for h in res.hits[0]] == sorted(h.distance for h in res.hits[0])
    assert col.search(k=3, texts=["zebra1510"], mode="text").hits[0][0].id == "d1510"  # written after the merge
    filtered = col.search(k=3, texts=["zebra42 alpha"], mode="text", filter={"n": {"$gte": 100}}).hits[0]
    assert len(filtered) == 3 and all(h.metadata["n"] >= 100 for h in filtered)
    assert col.search(k=3, texts=["??? ..."], mode="text").hits == [[]]  # no words: nothing matches


def test_hybrid_finds_what_either_ranking_finds(indexed):
    _, col, x = indexed
    rng = np.random.default_rng(1)
    q = (x[7] + 0.01 * rng.standard_normal(DIM)).astype(np.float32)[None]
    vector = col.search(q, k=10)
    assert vector.hits[0][0].id == "d7" and "d1234" not in {h.id for h in vector.hits[0]}
    res = col.search(q, k=10, texts=["zebra1234"], mode="hybrid")
    ids = [h.id for h in res.hits[0]]
    assert "d7" in ids and "d1234" in ids
    assert res.stats[0]["lists_probed"] > 0 and res.stats[0]["text_candidates"] >= 1  # the index path ran
    scores = [h.score for h in res.hits[0]]
    assert scores == sorted(scores, reverse=True) and max(scores) <= 1 / (RRF_K + 1) + 1e-12
    # distances are the exact vector distances, also for a hit the vector ranking did not find
    exact = {f"d{i}": float(((x[i] - q[0]) ** 2).sum()) for i in range(N + 20)}
    for h in res.hits[0]:
        assert h.distance == pytest.approx(exact[h.id], rel=1e-4, abs=1e-4)
    # The weight moves the fusion from one ranking to the other.
    all_vector = col.search(q, k=10, texts=["zebra1234"], mode="hybrid", text_weight=0.0)
    assert [h.id for h in all_vector.hits[0]] == [h.id for h in vector.hits[0]]
    all_text = col.search(q, k=10, texts=["zebra1234"], mode="hybrid", text_weight=1.0)
    assert all_text.hits[0][0].id == "d1234"


def test_text_follows_writes_and_deletes(tmp_path):
    cat = Catalog(tmp_path)
    col = cat.create("c", DIM, "cosine")
    x = clustered(20, DIM, 3)
    col.add([Document(f"d{i}", text_of(i), x[i]) for i in range(20)])
    assert col.search(k=1, texts=["zebra3"], mode="text").hits[0][0].id == "d3"
    col.upsert([Document("d3", "now about okapis", x[3])])  # replaced: the old words are gone
    assert col.search(k=1, texts=["zebra3"], mode="text").hits == [[]]
    assert col.search(k=1, texts=["okapi"], mode="text").hits[0][0].id == "d3"  # stemmed: okapis ~ okapi
    col.delete(["d3"])
    assert col.search(k=1, texts=["okapis"], mode="text").hits == [[]]
    col.upsert([Document("v", None, x[0])])  # a document without text is only found by its vector
    assert col.search(x[0], k=1).hits[0][0].id in ("v", "d0")
    cat.close()


def test_a_store_from_before_full_text_is_indexed_on_open(tmp_path):
    cat = Catalog(tmp_path)
    col = cat.create("c", DIM, "l2")
    x = clustered(10, DIM, 2)
    col.add([Document(f"d{i}", text_of(i), x[i]) for i in range(10)])
    cat.close()
    con = sqlite3.connect(tmp_path / "collections" / "c" / "docs.sqlite")  # as a store of the last version was
    con.executescript("DROP TRIGGER docs_fts_insert; DROP TRIGGER docs_fts_delete; DROP TABLE docs_fts;")
    con.close()
    cat = Catalog(tmp_path)
    assert cat.get("c").search(k=1, texts=["zebra6"], mode="text").hits[0][0].id == "d6"
    cat.close()


def test_bad_modes_are_refused(indexed):
    _, col, x = indexed
    cases = [
        (dict(vectors=x[:1], mode="fuzzy"), "mode must be one of"),
        (dict(vectors=x[:1], texts=["a"], mode="text"), "texts alone"),
        (dict(vectors=x[:2], texts=["a"], mode="hybrid"), "one text per query vector"),
        (dict(vectors=x[:1], mode="hybrid"), "needs texts"),
        (dict(vectors=x[:1], texts=["a"], mode="hybrid", text_weight=1.5), "text_weight"),
        (dict(texts="zebra", mode="text"), "needs texts"),
    ]
    for kwargs, words in cases:
        with pytest.raises(InputError, match=words):
            col.search(k=3, **kwargs)


def test_http_text_and_hybrid_modes(tmp_path):
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo")
    x = clustered(40, DIM, 4)
    try:
        srv.wait_ready()
        with srv.client() as c:
            assert c.post("/v1/collections", json={"name": "h", "dimension": DIM, "metric": "l2"}).status_code == 201
            docs = [{"id": f"d{i}", "text": text_of(i), "vector": x[i].tolist()} for i in range(40)]
            assert c.post("/v1/collections/h/documents", json={"documents": docs}).status_code == 200
            r = c.post("/v1/collections/h/search", json={"texts": ["zebra17"], "mode": "text", "k": 2, "stats": True})
            assert r.status_code == 200 and r.json()["results"][0][0]["id"] == "d17", r.text
            assert r.json()["stats"][0]["text_candidates"] >= 1
            r = c.post("/v1/collections/h/search", json={"vectors": [x[3].tolist()], "texts": ["zebra17"],
                                                         "mode": "hybrid", "k": 5})
            assert r.status_code == 200 and {"d3", "d17"} <= {h["id"] for h in r.json()["results"][0]}, r.text
            for body, status, words in [
                ({"texts": ["zebra17"], "mode": "hybrid"}, 422, "no embedding model"),  # texts alone need a model
                ({"vectors": [x[3].tolist()], "texts": ["a"], "mode": "text"}, 422, "no 'vectors'"),
                ({"vectors": [x[3].tolist()] * 2, "texts": ["a"], "mode": "hybrid"}, 422, "one text per query"),
                ({"vectors": [x[3].tolist()], "mode": "hybrid"}, 422, "needs 'texts'"),
                ({"texts": ["a"], "mode": "text", "text_weight": 2}, 422, "text_weight"),
            ]:
                r = c.post("/v1/collections/h/search", json=body)
                assert r.status_code == status and words in r.text, (body, r.text)
    finally:
        srv.stop()


# -- the stores ------------------------------------------------------------------------------------

class WordEmbeddings:
    """A deterministic embedding that knows nothing of rare words: a text maps to the vector of its first
    word, one of WORDS ("alpha" for any other)."""

    def __init__(self):
        self.table = {w: np.random.default_rng(j).standard_normal(DIM).astype(np.float32)
                      for j, w in enumerate(WORDS)}

    def __call__(self, text: str) -> list[float]:
        return self.table.get(text.split()[0], self.table["alpha"]).tolist()


# Its vector is that of the documents starting with "alpha" (d0, d8, ...); its words match d777 alone. So the
# vector ranking misses d777, the text ranking has it first, and fused with the text ranking weighted 0.7 (tied
# at 0.5: each is first in one ranking) it comes first.
QUERY, TARGET = "unknown zebra777", "d777"


@pytest.fixture
def many_texts():
    return [text_of(i) for i in range(1100)]


def _force_index(store_backend) -> None:
    col = store_backend._collection()
    col.merge()
    assert col.info()["build_state"]["indexed"] >= 1000


def _lc_words():
    """WordEmbeddings as LangChain's Embeddings."""
    from langchain_core.embeddings import Embeddings

    words = WordEmbeddings()

    class LCWords(Embeddings):
        def embed_documents(self, texts):
            return [words(t) for t in texts]

        def embed_query(self, text):
            return words(text)

    return LCWords()


def test_langchain_hybrid_search_and_retriever(tmp_path, many_texts):
    from fusionrag.integrations.langchain import FusionRAGVectorStore

    store = FusionRAGVectorStore(embedding=_lc_words(), path=tmp_path, collection="lc", metric="l2")
    try:
        store.add_texts(many_texts, ids=[f"d{i}" for i in range(len(many_texts))])
        _force_index(store._backend)
        assert TARGET not in {d.id for d in store.similarity_search(QUERY, k=4)}
        assert store.hybrid_search(QUERY, k=4, text_weight=0.7)[0].id == TARGET
        assert store.hybrid_search(QUERY, k=4, text_weight=0.3)[0].id != TARGET
        scored = store.hybrid_search_with_score(QUERY, k=4)
        assert [s for _, s in scored] == sorted((s for _, s in scored), reverse=True)
        assert TARGET in {d.id for d, _ in scored}
        retriever = store.as_retriever(search_type="hybrid", search_kwargs={"k": 3, "text_weight": 0.7})
        assert retriever.invoke(QUERY)[0].id == TARGET
        assert store.search(QUERY, "hybrid", k=2, text_weight=0.7)[0].id == TARGET
        assert TARGET not in {d.id for d in store.as_retriever(search_kwargs={"k": 3}).invoke(QUERY)}
    finally:
        store.close()


async def test_langchain_hybrid_async_remote(tmp_path, many_texts):
    from fusionrag.integrations.langchain import FusionRAGVectorStore
    from integration_helpers import API_KEY, running_service

    with running_service(tmp_path, min_index_count=500) as url:
        store = FusionRAGVectorStore(embedding=_lc_words(), url=url, api_key=API_KEY, collection="lc", metric="l2")
        try:
            await store.aadd_texts(many_texts[:600], ids=[f"d{i}" for i in range(600)])
            query, target = "unknown zebra333", "d333"
            assert target not in {d.id for d in await store.asimilarity_search(query, k=3)}
            assert (await store.ahybrid_search(query, k=3, text_weight=0.7))[0].id == target
            retriever = store.as_retriever(search_type="hybrid", search_kwargs={"k": 2, "text_weight": 0.7})
            assert (await retriever.ainvoke(query))[0].id == target
        finally:
            store.close()


def test_llamaindex_hybrid_and_text_modes(tmp_path, many_texts):
    from llama_index.core.schema import TextNode
    from llama_index.core.vector_stores.types import VectorStoreQuery, VectorStoreQueryMode

    from fusionrag.integrations.llamaindex import FusionRAGVectorStore

    words = WordEmbeddings()
    store = FusionRAGVectorStore(path=tmp_path, collection="li", metric="l2")
    try:
        store.add([TextNode(id_=f"d{i}", text=t, embedding=words(t)) for i, t in enumerate(many_texts)])
        _force_index(store._backend)
        def run(mode, **kw):
            return store.query(VectorStoreQuery(query_embedding=words(QUERY), query_str=QUERY, similarity_top_k=3,
                                                mode=mode, **kw)).ids

        assert TARGET not in run(VectorStoreQueryMode.DEFAULT)
        assert run(VectorStoreQueryMode.HYBRID, alpha=0.3)[0] == TARGET  # alpha: the dense ranking's weight
        assert TARGET in run(VectorStoreQueryMode.HYBRID)
        assert TARGET not in run(VectorStoreQueryMode.HYBRID, alpha=1.0)  # the dense ranking alone
        assert run(VectorStoreQueryMode.TEXT_SEARCH) == [TARGET]
        with pytest.raises(InputError, match="not supported"):
            run(VectorStoreQueryMode.MMR)
    finally:
        store.close()


def _separate(col, q, text, depth):
    """The two rankings hybrid search fuses, asked separately: (ids, distances) by vector, (ids, bm25) by text."""
    v = col.search(q, k=depth).hits[0]
    t = col.search(k=depth, texts=[text], mode="text").hits[0]
    return [h.id for h in v], [h.distance for h in v], [h.id for h in t], [h.distance for h in t]


def test_fusion_by_reciprocal_rank_with_its_k_and_by_weighted_normalised_scores(indexed):
    """Each fused score computed here from the two rankings asked alone, for rrf at two k and for weighted."""
    from fusionrag.retriever.collection.config import HYBRID_DEPTH

    _, col, x = indexed
    q = (x[1507] + 0.05).astype(np.float32)[None]  # near a document of the fresh tier: both tiers rank
    text = "zebra1234 giraffes"
    vid, vd, tid, td = _separate(col, q, text, HYBRID_DEPTH)
    assert any(int(i[1:]) >= N for i in vid) and any(int(i[1:]) < N for i in vid)
    for k in (1, 60):
        want = {}
        for rank, i in enumerate(vid, 1):
            want[i] = 0.7 / (k + rank)
        for rank, i in enumerate(tid, 1):
            want[i] = want.get(i, 0.0) + 0.3 / (k + rank)
        got = col.search(q, k=10, texts=[text], mode="hybrid", text_weight=0.3, fusion={"method": "rrf", "k": k})
        top = sorted(want.items(), key=lambda t: -t[1])[:10]
        assert [h.score for h in got.hits[0]] == pytest.approx([s for _, s in top], rel=1e-9)
        assert {h.id for h in got.hits[0]} == {i for i, _ in top}
    want = {}
    for ids, ds, w in ((vid, vd, 0.6), (tid, td, 0.4)):
        lo, hi = min(ds), max(ds)
        for i, d in zip(ids, ds):
            want[i] = want.get(i, 0.0) + w * ((hi - d) / (hi - lo) if hi > lo else 1.0)
    got = col.search(q, k=10, texts=[text], mode="hybrid", text_weight=0.4, fusion={"method": "weighted"})
    top = sorted(want.items(), key=lambda t: -t[1])[:10]
    assert [h.score for h in got.hits[0]] == pytest.approx([s for _, s in top], rel=1e-6, abs=1e-9)
    assert got.hits[0][0].id == top[0][0] and max(h.score for h in got.hits[0]) <= 1 + 1e-9
    for bad in ({"method": "borda"}, {"method": "rrf", "k": 0}, {"k": 60, "extra": 1}, "rrf"):
        with pytest.raises(InputError):
            col.search(q, k=10, texts=[text], mode="hybrid", fusion=bad)


def test_hybrid_ranks_the_vector_hits_of_both_tiers_by_distance(indexed):
    """With the text's weight 0 the fused order is the vector ranking, whichever tier each hit came from (the
    rows of the index and of the fresh tier arrive unsorted)."""
    _, col, x = indexed
    rng = np.random.default_rng(3)
    for i in (1501, 1510, 1519):
        q = (x[i] + 0.3 * rng.standard_normal(DIM)).astype(np.float32)[None]
        vector = [h.id for h in col.search(q, k=10).hits[0]]
        assert any(int(v[1:]) >= N for v in vector) and any(int(v[1:]) < N for v in vector)
        for fusion in ({"method": "rrf"}, {"method": "weighted"}):
            fused = col.search(q, k=10, texts=["alpha"], mode="hybrid", text_weight=0.0, fusion=fusion)
            assert [h.id for h in fused.hits[0]] == vector, fusion


def test_a_collection_text_analyzer_stemming_and_stop_words(tmp_path):
    """The analyzer is the collection's, fixed at create, kept across a reopen and a snapshot's restore."""
    cat = Catalog(tmp_path / "data")
    try:
        texts = {"runs": "the engine runs fast", "running": "running late", "the": "the the the", "cat": "a cat"}
        cols = {}
        for name, analyzer in (("english", None), ("plain", {"stemming": "none", "stop_words": "none"})):
            c = cat.create(name, 4, "l2", text_analyzer=analyzer)
            c.upsert([Document(k, t, np.full(4, i, np.float32)) for i, (k, t) in enumerate(texts.items())])
            cols[name] = c

        def text_ids(c, query):
            return {h.id for h in c.search(k=10, texts=[query], mode="text").hits[0]}

        assert text_ids(cols["english"], "run") == {"runs", "running"}  # Porter: one stem
        assert text_ids(cols["plain"], "run") == set() and text_ids(cols["plain"], "runs") == {"runs"}
        assert text_ids(cols["english"], "the cat") == {"cat"}  # "the" left out, as a stop word
        assert text_ids(cols["plain"], "the cat") == {"runs", "the", "cat"}
        assert cols["plain"].info()["text_analyzer"] == {"stemming": "none", "stop_words": "none"}
        assert cols["english"].info()["text_analyzer"] == {"stemming": "porter", "stop_words": "english"}
        cols["plain"].snapshot(tmp_path / "plain.tar")
        with pytest.raises(InputError, match="stemming"):
            cat.create("bad", 4, "l2", text_analyzer={"stemming": "snowball"})
        with pytest.raises(InputError, match="analyzer"):
            cat.create("bad", 4, "l2", text_analyzer={"language": "de"})
    finally:
        cat.close()
    cat = Catalog(tmp_path / "data")
    try:
        again = cat.get("plain")
        assert {h.id for h in again.search(k=10, texts=["run"], mode="text").hits[0]} == set()
        with open(tmp_path / "plain.tar", "rb") as f:
            restored = cat.restore("restored", f)
        assert restored.info()["text_analyzer"] == {"stemming": "none", "stop_words": "none"}
        assert {h.id for h in restored.search(k=10, texts=["the cat"], mode="text").hits[0]} == {"runs", "the", "cat"}
    finally:
        cat.close()


def test_fused_hits_pass_over_documents_deleted_since_and_give_exact_distances():
    """collection/fusion.py's fused_hits, which a collection's and a sharded collection's hybrid search share: the
    first k of the fused ranking whose documents are still there (the sharded side cut the ranking at k first and
    then dropped the deleted ones, answering fewer than k), fetched a part at a time, each distance computed here
    from the stored vector."""
    from fusionrag.retriever.collection.fusion import fused_hits

    rng = np.random.default_rng(4)
    vecs = {key: rng.standard_normal(8).astype(np.float32) for key in range(10)}
    gone = {1, 2, 5}  # deleted after the rankings were made
    asked = []

    def fetch(keys):
        asked.append(list(keys))
        return {key: (f"d{key}", f"text {key}", {"n": key}, vecs[key]) for key in keys if key not in gone}

    fused = [(key, 1.0 / (60 + rank)) for rank, key in enumerate([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 1)]
    q = rng.standard_normal(8).astype(np.float32)
    hits = fused_hits(q, fused, 4, fetch, "l2", with_vectors=False)
    assert [h.id for h in hits] == ["d0", "d3", "d4", "d6"]  # four, in the fused order, the deleted passed over
    assert asked == [[0, 1, 2, 3], [4, 5], [6]]  # the next keys asked only as many as still wanted
    for h, key in zip(hits, (0, 3, 4, 6)):
        assert h.distance == pytest.approx(float(((vecs[key] - q) ** 2).sum()), rel=1e-5)
        assert h.score == dict(fused)[key] and h.vector is None and h.metadata == {"n": key}
    assert len(fused_hits(q, fused, 20, fetch, "l2", with_vectors=True)) == 7  # all that are left
