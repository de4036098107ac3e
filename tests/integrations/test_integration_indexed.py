"""The LangChain and LlamaIndex stores, embedded and remote, over a collection big enough that the
engine's defaults index it (tests/indexed_helpers.py): searches run through a built generation beside
documents written after its merge, with indexed documents deleted and a filter excluded inside the PQ
scan; checked by the engine's own statistics and against exact search. Then the unmodified
langchain-tests suite over a collection that already has a built generation."""

import shutil
from collections.abc import Iterator

import httpx
import pytest
from langchain_tests.integration_tests.vectorstores import VectorStoreIntegrationTests
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters, VectorStoreQuery

from fusionrag.integrations.langchain import FusionRAGVectorStore as LangChainStore
from fusionrag.integrations.llamaindex import FusionRAGVectorStore as LlamaIndexStore
from fusionrag.integrations.llamaindex import to_collection_filter
from fusionrag.loadtests.report import parse_prometheus
from fusionrag.retriever.collection import CollectionConfig
from indexed_helpers import (DELETED, K, N_BEFORE, WIDE, Corpus, Lookup, check_index_path, corpus, remote_info,
                             remote_search, wait_merged)
from integration_helpers import API_KEY, drop_collection, running_service

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def data() -> Corpus:
    return corpus()


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[str]:
    with running_service(tmp_path_factory.mktemp("service")) as url:
        yield url


def _engine_of(backend, name: str):
    """The engine's collection behind an embedded store (the one its searches run on)."""
    return backend._catalog.get(name)


def _engine_probes(mode: str, backend, url: str, name: str, data: Corpus, to_filter=lambda flt: flt):
    """(info, engine) of the collection behind a store: its info, and the engine's own answer (ids, stats) to
    the test's queries under a filter, asked of the embedded collection or of the service."""
    if mode == "embedded":
        coll = _engine_of(backend, name)

        def engine(flt):
            res = coll.search(data.queries, k=K, filter=to_filter(flt))
            return [[h.id for h in hits] for hits in res.hits], res.stats
        return coll.info, engine

    def info():
        return remote_info(url, API_KEY, name)

    def engine(flt):
        return remote_search(url, API_KEY, name, data.queries, to_filter(flt))
    return info, engine


def _reranked(url: str, name: str) -> float:
    """Candidates the service's exact re-rank scored on this collection so far (from the raw vectors in RAM,
    which the default budget holds here, or from the SSD), from its Prometheus metrics."""
    samples = parse_prometheus(httpx.get(f"{url}/metrics", headers=HEADERS).text)
    return sum(v for (metric, labels), v in samples.items()
               if metric == "fusionrag_reranked_candidates_total" and ("collection", name) in labels)


def _checked_remote(url: str, name: str, data: Corpus, search) -> None:
    """The store's own searches went through the index: the service counted the candidates its re-rank
    scored, as many as the engine reports for the same queries."""
    before = _reranked(url, name)
    search(WIDE)
    during = _reranked(url, name) - before
    _, stats = remote_search(url, API_KEY, name, data.queries, WIDE)
    assert during == sum(s["reranked"] for s in stats) > 0


@pytest.mark.parametrize("mode", ["embedded", "remote"])
def test_langchain_store_searches_reach_the_index(mode, data, tmp_path, service):
    where = dict(path=tmp_path) if mode == "embedded" else dict(url=service, api_key=API_KEY)
    store = LangChainStore(embedding=Lookup(data), collection="big", metric="l2", **where)
    try:
        store.add_texts(data.texts[:N_BEFORE], data.metadata[:N_BEFORE], ids=data.ids[:N_BEFORE])
        info, engine = _engine_probes(mode, store._backend, service, "big", data)
        wait_merged(info)
        store.add_texts(data.texts[N_BEFORE:], data.metadata[N_BEFORE:], ids=data.ids[N_BEFORE:])
        assert store.delete([f"d{i}" for i in DELETED])
        assert info()["build_state"]["deleted"] == len(DELETED)

        def search(flt):
            return [[d.id for d in store.similarity_search_by_vector(q.tolist(), k=K, filter=flt)]
                    for q in data.queries]

        check_index_path(data, "l2", search, engine)
        if mode == "remote":
            _checked_remote(service, "big", data, search)
    finally:
        if mode == "remote":
            drop_collection(service, "big")
        store.close()


def _li_filters(flt: dict | None) -> MetadataFilters | None:
    if flt is None:
        return None
    op = FilterOperator.NE if flt == WIDE else FilterOperator.EQ
    return MetadataFilters(filters=[MetadataFilter(key="g", value=3, operator=op)])


@pytest.mark.parametrize("mode", ["embedded", "remote"])
def test_llamaindex_store_queries_reach_the_index(mode, data, tmp_path, service):
    where = dict(path=tmp_path) if mode == "embedded" else dict(url=service, api_key=API_KEY)
    store = LlamaIndexStore(collection="big-li", **where)  # cosine, the store's default
    nodes = [TextNode(id_=i, text=t, embedding=v, metadata=m)
             for i, t, v, m in zip(data.ids, data.texts, data.vectors.tolist(), data.metadata)]
    try:
        store.add(nodes[:N_BEFORE])
        info, engine = _engine_probes(mode, store.client, service, "big-li", data,
                                      lambda flt: to_collection_filter(_li_filters(flt)))
        wait_merged(info)
        store.add(nodes[N_BEFORE:])
        store.delete_nodes(node_ids=[f"d{i}" for i in DELETED])
        assert info()["build_state"]["deleted"] == len(DELETED)

        def search(flt):
            return [store.query(VectorStoreQuery(query_embedding=q.tolist(), similarity_top_k=K,
                                                 filters=_li_filters(flt))).ids for q in data.queries]

        check_index_path(data, "cosine", search, engine)
        if mode == "remote":
            _checked_remote(service, "big-li", data, search)
    finally:
        if mode == "remote":
            drop_collection(service, "big-li")
        store.close()


@pytest.fixture(scope="module")
def indexed_empty(tmp_path_factory):
    """A data directory whose collection "lc", made with the suite's embedding, has a built generation
    (min_index_count documents, merged) whose every document has been deleted since: tombstones."""
    root = tmp_path_factory.mktemp("indexed-empty")
    store = LangChainStore(embedding=VectorStoreIntegrationTests.get_embeddings(), path=root, collection="lc")
    try:
        ids = [f"seed-{i}" for i in range(CollectionConfig.min_index_count)]
        store.add_texts([f"seed text {i}" for i in range(len(ids))], ids=ids)
        _engine_of(store._backend, "lc").merge(progress=False)
        assert store.delete(ids)
    finally:
        store.close()
    return root


class TestStandardOnAnIndexedCollection(VectorStoreIntegrationTests):
    @pytest.fixture
    def vectorstore(self, indexed_empty, tmp_path) -> Iterator[LangChainStore]:
        shutil.copytree(indexed_empty, tmp_path / "data")
        store = LangChainStore(embedding=self.get_embeddings(), path=tmp_path / "data", collection="lc")
        state = _engine_of(store._backend, "lc").info()["build_state"]
        assert state["generation"] == 1 and state["deleted"] == CollectionConfig.min_index_count, state
        try:
            yield store
        finally:
            store.close()
