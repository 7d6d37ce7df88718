"""Micro-benchmarks of the hot path: the admission decision and /metrics rendering.

    python -m bench.micro            # prints a Markdown table

They run with 4,000 requests in flight in the ledger (``--in-flight``), on the real classes, no
I/O.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import math
import random
import statistics
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.config import Policy
from sidecar.engine.discovery import EngineConfig
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.projection import project_counts
from sidecar.observability.exporter import Metrics

IN_FLIGHT = 4000
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
    ac = AdmissionController(Ledger(BLOCKS), policy=Policy.queue, headroom=0.05, stale_after=3600)
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


def _near_capacity() -> AdmissionController:
    ac = loaded_controller()
    reserved = ac.ledger.reserved_blocks
    # the sum of peaks is 20% over the pool; vLLM reports a tenth of it in use
    ac.on_snapshot(snapshot(num_gpu_blocks=int(reserved / 1.2), usage=0.1))
    return ac


def _decide_near_capacity(ac: AdmissionController) -> None:
    p = project_counts((731,), requested_max_tokens=512, n=1, max_model_len=8192, blocks=BLOCKS)
    d = ac.try_admit(Ask(p, streamed=True))  # None: it would queue (not awaited here)
    if d is not None and d.reservation is not None:
        ac.release(d.reservation)


def bench_decision_near_capacity() -> list[float]:
    """The same decision when the sum of the reserved peaks is over the budget, so that the
    future peak of the trajectories is checked (sidecar/kv/trajectory.py), the ledger unchanged
    since the last decision: its kept profile (sidecar/kv/rows.py) is reused."""
    ac = _near_capacity()
    return per_call(lambda: _decide_near_capacity(ac), repeat=7, number=200)


def _at_margin(margin: int) -> AdmissionController:
    """Loaded, with the budget ``margin`` blocks over the peak the decision's candidate makes."""
    ac = loaded_controller()
    p = project_counts((731,), requested_max_tokens=512, n=1, max_model_len=8192, blocks=BLOCKS)
    peak = ac.ledger.peak_with(ac.ledger.candidate(p, streamed=True))
    capacity = math.ceil((peak + margin) / (1 - ac.headroom))
    ac.on_snapshot(snapshot(num_gpu_blocks=capacity, usage=0.01))
    return ac


def bench_decision_near_capacity_changed(ac: AdmissionController | None = None) -> list[float]:
    """The same, each decision after one request in flight advanced a token (as every decision
    is when streams run), so the ledger's profile is out of date: the decision is refused on
    the bounds kept from the last profile (``sidecar.kv.rows.Bound``), no rebuild. The call
    includes that advance."""
    if ac is None:
        ac = _near_capacity()
    running = list(ac.ledger)
    turn = [0]

    def decide() -> None:
        res = running[turn[0] % len(running)]
        turn[0] += 1
        ac.ledger.advance(res, res.generated + 1)
        _decide_near_capacity(ac)

    return per_call(decide, repeat=7, number=200)


def bench_decision_admitted_on_bounds() -> list[float]:
    """The same with a budget 5,000 blocks over the candidate's peak (2% of it): admitted (and
    released) on the kept bounds; the profile is rebuilt when the requests' progress since has
    used that margin up."""
    return bench_decision_near_capacity_changed(_at_margin(5000))


def bench_exact_after_change() -> list[float]:
    """Where the kept bounds do not settle a decision (the budget between them), the exact peak:
    a request advanced, then the candidate's peak with the profile rebuilt from the columns.
    (Timed on the ledger: a decision at that margin flips as the requests advance.)"""
    ac = loaded_controller()
    ledger = ac.ledger
    running = list(ledger)
    p = project_counts((731,), requested_max_tokens=512, n=1, max_model_len=8192, blocks=BLOCKS)
    return _advance_then_peak(ledger, running, ledger.candidate(p, streamed=True), number=200)


def _advance_then_peak(
    ledger: Ledger, running: list[Reservation], candidate: Reservation, *, number: int
) -> list[float]:
    """Per call: one of ``running`` advanced a token, then ``candidate``'s exact peak."""
    turn = [0]

    def exact() -> None:
        res = running[turn[0] % len(running)]
        turn[0] += 1
        ledger.advance(res, res.generated + 1)
        ledger.peak_with(candidate)

    return per_call(exact, repeat=7, number=number)


#: GPT-OSS-20B's attention (openai/gpt-oss-20b's config.json): 24 layers alternating a
#: 128-token sliding window with full attention, 8 KV heads of 64
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_size": 2880,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def bench_exact_sliding(sequences: int = 500) -> list[float]:
    """The exact peak after a request advanced, on a sliding-window model (GPT-OSS-20B's
    geometry, blocks of 16, a 32k context) with ``sequences`` requests in flight, nine in ten
    started: prompts of 200-6,000 tokens, max_tokens 100-4,000 (seeded)."""
    from sidecar.kv.geometry import KVGeometry, ModelKV

    geo = KVGeometry.build(ModelKV.from_config(GPT_OSS_20B), block_size=16, max_model_len=32768)
    ledger = Ledger(geo, share_prefixes=False)
    rng = random.Random(7)
    for _ in range(sequences):
        p = project_counts(
            (rng.randint(200, 6000),),
            requested_max_tokens=rng.randint(100, 4000),
            n=1,
            max_model_len=32768,
            blocks=geo,
        )
        res = ledger.reserve(p, streamed=True)
        if rng.random() < 0.9:
            ledger.start(res)
            ledger.advance(res, rng.randint(1, 90))
    running = [r for r in ledger if r.started]
    p = project_counts((1000,), requested_max_tokens=1000, n=1, max_model_len=32768, blocks=geo)
    return _advance_then_peak(ledger, running, ledger.candidate(p, streamed=True), number=50)


def bench_refusal() -> list[float]:
    """A refusal near capacity under ``--policy reject`` with a measured decode step: the
    Retry-After slot searched over the trajectories (sidecar/admission/retry.py). Each refusal
    books its slot, as in a burst; the bookings are cleared every 50 refusals."""
    ac = _near_capacity()
    ac.policy = Policy.reject
    ac.pools[0].view.seconds_per_step = 0.03
    turn = [0]

    def refuse() -> None:
        turn[0] += 1
        if turn[0] % 50 == 0:
            ac.pools[0].retry._bookings.clear()
        p = project_counts((731,), requested_max_tokens=512, n=1, max_model_len=8192, blocks=BLOCKS)
        d = ac.try_admit(Ask(p, streamed=True))
        assert d is not None and d.reservation is None

    return per_call(refuse, repeat=7, number=50)


def bench_second_opinion() -> list[float]:
    """Adaptive mode's second opinion near capacity (``sidecar.admission.fit.spread_fits``):
    every sequence in flight spread over its class's 512 learned answers, the candidate's fit
    judged on that; one computation each (the controller rations them to 10% of its time,
    ``sidecar.admission.second_opinion``)."""
    import random

    from sidecar.admission.fit import spread_fits
    from sidecar.admission.learner import LengthLearner
    from sidecar.admission.pools import pool_state

    ac = _near_capacity()
    learner = LengthLearner()
    rng = random.Random(1)
    for klass in {r.klass for r in ac.ledger}:
        for _ in range(512):
            learner.observe(klass, rng.randint(1, 512))
    p = project_counts((731,), requested_max_tokens=512, n=1, max_model_len=8192, blocks=BLOCKS)
    candidate = ac.ledger.candidate(p, streamed=True)
    state = pool_state(ac.pools[0], False)

    def judge() -> None:
        windows, window_of = learner.spread_windows()
        spread_fits(ac.ledger, candidate, state, windows, window_of, headroom=0.05, quantile=0.95)

    return per_call(judge, repeat=7, number=20)


def bench_advance() -> list[float]:
    """A request in flight advances a token (the relay does this per streamed chunk)."""
    ac = loaded_controller()
    running = list(ac.ledger)
    turn = [0]

    def advance() -> None:
        res = running[turn[0] % len(running)]
        turn[0] += 1
        ac.ledger.advance(res, res.generated + 1)

    return per_call(advance, repeat=7, number=20000)


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


def bench_snapshot_surplus() -> list[float]:
    """The same when vLLM runs 10 fewer sequences than the ledger has started (answers whose
    last chunk has not reached the sidecar yet): the 10 most advanced are taken as finished."""
    ac = loaded_controller()
    snap = dataclasses.replace(snapshot(), running=IN_FLIGHT - 10)
    return per_call(lambda: ac.on_snapshot(snap), repeat=7, number=50)


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
    parser.add_argument(
        "--in-flight", type=int, default=4000, help="requests in flight in the ledger"
    )
    args = parser.parse_args(argv)
    global IN_FLIGHT
    IN_FLIGHT = args.in_flight
    info = machine()
    asyncio.set_event_loop(asyncio.new_event_loop())
    progress("micro: admission decision, /metrics render, snapshot reconcile")
    rows = [
        ("admission decision (project + decide + release)", bench_decision(), 50e-6),
        (
            "  near capacity, the ledger unchanged since the last decision",
            bench_decision_near_capacity(),
            50e-6,
        ),
        (
            "  near capacity, a request advanced since the last decision: refused on the "
            "kept bounds",
            bench_decision_near_capacity_changed(),
            50e-6,
        ),
        (
            "  the same, admitted on the kept bounds (budget 5,000 blocks over)",
            bench_decision_admitted_on_bounds(),
            50e-6,
        ),
        (
            "  the same where the bounds do not settle it: the exact peak (profile rebuilt)",
            bench_exact_after_change(),
            None,
        ),
        (
            "  a sliding-window model (GPT-OSS-20B's geometry), 500 in flight: a request "
            "advanced, then the exact peak",
            bench_exact_sliding(),
            None,
        ),
        ("  near capacity, refused with Retry-After (`--policy reject`)", bench_refusal(), None),
        (
            "  adaptive mode's second opinion: the spread ends over every sequence in flight",
            bench_second_opinion(),
            None,
        ),
        (
            "a request advances a token (the ledger's part of a relayed chunk)",
            bench_advance(),
            None,
        ),
        ("/metrics render (`generate_latest`)", bench_render(), 10e-3),
        ("  of which the collectors alone (`registry.collect()`)", bench_collect(), None),
        ("  tried: render without `_created` series", bench_render_without_created(), None),
        ("reconcile with a vLLM snapshot (every scrape)", bench_snapshot(), 2e-3),
        ("  vLLM running 10 fewer than the ledger has started", bench_snapshot_surplus(), 2e-3),
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
