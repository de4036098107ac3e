"""Request bodies written to the data disk as they arrive (an upload may be far larger than memory), kept out of
the disk reserve as they are written (Room: their room claimed before it is written, and counted by every other
upload's check): a whole body (a snapshot to restore), or a multipart body's files (a bulk import's documents and
vectors, an OpenAI file upload) with its small fields kept in memory. A bulk import's body sent with
Content-Encoding: gzip, or its part whose file name ends in .gz, is decompressed as it arrives (Inflate)."""

from __future__ import annotations

import os
import uuid
import zlib
from collections.abc import AsyncIterator
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


class Inflate:
    """A gzip stream decompressed as it arrives: push() its compressed bytes, pull() the decompressed ones a piece
    of at most PIECE bytes at a time (never the whole in memory), members one after another as gzip allows, zero
    padding after the last taken. Refused with 413, as soon as it passes either, where its decompressed bytes pass
    `limit` (max_upload_bytes: gzip takes an upload no further than the same bytes sent plain) or RATIO times the
    compressed bytes pushed, once past FLOOR (a decompression bomb: 200 MB of zeros gzip to 200 KB, where JSON lines
    compress 3 to 10-fold, and a vector file less); with 400 where it is not gzip or is corrupt, or (finish) where
    it stops inside its compressed data. what: the stream, as messages name it."""

    PIECE = 1 << 20
    RATIO = 200  # Apache's mod_deflate refuses a request body past the same (DeflateInflateRatioLimit)
    FLOOR = 16 << 20

    def __init__(self, what: str, limit: int):
        self.what, self.limit = what, limit
        self.compressed = self.size = 0  # bytes pushed, bytes pulled
        self._d = zlib.decompressobj(zlib.MAX_WBITS | 16)  # gzip's header and trailer (CRC-32, size) checked
        self._in = b""

    def push(self, data: bytes) -> None:
        self.compressed += len(data)
        self._in += data

    def pull(self) -> bytes:
        """The next piece of what was pushed, decompressed; b"" once all of it is (push more, or finish)."""
        while self._in:
            if self._d.eof:  # a member ended: zero padding (as gzip reads it), or the next member
                self._in = self._in.lstrip(b"\0")
                if not b"\x1f\x8b".startswith(self._in[:2]):  # not a member's magic
                    raise self._bad("after the end of its gzip data come bytes that are neither gzip nor padding")
                if len(self._in) < 2:  # padding, or the next member's first byte: wait for more
                    break
                self._d = zlib.decompressobj(zlib.MAX_WBITS | 16)
            before = len(self._in)
            try:
                out = self._d.decompress(self._in, self.PIECE)
            except zlib.error as e:
                raise self._bad(f"not a valid gzip stream ({e}), in its first {self.compressed} bytes") from e
            self._in = self._d.unused_data if self._d.eof else self._d.unconsumed_tail
            if out:
                self.size += len(out)
                self._bound()
                return out
            if len(self._in) >= before and not self._d.eof:  # no progress: wait for more
                break
        return b""

    def finish(self) -> None:
        """After the last bytes were pushed and pulled: refused where the stream stops inside a member."""
        if self.compressed and (not self._d.eof or self._in):
            raise self._bad(f"the gzip stream stops after {self.compressed} bytes, inside its compressed data (cut "
                            "short?)")

    def _bound(self) -> None:
        if self.size > self.limit:
            raise http_error(413, f"{self.what}: its decompressed bytes pass {self.limit}, the limit of an upload "
                             "(max_upload_bytes), which holds for what a gzip upload decompresses to as well")
        if self.size > self.FLOOR and self.size > self.RATIO * self.compressed:
            raise http_error(413, f"{self.what} inflates over {self.RATIO}-fold ({self.size} bytes from the first "
                             f"{self.compressed} compressed): refused as a decompression bomb (JSON lines compress "
                             "3 to 10-fold); send it uncompressed, or less compressible")

    def _bad(self, why: str):
        return http_error(400, f"{self.what}: {why}")


class _Sink:
    """A file that a part of an upload is written into as it arrives: decompressed first where inflate is given,
    and its room claimed before each write where room is given (what a gzip part decompresses to is more than
    its request declared). write() (in a worker thread: it may decompress), finish() after its last bytes,
    close() whatever happened."""

    def __init__(self, path: Path, inflate: Inflate | None = None, room: Room | None = None):
        self._f = open(path, "wb")
        self._inflate, self._room = inflate, room

    def write(self, data: bytes) -> None:
        if self._inflate is None:
            self._put(data)
            return
        self._inflate.push(data)
        while piece := self._inflate.pull():
            self._put(piece)

    def _put(self, data: bytes) -> None:
        if self._room is not None:
            self._room.claim(len(data))
        self._f.write(data)
        if self._room is not None:
            self._room.wrote(len(data))

    def finish(self) -> None:
        if self._inflate is not None:
            self._inflate.finish()
        self._f.close()

    def close(self) -> None:
        self._f.close()


_GZIP = ("gzip", "x-gzip")


def _content_encoding(request: Request, limit: int) -> Inflate | None:
    """An Inflate for a body sent with Content-Encoding: gzip, None for one sent as it is; 415 for another coding."""
    codings = [c.strip().lower() for c in request.headers.get("content-encoding", "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in _GZIP:
        return Inflate("the body (Content-Encoding: gzip)", limit)
    raise http_error(415, f"Content-Encoding {request.headers['content-encoding'][:40]!r} is not one an import takes: "
                          "gzip, or none")


async def _inflated(chunks: AsyncIterator[bytes], inflate: Inflate | None) -> AsyncIterator[bytes]:
    """chunks, decompressed as they arrive where inflate is given (in a worker thread, a piece at a time)."""
    async for chunk in chunks:
        if inflate is None:
            yield chunk
            continue
        inflate.push(chunk)
        while piece := await anyio.to_thread.run_sync(inflate.pull):
            yield piece
    if inflate is not None:
        inflate.finish()


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


async def spool_multipart(request: Request, room: Room, place: Callable[[str, str], Path | None],
                          body: AsyncIterator[bytes] | None = None,
                          opener: Callable[[str, str, Path], _Sink] | None = None
                          ) -> tuple[dict[str, Path], dict[str, str]]:
    """A multipart/form-data body: each part that place(name, filename) gives a path is written there as it
    arrives, the others (fields) kept in memory, up to FIELD_BYTES each. place raises (an HTTPException) for a
    part the route does not take. (files by name, fields by name); the caller removes the files, also on error.
    room is closed at the end. body: the body's bytes (the request's stream, unless given); opener(name, filename,
    path): the _Sink a part is written into (a plain file, unless given)."""
    try:
        return await _spool_multipart(request, room, place, request.stream() if body is None else body,
                                      opener or (lambda name, filename, path: _Sink(path)))
    finally:
        room.close()


async def _spool_multipart(request: Request, room: Room, place: Callable[[str, str], Path | None],
                           body: AsyncIterator[bytes], opener: Callable[[str, str, Path], _Sink]
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
        filename = disposition.get(b"filename", b"").decode("utf-8", "replace")
        path = place(name, filename)
        part["name"] = name
        if path is None:
            fields[name] = ""
            part["value_bytes"] = bytearray()
        else:
            files[name] = path
            part["file"] = opener(name, filename, path)

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
            part["file"].finish()
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
            async for chunk in body:
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
    format by its file name's extension). A body sent with Content-Encoding: gzip, and a part whose file name
    ends in .gz, are decompressed as they arrive (Inflate: max_upload_bytes bounds the bytes on the wire and,
    with the bomb's ratio, those they decompress to; the room of the decompressed bytes claimed as they are
    written)."""
    limit = state_of(request).config.max_upload_bytes
    ctype, _ = parse_options_header(request.headers.get("content-type", ""))
    ctype = ctype.decode("latin-1").lower()
    body = _inflated(request.stream(), _content_encoding(request, limit))
    if ctype in _JSONL:
        path = folder / "documents.jsonl"
        room = Room(request, folder)
        try:
            async with await anyio.open_file(path, "wb") as f:
                async for chunk in body:
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
            ext = os.path.splitext(filename[:-3] if _gz(filename) else filename)[1].lower()
            if ext not in VECTOR_EXTENSIONS:
                raise http_error(422, f"the vectors part's file name must end in one of {', '.join(VECTOR_EXTENSIONS)}"
                                      " (and .gz after it where it is gzipped)")
            return folder / f"vectors{ext}"
        raise http_error(422, f"unknown part {name[:40]!r}: an import takes 'documents' and 'vectors'")

    room = Room(request, folder)

    def opener(name: str, filename: str, path: Path) -> _Sink:
        if _gz(filename):
            return _Sink(path, Inflate(f"part {name!r} ({filename[:80]})", limit), room)
        return _Sink(path)

    files, _ = await spool_multipart(request, room, place, body, opener)
    if not files:
        raise http_error(422, "the multipart body has neither a 'documents' nor a 'vectors' part")
    return files


def _gz(filename: str) -> bool:
    return filename.lower().endswith(".gz")
