"""Retry-After bookings that do not outlive their evidence (``sidecar.admission.retry``): a
refusal's booking is provisional for a short hold, then stops pushing later slots out unless its
request came back (the same fingerprint refused again), which confirms it until its slot plus the
grace. And the requests queued ahead of a refused one start in turn, not all at once with it.
The clock is injected: nothing sleeps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.retry import (
    MAX_BOOKINGS,
    MAX_PLACED,
    PROVISIONAL_HOLD_S,
    RetryPlanner,
    fingerprint,
)
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.projection import project_counts
from tests.support.snapshots import Clock, snapshot

BLOCKS = UniformBlocks(128)
STEP = 0.02
#: 32 blocks from its prefill (4 sequences of 900 prompt tokens): two never fit at once
BIG = project_counts((900,), requested_max_tokens=124, n=4, max_model_len=1024, blocks=BLOCKS)
#: Retry-After when the seven in flight have ended, 224 steps from now, and nothing is booked
ALONE = 224 * STEP * 1.1 + 0.25


def refusing() -> tuple[AdmissionController, Clock]:
    """--policy reject over 63 blocks: seven requests hold 56 and end 224 steps from now (their
    progress is not advanced: every plan below sees them there), 50 steps a second."""
    clock = Clock()
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock),
        clock=clock,
        headroom=0.0,
        policy="reject",  # type: ignore[arg-type]
    )
    ac.on_snapshot(snapshot(clock, generated=0, running=1))
    for _ in range(7):
        d = ac.try_admit(
            Ask(
                project_counts(
                    (100,), requested_max_tokens=924, n=1, max_model_len=1024, blocks=BLOCKS
                ),
                streamed=True,
            )
        )
        assert d is not None and d.reservation is not None
        ac.started(d.reservation)
        ac.progressed(d.reservation, 700)
    clock.now += 1.0
    ac.on_snapshot(snapshot(clock, generated=7 * 50, running=7))
    assert ac.pools[0].view.seconds_per_step == pytest.approx(STEP)
    return ac, clock


def refuse(ac: AdmissionController, key: int) -> float:
    d = ac.try_admit(Ask(BIG, streamed=True, key=key))
    assert d is not None and d.reason == "kv_cache_full" and d.retry_after is not None
    return d.retry_after


def planner(ac: AdmissionController) -> RetryPlanner:
    return ac.pools[0].retry


def test_a_booking_whose_request_never_returns_stops_pushing_slots_after_its_hold() -> None:
    """Two requests refused together are spaced (the second behind the first). Neither comes
    back (served by another replica). Past the hold, a third request is told the slot it would
    get with nothing booked, not one behind theirs."""
    ac, clock = refusing()
    first = refuse(ac, 1)
    second = refuse(ac, 2)
    assert first == pytest.approx(ALONE)
    assert second > first + 2.0  # behind the first while it is provisional
    clock.now += PROVISIONAL_HOLD_S / 2
    within = refuse(ac, 3)
    assert within > second  # still within the hold: behind both
    clock.now += PROVISIONAL_HOLD_S * 0.75  # past the first two's holds, before their slots
    assert planner(ac).bookings == 1  # the third's hold runs until 1.5 holds from the first
    assert planner(ac).remembered == 3
    clock.now += PROVISIONAL_HOLD_S
    assert planner(ac).bookings == 0
    later = refuse(ac, 4)
    assert later == pytest.approx(ALONE)


def test_a_returning_request_keeps_its_place_and_confirms_its_booking() -> None:
    """The first refused request comes back (its fingerprint, refused again): it is told its own
    slot again, ahead of the one refused after it, and its booking, now confirmed, goes on
    pushing newcomers back after the hold; the second, never seen again, does not."""
    ac, clock = refusing()
    first = refuse(ac, 1)
    second = refuse(ac, 2)
    clock.now += 1.0
    again = refuse(ac, 1)
    assert again == pytest.approx(ALONE)  # its place, not behind the second
    assert again < second - 1.0
    clock.now += PROVISIONAL_HOLD_S  # the second's hold is over; the first is confirmed
    assert planner(ac).bookings == 1
    newcomer = refuse(ac, 3)
    # behind the first's confirmed booking: it starts at its slot, ``again`` after it was told,
    # a hold ago, and runs 124 steps; the seven end 224 steps from now, while it still runs, so
    # the newcomer fits only once it has ended
    slot = round((again - PROVISIONAL_HOLD_S) / STEP)
    assert slot < 224 < slot + 124
    assert newcomer == pytest.approx((slot + 124) * STEP * 1.1 + 0.25)
    assert newcomer > ALONE  # without the confirmed booking it would be told ALONE
    assert first == pytest.approx(ALONE)


def test_a_client_that_returns_at_its_slot_after_the_hold_is_recognised() -> None:
    """A client honouring Retry-After comes back at its slot, long after the hold: its
    fingerprint is still remembered, so a second refusal confirms it (it then outlives the
    hold); admitting it takes its booking out."""
    ac, clock = refusing()
    first = refuse(ac, 1)
    assert first > PROVISIONAL_HOLD_S
    clock.now += first  # at its slot
    assert planner(ac).bookings == 0 and planner(ac).remembered == 1
    refuse(ac, 1)
    clock.now += PROVISIONAL_HOLD_S + 0.5
    assert planner(ac).bookings == 1  # confirmed: counted past the hold
    planner(ac).admitted(1)
    assert planner(ac).bookings == 0 and planner(ac).remembered == 0


def test_an_anonymous_booking_is_only_ever_provisional() -> None:
    """A request without a fingerprint cannot be recognised: its booking lasts the hold."""
    ac, clock = refusing()
    d = ac.try_admit(Ask(BIG, streamed=True))
    assert d is not None and d.retry_after is not None
    assert planner(ac).bookings == 1
    clock.now += PROVISIONAL_HOLD_S + 0.01
    assert planner(ac).bookings == 0


def test_bookings_past_their_hold_make_room_for_new_ones() -> None:
    """The kept bookings are capped; those remembered only to recognise a retry give way."""
    ac, clock = refusing()
    for key in range(MAX_BOOKINGS):
        planner(ac).plan(
            ac.ledger.candidate(BIG, streamed=True, ends=(124,)),
            ahead=[],
            budget_blocks=63,
            external_blocks=0,
            seconds_per_step=STEP,
            fallback=lambda: 1.0,
            key=key,
        )
    assert planner(ac).remembered == MAX_BOOKINGS
    clock.now += PROVISIONAL_HOLD_S + 0.01  # none counts any more; their slots are to come
    assert planner(ac).bookings == 0
    refuse(ac, MAX_BOOKINGS + 1)
    assert planner(ac).bookings == 1
    assert planner(ac).remembered == MAX_BOOKINGS


def test_the_fingerprint_is_the_same_in_every_process() -> None:
    """A retry may reach another relay worker: its fingerprint must not depend on the process
    (``hash`` of bytes is salted per process)."""
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 5}'
    code = f"from sidecar.admission.retry import fingerprint; print(fingerprint({body!r}))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert seen == {str(fingerprint(body))}
    assert fingerprint(body) != fingerprint(body + b" ")


# The requests queued ahead of a refused one start in turn, each where it first fits beside those
# before it and no sooner than the one ahead of it, and then end as the requests in flight do.
# Laid out together, as if all of them started with the refused request, two large ones ahead
# outweighed the budget and the planner gave no bound (its fallback: the release rate, 60 s
# early in a run).

#: BIG's sequences end after their 124 tokens: one BIG holds the pool's room for 124 steps
RUN = 124


def big(ac: AdmissionController) -> Reservation:
    return ac.ledger.candidate(BIG, streamed=True, ends=(RUN,))


def small(ac: AdmissionController) -> Reservation:
    """One block, 20 tokens long: it fits beside the seven in flight now."""
    return ac.ledger.candidate(
        project_counts((100,), requested_max_tokens=20, n=1, max_model_len=1024, blocks=BLOCKS),
        streamed=True,
        ends=(20,),
    )


def steps(p: RetryPlanner, candidate: Reservation, ahead: list[Reservation]) -> int | None:
    return p.wait_steps(candidate, ahead=ahead, budget_blocks=63, external_blocks=0)


def test_each_request_queued_ahead_starts_when_the_one_before_it_has_made_room() -> None:
    """63 blocks, seven requests in flight holding 56 until 224 steps from now, and two BIGs
    (32 blocks each: two never fit at once) queued ahead of a third: the first starts at 224,
    the second when the first ends, the third when the second ends."""
    ac, _ = refusing()
    p = planner(ac)
    assert steps(p, big(ac), []) == 224
    assert steps(p, big(ac), [big(ac)]) == 224 + RUN
    assert steps(p, big(ac), [big(ac), big(ac)]) == 224 + 2 * RUN


def test_retry_after_behind_a_queue_is_its_turn_not_the_fallback() -> None:
    """The same as a Retry-After: the seconds of its turn (with the planner's margin), not the
    fallback's."""
    ac, _ = refusing()
    seconds = planner(ac).plan(
        big(ac),
        ahead=[big(ac), big(ac)],
        budget_blocks=63,
        external_blocks=0,
        seconds_per_step=STEP,
        fallback=lambda: 60.0,
        book=False,
    )
    assert seconds == pytest.approx((224 + 2 * RUN) * STEP * 1.1 + 0.25)


def test_a_small_request_behind_a_large_one_waits_for_the_large_one_to_start() -> None:
    """The queue tries its head only: a request that would fit now waits behind the head, and
    then fits beside it."""
    ac, _ = refusing()
    tiny = small(ac)
    assert steps(planner(ac), tiny, []) == 0  # 1 block: fits now
    assert steps(planner(ac), tiny, [big(ac)]) == 224  # after the BIG ahead of it starts


def test_beyond_max_placed_the_queue_is_laid_out_together() -> None:
    """More than MAX_PLACED ahead: all of them with the candidate, as if they started at once (no
    bound when they never fit together)."""
    ac, _ = refusing()
    assert steps(planner(ac), big(ac), [big(ac)] * (MAX_PLACED + 1)) is None


def test_the_requests_queued_now_start_before_the_refused_ones_come_back() -> None:
    """A BIG refused a moment ago is booked to come back when the seven in flight have ended
    (its slot: 224 steps and the margin from now). A BIG queued now is served before it, at 224,
    so a small request queued behind that BIG fits once that BIG has ended (224 + 124 steps), not
    once the booked one has (its slot + 124), as when the bookings were laid out first."""
    ac, _ = refusing()
    refuse(ac, 1)
    slot = round(ALONE / STEP)  # the booking's start, in steps from now
    tiny = small(ac)
    seconds = planner(ac).plan(
        tiny,
        ahead=[big(ac)],
        budget_blocks=63,
        external_blocks=0,
        seconds_per_step=STEP,
        fallback=lambda: 60.0,
        book=False,
    )
    assert slot < 224 + RUN < slot + RUN
    assert seconds == pytest.approx((224 + RUN) * STEP * 1.1 + 0.25)
