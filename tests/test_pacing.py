"""``--priority-pace`` in the pure core: requests of a positive priority forwarded no faster than
vLLM prefills them (``sidecar.admission.pacing``), requests of priority 0 never held by it.

The pool is 64 blocks of 128 tokens (a budget of 63, no headroom); each request of 271 prompt
and 700 output tokens reaches 8 blocks, so 7 fit: the KV pool never holds anything back before
the third request here. No prefill is measured, so each prompt costs the prior,
271 x 5e-5 = 13.55 ms of prefill."""

from __future__ import annotations

import asyncio
import time

import pytest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.pacing import PRIOR_PREFILL_SECONDS_PER_TOKEN, PrefillPace
from sidecar.config import Policy
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import Projection, project_counts
from tests.support.snapshots import Clock, snapshot

BLOCKS = UniformBlocks(128)
PROMPT = 271
COST = PROMPT * PRIOR_PREFILL_SECONDS_PER_TOKEN  # 13.55 ms of prefill a request
BATCH = 10  # a positive priority: a batch class


def proj(prompt: int = PROMPT, max_tokens: int = 700) -> Projection:
    return project_counts(
        (prompt,), requested_max_tokens=max_tokens, n=1, max_model_len=1024, blocks=BLOCKS
    )


def controller(clock: object, **kw: object) -> AdmissionController:
    ac = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.0, **kw)  # type: ignore[arg-type]
    ac.on_snapshot(snapshot(clock))  # type: ignore[arg-type]
    return ac


def admitted(ac: AdmissionController, priority: int) -> bool:
    decision = ac.try_admit(Ask(proj(), streamed=True, priority=priority))
    return decision is not None and decision.admitted


@pytest.mark.parametrize(
    ("sent_seconds", "elapsed", "pace", "hold"),
    [
        (0.0, 0.0, 0.1, 0.0),  # nothing sent: go
        (0.05, 0.0, 0.1, 0.0),  # under the pace: go
        (0.1, 0.0, 0.1, 1e-9),  # at the pace: wait (a hair)
        (0.3, 0.0, 0.1, 0.2 + 1e-9),  # 0.2 s over it
        (0.3, 0.15, 0.1, 0.05 + 1e-9),  # drained at a second a second
        (0.3, 1.0, 0.1, 0.0),  # drained
    ],
)
def test_the_backlog_drains_at_a_second_a_second(
    sent_seconds: float, elapsed: float, pace: float, hold: float
) -> None:
    clock = Clock()
    pace_ = PrefillPace(clock=clock)
    pace_.sent(1000, sent_seconds / 1000)
    clock.now += elapsed
    assert pace_.hold(pace) == pytest.approx(hold, abs=1e-12)


def test_the_prior_counts_until_a_prefill_is_measured() -> None:
    clock = Clock()
    pace = PrefillPace(clock=clock)
    pace.sent(2000, None)
    assert pace.backlog() == pytest.approx(2000 * PRIOR_PREFILL_SECONDS_PER_TOKEN)
    pace.sent(2000, 1e-6)
    assert pace.backlog() == pytest.approx(2000 * PRIOR_PREFILL_SECONDS_PER_TOKEN + 2000 * 1e-6)


def test_a_batch_request_waits_for_the_backlog_and_an_interactive_one_does_not() -> None:
    clock = Clock()
    ac = controller(clock, priority_pace=0.02)
    assert admitted(ac, BATCH)  # backlog 13.55 ms, under the pace
    assert admitted(ac, BATCH)  # 27.1 ms: the next batch request waits
    assert not admitted(ac, BATCH)
    assert admitted(ac, 0)  # priority 0 is never paced (its prompt adds: 40.65 ms)
    clock.now += 0.02  # 20.65 ms left: still over
    assert not admitted(ac, BATCH)
    clock.now += 0.001  # 19.65 ms: under
    assert admitted(ac, BATCH)


@pytest.mark.parametrize(
    "kw",
    [
        {"priority_pace": 0.0},  # off
        {"priority_pace": 0.02, "policy": Policy.reject},  # it would be refused, not paced
        {"priority_pace": 0.02, "policy": Policy.observe},  # nothing is held
    ],
    ids=["off", "reject", "observe"],
)
def test_not_paced(kw: dict[str, object]) -> None:
    clock = Clock()
    ac = controller(clock, **kw)
    assert all(admitted(ac, BATCH) for _ in range(7))  # every one the pool holds


async def test_a_paced_request_goes_when_the_backlog_has_drained() -> None:
    """Nothing else happens (no scrape, no answer ends): the queue is tried again on its own
    when the backlog is under the pace, on the event loop's clock."""
    ac = controller(time.monotonic, priority_pace=0.02)
    assert admitted(ac, BATCH) and admitted(ac, BATCH)
    ask = Ask(proj(), streamed=True, priority=BATCH)
    assert ac.try_admit(ask) is None  # queued
    started = time.monotonic()
    decision = await asyncio.wait_for(ac.wait(ask), timeout=10)
    assert decision.admitted
    # the backlog was 27.1 ms with a pace of 20 ms: it waited about 7 ms, not for a timeout
    assert time.monotonic() - started >= 2 * COST - 0.02 - 0.001
