"""Routes of documents: upsert, get one or many, page through, delete by id or filter."""

from __future__ import annotations

from typing import Annotated, Callable

from fastapi import APIRouter, Depends, Path as PathParam, Query, Request
from fastapi.exceptions import HTTPException
from starlette.concurrency import run_in_threadpool

from fusionrag.retriever.collection import Document
from fusionrag.retriever.collection.contract import CollectionContract
from fusionrag.server.bodies import Body, read_body, validate
from fusionrag.server.schemas import (Counted, CountRequest, Deleted, DeleteRequest, Documents, DocumentsPage, GetRequest,
                                      MetadataRequest, Updated, UpsertRequest)
from fusionrag.server.errors import documented, http_error, json_body
from fusionrag.server.deps import DOCUMENT_VERBS, open_collection, state_of
from fusionrag.server.responses import VectorJSON, document_json
from fusionrag.server.requests import check_texts, embedder_of, over_limit, read_json


router = APIRouter(prefix="/v1")


@router.post("/collections/{name}/documents", summary="Add or replace documents (by id); returns their ids",
         openapi_extra=json_body(UpsertRequest), responses=documented(400, 401, 403, 404, 409, 413, 422, 503, 507))
async def upsert_documents(request: Request, coll: CollectionContract = Depends(open_collection)):
    cfg = state_of(request).config

    def document(b: Body, n: int, i: int):
        def wrong_dim(d: int) -> HTTPException:
            return http_error(422, f"documents[{n}].vector has dimension {d}, collection {coll.name!r} "
                               f"has dimension {coll.dim}")
        return b.obj(i, 2, {"vector": lambda j: b.vector(j, coll.dim, ("documents", n, "vector"), wrong_dim,
                                                         nullable=True)})

    too_many = over_limit("documents", cfg.max_documents, "max_documents")
    data = await read_json(request, lambda b: {
        "documents": lambda i: b.array(i, 1, lambda n, j: document(b, n, j), cfg.max_documents, too_many)})
    given = data.get("documents")
    vectors = [d.pop("vector", None) if isinstance(d, dict) else None for d in given] \
        if isinstance(given, list) else []
    docs = validate(UpsertRequest, data).documents
    check_texts([d.text for d in docs], cfg.max_text_chars, "documents.text")
    for i, (d, v) in enumerate(zip(docs, vectors)):
        if d.text is None and v is None:
            raise http_error(422, f"documents[{i}]: a document needs a text, a vector, or both")
    to_embed = [i for i, v in enumerate(vectors) if v is None]
    embedder = embedder_of(coll, "documents without a vector") if to_embed else None

    def write() -> list[str]:
        if to_embed:
            for i, vec in zip(to_embed, embedder.embed([docs[i].text for i in to_embed])):
                vectors[i] = vec
        return coll.upsert([Document(id=d.id, text=d.text, vector=v, metadata=d.metadata)
                            for d, v in zip(docs, vectors)])

    return {"ids": await run_in_threadpool(write)}


@router.get("/collections/{name}/documents/{doc_id:document_id}", summary="One document by id (ids 'get' and "
        "'delete' through POST …/documents/get)", responses=documented(400, 401, 403, 404, 405, 422, 503))
def get_document(doc_id: Annotated[str, PathParam(json_schema_extra={"not": {"enum": list(DOCUMENT_VERBS)}})],
                 vector: bool = False, coll: CollectionContract = Depends(open_collection)):
    found = coll.get([doc_id], with_vectors=vector)
    if not found:
        raise http_error(404, f"no document {doc_id!r} in collection {coll.name!r}")
    return VectorJSON(document_json(found[0], vector))


def _ids_reader(request: Request) -> Callable[[Body], dict]:
    """The body's `ids`, refused at the one past max_documents."""
    limit = state_of(request).config.max_documents
    too_many = over_limit("ids", limit, "max_documents")
    return lambda b: {"ids": lambda i: b.array(i, 1, lambda _, j: b.value(j, 2), limit, too_many)}


@router.post("/collections/{name}/documents/get", summary="Documents by id, in the order asked; ids not found are left "
         "out", openapi_extra=json_body(GetRequest),
         responses={200: {"model": Documents}, **documented(400, 401, 403, 404, 413, 422, 503)})
async def get_documents(request: Request, coll: CollectionContract = Depends(open_collection)):
    body = validate(GetRequest, await read_json(request, _ids_reader(request)))
    docs = await run_in_threadpool(coll.get, body.ids, body.with_vectors)
    return VectorJSON({"documents": [document_json(d, body.with_vectors) for d in docs]})


DEFAULT_PAGE = 100  # documents per page when `limit` is not given (at most max_documents)
PageLimit = Annotated[int, Query(ge=1, description="documents per page, at most max_documents")]
# The internal row to continue after: rows are never reused, so the order is stable while writes go on.
# 19 digits: a sharded collection's documents named by a string have ids from 2**62 up.
Cursor = Annotated[str, Query(pattern=r"^[0-9]{1,19}$", description="the next_cursor of the page before; left "
                                                                    "out: the first page")]
# Read by the route itself: FastAPI cannot declare a query parameter whose value is JSON.
_FILTER_PARAMETER = {"name": "filter", "in": "query", "required": False,
                     "description": "metadata filter as JSON, e.g. {\"year\": {\"$gte\": 2020}} (URL-encoded)",
                     "content": {"application/json": {"schema": {"type": "object"}}}}


def query_filter(request: Request) -> dict | None:
    """The `filter` query parameter, read at the bounded cost of a body (server/bodies.py)."""
    text = request.query_params.get("filter")
    if text is None:
        return None
    if not text.lstrip().startswith("{"):
        raise http_error(422, "the filter query parameter must be a JSON object")
    try:
        return Body(text.encode()).document({})
    except HTTPException as e:
        raise http_error(e.status_code, f"the filter query parameter: {e.detail}") from None


@router.post("/collections/{name}/documents/count", summary="How many documents a filter passes (all without one)",
         openapi_extra=json_body(CountRequest, required=False),
         responses={200: {"model": Counted}, **documented(400, 401, 403, 404, 413, 422, 503)})
async def count_documents(request: Request, coll: CollectionContract = Depends(open_collection)):
    body = Body(await read_body(request))
    data = body.document({}) if body.b.strip() else {}  # no body: count them all
    flt = validate(CountRequest, data).filter

    def count() -> dict:
        out = {"count": coll.count(flt)}
        if flt is not None and (warnings := coll.filter_warnings(flt)):
            out["warnings"] = warnings
        return out
    return await run_in_threadpool(count)


@router.get("/collections/{name}/documents", summary="Page through the documents (those a filter passes) in a stable "
        "order: each page's next_cursor gives the next", openapi_extra={"parameters": [_FILTER_PARAMETER]},
        responses={200: {"model": DocumentsPage}, **documented(400, 401, 403, 404, 409, 413, 422, 503)})
def list_documents(request: Request, limit: PageLimit = DEFAULT_PAGE, cursor: Cursor = None,
                   with_vectors: bool = False, coll: CollectionContract = Depends(open_collection)):
    cfg = state_of(request).config
    if "limit" not in request.query_params:
        limit = min(limit, cfg.max_documents)
    elif limit > cfg.max_documents:
        raise http_error(422, f"limit is {limit}, at most {cfg.max_documents} allowed (max_documents)")
    flt = query_filter(request)
    return page_answer(coll, limit, cursor, flt, with_vectors)


def page_answer(coll, limit: int, cursor: str | None, flt: dict | None, with_vectors: bool) -> VectorJSON:
    """One page of a collection's documents (a Collection's or a ShardedCollection's) as the API answers it."""
    if cursor and int(cursor) >= 1 << 63:
        raise http_error(422, f"cursor {cursor} is no page's next_cursor")
    docs, after = coll.scroll(limit, int(cursor) if cursor else -1, flt, with_vectors)
    out = {"documents": [document_json(d, with_vectors) for d in docs],
           "next_cursor": None if after is None else str(after)}
    if flt is not None and (warnings := coll.filter_warnings(flt)):
        out["warnings"] = warnings
    return VectorJSON(out)


@router.post("/collections/{name}/documents/metadata", summary="Change documents' metadata alone (their text, vector "
         "and place in the index stay), merged or replaced, in one write", openapi_extra=json_body(MetadataRequest),
         responses={200: {"model": Updated}, **documented(400, 401, 403, 404, 409, 413, 422, 503, 507)})
async def set_metadata(request: Request, coll: CollectionContract = Depends(open_collection)):
    cfg = state_of(request).config
    too_many = over_limit("documents", cfg.max_documents, "max_documents")
    data = await read_json(request, lambda b: {
        "documents": lambda i: b.array(i, 1, lambda n, j: b.value(j, 2), cfg.max_documents, too_many)})
    body = validate(MetadataRequest, data)
    updates = {d.id: d.metadata for d in body.documents}
    if len(updates) < len(body.documents):
        twice = next(d.id for i, d in enumerate(body.documents) if d.id in {e.id for e in body.documents[:i]})
        raise http_error(422, f"document {twice!r} is given twice: send one metadata for each id")
    return {"updated": await run_in_threadpool(coll.set_metadata, updates, body.merge)}


@router.post("/collections/{name}/documents/delete", summary="Delete documents by id (unknown ids are ignored) or by "
         "filter (in one write)", openapi_extra=json_body(DeleteRequest),
         responses={200: {"model": Deleted}, **documented(400, 401, 403, 404, 409, 413, 422, 503, 507)})
@router.delete("/collections/{name}/documents", summary="Delete documents by id (unknown ids are ignored) or by filter "
           "(in one write)", openapi_extra=json_body(DeleteRequest),
           responses={200: {"model": Deleted}, **documented(400, 401, 403, 404, 409, 413, 422, 503, 507)})
async def delete_documents(request: Request, coll: CollectionContract = Depends(open_collection)):
    data = await read_json(request, _ids_reader(request))
    body = validate(DeleteRequest, data)
    if ("ids" in data) == ("filter" in data):
        raise http_error(422, "give exactly one of 'ids' and 'filter'")
    if body.filter is not None:
        return {"deleted": await run_in_threadpool(coll.delete_where, body.filter)}
    return {"deleted": await run_in_threadpool(coll.delete, body.ids)}
