"""The service's two output paths off the event loop's hot path: log lines written from a thread of their own
(logs.DeferredHandler) and a response's head and body sent together (main.CoalescedWrites). Both must keep what they
carry whole and in order; checked here on real streams, a real event loop and a real service."""

import asyncio
import io
import json
import logging
import re
import socket
import threading
import time

import httpx
import numpy as np

from fusionrag.server.logs import DeferredHandler, JsonFormatter
from fusionrag.server.main import CoalescedWrites


class _CountingStream(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = 0
        self.lock = threading.Lock()

    def write(self, s):
        with self.lock:
            self.writes += 1
            return super().write(s)


def _logger(handler) -> logging.Logger:
    log = logging.getLogger(f"fusionrag.test_io_paths.{id(handler)}")
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def test_deferred_log_lines_keep_their_order_and_reach_the_stream_in_few_writes():
    stream = _CountingStream()
    handler = DeferredHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = _logger(handler)
    for i in range(500):
        log.info("request", extra={"i": i})
    assert stream.getvalue() == ""  # not written by the thread that logged
    log.warning("something", extra={"i": 500})  # at once, after the 500 waiting before it
    assert [json.loads(line)["i"] for line in stream.getvalue().splitlines()] == list(range(501))
    for i in range(501, 600):
        log.info("request", extra={"i": i})
    deadline = time.monotonic() + 5
    while len(stream.getvalue().splitlines()) < 600:  # the handler's thread writes them within its interval
        assert time.monotonic() < deadline
        time.sleep(0.01)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["i"] for line in lines] == list(range(600))
    assert lines[500]["level"] == "warning" and lines[0]["msg"] == "request"
    assert stream.writes < 20, stream.writes  # batches, not a write a line
    log.info("last", extra={"i": 600})
    handler.close()  # what waits is written when the handler closes (at exit too)
    assert json.loads(stream.getvalue().splitlines()[-1])["i"] == 600


def test_setting_logging_up_again_ends_the_handler_it_replaces(monkeypatch):
    """setup_logging replaces its handler: the one before has its lines written and its thread ended, so calls of it
    (a service started again in one process, the tests') keep one log thread, not one a call."""
    import sys

    from fusionrag.server.logs import setup_logging

    stream = _CountingStream()
    monkeypatch.setattr(sys, "stderr", stream)
    names = ("fusionrag", "uvicorn", "uvicorn.error")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}
    try:
        handlers = []
        for i in range(5):
            setup_logging("info", "json")
            handlers.append(logging.getLogger("fusionrag").handlers[0])
            logging.getLogger("fusionrag").info("line", extra={"i": i})
        threads = [t for t in threading.enumerate() if t.name == "fusionrag-log" and t.is_alive()]
        mine = [h._thread for h in handlers]
        assert [t for t in threads if t in mine] == [handlers[-1]._thread]  # only the last one's thread lives
        assert len({id(logging.getLogger(n).handlers[0]) for n in names}) == 1
        handlers[-1].flush()
        assert [json.loads(line)["i"] for line in stream.getvalue().splitlines()] == list(range(5))  # none lost
    finally:
        for n, (hs, level, propagate) in saved.items():
            logger = logging.getLogger(n)
            for h in logger.handlers:
                if h not in hs and isinstance(h, DeferredHandler):
                    h.close()
            logger.handlers[:], logger.level, logger.propagate = hs, level, propagate


class _Transport:
    def __init__(self):
        self.sent, self.closed, self.aborted = [], False, False

    def write(self, data):
        assert not self.closed
        self.sent.append(bytes(data))

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def abort(self):
        self.aborted = self.closed = True

    def get_write_buffer_size(self):
        return 0

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


def test_writes_in_one_turn_of_the_loop_leave_as_one_and_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        raw = _Transport()
        t = CoalescedWrites(raw, loop)
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
        t.write(b"body")
        assert raw.sent == [] and t.get_write_buffer_size() == 42
        await asyncio.sleep(0)
        assert raw.sent == [b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody"]
        big = b"x" * CoalescedWrites.WAIT_BYTES
        t.write(b"head")
        t.write(big)  # past WAIT_BYTES: sent at once, with what waited before it
        assert raw.sent[-1] == b"head" + big
        t.write(b"a")
        t.writelines([b"b", b"c"])
        t.close()  # sends what waits, then closes
        assert raw.sent[-1] == b"abc" and raw.closed
        assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the transport's own
        gone = _Transport()
        t = CoalescedWrites(gone, loop)
        t.write(b"late")
        gone.closed = True  # the peer went before the loop's turn ended: nothing is written to a closed transport
        await asyncio.sleep(0)
        assert gone.sent == []
        t = CoalescedWrites(raw := _Transport(), loop)
        t.write(b"dropped")
        t.abort()
        await asyncio.sleep(0)
        assert raw.sent == [] and raw.aborted

    asyncio.run(main())


def test_a_real_service_answers_whole_through_the_coalesced_transport(tmp_path):
    """Through `fusionrag serve` (uvicorn, httptools, the service's protocol and its coalesced writes): a search's
    answer and an error's arrive whole, head and body, request after request on one keep-alive connection."""
    from urllib.parse import urlparse

    from server_util import ServerProcess

    srv = ServerProcess(tmp_path / "data", tmp_path / "log", "--no-demo")
    try:
        srv.wait_ready()
        with srv.client() as c:
            assert c.post("/v1/collections", json={"name": "c", "dimension": 4, "metric": "l2"}).status_code == 201
            docs = [{"id": str(i), "vector": v} for i, v in enumerate(np.eye(4).tolist())]
            assert c.post("/v1/collections/c/documents", json={"documents": docs}).status_code == 200
        port = urlparse(srv.url).port
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(10)
            for body, status in ((b'{"vectors": [[1, 0, 0, 0]], "k": 2}', b"200"), (b'{"vectors": [[1, 0]]}', b"422")):
                for _ in range(3):
                    s.sendall(b"POST /v1/collections/c/search HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                    time.sleep(0.2)  # the whole answer has arrived by now, in however many segments it was sent
                    got = s.recv(1 << 20)
                    head, _, rest = got.partition(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 " + status), got[:200]
                    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                      if line.lower().startswith(b"content-length")))
                    assert len(rest) == length, (len(rest), length)
                    json.loads(rest)
        r = httpx.get(f"{srv.url}/healthz")
        assert r.status_code == 200

        # A lone client's searches run on the event loop; a burst of concurrent ones goes to the search threads
        # (the loop must parse requests meanwhile), bar the first of it at most.
        def on_loop() -> float:
            text = httpx.get(f"{srv.url}/metrics").text
            return float(re.search(r"^fusionrag_searches_on_event_loop_total (\S+)$", text, re.M).group(1))

        body = {"vectors": [[1, 0, 0, 0]], "k": 2}
        time.sleep(1.2)  # past QUIET_S since anything overlapped
        before = on_loop()
        with srv.client() as c:
            for _ in range(20):
                assert c.post("/v1/collections/c/search", json=body).status_code == 200
        assert on_loop() - before == 20
        before = on_loop()

        def client():
            with srv.client() as c:
                for _ in range(20):
                    assert c.post("/v1/collections/c/search", json=body).status_code == 200

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert on_loop() - before <= 16, on_loop() - before  # of 160
        # Bursts: 16 connections each send a search at once, 10 times. Their requests are read in few turns of the
        # loop and each runs to its end without waiting on anything, so a count of the requests that have started
        # saw one at a time and ran all 160 on the loop, one core for all (1,000 q/s at 16 connections where the
        # threads gave 2,200); the server's own count of requests in progress sees them together.
        raw = b"".join([b"POST /v1/collections/c/search HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n",
                        b"content-length: %d\r\n\r\n" % len(json.dumps(body)), json.dumps(body).encode()])
        before = on_loop()
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
        try:
            for _ in range(10):
                for s in conns:
                    s.sendall(raw)
                for s in conns:
                    s.settimeout(10)
                    got = b""
                    while not (b"\r\n\r\n" in got and len(got.partition(b"\r\n\r\n")[2]) >= int(
                            re.search(rb"content-length: (\d+)", got, re.I).group(1))):
                        got += s.recv(65536)
                    assert got.startswith(b"HTTP/1.1 200"), got[:100]
        finally:
            for s in conns:
                s.close()
        assert on_loop() - before <= 40, on_loop() - before  # of 160
    finally:
        srv.stop()


def test_what_the_start_made_is_kept_out_of_the_collectors_passes(tmp_path):
    """life.load freezes what the start made (gc.freeze: the models' libraries are millions of objects, whose full
    passes held the GIL ~0.1-0.2 s), so a collection pass after it walks only what requests made since."""
    import gc

    from integration_helpers import serving

    from fusionrag.server.app import create_app
    from fusionrag.server.config import ServerConfig

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        with serving(create_app(ServerConfig(data_dir=str(tmp_path), demo=False))) as url:
            assert httpx.get(f"{url}/readyz").status_code == 200
            frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # the interpreter's and the service's objects at least
    finally:
        gc.unfreeze()
