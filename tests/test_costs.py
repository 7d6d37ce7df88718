"""The engine's learned costs (``sidecar.admission.costs``): the decode line (the inter-token
latency against the batch), the prefill's cost per prompt token computed (finished requests'
prefill time less a decode step), the recompute in decode steps, the batch's fixed share, and
the quantile a recompute's cost asks for."""

from __future__ import annotations

import dataclasses

import pytest

from sidecar.admission.costs import (
    PRIOR_FIXED_SHARE,
    PRIOR_PREFILL_TOKENS_PER_STEP,
    EngineCosts,
    _Plane,
    reserve_quantile,
)
from sidecar.admission.ends import COLD_OUTPUT_TOKENS, Ends
from sidecar.admission.engine_view import EngineView
from sidecar.admission.learner import LengthLearner, request_class
from sidecar.config import ReservationMode
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import project_counts

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


def interval(
    prev: EngineSnapshot, *, running: int, step: float, steps: int, **added: float
) -> EngineSnapshot:
    """The next scrape, 0.5 s after ``prev``: ``steps`` steps of ``step`` s each with
    ``running`` sequences decoding (what vLLM's inter-token latency histogram adds), and
    ``added`` to ``prev``'s other counters."""
    return dataclasses.replace(
        prev,
        taken_at=prev.taken_at + 0.5,
        running=running,
        inter_token_latency_sum=prev.inter_token_latency_sum + steps * running * step,
        inter_token_latency_count=prev.inter_token_latency_count + steps * running,
        **{name: getattr(prev, name) + value for name, value in added.items()},
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


@pytest.mark.parametrize(
    ("per_token", "cached", "net", "whole"),
    [
        (2e-5, 0.0, 2e-5, (0.010 + 2e-5 * 256) / 256),
        (2e-5, 0.5, 2e-5, (0.010 + 2e-5 * 128) / 256),  # per prompt token, hits included
        # each prefill took no longer than a decode step: the net cost reads nothing, which is
        # not a measurement (None); a prompt still held its engine for a step (what
        # --priority-pace counts)
        (0.0, 0.0, None, 0.010 / 256),
    ],
)
def test_a_prompts_whole_prefill_keeps_its_step(
    per_token: float, cached: float, net: float | None, whole: float
) -> None:
    costs = EngineCosts()
    assert costs.prompt_seconds_per_token() is None  # nothing measured
    learn(Engine(base=0.010, per_token=per_token), costs, [(8, 2)] * 10, cached=cached)
    if net is None:
        assert costs.prefill_seconds_per_token() is None
    else:
        assert costs.prefill_seconds_per_token() == pytest.approx(net, rel=0.05)
    assert costs.prompt_seconds_per_token() == pytest.approx(whole, rel=0.05)


def test_a_host_that_slows_both_alike_leaves_the_recompute_in_steps_unchanged() -> None:
    """A busy host that makes the engine's steps three times slower makes its prefills three
    times slower too: the recompute in decode steps, the ratio, stays (a fit of the step time
    against tokens per step read such a host as a costly prefill)."""
    quiet, busy = EngineCosts(), EngineCosts()
    learn(Engine(base=0.010, per_token=2e-5), quiet, [(8, 2)] * 10)
    learn(Engine(base=0.030, per_token=6e-5), busy, [(8, 2)] * 10)
    assert busy.recompute_steps(500) == pytest.approx(quiet.recompute_steps(500), rel=1e-6)


def test_a_batch_that_never_varied_gives_no_line() -> None:
    """No line, so no measured fixed share: the batch gain is the prior share's, over the
    recent batch or the batch the request would join, whichever is larger."""
    costs = EngineCosts()
    learn(Engine(base=0.010, per_token=2e-5, per_sequence=1e-4), costs, [(8, 1)] * 20)
    assert costs.line() is None and costs.fixed_share() is None
    assert costs.gain_steps(100) == pytest.approx(100 * PRIOR_FIXED_SHARE / 8)
    assert costs.gain_steps(100, 20) == pytest.approx(100 * PRIOR_FIXED_SHARE / 20)
    assert costs.gain_steps(100, 4) == costs.gain_steps(100)
    assert costs.figures().gain_steps_per_token == pytest.approx(PRIOR_FIXED_SHARE / 8)
    assert costs.figures().fixed_share is None  # the exporter shows only a measured share
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


@pytest.mark.parametrize("together", [True, False])
def test_prefills_that_shared_a_step_count_it_once(together: bool) -> None:
    """12 streamed requests of 256 prompt tokens on an engine whose decode step takes 10 ms and
    whose prefill adds 20 us a token. Prefilled ``together`` (a burst: one step of 10 ms +
    12 x 256 x 20 us, whose first tokens the sidecar saw at one instant), vLLM reports that whole
    step for each of the 12 when they finish; one at a time (first tokens a step apart and
    more), each reports its own. Either way the cost learned is 20 us a token: the shared step
    counted once (``Ledger.prefill_share``), where summing the 12 reports read it 12 times over
    (the bias BENCHMARKS.md measured on ``vllm bench serve``'s burst)."""
    now = [0.0]
    ledger = Ledger(UniformBlocks(16), clock=lambda: now[0])
    view = EngineView(ledger)
    engine = Engine(base=0.010, per_token=2e-5)
    view.update(engine.snap)
    for _ in range(5):  # the decode step is learned first: 10 ms
        now[0] += 0.5
        view.update(engine.run(batch=12))
    assert view.costs.decode_step_seconds == pytest.approx(0.010)
    ask = project_counts((256,), requested_max_tokens=64, n=1, max_model_len=1024,
                         blocks=UniformBlocks(16))  # fmt: skip
    held = [ledger.reserve(ask, streamed=True) for _ in range(12)]
    for k, res in enumerate(held):
        now[0] = 10.0 + (0.0 if together else 0.05 * k)
        ledger.start(res)
    now[0] = 11.0
    for res in held:
        ledger.release(res)
    step = 0.010
    each = step + 2e-5 * (12 * 256 if together else 256)  # what vLLM reports for each request
    s = engine.snap
    snap = dataclasses.replace(
        engine.run(batch=12),
        prefill_seconds_sum=s.prefill_seconds_sum + 12 * each,
        prefill_count=s.prefill_count + 12,
        prompt_tokens_sum=s.prompt_tokens_sum + 12 * 256,
        prompt_tokens_total=s.prompt_tokens_total + 12 * 256,
    )
    now[0] = 11.5
    view.update(snap)
    assert view.costs.prefill_seconds_per_token() == pytest.approx(2e-5, rel=0.01)
    # without the share, the burst's step is counted once per request
    alone = EngineCosts()
    alone.update(s, snap)
    unshared = alone.prefill_seconds_per_token()
    assert unshared == pytest.approx(2e-5 * (12 if together else 1), rel=0.01)


class StepEngine:
    """An engine run step by step, as vLLM reports it: a step takes ``base + per_sequence x``
    its decoding sequences ``+ per_token x`` the prompt tokens it computes; each decoding
    sequence waits the whole step (its inter-token latency), each step is one observation of
    ``vllm:iteration_tokens_total``, and a prompt's tokens are counted at its first token while
    its prefill time (its step) is reported when the request finishes: a prompt under 1,000
    tokens (a chat) in the next interval, beside other prompts by then, and a longer one (a batch
    job's) 40 intervals later."""

    def __init__(self, base: float, per_sequence: float, per_token: float) -> None:
        self.base, self.per_sequence, self.per_token = base, per_sequence, per_token
        self.snap = dataclasses.replace(BASE, steps_total=0.0)
        self.interval = 0
        self.finishing: list[tuple[int, float, int]] = []  # (interval, prefill s, prompt)

    def run(self, *, decoders: int, prompts: tuple[int, ...], stall: float = 0.0) -> EngineSnapshot:
        """One interval; ``stall``: seconds a prompt token of it slows the host by, spread over
        the interval's steps (a host that takes the prompts in while the engine steps, which
        their prefill does not cost)."""
        queue = list(prompts)  # one prompt a step, in the interval's first steps
        taken: list[tuple[int, float]] = []  # (prompt tokens, seconds) a step
        unslowed = 0.0
        while unslowed < 0.5 or queue:
            prompt = queue.pop(0) if queue else 0
            seconds = self.base + self.per_sequence * decoders + self.per_token * prompt
            taken.append((prompt, seconds))
            unslowed += seconds
        slowed = stall * sum(prompts) / len(taken)
        elapsed, steps, waited, tokens = 0.0, 0, 0.0, 0
        for prompt, seconds in taken:
            step = seconds + slowed
            elapsed, steps = elapsed + step, steps + 1
            waited, tokens = waited + step * decoders, tokens + decoders
            if prompt:
                later = 1 if prompt < 1000 else 40
                self.finishing.append((self.interval + later, step, prompt))
        done = [f for f in self.finishing if f[0] <= self.interval]
        self.finishing = [f for f in self.finishing if f[0] > self.interval]
        self.interval += 1
        s = self.snap
        assert s.steps_total is not None
        self.snap = dataclasses.replace(
            s,
            taken_at=s.taken_at + elapsed,
            running=decoders,
            inter_token_latency_sum=s.inter_token_latency_sum + waited,
            inter_token_latency_count=s.inter_token_latency_count + tokens,
            steps_total=s.steps_total + steps,
            prefill_seconds_sum=s.prefill_seconds_sum + sum(f[1] for f in done),
            prefill_count=s.prefill_count + len(done),
            prompt_tokens_sum=s.prompt_tokens_sum + sum(f[2] for f in done),
            prompt_tokens_total=s.prompt_tokens_total + sum(prompts),
        )
        return self.snap


#: chats of 300 prompt tokens beside a batch's prompts of 2,000, the batch decoding 40-60
MIXED = [(40, (300, 300)), (60, (2000,) * 4), (50, (300,)), (45, (2000, 2000, 300)), (55, ())]


def test_a_prompt_tokens_cost_is_read_off_the_steps_beside_other_prompts() -> None:
    """On the mixed workload the finished requests' prefills, each less the interval's mean
    step, read a prompt token's cost far too low: only chats finish, and their light steps are
    reported while the batch's prompts lengthen the mean (the simulated 8B's priority workload,
    where that read 0: BENCHMARKS.md, The pace held to the interactive class's first tokens).
    The mean step against the prompt tokens computed a step, the decoding held, reads the
    engine as it runs: 50 us."""
    engine = StepEngine(base=0.010, per_sequence=6e-5, per_token=5e-5)
    costs, blind = EngineCosts(), EngineCosts()  # blind: vLLM without its steps counted
    prev = engine.snap
    for decoders, prompts in MIXED * 8:
        snap = engine.run(decoders=decoders, prompts=prompts)
        costs.update(prev, snap)
        blind.update(
            dataclasses.replace(prev, steps_total=None), dataclasses.replace(snap, steps_total=None)
        )
        prev = snap
    assert costs.prefill_seconds_per_token() == pytest.approx(5e-5, rel=0.02)
    # the decode line with the prefills taken out: 10 ms and 60 us a sequence
    line = costs.line()
    assert line is not None
    assert line[0] == pytest.approx(0.010, rel=0.02) and line[1] == pytest.approx(6e-5, rel=0.02)
    old = blind.prefill_seconds_per_token()
    assert old is not None and old < 0.5 * 5e-5
    # a plain decode step at the last interval's 55 sequences, where the mean step of the
    # intervals (the prefills' steps in it) reads 23 ms
    plain = 0.010 + 6e-5 * 55
    assert costs.plain_step_seconds() == pytest.approx(plain, rel=0.01)
    assert blind.plain_step_seconds() == blind.decode_step_seconds
    assert blind.decode_step_seconds is not None and blind.decode_step_seconds > 1.5 * plain
    # a recompute of 2,500 tokens: 0.125 s, 9.4 plain steps; read as 2.2 without the steps
    assert costs.recompute_steps(2500) == pytest.approx(2500 * 5e-5 / plain, rel=0.02)
    assert blind.recompute_steps(2500) < 0.5 * costs.recompute_steps(2500)


def test_a_slope_above_what_the_prefills_took_is_bounded_by_them() -> None:
    """The mixed workload on a host that each prompt token slows by 150 us, spread over the
    steps of the interval it arrives in (on two cores, vLLM's API server and the sidecar take
    the prompts in while the engine steps): the steps' fit charges the slowdown to the prompt
    tokens, where the steps the prompts were prefilled in, as the finished requests report
    them, took less per token than that. A prompt token costs at most that: the fit's slope is
    bounded by it."""
    engine = StepEngine(base=0.010, per_sequence=6e-5, per_token=5e-5)
    costs = EngineCosts()
    prev = engine.snap
    for decoders, prompts in MIXED * 8:
        snap = engine.run(decoders=decoders, prompts=prompts, stall=1.5e-4)
        costs.update(prev, snap)
        prev = snap
    slope = costs._steps.z_slope()
    bound = costs.prefill_bound()
    assert slope is not None and bound is not None
    # the premise: the fit reads the slowdown as the prompts' cost, 150 us a token on top of 50
    assert slope == pytest.approx(2e-4, rel=0.02)
    assert costs.prefill_seconds_per_token() == bound
    # what the prefills' steps took a token: above the cost (their steps were slowed too, and
    # decoded the batch), well below the slope
    assert 5e-5 < bound < 0.7 * slope


@pytest.mark.parametrize(
    ("loads", "why"),
    [
        ([(50, (300,))] * 20, "every step's prompt tokens the same"),
        ([(40, (2000,)), (60, (2000,) * 3)] * 10, "the batch and the prompts moved together"),
    ],
)
def test_prompts_that_never_varied_apart_fall_back_to_the_finished_prefills(
    loads: list[tuple[int, tuple[int, ...]]], why: str
) -> None:
    engine = StepEngine(base=0.010, per_sequence=6e-5, per_token=5e-5)
    costs, blind = EngineCosts(), EngineCosts()
    prev = engine.snap
    for decoders, prompts in loads:
        snap = engine.run(decoders=decoders, prompts=prompts)
        costs.update(prev, snap)
        blind.update(
            dataclasses.replace(prev, steps_total=None), dataclasses.replace(snap, steps_total=None)
        )
        prev = snap
    assert costs._steps.z_slope() is None, why
    assert costs.prefill_seconds_per_token() == blind.prefill_seconds_per_token()


def test_prefills_no_longer_than_the_mean_step_measure_no_prompt_cost() -> None:
    """A burst's prompts prefilled in full chunks make every step 0.2 s; the requests that
    finish report prefills of one such step each, no longer than the interval's mean step, and
    less a decode step each read nothing. That is not a free prompt token (the simulated 8B's
    thrash burst read it so 3 s in, and let 21 requests in as vLLM admits them): the cost is
    not measured, and a recompute is priced by the prior."""
    costs = EngineCosts()
    prev = BASE
    for _ in range(4):
        step, finished = 0.2, 3
        snap = interval(
            prev,
            running=28,
            step=step,
            steps=2,
            prefill_seconds_sum=finished * step,
            prefill_count=finished,
            prompt_tokens_sum=finished * 3000,
            prompt_tokens_total=finished * 3000,
        )
        costs.update(prev, snap)
        prev = snap
    assert costs.prefill_seconds_per_token() is None
    assert costs.recompute_steps(4096) == 4096 / PRIOR_PREFILL_TOKENS_PER_STEP


def test_a_burst_prefilled_in_full_chunks_teaches_no_slope() -> None:
    """A burst of long prompts prefilled in chunks of the step's whole token budget (8,192):
    every step takes the same 10 ms + 8,192 x 25 us, while the prompt tokens vLLM counts (at
    each request's first token) vary from interval to interval, two steps each (as on the
    simulated 8B's thrash burst, where the slope read under 0.4 us a token through them). The
    flat mean step says nothing of a prompt token's cost, and nothing is read from it (the
    slope through such intervals is 0); once the decoding steps after it vary, it is read."""
    costs = EngineCosts()
    prev = dataclasses.replace(BASE, steps_total=0.0)
    step = 0.010 + 8192 * 2.5e-5
    # prompt tokens completed by interval: prompts of 2,000-4,000 tokens, 2-4 ending a step
    burst = [15_000, 17_500, 16_400, 18_000, 14_800, 16_700]
    for k, prompts in enumerate(burst):
        snap = interval(
            prev, running=8 + 4 * k, step=step, steps=2, steps_total=2, prompt_tokens_total=prompts
        )
        costs.update(prev, snap)
        prev = snap
    assert costs._steps.solve() is None
    assert costs.prefill_seconds_per_token() is None
    assert costs.recompute_steps(4096) == 4096 / PRIOR_PREFILL_TOKENS_PER_STEP
    # then steps of 30 sequences decoding, with 0-2 prompts of 3,000 tokens each, one a step:
    # the slope is read
    engine = StepEngine(base=0.010, per_sequence=0.0, per_token=2.5e-5)
    prev = engine.snap
    for prompts in [(), (3000,), (3000, 3000), ()] * 3:
        snap = engine.run(decoders=30, prompts=prompts)
        costs.update(prev, snap)
        prev = snap
    assert costs.prefill_seconds_per_token() == pytest.approx(2.5e-5, rel=0.05)


def test_a_burst_prefilled_in_full_chunks_teaches_no_decode_line() -> None:
    """The same burst, each step a little longer with each sequence in it (10 us): the
    inter-token latency against the batch (4 to 28 sequences) reads a line whose base is almost
    the whole step, a fixed share of 0.99 (the simulated 8B's thrash burst read that 2.2 s in,
    twice its roofline's share, and let a request in at its floor). Where vLLM counts its
    steps that line learns only from intervals that computed no prompt token, so here nothing:
    the steps' fit, with the prefills taken out, says nothing yet, and neither does the share.
    A vLLM that does not count them still has only that line."""
    costs, blind = EngineCosts(), EngineCosts()
    prev = dataclasses.replace(BASE, steps_total=0.0)
    burst = [15_000, 17_500, 16_400, 18_000, 14_800, 16_700, 15_900]
    for k, prompts in enumerate(burst):
        running = 4 + 4 * k
        step = 0.010 + 8192 * 2.5e-5 + 1e-5 * running
        snap = interval(
            prev, running=running, step=step, steps=2, steps_total=2, prompt_tokens_total=prompts
        )
        costs.update(prev, snap)
        blind.update(
            dataclasses.replace(prev, steps_total=None), dataclasses.replace(snap, steps_total=None)
        )
        prev = snap
    assert costs.line() is None
    assert costs.fixed_share() is None
    share = blind.fixed_share()
    assert share is not None and share > 0.95


def test_decode_steps_alone_teach_the_line_where_vllm_counts_its_steps() -> None:
    """Intervals that computed no prompt token are decode steps alone: with vLLM's steps
    counted, the inter-token latency against the running batch (5 down to 1 sequences, a step
    of 10 ms + 1 ms a sequence) still gives the line there, where the steps' fit has no prompt
    tokens that varied to solve with (the warm-up of ``tests/test_tpot_target_sim.py``)."""
    costs = EngineCosts()
    prev = dataclasses.replace(BASE, steps_total=0.0)
    for running in (5, 4, 3, 2, 1) * 3:
        step = 0.010 + 0.001 * running
        steps = round(0.5 / step)
        snap = interval(prev, running=running, step=step, steps=steps, steps_total=steps)
        costs.update(prev, snap)
        prev = snap
    line = costs.line()
    assert line is not None
    # each interval's batch is the mean of its two scrapes' running counts: half a sequence
    # off the steps' own where it changed, so the fit leans (10.2 ms + 0.88 ms here)
    assert line[0] == pytest.approx(0.010, rel=0.05) and line[1] == pytest.approx(0.001, rel=0.15)


def test_a_step_that_reads_faster_with_more_sequences_is_fitted_without_them() -> None:
    """Where the fit would make a step shorter with every sequence more (the batch small while
    a burst's prompts were prefilled, large after), the sequences are left out: a step never
    gets faster with more of them, and the prompt tokens' slope is fitted alone."""
    plane = _Plane()
    points = [(x, z, 0.012 + 2.5e-5 * z - 1e-4 * x) for x, z in
              [(10, 8000), (12, 6000), (30, 0), (28, 150), (20, 3000), (26, 60)] * 4]  # fmt: skip
    for x, z, y in points:
        plane.learn(x, z, y)
    solved = plane.solve()
    assert solved is not None and solved[1] == 0.0
    alone = _Plane()
    for _, z, y in points:
        alone.learn(0.0, z, y)
    assert solved == alone.solve()


def test_a_measured_line_is_kept_while_the_batch_holds_still() -> None:
    """A window in which the batch held still says nothing of the line's slope: the line the
    fit gave while the batch varied is kept (a sidecar that holds a burst at what fits sees the
    batch vary only while the burst's prompts are prefilled, and the fit forgets that within
    some 20 intervals)."""
    engine = StepEngine(base=0.010, per_sequence=6e-5, per_token=5e-5)
    costs = EngineCosts()
    prev = engine.snap
    for decoders, prompts in MIXED * 8:
        snap = engine.run(decoders=decoders, prompts=prompts)
        costs.update(prev, snap)
        prev = snap
    learned = costs.line()
    assert learned is not None
    for _ in range(200):  # 45 sequences decoding, nothing else, for 100 s
        snap = engine.run(decoders=45, prompts=())
        costs.update(prev, snap)
        prev = snap
    assert costs._steps.solve() is None or costs._steps.solve()[1] == 0.0  # the fit forgot
    assert costs.line() == learned
    share = costs.fixed_share()
    assert share == pytest.approx(0.010 / (0.010 + 6e-5 * 45), rel=0.03)


#: the simulated Llama-3.1-70B (harness/models): its weights and a 16-token block of its KV,
#: the whole model's bytes, and a pool of 10,303 blocks
WEIGHTS_70B, BLOCK_70B, POOL_70B = 141_107_412_992, 5_242_880, 10_303


def taught_prompts_alone(costs: EngineCosts) -> None:
    """Intervals whose prompt tokens varied while 30 sequences decoded throughout: a prompt
    token's cost is measured (50 us), the decode line is not."""
    engine = StepEngine(base=0.010, per_sequence=6e-5, per_token=5e-5)
    prev = engine.snap
    for decoders, prompts in [(30, (2000,)), (30, ()), (30, (2000, 2000)), (30, ())] * 8:
        snap = engine.run(decoders=decoders, prompts=prompts)
        costs.update(prev, snap)
        prev = snap
    assert costs.prefill_seconds_per_token() == pytest.approx(5e-5, rel=0.02)
    assert costs.line() is None


def test_the_roofline_stands_in_for_the_fixed_share_until_the_line_is_measured() -> None:
    """A step bound by memory reads the weights once and every sequence's KV: at a full pool
    the fixed share is the weights over the weights and the pool's KV (0.72 for the 70B's pool
    here), the memory's speed cancelled. It is weighed once a prompt token's cost is measured
    (against the prior's recompute it admitted a cold burst of long prompts at their floor);
    without the weights the share stays unknown, and a measured line replaces it."""
    costs = EngineCosts()
    costs.roofline(WEIGHTS_70B, BLOCK_70B)
    costs.pool_blocks = POOL_70B
    assert costs.fixed_share() is None  # no prompt token's cost measured yet
    taught_prompts_alone(costs)
    share = costs.fixed_share()
    assert share == pytest.approx(WEIGHTS_70B / (WEIGHTS_70B + POOL_70B * BLOCK_70B))
    assert share == pytest.approx(0.723, abs=0.001)
    assert costs.gain_steps(2000, 30) == pytest.approx(2000 * share / 30)
    unknown = EngineCosts()
    unknown.roofline(None, BLOCK_70B)
    unknown.pool_blocks = POOL_70B
    taught_prompts_alone(unknown)
    assert unknown.fixed_share() is None
    # measured: the line's share, not the roofline's
    engine = StepEngine(base=0.010, per_sequence=6e-5, per_token=5e-5)
    prev = engine.snap
    for decoders, prompts in MIXED * 8:
        snap = engine.run(decoders=decoders, prompts=prompts)
        costs.update(prev, snap)
        prev = snap
    assert costs.fixed_share() == pytest.approx(0.010 / (0.010 + 6e-5 * 55), rel=0.03)


def test_a_weight_bound_model_risks_a_dear_recompute_by_its_roofline() -> None:
    """A 3,000-token prompt whose class answers 1,500-2,500 tokens: its recompute is dear (21
    plain decode steps at 50 us a prompt token, 30 sequences decoding). With the decode line
    unmeasured and no weights known it is weighed against no gain and reserved, beside 29
    others, to the pool's quantile of its class's answers (over 2,000 tokens). With the
    roofline of a 70B-shaped model (a fixed share of 0.72 at a full pool), running its likely
    2,000 tokens in the batch saves more than even a certain recompute costs: it is reserved
    from the floor, as vLLM risks it."""
    klass = request_class("completions", 4096)
    learner = LengthLearner()
    for i in range(64):
        learner.observe(klass, 1500 + (i * 16) % 1000, at_max=False)
    rule = Ends(ReservationMode.adaptive, learner, risk_steps=1.0)
    blind = EngineCosts()
    taught_prompts_alone(blind)
    assert blind.recompute_steps(5000) > 20
    assert rule.end(klass, 3000, 4096, blind, 30) > 2000
    costs = EngineCosts()
    costs.roofline(WEIGHTS_70B, BLOCK_70B)
    costs.pool_blocks = POOL_70B
    taught_prompts_alone(costs)
    assert costs.gain_steps(2000, 30) > costs.recompute_steps(5000)
    assert rule.end(klass, 3000, 4096, costs, 30) == COLD_OUTPUT_TOKENS
