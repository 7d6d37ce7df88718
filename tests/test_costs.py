"""The engine's learned costs (``sidecar.admission.costs``): the decode line (the inter-token
latency against the batch), the prefill's cost per prompt token computed (finished requests'
prefill time less a decode step), the recompute in decode steps, the batch's fixed share, and
the quantile a recompute's cost asks for."""

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
    """A steady engine whose decode step takes ``base + per_sequence x batch`` seconds and whose
    prefill adds ``per_token`` a prompt token to the step it runs in, scraped every 0.5 s: the
    snapshots vLLM's counters would give (``prompts`` requests of ``prompt`` tokens finishing
    each interval, a share ``cached`` of their tokens found in the prefix cache)."""

    def __init__(self, base: float, per_token: float, per_sequence: float = 0.0) -> None:
        self.base, self.per_token, self.per_sequence = base, per_token, per_sequence
        self.snap = BASE

    def run(
        self, *, batch: int, prompts: int = 0, prompt: int = 256, cached: float = 0.0
    ) -> EngineSnapshot:
        step = self.base + self.per_sequence * batch
        tokens = 0.5 / step * batch
        computed = prompt * (1 - cached)
        s = self.snap
        self.snap = dataclasses.replace(
            s,
            taken_at=s.taken_at + 0.5,
            running=batch,
            generation_tokens_total=s.generation_tokens_total + tokens,
            inter_token_latency_sum=s.inter_token_latency_sum + tokens * step,
            inter_token_latency_count=s.inter_token_latency_count + tokens,
            prefill_seconds_sum=s.prefill_seconds_sum
            + prompts * (step + self.per_token * computed),
            prefill_count=s.prefill_count + prompts,
            prompt_tokens_sum=s.prompt_tokens_sum + prompts * prompt,
            prompt_tokens_total=s.prompt_tokens_total + prompts * prompt,
            prompt_tokens_cached=s.prompt_tokens_cached + prompts * prompt * cached,
        )
        return self.snap


def learn(engine: Engine, costs: EngineCosts, loads: list[tuple[int, int]], **kw: float) -> None:
    """Intervals of ``(batch, prompts finished)``."""
    prev = engine.snap
    for batch, prompts in loads:
        snap = engine.run(batch=batch, prompts=prompts, **kw)  # type: ignore[arg-type]
        costs.update(prev, snap)
        prev = snap


def test_the_decode_line_and_the_prefill_cost_are_learned() -> None:
    engine = Engine(base=0.010, per_token=2e-5, per_sequence=1e-4)
    costs = EngineCosts()
    learn(engine, costs, [(8, 2), (16, 0), (12, 1), (8, 0)] * 10)
    line = costs.line()
    assert line is not None
    # the batch of an interval is read as the mean of its two ends' (vLLM's running gauge):
    # between loads that differ, a little off
    assert line[0] == pytest.approx(0.010, rel=0.01) and line[1] == pytest.approx(1e-4, rel=0.05)
    assert costs.prefill_seconds_per_token() == pytest.approx(2e-5, rel=0.05)
    # a decode step of 8 sequences takes 10.8 ms; a recompute of 1,000 tokens adds 20 ms
    assert costs.step_seconds(8) == pytest.approx(0.0108, rel=0.05)
    assert costs.recompute_steps(1000) == pytest.approx(0.020 / 0.0108, rel=0.05)
    # the base over the step at the recent batch (the last interval's ends, 12 and 8: 10)
    assert costs.batch == 10
    assert costs.fixed_share() == pytest.approx(0.010 / 0.011, rel=0.01)
    assert costs.gain_steps(100) == pytest.approx(100 * 0.010 / 0.011 / 10, rel=0.01)


def test_prefix_cache_hits_are_not_counted_as_computed() -> None:
    """Half of every prompt found in the prefix cache: the prefill's time is what the other
    half cost, so a token computed costs what it does without the cache."""
    costs = EngineCosts()
    learn(Engine(base=0.010, per_token=2e-5), costs, [(8, 2)] * 10, cached=0.5)
    assert costs.prefill_seconds_per_token() == pytest.approx(2e-5, rel=0.05)


def test_a_host_that_slows_both_alike_leaves_the_recompute_in_steps_unchanged() -> None:
    """A busy host that makes the engine's steps three times slower makes its prefills three
    times slower too: the recompute in decode steps, the ratio, stays (a fit of the step time
    against tokens per step read such a host as a costly prefill)."""
    quiet, busy = EngineCosts(), EngineCosts()
    learn(Engine(base=0.010, per_token=2e-5), quiet, [(8, 2)] * 10)
    learn(Engine(base=0.030, per_token=6e-5), busy, [(8, 2)] * 10)
    assert busy.recompute_steps(500) == pytest.approx(quiet.recompute_steps(500), rel=1e-6)


def test_a_batch_that_never_varied_gives_no_line() -> None:
    costs = EngineCosts()
    learn(Engine(base=0.010, per_token=2e-5, per_sequence=1e-4), costs, [(8, 1)] * 20)
    assert costs.line() is None and costs.fixed_share() is None and costs.gain_steps(100) == 0
    assert costs.prefill_seconds_per_token() is not None
    assert costs.step_seconds(8) == pytest.approx(0.0108, rel=1e-6)  # the measured decode step


def test_nothing_measured_the_prior_holds() -> None:
    costs = EngineCosts()
    learn(Engine(base=0.010, per_token=2e-5), costs, [(8, 0)] * 6)
    assert costs.prefill_seconds_per_token() is None
    assert costs.recompute_steps(4096) == 4096 / PRIOR_PREFILL_TOKENS_PER_STEP


def test_an_idle_interval_teaches_nothing() -> None:
    costs = EngineCosts()
    idle = dataclasses.replace(BASE, running=0)
    later = dataclasses.replace(idle, taken_at=10.0, inter_token_latency_count=50, prefill_count=2)
    costs.update(idle, later)
    assert costs.figures().decode_step_seconds is None and costs.line() is None
    assert costs.prefill_seconds_per_token() is None


def test_a_costly_prefill_makes_the_same_tokens_cost_more_steps() -> None:
    """A model whose prefill dominates (a large model, compute bound) against one whose decode
    step does: the same 8,000 tokens cost about 80 steps on the first, under 1 on the second."""
    heavy, light = EngineCosts(), EngineCosts()
    loads = [(8, 2), (8, 1)] * 10
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
