"""LlamaIndex store: a VectorStoreIndex over it answers retrieval queries (real all-MiniLM-L6-v2
embeddings) in embedded and remote mode; filters, doc/node selection, deletes, get_nodes, clear,
and the async twins."""

import uuid
from collections.abc import Iterator

import pytest
from integration_helpers import API_KEY, drop_collection, running_service
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores.types import (FilterCondition, FilterOperator, MetadataFilter, MetadataFilters,
                                                  VectorStoreQuery)

from fusionrag.integrations.llamaindex import FusionRAGVectorStore, to_collection_filter
from fusionrag.retriever.collection.embedding import get_embedder
from fusionrag.retriever.errors import InputError

_EMBEDDED: dict[str, list[float]] = {}


class MiniLM(BaseEmbedding):
    """all-MiniLM-L6-v2 from the offline PyPI package, as a LlamaIndex embedding. Each text is
    embedded once per test session: the tests index the same documents many times."""

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embeddings([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        new = [t for t in dict.fromkeys(texts) if t not in _EMBEDDED]
        if new:
            _EMBEDDED.update(zip(new, get_embedder("all-MiniLM-L6-v2").embed(new).tolist()))
        return [_EMBEDDED[t] for t in texts]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)


DOCS = [
    Document(doc_id="paris", text="The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. "
             "It was designed by the company of the engineer Gustave Eiffel.",
             metadata={"city": "Paris", "year": 1889}),
    Document(doc_id="rome", text="The Colosseum is an elliptical amphitheatre in the centre of Rome, built of "
             "travertine limestone and brick-faced concrete.", metadata={"city": "Rome", "year": 80}),
    Document(doc_id="plants", text="Photosynthesis is the process by which plants turn light, water and carbon "
             "dioxide into sugar and oxygen.", metadata={"topic": "biology", "year": 1779}),
    Document(doc_id="python", text="Python is a programming language created by Guido van Rossum and first "
             "released in 1991.", metadata={"topic": "software", "year": 1991}),
    # Long enough to be split into several nodes: delete by ref doc must take all of them.
    Document(doc_id="bees", text=" ".join(
        f"Honey bees live in colonies; fact {i}: a worker bee visits many flowers to gather nectar and pollen."
        for i in range(12)), metadata={"topic": "biology", "year": 2000}),
]
QUESTIONS = {
    "Which iron tower stands in Paris?": "paris",
    "Where is the ancient amphitheatre of Rome?": "rome",
    "How do plants make sugar from light?": "plants",
    "Who created the Python programming language?": "python",
    "What do worker bees collect from flowers?": "bees",
}
SPLITTER = SentenceSplitter(chunk_size=64, chunk_overlap=0, tokenizer=str.split)  # no tiktoken download


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[str]:
    with running_service(tmp_path_factory.mktemp("service")) as url:
        yield url


@pytest.fixture(params=["embedded", "remote"])
def store(request, tmp_path) -> Iterator[FusionRAGVectorStore]:
    if request.param == "embedded":
        s = FusionRAGVectorStore(path=tmp_path, collection="li")
        yield s
    else:
        url = request.getfixturevalue("service")
        s = FusionRAGVectorStore(url=url, api_key=API_KEY, collection=f"li-{uuid.uuid4().hex}")
        yield s
        drop_collection(url, s.collection)
    s.close()


def _index(store) -> VectorStoreIndex:
    return VectorStoreIndex.from_documents(DOCS, storage_context=StorageContext.from_defaults(vector_store=store),
                                           embed_model=MiniLM(), transformations=[SPLITTER])


def test_index_answers_retrieval_queries_with_the_right_nodes(store):
    index = _index(store)
    assert store.stores_text
    nodes = store.get_nodes(filters=MetadataFilters(filters=[MetadataFilter(key="year", value=0,
                                                                             operator=FilterOperator.GTE)]))
    by_doc = {}
    for n in nodes:
        by_doc.setdefault(n.ref_doc_id, []).append(n)
    assert set(by_doc) == {d.doc_id for d in DOCS} and len(by_doc["bees"]) > 1
    retriever = index.as_retriever(similarity_top_k=2)
    for question, doc_id in QUESTIONS.items():
        hits = retriever.retrieve(question)
        assert hits[0].node.ref_doc_id == doc_id, question
        assert hits[0].score >= hits[1].score and -1.0 <= hits[1].score <= 1.0
    # Text and metadata come back whole.
    top = retriever.retrieve("Who created the Python programming language?")[0].node
    assert top.get_content() == DOCS[3].text and top.metadata == DOCS[3].metadata


def test_filters_doc_ids_and_node_ids_narrow_the_query(store):
    index = _index(store)
    embed = MiniLM().get_query_embedding("an old building in Rome")

    def ids(**kw):
        res = store.query(VectorStoreQuery(query_embedding=embed, similarity_top_k=20, **kw))
        assert res.similarities == sorted(res.similarities, reverse=True)
        return {n.ref_doc_id for n in res.nodes}

    def filters(*fs, condition=FilterCondition.AND):
        return MetadataFilters(filters=list(fs), condition=condition)

    assert ids(filters=filters(MetadataFilter(key="year", value=1000, operator=FilterOperator.GT))) == \
        {"paris", "plants", "python", "bees"}
    assert ids(filters=filters(MetadataFilter(key="city", value=["Rome", "Oslo"], operator=FilterOperator.IN))) == \
        {"rome"}
    assert ids(filters=filters(MetadataFilter(key="topic", value="biology"),
                               MetadataFilter(key="year", value=1900, operator=FilterOperator.LT))) == {"plants"}
    nested = filters(MetadataFilter(key="city", value="Paris"),
                     filters(MetadataFilter(key="topic", value="software"),
                             MetadataFilter(key="year", value=1991, operator=FilterOperator.LTE)),
                     condition=FilterCondition.OR)
    assert ids(filters=nested) == {"paris", "python"}
    assert ids(filters=filters(MetadataFilter(key="topic", value=["biology"], operator=FilterOperator.NIN))) == \
        {"paris", "rome", "python"}
    assert ids(doc_ids=["python", "bees"]) == {"python", "bees"}
    some = [n.node_id for n in store.get_nodes(filters=filters(MetadataFilter(key="city", value="Paris")))]
    res = store.query(VectorStoreQuery(query_embedding=embed, similarity_top_k=20, node_ids=some))
    assert res.ids == some
    assert index.as_retriever(similarity_top_k=1, filters=filters(MetadataFilter(key="city", value="Paris"))) \
        .retrieve("Rome amphitheatre")[0].node.ref_doc_id == "paris"


def test_contains_any_and_all_test_the_elements_of_list_metadata(store):
    tagged = [TextNode(id_=name, text=name, embedding=[1.0, float(i)], metadata={"tags": tags})
              for i, (name, tags) in enumerate({"a": ["x", "y"], "b": ["y"], "c": ["z"], "d": "x"}.items())]
    store.add(tagged)

    def ids(operator, value):
        flt = MetadataFilters(filters=[MetadataFilter(key="tags", value=value, operator=operator)])
        return {n.node_id for n in store.query(VectorStoreQuery(query_embedding=[1.0, 0.0], similarity_top_k=10,
                                                                 filters=flt)).nodes}

    assert ids(FilterOperator.CONTAINS, "x") == {"a"}  # "d" holds a string, not a list
    assert ids(FilterOperator.ANY, ["x", "z"]) == {"a", "c"}
    assert ids(FilterOperator.ALL, ["x", "y"]) == {"a"}
    with pytest.raises(InputError, match="needs a non-empty list"):
        ids(FilterOperator.ANY, [])


@pytest.mark.parametrize("operator", [FilterOperator.TEXT_MATCH, FilterOperator.IS_EMPTY])
def test_unsupported_filters_are_named(operator):
    with pytest.raises(InputError, match=f"operator '{operator.value}' \\(on 'topic'\\) is not supported"):
        to_collection_filter(MetadataFilters(filters=[MetadataFilter(key="topic", value="bio", operator=operator)]))


def test_not_condition_is_refused():
    with pytest.raises(InputError, match="'not' is not supported"):
        to_collection_filter(MetadataFilters(filters=[MetadataFilter(key="a", value=1)], condition=FilterCondition.NOT))
    assert to_collection_filter(MetadataFilters(filters=[])) is None


def test_deletes_get_nodes_and_clear(store):
    _index(store)
    all_nodes = store.get_nodes(filters=MetadataFilters(filters=[MetadataFilter(key="year", value=-1,
                                                                                 operator=FilterOperator.GT)]))
    bees = [n.node_id for n in all_nodes if n.ref_doc_id == "bees"]
    store.delete("bees")
    left = {n.node_id: n for n in store.get_nodes(node_ids=[n.node_id for n in all_nodes])}
    assert len(left) == len(all_nodes) - len(bees) and not set(bees) & set(left)
    python = [n.node_id for n in all_nodes if n.ref_doc_id == "python"]
    assert [n.get_content() for n in store.get_nodes(node_ids=python)] == [DOCS[3].text]
    store.delete_nodes(node_ids=python)
    assert store.get_nodes(node_ids=python) == []
    by_city = MetadataFilters(filters=[MetadataFilter(key="city", value=["Paris", "Rome"], operator=FilterOperator.IN)])
    # node_ids and filters together: only nodes meeting both go.
    paris = [n.node_id for n in all_nodes if n.ref_doc_id == "paris"]
    store.delete_nodes(node_ids=paris, filters=by_city)
    assert {n.ref_doc_id for n in store.get_nodes(filters=by_city)} == {"rome"}
    store.delete_nodes(filters=by_city)
    assert store.get_nodes(filters=by_city) == []
    assert {n.ref_doc_id for n in store.get_nodes(node_ids=list(left))} == {"plants"}
    store.clear()
    assert store.get_nodes(node_ids=list(left)) == []
    res = store.query(VectorStoreQuery(query_embedding=[0.1] * 384, similarity_top_k=3))
    assert res.nodes == [] and res.ids == []


async def test_async_twins(store):
    nodes = SPLITTER.get_nodes_from_documents(DOCS)
    embeds = MiniLM().get_text_embedding_batch([n.get_content() for n in nodes])
    for n, e in zip(nodes, embeds):
        n.embedding = e
    assert await store.async_add(nodes) == [n.node_id for n in nodes]
    q = MiniLM().get_query_embedding("Who created the Python programming language?")
    res = await store.aquery(VectorStoreQuery(query_embedding=q, similarity_top_k=1))
    assert res.nodes[0].ref_doc_id == "python"
    await store.adelete("python")
    res = await store.aquery(VectorStoreQuery(query_embedding=q, similarity_top_k=1))
    assert res.nodes[0].ref_doc_id != "python"
    got = await store.aget_nodes(node_ids=[nodes[0].node_id, "missing"])
    assert [n.node_id for n in got] == [nodes[0].node_id]
    await store.adelete_nodes(filters=MetadataFilters(filters=[MetadataFilter(key="topic", value="biology")]))
    left = await store.aget_nodes(node_ids=[n.node_id for n in nodes])
    assert {n.ref_doc_id for n in left} == {"paris", "rome"}
    await store.adelete_nodes(node_ids=[left[0].node_id])
    assert len(await store.aget_nodes(node_ids=[n.node_id for n in nodes])) == 1
    await store.aclear()
    assert await store.aget_nodes(node_ids=[n.node_id for n in nodes]) == []


def test_bad_queries_and_nodes_are_refused(tmp_path):
    store = FusionRAGVectorStore(path=tmp_path, collection="bad")
    try:
        with pytest.raises(InputError, match="query embedding"):
            store.query(VectorStoreQuery(query_str="x", similarity_top_k=1))
        with pytest.raises(InputError, match="mode 'mmr'"):
            store.query(VectorStoreQuery(query_embedding=[0.0, 1.0], similarity_top_k=1, mode="mmr"))
        with pytest.raises(ValueError, match="embedding not set"):
            store.add([TextNode(text="no embedding")])
        store.add([TextNode(text="a", id_="a", embedding=[1.0, 0.0])])
        with pytest.raises(InputError, match="2-dimensional"):
            store.add([TextNode(text="b", id_="b", embedding=[1.0, 0.0, 0.0])])
        assert [n.get_content() for n in store.get_nodes(node_ids=["a", "b"])] == ["a"]
    finally:
        store.close()


def test_reopened_store_serves_the_index(tmp_path):
    store = FusionRAGVectorStore(path=tmp_path, collection="keep")
    _index(store)
    store.close()
    store = FusionRAGVectorStore(path=tmp_path, collection="keep")
    try:
        index = VectorStoreIndex.from_vector_store(store, embed_model=MiniLM())
        top = index.as_retriever(similarity_top_k=1).retrieve("What do worker bees collect from flowers?")[0]
        assert top.node.ref_doc_id == "bees" and top.node.metadata["topic"] == "biology"
    finally:
        store.close()


def test_documents_written_otherwise_come_back_as_text_nodes(tmp_path):
    """Documents LlamaIndex did not write (an import, the API, another store) hold no serialised node: a query
    gives each as a TextNode of its id, text and metadata (this raised ValueError in LlamaIndex's
    metadata_dict_to_node before)."""
    from fusionrag.retriever.collection import Document as Doc
    from fusionrag.retriever.directory import catalog

    vectors = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.9, 0.1, 0.0]]
    cat = catalog(tmp_path)
    try:
        cat.create("plain", 3, "l2").upsert([Doc(f"d{i}", f"text {i}", v, {"n": i}) for i, v in enumerate(vectors)])
    finally:
        cat.close()
    store = FusionRAGVectorStore(collection="plain", path=tmp_path)
    try:
        res = store.query(VectorStoreQuery(query_embedding=[1.0, 0.0, 0.0], similarity_top_k=2))
        assert res.ids == ["d0", "d2"]
        assert [(n.node_id, n.get_content(), n.metadata) for n in res.nodes] == [("d0", "text 0", {"n": 0}),
                                                                                 ("d2", "text 2", {"n": 2})]
        assert [n.node_id for n in store.get_nodes(node_ids=["d1"])] == ["d1"]
    finally:
        store.close()
