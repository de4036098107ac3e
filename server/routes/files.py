"""Routes that move files: snapshots (write, list, download, delete), restore, and bulk import."""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from fusionrag.retriever.collection import Collection, importer
from fusionrag.retriever.collection.embedding import canonical_name, get_embedder
from fusionrag.retriever.errors import InputError, StorageError
from fusionrag.retriever.process import lower_thread_priority
from fusionrag.server.auth import Key
from fusionrag.server.config import data_path
from fusionrag.server.deps import allowed, authenticate, collection_quota, creatable, open_collection, state_of
from fusionrag.server.errors import documented, http_error
from fusionrag.server.uploads import spool, spool_import

log = logging.getLogger("fusionrag.server")

router = APIRouter(prefix="/v1")


# -- snapshots ---------------------------------------------------------------------------------------

_TAR = {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}
_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary", "description": "the archive"}}}


@router.post("/collections/{name}/snapshots", status_code=201, responses=documented(400, 401, 403, 404, 409, 422, 503,
                                                                                    507),
         summary="Write a snapshot of a collection (its state now, while writes go on); returns its id")
def create_snapshot(request: Request, coll: Collection = Depends(open_collection)):
    return state_of(request).snapshots.take(coll)


@router.get("/collections/{name}/snapshots", summary="The snapshots of a collection, oldest first",
        responses=documented(400, 401, 403, 422))
def list_snapshots(request: Request, name: str = Depends(allowed)):
    return {"snapshots": state_of(request).snapshots.list(name)}


@router.get("/collections/{name}/snapshots/{snapshot_id}", summary="Download a snapshot (a tar archive)",
        responses={200: {"content": _TAR, "description": "the archive"}, **documented(400, 401, 403, 404, 422)},
        response_class=FileResponse)
def download_snapshot(request: Request, snapshot_id: str, name: str = Depends(allowed)):
    return FileResponse(state_of(request).snapshots.path(name, snapshot_id), media_type="application/x-tar",
                        filename=f"{name}-{snapshot_id}.tar")


@router.delete("/collections/{name}/snapshots/{snapshot_id}", summary="Delete a snapshot",
           responses=documented(400, 401, 403, 404, 422))
def delete_snapshot(request: Request, snapshot_id: str, name: str = Depends(allowed)):
    state_of(request).snapshots.delete(name, snapshot_id)
    return {"deleted": snapshot_id}


def _check_start(coll: Collection, files: dict[str, Path], folder: Path) -> None:
    """Before the 202: the start of the upload (the documents' first lines, the vector file's header and first rows)
    checked as the import will check it (importer.check_start), so that what the import would refuse there is
    refused now (InputError, 422, naming the line and the problem) rather than failing after the 202."""
    try:
        importer.check_start(files.get("documents"), files.get("vectors"), coll.dim, coll.metric,
                             coll.embedding is not None, f"collection {coll.name!r}")
    except InputError as e:  # its words, without the upload's path on the server
        raise InputError(importer.public_reason(e, coll.path, folder)) from e


def _run_import(coll: Collection, files: dict[str, Path], folder: Path) -> None:
    lower_thread_priority()  # a build takes the cores that searches leave (threads it starts inherit it)
    try:
        coll.import_files(files.get("documents"), files.get("vectors"), progress=False, claimed=True)
    except Exception:  # noqa: BLE001 - the collection's info says why; the log has the rest
        log.exception("import into collection %r failed", coll.name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@router.post("/collections/{name}/import", status_code=202, summary="Bulk import into an empty collection: JSON lines "
         "(or a vector file and JSON lines; gzipped with Content-Encoding: gzip, or as parts named *.gz) streamed "
         "to disk, their first lines checked, then indexed in the background; progress and outcome in the "
         "collection's info", responses=documented(400, 401, 403, 404, 409, 413, 415, 422, 503, 507),
         openapi_extra={"requestBody": {"required": True, "content": {
             "application/x-ndjson": {"schema": {"type": "string", "format": "binary"}},
             "multipart/form-data": {"schema": {"type": "object", "properties": {
                 "documents": {"type": "string", "format": "binary"},
                 "vectors": {"type": "string", "format": "binary"}}}}}}})
async def import_documents(request: Request, coll: Collection = Depends(open_collection)):
    state = state_of(request)
    # Claimed before the upload, not after it: a second import, or a write, is refused (409) while it arrives.
    await run_in_threadpool(coll.claim_import)
    folder = data_path(state.config) / "uploads" / uuid.uuid4().hex
    try:
        try:
            folder.mkdir(parents=True)
            files = await spool_import(request, folder)
        except OSError as e:
            raise StorageError(f"cannot store the upload: {e}") from e
        sizes = {k: p.stat().st_size for k, p in files.items()}
        if not any(sizes.values()):
            raise http_error(422, "the upload is empty")
        await run_in_threadpool(_check_start, coll, files, folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        coll.release_import()
        raise
    threading.Thread(target=_run_import, args=(coll, files, folder), name=f"import-{coll.name}", daemon=True).start()
    return JSONResponse({"collection": coll.name, "import": "started", "files": sizes}, 202)


@router.post("/collections/{name}/restore", status_code=201, summary="A new collection from a snapshot (the archive "
         "as the body, up to max_upload_bytes)", openapi_extra={"requestBody": {"required": True, "content": _BINARY}},
         responses=documented(400, 401, 403, 409, 413, 422, 503, 507))
async def restore_collection(request: Request, name: str = Depends(creatable),
                             key: Key | None = Depends(authenticate)):
    catalog = state_of(request).catalog
    allow = collection_quota(request, key)
    catalog.check_free(name, allow)  # before the upload, not after it
    upload = await spool(request)
    try:
        def restore() -> dict:
            with open(upload, "rb") as f:
                return catalog.restore(name, f, _model_dim, allow).info()
        return await run_in_threadpool(restore)
    finally:
        upload.unlink(missing_ok=True)


def _model_dim(embedding: str) -> int:
    """The dimension of an embedding model the service embeds with (a restored collection may name only those,
    as a create may): ConfigError (422) for any other name."""
    return get_embedder(canonical_name(embedding)).dim
