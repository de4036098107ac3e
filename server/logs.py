"""Structured logs: one JSON object per line on stderr (or plain text), for the service and uvicorn alike."""

from __future__ import annotations

import atexit
import collections
import json
import logging
import sys
import threading
import time

import orjson

# Attributes every LogRecord has; anything else was passed in `extra=` and belongs in the line.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName",
                                                                        "color_message"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line, written by orjson, its time stamp formatted once a second (the service logs a line a
    request: a one-query search cost 6% more CPU with the log at info than at warning)."""

    _second, _stamp = -1, ""

    def _ts(self, created: float, msecs: float) -> str:
        second = int(created)
        if second != self._second:  # the date and time to the second, formatted once a second
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int(msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": self._ts(record.created, record.msecs),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        # What callers passed in `extra=`; not what libraries add to every record for themselves (Ray's log record
        # factory adds _ray_timestamp_ns to each once a sharded collection starts Ray): their names start with "_".
        line.update((k, v) for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_"))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        try:
            return orjson.dumps(line, default=str).decode()
        except TypeError:  # what orjson does not write (an integer past 64 bits, a dict with keys not strings)
            return json.dumps(line, default=str)


class DeferredHandler(logging.StreamHandler):
    """A stream handler that formats and writes lines below warning from a thread of its own, those that wait
    together every INTERVAL_S in one write, rather than on the thread that logs: the service logs a line per
    request from its event loop, where formatting and writing it was ~5% of the loop's busy time at one connection.
    A warning or worse is written at once, after the lines waiting before it (in order). What waits is written when
    the handler is flushed or closed (at exit too); a process killed outright loses at most INTERVAL_S of info
    lines."""

    INTERVAL_S = 0.05

    def __init__(self, stream=None):
        super().__init__(stream)
        self._waiting: collections.deque[logging.LogRecord] = collections.deque()
        self._writing = threading.RLock()  # one batch written at a time, in order (StreamHandler.emit flushes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fusionrag-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            with self._writing:
                self._write_waiting()
                super().emit(record)
        else:
            self._waiting.append(record)

    def _write_waiting(self) -> None:
        lines = []
        while self._waiting:
            record = self._waiting.popleft()
            try:
                lines.append(self.format(record))
            except Exception:  # noqa: BLE001 - as logging does: said on stderr, the rest written
                self.handleError(record)
        if lines:
            try:
                self.stream.write("\n".join(lines) + "\n")
                self.stream.flush()
            except Exception:  # noqa: BLE001
                self.handleError(logging.makeLogRecord({"msg": "writing log lines failed"}))

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            if self._waiting:
                with self._writing:
                    self._write_waiting()

    def flush(self) -> None:
        with self._writing:
            self._write_waiting()
        super().flush()

    def close(self) -> None:
        atexit.unregister(self.close)
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(1.0)
        try:
            self.flush()
        except ValueError:  # the stream is closed already
            pass
        super().close()


def setup_logging(level: str, fmt: str) -> None:
    handler = DeferredHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    replaced = set()
    for name in ("fusionrag", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        replaced.update(h for h in logger.handlers if isinstance(h, DeferredHandler))
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    for old in replaced:  # an earlier call's: its lines written, its thread ended (not one a call kept)
        old.close()
    # Requests are logged once, by the service's middleware, with their route and latency.
    logging.getLogger("uvicorn.access").disabled = True
