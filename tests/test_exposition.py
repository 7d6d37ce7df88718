"""What a scrape costs the event loop that decides admission: ``/metrics`` rendered in slices
that give the loop back (``sidecar.observability.exposition``), the same text as
prometheus_client's; the admission gauges still one moment's; and the exporter's work after each
scrape of vLLM kept to that scrape's figures (no pass over the ledger)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from sidecar.admission.ask import Ask, KVState
from sidecar.admission.controller import AdmissionController
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.projection import project_counts
from sidecar.observability.exporter import Metrics
from sidecar.observability.exposition import render
from tests.support.exporter import build_metrics
from tests.support.snapshots import Clock, snapshot

BLOCKS = UniformBlocks(128, 131_072)


def fixed_registry() -> CollectorRegistry:
    """Families of every kind, whose values do not move between two renders."""
    registry = CollectorRegistry()
    c = Counter("things", "Things, by kind.", ["kind"], registry=registry)
    c.labels("a").inc(3)
    c.labels('b"\n').inc()  # a label value to escape
    h = Histogram("waits_seconds", "Waits.", buckets=(0.1, 1.0), registry=registry)
    for x in (0.05, 0.5, 5.0):
        h.observe(x)
    Gauge("depth", "Depth\\with a backslash.", registry=registry).set(float("inf"))
    Info("build", "The build.", registry=registry).info({"version": "1"})
    return registry


class Watching(Collector):
    """Records, as it is collected, whether ``flag`` has been set meanwhile."""

    def __init__(self, name: str, flag: dict[str, bool], seen: list[bool]) -> None:
        self.name, self.flag, self.seen = name, flag, seen

    def collect(self) -> Iterable[Metric]:
        self.seen.append(self.flag["set"])
        return [GaugeMetricFamily(self.name, "A gauge.", value=1.0)]


def test_the_sliced_render_is_prometheus_clients_text() -> None:
    registry = fixed_registry()
    expected = generate_latest(registry)
    for slice_seconds in (0.0, 0.001, 60.0):
        assert asyncio.run(render(registry, slice_seconds=slice_seconds)) == expected


def test_the_render_gives_the_loop_back_once_a_slice_is_spent() -> None:
    """Whatever is due on the loop (a decision, a relay message) runs between two families once
    a slice is spent, not after the whole render."""

    async def scrape(slice_seconds: float) -> list[bool]:
        flag: dict[str, bool] = {"set": False}
        seen: list[bool] = []
        registry = CollectorRegistry()
        for i in range(4):
            registry.register(Watching(f"g{i}", flag, seen))
        asyncio.get_running_loop().call_soon(flag.__setitem__, "set", True)
        await render(registry, slice_seconds=slice_seconds)
        return seen

    assert asyncio.run(scrape(0.0)) == [False, True, True, True]
    # a render that fits in its slice is one piece
    assert asyncio.run(scrape(60.0)) == [False, False, False, False]


def build(
    ready: Callable[[], bool] = lambda: True,
) -> tuple[CollectorRegistry, Metrics, AdmissionController, Clock]:
    return build_metrics(ready=ready)


def admit(ac: AdmissionController, count: int) -> None:
    p = project_counts((271,), requested_max_tokens=700, n=1, max_model_len=1024, blocks=BLOCKS)
    for _ in range(count):
        d = ac.try_admit(Ask(p, streamed=True))
        assert d is not None and d.reservation is not None
        ac.ledger.start(d.reservation)


def test_the_admission_gauges_are_one_moments_whatever_the_render_does_between() -> None:
    """The state collector computes its families together: a render that gives the loop back
    between them (where a request may be admitted, or readiness change) still shows one
    moment."""
    ready = {"now": True}
    _, metrics, ac, clock = build(ready=lambda: ready["now"])
    ac.on_snapshot(snapshot(clock, used=0, running=0))
    admit(ac, 2)
    families = iter(metrics.collector.collect())
    first = next(families)
    admit(ac, 1)  # between two families of one scrape
    ready["now"] = False
    rest = {f.name: f.samples[0].value for f in families if f.samples}
    assert first.name == "kv_sidecar_kv_capacity_blocks"
    assert rest["kv_sidecar_requests_in_flight"] == 2
    assert rest["kv_sidecar_kv_reserved_blocks"] == 2 * 8
    assert rest["kv_sidecar_ready"] == 1.0


def test_after_a_scrape_of_vllm_the_exporter_reads_that_scrape_not_the_whole_state() -> None:
    """The prediction error after each scrape (every 0.5 s) needs the scrape's figures: no
    ``state()``, whose peaks are a pass over every request in flight."""
    registry, metrics, ac, clock = build()
    ac.on_snapshot(snapshot(clock, used=0, running=0))
    admit(ac, 3)
    clock.now += 1
    ac.on_snapshot(snapshot(clock, used=10, running=3))  # predicted: 3 blocks each
    state = ac.state()
    assert ac.at_snapshot() == (
        state.predicted_at_snapshot_blocks,
        state.actual_blocks,
        state.capacity_blocks,
    )
    calls: list[int] = []
    real_state = ac.state

    def counted() -> KVState:
        calls.append(1)
        return real_state()

    ac.state = counted  # type: ignore[method-assign]
    metrics.on_snapshot()
    assert calls == []
    assert ac.at_snapshot() == (9, 10, 63)  # observed: -1/63, between -0.02 and -0.01

    def bucket(le: str) -> float | None:
        name = "kv_sidecar_kv_prediction_relative_error_bucket"
        return registry.get_sample_value(name, {"le": le, "model_name": "tiny"})

    count = "kv_sidecar_kv_prediction_relative_error_count"
    assert registry.get_sample_value(count, {"model_name": "tiny"}) == 1
    assert (bucket("-0.02"), bucket("-0.01")) == (0, 1)
