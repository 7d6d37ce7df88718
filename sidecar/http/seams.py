"""The narrow interfaces the HTTP layer depends on, instead of the whole app.

The proxy sees a :class:`Gate` (admit, queue, release, and progress of what it admitted), an
:class:`Upstream` (send one request to vLLM), the current :class:`Engine` (the discovered config and
its prompt counter, swapped in as one value), a :class:`MetricsSink` and the pod's
:class:`Traffic` (draining, pass-through requests in flight). The app wires the real ones;
tests may hand in their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from sidecar.admission.ask import Ask
from sidecar.admission.decisions import Decision, Reason
from sidecar.counting import CountedEndpoint, TokenCount
from sidecar.engine.discovery import EngineConfig
from sidecar.kv.ledger import Reservation
from sidecar.kv.projection import Projection


class Gate(Protocol):
    """Admission: decide, queue, follow progress, release."""

    def try_admit(self, ask: Ask) -> Decision | None:
        """Decide at once; None means "queue it" (then await :meth:`wait`)."""
        ...

    async def wait(self, ask: Ask, cancelled: asyncio.Event | None = None) -> Decision: ...

    def started(self, reservation: Reservation) -> None: ...

    def progressed(self, reservation: Reservation, generated_per_sequence: float) -> None: ...

    def release(self, reservation: Reservation, completion_tokens: int | None = None) -> None:
        """The request is over; ``completion_tokens`` when its answer ended naturally."""
        ...


class Counter(Protocol):
    """Counts a request's prompt tokens."""

    async def count(self, endpoint: CountedEndpoint, body: Mapping[str, Any]) -> TokenCount: ...


class Upstream(Protocol):
    """Sends one request to vLLM (an httpx transport): the response's head is read, its body
    is left to stream."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response: ...


class MetricsSink(Protocol):
    """What the request path records."""

    def counted(self, count: TokenCount) -> None: ...

    def projected(self, projection: Projection, bytes_per_block: int | None) -> None: ...

    def decision_time(self, seconds: float) -> None: ...

    def queue_waited(self, seconds: float) -> None: ...

    def answered(self, seconds: float) -> None: ...

    def decided(self, decision: Decision) -> None: ...

    def refused(self, reason: Reason, retry_after: float | None = None) -> None: ...

    def upstream_failed(self, kind: str) -> None: ...

    def completed(self, completion_tokens: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Engine:
    """The discovered engine and the counter built for it: one value, swapped whole."""

    config: EngineConfig
    counter: Counter


class Traffic:
    """The pod's traffic state that the drain and the proxy share."""

    __slots__ = ("draining", "passthrough_in_flight")

    def __init__(self) -> None:
        self.draining = False
        self.passthrough_in_flight = 0  # non-generating requests being relayed
