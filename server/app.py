"""The HTTP API: a FastAPI app over a Catalog of collections, assembled from the service's life (life.py),
its middleware, error handlers and routes (routes/). The engine underneath knows nothing of HTTP."""

from __future__ import annotations

from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic.json_schema import models_json_schema

from fusionrag import __version__
from fusionrag.server.config import ServerConfig
from fusionrag.server.errors import install_handlers
from fusionrag.server.fastpath import FastRoutes, ServiceApp
from fusionrag.server.life import Service, State
from fusionrag.server.auth import KeyRing
from fusionrag.server.middleware import AddHeaders, BodyLimit, ObserveMiddleware
from fusionrag.server.routes import v1
from fusionrag.server.routes.documents import DEFAULT_PAGE
from fusionrag.server.routes.ops import router as ops
from fusionrag.server.schemas import (CountRequest, DeleteRequest, Error, GetRequest, GroupSearchRequest, MetadataRequest,
                                      RecommendRequest, SearchRequest, UpsertRequest)

__all__ = ["Service", "State", "create_app"]


def _document_limits(schemas: dict, config: ServerConfig) -> None:
    """The configured limits, written into the bodies' schemas of the OpenAPI document."""
    search = schemas["SearchRequest"]["properties"]
    search["k"]["maximum"] = config.max_k
    search["vectors"]["maxItems"] = search["texts"]["maxItems"] = config.max_queries
    search["texts"]["anyOf"][0]["items"]["maxLength"] = config.max_text_chars
    groups = schemas["GroupSearchRequest"]["properties"]
    groups["group_size"]["maximum"] = groups["limit"]["maximum"] = config.max_k
    groups["vectors"]["maxItems"] = groups["texts"]["maxItems"] = config.max_queries
    schemas["DocumentIn"]["properties"]["text"]["maxLength"] = config.max_text_chars
    schemas["UpsertRequest"]["properties"]["documents"]["maxItems"] = config.max_documents
    schemas["DeleteRequest"]["properties"]["ids"]["maxItems"] = config.max_documents
    schemas["GetRequest"]["properties"]["ids"]["maxItems"] = config.max_documents
    schemas["MetadataRequest"]["properties"]["documents"]["maxItems"] = config.max_documents


def _document_page_limit(paths: dict, config: ServerConfig) -> None:
    """The configured page size, written into the listing's `limit` parameter."""
    limit = next(p for p in paths["/v1/collections/{name}/documents"]["get"]["parameters"] if p["name"] == "limit")
    limit["schema"].update(maximum=config.max_documents, default=min(DEFAULT_PAGE, config.max_documents))


def create_app(config: ServerConfig, catalog=None, keys: KeyRing | None = None,
               headers: dict[str, str] | None = None, fast_routes: bool = True) -> FastAPI:
    """The service's app. catalog, keys: as State takes them (a ShardedCatalog: the sharded service, every router
    replica of it building this same app from the user's ServerConfig); headers: added to every answer (a router
    replica's id); fast_routes: the search route answered below FastAPI's routing (server/fastpath.py; False
    leaves every request to FastAPI, as tests compare)."""
    service = Service(config, catalog, keys)
    state = service.state

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = ServiceApp(title="fusionrag", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Retrieval for RAG over a FusionANNS-style index. Send `Authorization: Bearer <key>` "
                              "when the service has API keys.")
    app.state.fusionrag = state
    # The service's middleware, innermost first (Starlette adds each around those before): the same classes wrap
    # the search route's own chain (fastpath.FastRoutes) and the rest of the app.
    middleware = [(BodyLimit, {"limit": config.max_body_bytes, "upload_limit": config.max_upload_bytes,
                               "timeout": config.body_timeout_s, "file_limit": config.max_file_bytes}),
                  (ObserveMiddleware, {"metrics": state.metrics})]
    if headers:
        middleware.append((AddHeaders, {"headers": headers}))
    for cls, options in middleware:
        app.add_middleware(cls, **options)

    def wrap(inner):
        for cls, options in middleware:
            inner = cls(inner, **options)
        return inner

    if fast_routes:
        app.fast_routes = FastRoutes(wrap)
    install_handlers(app)
    app.include_router(v1)
    app.include_router(ops)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schemas = FastAPI.openapi(app)["components"]["schemas"]
            _, read_by_routes = models_json_schema(
                [(m, "validation") for m in (SearchRequest, GroupSearchRequest, RecommendRequest, UpsertRequest,
                                             DeleteRequest, GetRequest, MetadataRequest, CountRequest, Error)],
                ref_template="#/components/schemas/{model}")
            schemas.update(read_by_routes["$defs"])
            _document_limits(schemas, config)
            _document_page_limit(app.openapi_schema["paths"], config)
        return app.openapi_schema

    app.openapi = openapi

    static = resources.files("fusionrag.server") / "static"

    @app.get("/", include_in_schema=False)
    def page():
        return FileResponse(str(static / "index.html"))

    app.mount("/static", StaticFiles(directory=str(static)), name="static")
    # The OpenAPI page from a PyPI copy of Swagger UI (fastapi-offline's, 5.x: the OpenAPI 3.1 that FastAPI writes
    # needs Swagger UI 5); the default page loads it from a CDN.
    app.mount("/swagger", StaticFiles(directory=str(resources.files("fastapi_offline") / "static")), name="swagger")

    @app.get("/docs", include_in_schema=False)
    def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="fusionrag API",
                                   swagger_js_url="/swagger/swagger-ui-bundle.js",
                                   swagger_css_url="/swagger/swagger-ui.css",
                                   swagger_favicon_url="/swagger/favicon.png")

    return app
