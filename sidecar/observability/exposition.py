"""``/metrics`` rendered in slices, so that a scrape does not hold the event loop for its whole
render.

prometheus_client's ``generate_latest`` collects and formats every family in one call: at
2,000 requests in flight on the relay workers' owner that is some 5-8 ms (the admission state,
the process figures, some 400 sample lines), during which no worker's ``ADMIT`` is decided. The
same text is made here family by family, and the loop is given back (``await asyncio.sleep(0)``)
whenever a slice of ``slice_seconds`` has been spent: every decision, relay message and timer
due meanwhile runs between two slices. The text is byte for byte what ``generate_latest`` gives
(its format is per family); each family is still read in one piece, and a collector that must
be one moment (the admission state's gauges, from one :class:`~sidecar.admission.ask.KVState`)
computes its families in one go (``StateCollector`` does). Families of different collectors may
be read a slice apart, as two threads' updates already could be in prometheus_client.

>>> import asyncio
>>> from prometheus_client import CollectorRegistry, Counter, generate_latest
>>> registry = CollectorRegistry()
>>> Counter("a", "A.", registry=registry).inc()
>>> asyncio.run(render(registry, slice_seconds=0.0)) == generate_latest(registry)
True
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

#: seconds of rendering between two returns to the event loop
SLICE_SECONDS = 0.001


class _One(Collector):
    """One family, as a collector ``generate_latest`` formats."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterable[Metric]:
        return (self.family,)


async def render(registry: Collector, *, slice_seconds: float = SLICE_SECONDS) -> bytes:
    """``generate_latest(registry)``, giving the loop back after each ``slice_seconds`` spent."""
    out: list[bytes] = []
    began = time.perf_counter()
    for family in registry.collect():
        out.append(generate_latest(_One(family)))
        if time.perf_counter() - began >= slice_seconds:
            await asyncio.sleep(0)
            began = time.perf_counter()
    return b"".join(out)
