"""What routes depend on: the service's state, the caller's key, a collection name the key reaches (`reaches`,
the one rule of which key may use which collection), the open collection, and the path convertors for ids."""

from __future__ import annotations

from typing import Annotated, Callable

from fastapi import Depends, Path as PathParam, Request
from starlette.concurrency import run_in_threadpool
from starlette.convertors import Convertor, register_url_convertor

from fusionrag.retriever.collection import NAME_RE
from fusionrag.retriever.collection.contract import CollectionContract
from fusionrag.retriever.errors import QuotaError
from fusionrag.server.auth import Key
from fusionrag.server.schemas import NAME_PATTERN
from fusionrag.server.errors import http_error
from fusionrag.server.life import State
from fusionrag.server.vector_stores import STORE_RE, VectorStores

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


# The dependencies routes declare (authenticate, allowed, creatable, open_collection) are coroutines: FastAPI runs
# a plain function dependency in its thread pool, a thread hop (and two GIL hand-offs) per dependency per request,
# which cost more than the checks themselves. Each is a check in memory; open_collection goes to a thread only to
# open a collection that is not open yet. Their plain twins (key_of, ...) serve code that calls them directly.

def key_of(request: Request) -> Key | None:
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


async def authenticate(request: Request) -> Key | None:
    """The caller's key (key_of), as a route's dependency."""
    return key_of(request)


def check_name(name: str) -> None:
    if not NAME_RE.fullmatch(name):  # fullmatch: `$` alone would let a trailing newline through
        raise http_error(400, f"invalid collection name {name[:80]!r}: use 1-64 letters, digits, '_', '.' or '-', "
                          "starting with a letter or digit")


def viewer(key: Key | None) -> str | None:
    """Whose files and vector stores a key owns and sees: a key restricted to some collections its own (by its
    digest); the service's keys that cover every collection, or no keys at all, every one (None)."""
    return None if key is None or key.unrestricted else key.digest.hex()


def reaches(state: State, key: Key | None, name: str) -> bool:
    """Whether this key may use collection `name` through the collection routes and see it in any listing: the
    one rule every route's name check, every listing of names and the per-key count use. Without keys, or with
    a key unrestricted, every collection. A restricted key: those its patterns cover, except that a name of a
    vector store's form (`vs_` and 24 hex digits) is reached only by the key that owns that store (whatever
    other keys' patterns cover), and a name of that form that no store has (an unrestricted key made it) by no
    restricted key."""
    if key is None or key.unrestricted:
        return True
    if not key.allows(name):
        return False
    if STORE_RE.fullmatch(name):
        stores = state.vector_stores  # a service over a sharded collection has none
        return isinstance(stores, VectorStores) and stores.owner_of(name) == viewer(key)
    return True


def resolve(state: State, name: str) -> str:
    """The collection a name stands for: an alias's target (Catalog.resolve), else the name."""
    return state.catalog.resolve(name)


def check_reaches(request: Request, name: str, key: Key | None) -> str:
    """The collection the name of the path stands for (itself, or an alias's target), the name valid and both it
    and the collection open to this key (400, 403): an alias never lets a key reach a collection it could not reach
    by name."""
    check_name(name)
    state = state_of(request)
    target = resolve(state, name)
    if not reaches(state, key, name):
        raise http_error(403, f"this API key has no rights to collection {name!r}")
    if target != name and not reaches(state, key, target):
        # The words of a name the key does not cover: they say nothing of what the alias points to.
        raise http_error(403, f"this API key has no rights to collection {name!r}")
    return target


async def allowed(request: Request, name: Annotated[str, PathParam(json_schema_extra={"pattern": NAME_PATTERN})],
                  key: Key | None = Depends(authenticate)) -> str:
    """check_reaches as a route's dependency."""
    return check_reaches(request, name, key)


def check_new_name(name: str, key: Key | None) -> None:
    """A name this key may create (or restore) a collection under: valid, covered by its patterns, and, for a
    key restricted to some collections, not of a vector store's form, which only POST /v1/vector_stores makes
    (the answer is the same whether a store of that id exists or not)."""
    check_name(name)
    if key is not None and not key.allows(name):
        raise http_error(403, f"this API key has no rights to collection {name!r}")
    if key is not None and not key.unrestricted and STORE_RE.fullmatch(name):
        raise http_error(403, f"collection names of the form vs_<24 hex digits> are reserved for vector stores "
                              f"(POST /v1/vector_stores); this API key cannot create {name!r}")


async def creatable(name: Annotated[str, PathParam(json_schema_extra={"pattern": NAME_PATTERN})],
                    key: Key | None = Depends(authenticate)) -> str:
    """The collection name of the path, for a collection this key would make (a restore): see check_new_name."""
    check_new_name(name, key)
    return name


def collection_quota(request: Request, key: Key | None) -> Callable[[list[str]], None] | None:
    """The check a create or restore by this key makes under the catalog's lock: a key restricted to some
    collections may hold at most max_collections_per_key of those it reaches (another key's stores are not
    counted, nor shown in the refusal's count)."""
    state = state_of(request)
    limit = state.config.max_collections_per_key
    if key is None or key.unrestricted or not limit:
        return None

    def allow(names: list[str]) -> None:
        mine = sum(reaches(state, key, n) for n in names)
        if mine >= limit:
            raise QuotaError(f"this API key's collections ({', '.join(key.patterns)}) number {mine}, its limit "
                             "(max_collections_per_key): delete one before making another")
    return allow


def collection_of(request: Request, name: str) -> CollectionContract:
    """The open collection of a name this key may use (opened if it is not: files are read)."""
    state = state_of(request)
    with state.lock:
        building = name in state.building
    if building:
        raise http_error(503, f"collection {name!r} is being built; /readyz says when it is done", {"Retry-After": "5"})
    return state.catalog.get(name)


async def open_collection(request: Request, name: str = Depends(allowed)) -> CollectionContract:
    """collection_of as a route's dependency: an open collection is taken on the event loop (a dict read; a set's
    membership read without the lock, atomic under the GIL), one still to open in a thread."""
    state = state_of(request)
    col = state.catalog.peek(name)
    if col is not None and name not in state.building:
        return col
    return await run_in_threadpool(collection_of, request, name)
