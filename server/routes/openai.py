"""OpenAI's files, vector stores and embeddings API (/v1/files, /v1/vector_stores, /v1/embeddings), in OpenAI's
shapes, so that the OpenAI SDK's `client.files`, `client.vector_stores` and `client.embeddings` work unchanged
against the service or its vLLM plugin; the
stores themselves are server/vector_stores.py's. Errors carry OpenAI's {"error": {"message", "type"}} beside the
service's "detail" (server/errors.py)."""

from __future__ import annotations

import base64
from typing import Annotated, Literal, Optional, Union

import numpy as np
from fastapi import APIRouter, Depends, Path as PathParam, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from fusionrag.retriever.collection.config import DEFAULT_TEXT_WEIGHT, Fusion
from fusionrag.retriever.collection.embedding import canonical_name, get_embedder, model_names
from fusionrag.retriever.errors import ConfigError, InputError, StorageError
from fusionrag.server.auth import Key
from fusionrag.server.batcher import ServiceClosing
from fusionrag.server.deps import authenticate, state_of, viewer
from fusionrag.server.errors import documented, http_error
from fusionrag.server.requests import check_texts
from fusionrag.server.uploads import Room, spool_multipart
from fusionrag.server.vector_stores import BATCH_RE, FILE_RE, STORE_RE, VectorStores, translate_filter

router = APIRouter(prefix="/v1", tags=["OpenAI vector stores"])
# Every route that reads a body: 400 malformed JSON, 408 a body that stalls, 413 one too large.
_ERRORS = documented(400, 401, 404, 408, 409, 413, 422, 503, 507)
_READ = documented(401, 404, 422, 503)
StoreId = Annotated[str, PathParam(pattern=f"^{STORE_RE.pattern}$")]
FileId = Annotated[str, PathParam(pattern=f"^{FILE_RE.pattern}$")]
BatchId = Annotated[str, PathParam(pattern=f"^{BATCH_RE.pattern}$")]
FileStatus = Optional[Literal["in_progress", "completed", "failed", "cancelled"]]
_POLL_AFTER = {"openai-poll-after-ms": "250"}  # the SDK's poll helpers wait this long between polls


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields of OpenAI's that fusionrag does not use


class CreateVectorStore(_Body):
    name: Optional[str] = Field(None, max_length=256)
    description: Optional[str] = Field(None, max_length=512)
    file_ids: Optional[list[str]] = Field(None, max_length=500)
    metadata: Optional[dict] = None
    chunking_strategy: Optional[dict] = None
    expires_after: Optional[dict] = None


class UpdateVectorStore(_Body):
    name: Optional[str] = Field(None, max_length=256)
    metadata: Optional[dict] = None
    expires_after: Optional[dict] = None


class AddVectorStoreFile(_Body):
    file_id: str = Field(max_length=64)
    attributes: Optional[dict] = None
    chunking_strategy: Optional[dict] = None


class UpdateVectorStoreFile(_Body):
    attributes: Optional[dict]


class FileBatch(_Body):
    file_ids: Optional[list[str]] = Field(None, max_length=2000)
    files: Optional[list[dict]] = Field(None, max_length=2000)
    attributes: Optional[dict] = None
    chunking_strategy: Optional[dict] = None


class RankingOptions(_Body):
    ranker: Literal["none", "auto", "default-2024-11-15"] = "auto"
    score_threshold: float = Field(0.0, ge=0, le=1)


# A hybrid search's fusion (Collection.search's default, reciprocal rank) and the highest score it can give: a
# chunk first in both rankings. A search's `score` is the fused score divided by it.
SEARCH_FUSION = Fusion()


def top_fused_score(fusion: Fusion, text_weight: float) -> float:
    """The fused score of a chunk first in both rankings (config.Fusion): (1 - w) / (k + 1) + w / (k + 1) for
    reciprocal rank, (1 - w) + w for the weighted fusion (each ranking's best normalised to 1)."""
    best = 1.0 / (fusion.k + 1) if fusion.method == "rrf" else 1.0
    return (1 - text_weight) * best + text_weight * best


def search_score(hit, fused: bool, top: float) -> float:
    """OpenAI's score in [0, 1], higher better, in the order of the ranking: a hybrid hit's fused score over the
    highest one (1.0: first in both rankings), a vector hit's cosine similarity (negative ones as 0)."""
    score = float(hit.score) / top if fused else 1.0 - float(hit.distance)
    return min(1.0, max(0.0, score))


class VectorStoreSearch(_Body):
    query: Union[str, list[str]]
    filters: Optional[dict] = None
    max_num_results: int = Field(10, ge=1, le=50)
    ranking_options: Optional[RankingOptions] = None
    rewrite_query: bool = False


def stores_of(request: Request) -> VectorStores:
    return state_of(request).vector_stores


_Limit = Query(20, ge=1, le=100)
_Order = Query("desc", pattern="^(asc|desc)$")


# -- files ------------------------------------------------------------------------------------------

@router.post("/files", summary="Upload a file (multipart: file, purpose), for a vector store",
             responses=documented(400, 401, 404, 408, 409, 413, 415, 422, 503, 507),
             openapi_extra={"requestBody": {"required": True, "content": {
                 "multipart/form-data": {"schema": {"type": "object", "required": ["file", "purpose"], "properties": {
                     "file": {"type": "string", "format": "binary"}, "purpose": {"type": "string"}}}}}}})
async def upload_file(request: Request, key: Key | None = Depends(authenticate)):
    stores = stores_of(request)
    owner = viewer(key)
    await run_in_threadpool(stores.check_upload_room, owner, 0)  # the count, before the bytes arrive
    names: dict[str, str] = {}

    def place(name: str, filename: str):
        if name == "file":
            names["file"] = filename
            return stores.upload_path()
        return None  # purpose, and fields of OpenAI's that are not used (expires_after)

    try:
        files, fields = await spool_multipart(request, Room(request, stores.files_dir), place)
    except OSError as e:
        raise StorageError(f"cannot store the upload: {e}") from e
    if "file" not in files:
        raise http_error(422, "the multipart body has no 'file' part")
    if "purpose" not in fields:
        files["file"].unlink(missing_ok=True)
        raise http_error(422, "the multipart body has no 'purpose' field")
    return _public(await run_in_threadpool(stores.add_file, owner, files["file"], names["file"], fields["purpose"]))


def _public(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in ("owner", "made_ns")}


@router.get("/files", summary="The files uploaded (those this key may see)", responses=documented(401, 422))
def list_files(request: Request, purpose: Optional[str] = None, limit: int = Query(10000, ge=1, le=10000),
               order: str = _Order, after: Optional[str] = None, key: Key | None = Depends(authenticate)):
    page = stores_of(request).list_files(viewer(key), purpose, limit, order, after)
    return {**page, "data": [_public(f) for f in page["data"]]}


@router.get("/files/{file_id}", summary="A file's record", responses=_READ)
def get_file(request: Request, file_id: FileId, key: Key | None = Depends(authenticate)):
    return _public(stores_of(request).file(viewer(key), file_id))


@router.get("/files/{file_id}/content", summary="A file's bytes", response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}},
                             "description": "the file"}, **documented(401, 404, 422)})
def file_content(request: Request, file_id: FileId, key: Key | None = Depends(authenticate)):
    stores = stores_of(request)
    rec = stores.file(viewer(key), file_id)
    return FileResponse(stores.file_data(viewer(key), file_id), media_type="application/octet-stream",
                        filename=rec["filename"])


@router.delete("/files/{file_id}", summary="Delete a file (its chunks stay in the vector stores it was added to)",
               responses=_READ)
def delete_file(request: Request, file_id: FileId, key: Key | None = Depends(authenticate)):
    return stores_of(request).delete_file(viewer(key), file_id)


# -- vector stores ----------------------------------------------------------------------------------

@router.post("/vector_stores", summary="Create a vector store (a collection of its own), optionally with files",
             responses=_ERRORS)
def create_vector_store(body: CreateVectorStore, request: Request, key: Key | None = Depends(authenticate)):
    return stores_of(request).create_store(viewer(key), viewer(key) is not None, body.name, body.metadata,
                                           body.file_ids, body.chunking_strategy, body.expires_after, body.description)


@router.get("/vector_stores", summary="The vector stores (those this key may see)", responses=documented(401, 422))
def list_vector_stores(request: Request, limit: int = _Limit, order: str = _Order, after: Optional[str] = None,
                       before: Optional[str] = None, key: Key | None = Depends(authenticate)):
    return stores_of(request).list_stores(viewer(key), limit, order, after, before)


@router.get("/vector_stores/{vector_store_id}", summary="A vector store", responses=_READ)
def get_vector_store(request: Request, vector_store_id: StoreId, key: Key | None = Depends(authenticate)):
    return stores_of(request).store(viewer(key), vector_store_id)


@router.post("/vector_stores/{vector_store_id}", summary="Change a vector store's name, metadata or expiry",
             responses=_ERRORS)
def update_vector_store(body: UpdateVectorStore, request: Request, vector_store_id: StoreId,
                        key: Key | None = Depends(authenticate)):
    given = {k: getattr(body, k) for k in body.model_fields_set}
    return stores_of(request).update_store(viewer(key), vector_store_id, given)


@router.delete("/vector_stores/{vector_store_id}", summary="Delete a vector store and its collection",
               responses=_READ)
def delete_vector_store(request: Request, vector_store_id: StoreId, key: Key | None = Depends(authenticate)):
    return stores_of(request).delete_store(viewer(key), vector_store_id)


@router.post("/vector_stores/{vector_store_id}/search", summary="The chunks nearest a query, filtered by the "
             "files' attributes", responses=_ERRORS)
async def search_vector_store(body: VectorStoreSearch, request: Request, vector_store_id: StoreId,
                              key: Key | None = Depends(authenticate)):
    state = state_of(request)
    queries = [body.query] if isinstance(body.query, str) else body.query
    if not queries or len(queries) > state.config.max_queries:
        raise http_error(422, f"query must be a string or 1-{state.config.max_queries} strings (max_queries)")
    check_texts(queries, state.config.max_text_chars, "query")
    where = translate_filter(body.filters) if body.filters is not None else None
    ranking = body.ranking_options or RankingOptions()
    coll = await run_in_threadpool(stores_of(request).collection, viewer(key), vector_store_id)
    k = body.max_num_results
    fused = ranking.ranker != "none"  # auto and default-2024-11-15: hybrid; none: the vectors alone
    try:
        res = await state.batcher.search(coll, k, texts=queries, filter=where, mode="hybrid" if fused else "vector",
                                         text_weight=DEFAULT_TEXT_WEIGHT, fusion=SEARCH_FUSION)
    except ServiceClosing as e:
        raise http_error(503, str(e)) from e
    # The score is the ranking's own, so the results come by it, best first, and score_threshold drops those
    # below it (search_score); over several queries a chunk counts with its best score.
    top = top_fused_score(SEARCH_FUSION, DEFAULT_TEXT_WEIGHT)
    best: dict[str, tuple[float, int, object]] = {}
    for hits in res.hits:
        for rank, h in enumerate(hits):
            score = search_score(h, fused, top)
            if score < ranking.score_threshold:
                continue
            if h.id not in best or score > best[h.id][0]:
                best[h.id] = (score, rank, h)
    order = sorted(best.values(), key=lambda t: (-t[0], t[1]))
    data = [{"file_id": h.metadata.get("file_id"), "filename": h.metadata.get("filename", ""), "score": score,
             "attributes": h.metadata.get("attributes") or {}, "content": [{"type": "text", "text": h.text}]}
            for score, _, h in order[:k]]
    return {"object": "vector_store.search_results.page", "search_query": queries, "data": data, "has_more": False,
            "next_page": None}


# -- a vector store's files -------------------------------------------------------------------------

def _polled(view: dict) -> JSONResponse:
    return JSONResponse(view, headers=_POLL_AFTER if view["status"] == "in_progress" else None)


@router.post("/vector_stores/{vector_store_id}/files", summary="Add a file to a vector store: chunked, embedded "
             "and indexed in the background (poll its status)", responses=_ERRORS)
def add_vector_store_file(body: AddVectorStoreFile, request: Request, vector_store_id: StoreId,
                          key: Key | None = Depends(authenticate)):
    return _polled(stores_of(request).add_store_file(viewer(key), vector_store_id, body.file_id, body.attributes,
                                                     body.chunking_strategy))


@router.get("/vector_stores/{vector_store_id}/files", summary="A vector store's files",
            responses=_READ)
def list_vector_store_files(request: Request, vector_store_id: StoreId, filter: FileStatus = None, limit: int = _Limit,
                            order: str = _Order, after: Optional[str] = None, before: Optional[str] = None,
                            key: Key | None = Depends(authenticate)):
    return stores_of(request).list_store_files(viewer(key), vector_store_id, filter, limit, order, after, before)


@router.get("/vector_stores/{vector_store_id}/files/{file_id}", summary="A file of a vector store, with its status",
            responses=_READ)
def get_vector_store_file(request: Request, vector_store_id: StoreId, file_id: FileId,
                          key: Key | None = Depends(authenticate)):
    return _polled(stores_of(request).store_file(viewer(key), vector_store_id, file_id))


@router.post("/vector_stores/{vector_store_id}/files/{file_id}", summary="Change a file's attributes (its chunks' "
             "metadata; nothing is embedded again)", responses=_ERRORS)
def update_vector_store_file(body: UpdateVectorStoreFile, request: Request, vector_store_id: StoreId, file_id: FileId,
                             key: Key | None = Depends(authenticate)):
    return stores_of(request).update_store_file(viewer(key), vector_store_id, file_id, body.attributes)


@router.delete("/vector_stores/{vector_store_id}/files/{file_id}", summary="Remove a file from a vector store (its "
               "chunks are deleted; the file stays)", responses=_READ)
def delete_vector_store_file(request: Request, vector_store_id: StoreId, file_id: FileId,
                             key: Key | None = Depends(authenticate)):
    return stores_of(request).delete_store_file(viewer(key), vector_store_id, file_id)


@router.get("/vector_stores/{vector_store_id}/files/{file_id}/content", summary="A file's chunks as the vector "
            "store holds them", responses=_READ)
def vector_store_file_content(request: Request, vector_store_id: StoreId, file_id: FileId,
                              key: Key | None = Depends(authenticate)):
    chunks = stores_of(request).store_file_chunks(viewer(key), vector_store_id, file_id)
    return {"object": "vector_store.file_content.page", "data": [{"type": "text", "text": t} for t in chunks],
            "has_more": False, "next_page": None}


@router.post("/vector_stores/{vector_store_id}/file_batches", summary="Add several files to a vector store",
             responses=_ERRORS)
def create_file_batch(body: FileBatch, request: Request, vector_store_id: StoreId,
                      key: Key | None = Depends(authenticate)):
    if body.file_ids is None and body.files is None:
        raise InputError("a file batch needs file_ids or files")
    return _polled(stores_of(request).add_batch(viewer(key), vector_store_id, body.model_dump()))


@router.get("/vector_stores/{vector_store_id}/file_batches/{batch_id}", summary="A file batch, with its status",
            responses=_READ)
def get_file_batch(request: Request, vector_store_id: StoreId, batch_id: BatchId,
                   key: Key | None = Depends(authenticate)):
    return _polled(stores_of(request).batch(viewer(key), vector_store_id, batch_id))


@router.post("/vector_stores/{vector_store_id}/file_batches/{batch_id}/cancel", summary="Cancel the files of a "
             "batch still in progress", responses=_ERRORS)
def cancel_file_batch(request: Request, vector_store_id: StoreId, batch_id: BatchId,
                      key: Key | None = Depends(authenticate)):
    return stores_of(request).cancel_batch(viewer(key), vector_store_id, batch_id)


@router.get("/vector_stores/{vector_store_id}/file_batches/{batch_id}/files", summary="The files of a batch",
            responses=_READ)
def list_file_batch_files(request: Request, vector_store_id: StoreId, batch_id: BatchId, filter: FileStatus = None,
                          limit: int = _Limit, order: str = _Order, after: Optional[str] = None,
                          before: Optional[str] = None, key: Key | None = Depends(authenticate)):
    return stores_of(request).list_store_files(viewer(key), vector_store_id, filter, limit, order, after, before,
                                               batch=batch_id)


# -- embeddings ---------------------------------------------------------------------------------------

class EmbeddingsRequest(_Body):
    model: str
    input: Union[str, list[str]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None


@router.post("/embeddings", summary="Texts embedded by one of the service's models (OpenAI's embeddings API): a "
             "client embeds with exactly its collections' model", tags=["OpenAI embeddings"],
             responses=documented(400, 401, 404, 408, 413, 422, 503))
async def embeddings(body: EmbeddingsRequest, request: Request, key: Key | None = Depends(authenticate)):
    state = state_of(request)
    cfg = state.config
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts or len(texts) > cfg.max_documents:
        raise http_error(422, f"input must be a string or 1-{cfg.max_documents} strings (max_documents)")
    if any(not t for t in texts):
        raise http_error(422, "input holds an empty string, which has nothing to embed")
    check_texts(texts, cfg.max_text_chars, "input")
    try:
        name = canonical_name(body.model)
    except ConfigError:
        raise http_error(404, f"model {body.model!r} is not served here; the service's models: "
                              f"{', '.join(model_names())}") from None
    embedder = await run_in_threadpool(get_embedder, name)
    if body.dimensions is not None and body.dimensions != embedder.dim:
        raise http_error(422, f"model {name!r} gives {embedder.dim}-dimensional vectors; dimensions "
                              f"{body.dimensions} cannot be asked of it")
    try:
        vectors = await state.batcher.embed(embedder, texts)
    except ServiceClosing as e:
        raise http_error(503, str(e)) from e
    # The texts' own tokens, as OpenAI counts them (tokenized off the event loop).
    tokens = await run_in_threadpool(lambda: sum(len(embedder.token_spans(t)) for t in texts))
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.tobytes()).decode() if body.encoding_format == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
