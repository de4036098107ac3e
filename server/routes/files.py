"""Routes that move files: snapshots (write, list, download, delete), restore, bulk import, and a file chunked into
a collection."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import uuid
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from fusionrag.retriever.collection import Document, importer
from fusionrag.retriever.collection.contract import CollectionContract
from fusionrag.retriever.collection.embedding import canonical_name, get_embedder
from fusionrag.retriever.errors import InputError, StorageError
from fusionrag.retriever.process import lower_thread_priority
from fusionrag.server.auth import Key
from fusionrag.server.config import data_path
from fusionrag.server.deps import allowed, authenticate, collection_quota, creatable, open_collection, state_of
from fusionrag.server.errors import documented, http_error
from fusionrag.server.file_chunks import BadText, Chunker, Mark
from fusionrag.server.requests import embedder_of
from fusionrag.server.uploads import Room, spool, spool_import, spool_multipart
from fusionrag.server.vector_stores import EMBED_BATCH, chunking, over_token_limit, too_many_tokens

log = logging.getLogger("fusionrag.server")

router = APIRouter(prefix="/v1")


# -- snapshots ---------------------------------------------------------------------------------------

_TAR = {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}
_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary", "description": "the archive"}}}


@router.post("/collections/{name}/snapshots", status_code=201, responses=documented(400, 401, 403, 404, 409, 422, 503,
                                                                                    507),
         summary="Write a snapshot of a collection (its state now, while writes go on); returns its id")
def create_snapshot(request: Request, coll: CollectionContract = Depends(open_collection)):
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


def _check_start(coll: CollectionContract, files: dict[str, Path], folder: Path) -> None:
    """Before the 202: the start of the upload (the documents' first lines, the vector file's header and first rows)
    checked as the import will check it (importer.check_start), so that what the import would refuse there is
    refused now (InputError, 422, naming the line and the problem) rather than failing after the 202."""
    try:
        importer.check_start(files.get("documents"), files.get("vectors"), coll.dim, coll.metric,
                             coll.embedding is not None, f"collection {coll.name!r}")
    except InputError as e:  # its words, without the upload's path on the server
        raise InputError(importer.public_reason(e, coll.path, folder)) from e


def _run_import(coll: CollectionContract, files: dict[str, Path], folder: Path) -> None:
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
async def import_documents(request: Request, coll: CollectionContract = Depends(open_collection)):
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


# -- a file chunked into a collection ----------------------------------------------------------------

FILE_FIELDS = ("max_chunk_size_tokens", "chunk_overlap_tokens", "metadata")
CHUNK_KEYS = ("filename", "chunk")  # the metadata each chunk gets from the route
_uploading: set[tuple[str, str]] = set()  # (collection, file name) being written: one at a time
_uploading_lock = threading.Lock()


def _chunk_plan(fields: dict[str, str], model_tokens: int) -> tuple[int, int]:
    """(chunk size, overlap) in the model's tokens, by the vector stores' rule (vector_stores.chunking): the
    model's window or 800 tokens, half of it overlapping, unless given (100-4096 tokens, overlap at most half)."""
    given = {}
    for name in FILE_FIELDS[:2]:
        if name in fields:
            text = fields[name].strip()
            if not (text.isascii() and text.isdigit()):
                raise InputError(f"{name} must be a whole number of tokens, got {text[:40]!r}")
            given[name] = int(text)
    plan = chunking(None, model_tokens)["static"]
    if given:
        size = given.get("max_chunk_size_tokens", plan["max_chunk_size_tokens"])
        plan = chunking({"type": "static", "static": {"max_chunk_size_tokens": size, "chunk_overlap_tokens":
                                                      given.get("chunk_overlap_tokens", size // 2)}}, 0)["static"]
    return plan["max_chunk_size_tokens"], plan["chunk_overlap_tokens"]


def _file_metadata(fields: dict[str, str]) -> dict:
    if "metadata" not in fields:
        return {}
    try:
        meta = json.loads(fields["metadata"])
    except ValueError as e:
        raise InputError(f"metadata must be a JSON object: {e}") from None
    if not isinstance(meta, dict):
        raise InputError("metadata must be a JSON object")
    taken = [k for k in CHUNK_KEYS if k in meta]
    if taken:
        raise InputError(f"metadata may not set {', '.join(map(repr, taken))}: the route sets it on each chunk")
    return meta


def _store_file(coll: CollectionContract, path: Path, filename: str, size: int, overlap: int, meta: dict,
                max_tokens: int) -> int:
    """The file's chunks written as documents `<filename>#<n>`, those a former upload of the name left past them
    deleted; nothing written where the file is refused. The number of chunks."""
    embedder = get_embedder(coll.embedding)
    try:
        if over_token_limit(path, path.stat().st_size, embedder.token_spans, max_tokens):
            raise http_error(413, too_many_tokens(max_tokens))
        chunker = Chunker(path, Mark(), 0, embedder.token_spans, size, overlap, whole_words=True)
        batch = chunker.step(EMBED_BATCH)
    except BadText as e:
        raise http_error(415, e.message) from None
    if not batch:
        raise http_error(422, "the file holds no text")
    n = 0
    try:
        while batch:
            vectors = embedder.embed(batch)
            coll.upsert([Document(f"{filename}#{n + i}", t, v, {**meta, "filename": filename, "chunk": n + i})
                         for i, (t, v) in enumerate(zip(batch, vectors))])
            n += len(batch)
            batch = [] if chunker.done else chunker.step(EMBED_BATCH)
        coll.delete_where({"filename": filename, "chunk": {"$gte": n}})
    except BaseException:
        # Not a mix of two uploads: the name's chunks go, and the error says so.
        log.exception("writing the chunks of file %r into collection %r failed", filename, coll.name)
        coll.delete_where({"filename": filename})
        raise
    return n


@router.post("/collections/{name}/files", summary="A text file cut into chunks by the vector stores' chunker, each "
             "embedded by the collection's model and stored as a document `<filename>#<n>` (an upload of the same "
             "name replaces its chunks); returns how many", responses=documented(400, 401, 403, 404, 409, 413, 415,
                                                                                  422, 503, 507),
             openapi_extra={"requestBody": {"required": True, "content": {
                 "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
                     "file": {"type": "string", "format": "binary"},
                     "max_chunk_size_tokens": {"type": "integer", "minimum": 100, "maximum": 4096},
                     "chunk_overlap_tokens": {"type": "integer", "minimum": 0},
                     "metadata": {"type": "string", "description": "a JSON object given to every chunk"}}}}}}})
async def upload_collection_file(request: Request, coll: CollectionContract = Depends(open_collection)):
    state = state_of(request)
    cfg = state.config
    embedder_of(coll, "a file's chunks")  # before the upload: a collection without a model is refused at once
    folder = data_path(cfg) / "uploads"
    names: dict[str, str] = {}

    def place(name: str, filename: str):
        if name == "file":
            names["file"] = filename
            return folder / f"{uuid.uuid4().hex}.part"
        if name not in FILE_FIELDS:
            raise http_error(422, f"unknown part {name[:40]!r}: the parts are file, {', '.join(FILE_FIELDS)}")
        return None

    try:
        folder.mkdir(parents=True, exist_ok=True)
        files, fields = await spool_multipart(request, Room(request, folder), place)
    except OSError as e:
        raise StorageError(f"cannot store the upload: {e}") from e
    path = files.get("file")
    try:
        if path is None:
            raise http_error(422, "the multipart body has no 'file' part")
        filename = os.path.basename(names["file"].replace("\\", "/"))[:255]
        if not filename:
            raise http_error(422, "the file part has no file name: chunks are named after it")
        size, overlap = _chunk_plan(fields, get_embedder(coll.embedding).max_tokens)
        meta = _file_metadata(fields)
        key = (coll.name, filename)
        with _uploading_lock:
            if key in _uploading:
                raise http_error(409, f"file {filename!r} is being written into collection {coll.name!r} already")
            _uploading.add(key)
        try:
            chunks = await run_in_threadpool(_store_file, coll, path, filename, size, overlap, meta,
                                             cfg.max_file_tokens)
        finally:
            with _uploading_lock:
                _uploading.discard(key)
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
    return {"collection": coll.name, "filename": filename, "chunks": chunks, "max_chunk_size_tokens": size,
            "chunk_overlap_tokens": overlap}
