"""Errors as HTTP answers: the statuses routes declare, and the handlers that turn an engine error, a refused
body or anything unexpected into a JSON answer with its status (the table itself: retriever/errors.py)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from fusionrag.retriever.errors import FusionRAGError, http_status

log = logging.getLogger("fusionrag.server")


def http_error(status: int, detail: str, headers: dict | None = None) -> HTTPException:
    return HTTPException(status_code=status, detail=detail, headers=headers)


_WHY = {400: "malformed JSON, or an invalid collection name", 401: "no valid API key (when the service has keys)",
        403: "the API key does not cover this collection", 404: "no such collection or document",
        405: "a verb's path (…/documents/get or …/delete) asked with another method, or what the sharded "
             "service on Ray does not do (drop, snapshots, import, restore, the OpenAI vector stores)",
        408: "the request body sent nothing for body_timeout_s",
        409: "the name is taken, the collection is importing (or is sharded and not yet built by its import), or a "
             "limit (collections, snapshots) is reached", 413: "body over max_body_bytes, or over its share of JSON values",
        422: "a value or a limit refused; `errors` lists what the body's model found",
        415: "the body's content type is not one the route takes",
        503: "the collection is being built or failed to open, the service is at its open-files limit, or it "
             "is stopping",
        507: "the disk refused a write, or a snapshot, import or restore would write into the disk reserve"}


def documented(*statuses: int) -> dict:
    # Named by reference, not `model`, which would take the route's media type (text/plain for /metrics).
    return {status: {"description": _WHY[status], "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}} for status in statuses}


def json_body(model, required: bool = True) -> dict:
    """The body of a route that reads it itself (server/bodies.py), declared as FastAPI would declare it."""
    return {"requestBody": {"required": required, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openai(path: str) -> bool:
    return path.startswith(("/v1/files", "/v1/vector_stores", "/v1/embeddings"))


def shaped(path: str, content: dict, status: int) -> dict:
    """An error's JSON: {"detail"} (and more) as the service answers, with OpenAI's {"error": {"message", "type"}}
    beside it on the OpenAI API's paths, which its SDK reads."""
    if not _openai(path):
        return content
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {**content, "error": {"message": content.get("detail"), "type": kind, "param": None, "code": str(status)}}


def answer(request: Request, content: dict, status: int, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(shaped(request.url.path, content, status), status, headers)


async def validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json:
        pos = bad_json["loc"][-1]
        return answer(request, {"detail": f"malformed JSON at character {pos}: {bad_json['ctx']['error']}"}, 400)
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
        parts.append(f"{loc}: {e['msg']}")
    more = f" (and {len(parts) - 10} more)" if len(parts) > 10 else ""
    return answer(request, {"detail": "; ".join(parts[:10]) + more,
                            "errors": [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors[:50]]},
                  422)


async def engine_error(request: Request, exc: FusionRAGError) -> JSONResponse:
    # The service's own paths are none of a client's business: the data directory's (or, for the sharded service, the
    # index directory's) is named by what it is.
    catalog = request.app.state.fusionrag.catalog
    root, word = str(catalog.root), "<index-dir>" if catalog.sharded else "<data-dir>"
    detail = str(exc).replace(root, word)
    status = http_status(exc)
    if status is not None:
        return answer(request, {"detail": detail}, status, {"Retry-After": "5"} if status == 503 else None)
    log.error("engine error", exc_info=exc)
    return answer(request, {"detail": f"{type(exc).__name__}: {detail}"}, 500)


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc, extra={"path": request.url.path})
    # uvicorn closes the connection after an unhandled error: the client is told so, not left to find out.
    return JSONResponse({"detail": "internal error; see the service's log"}, 500, {"Connection": "close"})


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 405:  # Starlette's Allow names the methods of the path's first route only
        routes = request.app.router.routes
        methods = [m for m in ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")
                   if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes)]
        exc = StarletteHTTPException(405, exc.detail, {"Allow": ", ".join(methods)})
    if _openai(request.url.path) and exc.status_code >= 400:
        return answer(request, {"detail": exc.detail}, exc.status_code, getattr(exc, "headers", None))
    return await http_exception_handler(request, exc)


def install_handlers(app: FastAPI) -> None:
    """Every error answered as JSON with its status (each handler a coroutine: Starlette runs a plain function
    handler in its thread pool, a thread hop an error): engine errors by the table, refused bodies with what was
    wrong, 405 with the methods the path takes, and anything unexpected as a 500 that closes the connection."""
    app.add_exception_handler(RequestValidationError, validation_response)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(FusionRAGError, engine_error)
    app.add_exception_handler(Exception, unexpected)
