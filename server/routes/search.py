"""The search route."""

from __future__ import annotations

import re
import time

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import HTTPException
from starlette.concurrency import run_in_threadpool

from fusionrag.retriever.collection.config import Fusion
from fusionrag.retriever.collection.contract import CollectionContract
from fusionrag.retriever.collection.filters import compile_filter
from fusionrag.server.batcher import ServiceClosing
from fusionrag.server.bodies import validate
from fusionrag.server.deps import open_collection, state_of
from fusionrag.server.errors import documented, http_error, json_body
from fusionrag.server.requests import (check_texts, check_vectors, embedder_of, over_limit, query_words, read_json,
                                       search_params, search_queries)
from fusionrag.server.responses import VectorJSON, hit_json, plain
from fusionrag.server.groups import first_depth, group_hits, next_depth
from fusionrag.server.schemas import GroupSearchRequest, RecommendRequest, SearchRequest

router = APIRouter(prefix="/v1")


async def _read_queries(request: Request, coll: CollectionContract, cfg, model):
    """A search body (a search's, a grouped search's: `model`) read and validated: (body, its vector rows or None,
    its queries). Rows are read in C++ and refused while the body is read (a row's length, too many queries)."""
    too_many = over_limit("queries", cfg.max_queries, "max_queries")
    words = query_words(coll, "query vectors")

    def wrong_dim(d: int) -> HTTPException:  # a row's length, refused while the body is read
        return http_error(422, words.dimension.format(got=d, dim=coll.dim))

    data = await read_json(request, lambda b: {
        "vectors": lambda i: b.vectors(i, coll.dim, "vectors", wrong_dim, cfg.max_queries, too_many),
        "texts": lambda i: b.array(i, 1, lambda _, j: b.value(j, 2), cfg.max_queries, too_many)})
    rows = data.pop("vectors", None)
    # Vectors that are not a list are the model's to refuse, with its message.
    body = validate(model, data if isinstance(rows, (list, type(None))) else {**data, "vectors": rows})
    return body, rows, search_queries(body.mode, rows, body.texts)


@router.post("/collections/{name}/search", summary="Top-k documents of each query vector or text",
         openapi_extra=json_body(SearchRequest), responses=documented(400, 401, 403, 404, 409, 413, 422, 503))
async def search(request: Request, coll: CollectionContract = Depends(open_collection)):
    state = state_of(request)
    cfg = state.config
    body, rows, queries = await _read_queries(request, coll, cfg, SearchRequest)
    if body.k > cfg.max_k:
        raise http_error(422, f"k is {body.k}, at most {cfg.max_k} allowed (max_k)")
    if body.k + body.offset > cfg.max_k:
        raise http_error(422, f"k + offset is {body.k + body.offset}, at most {cfg.max_k} allowed (max_k)")
    params = search_params(body.params) if body.params else None
    if body.filter is not None:
        compile_filter(body.filter)  # a bad filter fails its own request here, not the batch it would join
    vectors = None
    if rows is not None:
        vectors = check_vectors(np.stack(rows), coll, "query vectors")
    if body.texts is not None:
        check_texts(body.texts, cfg.max_text_chars, "texts")
        if vectors is None and body.mode != "text":
            embedder_of(coll, "queries")
    t = time.perf_counter()
    try:
        res = await state.batcher.search(coll, body.k + body.offset, filter=body.filter, params=params, vectors=vectors,
                                         texts=body.texts, mode=body.mode, text_weight=body.text_weight,
                                         fusion=Fusion(body.fusion.method, body.fusion.k, body.fusion.question_share)
                                         if body.fusion else None,
                                         with_vectors=body.with_vectors, partial=body.partial)
    except ServiceClosing as e:
        raise http_error(503, str(e)) from e
    state.metrics.recent.add(time.perf_counter() - t, len(queries),
                             sum(int(s.get("pages_read", 0)) for s in res.stats),
                             sum(int(s.get("pages_buffered", 0)) for s in res.stats))
    found = res.hits
    if body.offset or body.score_threshold is not None:  # a page of each ranking, and a floor on its scores
        low = body.score_threshold
        found = [[h for h in hits[body.offset:] if low is None or h.score >= low] for hits in found]
    out = {"results": [[hit_json(h, body.with_vectors) for h in hits] for hits in found]}
    if res.missing_lists is not None:  # a sharded collection: whether a shard down left lists unsearched, and which
        out["partial"] = res.partial
        if res.partial:
            out["missing_lists"], out["missing_shards"] = res.missing_lists, res.missing_shards
    # A filter comparing a field with values of a type it is not held as matches nothing: said, not silent.
    if body.filter is not None and (warnings := await run_in_threadpool(coll.filter_warnings, body.filter)):
        out["warnings"] = warnings
    if body.stats:
        out["stats"] = [plain(s) for s in res.stats]
    return VectorJSON(out)


@router.post("/collections/{name}/recommend", summary="Documents like some stored ones and unlike others, by their ids "
             "(Qdrant's recommend, average-vector strategy)", openapi_extra=json_body(RecommendRequest),
             responses=documented(400, 401, 403, 404, 409, 413, 422, 503))
async def recommend(request: Request, coll: CollectionContract = Depends(open_collection)):
    """The query is 2 x the mean of the positive examples' vectors - the mean of the negative ones' (the positive
    mean alone without negatives; under cosine each example made unit length first), searched as a query vector;
    the examples themselves are left out of the hits."""
    state = state_of(request)
    cfg = state.config
    body = validate(RecommendRequest, await read_json(request, lambda b: {}))
    examples = list(dict.fromkeys(body.positive + body.negative))
    if len(examples) > cfg.max_documents:
        raise http_error(422, f"{len(examples)} examples, at most {cfg.max_documents} allowed (max_documents)")
    if body.k + len(examples) > cfg.max_k:
        raise http_error(422, f"k and the examples are {body.k + len(examples)} hits to look for, at most "
                              f"{cfg.max_k} allowed (max_k)")
    params = search_params(body.params) if body.params else None
    if body.filter is not None:
        compile_filter(body.filter)
    docs = await run_in_threadpool(coll.get, examples, True)
    found = {d.id: np.asarray(d.vector, dtype=np.float64) for d in docs}
    missing = [i for i in examples if i not in found]
    if missing:
        raise http_error(404, f"no document {missing[0]!r} in collection {coll.name!r}"
                              + (f" (and {len(missing) - 1} more examples)" if len(missing) > 1 else ""))

    def mean(ids: list[str]) -> np.ndarray:
        rows = np.stack([found[i] for i in ids])
        if coll.metric == "cosine":
            rows /= np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-300)
        return rows.mean(axis=0)

    query = mean(body.positive)
    if body.negative:
        query = 2 * query - mean(body.negative)
    vectors = check_vectors(query[None, :].astype(np.float32), coll, "the recommendation's query")
    try:
        res = await state.batcher.search(coll, body.k + len(examples), filter=body.filter, params=params,
                                         vectors=vectors, with_vectors=body.with_vectors)
    except ServiceClosing as e:
        raise http_error(503, str(e)) from e
    skip = set(examples)
    hits = [h for h in res.hits[0] if h.id not in skip][:body.k]
    return VectorJSON({"results": [hit_json(h, body.with_vectors) for h in hits]})


@router.post("/collections/{name}/search/groups", summary="Hits grouped by a metadata field: the best `limit` groups "
             "of each query, each its best `group_size` hits sharing one value of `group_by` (Qdrant's search "
             "groups)", openapi_extra=json_body(GroupSearchRequest),
             responses=documented(400, 401, 403, 404, 409, 413, 422, 503))
async def search_groups(request: Request, coll: CollectionContract = Depends(open_collection)):
    """Each query's ranking (as a search makes it, with the filter) is grouped best first (server/groups.py): a
    document with a list under the field is in each of its values' groups, one without a string or integer value
    there in none. The ranking is searched to a depth of 2 x limit x group_size first (at most max_k), then 4 times
    deeper each time until its groups fill, the ranking ends (fewer hits than the depth), or the depth is max_k."""
    state = state_of(request)
    cfg = state.config
    body, rows, queries = await _read_queries(request, coll, cfg, GroupSearchRequest)
    if body.limit * body.group_size > cfg.max_k:
        raise http_error(422, f"limit x group_size is {body.limit * body.group_size} hits, at most {cfg.max_k} "
                              "allowed (max_k)")
    params = search_params(body.params) if body.params else None
    if body.filter is not None:
        compile_filter(body.filter)
    vectors = None
    if rows is not None:
        vectors = check_vectors(np.stack(rows), coll, "query vectors")
    if body.texts is not None:
        check_texts(body.texts, cfg.max_text_chars, "texts")
    fusion = Fusion(body.fusion.method, body.fusion.k, body.fusion.question_share) if body.fusion else None
    try:
        if vectors is None and body.mode != "text":  # embedded once, for every depth searched
            embedded = await state.batcher.embed(embedder_of(coll, "queries"), body.texts)
            vectors = check_vectors(np.asarray(embedded, dtype=np.float32), coll, "the texts' vectors")
        texts = body.texts if body.mode != "vector" else None
        answers: list = [None] * len(queries)
        pending, k = list(range(len(queries))), first_depth(body.limit, body.group_size, cfg.max_k)
        partial, last = False, None
        while pending:
            which = np.asarray(pending)
            res = await state.batcher.search(
                coll, k, filter=body.filter, params=params, mode=body.mode, text_weight=body.text_weight,
                vectors=None if vectors is None else vectors.rows(which),
                texts=None if texts is None else [texts[i] for i in pending], fusion=fusion,
                with_vectors=body.with_vectors, partial=body.partial)
            if res.missing_lists is not None and (last is None or res.partial):  # a sharded collection's
                partial, last = partial or res.partial, res
            deeper = []
            for i, hits in zip(pending, res.hits):
                answers[i], full = group_hits(hits, body.group_by, body.limit, body.group_size)
                if not full and len(hits) >= k and k < cfg.max_k:
                    deeper.append(i)
            pending, k = deeper, next_depth(k, cfg.max_k)
    except ServiceClosing as e:
        raise http_error(503, str(e)) from e
    out = {"results": [[{"id": value, "hits": [hit_json(h, body.with_vectors) for h in hits]}
                        for value, hits in groups] for groups in answers]}
    if last is not None:  # a sharded collection, as its search answers
        out["partial"] = partial
        if partial:
            out["missing_lists"], out["missing_shards"] = last.missing_lists, last.missing_shards
    warnings = []
    if body.filter is not None:
        warnings += await run_in_threadpool(coll.filter_warnings, body.filter)
    if not all(answers):  # a query without a group: a misspelt field, or one of other types, said
        warnings += [_group_warning(body.group_by, w) for w in await run_in_threadpool(
            coll.filter_warnings, {body.group_by: {"$in": ["", 0]}})]
    if warnings:
        out["warnings"] = warnings
    return VectorJSON(out)


def _group_warning(field: str, said: str) -> str:
    """A filter's warning on `field` (filters.filter_warnings) in a group search's words."""
    if "no document holds" not in said:  # held as other types only
        return f"group_by {field!r}: " + said.split(": ", 1)[-1]
    near = re.search(r"the documents hold ('.*?)\)", said)
    return (f"group_by {field!r}: no document holds a string or number under it, so no hit is in a group (a "
            f"misspelled field?{' the documents hold ' + near.group(1) if near else ''})")
