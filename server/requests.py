"""Reading and checking what requests carry, beyond their body's model: search parameters, texts, vectors,
the embedding model, and bodies read with their limits (server/bodies.py)."""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Callable

import numpy as np
from fastapi import Request
from fastapi.exceptions import HTTPException

from fusionrag.retriever.collection.contract import CollectionContract
from fusionrag.retriever.collection.embedding import get_embedder
from fusionrag.retriever.collection.values import check_text
from fusionrag.retriever.engine.config import SearchOverrides, SearchParams
from fusionrag.retriever.engine.queries import PreparedQueries, QueryWords, prepare_queries
from fusionrag.retriever.errors import InputError
from fusionrag.server.bodies import Body, read_body
from fusionrag.server.errors import http_error


@functools.cache
def _kinds() -> dict[str, type]:
    """SearchParams' knobs and their types, read once."""
    return {f.name: type(f.default) for f in fields(SearchParams)}


def search_params(given: dict) -> SearchOverrides:
    """A request's search knobs, checked, to apply over the collection index's own defaults (its calibrated ones)."""
    kinds = _kinds()
    for name, value in given.items():
        kind = kinds.get(name)
        ok = kind is None or (isinstance(value, kind) and not isinstance(value, bool)) or \
            (kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise http_error(422, f"params.{name} must be a{'n' if kind is int else ''} {kind.__name__}, got {value!r}")
    return SearchOverrides.of(given)  # unknown names and ranges: ConfigError, a 422


def check_texts(texts, limit: int, what: str) -> None:
    """Texts a body brings, refused (422) before anything embeds or stores them: longer than max_text_chars, or
    not valid Unicode (a lone surrogate, which JSON's \\ud800 escape lets through: values.check_text)."""
    for i, t in enumerate(texts):
        if t is not None and len(t) > limit:
            raise http_error(422, f"{what}[{i}] has {len(t)} characters, at most {limit} allowed (max_text_chars)")
        if t is not None:
            try:
                check_text(t, f"{what}[{i}]")
            except InputError as e:
                raise http_error(422, str(e)) from None


def search_queries(mode: str, vectors: list | None, texts: list | None) -> list:
    """A search body's queries as its mode takes them: its vectors, or its texts where it gives none (422 where
    they do not fit the mode, or there are none)."""
    if mode == "vector" and (vectors is None) == (texts is None):
        raise http_error(422, "give exactly one of 'vectors' and 'texts'")
    if mode != "vector" and texts is None:
        raise http_error(422, f"mode {mode!r} needs 'texts'")
    if mode == "text" and vectors is not None:
        raise http_error(422, "mode 'text' searches by 'texts' alone: give no 'vectors'")
    if mode == "hybrid" and vectors is not None and len(vectors) != len(texts):
        raise http_error(422, f"mode 'hybrid' needs one text per query vector, got {len(texts)} for {len(vectors)}")
    queries = vectors if vectors is not None else texts
    if not queries:
        raise http_error(422, "no queries: 'vectors' or 'texts' is empty")
    return queries


def query_words(coll: CollectionContract, what: str) -> QueryWords:
    """The API's words for query vectors that `coll` cannot search."""
    return _query_words(coll.name, what)


@functools.lru_cache(maxsize=1024)
def _query_words(name: str, what: str) -> QueryWords:  # made once a collection (five formatted strings a search)
    name = repr(name).replace("{", "{{").replace("}", "}}")
    return QueryWords(
        numeric=f"{what} must be numbers, got {{detail}}",
        shape=f"{what} have dimension ragged, collection {name} has dimension {{dim}}",
        dimension=f"{what} have dimension {{got}}, collection {name} has dimension {{dim}}",
        empty=f"no {what} given",
        row=f"{what}[{{row}}] {{why}}",
    )


def check_vectors(vectors: np.ndarray, coll: CollectionContract, what: str) -> PreparedQueries:
    """What Collection.search would refuse, refused here (queries.prepare_queries, in the API's words): in a
    batch, one bad query would fail its neighbours. The queries come back prepared (unit rows under cosine),
    so that neither the collection nor its index checks or normalises them again."""
    try:
        return prepare_queries(vectors, coll.dim, coll.metric, query_words(coll, what))
    except InputError as e:
        raise http_error(422, str(e)) from None


def embedder_of(coll: CollectionContract, what: str):
    if not coll.embedding:
        raise http_error(422, f"collection {coll.name!r} has no embedding model, so {what} need vectors")
    return get_embedder(coll.embedding)


async def read_json(request: Request, readers: Callable[[Body], dict]) -> dict:
    """The JSON object of the body, the members named by readers(body) read by theirs; its bytes go on return."""
    body = Body(await read_body(request))
    return body.document(readers(body))


def over_limit(what: str, limit: int, setting: str) -> Callable[[], HTTPException]:
    return lambda: http_error(422, f"more than {limit} {what} in one request, at most {limit} allowed ({setting})")
