"""ASGI middleware: body limits and deadlines, and counting, timing and logging every request."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import anyio
from fastapi.exceptions import HTTPException
from fastapi.responses import JSONResponse

from fusionrag.server.metrics import Metrics
from fusionrag.server.errors import shaped

log = logging.getLogger("fusionrag.server")


# Routes whose body is a file, written to disk as it arrives: a restore and an import take max_upload_bytes, an
# OpenAI file upload (a document for a vector store) and a file chunked into a collection max_file_bytes.
_UPLOADS = re.compile(r"/v1/collections/[^/]+/(restore|import)")
_FILES = re.compile(r"/v1/files|/v1/collections/[^/]+/files")


def _deadline(seconds: float):
    """A deadline on one await: asyncio's own (3.11 on) where the loop is asyncio's, which costs a timer; anyio's
    cancel scope elsewhere (3.5% of the event loop's time on one-query searches, a receive a request)."""
    if _timeout is not None:
        try:
            asyncio.get_running_loop()
            return _timeout(seconds)
        except RuntimeError:
            pass
    return _AnyioDeadline(seconds)


class _AnyioDeadline:
    def __init__(self, seconds: float):
        self._scope = anyio.fail_after(seconds)

    async def __aenter__(self):
        return self._scope.__enter__()

    async def __aexit__(self, *exc):
        return self._scope.__exit__(*exc)


_timeout = getattr(asyncio, "timeout", None)


class BodyLimit:
    """413, with a message, for a body over the limit: at once when its declared length says so, else as soon as
    the bytes read pass it; 408 for a body that sends nothing for `timeout` seconds (both raised from `receive`,
    so the route answers them like any HTTPException)."""

    def __init__(self, app, limit: int, upload_limit: int, timeout: float = 60.0, file_limit: int | None = None):
        self.app, self.limit, self.upload_limit, self.timeout = app, limit, upload_limit, timeout
        self.file_limit = upload_limit if file_limit is None else file_limit

    @staticmethod
    def _message(size: int, exact: bool, limit: int, setting: str) -> str:
        return f"request body {'of' if exact else 'over'} {size} bytes is over the limit of {limit} bytes ({setting})"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        limit, setting = (self.upload_limit, "max_upload_bytes") if _UPLOADS.fullmatch(path) else (
            (self.file_limit, "max_file_bytes") if _FILES.fullmatch(path) else (self.limit, "max_body_bytes"))
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await JSONResponse(shaped(path, {"detail": self._message(int(declared), True, limit, setting)}, 413),
                                      413)(scope, receive, send)
        seen, whole = 0, False

        async def counted():
            nonlocal seen, whole
            if whole:  # after the body, receive() waits for the client to leave: no deadline on that
                return await receive()
            try:
                async with _deadline(self.timeout):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(408, f"the request body sent nothing for {self.timeout:g} s (body_timeout_s)",
                                    {"Connection": "close"}) from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, self._message(seen, False, limit, setting))
            return message

        await self.app(scope, counted, send)


class AddHeaders:
    """These headers on every answer (a sharded service's router replica says which it is)."""

    def __init__(self, app, headers: dict[str, str]):
        self.app, self.headers = app, [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        return await self.app(scope, receive, with_headers)


class ObserveMiddleware:
    """Counts and times every request by route, and logs it as one structured line."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        metrics = self.metrics
        metrics.active += 1
        if metrics.active > 1:
            metrics.overlapped_at = time.monotonic()
        try:
            await self.app(scope, receive, send_status)
        finally:
            metrics.active -= 1
            seconds = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", "unmatched")
            series = self.metrics.series
            series(self.metrics.requests, scope["method"], route, str(status)).inc()
            series(self.metrics.request_seconds, route).observe(seconds)
            log.info("request", extra={"method": scope["method"], "path": scope["path"], "status": status,
                                       "ms": round(seconds * 1000, 3),
                                       "client": (scope.get("client") or ("",))[0]})
