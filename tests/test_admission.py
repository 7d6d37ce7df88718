"""The ledger and the admission decision: budget, queue, FIFO, timeouts, Retry-After, learning."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.admission.controller import AdmissionController, CompletionLearner
from sidecar.admission.decisions import Outcome
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import Projection, project_counts

BLOCKS = UniformBlocks(128)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def snapshot(
    clock: Clock,
    *,
    used: int = 0,
    blocks: int = 64,
    preemptions: float = 0,
    generated: float = 0,
    running: int = 0,
) -> EngineSnapshot:
    capacity = blocks - 1
    return EngineSnapshot(
        taken_at=clock(),
        block_size=128,
        num_gpu_blocks=blocks,
        engines=1,
        kv_cache_usage=used / capacity,
        running=running,
        preemptions_total=preemptions,
        generation_tokens_total=generated,
        cache_dtype="auto",
        prefix_caching=True,
        kv_cache_memory_bytes=None,
        has_cache_config=True,
    )


def proj(prompt: int = 271, max_tokens: int = 700, n: int = 1) -> Projection:
    return project_counts(
        (prompt,), requested_max_tokens=max_tokens, n=n, max_model_len=1024, blocks=BLOCKS
    )


def controller(clock: Clock, **kw: object) -> AdmissionController:
    ac = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.0, **kw)  # type: ignore[arg-type]
    ac.on_snapshot(snapshot(clock))
    return ac


def test_ledger_tracks_predicted_and_reserved() -> None:
    clock = Clock()
    ledger = Ledger(BLOCKS, clock=clock)
    p = proj()  # 271 + 700 tokens -> 3 prompt blocks, 8 at peak
    r = ledger.reserve(p, reserved_blocks=p.peak_blocks, streamed=True)
    # admitted, not yet in vLLM: promised but not held
    assert (ledger.reserved_blocks, ledger.predicted_blocks, ledger.peak_blocks) == (8, 0, 8)
    ledger.start(r)
    assert ledger.predicted_blocks == 3
    ledger.advance(r, 300)  # 571 tokens -> 5 blocks
    assert ledger.predicted_blocks == 5
    ledger.advance(r, 100)  # progress never goes back
    assert ledger.predicted_blocks == 5
    clock.now += 4
    assert ledger.release(r) == 8 and ledger.release(r) == 0
    assert (ledger.reserved_blocks, ledger.predicted_blocks, len(ledger)) == (0, 0, 0)
    assert ledger.freed_blocks_per_second() == pytest.approx(8.0)
    assert ledger.mean_hold_seconds == 4


def test_expected_reservation_grows_when_the_answer_runs_long() -> None:
    ledger = Ledger(BLOCKS)
    p = proj()
    r = ledger.reserve(p, reserved_blocks=4, streamed=True)
    ledger.start(r)
    ledger.advance(r, 650)  # 921 tokens -> 8 blocks > 4 reserved
    assert r.reserved_blocks == 8 and ledger.reserved_blocks == 8


def test_worst_case_admits_until_the_budget_then_rejects() -> None:
    clock = Clock()
    ac = controller(clock, policy="reject")
    admitted = [ac.try_admit(proj(), streamed=True) for _ in range(8)]
    assert [d.outcome for d in admitted if d] == [Outcome.ADMIT] * 7 + [Outcome.REJECT]  # 63 // 8
    refused = admitted[-1]
    assert refused is not None and refused.reason == "kv_cache_full"
    assert refused.retry_after is not None and 1 <= refused.retry_after <= 60
    assert ac.ledger.reserved_blocks == 56


def test_headroom_and_external_usage_shrink_the_budget() -> None:
    clock = Clock()
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.5, policy="reject"
    )
    ac.on_snapshot(snapshot(clock))
    assert ac.budget_blocks() == 31
    assert (
        sum(1 for _ in range(5) if (d := ac.try_admit(proj(), streamed=True)) and d.admitted) == 3
    )
    # traffic that bypasses the sidecar: vLLM holds 40 blocks, the ledger predicts 9
    ac2 = controller(clock, policy="reject")
    ac2.on_snapshot(snapshot(clock, used=40))
    assert ac2.committed_blocks() >= 40
    results = [ac2.try_admit(proj(), streamed=True) for _ in range(4)]
    assert sum(1 for d in results if d and d.admitted) == 2  # (63 - 40) // 8


def test_a_request_that_can_never_fit_is_refused_at_once() -> None:
    clock = Clock()
    ac = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.9)
    ac.on_snapshot(snapshot(clock))  # budget 6 blocks
    d = ac.try_admit(proj(), streamed=True)
    assert d is not None and d.reason == "too_large" and d.retry_after is None


async def test_queue_is_fifo_and_admits_on_release() -> None:
    clock = Clock()
    ac = controller(clock, policy="queue", max_queue_wait=5)
    running = [ac.try_admit(proj(), streamed=True) for _ in range(7)]
    assert all(d and d.admitted for d in running)
    big = proj(prompt=500, max_tokens=520)  # 8 blocks
    small = proj(prompt=10, max_tokens=10)  # 1 block
    assert ac.try_admit(big, streamed=True) is None
    order: list[str] = []

    async def wait(name: str, p: Projection) -> None:
        d = await ac.wait(p, streamed=True)
        order.append(f"{name}:{d.outcome.value}")

    t_big = asyncio.create_task(wait("big", big))
    await asyncio.sleep(0)
    # a small request arriving behind the big one must not overtake it, although 7 blocks are free
    assert ac.try_admit(small, streamed=True) is None
    t_small = asyncio.create_task(wait("small", small))
    await asyncio.sleep(0)
    assert ac.queue_depth == 2 and order == []
    first = running[0]
    assert first is not None and first.reservation is not None
    ac.release(first.reservation)
    await asyncio.gather(t_big, t_small)
    assert order == ["big:admit", "small:admit"]
    assert ac.queue_depth == 0


async def test_queue_timeout_full_and_disconnect() -> None:
    clock = Clock()
    ac = controller(clock, policy="queue", max_queue_wait=0.05, max_queue_depth=1)
    for _ in range(7):
        ac.try_admit(proj(), streamed=True)
    assert ac.try_admit(proj(), streamed=True) is None
    waiting = asyncio.create_task(ac.wait(proj(), streamed=True))
    await asyncio.sleep(0)
    full = ac.try_admit(proj(), streamed=True)
    assert full is not None and full.reason == "queue_full"
    timed_out = await waiting
    assert timed_out.reason == "queue_timeout" and timed_out.retry_after is not None
    assert ac.queue_depth == 0
    gone = asyncio.Event()
    ac.max_queue_wait = 5
    task = asyncio.create_task(ac.wait(proj(), streamed=True, cancelled=gone))
    await asyncio.sleep(0.01)
    gone.set()
    d = await task
    assert d.outcome is Outcome.CANCEL and ac.queue_depth == 0


def test_retry_after_follows_the_release_rate() -> None:
    clock = Clock()
    ac = controller(clock, policy="reject")
    decisions = [ac.try_admit(proj(), streamed=True) for _ in range(7)]
    for d in decisions[:4]:  # 32 blocks freed over 6 s
        clock.now += 2
        assert d is not None and d.reservation is not None
        ac.release(d.reservation)
    ac.on_snapshot(snapshot(clock))
    for _ in range(4):
        ac.try_admit(proj(), streamed=True)
    refused = ac.try_admit(proj(), streamed=True)
    assert refused is not None and refused.reason == "kv_cache_full"
    # 56 committed + 8 needed - 63 budget = 1 block short, at 32 blocks / 6 s
    assert refused.retry_after == pytest.approx(1.0)
    # 40 blocks short at 32 / 6 s -> 7.5 s
    assert ac.retry_after(47) == pytest.approx(40 / (32 / 6))
    clock.now += 100  # nothing released lately: half the smoothed hold time (EWMA of 2, 4, 6, 8 s)
    assert ac.retry_after(8) == pytest.approx(4.096 / 2)


def test_stale_metrics_open_and_closed() -> None:
    clock = Clock()
    ac = controller(clock, policy="reject", stale_after=5)
    ac.on_snapshot(snapshot(clock, used=60))  # vLLM says it is full, then goes quiet
    clock.now += 10
    d = ac.try_admit(proj(), streamed=True)
    assert d is not None and d.admitted and d.reason == "stale_open"
    # stale means "trust the ledger alone", not "admit everything"
    results = [ac.try_admit(proj(), streamed=True) for _ in range(7)]
    assert sum(1 for r in results if r and r.admitted) == 6  # 7 x 8 blocks <= 63
    assert ac.ledger.reserved_blocks == 56
    closed = controller(clock, policy="reject", stale_after=5, stale_policy="closed")
    clock.now += 10
    d = closed.try_admit(proj(), streamed=True)
    assert d is not None and d.reason == "stale_closed" and not d.admitted


def test_non_streamed_progress_is_estimated_from_vllm_counters() -> None:
    clock = Clock()
    ac = controller(clock)
    ac.on_snapshot(snapshot(clock, generated=1000, running=2))
    d = ac.try_admit(proj(), streamed=False)
    assert d is not None and d.reservation is not None
    ac.ledger.start(d.reservation)  # the proxy starts non-streamed requests as it forwards them
    ac.on_snapshot(snapshot(clock, generated=1600, running=2))  # 300 tokens per sequence
    assert d.reservation.generated == 300
    assert ac.ledger.predicted_blocks == 5  # ceil(571 / 128)


def test_learner_quantile_boost_and_expected_need() -> None:
    clock = Clock()
    learner = CompletionLearner(0.9, min_samples=10, boost_half_life=60, clock=clock)
    assert learner.ratio() == 1.0
    for i in range(100):
        learner.observe(i, 100)  # ratios 0.00 .. 0.99
    assert learner.ratio() == pytest.approx(0.90)
    learner.tighten()
    assert learner.ratio() == pytest.approx(1.0)
    clock.now += 600
    assert learner.ratio() == pytest.approx(0.90, abs=0.01)

    ac = controller(clock, reservation="expected", expected_quantile=0.5)
    for _ in range(30):
        ac.learner.observe(70, 700)
    assert ac.need_blocks(proj()) == 3  # 271 + 70 tokens -> 3 blocks instead of 8
    ac.on_snapshot(snapshot(clock, preemptions=1))
    ac.on_snapshot(snapshot(clock, preemptions=3))
    assert ac.preemptions_seen == 3
    assert ac.need_blocks(proj()) > 3  # tightened after vLLM preempted


def test_learner_starts_from_its_prior_until_enough_answers() -> None:
    learner = CompletionLearner(0.9, min_samples=5, prior=0.4)
    assert learner.ratio() == 0.4
    for _ in range(4):
        learner.observe(90, 100)
    assert learner.ratio() == 0.4  # 4 answers are not evidence yet
    learner.observe(90, 100)
    assert learner.ratio() == pytest.approx(0.9)
    with pytest.raises(ValueError, match="prior"):
        CompletionLearner(prior=0.0)

    clock = Clock()
    ac = controller(clock, reservation="expected", expected_prior=0.1)
    assert ac.need_blocks(proj()) == 3  # 271 + 70 tokens: the prior, before any answer
    assert controller(clock, reservation="expected").need_blocks(proj()) == 8  # default: all


async def test_a_queued_request_is_sized_by_the_learned_ratio_when_it_starts() -> None:
    """The ratio can drop while a request waits: it is reserved at what it says then."""
    clock = Clock()
    ac = controller(clock, policy="queue", reservation="expected", max_queue_wait=5)
    running = [ac.try_admit(proj(prompt=500, max_tokens=500), streamed=True) for _ in range(7)]
    assert all(d and d.admitted for d in running)  # 7 x 8 = 56 of 63 blocks, worst-case ratio
    waiter = asyncio.create_task(ac.wait(proj(), streamed=True))  # 8 blocks at ratio 1.0
    await asyncio.sleep(0)
    assert ac.queue_depth == 1
    for _ in range(20):
        ac.learner.observe(50, 500)  # answers use a tenth of max_tokens
    ac.pump()
    decision = await asyncio.wait_for(waiter, 1)
    assert decision.admitted and decision.reservation is not None
    assert decision.reservation.reserved_blocks == 3  # 271 + 70 tokens, not 8 blocks


def test_an_estimate_never_makes_a_request_unrunnable() -> None:
    clock = Clock()
    ac = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.9)
    ac.on_snapshot(snapshot(clock))  # budget 6 blocks
    estimated = project_counts(
        (900,), requested_max_tokens=100, n=1, max_model_len=1024, blocks=BLOCKS, exact=False
    )
    d = ac.try_admit(estimated, streamed=True)
    assert d is not None and d.admitted and d.reservation is not None
    assert d.reservation.reserved_blocks == 6  # the whole budget, not 8
