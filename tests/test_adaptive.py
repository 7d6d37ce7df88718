"""Adaptive reservations (``--reservation adaptive``): lengths from the first second (a cold
floor that grows, vLLM's own history, the learned classes), a quantile chosen by what a
recompute costs on this engine, and the decode-step target."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable

import pytest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.decisions import Reason
from sidecar.admission.ends import COLD_OUTPUT_TOKENS
from sidecar.admission.learner import pooled_length, request_class
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import Projection, project_counts
from tests.support.snapshots import Clock, teach_costs

BLOCKS = UniformBlocks(128)
MAX_MODEL_LEN = 2048


def snapshot(clock: Clock, **kw: object) -> EngineSnapshot:
    fields: dict[str, object] = dict(
        taken_at=clock(),
        block_size=128,
        num_gpu_blocks=65,  # 64 usable
        engines=1,
        kv_cache_usage=0.0,
        running=0,
        preemptions_total=0,
        generation_tokens_total=0,
        cache_dtype="auto",
        prefix_caching=True,
        kv_cache_memory_bytes=None,
        has_cache_config=True,
    )
    fields.update(kw)
    return EngineSnapshot(**fields)  # type: ignore[arg-type]


def chat(prompt: int, max_tokens: int | None = None) -> Projection:
    """A chat request; without max_tokens it may run to the end of the context, as in vLLM."""
    return project_counts(
        (prompt,), requested_max_tokens=max_tokens, n=1, max_model_len=MAX_MODEL_LEN, blocks=BLOCKS
    )


def controller(clock: Clock, **kw: object) -> AdmissionController:
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock),
        clock=clock,
        headroom=0.0,
        reservation="adaptive",  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    ac.on_snapshot(snapshot(clock))
    return ac


def admitted(ac: AdmissionController, projection: Projection, klass: str = "chat:none") -> int:
    count = 0
    while (d := ac.try_admit(Ask(projection, streamed=True, klass=klass))) is not None:
        assert d.admitted, d
        count += 1
    return count


def dear(clock: Clock, **kw: object) -> AdmissionController:
    """A controller that has learned an engine where a 300-token chat's recompute is dear
    (a GPU-like 26 ms decode step of 64 sequences, 0.25 ms a prompt token: 3-4 steps), so its
    end is the length quantile that recompute asks for (0.75 here), not the floor a cheap one
    is risked at (``test_a_cheap_recompute_is_risked_as_vllm_risks_it``)."""
    ac = controller(clock, **kw)
    _costly(ac, clock, per_token=2.5e-4, running=64)
    return ac


def test_a_cold_chat_without_max_tokens_is_not_reserved_to_the_end_of_the_context() -> None:
    """300-token chats without max_tokens on 64 blocks of 128: worst-case reserves each to 2,048
    tokens (16 blocks: 4 run); a cold adaptive sidecar, whose recompute of 556 tokens costs half
    a decode step by the prior, admits them as vLLM does, by their prompts (3 blocks: 21 run),
    its 256 output tokens telling only where they likely end."""
    clock = Clock()
    worst = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.0)
    worst.on_snapshot(snapshot(clock))
    assert admitted(worst, chat(300)) == 4
    ac = controller(clock)
    assert ac.ends(chat(300), "chat:none") == (COLD_OUTPUT_TOKENS,)
    assert admitted(ac, chat(300)) == 21


def test_an_answer_past_its_cold_floor_is_expected_to_double() -> None:
    clock = Clock()
    ac = controller(clock)
    d = ac.try_admit(Ask(chat(300), streamed=True, klass="chat:none"))
    assert d is not None and d.reservation is not None
    res = d.reservation
    ac.started(res)
    ac.progressed(res, 400)  # past 256: to twice what it has
    assert res.end(0) == 800


def test_a_sidecar_beside_a_vllm_that_has_answered_starts_from_its_histogram() -> None:
    """vLLM's vllm:request_generation_tokens at the first scrape: 100 answers of 50-100 tokens
    and 10 of 100-200. The class takes the 0.75-quantile bound of that history (each bucket's
    answers spread evenly over its range: the 87th of 110 lengths, 94), not the cold floor."""
    clock = Clock()
    ac = dear(clock)
    history = ((20.0, 0.0), (50.0, 0.0), (100.0, 100.0), (200.0, 110.0), (float("inf"), 110.0))
    ac.on_snapshot(snapshot(clock, generation_lengths=history))
    assert ac.learner.seeded == 110
    assert ac.ends(chat(300), "chat:none") == (94,)
    # its own answers take over once it has enough of them
    for _ in range(40):
        ac.learner.observe("chat:none", 180)
    assert ac.ends(chat(300), "chat:none") == (180,)


def test_the_histograms_sum_narrows_its_buckets() -> None:
    """The same history with its _sum: 7,100 tokens (answers of about 60 and 110, where the
    buckets spread evenly would sum to about 9,100). The answers are spread over the share of
    each bucket from its lower bound that sums to that, and the class reserves less than the
    even spread's 94, yet at least the answers' own 0.75-quantile (60)."""
    clock = Clock()
    ac = dear(clock)
    history = ((20.0, 0.0), (50.0, 0.0), (100.0, 100.0), (200.0, 110.0), (float("inf"), 110.0))
    ac.on_snapshot(snapshot(clock, generation_lengths=history, generation_lengths_sum=7100.0))
    assert ac.learner.seeded == 110
    (end,) = ac.ends(chat(300), "chat:none")
    assert 60 <= end < 94
    assert end == 66  # 50 + 1,100 / 3,075 of each answer's even place in (50, 100]


def test_history_with_answers_past_the_last_bucket_reserves_to_max_tokens() -> None:
    clock = Clock()
    ac = dear(clock)
    ac.on_snapshot(snapshot(clock, generation_lengths=((1000.0, 2.0), (float("inf"), 20.0))))
    assert ac.ends(chat(300), "chat:none") == (MAX_MODEL_LEN - 300,)


def _costly(ac: AdmissionController, clock: Clock, *, per_token: float, running: int = 8) -> None:
    """``teach_costs`` on this module's engine (``snapshot``)."""
    teach_costs(ac, clock, snapshot(clock), per_token=per_token, running=running)


def test_long_prompts_are_held_back_where_a_recompute_is_costly_and_short_ones_are_not() -> None:
    """On an engine whose step takes 10 ms + 0.3 ms per token, with 64 sequences decoding (a
    29.2 ms step, 34% of it fixed): a recompute of a 1,500-token prompt and its cold 256 costs
    ~18 steps, where running one more sequence for 256 tokens saves ~1.4 (256 x 0.34 / 64), so
    a cold sidecar reserves it to max_tokens; a 100-token prompt's recompute costs ~3.7 steps
    and is risked at the floor. Where a prefill costs little (0.1 us a token), the long one is
    risked too."""
    clock = Clock()
    ac = controller(clock)
    _costly(ac, clock, per_token=3e-4, running=64)
    tokens_per_step = ac.state().prefill_tokens_per_step
    assert tokens_per_step is not None and tokens_per_step < 200
    assert ac.ends(chat(1500), "chat:none") == (MAX_MODEL_LEN - 1500,)
    assert ac.ends(chat(100), "chat:none") == (COLD_OUTPUT_TOKENS,)
    cheap = controller(clock)
    _costly(cheap, clock, per_token=1e-7, running=64)
    assert cheap.ends(chat(1500), "chat:none") == (COLD_OUTPUT_TOKENS,)


def test_a_small_batch_pays_for_the_recompute_a_larger_one_would_not() -> None:
    """The same engine with 8 sequences decoding (a 12.4 ms step, 81% of it fixed): one more
    sequence for 256 tokens saves ~26 steps (256 x 0.81 / 8), more than the 1,500-token
    prompt's recompute risks at the median (~42 steps, half the time), so it is risked at the
    floor where 64 decoding held it back. With answers of its own (40 of 100-300 tokens) it is
    reserved to their median, below the 0.75-quantile the engine's recompute alone allows."""
    clock = Clock()
    ac = controller(clock)
    _costly(ac, clock, per_token=3e-4, running=8)
    costs = ac.pools[0].view.costs
    assert costs.gain_steps(256) > 20
    assert ac.ends(chat(1500), "chat:none") == (COLD_OUTPUT_TOKENS,)
    for length in range(100, 300, 5):
        ac.learner.observe("chat:none", length)
    (median,) = ac.ends(chat(100), "chat:none")
    busy = controller(clock)
    _costly(busy, clock, per_token=3e-4, running=64)
    for length in range(100, 300, 5):
        busy.learner.observe("chat:none", length)
    (upper,) = busy.ends(chat(100), "chat:none")
    assert median < upper, (median, upper)


def test_an_ignore_eos_request_is_risked_only_where_even_a_certain_recompute_pays() -> None:
    """An ``ignore_eos`` request will reach its max_tokens (600 here, a 100-token prompt): with
    8 sequences decoding on a 10 ms + 0.3 ms-a-token step, one more saves ~60 steps (600 x 0.80
    / 8), more than its certain recompute (~17): it is risked at the floor, as vLLM risks it.
    With 64 decoding it saves ~3.2 of a ~7-step recompute: all 600 are reserved."""
    klass = request_class("chat", 600, ignore_eos=True)
    clock = Clock()
    small = controller(clock)
    _costly(small, clock, per_token=3e-4, running=8)
    assert small.ends(chat(100, 600), klass) == (COLD_OUTPUT_TOKENS,)
    busy = controller(clock)
    _costly(busy, clock, per_token=3e-4, running=64)
    assert busy.ends(chat(100, 600), klass) == (600,)


def test_where_a_certain_recompute_pays_a_long_answer_is_risked_at_the_floor() -> None:
    """Prompts of 600 tokens whose answers (300-500 tokens, 40 learned: 450 likely, 415 at the
    median) decode in a batch of 20 on a step of 10 ms + ``per_token`` per token. At 27 us a
    token (a GPU's prefill: a 10.5 ms step, 95% of it fixed) one more sequence saves ~21 steps
    (450 x 0.95 / 20) and its recompute, even a certain one, costs ~2.7: it is risked at the
    floor, as vLLM risks it. At 0.3 ms a token (a 16 ms step, 62% fixed) it saves ~14 and a
    recompute costs ~19.5: the median, which half the answers outrun."""
    ends = {per_token: _long_answer_end(per_token) for per_token in (2.7e-5, 3e-4)}
    assert ends == {2.7e-5: COLD_OUTPUT_TOKENS, 3e-4: 415}, ends


def _long_answer_end(per_token: float, *, preemptions: int = 0) -> int:
    """What a 600-token prompt of a class with 40 answers of 300-500 tokens reserves, in a batch
    of 20 on a step of 10 ms + ``per_token`` per token, after ``preemptions``."""
    clock = Clock()
    ac = controller(clock)
    _costly(ac, clock, per_token=per_token, running=20)
    for length in range(300, 500, 5):
        ac.learner.observe("completion:1000", length)
    for _ in range(preemptions):
        ac.learner.tighten()
    (end,) = ac.ends(completion(600, 1000), "completion:1000")
    return end


def test_a_request_risked_at_the_floor_is_not_widened_by_preemptions() -> None:
    """vLLM's preemptions widen the reservations that a quantile sets (the learner's boost), but
    not one risked at the floor: it was admitted knowing it may be preempted, and widening it
    would hold the batch back for a risk that running it pays for."""
    assert _long_answer_end(2.7e-5, preemptions=2) == COLD_OUTPUT_TOKENS
    assert _long_answer_end(3e-4, preemptions=2) > 415


def test_a_preemption_widens_adaptive_reservations() -> None:
    clock = Clock()
    ac = dear(clock)
    ac.on_snapshot(snapshot(clock, preemptions_total=1))
    ac.on_snapshot(snapshot(clock, preemptions_total=2))
    (end,) = ac.ends(chat(300), "chat:none")
    assert COLD_OUTPUT_TOKENS < end < MAX_MODEL_LEN - 300


def test_the_decode_step_target_holds_a_larger_batch_back() -> None:
    """--tpot-target 12.1 ms on an engine whose step takes 10 ms + 0.2 ms per sequence: 8
    running make 11.6 ms; a ninth sequence would make 11.8, a tenth 12.0, an eleventh 12.2 ms."""
    clock = Clock()
    ac = controller(clock, tpot_target=0.0121, policy="reject")
    _costly(ac, clock, per_token=2e-4)
    ac.on_snapshot(snapshot(clock, running=8))
    ok = [ac.try_admit(Ask(chat(100, 16), streamed=True)) for _ in range(2)]
    assert all(d is not None and d.admitted for d in ok)
    refused = ac.try_admit(Ask(chat(100, 16), streamed=True))
    assert refused is not None and refused.reason is Reason.LATENCY_TARGET
    assert refused.retry_after is not None
    # nothing running: the target holds nothing back
    empty = controller(clock, tpot_target=0.001, policy="reject")
    _costly(empty, clock, per_token=2e-4)
    d = empty.try_admit(Ask(chat(100, 16), streamed=True))
    assert d is not None and d.admitted


def test_the_decode_step_target_counts_requests_started_since_the_scrape() -> None:
    """The same engine and target, 8 running at the last scrape, all of them the sidecar's; the
    requests it admits start at once (their first tokens come) and no scrape follows: the
    sidecar's own count of started sequences holds the batch to 10, as the scrape would have."""
    clock = Clock()
    ac = controller(clock, tpot_target=0.0121, policy="reject")
    _costly(ac, clock, per_token=2e-4)
    running = []
    for _ in range(8):
        d = ac.try_admit(Ask(chat(100, 16), streamed=True))
        assert d is not None and d.reservation is not None
        ac.started(d.reservation)
        running.append(d.reservation)
    ac.on_snapshot(snapshot(clock, running=8))
    decisions = []
    for _ in range(5):
        d = ac.try_admit(Ask(chat(100, 16), streamed=True))
        assert d is not None
        decisions.append(d.reason)
        if d.reservation is not None:
            ac.started(d.reservation)
    assert decisions == [Reason.FITS, Reason.FITS] + [Reason.LATENCY_TARGET] * 3


def completion(prompt: int, max_tokens: int) -> Projection:
    return project_counts(
        (prompt,), requested_max_tokens=max_tokens, n=1, max_model_len=MAX_MODEL_LEN, blocks=BLOCKS
    )


def test_a_named_max_tokens_is_reserved_whole_where_answers_run_to_it() -> None:
    """vLLM's history: 100 answers of at most 100 tokens. Where most of vLLM's answers ended at
    their max_tokens (finished_reason "length": ignore_eos, or capped answers), a request of a
    class with no answers of its own that names max_tokens 800 is that likely to use it all, and
    is reserved 800; where most stopped on their own, it takes the history's 0.75-quantile bound
    (88). A chat that names no max_tokens takes the history's bound either way."""
    history = ((50.0, 20.0), (100.0, 100.0), (float("inf"), 100.0))
    for at_length, stopped, named in ((90.0, 10.0, 800), (10.0, 90.0, 88)):
        clock = Clock()
        ac = dear(clock)
        ac.on_snapshot(
            snapshot(
                clock,
                generation_lengths=history,
                answers_at_length=at_length,
                answers_stopped=stopped,
            )
        )
        assert ac.ends(completion(300, 800), "completions:1024") == (named,)
        assert ac.ends(chat(300), "chat:none") == (88,)
    # its own answers take over: six that stopped at 60 of 800
    for _ in range(6):
        d = ac.try_admit(Ask(completion(300, 800), streamed=True, klass="completions:1024"))
        assert d is not None and d.reservation is not None
        ac.release(d.reservation, 60)
    assert ac.ends(completion(300, 800), "completions:1024") == (60,)


def test_the_learned_batch_gain_is_exported() -> None:
    """The fixed share of the step (10 ms of ~12.6) and what one sequence more saves per token
    at a batch of 8 are in the state and on /metrics; absent before anything is measured."""
    from prometheus_client.core import Metric

    from sidecar.observability.exporter import cost_families

    def gauges(ac: AdmissionController) -> dict[str, float]:
        families: list[Metric] = cost_families(ac.state())
        return {f.name: f.samples[0].value for f in families}

    clock = Clock()
    ac = controller(clock)
    assert "kv_sidecar_engine_step_fixed_share" not in gauges(ac)
    _costly(ac, clock, per_token=3e-4, running=8)
    state = ac.state()
    assert state.step_fixed_share is not None and 0.75 < state.step_fixed_share < 0.85
    assert state.batch_gain_steps_per_token == state.step_fixed_share / 8
    exported = gauges(ac)
    assert exported["kv_sidecar_engine_step_fixed_share"] == state.step_fixed_share
    assert exported["kv_sidecar_engine_batch_gain_steps_per_token"] == (
        state.batch_gain_steps_per_token
    )


# --- pooled risk: the answers of many requests in flight outrun their reservations together
# far less often than one answer outruns its own ----------------------------------------------


LENGTHS: dict[str, Callable[[random.Random], float]] = {
    "uniform": lambda rng: rng.uniform(30, 220),
    "exponential": lambda rng: 30 + rng.expovariate(1 / 80),
    "log-normal": lambda rng: rng.lognormvariate(4.5, 0.8),
    # most answers short, a fifth long
    "two-mode": lambda rng: rng.uniform(20, 60) if rng.random() < 0.8 else rng.uniform(400, 600),
    # one in twenty very long: its own 0.9 quantile is short, n of them together are not
    "rare-long": lambda rng: rng.uniform(20, 60) if rng.random() < 0.95 else rng.uniform(900, 1e3),
}


#: (lengths, quantile, in flight, answers the moments come from) where the claim is made: not
#: the rare-long mix below 0.99; nor from 32 of its answers with 16 or more in flight (32
#: answers of it often hold no long one: 16 in flight outran it in 12% of the trials, 64 in
#: 18%, at 0.99, when measured; the moments cannot see what is not there)
POOLED_CASES = [
    (name, q, n, k)
    for name in LENGTHS
    for q in (0.9, 0.95, 0.99)
    for n in (2, 4, 16, 64)
    for k in (32, 20_000)
    if name != "rare-long" or (q > 0.95 and (k > 1000 or n < 16))
]


@pytest.mark.parametrize(("lengths", "quantile", "concurrency", "samples"), POOLED_CASES)
def test_pooled_reservations_outrun_together_about_as_often_as_one_alone(
    lengths: str, quantile: float, concurrency: int, samples: int
) -> None:
    """``concurrency`` answers drawn independently, each reserved to ``pooled_length`` of the
    moments of ``samples`` answers: their sum outruns the sum of their reservations in at most
    1.5 x ``1 - quantile`` plus a point of 4,000 trials with the moments of 20,000 answers (the
    Cornish-Fisher expansion is an approximation: a sum of a few answers of a two-mode mix is
    itself lumpy; on the rare-long mix it holds at 0.99 only: at 0.95, two answers outrun it in
    10% of trials, as two reserved at their own 0.95 quantile do), and 4 x plus a point with
    the moments of 32, each trial with moments of its own (their error does not shrink with
    the answers in flight); the cases are :data:`POOLED_CASES`. Dividing the deviation by ``n``
    rather than ``sqrt(n)``, or dropping the skew or the samples' term, fails it."""
    rng = random.Random(f"{lengths}-{quantile}-{concurrency}-{samples}")
    draw = LENGTHS[lengths]
    trials, allowance = (4000, 1.5) if samples > 1000 else (4000, 4.0)
    moments = None
    outran = 0
    for trial in range(trials):
        if moments is None or (samples < 1000 and trial % 20 == 0):  # 200 samples of 32
            seen = [draw(rng) for _ in range(samples)]
            mean, sd = statistics.fmean(seen), statistics.pstdev(seen)
            skew = statistics.fmean(((x - mean) / sd) ** 3 for x in seen)
            moments = pooled_length(mean, sd, skew, quantile, concurrency, samples)
        outran += sum(draw(rng) for _ in range(concurrency)) > moments * concurrency
    assert outran / trials <= allowance * (1 - quantile) + 0.01, (moments, outran)


def test_a_request_beside_many_in_flight_is_reserved_lower_than_one_alone() -> None:
    """Chats without max_tokens whose answers ran 30-220 tokens: the first, alone, is reserved
    near the top of that range; with fifteen in flight beside it, near the middle; the
    worst-case sum is never what is reserved."""
    clock = Clock()
    ac = dear(clock)
    for n in range(64):
        ac.learner.observe("chat:none", 30 + (190 * n) // 63)
    alone = ac.ends(chat(100), "chat:none")[0]
    crowded = ac.ends(chat(100), "chat:none", in_flight=15)[0]
    assert 30 < crowded < alone <= 220, (crowded, alone)
    assert ac.ends(chat(100), "chat:none", in_flight=15)[0] == crowded  # stable per load
    worst = ac.ends(chat(100, max_tokens=None))  # no class: the context's end would be worst
    assert worst[0] < MAX_MODEL_LEN - 100


def test_beside_others_a_costly_recompute_is_reserved_to_the_pools_tail_not_max_tokens() -> None:
    """The engine above with 64 sequences decoding: a 1,500-token prompt's recompute costs
    ~16.5 steps, too much to risk at ``--risk-steps 0.1`` even at 0.99 for one request alone
    (0.165 steps), so alone it is reserved to max_tokens even with 64 answers of 60-180 tokens
    learned; beside 15 others in flight, to the pool's tail at 1 - 0.1 / 16.5 of those answers,
    far below the context."""
    clock = Clock()
    ac = controller(clock, risk_steps=0.1)
    _costly(ac, clock, per_token=3e-4, running=64)
    for n in range(64):
        ac.learner.observe("chat:none", 60 + (120 * n) // 63)
    alone = ac.ends(chat(1500), "chat:none")[0]
    beside = ac.ends(chat(1500), "chat:none", in_flight=15)[0]
    assert alone == MAX_MODEL_LEN - 1500
    assert 120 < beside < 240, beside
    # a class that names its max_tokens, with none of its own, where every answer ran to it
    named = controller(clock, risk_steps=0.1)
    _costly(named, clock, per_token=3e-4, running=64)
    for _ in range(64):
        named.learner.observe("chat:none", 100, at_max=True)
    assert named.ends(chat(1500, max_tokens=400), "chat:400", in_flight=15) == (400,)


def test_a_cheap_recompute_is_risked_as_vllm_risks_it() -> None:
    """On an engine whose prefill costs 5 us a token beside a 10 ms step (the CPU engine's
    shape), a 300-token chat's recompute is a fraction of a step: chats are admitted as vLLM
    admits them, by their prompts (3 blocks: 21 in 64), with 40 answers of 150-250 tokens
    learned; with a prefill of 0.25 ms a token beside a 26 ms step (a GPU-like engine), the
    same chats cost 3-4 steps to recompute and are reserved to their length quantile, so
    fewer run at once."""
    clock = Clock()
    cheap = controller(clock)
    _costly(cheap, clock, per_token=5e-6, running=64)
    dearer = dear(clock)
    for ac in (cheap, dearer):
        for length in range(150, 250, 2):
            ac.learner.observe("chat:none", length)
    assert cheap.pools[0].view.costs.recompute_steps(500) < 1
    assert dearer.pools[0].view.costs.recompute_steps(500) > 2
    assert admitted(cheap, chat(300)) == 21
    # 4 blocks each at their pool's length quantile (vLLM would preempt some of 21)
    assert admitted(dearer, chat(300)) == 15


def test_the_exported_ends_per_class_stay_within_each_class_while_preemptions_widen_them() -> None:
    """``kv_sidecar_expected_output_tokens`` per class: after vLLM's preemptions widen the
    reservations (the boost), a class bucketed by max_tokens is still at most its bucket, and a
    class without max_tokens (whose widened end is a share of each request's rest of the
    context) is left out rather than exported as a share of an unbounded length."""
    clock = Clock()
    ac = dear(clock)
    for n in (20, 40, 60, 12, 16):
        for _ in range(40):
            ac.learner.observe("completions:16", min(n, 16))
            ac.learner.observe("chat:none", n * 3)
    ac.on_snapshot(snapshot(clock))
    calm = ac.reserving.per_class(ac.pools[0].view.costs)
    assert set(calm) == {"completions:16", "chat:none"}, calm
    assert 0 < calm["completions:16"] <= 16 and 0 < calm["chat:none"] <= 180, calm
    ac.learner.tighten()
    assert ac.learner.boost > 0
    widened = ac.reserving.per_class(ac.pools[0].view.costs)
    assert set(widened) == {"completions:16"}, widened
    assert calm["completions:16"] <= widened["completions:16"] <= 16, widened


def test_only_a_cheap_recompute_is_admitted_by_its_prompt() -> None:
    """Where the batch gain pays for even a certain recompute but the recompute itself costs
    more than two decode steps (600-token prompts with 300-500-token answers, a batch of 20 on
    a step of 10 ms + 27 us a token: about 2.7 steps), a request is reserved from the floor and
    laid out by the future peak, not admitted by its prompt as vLLM admits: admitting long
    prompts with long answers by their prompts is what makes vLLM run dry mid-decode. A
    40-token prompt of the same class recomputes in under two steps and is admitted by its
    prompt."""
    clock = Clock()
    ac = controller(clock)
    _costly(ac, clock, per_token=2.7e-5, running=20)
    for length in range(300, 500, 5):
        ac.learner.observe("completion:1000", length)
    costs = ac.pools[0].view.costs
    likely = ac.learner.likely("completion:1000")
    assert likely is not None
    assert costs.recompute_steps(600 + likely) > 2 >= costs.recompute_steps(40 + likely)
    (end,) = ac.ends(completion(600, 1000), "completion:1000")
    assert end == COLD_OUTPUT_TOKENS  # the gain pays: the floor
    assert not ac.reserving.risked("completion:1000", 600, 1000, costs)
    assert ac.reserving.risked("completion:1000", 40, 1000, costs)
    # by the future peak at the floor: 7 blocks each (600 + 256 tokens), 9 in 64; by their
    # prompts (5 blocks each) vLLM's rule would have admitted 12
    assert admitted(ac, completion(600, 1000), "completion:1000") == 64 // math.ceil(856 / 128)


def test_a_burst_of_known_lengths_is_admitted_by_its_trajectories_means() -> None:
    """``vllm bench serve``'s burst: 256-token prompts that run to 600 tokens (``ignore_eos``)
    on 64 blocks of 128. Laid out by their peaks (7 blocks each, all at their ends at once)
    9 run and the wave uses the pool fully only at its end; an adaptive sidecar on an engine
    whose recompute of 856 tokens costs under a decode step, and where one sequence more gains
    less than that, admits them by their means (halfway from the prompt's 2 blocks to the
    peak's 7: 4.5 each), 14. Worst-case mode keeps the peaks. Where the recompute is dear (a
    GPU-like 26 ms step beside 0.25 ms a prompt token: ~8 steps), the peaks again; and a
    request whose length is not known (no ``ignore_eos``) is never laid out by a mean."""
    klass = request_class("completions", 600, ignore_eos=True)
    clock = Clock()
    wide = controller(clock)
    # a step of 512 sequences, 49% of it fixed (20.2 ms), 20 us a prompt token: the recompute
    # of 856 tokens costs under a step, and one sequence more gains 600 x 0.49 / 512, less
    # (where it gains more, it is risked from the floor: tests/test_ignore_eos.py)
    _costly(wide, clock, per_token=2e-5, running=512)
    costs = wide.pools[0].view.costs
    assert costs.gain_steps(600) < costs.recompute_steps(856) < 1
    assert wide.reserving.averaged(klass, 256, 600, costs)
    assert admitted(wide, completion(256, 600), klass) == 14
    worst = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.0)
    worst.on_snapshot(snapshot(clock))
    assert admitted(worst, completion(256, 600), klass) == 9
    expensive = dear(clock)
    assert not expensive.reserving.averaged(klass, 256, 600, expensive.pools[0].view.costs)
    assert admitted(expensive, completion(256, 600), klass) == 9
    plain = request_class("completions", 600)
    assert not wide.reserving.averaged(plain, 256, 600, costs)


def test_a_batch_request_stays_out_of_the_priority_reserve_by_its_whole_trajectory() -> None:
    """Under ``--priority-reserve`` a request of a positive priority is admitted only where its
    laid-out trajectory fits beside the reserve: not by its mean, not as vLLM admits, and an
    ``ignore_eos`` answer not from the floor. The burst above (256-token prompts running to
    600, peaks of 7 blocks, means of 4.5) runs 14 at priority 0 by their means; as a batch
    (priority 10) beside a reserve of 6 of the 64 blocks, 8 by their peaks (56 <= 58).
    Where even a certain recompute pays, an ``ignore_eos`` request is reserved from the floor
    at priority 0 and to its whole 600 tokens as a batch."""
    klass = request_class("completions", 600, ignore_eos=True)
    clock = Clock()

    def count(priority: int) -> int:
        ac = controller(clock, priority_reserve=0.1)
        _costly(ac, clock, per_token=2e-5, running=512)
        n = 0
        while d := ac.try_admit(Ask(completion(256, 600), True, klass=klass, priority=priority)):
            assert d.admitted, d
            n += 1
        return n

    assert (count(0), count(10)) == (14, 8)
    floor = request_class("chat", 600, ignore_eos=True)
    ends = {}
    for priority in (0, 10):
        small = controller(clock, priority_reserve=0.1)
        _costly(small, clock, per_token=3e-4, running=8)
        d = small.try_admit(Ask(chat(100, 600), True, klass=floor, priority=priority))
        assert d is not None and d.reservation is not None, d
        ends[priority] = d.reservation.ends
    assert ends == {0: (COLD_OUTPUT_TOKENS,), 10: (600,)}, ends
    # without a reserve a batch request is admitted as any other
    plain = controller(clock)
    _costly(plain, clock, per_token=2e-5, running=512)
    assert plain.try_admit(Ask(completion(256, 600), True, klass=klass, priority=10)) is not None
