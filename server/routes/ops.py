"""Routes of the service itself, outside /v1: live, ready, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import HTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fusionrag.server.deps import key_of, reaches, state_of
from fusionrag.server.errors import documented, http_error
from fusionrag.server.schemas import Readiness

router = APIRouter()


NAMED = ("collections", "building", "failed")  # the members of readyz's body that name collections


def _for_caller(request: Request, body: dict) -> dict:
    """`body` with its collection names (its lists of names, its dicts by name) cut to those the caller's key
    reaches (deps.reaches); with API keys, a caller without a valid key is told the status only."""
    state = state_of(request)
    if not state.keys.enabled:
        return body
    try:
        key = key_of(request)
    except HTTPException:
        return {"status": body["status"]}
    return {k: v if k not in NAMED else [n for n in v if reaches(state, key, n)] if isinstance(v, list) else
            {n: x for n, x in v.items() if reaches(state, key, n)} for k, v in body.items()}


@router.get("/healthz", summary="Live: the process answers")
def healthz():
    return {"status": "ok"}


@router.get("/readyz", summary="Ready: every collection is loaded",
            responses={200: {"model": Readiness}, 503: {"model": Readiness}})
def readyz(request: Request):
    state = state_of(request)
    if state.ready.is_set():
        # Ready while any collection serves: one that failed to open is named here with the reason.
        failed = state.catalog.failed()
        if state.demo_error:
            failed.setdefault("demo", state.demo_error)
        body = {"status": "ready", "collections": state.catalog.names(), "failed": failed}
        r = state.catalog.readiness()
        if r is not None:  # a sharded collection: its shards asked now; degraded with one down, 503 with all
            body.update(status="degraded" if r["degraded"] else "ready", shards_alive=r["shards_alive"])
            if not r["ready"]:
                return JSONResponse(_for_caller(request, body), 503)
        return _for_caller(request, body)
    return JSONResponse(_for_caller(request, {"status": "loading", "building": sorted(state.building)}), 503)


@router.get("/metrics", summary="Prometheus metrics (with API keys and metrics_auth: for a key that covers "
                                "every collection)", response_class=PlainTextResponse, responses=documented(401, 403))
def metrics(request: Request):
    state = state_of(request)
    if state.config.metrics_auth and state.keys.enabled and not key_of(request).unrestricted:
        raise http_error(403, "/metrics names every collection: it needs a key that covers them all")
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
