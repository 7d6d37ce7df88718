"""How long a request that does not fit now would wait, per pool: the Retry-After told with a
refusal, and the expected wait that ``--policy spill`` and ``--ttft-target`` judge.

Both are the pool's Retry-After planner's (``sidecar.admission.retry``) over the request's
candidate in that pool and those of the requests queued beside it (``ahead``): the decode steps
until the request fits, as the in-flight trajectories say they end, times the learned decode
step time. Without a measured step time a Retry-After falls back to the pool's recent release
rate: the blocks the request lacks over the blocks freed per second (or half the mean hold, or
2 s, while nothing has been freed yet). The controller chooses the pools and builds the
candidates; these are functions of one pool, no clock of their own.
"""

from __future__ import annotations

from collections.abc import Callable

from sidecar.admission.costs import EngineCosts
from sidecar.admission.fit import budget_blocks, in_flight_peak
from sidecar.admission.pools import Pool
from sidecar.admission.spill import Estimate
from sidecar.kv.ledger import Reservation
from sidecar.kv.projection import Projection

#: the learner's likely end of a class's answers, as the planner takes it
Likely = Callable[[str], int | None]


def retry_in(
    pool: Pool,
    candidate: Reservation,
    ahead: list[Reservation],
    *,
    headroom: float,
    book: bool,
    key: int | None,
    likely: Likely,
) -> float:
    """Seconds until ``candidate`` would fit in ``pool`` behind ``ahead``; ``book``: the slot
    is booked there (``RetryPlanner.plan``)."""
    return pool.retry.plan(
        candidate,
        ahead=ahead,
        budget_blocks=budget_blocks(pool.view.capacity_blocks, headroom),
        external_blocks=pool.view.external_blocks,
        seconds_per_step=pool.view.seconds_per_step,
        fallback=lambda: release_rate_estimate(pool, candidate, ahead, headroom=headroom),
        book=book,
        key=key,
        likely=likely,
    )


def expected_wait(
    pool: Pool, candidate: Reservation, ahead: list[Reservation], *, budget: int, likely: Likely
) -> Estimate:
    """``candidate``'s expected wait in ``pool`` if queued now behind ``ahead``: the decode
    steps until it fits (``RetryPlanner.wait_steps``) and the pool's step time."""
    steps = pool.retry.wait_steps(
        candidate,
        ahead=ahead,
        budget_blocks=budget,
        external_blocks=pool.view.external_blocks,
        likely=likely,
    )
    return Estimate(steps, pool.view.seconds_per_step)


def release_rate_estimate(
    pool: Pool, candidate: Reservation, ahead: list[Reservation], *, headroom: float
) -> float:
    """Seconds until ``pool`` frees what ``candidate`` lacks, at its recent release rate."""
    budget = budget_blocks(pool.view.capacity_blocks, headroom) or 0
    need = in_flight_peak(pool.ledger, *ahead, candidate) + pool.view.external_blocks
    deficit = max(1, need - budget)
    rate = pool.ledger.freed_blocks_per_second()
    if rate > 0:
        return deficit / rate
    hold = pool.ledger.mean_hold_seconds
    return hold / 2 if hold is not None else 2.0


def prefill_seconds(costs: EngineCosts, projection: Projection) -> float:
    """The request's prefill by the learned step model (its prompts' tokens x what a prompt
    token adds to a step; 0 until that is measured)."""
    per_token = costs.prefill_seconds_per_token()
    return 0.0 if per_token is None else sum(projection.prompt_tokens) * per_token
