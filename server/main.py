"""Run the service under uvicorn: `fusionrag serve`."""

from __future__ import annotations

import uvicorn

from fusionrag.server.app import create_app
from fusionrag.server.config import ServerConfig
from fusionrag.server.logs import setup_logging


def serve(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT; then stop accepting, let requests in flight finish, close the collections."""
    setup_logging(config.log_level, config.log_format)
    app = create_app(config)
    uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None, access_log=False, lifespan="on",
        timeout_graceful_shutdown=config.shutdown_timeout_s,
    )).run()
