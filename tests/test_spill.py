"""``--policy spill``: a request that does not fit is queued when its expected wait here (the
trajectories' steps behind the queue, times the learned step time) is at most ``--spill-wait``,
refused at once with 429 ``spilled`` and a Retry-After when it is longer or cannot be bounded, and
queued while the step time is not known (cold). A request queued under spill is judged again
each time the queue is tried (the pump, after every scrape and release), with the requests
queued before it ahead, and handed back with ``spilled`` and a Retry-After once its expected
wait is over half again ``--spill-wait``: never the next to be admitted, never on a cold pool,
never for a wait over the threshold by less than the margin."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.decisions import REFUSALS, Decision, Outcome, Reason
from sidecar.admission.spill import REJUDGE_MARGIN
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import Projection, project_counts
from tests.support.snapshots import Clock, snapshot

BLOCKS = UniformBlocks(128)
STEP = 0.02  # seconds per decode step the tests teach the controller (50 steps a second)


def proj(prompt: int, max_tokens: int, n: int = 1) -> Projection:
    return project_counts(
        (prompt,), requested_max_tokens=max_tokens, n=n, max_model_len=1024, blocks=BLOCKS
    )


#: 8 blocks from its prefill on (900 prompt tokens), 8 at its end: it never fits beside 56
BIG = proj(900, 124)


def controller(clock: Clock, policy: str = "spill", **kw: object) -> AdmissionController:
    """64 blocks (63 usable, no headroom), --policy spill unless told."""
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock),
        clock=clock,
        headroom=0.0,
        policy=policy,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    ac.on_snapshot(snapshot(clock, generated=0, running=1))
    return ac


def run_seven(ac: AdmissionController, clock: Clock, generated: tuple[int, ...]) -> list[Decision]:
    """Seven requests of 100 prompt tokens and max_tokens 924 (8 blocks at their end), started,
    each ``generated[i]`` tokens in; then a scrape that teaches 50 steps a second."""
    running = [ac.try_admit(Ask(proj(100, 924), streamed=True)) for _ in range(7)]
    for d, done in zip(running, generated, strict=True):
        assert d is not None and d.reservation is not None
        ac.started(d.reservation)
        ac.progressed(d.reservation, done)
    clock.now += 1.0
    ac.on_snapshot(snapshot(clock, generated=7 * 50, running=7))
    assert ac.pools[0].view.seconds_per_step == pytest.approx(STEP)
    return [d for d in running if d is not None]


def test_a_long_wait_is_refused_at_once_and_a_short_one_queued() -> None:
    """The seven end 224 steps from now (4.48 s): over the 2 s default the request is refused
    at once, with Retry-After from the planner; with --spill-wait 5 the same request queues."""
    clock = Clock()
    ac = controller(clock)
    run_seven(ac, clock, (700,) * 7)
    refused = ac.try_admit(Ask(BIG, streamed=True, key=1))
    assert refused is not None and refused.outcome is Outcome.REJECT
    assert refused.reason is Reason.SPILLED
    assert REFUSALS[refused.reason].status == 429
    assert refused.retry_after == pytest.approx(224 * STEP * 1.1 + 0.25)
    assert "4.5s" in refused.message and "--spill-wait" in refused.message
    assert ac.pools[0].retry.bookings == 1  # booked, as any refusal
    waits = ac.expected_waits(Ask(BIG, streamed=True))
    assert [(e.steps, e.seconds) for e in waits] == [(224, pytest.approx(4.48))]

    other_clock = Clock()
    patient = controller(other_clock, spill_wait=5.0)
    run_seven(patient, other_clock, (700,) * 7)
    assert patient.try_admit(Ask(BIG, streamed=True, key=1)) is None  # queue it


async def test_the_queue_ahead_makes_a_short_wait_long() -> None:
    """One of the seven ends in 50 steps (1 s), the other six in 124 (2.48 s): the first request
    that needs 8 blocks is queued. A second one is behind it: not both fit until the six have
    ended, so it is refused; without the first queued it would have queued too. A request
    that fits is still admitted at once while nothing is queued."""
    clock = Clock()
    ac = controller(clock, max_queue_wait=30)
    running = run_seven(ac, clock, (874,) + (800,) * 6)
    assert ac.try_admit(Ask(BIG, streamed=True, key=1)) is None  # 1 s: queue it
    [alone] = ac.expected_waits(Ask(BIG, streamed=True, key=2))
    assert alone.steps == 50
    first = asyncio.create_task(ac.wait(Ask(BIG, streamed=True, key=1)))
    await asyncio.sleep(0)
    assert ac.queue_depth == 1
    [behind] = ac.expected_waits(Ask(BIG, streamed=True, key=2))
    assert behind.steps == 124  # at least the queued one's 50, and both must fit
    second = ac.try_admit(Ask(BIG, streamed=True, key=2))
    assert second is not None and second.reason is Reason.SPILLED
    # the one that ends makes room for the first queued
    ac.release(running[0].reservation)  # type: ignore[arg-type]
    admitted = await asyncio.wait_for(first, 5)
    assert admitted.reason is Reason.QUEUED
    assert ac.try_admit(Ask(proj(10, 10), streamed=True)) is not None  # 1 block: fits


def test_bookings_do_not_lengthen_the_wait_of_a_request_queued_now() -> None:
    """Refused requests booked for later come back behind whatever queues now: the spill wait
    leaves them out, Retry-After does not."""
    clock = Clock()
    ac = controller(clock)
    run_seven(ac, clock, (874,) + (800,) * 6)
    # refused under reject semantics to book slots: the planner books at 50 steps
    for key in (11, 12):
        ac.retry_after(Ask(BIG, streamed=True, key=key))
    assert ac.pools[0].retry.bookings == 2
    [wait] = ac.expected_waits(Ask(BIG, streamed=True, key=3))
    assert wait.steps == 50
    assert ac.try_admit(Ask(BIG, streamed=True, key=3)) is None  # queued, not spilled
    # whereas its Retry-After, were it refused, would be behind both bookings
    assert ac.retry_after(Ask(BIG, streamed=True, key=4)) > 2 * 50 * STEP


def test_cold_queues_and_a_wait_behind_requests_not_started_is_bounded() -> None:
    """No step time yet (vLLM has generated nothing): the request queues, as under --policy
    queue. Once it is known, the seven requests admitted a moment ago and not started by vLLM
    yet are laid out as starting now: the wait is their whole run, 924 steps, not unbounded (as
    it was when they were laid out to start only with the refused request), and its Retry-After
    is that slot."""
    clock = Clock()
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock),
        clock=clock,
        headroom=0.0,
        policy="spill",  # type: ignore[arg-type]
    )
    ac.on_snapshot(snapshot(clock))
    held = [ac.try_admit(Ask(proj(100, 924), streamed=True)) for _ in range(7)]
    assert all(d is not None and d.admitted for d in held)
    assert ac.pools[0].view.seconds_per_step is None
    [cold] = ac.expected_waits(Ask(BIG, streamed=True))
    assert cold.cold and cold.seconds is None
    assert ac.try_admit(Ask(BIG, streamed=True)) is None  # queued

    ac.pools[0].view.seconds_per_step = STEP  # as a scrape would teach it
    [bounded] = ac.expected_waits(Ask(BIG, streamed=True))
    assert bounded.steps == 924
    refused = ac.try_admit(Ask(BIG, streamed=True, key=5))
    assert refused is not None and refused.reason is Reason.SPILLED
    assert f"is {924 * STEP:.1f}s" in refused.message
    # behind the queued one (its 924 steps too: it fits beside the seven's prompts only once
    # they have ended), a little late
    assert refused.retry_after == pytest.approx(924 * STEP * 1.1 + 0.25)
    # its fingerprint is remembered with its booking: when it comes back, refused again, its
    # booking is replaced, not added to
    assert ac.pools[0].retry.remembers(5)
    assert ac.pools[0].retry.remembered == 1
    again = ac.try_admit(Ask(BIG, streamed=True, key=5))
    assert again is not None and again.reason is Reason.SPILLED
    assert ac.pools[0].retry.remembers(5) and ac.pools[0].retry.remembered == 1


def test_a_wait_that_cannot_be_bounded_is_refused() -> None:
    """A request of 8 sequences over the budget together (each within the pool) runs only into
    an empty pool: no end of the requests in flight lets it fit beside them, so its wait cannot
    be bounded, and spill refuses it at once with the release rate's guess as its Retry-After,
    its fingerprint remembered (a booking with no trajectory)."""
    clock = Clock()
    ac = controller(clock)
    run_seven(ac, clock, (700,) * 7)
    huge = proj(900, 124, n=8)  # 8 sequences of 8 blocks: 64, over the 63 usable
    [unbounded] = ac.expected_waits(Ask(huge, streamed=True))
    assert unbounded.steps is None and unbounded.seconds == float("inf")
    refused = ac.try_admit(Ask(huge, streamed=True, key=9))
    assert refused is not None and refused.reason is Reason.SPILLED
    assert "cannot be bounded" in refused.message
    assert refused.retry_after is not None and refused.retry_after >= 1.0
    assert ac.pools[0].retry.remembers(9) and ac.pools[0].retry.bookings == 1


def test_queue_and_reject_policies_are_unchanged() -> None:
    """The same long wait: --policy queue queues it, --policy reject refuses it kv_cache_full."""
    for policy, expect in (("queue", None), ("reject", Reason.KV_CACHE_FULL)):
        clock = Clock()
        ac = controller(clock, policy=policy)
        run_seven(ac, clock, (700,) * 7)
        d = ac.try_admit(Ask(BIG, streamed=True))
        assert (d.reason if d is not None else None) == expect


def test_the_settings_reach_the_controller() -> None:
    """``--policy spill --spill-wait S`` (flags or env) is what the sidecar's controller runs."""
    from sidecar.app import Sidecar
    from sidecar.config import Policy, Settings

    sidecar = Sidecar(Settings(policy="spill", spill_wait=7.5))  # type: ignore[arg-type]
    assert sidecar.admission.policy is Policy.spill
    assert sidecar.admission.spill_wait == 7.5


# --- the pure core: re-judging the queue -------------------------------------------------------

#: --spill-wait of these tests: the three queued requests' waits at 20 ms a step (1.0, 1.48 and
#: 2.48 s) are all under it at arrival; the bar for handing one back is half again: 3.75 s
SPILL_WAIT = 2.5


async def three_queued(
    clock: Clock, *, small: bool = False
) -> tuple[AdmissionController, list[asyncio.Task[Decision]], Decision | None]:
    """Seven streams in flight ending in 50, 74 and (five of them) 124 steps, and three requests
    of 8 blocks queued behind them: the first fits after 50 steps, the first two after 74, all
    three after 124 (20 ms a step). ``small``: a one-block request admitted and started before
    them too (it ends in 5 steps), returned for the test to release."""
    ac = controller(clock, spill_wait=SPILL_WAIT, max_queue_wait=60)
    extra = None
    if small:
        extra = ac.try_admit(Ask(proj(10, 10), streamed=True))
        assert extra is not None and extra.reservation is not None
        ac.started(extra.reservation)
        ac.progressed(extra.reservation, 5)
    run_seven(ac, clock, (874, 850) + (800,) * 5)
    tasks = []
    for key in (1, 2, 3):
        ask = Ask(BIG, streamed=True, key=key)
        assert ac.try_admit(ask) is None  # queued: its wait is under --spill-wait
        tasks.append(asyncio.create_task(ac.wait(ask)))
        await asyncio.sleep(0)
    queued = ac.queue.waiting()
    assert [w.ask.key for w in queued] == [1, 2, 3]
    # each judged with only those before it ahead (the arrival form counts every other waiter)
    assert [ac.expected_waits(w.ask, before=w.seq)[0].steps for w in queued] == [50, 74, 124]
    assert ac.expected_waits(queued[1].ask)[0].steps == 124
    return ac, tasks, extra


def keys_queued(ac: AdmissionController) -> list[int | None]:
    return [w.ask.key for w in ac.queue.waiting()]


async def test_a_queued_request_whose_wait_grows_past_the_bar_is_handed_back() -> None:
    """The step time doubles (20 to 40 ms): the last one's wait is 4.96 s, over the 3.75 s bar,
    and it is refused ``spilled`` with a Retry-After; the second's is 2.96 s, over --spill-wait
    but not by half again, and it stays, as the first, the next to be admitted."""
    clock = Clock()
    ac, tasks, _ = await three_queued(clock)
    view = ac.pools[0].view
    ac.pump()  # as after a scrape: every wait still under --spill-wait
    assert keys_queued(ac) == [1, 2, 3]

    view.seconds_per_step = 0.04
    assert SPILL_WAIT < 74 * 0.04 < SPILL_WAIT * (1 + REJUDGE_MARGIN) < 124 * 0.04
    clock.now += 0.5
    ac.pump()
    assert keys_queued(ac) == [1, 2]
    handed = await asyncio.wait_for(tasks[2], 5)
    assert handed.outcome is Outcome.REJECT and handed.reason is Reason.SPILLED
    assert "handed back before vLLM saw it" in handed.message and "4.96" not in handed.message
    assert "is now 5.0s" in handed.message and "--spill-wait" in handed.message
    assert handed.retry_after is not None and handed.retry_after >= 1.0
    assert handed.waited_seconds == pytest.approx(0.5)
    assert ac.queue_depth == 2
    for task in tasks[:2]:
        assert not task.done()
        task.cancel()


async def test_the_next_to_be_admitted_is_never_handed_back() -> None:
    """At 100 ms a step every wait is over the bar (5, 7.4 and 12.4 s): the two behind are
    handed back, the first, which the queue tries next, keeps its place."""
    clock = Clock()
    ac, tasks, _ = await three_queued(clock)
    ac.pools[0].view.seconds_per_step = 0.1
    ac.pump()
    assert keys_queued(ac) == [1]
    for task in tasks[1:]:
        assert (await asyncio.wait_for(task, 5)).reason is Reason.SPILLED
    assert not tasks[0].done()
    tasks[0].cancel()


async def test_a_cold_pool_hands_nothing_back() -> None:
    """No step time (as before vLLM generated a token): the waits cannot be told in seconds,
    and nothing is handed back; once the step is known again, the long one is."""
    clock = Clock()
    ac, tasks, _ = await three_queued(clock)
    view = ac.pools[0].view
    view.seconds_per_step = None
    ac.pump()
    assert keys_queued(ac) == [1, 2, 3]
    view.seconds_per_step = 0.1
    ac.pump()
    assert keys_queued(ac) == [1]
    for task in tasks:
        task.cancel()


async def test_a_release_tries_the_queue_and_judges_it_again() -> None:
    """A release (here a small request's, which makes no room for the first) is a try of the
    queue: the waits are judged again then, not only at the next scrape."""
    clock = Clock()
    ac, tasks, small = await three_queued(clock, small=True)
    assert small is not None and small.reservation is not None
    ac.pools[0].view.seconds_per_step = 0.1  # learned at a scrape; no try of the queue yet
    assert keys_queued(ac) == [1, 2, 3]
    ac.release(small.reservation, 10)
    assert keys_queued(ac) == [1]
    for task in tasks:
        task.cancel()


async def test_the_queue_policy_hands_nothing_back() -> None:
    """Only --policy spill re-judges: the same queue under --policy queue keeps waiting."""
    clock = Clock()
    ac, tasks, _ = await three_queued(clock)
    ac.policy = ac.policy.queue
    ac.pools[0].view.seconds_per_step = 0.1
    ac.pump()
    assert keys_queued(ac) == [1, 2, 3]
    for task in tasks:
        task.cancel()
