"""Routes that move files: snapshots (write, list, download, delete), restore, and bulk import."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from pathlib import Path

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from fusionrag.retriever.collection import Collection, quota
from fusionrag.retriever.collection.embedding import canonical_name, get_embedder
from fusionrag.retriever.engine.vectors import EXTENSIONS as VECTOR_EXTENSIONS
from fusionrag.retriever.errors import StorageError
from fusionrag.server.auth import Key
from fusionrag.server.config import data_path
from fusionrag.server.deps import allowed, authenticate, collection_quota, open_collection, state_of
from fusionrag.server.errors import documented, http_error

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


class _Room:
    """Checks, as an upload is written, that the disk reserve stays free: before each few MiB (a statvfs), that
    they fit above it."""

    EVERY = 4 << 20

    def __init__(self, request: Request, folder: Path):
        self.folder, self.reserve = folder, state_of(request).catalog.limits.disk_reserve_bytes
        self.left = 0  # bytes checked for and not yet written

    def wrote(self, n: int) -> None:
        if n > self.left:
            quota.check_room(self.folder, max(n, self.EVERY), self.reserve, "the upload")
            self.left = max(n, self.EVERY)
        self.left -= n


async def _spool(request: Request) -> Path:
    """The request's body, written to a file of the data directory as it arrives (an upload may be far larger
    than memory); the caller removes it."""
    folder = data_path(state_of(request).config) / "uploads"
    path = folder / f"{uuid.uuid4().hex}.part"
    size = 0
    try:
        folder.mkdir(parents=True, exist_ok=True)
        room = _Room(request, folder)
        async with await anyio.open_file(path, "wb") as f:
            async for chunk in request.stream():
                room.wrote(len(chunk))
                size += len(chunk)
                await f.write(chunk)
    except OSError as e:
        path.unlink(missing_ok=True)
        raise StorageError(f"cannot store the upload: {e}") from e
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    if not size:
        path.unlink(missing_ok=True)
        raise http_error(422, "the body is empty: send the file as the request's body")
    return path


# -- bulk import ------------------------------------------------------------------------------------

_JSONL = ("application/x-ndjson", "application/jsonl")


async def _spool_parts(request: Request, folder: Path) -> dict[str, Path]:
    """The files of an import request, written into `folder` as they arrive: a JSON-lines body is the
    documents; a multipart body has parts `documents` (JSON lines) and `vectors` (a vector file, its
    format by its file name's extension)."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    ctype = ctype.decode("latin-1").lower()
    room = _Room(request, folder)
    if ctype in _JSONL:
        path = folder / "documents.jsonl"
        async with await anyio.open_file(path, "wb") as f:
            async for chunk in request.stream():
                room.wrote(len(chunk))
                await f.write(chunk)
        return {"documents": path}
    if ctype != "multipart/form-data" or not params.get(b"boundary"):
        raise http_error(415, f"send the documents as {' or '.join(_JSONL)} (JSON lines), or multipart/form-data with "
                          "parts 'documents' and 'vectors' (a .fvecs .fbin .npy ... file)")
    files: dict[str, Path] = {}
    part: dict = {}
    ended = []  # the closing boundary was read

    def headers_finished() -> None:
        _, disposition = parse_options_header(part["headers"].get(b"content-disposition", b""))
        name = disposition.get(b"name", b"").decode("latin-1")
        if name == "documents":
            path = folder / "documents.jsonl"
        elif name == "vectors":
            ext = os.path.splitext(disposition.get(b"filename", b"").decode("latin-1"))[1].lower()
            if ext not in VECTOR_EXTENSIONS:
                raise http_error(422, f"the vectors part's file name must end in one of {', '.join(VECTOR_EXTENSIONS)}")
            path = folder / f"vectors{ext}"
        else:
            raise http_error(422, f"unknown part {name[:40]!r}: an import takes 'documents' and 'vectors'")
        if name in files:
            raise http_error(422, f"part {name!r} given twice")
        files[name] = path
        part["file"] = open(path, "wb")

    def header_end() -> None:
        part["headers"][part["field"].lower()] = part["value"]
        part["field"] = part["value"] = b""

    callbacks = {
        "on_part_begin": lambda: part.update(headers={}, field=b"", value=b"", file=None),
        "on_header_field": lambda d, s, e: part.update(field=part["field"] + d[s:e]),
        "on_header_value": lambda d, s, e: part.update(value=part["value"] + d[s:e]),
        "on_header_end": header_end,
        "on_headers_finished": headers_finished,
        "on_part_data": lambda d, s, e: part["file"].write(d[s:e]),
        "on_part_end": lambda: part["file"].close(),
        "on_end": lambda: ended.append(True),
    }
    parser = MultipartParser(params[b"boundary"], callbacks)
    try:
        async for chunk in request.stream():
            room.wrote(len(chunk))
            await anyio.to_thread.run_sync(parser.write, chunk)
        parser.finalize()
    except MultipartParseError as e:
        raise http_error(400, f"malformed multipart body: {e}") from e
    finally:
        if part.get("file") is not None:
            part["file"].close()
    if not ended:
        raise http_error(400, "malformed multipart body: it ends before its closing boundary (cut short?)")
    if not files:
        raise http_error(422, "the multipart body has neither a 'documents' nor a 'vectors' part")
    return files


def _run_import(coll: Collection, files: dict[str, Path], folder: Path) -> None:
    try:
        coll.import_files(files.get("documents"), files.get("vectors"), progress=False, claimed=True)
    except Exception:  # noqa: BLE001 - the collection's info says why; the log has the rest
        log.exception("import into collection %r failed", coll.name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@router.post("/collections/{name}/import", status_code=202, summary="Bulk import into an empty collection: JSON lines "
         "(or a vector file and JSON lines) streamed to disk, then indexed in the background; progress and outcome "
         "in the collection's info", responses=documented(400, 401, 403, 404, 409, 413, 415, 422, 503, 507),
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
            files = await _spool_parts(request, folder)
        except OSError as e:
            raise StorageError(f"cannot store the upload: {e}") from e
        sizes = {k: p.stat().st_size for k, p in files.items()}
        if not any(sizes.values()):
            raise http_error(422, "the upload is empty")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        coll.release_import()
        raise
    threading.Thread(target=_run_import, args=(coll, files, folder), name=f"import-{coll.name}", daemon=True).start()
    return JSONResponse({"collection": coll.name, "import": "started", "files": sizes}, 202)


@router.post("/collections/{name}/restore", status_code=201, summary="A new collection from a snapshot (the archive "
         "as the body, up to max_upload_bytes)", openapi_extra={"requestBody": {"required": True, "content": _BINARY}},
         responses=documented(400, 401, 403, 409, 413, 422, 503, 507))
async def restore_collection(request: Request, name: str = Depends(allowed), key: Key | None = Depends(authenticate)):
    catalog = state_of(request).catalog
    allow = collection_quota(request, key)
    catalog.check_free(name, allow)  # before the upload, not after it
    upload = await _spool(request)
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
