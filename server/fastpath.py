"""The search route without FastAPI's routing and dependency solving: the request the service answers most.

A search through FastAPI passes its router (a match against every route, included routers' scope bookkeeping), its
dependency solver, an exit stack and the exception middleware before the route's own code runs: on a one-query
search of a 36k-document collection that was about a third of the event loop's time per request, more than reading
and checking the body. `FastRoutes`, the innermost middleware, answers `POST /v1/collections/{name}/search` itself:
the same checks in the same order (the key, the name, the open collection: server/deps.py), the same route code
(routes/search.py `search`), errors answered by the app's own handlers (server/errors.py); the middleware above it
(body limits and deadlines, metrics and the request log) sees it as it sees any route, under the route's own name.
Every other request, and a search under a root path, goes to the app as before; the FastAPI route stays, for the
OpenAPI document and for any caller that reaches the app below this middleware.
"""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from fusionrag.retriever.errors import FusionRAGError
from fusionrag.server.deps import check_reaches, key_of, open_collection
from fusionrag.server.errors import engine_error, http_error_handler, validation_response
from fusionrag.server.routes.search import router as search_router, search

SEARCH_PATH = "/v1/collections/{name}/search"
_SEARCH = re.compile(r"/v1/collections/([^/]+)/search")
# The app's handlers for what a route raises, most specific first (as the exception middleware looks them up).
_HANDLERS = ((RequestValidationError, validation_response), (StarletteHTTPException, http_error_handler),
             (FusionRAGError, engine_error))


class FastRoutes:
    def __init__(self, app):
        self.app = app
        # The route FastAPI would have matched: metrics and the request log name a request by its path.
        self._route = next(r for r in search_router.routes if r.path == SEARCH_PATH and "POST" in r.methods)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return await self.app(scope, receive, send)
        m = _SEARCH.fullmatch(scope["path"])
        if m is None:
            return await self.app(scope, receive, send)
        name = m.group(1)
        scope["route"], scope["path_params"] = self._route, {"name": name}
        request = Request(scope, receive, send)
        try:
            coll = await open_collection(request, check_reaches(request, name, key_of(request)))
            response = await search(request, coll)
        except Exception as exc:  # noqa: BLE001 - answered as the app answers it, or raised to the app's 500
            handler = next((h for cls, h in _HANDLERS if isinstance(exc, cls)), None)
            if handler is None:
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)
