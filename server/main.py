"""Run the service under uvicorn: `fusionrag serve`."""

from __future__ import annotations

import contextlib
import signal

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from fusionrag.server.app import create_app
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


def serve(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT; then stop accepting, let requests in flight finish, close the collections,
    and return (the process exits 0)."""
    setup_logging(config.log_level, config.log_format)
    app = create_app(config)
    _Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None, access_log=False, lifespan="on",
        timeout_graceful_shutdown=config.shutdown_timeout_s,
    )).run()
