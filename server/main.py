"""Run the service under uvicorn: `fusionrag serve`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import logging

import threadpoolctl
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.server import HANDLED_SIGNALS

from fusionrag.retriever.errors import ConfigError
from fusionrag.server.app import create_app
from fusionrag.server.batcher import count_requests_in
from fusionrag.server.config import ServerConfig
from fusionrag.server.logs import setup_logging


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own re-raises the signal once its shutdown is done, so the process dies of it after an
        # orderly stop (exit 143 for SIGTERM, and `make run` says "Terminated"; a KeyboardInterrupt for Ctrl-C).
        # Here an orderly stop is the end of the run, and the process exits 0.
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


log = logging.getLogger("fusionrag.server")
SWITCH_INTERVAL_S = 0.001


def _check_device(config: ServerConfig) -> None:
    """--filter-tier gpu without a CUDA device is refused at start (it failed each collection as it opened); GPU
    settings that cannot apply are said once, at start. Under TRITON_INTERPRET=1 the GPU tier runs its kernels on
    the CPU (tests, the GPU acceptance's dry run), and is let be."""
    from fusionrag.retriever.engine.tiers import cuda_available

    if config.filter_tier != "gpu" and not config.gpu_budget_mb:
        return
    if cuda_available() or os.environ.get("TRITON_INTERPRET") == "1":  # (the interpreter: the kernels on the CPU)
        return
    if config.filter_tier == "gpu":
        raise ConfigError("--filter-tier gpu needs a CUDA device (and torch with CUDA and triton installed); this "
                          "machine has none: use auto (the GPU where there is one) or cpu")
    log.warning("--gpu-budget-mb %g is set, but there is no CUDA device here: the filter tier runs on the CPU",
                config.gpu_budget_mb)


class CoalescedWrites:
    """A connection's transport whose writes within one turn of the event loop leave as one: uvicorn writes a
    response's head and its body apart, two sends (and two segments) for every answer, where one does; the second
    send was ~3% of the event loop's busy time at one connection. What is written waits at most for the end of the
    loop's turn (or goes at once past WAIT_BYTES); close and write_eof send it first, abort drops it. Everything
    else is the transport's own (its flow control, extra info, reading)."""

    __slots__ = ("_transport", "_loop", "_waiting", "_bytes")
    WAIT_BYTES = 1 << 16

    def __init__(self, transport, loop):
        self._transport, self._loop, self._waiting, self._bytes = transport, loop, [], 0

    def write(self, data) -> None:
        if not self._waiting:
            self._loop.call_soon(self._send)
        self._waiting.append(data)
        self._bytes += len(data)
        if self._bytes >= self.WAIT_BYTES:
            self._send()

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def _send(self) -> None:
        if self._waiting:
            data = self._waiting[0] if len(self._waiting) == 1 else b"".join(self._waiting)
            self._waiting, self._bytes = [], 0
            if not self._transport.is_closing():  # the peer may have gone meanwhile: what it would get is dropped
                self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._bytes + self._transport.get_write_buffer_size()

    def write_eof(self) -> None:
        self._send()
        self._transport.write_eof()

    def close(self) -> None:
        self._send()
        self._transport.close()

    def abort(self) -> None:
        self._waiting, self._bytes = [], 0
        self._transport.abort()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class _HeadDeadline(AutoHTTPProtocol):
    """uvicorn's HTTP protocol (httptools', else h11's) with a deadline on each request's head: a connection that
    has not sent a whole request line and headers within head_timeout seconds of connecting, or of starting its
    next request, is closed (uvicorn's own timeouts cover only an idle keep-alive connection)."""

    head_timeout = 30.0
    _head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(CoalescedWrites(transport, self.loop))
        count_requests_in(self.server_state.tasks)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:  # httptools: a request's first bytes
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:  # httptools: its head is whole
        self._disarm()
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        conn = getattr(self, "conn", None)  # h11: its parser says whether a head is still arriving
        if conn is not None:
            import h11
            if conn.their_state is h11.IDLE and data:
                self._arm()
            else:
                self._disarm()

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            log.warning("closed a connection whose request head took over %s s (header_timeout_s)",
                        self.head_timeout, extra={"client": (self.client or ("",))[0]})
            self.transport.close()


def serve(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT; then stop accepting, let requests in flight finish, close the collections,
    and return (the process exits 0)."""
    setup_logging(config.log_level, config.log_format)
    _check_device(config)
    # A thread running Python keeps the GIL up to the switch interval while another waits for it: 5 ms by default,
    # which background work (an import's build, a file's chunks) added to each of a search's waits for the GIL.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # numpy's BLAS (OpenBLAS) on one thread, the caller's: its own threads spin between calls, and a search's small
    # products (a fresh tier's distances) woke them at every request: on a text collection with 3,000 fresh documents
    # they burnt a core, 25 against 16 ms of CPU a text query and 11% fewer answered. The engine's own pool (native)
    # and ONNX Runtime's threads do the service's parallel work; a merge's products then run on its niced thread.
    threadpoolctl.threadpool_limits(1, user_api="blas")
    app = create_app(config)
    protocol = type("HTTPProtocol", (_HeadDeadline,), {"head_timeout": config.header_timeout_s})
    _Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None, access_log=False, lifespan="on",
        timeout_graceful_shutdown=config.shutdown_timeout_s, http=protocol,
    )).run()
