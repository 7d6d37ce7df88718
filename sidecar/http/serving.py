"""The uvicorn servers of the two ports, configured once for the sidecar and its relay workers."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import uvicorn

from sidecar.config import Settings


class Server(uvicorn.Server):
    """A uvicorn server that leaves signals to us (servers share one loop and one drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def uvicorn_config(app: Any, settings: Settings, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=port,
        lifespan="off",
        access_log=False,  # the proxy writes its own (sidecar.access, --access-log)
        log_config=None,  # run() has set up logging: uvicorn's lines go through it too
        server_header=False,  # the upstream's own Server and Date headers pass through
        date_header=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
        backlog=4096,
    )
