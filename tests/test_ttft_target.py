"""``--ttft-target``: a request that does not fit now is refused at once with 429 ``ttft_target``
and a Retry-After when its expected wait here plus its prefill is over the objective, queued when
within it, and queued while the step time is not known (cold)."""

from __future__ import annotations

import pytest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.decisions import REFUSALS, Outcome, Reason
from sidecar.admission.spill import Estimate, first_token
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import Projection, project_counts
from tests.support.snapshots import Clock, snapshot

BLOCKS = UniformBlocks(128)
STEP = 0.02  # seconds per decode step taught (50 steps a second)


def proj(prompt: int, max_tokens: int) -> Projection:
    return project_counts(
        (prompt,), requested_max_tokens=max_tokens, n=1, max_model_len=1024, blocks=BLOCKS
    )


#: 8 blocks from its prefill on, 8 at its end: it never fits beside seven of 8
BIG = proj(900, 124)


def loaded(target: float | None, *, taught: bool = True) -> AdmissionController:
    """64 blocks (63 usable), --policy queue, seven requests of 8 blocks at their end running
    700 tokens in (224 steps from their end); 50 steps a second taught unless ``taught`` is
    False."""
    clock = Clock()
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.0, ttft_target=target
    )
    ac.on_snapshot(snapshot(clock, generated=0, running=1 if taught else 0))
    for _ in range(7):
        d = ac.try_admit(Ask(proj(100, 924), streamed=True))
        assert d is not None and d.reservation is not None
        ac.started(d.reservation)
        ac.progressed(d.reservation, 700)
    if taught:
        clock.now += 1.0
        ac.on_snapshot(snapshot(clock, generated=7 * 50, running=7))
        assert ac.pools[0].view.seconds_per_step == pytest.approx(STEP)
    return ac


def test_a_first_token_past_the_objective_is_refused_at_once() -> None:
    """Its wait is 224 steps (4.48 s): over a 3 s objective it is refused at once, with the
    planner's Retry-After; within a 5 s one it queues; with no objective it queues."""
    refused = loaded(3.0).try_admit(Ask(BIG, streamed=True, key=1))
    assert refused is not None and refused.outcome is Outcome.REJECT
    assert refused.reason is Reason.TTFT_TARGET
    assert REFUSALS[refused.reason].status == 429
    assert REFUSALS[refused.reason].code == "ttft_target"
    assert refused.retry_after == pytest.approx(224 * STEP * 1.1 + 0.25)
    assert "4.5s" in refused.message and "--ttft-target" in refused.message
    assert loaded(5.0).try_admit(Ask(BIG, streamed=True, key=1)) is None  # queue it
    assert loaded(None).try_admit(Ask(BIG, streamed=True, key=1)) is None


def test_a_request_that_fits_is_admitted_whatever_the_objective() -> None:
    small = loaded(0.001).try_admit(Ask(proj(100, 16), streamed=True))
    assert small is not None and small.admitted


def test_a_cold_engine_queues() -> None:
    """No decode step measured yet: the wait cannot be told in seconds, so it queues."""
    assert loaded(0.001, taught=False).try_admit(Ask(BIG, streamed=True)) is None


def test_the_prefill_counts_against_the_objective() -> None:
    waits = [Estimate(steps=100, seconds_per_step=STEP)]  # 2 s waiting for room
    assert first_token(waits, prefill_seconds=0.5, target=3.0).queue
    late = first_token(waits, prefill_seconds=1.5, target=3.0)
    assert not late.queue and "3.5s" in late.message and "1.5s of prefill" in late.message
    unbounded = first_token([Estimate(None, STEP)], prefill_seconds=0.0, target=60.0)
    assert not unbounded.queue and "cannot be bounded" in unbounded.message
