"""``--priority-pace`` in the pure core: requests of a positive priority forwarded no faster than
vLLM prefills them (``sidecar.admission.pacing``), requests of priority 0 never held by it.

The pool is 64 blocks of 128 tokens (a budget of 63, no headroom); each request of 271 prompt
and 700 output tokens reaches 8 blocks, so 7 fit: the KV pool never holds anything back before
the third request here. No prefill and no decode step are measured, so each prompt costs the
priors: 271 tokens and a decode step of 1,024 tokens' worth at 5e-5 s a token, 64.75 ms."""

from __future__ import annotations

import asyncio
import time

import pytest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.costs import PRIOR_PREFILL_TOKENS_PER_STEP
from sidecar.admission.pacing import PRIOR_PREFILL_SECONDS_PER_TOKEN, PrefillPace
from sidecar.config import Policy
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.projection import Projection, project_counts
from tests.support.snapshots import Clock, snapshot

BLOCKS = UniformBlocks(128)
PROMPT = 271
COST = (PROMPT + PRIOR_PREFILL_TOKENS_PER_STEP) * PRIOR_PREFILL_SECONDS_PER_TOKEN  # 64.75 ms
PACE = 0.1
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


def admit(ac: AdmissionController, priority: int, *, streamed: bool = True) -> Reservation:
    decision = ac.try_admit(Ask(proj(), streamed=streamed, priority=priority))
    assert decision is not None and decision.reservation is not None
    return decision.reservation


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
    pace_.sent(1000, sent_seconds / 1000, None)
    clock.now += elapsed
    assert pace_.hold(pace) == pytest.approx(hold, abs=1e-12)


def test_the_priors_count_until_a_prefill_is_measured() -> None:
    clock = Clock()
    pace = PrefillPace(clock=clock)
    prior = PRIOR_PREFILL_SECONDS_PER_TOKEN
    pace.sent(2000, None, None)  # the prompt and a step of 1,024 tokens at the prior
    assert pace.backlog() == pytest.approx((2000 + PRIOR_PREFILL_TOKENS_PER_STEP) * prior)
    pace.sent(2000, None, 0.01)  # a measured decode step, no prefill measured yet
    assert pace.backlog() == pytest.approx((4000 + PRIOR_PREFILL_TOKENS_PER_STEP) * prior + 0.01)
    pace.sent(2000, 1e-6, 0.01)  # a measured prefill: its steps are in it
    assert pace.backlog() == pytest.approx(
        (4000 + PRIOR_PREFILL_TOKENS_PER_STEP) * prior + 0.01 + 2000 * 1e-6
    )


def test_a_batch_request_waits_for_the_backlog_and_an_interactive_one_does_not() -> None:
    clock = Clock()
    ac = controller(clock, priority_pace=PACE)
    assert admitted(ac, BATCH)  # backlog 64.75 ms, under the pace
    assert admitted(ac, BATCH)  # 129.5 ms: the next batch request waits
    assert not admitted(ac, BATCH)
    chat = admit(ac, 0)  # priority 0 is never paced (its prompt adds: 194.25 ms)
    ac.started(chat)  # its first token (until then it holds the batch: below)
    clock.now += 0.094  # 100.25 ms left: still over
    assert not admitted(ac, BATCH)
    clock.now += 0.001  # 99.25 ms: under
    assert admitted(ac, BATCH)


@pytest.mark.parametrize(
    "kw",
    [
        {"priority_pace": 0.0},  # off
        {"priority_pace": PACE, "policy": Policy.reject},  # it would be refused, not paced
        {"priority_pace": PACE, "policy": Policy.observe},  # nothing is held
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
    ac = controller(time.monotonic, priority_pace=PACE)
    assert admitted(ac, BATCH) and admitted(ac, BATCH)
    ask = Ask(proj(), streamed=True, priority=BATCH)
    assert ac.try_admit(ask) is None  # queued
    started = time.monotonic()
    decision = await asyncio.wait_for(ac.wait(ask), timeout=10)
    assert decision.admitted
    # the backlog was 129.5 ms with a pace of 100 ms: it waited about 30 ms, not for a timeout
    assert time.monotonic() - started >= 2 * COST - PACE - 0.001


@pytest.mark.parametrize("first", ["started", "released"])
def test_a_batch_request_waits_for_an_interactive_requests_first_token(first: str) -> None:
    """With no backlog left (its prompt's prefill presumed done by the clock), a streamed
    request of priority 0 still awaiting its first token holds the batch class back: a batch
    prompt sent now would be prefilled in the same steps as its prompt."""
    clock = Clock()
    ac = controller(clock, priority_pace=PACE)
    chat = admit(ac, 0)
    clock.now += 10.0  # the backlog has long drained
    assert not admitted(ac, BATCH)
    other = admit(ac, -1)  # priority 0 and better are never held
    ac.started(other)
    assert not admitted(ac, BATCH)  # the first one still awaits its first token
    ac.started(chat) if first == "started" else ac.release(chat)
    assert admitted(ac, BATCH)
    ac.started(chat)  # a later chunk of it, or a chunk after its end: counted once
    ac.release(chat)
    clock.now += 10.0
    assert admitted(ac, BATCH)  # nothing awaited: counted off once


@pytest.mark.parametrize(
    ("kw", "streamed", "priority"),
    [
        ({"priority_pace": PACE}, False, 0),  # its first token is not seen: it holds nothing
        ({"priority_pace": PACE}, True, 5),  # a batch request holds no other
        ({"priority_pace": 0.0}, True, 0),  # not paced
    ],
    ids=["not-streamed", "batch", "off"],
)
def test_what_holds_nothing(kw: dict[str, object], streamed: bool, priority: int) -> None:
    clock = Clock()
    ac = controller(clock, **kw)
    admit(ac, priority, streamed=streamed)
    clock.now += 10.0
    assert admitted(ac, BATCH)


async def test_a_paced_request_goes_when_the_first_token_comes() -> None:
    """Nothing else happens (no scrape, no answer ends): the interactive request's first token
    tries the queue again."""
    ac = controller(time.monotonic, priority_pace=PACE)
    chat = admit(ac, 0)
    ask = Ask(proj(), streamed=True, priority=BATCH)
    assert ac.try_admit(ask) is None  # queued
    waiting = asyncio.ensure_future(ac.wait(ask))
    await asyncio.sleep(0.3)  # the backlog (64.75 ms) has drained: the first token holds it
    assert not waiting.done()
    ac.started(chat)
    decision = await asyncio.wait_for(waiting, timeout=10)
    assert decision.admitted
