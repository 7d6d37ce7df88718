"""Micro-benchmarks of the hot path: the admission decision and /metrics rendering.

    python -m bench.micro            # prints a Markdown table

Both run with 1,000 requests in flight in the ledger, on the real classes, no I/O.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.engine.discovery import EngineConfig
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import project_counts
from sidecar.observability.exporter import Metrics

IN_FLIGHT = 1000
BLOCKS = UniformBlocks(16, 2 * 1024 * 1024)


ENGINE = EngineConfig(
    model="m",
    max_model_len=32768,
    block_size=16,
    num_gpu_blocks=1_000_000,
    cache_dtype="auto",
    prefix_caching=True,
    blocks=UniformBlocks(16, 2 << 20),
    bytes_per_block=2 << 20,
)


def snapshot(num_gpu_blocks: int = 1_000_000, usage: float = 0.4) -> EngineSnapshot:
    return EngineSnapshot(
        taken_at=time.monotonic(),
        block_size=16,
        num_gpu_blocks=num_gpu_blocks,
        engines=1,
        kv_cache_usage=usage,
        running=IN_FLIGHT,
        preemptions_total=0.0,
        generation_tokens_total=0.0,
        cache_dtype="auto",
        prefix_caching=True,
        kv_cache_memory_bytes=None,
        has_cache_config=True,
    )


def loaded_controller() -> AdmissionController:
    ac = AdmissionController(Ledger(BLOCKS), policy="queue", headroom=0.05, stale_after=3600)
    ac.on_snapshot(snapshot())
    for i in range(IN_FLIGHT):
        p = project_counts(
            (500 + i % 300,), requested_max_tokens=512, n=1, max_model_len=8192, blocks=BLOCKS
        )
        d = ac.try_admit(Ask(p, streamed=True))
        assert d is not None and d.reservation is not None
        ac.ledger.start(d.reservation)
        ac.ledger.advance(d.reservation, i % 400)
    return ac


def per_call(fn: Callable[[], object], *, repeat: int = 7, number: int = 2000) -> list[float]:
    """CPU seconds per call (process time: the machine is shared, wall time would count the
    time other processes held the CPU), one figure per repeat (take the median)."""
    gc.collect()
    out = []
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(number):
            fn()
        out.append((time.process_time() - t0) / number)
    return out


def bench_decision() -> list[float]:
    ac = loaded_controller()

    def decide() -> None:
        # what the proxy does per request: project, decide, and later release
        p = project_counts((731,), requested_max_tokens=512, n=1, max_model_len=8192, blocks=BLOCKS)
        d = ac.try_admit(Ask(p, streamed=True))
        assert d is not None and d.reservation is not None
        ac.release(d.reservation)

    return per_call(decide)


def bench_decision_near_capacity() -> list[float]:
    """The same decision when the sum of the reserved peaks is over the budget, so that the
    future peak of the 1,000 trajectories is computed (sidecar/kv/trajectory.py)."""
    ac = loaded_controller()
    reserved = ac.ledger.reserved_blocks
    # the sum of peaks is 20% over the pool; vLLM reports a tenth of it in use
    ac.on_snapshot(snapshot(num_gpu_blocks=int(reserved / 1.2), usage=0.1))

    def decide() -> None:
        p = project_counts((731,), requested_max_tokens=512, n=1, max_model_len=8192, blocks=BLOCKS)
        d = ac.try_admit(Ask(p, streamed=True))  # None: it would queue (not awaited here)
        if d is not None and d.reservation is not None:
            ac.release(d.reservation)

    return per_call(decide, repeat=7, number=200)


def bench_render() -> list[float]:
    ac = loaded_controller()
    registry = CollectorRegistry()
    metrics = Metrics(
        registry,
        ac,
        engine=lambda: ENGINE,
        vllm_up=lambda: True,
        ready=lambda: True,
        scrape_errors=lambda: 0,
        config_labels={"policy": "queue", "reservation": "worst-case", "headroom": "0.05"},
    )
    for _ in range(50):
        metrics.on_snapshot()
    return per_call(lambda: generate_latest(registry), repeat=7, number=50)


def bench_snapshot() -> list[float]:
    """on_snapshot with 1,000 in flight (runs every scrape interval, off the request path)."""
    ac = loaded_controller()
    return per_call(lambda: ac.on_snapshot(snapshot()), repeat=7, number=50)


def bench_collect() -> list[float]:
    """Only the collectors (the sidecar's state read and metric families built), no text."""
    ac = loaded_controller()
    registry = CollectorRegistry()
    Metrics(
        registry,
        ac,
        engine=lambda: ENGINE,
        vllm_up=lambda: True,
        ready=lambda: True,
        scrape_errors=lambda: 0,
        config_labels={"policy": "queue", "reservation": "worst-case", "headroom": "0.05"},
    )
    return per_call(lambda: list(registry.collect()), repeat=7, number=50)


def bench_render_without_created() -> list[float]:
    """What was tried: the same render without the ``_created`` series (they are a quarter of
    the families' samples and nobody queries them)."""
    import prometheus_client.metrics

    prometheus_client.metrics._use_created = False
    try:
        return bench_render()
    finally:
        prometheus_client.metrics._use_created = True


def render_lines() -> int:
    ac = loaded_controller()
    registry = CollectorRegistry()
    Metrics(
        registry,
        ac,
        engine=lambda: ENGINE,
        vllm_up=lambda: True,
        ready=lambda: True,
        scrape_errors=lambda: 0,
        config_labels={"policy": "queue", "reservation": "worst-case", "headroom": "0.05"},
    )
    text = generate_latest(registry).decode()
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def _micros(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs"


def _millis(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def main(argv: list[str] | None = None) -> dict[str, object]:
    from harness.bench_util import (
        ROOT,
        load_average,
        machine,
        machine_line,
        progress,
        update_section,
        write_json,
    )

    parser = argparse.ArgumentParser(
        prog="python -m bench.micro",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    args = parser.parse_args(argv)
    info = machine()
    asyncio.set_event_loop(asyncio.new_event_loop())
    progress("micro: admission decision, /metrics render, snapshot reconcile")
    rows = [
        ("admission decision (project + decide + release)", bench_decision(), 50e-6),
        ("  near capacity: the future peak computed", bench_decision_near_capacity(), None),
        ("/metrics render (`generate_latest`)", bench_render(), 5e-3),
        ("  of which the collectors alone (`registry.collect()`)", bench_collect(), None),
        ("  tried: render without `_created` series", bench_render_without_created(), None),
        ("reconcile with a vLLM snapshot (every scrape)", bench_snapshot(), None),
    ]
    after = [round(x, 2) for x in load_average()]
    lines = [
        f"Run: {machine_line(info, after)}.",
        "",
        f"Command: `python -m bench.micro` ({IN_FLIGHT} requests in flight in the ledger, real "
        "classes, no I/O; CPU time per call, 7 repeats, median and best). The exposition has "
        f"{render_lines()} samples.",
        "",
        "| what | median | best | target |",
        "|---|---|---|---|",
    ]
    figures: dict[str, dict[str, float | None]] = {}
    out: dict[str, object] = {"machine": info, "load_average_after": after, "rows": figures}
    for name, samples, target in rows:
        med = statistics.median(samples)
        tgt = (
            ""
            if target is None
            else (f"< {target * 1e6:.0f} µs" if target < 1e-3 else f"< {target * 1e3:.0f} ms")
        )
        ok = "" if target is None else (" met" if med < target else " **missed**")
        unit = _micros if med < 1e-3 else _millis
        lines.append(f"| {name} | {unit(med)} | {unit(min(samples))} | {tgt}{ok} |")
        figures[name] = {"median_s": med, "best_s": min(samples), "target_s": target}
    text = "\n".join(lines)
    print(text)
    if not args.no_report:  # the JSON goes with the section it backs
        write_json("micro", out)
        update_section(ROOT / "BENCHMARKS.md", "micro", text)
    return out


if __name__ == "__main__":
    main()
