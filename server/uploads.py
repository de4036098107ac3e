"""Request bodies written to the data disk as they arrive (an upload may be far larger than memory), kept out of
the disk reserve as they are written (Room: their room claimed before it is written, and counted by every other
upload's check): a whole body (a snapshot to restore), or a multipart body's files (a bulk import's documents and
vectors, an OpenAI file upload) with its small fields kept in memory."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable

import anyio
from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from fusionrag.retriever.collection import quota
from fusionrag.retriever.engine.vectors import EXTENSIONS as VECTOR_EXTENSIONS
from fusionrag.retriever.errors import StorageError
from fusionrag.server.config import data_path
from fusionrag.server.deps import state_of
from fusionrag.server.errors import http_error

FIELD_BYTES = 4096  # a multipart field kept in memory (not a file) is at most this long


class Room:
    """Keeps an upload out of the disk reserve as it is written, whatever other uploads write meanwhile: before
    its first bytes are written it claims the room its request declares (Content-Length), else EVERY bytes at a
    time as they arrive (a quota.DiskClaim, which every check of the reserve counts until those bytes are
    written), and is refused (StorageError, 507) where that room is not there above the reserve besides what
    the uploads in progress have claimed. claim(n) before writing n bytes, wrote(n) after, close() at the end
    (whatever happened: what was claimed and not written is given back)."""

    EVERY = 4 << 20

    def __init__(self, request: Request, folder: Path):
        self.claimed = quota.DiskClaim(folder, state_of(request).catalog.limits.disk_reserve_bytes, "the upload")
        declared = request.headers.get("content-length", "")
        self.declared = int(declared) if declared.isascii() and declared.isdigit() else 0  # 0: not declared

    def claim(self, n: int) -> None:
        """Before n bytes are written."""
        short = n - self.claimed.held
        if short > 0:
            self.claimed.take(max(short, self.declared or self.EVERY))
            self.declared = 0  # claimed whole: what passes it (nothing, HTTP framing holds it) claimed as it comes

    def wrote(self, n: int) -> None:
        """After n bytes were written."""
        self.claimed.wrote(n)

    def close(self) -> None:
        self.claimed.release()


async def spool(request: Request) -> Path:
    """The request's body, written to a file of the data directory as it arrives; the caller removes it."""
    folder = data_path(state_of(request).config) / "uploads"
    path = folder / f"{uuid.uuid4().hex}.part"
    size = 0
    room = Room(request, folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        async with await anyio.open_file(path, "wb") as f:
            async for chunk in request.stream():
                room.claim(len(chunk))
                size += len(chunk)
                await f.write(chunk)
                room.wrote(len(chunk))
    except OSError as e:
        path.unlink(missing_ok=True)
        raise StorageError(f"cannot store the upload: {e}") from e
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        room.close()
    if not size:
        path.unlink(missing_ok=True)
        raise http_error(422, "the body is empty: send the file as the request's body")
    return path


async def spool_multipart(request: Request, room: Room, place: Callable[[str, str], Path | None]
                          ) -> tuple[dict[str, Path], dict[str, str]]:
    """A multipart/form-data body: each part that place(name, filename) gives a path is written there as it
    arrives, the others (fields) kept in memory, up to FIELD_BYTES each. place raises (an HTTPException) for a
    part the route does not take. (files by name, fields by name); the caller removes the files, also on error.
    room is closed at the end."""
    try:
        return await _spool_multipart(request, room, place)
    finally:
        room.close()


async def _spool_multipart(request: Request, room: Room, place: Callable[[str, str], Path | None]
                           ) -> tuple[dict[str, Path], dict[str, str]]:
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype.decode("latin-1").lower() != "multipart/form-data" or not params.get(b"boundary"):
        raise http_error(415, "send the body as multipart/form-data")
    files: dict[str, Path] = {}
    fields: dict[str, str] = {}
    part: dict = {}
    ended = []  # the closing boundary was read

    def headers_finished() -> None:
        _, disposition = parse_options_header(part["headers"].get(b"content-disposition", b""))
        name = disposition.get(b"name", b"").decode("latin-1")
        if name in files or name in fields:
            raise http_error(422, f"part {name[:40]!r} given twice")
        path = place(name, disposition.get(b"filename", b"").decode("utf-8", "replace"))
        part["name"] = name
        if path is None:
            fields[name] = ""
            part["value_bytes"] = bytearray()
        else:
            files[name] = path
            part["file"] = open(path, "wb")

    def data(d, s, e) -> None:
        if part.get("file") is not None:
            part["file"].write(d[s:e])
            return
        buf = part["value_bytes"]
        if len(buf) + e - s > FIELD_BYTES:
            raise http_error(422, f"field {part['name'][:40]!r} is longer than {FIELD_BYTES} bytes")
        buf += d[s:e]

    def part_end() -> None:
        if part.get("file") is not None:
            part["file"].close()
        else:
            fields[part["name"]] = bytes(part["value_bytes"]).decode("utf-8", "replace")

    def header_end() -> None:
        part["headers"][part["field"].lower()] = part["value"]
        part["field"] = part["value"] = b""

    callbacks = {
        "on_part_begin": lambda: (part.clear(), part.update(headers={}, field=b"", value=b"", file=None)),
        "on_header_field": lambda d, s, e: part.update(field=part["field"] + d[s:e]),
        "on_header_value": lambda d, s, e: part.update(value=part["value"] + d[s:e]),
        "on_header_end": header_end,
        "on_headers_finished": headers_finished,
        "on_part_data": data,
        "on_part_end": part_end,
        "on_end": lambda: ended.append(True),
    }
    parser = MultipartParser(params[b"boundary"], callbacks)
    try:
        try:
            async for chunk in request.stream():
                room.claim(len(chunk))
                await anyio.to_thread.run_sync(parser.write, chunk)
                room.wrote(len(chunk))
            parser.finalize()
        except MultipartParseError as e:
            raise http_error(400, f"malformed multipart body: {e}") from e
        finally:
            if part.get("file") is not None:
                part["file"].close()
        if not ended:
            raise http_error(400, "malformed multipart body: it ends before its closing boundary (cut short?)")
    except BaseException:
        for p in files.values():
            p.unlink(missing_ok=True)
        raise
    return files, fields


_JSONL = ("application/x-ndjson", "application/jsonl")


async def spool_import(request: Request, folder: Path) -> dict[str, Path]:
    """The files of an import request, written into `folder` as they arrive: a JSON-lines body is the
    documents; a multipart body has parts `documents` (JSON lines) and `vectors` (a vector file, its
    format by its file name's extension)."""
    ctype, _ = parse_options_header(request.headers.get("content-type", ""))
    ctype = ctype.decode("latin-1").lower()
    if ctype in _JSONL:
        path = folder / "documents.jsonl"
        room = Room(request, folder)
        try:
            async with await anyio.open_file(path, "wb") as f:
                async for chunk in request.stream():
                    room.claim(len(chunk))
                    await f.write(chunk)
                    room.wrote(len(chunk))
        finally:
            room.close()
        return {"documents": path}
    if ctype != "multipart/form-data":
        raise http_error(415, f"send the documents as {' or '.join(_JSONL)} (JSON lines), or multipart/form-data with "
                          "parts 'documents' and 'vectors' (a .fvecs .fbin .npy ... file)")

    def place(name: str, filename: str) -> Path:
        if name == "documents":
            return folder / "documents.jsonl"
        if name == "vectors":
            ext = os.path.splitext(filename)[1].lower()
            if ext not in VECTOR_EXTENSIONS:
                raise http_error(422, f"the vectors part's file name must end in one of {', '.join(VECTOR_EXTENSIONS)}")
            return folder / f"vectors{ext}"
        raise http_error(422, f"unknown part {name[:40]!r}: an import takes 'documents' and 'vectors'")

    files, _ = await spool_multipart(request, Room(request, folder), place)
    if not files:
        raise http_error(422, "the multipart body has neither a 'documents' nor a 'vectors' part")
    return files
