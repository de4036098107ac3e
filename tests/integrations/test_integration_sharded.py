"""The LangChain and LlamaIndex stores, unchanged, against the sharded service's routes (the service's own app,
server/app.py, over a ShardedCatalog: server/ray_serve.py's replica_app; shards in this process, served by uvicorn
over real HTTP; the same app runs as a Ray Serve deployment in tests/retriever/sharded_ray_serve_child.py). The collection is a built sharded index of
3000 vectors, so searches run through the index path (PQ candidates, re-rank) of every shard beside the documents
the stores write; answers are checked against exact search in numpy."""

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from conftest import clustered
from integration_helpers import serving, serving_sharded
from langchain_core.embeddings import DeterministicFakeEmbedding
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters, VectorStoreQuery, VectorStoreQueryMode

from fusionrag.integrations.langchain import FusionRAGVectorStore as LangChainStore
from fusionrag.integrations.llamaindex import FusionRAGVectorStore as LlamaIndexStore
from fusionrag.retriever.engine.config import BuildConfig
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.server.auth import KeyRing, parse_entries
from fusionrag.server.config import ServerConfig
from fusionrag.server.ray_serve import replica_app

N, DIM = 3000, 16
NAME = "docs"


@pytest.fixture(scope="module")
def base() -> np.ndarray:
    return clustered(N, DIM, 20, seed=9, spread=0.6)


@pytest.fixture(scope="module")
def service(tmp_path_factory, base) -> Iterator[tuple[str, ShardedCollection]]:
    root = tmp_path_factory.mktemp("sharded-service")
    build_sharded(base, root / "built", 3, BuildConfig(threads=1, centroid_ratio=0.05), progress=False)
    with serving_sharded(root / "built", root / "idx", NAME) as served:
        yield served


def nearest(x: np.ndarray, names: list[str], q: np.ndarray, k: int) -> list[str]:
    d = ((x.astype(np.float64) - q[None, :].astype(np.float64)) ** 2).sum(1)
    return [names[i] for i in np.argsort(d, kind="stable")[:k]]


def test_langchain_store_writes_filters_and_finds_through_the_index(service, base):
    url, coll = service
    emb = DeterministicFakeEmbedding(size=DIM)
    store = LangChainStore(emb, collection=NAME, url=url)
    try:
        texts = [f"passage {i} about {'ships' if i % 3 else 'trains'}" for i in range(40)]
        metas = [{"topic": "ships" if i % 3 else "trains", "i": i} for i in range(40)]
        ids = store.add_texts(texts, metas, ids=[f"lc-{i}" for i in range(40)])
        assert ids == [f"lc-{i}" for i in range(40)]
        # A query equal to a passage finds it first; under a filter only passages of that topic come back.
        hits = store.similarity_search(texts[4], k=5)
        assert hits[0].id == "lc-4" and hits[0].page_content == texts[4] and hits[0].metadata == metas[4]
        vecs = np.array(emb.embed_documents(texts), dtype=np.float32)
        names = [str(i) for i in range(N)] + ids
        everything = np.concatenate([base, vecs])
        assert [h.id for h in hits] == nearest(everything, names, vecs[4], 5)
        trains = store.similarity_search(texts[5], k=6, filter={"topic": "trains"})
        want = [ids[i] for i in range(40) if metas[i]["topic"] == "trains"]
        assert [h.id for h in trains] == nearest(vecs[[ids.index(w) for w in want]], want, vecs[5], 6)
        # A built vector is a document too, found through the shards' index path.
        scored = store.similarity_search_with_score_by_vector(base[123].tolist(), k=3)
        assert scored[0][0].id == "123" and scored[0][0].page_content == "" and scored[0][1] < 1e-4
        stats = httpx.post(f"{url}/v1/collections/{NAME}/search",
                           json={"vectors": [base[123].tolist()], "k": 3, "stats": True}).json()["stats"][0]
        assert stats["candidates"] > 0 and stats["shards_probed"] >= 1
        # Hybrid search (the store embeds the query, the shards rank texts by BM25): the passage itself first.
        hybrid = store.hybrid_search(texts[9], k=4)
        assert hybrid[0].id == "lc-9" and hybrid[0].page_content == texts[9]
        assert [d.id for d in store.get_by_ids(["lc-7", "nope", "lc-8"])] == ["lc-7", "lc-8"]
        assert store.delete(["lc-7", "lc-8"])
        assert store.get_by_ids(["lc-7", "lc-8"]) == []
        assert "lc-7" not in [h.id for h in store.similarity_search(texts[7], k=5)]
    finally:
        store.close()


def test_llamaindex_store_adds_queries_and_deletes_by_document(service, base):
    url, coll = service
    store = LlamaIndexStore(collection=NAME, url=url)
    rng = np.random.default_rng(3)
    vecs = (base[rng.choice(N, 12)] + rng.normal(0, 0.05, (12, DIM))).astype(np.float32)
    nodes = [TextNode(id_=f"li-{i}", text=f"chunk {i}", embedding=vecs[i].tolist(), metadata={"part": i % 2},
                      relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=f"src-{i % 3}")})
             for i in range(12)]
    try:
        assert store.add(nodes) == [n.node_id for n in nodes]
        res = store.query(VectorStoreQuery(query_embedding=vecs[2].tolist(), similarity_top_k=3,
                                           filters=MetadataFilters(filters=[MetadataFilter(key="part", value=0)])))
        want = [f"li-{i}" for i in range(12) if i % 2 == 0]
        assert res.ids == nearest(vecs[0::2], want, vecs[2], 3)
        assert [n.get_content() for n in res.nodes][0] == "chunk 2"
        # Text search, over every shard's texts: the node holding the words, first.
        text = store.query(VectorStoreQuery(query_str="chunk 7", mode=VectorStoreQueryMode.TEXT_SEARCH,
                                            similarity_top_k=12))
        assert text.ids[0] == "li-7" and set(text.ids) == {n.node_id for n in nodes}
        store.delete("src-1")  # by the source document: its chunks 1, 4, 7, 10
        left = {n.node_id for n in store.get_nodes([n.node_id for n in nodes])}
        assert left == {f"li-{i}" for i in range(12) if i % 3 != 1}
        assert {n.node_id for n in store.get_nodes(filters=MetadataFilters(
            filters=[MetadataFilter(key="part", value=1)]))} == {f"li-{i}" for i in (3, 5, 9, 11)}
    finally:
        store.close()


def test_the_routes_refuse_what_a_sharded_collection_cannot_do(service, base):
    url, coll = service
    v = base[0].tolist()
    post = lambda path, body: httpx.post(f"{url}/v1/collections/{NAME}{path}", json=body)  # noqa: E731
    assert post("/search", {"texts": ["hello"], "mode": "hybrid"}).status_code == 422  # it embeds nothing
    assert post("/search", {"texts": ["hello"]}).status_code == 422
    assert post("/search", {"texts": ["hello"], "vectors": [v], "mode": "text"}).status_code == 422
    assert post("/search", {"vectors": [v[:-1]]}).status_code == 422
    assert post("/search", {"vectors": [v], "filter": {"$nope": 1}}).status_code == 422
    assert post("/search", {"vectors": [v], "k": 10**6}).status_code == 422
    r = httpx.post(f"{url}/v1/collections/{NAME}/search", content=b'{"vectors": [[NaN]]}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert post("/documents", {"documents": [{"id": "t", "text": "no vector"}]}).status_code == 422
    r = post("/documents", {"documents": [{"id": "t", "vector": v}] * (ServerConfig().max_documents + 1)})
    assert r.status_code == 422 and "max_documents" in r.text  # as the single service answers it
    assert post("/documents/delete", {"ids": ["a"], "filter": {"x": 1}}).status_code == 422
    assert httpx.post(f"{url}/v1/collections/other/search", json={"vectors": [v]}).status_code == 404
    assert httpx.post(f"{url}/v1/collections", json={"name": NAME, "dimension": DIM}).status_code == 409
    assert httpx.post(f"{url}/v1/collections", json={"name": "x", "dimension": DIM}).status_code == 422
    assert httpx.delete(f"{url}/v1/collections/{NAME}").status_code == 405
    assert httpx.get(f"{url}/v1/collections/{NAME}/documents", params={"filter": "[1]"}).status_code == 422
    info = httpx.get(f"{url}/v1/collections/{NAME}").json()
    assert info["dimension"] == DIM and info["count"] == len(coll) and info["sharded"]
    assert httpx.get(f"{url}/v1/collections/{NAME}/documents/nope").status_code == 404
    doc = httpx.get(f"{url}/v1/collections/{NAME}/documents/5", params={"vector": "true"}).json()
    assert doc["id"] == "5" and np.allclose(doc["vector"], base[5], rtol=1e-6)
    page = httpx.get(f"{url}/v1/collections/{NAME}/documents", params={"limit": 3}).json()
    assert [d["id"] for d in page["documents"]] == ["0", "1", "2"] and page["next_cursor"] == "2"


def test_the_limits_of_the_users_config_reach_the_routes(service, base):
    """#50: the sharded routes applied ServerConfig()'s defaults whatever `serve --ray` was given; now the
    user's (the config `serve` gives every router replica, which builds the service's app from it)."""
    from fusionrag.server.config import load_config

    _, coll = service
    config = load_config(flags={"max_k": 7, "max_documents": 3, "max_queries": 2, "max_body_bytes": 4096})
    with serving(replica_app(coll, config)) as url:
        post = lambda path, body: httpx.post(f"{url}/v1/collections/{NAME}{path}", json=body)  # noqa: E731
        v = base[0].tolist()
        assert post("/search", {"vectors": [v], "k": 7}).status_code == 200
        r = post("/search", {"vectors": [v], "k": 8})
        assert r.status_code == 422 and "max_k" in r.text
        r = post("/search", {"vectors": [v] * 3, "k": 1})
        assert r.status_code == 422 and "max_queries" in r.text
        r = post("/documents/get", {"ids": ["1", "2", "3", "4"]})
        assert r.status_code == 422 and "max_documents" in r.text
        r = httpx.get(f"{url}/v1/collections/{NAME}/documents")
        assert r.status_code == 200 and len(r.json()["documents"]) == 3  # a page: max_documents at most
        r = post("/search", {"vectors": [v], "k": 1, "filter": {"pad": "x" * 5000}})
        assert r.status_code == 413 and "max_body_bytes" in r.text


def test_api_keys_guard_the_sharded_routes(service, base):
    """The same keys as the single service's (server/auth.py): 401 without a valid one, 403 for a key not allowed
    this collection, whose listing leaves it out; health stays open. The LangChain store passes its key."""
    _, coll = service
    keys = KeyRing(parse_entries(f"good-key-123\nnarrow-key-1 other,team-*\nwide-key-12 {NAME}", "test"))
    with serving(replica_app(coll, keys=keys)) as url:
        search = f"{url}/v1/collections/{NAME}/search"
        body = {"vectors": [base[0].tolist()], "k": 1}
        r = httpx.post(search, json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and "missing" in r.json()["detail"]
        assert httpx.post(search, json=body, headers={"Authorization": "Bearer wrong-key-9"}).status_code == 401
        assert httpx.post(search, json=body, headers={"Authorization": "Basic good-key-123"}).status_code == 401
        narrow = {"Authorization": "Bearer narrow-key-1"}
        assert httpx.post(search, json=body, headers=narrow).status_code == 403
        assert httpx.get(f"{url}/v1/collections", headers=narrow).json() == {"collections": []}
        for key in ("good-key-123", "wide-key-12"):
            r = httpx.post(search, json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.json()["results"][0][0]["id"] == "0"
        assert httpx.get(f"{url}/healthz").status_code == 200
        store = LangChainStore(DeterministicFakeEmbedding(size=DIM), collection=NAME, url=url, api_key="wide-key-12")
        try:
            assert store.similarity_search_by_vector(base[9].tolist(), k=1)[0].id == "9"
        finally:
            store.close()
        refused = LangChainStore(DeterministicFakeEmbedding(size=DIM), collection=NAME, url=url, api_key="nope-nope")
        try:
            with pytest.raises(Exception, match="invalid API key"):
                refused.similarity_search_by_vector(base[9].tolist(), k=1)
        finally:
            refused.close()
