"""What routes depend on: the service's state, the caller's key, a collection name the key covers, the open
collection, and the path convertors for ids."""

from __future__ import annotations

from typing import Annotated, Callable

from fastapi import Depends, Path as PathParam, Request
from starlette.convertors import Convertor, register_url_convertor

from fusionrag.retriever.collection import NAME_RE, Collection
from fusionrag.retriever.errors import QuotaError
from fusionrag.server.auth import Key
from fusionrag.server.schemas import NAME_PATTERN
from fusionrag.server.errors import http_error
from fusionrag.server.life import State

class _AnyText(Convertor):
    """A path parameter matched whole: `path` is `.*`, which stops at a newline that the route's `$` then lets
    through, so `…/documents/a%0A` would have answered document `a`."""
    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


# The verbs under /documents/ (POST …/documents/get and …/delete): concrete paths before templated ones, as
# OpenAPI matches them, so a GET there is a 405, not the document of that id (POST …/documents/get reads it).
DOCUMENT_VERBS = ("get", "delete", "count", "metadata")


class _DocumentId(_AnyText):
    regex = rf"(?!(?:{'|'.join(DOCUMENT_VERBS)})\Z)[\s\S]*"


register_url_convertor("document_id", _DocumentId())


def state_of(request: Request) -> State:
    return request.app.state.fusionrag


def authenticate(request: Request) -> Key | None:
    """The caller's key; None when the service runs without keys."""
    ring = state_of(request).keys
    if not ring.enabled:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}
    if scheme.lower() != "bearer" or not token.strip():
        raise http_error(401, "missing API key: send the header 'Authorization: Bearer <key>'", challenge)
    key = ring.lookup(token.strip())
    if key is None:
        raise http_error(401, "invalid API key", challenge)
    return key


def check_name(name: str) -> None:
    if not NAME_RE.fullmatch(name):  # fullmatch: `$` alone would let a trailing newline through
        raise http_error(400, f"invalid collection name {name[:80]!r}: use 1-64 letters, digits, '_', '.' or '-', "
                          "starting with a letter or digit")


def allowed(name: Annotated[str, PathParam(json_schema_extra={"pattern": NAME_PATTERN})],
            key: Key | None = Depends(authenticate)) -> str:
    """The collection name of the path, valid and open to this key."""
    check_name(name)
    if key is not None and not key.allows(name):
        raise http_error(403, f"this API key has no rights to collection {name!r}")
    return name


def collection_quota(request: Request, key: Key | None) -> Callable[[list[str]], None] | None:
    """The check a create or restore by this key makes under the catalog's lock: a key restricted to some
    collections may hold at most max_collections_per_key of those its patterns cover."""
    limit = state_of(request).config.max_collections_per_key
    if key is None or key.unrestricted or not limit:
        return None

    def allow(names: list[str]) -> None:
        mine = sum(key.allows(n) for n in names)
        if mine >= limit:
            raise QuotaError(f"this API key's collections ({', '.join(key.patterns)}) number {mine}, its limit "
                             "(max_collections_per_key): delete one before making another")
    return allow


def open_collection(request: Request, name: str = Depends(allowed)) -> Collection:
    state = state_of(request)
    with state.lock:
        building = name in state.building
    if building:
        raise http_error(503, f"collection {name!r} is being built; /readyz says when it is done", {"Retry-After": "5"})
    return state.catalog.get(name)
