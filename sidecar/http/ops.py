"""The metrics port: ``/metrics``, ``/healthz``, ``/readyz`` and ``/state``, with its OpenAPI page.

A FastAPI app: typed response models document ``/readyz`` and ``/state`` at ``/docs``. Every
handler runs on the sidecar's event loop (``async def``), so that a scrape reads the ledger and
the queue in one consistent moment.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict

from sidecar.admission.controller import KVState


class Readiness(BaseModel):
    """Whether the pod should receive traffic, and why not."""

    ready: bool
    discovered: bool
    draining: bool
    vllm_up: bool
    vllm_healthy: bool
    vllm_metrics_age_seconds: float | None
    last_error: str | None


class State(BaseModel):
    """The ledger, the queue and the engine's view, in KV blocks."""

    model_config = ConfigDict(extra="forbid")  # every field of KVState, none forgotten

    capacity_blocks: int | None
    budget_blocks: int | None
    reserved_blocks: int
    future_peak_blocks: int
    worst_case_peak_blocks: int
    predicted_blocks: int
    shared_blocks: int
    actual_blocks: int | None
    external_blocks: int
    committed_blocks: int
    peak_blocks_in_flight: int
    peak_blocks_queued: int
    in_flight: int
    queue_depth: int
    snapshot_age: float | None
    predicted_at_snapshot_blocks: int | None
    in_flight_at_snapshot: int
    event_loop_tasks: int


def finite(value: float) -> float | None:
    """JSON has no infinity: an unknown age is null."""
    return value if math.isfinite(value) else None


def build_ops_app(
    *,
    registry: CollectorRegistry,
    readiness: Callable[[], Readiness],
    state: Callable[[], KVState],
    event_loop_tasks: Callable[[], int],
) -> FastAPI:
    app = FastAPI(
        title="kv-sidecar metrics port",
        description="The sidecar's own metrics, health and admission state.",
    )

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

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
        values = dataclasses.asdict(state())
        values["snapshot_age"] = finite(values["snapshot_age"])
        return State(**values, event_loop_tasks=event_loop_tasks())

    return app
