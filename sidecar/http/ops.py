"""The metrics port: ``/metrics``, ``/healthz``, ``/readyz`` and ``/state``, with its OpenAPI page.

A FastAPI app: typed response models document ``/readyz`` and ``/state`` at ``/docs`` and
``/openapi.json``, served only with ``--docs`` (Swagger UI loads from a CDN). Every
handler runs on the sidecar's event loop (``async def``), so that a scrape reads the ledger and
the queue in one consistent moment. ``/metrics`` is rendered in slices that give the loop back
between families (``sidecar.observability.exposition``): admission decides between them, and
the admission gauges are still computed together, from one state. Every answer carries
``X-Request-Id`` (the client's, else a new one: :class:`~sidecar.http.headers.RequestIdMiddleware`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from sidecar.admission.ask import KVState
from sidecar.http.headers import RequestIdMiddleware
from sidecar.observability.exposition import render


class Readiness(BaseModel):
    """Whether the pod should receive traffic, and why not."""

    ready: bool
    discovered: bool
    draining: bool
    vllm_up: bool
    vllm_healthy: bool
    vllm_metrics_age_seconds: float | None
    last_error: str | None


@dataclasses.dataclass(frozen=True)
class State(KVState):
    """The ledger, the queue and the engine's view, in KV blocks: every field of
    :class:`~sidecar.admission.ask.KVState`, the event loop's task count, and the runtime
    settings, the queue's oldest wait and the refusals by reason (``sidecar.http.admin``)."""

    event_loop_tasks: int = 0
    #: the runtime settings admission decides by now (changed with --admin's PATCH)
    settings: Mapping[str, float | int | str] = dataclasses.field(default_factory=dict)
    admin_enabled: bool = False
    queue_oldest_wait_seconds: float | None = None
    refusals_total: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: refusals by reason in the last ``refusals_recent_seconds`` (about a minute)
    refusals_recent: Mapping[str, int] = dataclasses.field(default_factory=dict)
    refusals_recent_seconds: float = 0.0


def finite(value: float) -> float | None:
    """JSON has no infinity: an unknown age is null."""
    return value if math.isfinite(value) else None


def build_ops_app(
    *,
    registry: CollectorRegistry,
    readiness: Callable[[], Readiness],
    state: Callable[[], KVState],
    event_loop_tasks: Callable[[], int],
    runtime: Callable[[], Mapping[str, Any]] = dict,
    docs: bool = False,
) -> FastAPI:
    app = FastAPI(
        title="kv-sidecar metrics port",
        description="The sidecar's own metrics, health and admission state.",
        # --docs: Swagger UI's page (its assets from a CDN) and the document it reads; no ReDoc
        docs_url="/docs" if docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if docs else None,
    )
    # every answer of the port, its 404s and 405s and the admin API's refusals included
    app.add_middleware(RequestIdMiddleware)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(await render(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> str:
        """The process is alive (liveness)."""
        return "ok\n"

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
    async def readyz() -> JSONResponse:
        """200 when the pod should receive traffic, else 503 with the reason."""
        info = readiness()
        return JSONResponse(info.model_dump(), status_code=200 if info.ready else 503)

    @app.get("/state", response_model=State)
    async def kv_state() -> State:
        """The admission state in KV blocks (what the gauges on /metrics are computed from)."""
        kv = state()
        values = {f.name: getattr(kv, f.name) for f in dataclasses.fields(kv)}
        return State(**values, event_loop_tasks=event_loop_tasks(), **runtime())

    return app
