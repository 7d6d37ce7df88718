"""The fit test: does a candidate fit in one pool beside the requests in flight? Pure.

Functions of the in-flight set (a :class:`~sidecar.kv.ledger.Ledger`), the candidate (a
:class:`~sidecar.kv.ledger.Reservation` not in it yet) and the engine's state for that pool
(:class:`PoolState`, staleness included), as LightLLM's ``_can_add_new_req`` is one function of
its running batch. No clock, no I/O: the controller builds the :class:`PoolState` and decides
what to do with the answer.

What is checked (``sidecar.kv.trajectory`` for the peak):

- the **budget**: the pool's capacity less ``headroom``; unknown capacity admits (vLLM alone
  judges until the first scrape);
- the **commitment**: the peak over the future of the in-flight trajectories plus the
  candidate's, plus what vLLM holds beyond the ledger (traffic that bypasses the sidecar), and
  at least what vLLM holds now plus the candidate's prompt. On stale engine figures only the
  ledger counts (fail-open on the engine, never on the ledger).
- in strict (worst-case) mode, where the trajectories are laid out, the blocks their streams
  may hold beyond where they were seen, as far behind vLLM as streams were lately
  (``sidecar.kv.lag``);
- the sum of the reserved peaks bounds the future peak from above in strict (worst-case) mode,
  and in the others while no request in flight has run past its reserved end: when even that
  fits, the trajectories need not be laid out.
- a request whose reservation alone is over the budget (or the pool: the controller refuses one
  whose single sequence is over it), or whose estimated (upper-bound) prompt is, runs only into
  an empty pool.

>>> from sidecar.kv.geometry import UniformBlocks
>>> from sidecar.kv.ledger import Ledger
>>> from sidecar.kv.projection import project_counts
>>> ledger = Ledger(UniformBlocks(16))
>>> ask = project_counts((64,), requested_max_tokens=64, n=1, max_model_len=1024,
...                      blocks=UniformBlocks(16))
>>> pool = PoolState(capacity_blocks=10, used_blocks=0, external_blocks=0, stale=False)
>>> fits(ledger, ledger.candidate(ask, streamed=True), pool, headroom=0.0, strict=True)
True
>>> ledger.reserve(ask, streamed=True).reserved_blocks
8
>>> fits(ledger, ledger.candidate(ask, streamed=True), pool, headroom=0.0, strict=True)
False
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

from sidecar.admission.costs import EngineCosts
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.spread import spread_peak
from sidecar.kv.trajectory import future_peak

#: sequences with learned lengths (the candidate's included) the spread ends need before they
#: are asked: fewer end too unevenly for a normal sum (tests/test_spread.py: 4 sequences passed
#: the 0.95 figure in up to 15% of draws, 16 in under 1%)
SPREAD_MIN_SEQUENCES = 16
#: steps a request admitted but not started yet may wait for vLLM to start it, for the spread
#: ends (it is counted alive that much longer, holding as much as if it started now)
SPREAD_START_SLACK = 32
_NORMAL = NormalDist()


class PoolState(NamedTuple):
    """What vLLM reported for one pool, as admission may use it now (a named tuple: one is built
    per decision, and a frozen dataclass costs three times as much to build)."""

    capacity_blocks: int | None  # None: not known yet
    used_blocks: int | None  # what vLLM holds now (None: not reported)
    external_blocks: int  # what vLLM holds beyond the ledger's prediction
    stale: bool  # the figures are too old to mean anything (only the ledger counts)


def budget_blocks(capacity_blocks: int | None, headroom: float) -> int | None:
    """The blocks admission may promise out of ``capacity_blocks``.

    >>> budget_blocks(1000, 0.05), budget_blocks(None, 0.05)
    (950, None)
    """
    if capacity_blocks is None:
        return None
    return math.floor(capacity_blocks * (1.0 - headroom))


def committed_blocks(peak_blocks: int, pool: PoolState, *, prompt_blocks: int = 0) -> int:
    """``peak_blocks`` (of the ledger, the candidate's included where it is one) with what vLLM
    holds beyond the ledger, and at least what vLLM holds now plus ``prompt_blocks`` (a
    candidate's prompt, which vLLM allocates at once).

    >>> committed_blocks(10, PoolState(100, used_blocks=30, external_blocks=2, stale=False))
    30
    >>> committed_blocks(10, PoolState(100, used_blocks=30, external_blocks=2, stale=True))
    10
    """
    if pool.stale:
        return peak_blocks
    committed = peak_blocks + pool.external_blocks
    if pool.used_blocks is not None:
        committed = max(committed, pool.used_blocks + prompt_blocks)
    return committed


def in_flight_peak(ledger: Ledger, *extra: Reservation, worst_case: bool = False) -> int:
    """The most blocks the ledger's requests (and ``extra``) can hold at once from now."""
    return ledger.peak_with(*extra, worst_case=worst_case)


def fits(
    ledger: Ledger,
    candidate: Reservation,
    pool: PoolState,
    *,
    headroom: float,
    strict: bool,
    reserve_blocks: int = 0,
    risked: bool = False,
    averaged: bool = False,
) -> bool:
    """Whether ``candidate`` fits in the pool now (``strict``: worst-case mode, where every
    request runs to its reserved end and no further; ``reserve_blocks``: blocks of the budget
    the candidate may not take, kept for better priorities, none into an empty pool;
    ``risked``: the candidate is admitted as vLLM admits, :func:`fits_now`; ``averaged``: it
    may also be admitted where the trajectories' means fit, :func:`mean_fits`)."""
    full = budget_blocks(pool.capacity_blocks, headroom)
    if full is None:
        return True  # nothing known yet (fail-open start-up): vLLM is the only judge
    budget = full if len(ledger) == 0 else full - max(0, reserve_blocks)
    prompt = candidate.projection.prompt_blocks
    exact = candidate.projection.exact
    if risked and exact:
        return fits_now(ledger, candidate, pool, budget)
    if averaged and exact and not strict and mean_fits(ledger, candidate, pool, budget):
        return True
    if exact and (strict or ledger.overruns == 0):
        # in worst-case mode always; in the others while no answer has run past its reserved end
        # (one that has is expected to grow beyond what it reserved)
        bound = ledger.reserved_blocks + candidate.reserved_blocks
        if committed_blocks(bound, pool, prompt_blocks=prompt) <= budget:
            return True
    # a request over the budget runs when nothing else does: within the pool vLLM runs it alone
    # without a preemption, and the headroom must not make a request that vLLM serves
    # unrunnable (a chat without max_tokens reaches the whole context, which a pool sized for
    # one context holds, but not 95% of it); over the pool with each of its sequences within
    # it (the controller refuses one over it), vLLM serves it too, its sequences preempting
    # one another only if together they outgrow the pool; an upper-bound estimated prompt
    # likewise
    alone = (
        candidate.reserved_blocks
        if exact
        else future_peak(ledger.trajectories([candidate], in_flight=False), ledger.blocks)
    )
    if alone > full:
        sequence = candidate.projection.sequence_peak_blocks
        if exact and pool.capacity_blocks is not None and sequence > pool.capacity_blocks:
            return False
        return len(ledger) == 0 and pool.external_blocks == 0
    # the kept bounds first, coarse then fine: while streams advance they settle most decisions
    # without a pass over the profile or a rebuild; in strict mode, which promises no
    # preemption, plus what the streams may hold beyond where they were seen, as far behind
    # vLLM as streams were lately (the other modes lay out learned ends, and take that risk)
    lag = ledger.lag_blocks() if strict else 0
    for coarse in (True, False):
        least, most = ledger.peak_bounds(candidate, coarse=coarse)
        if committed_blocks(most + lag, pool, prompt_blocks=prompt) <= budget:
            return True
        if committed_blocks(least + lag, pool, prompt_blocks=prompt) > budget:
            return False
    peak = in_flight_peak(ledger, candidate)
    return committed_blocks(peak + lag, pool, prompt_blocks=prompt) <= budget


def mean_fits(ledger: Ledger, candidate: Reservation, pool: PoolState, budget: int) -> bool:
    """Whether the requests in flight and the candidate fit the budget each at the mean of the
    rest of its trajectory (halfway between what it holds now, its prompt for one not started,
    and its reserved peak), and the candidate's prompt fits beside what vLLM holds now. For
    requests of known lengths whose recompute is cheap (``Ends.averaged``): vLLM may preempt
    some near their peaks. Never while an answer has run past its reserved end (its mean is
    unknown). Cases in tests/test_fit.py.
    """
    if ledger.overruns:
        return False
    prompt = candidate.projection.prompt_blocks
    now = ledger.predicted_blocks + ledger.unstarted_prompt_blocks + prompt
    mean = math.ceil((now + ledger.reserved_blocks + candidate.reserved_blocks) / 2)
    return committed_blocks(mean, pool, prompt_blocks=prompt) <= budget


def spread_fits(
    ledger: Ledger,
    candidate: Reservation,
    pool: PoolState,
    windows: Sequence[Sequence[int]],
    window_of: Callable[[str], int],
    *,
    headroom: float,
    quantile: float,
    reserve_blocks: int = 0,
) -> bool:
    """Adaptive mode's second opinion, where :func:`fits` refused: whether the candidate fits
    with every answer in flight ending where its class's learned lengths spread it
    (``sidecar.kv.spread``, at ``quantile`` of the demand) rather than all at their reserved
    ends at once; ``windows``: each class's sorted lengths, ``window_of``: a class's index
    among them (-1: none, laid out to its reserved end). Never into an empty pool (:func:`fits`
    judges that), on stale figures, or with fewer than :data:`SPREAD_MIN_SEQUENCES` sequences
    whose ends are spread."""
    full = budget_blocks(pool.capacity_blocks, headroom)
    if full is None or pool.stale or len(ledger) == 0 or not candidate.projection.exact:
        return False
    rows = ledger.spread_rows(window_of, candidate)
    if int(rows.weight[rows.window >= 0].sum()) < SPREAD_MIN_SEQUENCES:
        return False
    arrays = [np.asarray(w, dtype=np.int64) for w in windows]
    z = _NORMAL.inv_cdf(quantile)
    peak = spread_peak(rows, arrays, ledger.blocks, z=z, start_slack=SPREAD_START_SLACK)
    # the spread rows hold a decoding sequence's state groups at one block: add the crossings
    peak += ledger.crossing_blocks()
    budget = full - max(0, reserve_blocks)
    return committed_blocks(peak, pool, prompt_blocks=candidate.projection.prompt_blocks) <= budget


def held_now_blocks(ledger: Ledger, pool: PoolState) -> int:
    """What the pool holds now and what the requests admitted but not started will take at
    once: the ledger's started requests at their size now, or vLLM's own figure where it is
    higher (on fresh figures; what vLLM holds beyond the ledger counts too), and the admitted
    requests' prompts.

    >>> from sidecar.kv.geometry import UniformBlocks
    >>> held_now_blocks(Ledger(UniformBlocks(16)), PoolState(100, 30, 0, stale=False))
    30
    """
    held = ledger.predicted_blocks
    if not pool.stale:
        held += pool.external_blocks
        if pool.used_blocks is not None:
            held = max(held, pool.used_blocks)
    return held + ledger.unstarted_prompt_blocks


#: requests admitted as vLLM admits (``risked``) may wait in vLLM's own queue while fewer than
#: this many sequences admitted by the sidecar have not started there: a request waiting in vLLM
#: holds no block, and vLLM starts it the moment its prompt fits, where one held here reaches
#: vLLM only after the sidecar sees room and sends it (a scrape, a release, the relay and vLLM's
#: own rendering later). Without it, on the CPU engine, chats without max_tokens on a pool of
#: 31 blocks ran behind the sidecar with idle gaps between a release and the next admission.
PRIMED_SEQUENCES = 4


def fits_now(ledger: Ledger, candidate: Reservation, pool: PoolState, budget: int) -> bool:
    """vLLM's own admission: the candidate's prompt fits beside what the pool holds now
    (:func:`held_now_blocks`), or few requests the sidecar admitted wait for vLLM to start them
    (:data:`PRIMED_SEQUENCES`: vLLM then starts it when its prompt fits, by that same rule). No
    future is laid out: adaptive mode admits so a request whose batch gain pays even for a
    certain recompute (``sidecar.admission.ends``), as vLLM admits every request."""
    if ledger.unstarted_sequences + candidate.projection.sequences <= PRIMED_SEQUENCES:
        return True
    return held_now_blocks(ledger, pool) + candidate.projection.prompt_blocks <= budget


def room_blocks(ledger: Ledger, pool: PoolState, *, headroom: float) -> int:
    """The blocks still promisable in the pool (negative when over-committed); where a request
    is best placed among several pools."""
    budget = budget_blocks(pool.capacity_blocks, headroom) or 0
    return budget - committed_blocks(in_flight_peak(ledger), pool)


def keeps_step_target(
    costs: EngineCosts,
    ledger: Ledger,
    candidate: Reservation,
    *,
    running: int,
    target_seconds: float,
) -> bool:
    """Whether a decode step stays within ``target_seconds`` with the candidate's sequences
    added to the batch: vLLM's ``running`` at the last scrape, at least the sidecar's own
    started sequences (those that started since the scrape are not in vLLM's count yet: without
    this floor, requests admitted and started between two scrapes were never counted, and the
    target held nothing back until the next one), and the ledger's requests not started yet. An
    empty batch always takes a request, and an unknown step time holds nothing back."""
    batch = max(running, ledger.started_sequences) + ledger.unstarted_sequences
    if batch == 0:
        return True
    step = costs.step_seconds(batch + candidate.projection.sequences)
    return step is None or step <= target_seconds
