"""The proxy app and the uvicorn servers of the two ports, built once for the sidecar and its
relay workers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import uvicorn

from sidecar.config import AccessLog, Settings, parse_priority_rules
from sidecar.http.clients import upstream_timeout
from sidecar.http.generation import GenerationPath
from sidecar.http.proxy import Proxy
from sidecar.http.relay import Relay
from sidecar.http.seams import Engine, Gate, MetricsSink, Traffic, Upstream
from sidecar.http.stream_usage import stream_usage_asked

if TYPE_CHECKING:
    from sidecar.observability.tracing import Tracing


def build_proxy(
    settings: Settings,
    *,
    transport: Upstream,
    gate: Gate,
    engine: Callable[[], Engine | None],
    metrics: MetricsSink,
    traffic: Traffic,
    tracing: Tracing | None,
) -> Proxy:
    """The proxy port's app: pass-through and the generation path, on one relay to vLLM."""
    relay = Relay(transport, settings.upstream, upstream_timeout(settings))
    return Proxy(
        relay=relay,
        generation=GenerationPath(
            gate=gate,
            engine=engine,
            metrics=metrics,
            relay=relay,
            max_body_bytes=settings.max_body_bytes,
            access_log=settings.access_log is not AccessLog.off,
            tracing=tracing,
            priority_rules=parse_priority_rules(settings.priority_rules),
            forward_priority=settings.forward_priority,
            spill_status=settings.spill_status,
            stream_usage=stream_usage_asked(settings.stream_usage, settings.reservation),
        ),
        traffic=traffic,
        metrics=metrics,
        max_headers=settings.max_headers,
        max_header_bytes=settings.max_header_bytes,
        access_log=settings.access_log is AccessLog.all,
        docs=settings.docs,
    )


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
