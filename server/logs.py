"""Structured logs: one JSON object per line on stderr (or plain text), for the service and uvicorn alike."""

from __future__ import annotations

import json
import logging
import sys
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


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("fusionrag", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    # Requests are logged once, by the service's middleware, with their route and latency.
    logging.getLogger("uvicorn.access").disabled = True
