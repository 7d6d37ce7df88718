"""The engine's learned costs (``sidecar.admission.costs``): the step line from vLLM's iteration
histogram, the decode step from its inter-token latency, the recompute in decode steps, and the
quantile a recompute's cost asks for."""

from __future__ import annotations

import dataclasses

import pytest

from sidecar.admission.costs import (
    PRIOR_PREFILL_TOKENS_PER_STEP,
    EngineCosts,
    reserve_quantile,
)
from sidecar.engine.snapshot import EngineSnapshot

BASE = EngineSnapshot(
    taken_at=0.0,
    block_size=16,
    num_gpu_blocks=1000,
    engines=1,
    kv_cache_usage=0.5,
    running=8,
    preemptions_total=0,
    generation_tokens_total=0,
    cache_dtype="auto",
    prefix_caching=True,
    kv_cache_memory_bytes=None,
    has_cache_config=True,
)


class Engine:
    """A steady engine whose step takes ``base + per_token x tokens`` seconds, scraped every
    ``interval`` seconds: the snapshots vLLM's counters would give."""

    def __init__(self, base: float, per_token: float) -> None:
        self.base, self.per_token = base, per_token
        self.snap = BASE

    def run(
        self, seconds: float, *, batch: int, prefill_tokens_per_step: float = 0
    ) -> EngineSnapshot:
        tokens = batch + prefill_tokens_per_step
        step = self.base + self.per_token * tokens
        steps = seconds / step
        s = self.snap
        self.snap = dataclasses.replace(
            s,
            taken_at=s.taken_at + seconds,
            running=batch,
            steps_total=s.steps_total + steps,
            step_tokens_total=s.step_tokens_total + steps * tokens,
            inter_token_latency_sum=s.inter_token_latency_sum + steps * batch * step,
            inter_token_latency_count=s.inter_token_latency_count + steps * batch,
        )
        return self.snap


def learn(engine: Engine, costs: EngineCosts, loads: list[tuple[int, float]]) -> None:
    prev = engine.snap
    for batch, prefill in loads:
        snap = engine.run(0.5, batch=batch, prefill_tokens_per_step=prefill)
        costs.update(prev, snap)
        prev = snap


def test_the_step_line_is_learned_from_two_loads() -> None:
    engine, costs = Engine(base=0.010, per_token=2e-5), EngineCosts()
    # prefill steps among decode steps, then decode alone (the recent step is a decode step)
    learn(engine, costs, [(8, 0), (8, 512)] * 5 + [(8, 0)] * 20)
    line = costs.line()
    assert line is not None
    base, per_token = line
    assert base == pytest.approx(0.010, rel=1e-6) and per_token == pytest.approx(2e-5, rel=1e-6)
    # a decode step of 8 sequences takes 10.16 ms; a recompute of 1,000 tokens adds 20 ms: ~2 steps
    # (the smoothed inter-token latency still holds 0.8 ** 20 of the mixed steps: about 1 %)
    assert costs.step_seconds(8) == pytest.approx(0.01016, rel=0.02)
    assert costs.recompute_steps(1000) == pytest.approx(0.020 / 0.01016, rel=1e-2)


def test_one_load_gives_no_slope_and_the_prior_holds() -> None:
    engine, costs = Engine(base=0.010, per_token=2e-5), EngineCosts()
    learn(engine, costs, [(8, 0)] * 6)
    assert costs.line() is None
    assert costs.recompute_steps(4096) == 4096 / PRIOR_PREFILL_TOKENS_PER_STEP
    assert costs.step_seconds(8) == pytest.approx(0.01016, rel=1e-6)  # the measured decode step


def test_an_idle_interval_teaches_nothing() -> None:
    costs = EngineCosts()
    idle = dataclasses.replace(BASE, running=0)
    later = dataclasses.replace(idle, taken_at=10.0, steps_total=5, step_tokens_total=50)
    costs.update(idle, later)
    assert costs.figures().decode_step_seconds is None and costs.line() is None


def test_a_costly_prefill_makes_the_same_tokens_cost_more_steps() -> None:
    """A model whose prefill dominates (a large model, compute bound) against one whose decode
    step does: the same 8,000 tokens cost about 80 steps on the first, under 1 on the second."""
    heavy, light = EngineCosts(), EngineCosts()
    loads = [(8, 0), (8, 256)] * 5 + [(8, 0)] * 20
    learn(Engine(base=0.010, per_token=1e-4), heavy, loads)
    learn(Engine(base=0.010, per_token=1e-6), light, loads)
    assert heavy.recompute_steps(8000) > 70 and light.recompute_steps(8000) < 1


@pytest.mark.parametrize(
    ("steps", "risk", "quantile"),
    [
        (0.0, 1.0, 0.75),
        (4.0, 1.0, 0.75),
        (4.1, 1.0, 0.9),
        (10.0, 1.0, 0.9),
        (20.0, 1.0, 0.95),
        (100.0, 1.0, 0.99),
        (101.0, 1.0, None),
        (101.0, 2.0, 0.99),
        (8.0, 2.0, 0.75),
    ],
)
def test_the_quantile_a_recompute_asks_for(
    steps: float, risk: float, quantile: float | None
) -> None:
    assert reserve_quantile(steps, risk_steps=risk) == quantile
