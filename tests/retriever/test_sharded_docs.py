"""Documents in sharded mode (retriever/sharded_docs.py): string ids, texts, metadata and filters over a sharded
index, shards in this process. Answers are checked against exact search in numpy over the documents a filter passes
(the filter evaluated here, in Python, not by the engine), and the documents against what was written; they survive
a shard's restart, the router's reopening, and a doc store that lags its shard's log."""

import shutil

import numpy as np
import pytest
from conftest import clustered, sharded_copy

from fusionrag.retriever.collection import Document
from fusionrag.retriever.config import BuildConfig, SearchParams
from fusionrag.retriever.errors import InputError, UnavailableError
from fusionrag.retriever.sharded import NAMED_IDS, ShardedIndex, build_sharded
from fusionrag.retriever.sharded_docs import ShardedCollection, numeric_id
from fusionrag.retriever.sharded_writes import DOCS

N, DIM, K = 3000, 16, 10
CONFIG = BuildConfig(threads=1, centroid_ratio=0.05)
EXHAUSTIVE = SearchParams(rerank=N, beta=0)


@pytest.fixture(scope="module")
def base():
    return clustered(N, DIM, 20, seed=5, spread=0.6)


@pytest.fixture(scope="module")
def built(tmp_path_factory, base):
    path = tmp_path_factory.mktemp("sharded-docs") / "idx"
    build_sharded(base, path, 3, CONFIG, progress=False)
    return path


@pytest.fixture
def coll(built, tmp_path):
    c = sharded_copy(built, tmp_path / "idx")
    yield c
    c.close()


def written(base, n=60, rng_seed=1):
    rng = np.random.default_rng(rng_seed)
    return [Document(f"doc-{i}", f"text of {i}", base[i * 7 % N] + rng.normal(0, 0.05, DIM).astype(np.float32),
                     {"year": 2000 + i % 5, "tag": "ab"[i % 2], "n": i}) for i in range(n)]


def expected(base, docs: list[Document], q: np.ndarray, k: int, passes=None):
    """Exact top-k names by L2 over the written documents that pass `passes` (a Python predicate on their metadata)
    or, with none, over them and the built vectors (which hold no metadata, so no filter passes them)."""
    names, vecs = [], []
    if passes is None:
        names += [str(i) for i in range(N)]
        vecs.append(base)
        passes = lambda m: True  # noqa: E731
    chosen = [d for d in docs if passes(d.metadata)]
    names += [d.id for d in chosen]
    vecs.append(np.stack([d.vector for d in chosen]) if chosen else np.empty((0, DIM), np.float32))
    x = np.concatenate(vecs)
    d = ((q[:, None, :].astype(np.float64) - x[None, :, :]) ** 2).sum(-1)
    order = np.argsort(d, axis=1, kind="stable")[:, :k]
    return [[names[j] for j in row] for row in order], np.take_along_axis(d, order, axis=1)


def test_numeric_names_name_their_ids():
    assert numeric_id("0") == 0 and numeric_id("17") == 17 and numeric_id(str(NAMED_IDS - 1)) == NAMED_IDS - 1
    for name in ("017", "-1", "1.0", "+3", " 3", "a", "", str(NAMED_IDS), "٣", "99999999999999999999"):
        assert numeric_id(name) is None, name


def test_documents_round_trip_and_page_through_every_one(coll, base):
    docs = written(base)
    assert coll.upsert(docs) == [d.id for d in docs]
    coll.upsert([Document("17", "seventeen", base[17] + 0.5, {"year": 1999})])
    assert all(i >= NAMED_IDS for i in coll.index.named.values()) and len(coll.index.named) == len(docs)
    assert len(coll) == N + len(docs) == coll.info()["count"]
    got = coll.get(["doc-3", "17", "5", "nope", "doc-3"], with_vectors=True)
    assert [d.id for d in got] == ["doc-3", "17", "5", "doc-3"]
    assert (got[0].text, got[0].metadata) == ("text of 3", docs[3].metadata)
    np.testing.assert_allclose(got[0].vector, docs[3].vector, rtol=1e-6)
    assert (got[1].text, got[1].metadata) == ("seventeen", {"year": 1999})
    np.testing.assert_allclose(got[1].vector, base[17] + 0.5, rtol=1e-6)
    # A built vector: a document with no text or metadata, its vector read back from the SSD tier.
    assert (got[2].text, got[2].metadata) == (None, {})
    np.testing.assert_allclose(got[2].vector, base[5], rtol=1e-6)
    seen, after = [], -1
    while after is not None:
        page, after = coll.scroll(500, after)
        seen += [d.id for d in page]
    assert len(seen) == len(set(seen)) == len(coll)
    assert set(seen) == {str(i) for i in range(N)} | {d.id for d in docs}
    # Filtered pages: the documents whose metadata passes, each once, in pages of 7.
    seen, after = [], -1
    while after is not None:
        page, after = coll.scroll(7, after, {"tag": "a", "year": {"$gte": 2002}})
        seen += [(d.id, d.text) for d in page]
    want = {(d.id, d.text) for d in docs if d.metadata["tag"] == "a" and d.metadata["year"] >= 2002}
    assert len(seen) == len(want) and set(seen) == want


def test_searches_are_exact_over_the_documents_a_filter_passes(coll, base):
    docs = written(base)
    coll.upsert(docs)
    q = np.stack([docs[i].vector for i in (0, 5, 11)]) + 0.02
    res = coll.search(q, K, params=EXHAUSTIVE)
    names, d = expected(base, docs, q, K)
    assert [[h.id for h in hits] for hits in res.hits] == names
    np.testing.assert_allclose([[h.distance for h in hits] for hits in res.hits], d, rtol=1e-4, atol=1e-4)
    assert res.hits[0][0].text == docs[0].text and res.hits[0][0].score == -res.hits[0][0].distance
    assert all(s["candidates"] > 0 for s in res.stats)  # the built index answered too, not only the fresh tier
    for flt, passes in [({"year": 2003}, lambda m: m.get("year") == 2003),
                        ({"tag": {"$in": ["a"]}, "n": {"$lt": 30}}, lambda m: m.get("tag") == "a" and m["n"] < 30),
                        ({"$or": [{"year": 2001}, {"n": 4}]}, lambda m: m.get("year") == 2001 or m.get("n") == 4),
                        ({"year": 1800}, lambda m: False)]:
        res = coll.search(q, K, filter=flt)
        names, d = expected(base, docs, q, K, passes)
        assert [[h.id for h in hits] for hits in res.hits] == [row[:len(hits)] for row, hits in
                                                               zip(names, res.hits)]
        assert all(len(hits) == min(K, sum(passes(x.metadata) for x in docs)) for hits in res.hits), flt
        assert all(passes(h.metadata) for hits in res.hits for h in hits)
    assert coll.filter_warnings({"year": "2003"})  # compared as a string, held as numbers: said


def test_deletes_by_id_and_by_filter(coll, base):
    docs = written(base)
    coll.upsert(docs)
    assert coll.delete(["doc-1", "doc-2", "unknown", "12"]) == 3
    gone = {d.id for d in docs if d.metadata["year"] == 2004} - {"doc-1", "doc-2"}
    assert coll.delete_where({"year": 2004}) == len(gone)
    assert coll.delete_where({"year": 2004}) == 0
    left = [d for d in docs if d.id not in gone | {"doc-1", "doc-2"}]
    assert len(coll) == N - 1 + len(left)
    assert coll.get([d.id for d in docs] + ["12"]) == coll.get([d.id for d in left])
    q = np.stack([d.vector for d in docs])
    found = {h.id for hits in coll.search(q, K).hits for h in hits}
    assert not found & (gone | {"doc-1", "doc-2", "12"})
    # A name deleted and written again is a document again.
    coll.upsert([Document("doc-1", "back", docs[1].vector, {})])
    assert [d.text for d in coll.get(["doc-1"])] == ["back"]


def test_documents_survive_a_shard_restart_and_the_router_reopening(coll, base, tmp_path):
    docs = written(base)
    coll.upsert(docs)
    ix = coll.index
    holders = ix.fresh_owner[ix.named["doc-4"]]
    for s in holders:
        ix.kill_shard(s)
    ix.check_shards()
    with pytest.raises(UnavailableError):
        coll.get(["doc-4"])
    with pytest.raises(UnavailableError):
        coll.scroll(10)  # a page cannot leave a down shard's documents out
    res = coll.search(docs[4].vector[None], K)
    assert res.partial and set(holders) <= set(res.missing_shards)
    assert "doc-4" not in [h.id for h in res.hits[0]]
    for s in holders:
        ix.restart_shard(s)
    assert coll.get(["doc-4"]) == [Document("doc-4", "text of 4", None, docs[4].metadata)]
    ix.close()
    again = ShardedCollection(ShardedIndex.open(tmp_path / "idx"), "docs")
    try:
        assert again.index.named == ix.named
        assert [d.text for d in again.get([d.id for d in docs])] == [d.text for d in docs]
        again.upsert([Document("new-one", None, base[0], {"k": 1})])
        assert again.index.named["new-one"] == max(ix.named.values()) + 1
    finally:
        again.close()


def test_a_doc_store_behind_its_log_gets_exactly_the_writes_it_lacks(built, base, tmp_path):
    shutil.copytree(built, tmp_path / "idx")
    coll = ShardedCollection(ShardedIndex.open(tmp_path / "idx"), "docs")
    docs = written(base, 12)
    coll.upsert(docs[:6])
    coll.close()
    stores = {p: p.read_bytes() for p in (tmp_path / "idx").glob(f"shard-*/{DOCS}")}
    assert stores and not list((tmp_path / "idx").glob(f"shard-*/{DOCS}-wal"))
    coll = ShardedCollection(ShardedIndex.open(tmp_path / "idx"), "docs")
    coll.upsert(docs[6:])
    coll.delete(["doc-0"])
    coll.upsert([Document("doc-1", "changed", docs[1].vector, {"year": 3000})])
    coll.close()
    for p, data in stores.items():  # each store as it was before the last three writes
        p.write_bytes(data)
    coll = ShardedCollection(ShardedIndex.open(tmp_path / "idx"), "docs")
    try:
        got = {d.id: (d.text, d.metadata) for d in coll.get([d.id for d in docs])}
        want = {d.id: (d.text, d.metadata) for d in docs[2:]} | {"doc-1": ("changed", {"year": 3000})}
        assert got == want
        assert {d.id for d in coll.scroll(100, NAMED_IDS - 1)[0]} == set(want)
        assert [d.id for d in coll.scroll(100, filter={"year": 3000})[0]] == ["doc-1"]
    finally:
        coll.close()


def test_bad_input_is_refused_and_changes_nothing(coll, base):
    before = len(coll)
    for docs, why in [([Document("a", "t", None, {})], "vector is required"),
                      ([Document("a", "t", np.zeros(DIM + 1), {})], "vector must be"),
                      ([Document("a", "t", np.full(DIM, np.nan), {})], "vector"),
                      ([Document("a", "t", base[0], {"x": float("inf")})], "metadata"),
                      ([Document("", "t", base[0], {})], "id must be")]:
        with pytest.raises(InputError, match=why):
            coll.upsert(docs)
    with pytest.raises(InputError, match="embeds nothing"):
        coll.search(None, K, texts=["hello"], mode="hybrid")
    with pytest.raises(InputError, match="texts alone"):
        coll.search(base[:1], K, texts=["hello"], mode="text")
    with pytest.raises(InputError, match="mode must be one of"):
        coll.search(base[:1], K, mode="fuzzy")
    with pytest.raises(InputError, match="one text per query vector"):
        coll.search(base[:2], K, texts=["hello"], mode="hybrid")
    with pytest.raises(InputError, match="text_weight"):
        coll.search(base[:1], K, texts=["hello"], mode="hybrid", text_weight=2)
    with pytest.raises(InputError, match="string ids"):
        coll.get([1, 2])
    with pytest.raises(InputError):
        coll.search(base[:1], K, filter={"$bogus": 1})
    with pytest.raises(InputError, match="2\\*\\*62"):
        coll.index.upsert(np.array([NAMED_IDS]), base[:1])
    with pytest.raises(InputError, match="cleared"):
        coll.clear()
    assert len(coll) == before and not coll.index.named


TOPICS = ("ships", "trains", "planes")


def texts_written(base, n=90):
    """Documents with texts: a topic word, a word of their own (tok<i>) and filler; metadata year and topic."""
    rng = np.random.default_rng(4)
    return [Document(f"t-{i}", f"about {TOPICS[i % 3]} tok{i} " + " ".join(["filler"] * int(rng.integers(1, 6))),
                     base[i * 11 % N] + rng.normal(0, 0.05, DIM).astype(np.float32),
                     {"year": 2000 + i % 4, "topic": TOPICS[i % 3]}) for i in range(n)]


def test_text_search_finds_every_matching_document_on_every_shard(coll, base):
    docs = texts_written(base)
    coll.upsert(docs)
    coll.delete(["t-3"])  # a ships document
    by_name = {d.id: d for d in docs if d.id != "t-3"}
    holders = {ix for d in by_name for ix in coll.index.fresh_owner[coll.index.named[d]]}
    assert len(holders) == coll.index.n_shards  # the documents are spread over every shard
    # A word of one document's own finds it first.
    res = coll.search(None, 5, texts=["tok17", "tok44 nothing-matches-this"], mode="text")
    assert res.hits[0][0].id == "t-17" and res.hits[1][0].id == "t-44" and not res.partial
    assert len(res.hits[0]) == 1 and res.hits[0][0].text == docs[17].text and res.hits[0][0].metadata == docs[17].metadata
    # A topic word: exactly the live documents holding it (checked on their texts here), each once, best first.
    hits = coll.search(None, 50, texts=["ships"], mode="text").hits[0]
    want = {n for n, d in by_name.items() if "ships" in d.text.split()}
    assert {h.id for h in hits} == want and len(hits) == len(want)
    assert [h.distance for h in hits] == sorted(h.distance for h in hits) and all(h.score == -h.distance for h in hits)
    # Under a filter, only those it passes (the predicate evaluated here).
    hits = coll.search(None, 50, filter={"year": {"$gte": 2002}}, texts=["ships trains"], mode="text").hits[0]
    assert {h.id for h in hits} == {n for n, d in by_name.items()
                                    if d.metadata["year"] >= 2002 and d.metadata["topic"] in ("ships", "trains")}
    # Vectors come back when asked for.
    got = coll.search(None, 1, texts=["tok20"], mode="text", with_vectors=True).hits[0][0]
    assert np.allclose(got.vector, docs[20].vector)


def test_hybrid_search_fuses_both_rankings_with_exact_distances(coll, base):
    docs = texts_written(base)
    coll.upsert(docs)
    # The vector of one document with the own word of another: both come first, by reciprocal rank fusion.
    q = docs[10].vector[None]
    res = coll.search(q, 5, texts=["tok61"], mode="hybrid")
    top = [h.id for h in res.hits[0]]
    assert set(top[:2]) == {"t-10", "t-61"} and res.stats[0]["text_candidates"] == 1
    assert [h.score for h in res.hits[0]] == sorted((h.score for h in res.hits[0]), reverse=True)
    # Each hit's distance is its exact L2 distance to the query vector, also for one found by its text alone.
    vectors = {d.id: d.vector for d in docs} | {str(i): base[i] for i in range(N)}
    for h in res.hits[0]:
        assert h.distance == pytest.approx(float(((vectors[h.id] - q[0]) ** 2).sum()), rel=1e-4, abs=1e-5)
    # text_weight 0 is the vector ranking alone; 1 puts the text match first.
    only_vec = coll.search(q, 5, texts=["tok61"], mode="hybrid", text_weight=0).hits[0]
    assert [h.id for h in only_vec] == [h.id for h in coll.search(q, 5).hits[0]]
    assert coll.search(q, 5, texts=["tok61"], mode="hybrid", text_weight=1).hits[0][0].id == "t-61"


def test_text_search_with_a_shard_down_says_what_it_missed(coll, base):
    docs = texts_written(base)
    coll.upsert(docs)
    ix = coll.index
    down = 1
    ix.kill_shard(down)
    res = coll.search(None, 100, texts=["ships"], mode="text")
    assert res.partial and down in res.missing_shards
    found = {h.id for h in res.hits[0]}
    want = {d.id for d in docs if "ships" in d.text.split()}
    # Those a live shard also holds are found; those only the down shard holds are not.
    reachable = {n for n in want if any(s != down for s in ix.fresh_owner[ix.named[n]])}
    assert found == reachable and reachable != want
    with pytest.raises(UnavailableError):
        coll.search(None, 10, texts=["ships"], mode="text", partial=False)
    ix.restart_shard(down)
    assert {h.id for h in coll.search(None, 100, texts=["ships"], mode="text").hits[0]} == want
