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
- Not bounded by the trajectories (only requests that have not started yet stand in its way, and
  they are held at their worst, never freed): counted as long, refused.
- Cold (no decode step time measured yet in a pool: a vLLM that has generated no token since it
  started; the first scrape after it has takes the mean of its inter-token latency histogram):
  queued. Steps cannot be turned into seconds, and a guess of the step time would be off by 10x
  between a CPU and a GPU; queueing is what ``--policy queue`` would do, and refusing would send
  a fresh fleet's first burst round the gateway on no evidence.

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
from collections.abc import Sequence
from dataclasses import dataclass


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
