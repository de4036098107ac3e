"""The routes of the API under /v1, one module per kind of resource; `v1` gathers them."""

from fastapi import APIRouter, Depends

from fusionrag.server.deps import authenticate
from fusionrag.server.routes import collections, documents, files, openai, search

# Each part has the /v1 prefix itself, so that its routes' paths are whole (the metrics label requests by them).
v1 = APIRouter(dependencies=[Depends(authenticate)])
for part in (collections, files, search, documents, openai):
    v1.include_router(part.router)

__all__ = ["v1"]
