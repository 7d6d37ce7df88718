"""``--policy spill``: queue a request whose expected wait here is short, refuse one whose wait is
long at once.

Between ``queue`` (every request that does not fit waits here, however long) and ``reject``
(every one is refused at once): behind a gateway that retries another replica on 429 (nginx's
``proxy_next_upstream http_429``, the ingress overlay in ``deploy/``), a request that would wait
long here is better refused before it queues, so that the gateway finds the replica with room;
one that would wait a moment is better queued than sent round the fleet.

The expected wait is the Retry-After planner's (``sidecar.admission.retry``): the decode steps
until the request fits behind the requests already queued (the queue is FIFO, so its wait is at
least theirs: they are taken to start with it), as the trajectories of the requests in flight
say they end, times the learned decode step time. Refused requests booked for later are left out:
a request queued now is served before any of them that comes back. The shortest wait over the
pools the request may run in is the one judged (data-parallel engines).

- Known and at most ``--spill-wait`` seconds: queued (up to ``--max-queue-wait``, as under
  ``--policy queue``).
- Known and longer: refused at once with 429 ``spilled`` and the planner's Retry-After.
- Not bounded by the trajectories (it fits only into an empty pool; requests admitted and not
  started yet are laid out as starting now, ``sidecar.kv.rows``): counted as long, refused.
- Cold (no decode step time measured yet in a pool: a vLLM that has generated no token since it
  started; the first scrape after it has takes the mean of its inter-token latency histogram):
  queued. Steps cannot be turned into seconds, and a guess of the step time would be off by 10x
  between a CPU and a GPU; queueing is what ``--policy queue`` would do, and refusing would send
  a fresh fleet's first burst round the gateway on no evidence.

A queued request is judged again each time the queue is tried (after every scrape and every
release, :func:`hand_back`), by the same estimate, with the requests queued before it (not
those after it) ahead: the in-flight requests may run longer than their class's answers
usually do, the step time may grow, a better priority may queue ahead of it. One whose wait is
now over :data:`REJUDGE_MARGIN` more than ``--spill-wait`` is handed back: refused with
``spilled`` and a Retry-After, as it would have been at arrival, so that the gateway retries it
on another replica; it has not reached vLLM, nothing is lost. Never the request the queue tries
next (its wait is the in-flight requests' alone, and it would hand its place to the one behind
it), and never on a cold pool (:func:`judge` queues then).

The status of a ``spilled`` refusal is 429, or 503 with ``--spill-status 503`` for a gateway
that retries a 503 but not a 429 (HAProxy 2.6); ``sidecar.admission.decisions.refusal_of``.

>>> judge([Estimate(steps=40, seconds_per_step=0.02)], threshold=2.0).queue
True
>>> judge([Estimate(steps=400, seconds_per_step=0.02)], threshold=2.0).wait_seconds
8.0
>>> judge([Estimate(steps=None, seconds_per_step=0.02)], threshold=2.0).queue
False
>>> judge([Estimate(steps=400, seconds_per_step=None)], threshold=2.0).queue
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar.admission.decisions import Reason

if TYPE_CHECKING:
    from sidecar.admission.ask import Ask
    from sidecar.admission.queue import Waiter, WaitQueue

#: How much longer than ``--spill-wait`` a queued request's expected wait must be before it is
#: handed back: half again. It was queued because its wait was at most the threshold, and an
#: estimate moves without the wait having grown: the step time is a moving average of each
#: scrape interval's (weight 0.3), so one interval whose steps take twice as long (a burst of
#: prefills) moves it, and every wait, by 30%; the likely ends of the in-flight requests move as
#: answers are learned. Handing back a request for such a move would send it round the fleet,
#: behind the requests queued there, for nothing. A wait half again over the threshold is more
#: than one noisy interval. Not measured: a reasoned choice, as the threshold itself.
REJUDGE_MARGIN = 0.5


@dataclass(frozen=True, slots=True)
class Estimate:
    """One pool's expected wait for a request: decode steps (None: not bounded) and the pool's
    learned decode step time (None: cold)."""

    steps: int | None
    seconds_per_step: float | None

    @property
    def cold(self) -> bool:
        return self.seconds_per_step is None or self.seconds_per_step <= 0

    @property
    def seconds(self) -> float | None:
        """The wait in seconds; None when cold; infinite when not bounded."""
        if self.cold:
            return None
        if self.steps is None:
            return math.inf
        assert self.seconds_per_step is not None
        return self.steps * self.seconds_per_step


@dataclass(frozen=True, slots=True)
class Verdict:
    queue: bool  # wait here; else refuse at once (429 spilled)
    wait_seconds: float | None  # the shortest known wait (inf: not bounded; None: cold)
    message: str = ""


def judge(estimates: Sequence[Estimate], *, threshold: float) -> Verdict:
    """Queue unless every pool's wait is known and over ``threshold`` seconds."""
    known = [e.seconds for e in estimates if not e.cold]
    wait = min((s for s in known if s is not None), default=None)
    if not known or len(known) < len(estimates):  # a pool is cold: its wait cannot be told
        return Verdict(True, wait)
    if wait is not None and wait <= threshold:
        return Verdict(True, wait)
    said = "cannot be bounded" if wait is None or math.isinf(wait) else f"is {wait:.1f}s"
    return Verdict(
        False,
        wait,
        f"the KV cache is full and the expected wait for room here {said}, over the "
        f"{threshold:g}s this replica queues for (--spill-wait); retry another replica or "
        "after Retry-After",
    )


def first_token(estimates: Sequence[Estimate], *, prefill_seconds: float, target: float) -> Verdict:
    """``--ttft-target``: queue unless every pool's wait is known and the wait plus the prefill
    is over ``target`` seconds (cold: queued, as :func:`judge`).

    >>> first_token([Estimate(100, 0.02)], prefill_seconds=0.5, target=3.0).queue
    True
    >>> first_token([Estimate(100, 0.02)], prefill_seconds=1.5, target=3.0).message[:40]
    'its first token is expected in 3.5s (2.0'
    """
    verdict = judge(estimates, threshold=target - prefill_seconds)
    if verdict.queue:
        return verdict
    wait = verdict.wait_seconds
    said = (
        "cannot be expected soon: the wait for KV room cannot be bounded"
        if wait is None or math.isinf(wait)
        else f"is expected in {wait + prefill_seconds:.1f}s ({wait:.1f}s waiting for KV room, "
        f"{prefill_seconds:.1f}s of prefill)"
    )
    return Verdict(
        False,
        wait,
        f"its first token {said}; the objective is {target:g}s (--ttft-target); retry "
        "after Retry-After or on another replica",
    )


def hand_back(
    queue: WaitQueue,
    waits: Callable[[Ask, int], Sequence[Estimate]],
    *,
    threshold: float,
    margin: float = REJUDGE_MARGIN,
) -> list[Waiter]:
    """Refuse (``WaitQueue.shed``, reason ``spilled``) the queued requests whose expected wait
    now (``waits(ask, seq)``: each pool's, with the requests queued before it ahead) is over
    ``threshold`` x (1 + ``margin``), but for the one the queue tries next; the ones refused.

    Each tenant's line is judged from its newest waiter back and left at the first that may
    stay: a waiter's wait is at least that of any before it in its line (those are ahead of it
    too, and a plan with more requests in it fits no sooner), so the rest may stay too. A try
    that hands nothing back costs one estimate per line."""
    bar = threshold * (1 + margin)
    first = queue.next_waiter()
    out: list[Waiter] = []
    for line in queue.lines():
        for waiter in reversed(line):
            if waiter is first:
                break
            if waiter.future.done():
                continue  # leaving in this very tick
            verdict = judge(waits(waiter.ask, waiter.seq), threshold=bar)
            if verdict.queue:
                break
            wait = verdict.wait_seconds
            said = (
                "cannot be bounded now"
                if wait is None or math.isinf(wait)
                else f"is now {wait:.1f}s"
            )
            queue.shed(
                waiter,
                Reason.SPILLED,
                f"queued here, the expected wait for room in the KV cache {said}, over the "
                f"{threshold:g}s this replica queues for (--spill-wait) by more than "
                f"{margin:.0%}; handed back before vLLM saw it: retry another replica or after "
                "Retry-After",
            )
            out.append(waiter)
    return out
