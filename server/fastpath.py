"""The search route answered before FastAPI's middleware stack and routing: the request the service answers most.

A search through FastAPI passes its own layers (the server-error middleware, the app-wide body limit and exception
telemetry wrappers, the exception middleware), its router (a match against every route, included routers' scope
bookkeeping), its dependency solver and an exit stack before the route's own code runs: on a one-query search of a
36k-document collection that was about a third of the event loop's time per request, more than reading and checking
the body. `ServiceApp` (the service's FastAPI app) hands `POST /v1/collections/{name}/search` to `FastRoutes` first,
which runs the service's own middleware (body limits and deadlines, metrics and the request log, a router replica's
headers: the same classes, built once for this chain) around the same checks in the same order (the key, the name,
the open collection: server/deps.py) and the same route code (routes/search.py `search`); errors are answered by the
app's own handlers (server/errors.py), an unexpected one as the app's 500 before it is raised to the server, as
Starlette's server-error middleware does. Every other request, a search under a root path, and every request while
FastAPI's own telemetry is on go to the app as before; the FastAPI route stays, for the OpenAPI document and for any
caller that reaches the app below this.
"""

from __future__ import annotations

import re
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from fusionrag.retriever.errors import FusionRAGError
from fusionrag.server.deps import check_reaches, key_of, open_collection
from fusionrag.server.errors import engine_error, http_error_handler, unexpected, validation_response
from fusionrag.server.routes.search import router as search_router, search

SEARCH_PATH = "/v1/collections/{name}/search"
_SEARCH = re.compile(r"/v1/collections/([^/]+)/search")
# The app's handlers for what a route raises, most specific first (as the exception middleware looks them up).
_HANDLERS = ((RequestValidationError, validation_response), (StarletteHTTPException, http_error_handler),
             (FusionRAGError, engine_error))


class FastRoutes:
    """The search route's chain: `wrap` puts the service's middleware around it (create_app's, in its order)."""

    def __init__(self, wrap):
        # The route FastAPI would have matched: metrics and the request log name a request by its path.
        self._route = next(r for r in search_router.routes if r.path == SEARCH_PATH and "POST" in r.methods)
        self._chain = wrap(self._search)

    def match(self, scope) -> str | None:
        """The collection's name where the request is a search this chain answers."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        m = _SEARCH.fullmatch(scope["path"])
        return None if m is None else m.group(1)

    async def __call__(self, scope, receive, send, name: str):
        scope["path_params"] = {"name": name}
        await self._chain(scope, receive, send)

    async def _search(self, scope, receive, send):
        # Matched here, below the middleware, as FastAPI's router matches: a body refused by its declared length
        # counts as unmatched either way.
        scope["route"] = self._route
        request = Request(scope, receive, send)
        name = scope["path_params"]["name"]
        try:
            coll = await open_collection(request, check_reaches(request, name, key_of(request)))
            response = await search(request, coll)
        except Exception as exc:  # noqa: BLE001 - answered as the app answers it
            handler = next((h for cls, h in _HANDLERS if isinstance(exc, cls)), None)
            if handler is None:  # the app's 500, then raised to the server, as Starlette's ServerErrorMiddleware does
                await (await unexpected(request, exc))(scope, receive, send)
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)


class ServiceApp(FastAPI):
    """The service's FastAPI app: searches go to `fast_routes` (when set) before FastAPI's own stack."""

    fast_routes: FastRoutes | None = None
    _telemetry_on, _telemetry_at = False, -1.0

    def _telemetry_enabled(self) -> bool:
        """Whether FastAPI's own telemetry is on (OpenTelemetry configured): then it sees every request, searches
        too. Asked at most once a second (its check reads three global providers: ~10 us a request); once on, on,
        as OpenTelemetry's global providers are set once."""
        now = time.monotonic()
        if not self._telemetry_on and now - self._telemetry_at > 1.0:
            telemetry = getattr(self, "_native_telemetry", None)
            self._telemetry_on, self._telemetry_at = telemetry is not None and telemetry.enabled(), now
        return self._telemetry_on

    async def __call__(self, scope, receive, send):
        fast = self.fast_routes
        if fast is not None and not self.root_path and (name := fast.match(scope)) is not None:
            if "fastapi.telemetry" in scope or not self._telemetry_enabled():
                scope["app"] = self
                return await fast(scope, receive, send, name)
        await super().__call__(scope, receive, send)
