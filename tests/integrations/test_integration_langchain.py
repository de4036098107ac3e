"""LangChain store: the unmodified langchain-tests standard suite (sync and async) in embedded mode,
then what the suite does not cover: filters, scores and relevance per metric, MMR, from_texts,
as_retriever, bad input."""

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from langchain_core.embeddings import DeterministicFakeEmbedding, Embeddings
from langchain_tests.integration_tests.vectorstores import VectorStoreIntegrationTests

from fusionrag.integrations.langchain import FusionRAGVectorStore
from fusionrag.retriever.errors import ConfigError, InputError
from integration_helpers import API_KEY, drop_collection, running_service


class TestEmbeddedStandard(VectorStoreIntegrationTests):
    @pytest.fixture
    def vectorstore(self, tmp_path) -> Iterator[FusionRAGVectorStore]:
        store = FusionRAGVectorStore(embedding=self.get_embeddings(), path=tmp_path, collection="lc")
        try:
            yield store
        finally:
            store.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[str]:
    with running_service(tmp_path_factory.mktemp("service")) as url:
        yield url


class TestRemoteStandard(VectorStoreIntegrationTests):
    @pytest.fixture
    def vectorstore(self, service, request) -> Iterator[FusionRAGVectorStore]:
        # A collection per test, dropped after it: the suite wants an empty store each time.
        name = f"lc-{request.node.name.replace('_', '-')}"[:64]
        store = FusionRAGVectorStore(embedding=self.get_embeddings(), url=service, api_key=API_KEY, collection=name)
        try:
            yield store
        finally:
            drop_collection(service, name)
            store.close()


class TableEmbeddings(Embeddings):
    """Texts embedded by a lookup table: distances a test can work out by hand."""

    table = {
        "north": [1.0, 0.0, 0.0], "north-ish": [1.0, 0.0, 0.01], "north-east": [0.7, 0.7, 0.0],
        "east": [0.0, 1.0, 0.0], "south": [-1.0, 0.0, 0.0], "up": [0.0, 0.0, 2.0],
    }

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.table[t] for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self.table[text]


@pytest.fixture(params=["embedded", "remote"])
def make_store(request, tmp_path, service):
    made = []

    def make(metric=None, collection=None, **kw):
        name = collection or f"t-{uuid.uuid4().hex}"
        if request.param == "embedded":
            store = FusionRAGVectorStore(embedding=kw.pop("embedding", TableEmbeddings()), path=tmp_path,
                                         collection=name, metric=metric, **kw)
        else:
            store = FusionRAGVectorStore(embedding=kw.pop("embedding", TableEmbeddings()), url=service,
                                         api_key=API_KEY, collection=name, metric=metric, **kw)
        made.append(store)
        return store

    yield make
    for store in made:
        if request.param == "remote":
            drop_collection(service, store.collection_name)
        store.close()


def _vec(text):
    return np.asarray(TableEmbeddings.table[text], dtype=np.float64)


@pytest.mark.parametrize("metric", ["cosine", "l2", "ip"])
def test_scores_are_engine_distances_and_relevance_is_in_unit_interval(make_store, metric):
    store = make_store(metric)
    texts = list(TableEmbeddings.table)
    store.add_texts(texts, ids=texts)
    q = _vec("north")
    want = {}
    for t in texts:
        x = _vec(t)
        if metric == "l2":
            want[t] = float(((q - x) ** 2).sum())
        elif metric == "ip":
            want[t] = float(-(q @ x))
        else:
            want[t] = float(1 - q @ x / np.linalg.norm(q) / np.linalg.norm(x))
    got = store.similarity_search_with_score("north", k=len(texts))
    assert [d.id for d, _ in got] == sorted(texts, key=lambda t: (want[t], t))[:len(got)]
    assert len(got) == len(texts)
    for doc, dist in got:
        assert dist == pytest.approx(want[doc.id], abs=1e-5)
    rel = store.similarity_search_with_relevance_scores("north", k=len(texts))
    scores = [s for _, s in rel]
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert scores == sorted(scores, reverse=True)
    assert scores[0] == pytest.approx({"cosine": 1.0, "l2": 1.0, "ip": 1 / (1 + np.exp(-1))}[metric], abs=1e-5)
    if metric == "cosine":  # the opposite direction: cos = -1, the bottom of the interval
        assert dict((d.id, s) for d, s in rel)["south"] == pytest.approx(0.0, abs=1e-6)
    by_vector = store.similarity_search_by_vector(TableEmbeddings.table["north"], k=len(texts))
    assert [d.id for d in by_vector] == [d.id for d, _ in got]
    kept = store.similarity_search_with_relevance_scores("north", k=len(texts), score_threshold=scores[2])
    assert [d.id for d, _ in kept] == [d.id for d, _ in rel[:3]]


def test_filters_use_the_collection_syntax(make_store):
    store = make_store()
    texts = list(TableEmbeddings.table)
    store.add_texts(texts, metadatas=[{"n": i, "kind": "cardinal" if "-" not in t and t != "up" else "other"}
                                      for i, t in enumerate(texts)], ids=texts)
    assert [d.id for d in store.similarity_search("north", k=10, filter={"kind": "other"})] == \
        ["north-ish", "north-east", "up"]
    assert {d.id for d in store.similarity_search("north", k=10, filter={"n": {"$gte": 3}})} == {"east", "south", "up"}
    got = store.similarity_search("north", k=10, filter={"$or": [{"n": 0}, {"n": {"$in": [4, 5]}}]})
    assert [d.id for d in got] == ["north", "up", "south"]
    with pytest.raises(InputError, match=r"\$regex"):
        store.similarity_search("north", k=3, filter={"kind": {"$regex": "c.*"}})


def test_max_marginal_relevance_trades_a_near_duplicate_for_diversity(make_store):
    store = make_store()
    store.add_texts(["north", "north-ish", "north-east", "east"], ids=["n", "ni", "ne", "e"])
    assert [d.id for d in store.similarity_search("north", k=2)] == ["n", "ni"]
    # After "n" (= the query), a candidate x scores lambda*cos(q, x) - (1 - lambda)*cos(n, x) = -0.5*cos(q, x):
    # the least similar one wins.
    assert [d.id for d in store.max_marginal_relevance_search("north", k=2, fetch_k=4, lambda_mult=0.25)] == ["n", "e"]
    assert [d.id for d in store.max_marginal_relevance_search("north", k=2, fetch_k=4, lambda_mult=1.0)] == ["n", "ni"]


async def test_async_twins_agree_with_sync(make_store):
    store = make_store()
    ids = await store.aadd_texts(["north", "east", "south"], metadatas=[{"i": 0}, {"i": 1}, {"i": 2}])
    assert len(set(ids)) == 3
    sync = store.similarity_search_with_score("north-east", k=3)
    assert await store.asimilarity_search_with_score("north-east", k=3) == sync
    assert await store.asimilarity_search("north-east", k=1, filter={"i": 2}) == [sync[-1][0]]
    assert await store.asimilarity_search_by_vector([0.7, 0.7, 0.0], k=3) == [d for d, _ in sync]
    mmr = await store.amax_marginal_relevance_search("north", k=2, fetch_k=3)
    assert mmr == store.max_marginal_relevance_search("north", k=2, fetch_k=3)
    rel = await store.asimilarity_search_with_relevance_scores("north-east", k=3)
    assert rel == store.similarity_search_with_relevance_scores("north-east", k=3)
    assert await store.adelete([ids[0]])
    assert await store.aget_by_ids(ids) == store.get_by_ids(ids[1:])


def test_from_texts_and_retriever(tmp_path):
    store = FusionRAGVectorStore.from_texts(["north", "east", "south"], TableEmbeddings(), metadatas=None,
                                            ids=["n", "e", "s"], path=tmp_path, collection="ft", metric="l2")
    try:
        found = store.as_retriever(search_kwargs={"k": 2}).invoke("north-east")
        assert sorted(d.id for d in found) == ["e", "n"]
        thresholded = store.as_retriever(search_type="similarity_score_threshold",
                                         search_kwargs={"score_threshold": 0.9, "k": 3}).invoke("north")
        assert [d.id for d in thresholded] == ["n"]
        mmr = store.as_retriever(search_type="mmr", search_kwargs={"k": 2, "fetch_k": 3}).invoke("north")
        assert mmr[0].id == "n" and len(mmr) == 2
    finally:
        store.close()
    # The data directory keeps the collection: a new store over it sees the documents.
    again = FusionRAGVectorStore(embedding=TableEmbeddings(), path=tmp_path, collection="ft")
    try:
        assert [d.page_content for d in again.get_by_ids(["s", "n"])] == ["south", "north"]
        with pytest.raises(ConfigError, match="exists with metric 'l2'"):
            FusionRAGVectorStore(embedding=TableEmbeddings(), path=tmp_path, collection="ft", metric="cosine")
    finally:
        again.close()


def test_bad_input_is_refused_with_a_message(make_store, tmp_path, service):
    emb = TableEmbeddings()
    with pytest.raises(ConfigError, match="exactly one of path"):
        FusionRAGVectorStore(embedding=emb, collection="x")
    with pytest.raises(ConfigError, match="exactly one of path"):
        FusionRAGVectorStore(embedding=emb, path=tmp_path, url=service, collection="x")
    with pytest.raises(ConfigError, match="metric"):
        FusionRAGVectorStore(embedding=emb, path=tmp_path, collection="x", metric="hamming")
    store = make_store()
    with pytest.raises(InputError, match="2 texts but 1 metadatas"):
        store.add_texts(["north", "east"], metadatas=[{}])
    store.add_texts(["north"], ids=["n"])
    with pytest.raises(InputError, match="k must be"):
        store.similarity_search("north", k=0)
    wide = make_store(collection=store.collection_name, embedding=DeterministicFakeEmbedding(size=5))
    with pytest.raises(InputError, match="3-dimensional"):
        wide.add_texts(["five dims"])
    assert [d.id for d in store.similarity_search("north", k=5)] == ["n"]  # nothing lost


def test_remote_needs_a_valid_key(service):
    from fusionrag.integrations.backend import RemoteError

    store = FusionRAGVectorStore(embedding=TableEmbeddings(), url=service, api_key="wrong-key-123", collection="k")
    try:
        with pytest.raises(RemoteError, match="401"):
            store.add_texts(["north"])
    finally:
        store.close()


async def test_remote_delete_all_keeps_the_collection_settings(service):
    import httpx

    store = FusionRAGVectorStore(embedding=TableEmbeddings(), url=service, api_key=API_KEY, collection="keep",
                                 metric="l2")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        store.add_texts(["north", "east"])
        store.delete()  # no ids: every document
        info = httpx.get(f"{service}/v1/collections/keep", headers=headers).json()
        assert (info["count"], info["dimension"], info["metric"]) == (0, 3, "l2")
        await store.aadd_texts(["south"], ids=["s"])
        await store.adelete()
        info = httpx.get(f"{service}/v1/collections/keep", headers=headers).json()
        assert (info["count"], info["dimension"], info["metric"]) == (0, 3, "l2")
        assert store.similarity_search("south", k=1) == []
    finally:
        drop_collection(service, "keep")
        store.close()
