"""Routes of the collections: list, create, info, drop, and the live figures of the web page."""

from __future__ import annotations

import logging
import threading

from fastapi import APIRouter, Depends, Request

from fusionrag.retriever.collection.embedding import canonical_name, get_embedder
from fusionrag.retriever.errors import NotFoundError, UnavailableError
from fusionrag.server.auth import Key
from fusionrag.server.deps import (allowed, authenticate, check_name, check_new_name, collection_of,
                                   collection_quota, key_of, open_collection, reaches, state_of)
from fusionrag.server.errors import documented, http_error
from fusionrag.server.schemas import AliasActions, CreateCollection
from fusionrag.server.vector_stores import STORE_RE

log = logging.getLogger("fusionrag.server")

router = APIRouter(prefix="/v1")


@router.get("/collections", summary="List the collections (those this key may use)", responses=documented(401))
def list_collections(request: Request, key: Key | None = Depends(authenticate)):
    state = state_of(request)
    with state.lock:
        building = set(state.building)
    out = []
    for name in state.catalog.names():
        if reaches(state, key, name):
            try:
                coll = state.catalog.get(name)
                # "building": there, but its search answers 503 until the build is done (the demo's first start)
                out.append({"name": name, "state": "building" if name in building else "ready", "dimension": coll.dim,
                            "metric": coll.metric, "embedding": coll.embedding, "count": len(coll)})
            except UnavailableError:
                out.append(state.failed_info(name))
            except NotFoundError:  # dropped meanwhile
                pass
    return {"collections": out}


@router.post("/collections", status_code=201, summary="Create an empty collection",
         responses=documented(400, 401, 403, 409, 413, 422, 507))
def create_collection(body: CreateCollection, request: Request, key: Key | None = Depends(authenticate)):
    check_new_name(body.name, key)
    dim = body.dimension
    embedding = canonical_name(body.embedding) if body.embedding else None
    if embedding:
        model_dim = get_embedder(embedding).dim
        if dim is not None and dim != model_dim:
            raise http_error(422, f"dimension {dim} does not fit embedding model {embedding} (dimension {model_dim})")
        dim = model_dim
    analyzer = body.text_analyzer.model_dump() if body.text_analyzer else None
    info = state_of(request).catalog.create(body.name, dim, body.metric, embedding,
                                            allow=collection_quota(request, key), text_analyzer=analyzer,
                                            shards=body.shards).info()
    if embedding:  # loaded now, in the background, rather than by the first write or search that needs it
        threading.Thread(target=_preload, args=(embedding,), name="embedder-load", daemon=True).start()
    return info


def _preload(model: str) -> None:
    try:
        get_embedder(model).load()
    except Exception:  # noqa: BLE001 - the first request that needs the model gets the error
        log.exception("loading embedding model %r failed", model)


@router.get("/collections/{name}", summary="Size, tiers, memory per tier and build state of a collection; the "
                                      "reason when it failed to open",
        responses=documented(400, 401, 403, 404, 422, 503))
def collection_info(request: Request, name: str = Depends(allowed)):
    state = state_of(request)
    if name in state.catalog.failed():
        return state.failed_info(name)
    return collection_of(request, name).info()


@router.delete("/collections/{name}", summary="Delete a collection and its files",
           responses=documented(400, 401, 403, 404, 422, 503, 507))
def drop_collection(request: Request, name: str = Depends(allowed)):
    state_of(request).catalog.drop(name)
    return {"deleted": name}


@router.post("/aliases", summary="Create, switch, rename and delete collection aliases: the actions applied together, "
             "or none of them (Qdrant's POST /collections/aliases)",
             responses=documented(400, 401, 403, 404, 405, 409, 413, 422, 507))
def update_aliases(body: AliasActions, request: Request, key: Key | None = Depends(authenticate)):
    """Each action: {"create_alias": {"alias_name", "collection_name"}} (an existing alias is pointed at the
    collection: a switch), {"delete_alias": {"alias_name"}} or {"rename_alias": {"old_alias_name",
    "new_alias_name"}}. The key must reach every alias name an action names and every collection an alias it
    changes points to, before and after. Every route that takes a collection's name takes an alias for it."""
    state = state_of(request)
    actions = []
    for a in body.actions:
        if a.create_alias is not None:
            actions.append(("create", a.create_alias.alias_name, a.create_alias.collection_name))
        elif a.delete_alias is not None:
            actions.append(("delete", a.delete_alias.alias_name))
        else:
            actions.append(("rename", a.rename_alias.old_alias_name, a.rename_alias.new_alias_name))

    def allow(kind: str, name: str) -> None:
        check_name(name)
        if kind == "alias" and STORE_RE.fullmatch(name):
            raise http_error(422, f"alias names of the form vs_<24 hex digits> are reserved for vector stores: "
                                  f"{name!r}")
        if not reaches(state, key, name):
            raise http_error(403, f"this API key has no rights to {kind} {name!r}")
    return {"aliases": _alias_list(state, key, state.catalog.update_aliases(actions, allow))}


@router.get("/aliases", summary="The aliases (those whose name and collection this key reaches)",
            responses=documented(401))
def list_aliases(request: Request, key: Key | None = Depends(authenticate)):
    state = state_of(request)
    return {"aliases": _alias_list(state, key, state.catalog.aliases())}


@router.get("/collections/{name}/aliases", summary="The aliases of a collection (of an alias's collection)",
            responses=documented(400, 401, 403, 404, 422))
def collection_aliases(request: Request, name: str = Depends(allowed)):
    state = state_of(request)
    collection_of(request, name)  # 404 for no collection
    mine = {a: t for a, t in state.catalog.aliases().items() if t == name}
    return {"aliases": _alias_list(state, key_of(request), mine)}


def _alias_list(state, key: Key | None, aliases: dict[str, str]) -> list[dict]:
    return [{"alias_name": a, "collection_name": t} for a, t in sorted(aliases.items())
            if reaches(state, key, a) and reaches(state, key, t)]


@router.get("/stats", summary="Live figures for the web page: memory per tier, pages per query, latency",
        responses=documented(401))
def stats(request: Request, key: Key | None = Depends(authenticate)):
    state = state_of(request)
    infos = {n: i for n, i in state.collections_info().items() if reaches(state, key, n)}
    return {"ready": state.ready.is_set(), "collections": infos, "recent": state.metrics.recent.summary(),
            "page_buffer_hit_ratio": {n: r for n, r in state.metrics.hit_ratios().items() if n in infos}}
