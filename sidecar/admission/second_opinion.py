"""Adaptive mode's second opinion: a placement the laid-out future peak refused, judged again
with the in-flight answers' ends spread over their learned lengths (``sidecar.kv.spread``,
``sidecar.admission.fit.spread_fits``).

It costs a pass over every sequence in flight (some 11 ms at 4,000, where the laid-out checks
take microseconds), so it is rationed: a refusal stands for :data:`RECHECK_SECONDS` while the
pool's requests and the candidate stay the same (only progress changed), and its computations
together take at most :data:`CPU_SHARE` of the time, with a burst of :data:`BURST_SECONDS`
(a token bucket on the process's clock): past that the laid-out peak alone decides, as before.
Not asked while vLLM's preemptions widen the ends (the learner's boost), in the other modes,
or for a request whose length is known (``ignore_eos``) or that is reserved from the floor
already (``Ends.spread_quantile``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sidecar.admission.ends import Ends
from sidecar.admission.fit import PoolState, spread_fits
from sidecar.admission.learner import LengthLearner
from sidecar.admission.pools import Pool
from sidecar.kv.ledger import Reservation

log = logging.getLogger("sidecar.admission")

#: how long a refusal stands while nothing but progress changed (seconds of the controller's clock)
RECHECK_SECONDS = 0.05
#: the share of the process's time the second opinions may take, on average ...
CPU_SHARE = 0.1
#: ... and at once (seconds)
BURST_SECONDS = 0.05


class SecondOpinion:
    """The spread ends' judgement for one controller, with its ration and its count."""

    def __init__(
        self,
        learner: LengthLearner,
        reserving: Ends,
        *,
        clock: Callable[[], float],
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.learner = learner
        self.reserving = reserving
        self._clock = clock
        self._timer = timer
        self._refused: dict[str, tuple[float, tuple[int, int, int, int]]] = {}
        self._credit = BURST_SECONDS
        self._credit_at = timer()
        self.admitted = 0  # placements it allowed where the laid-out peak did not

    def fits(
        self,
        pool: Pool,
        candidate: Reservation,
        state: PoolState,
        *,
        headroom: float,
        reserve_blocks: int,
        priority: int,
    ) -> bool:
        if self.learner.boost:
            return False
        p = candidate.projection
        costs = pool.view.costs
        batch = len(pool.ledger) + 1  # the batch it would join, as its end was chosen
        quantiles = [
            self.reserving.spread_quantile(candidate.klass, prompt, m, costs, batch)
            for prompt, m in zip(p.prompt_tokens, p.max_tokens, strict=True)
        ]
        chosen = [q for q in quantiles if q is not None]
        if len(chosen) < len(quantiles):
            return False
        ledger = pool.ledger
        key = (len(ledger), ledger.started_sequences, candidate.reserved_blocks, priority)
        now = self._clock()
        refused = self._refused.get(pool.engine)
        if refused is not None and refused[1] == key and now - refused[0] < RECHECK_SECONDS:
            return False
        t0 = self._timer()
        self._credit = min(BURST_SECONDS, self._credit + (t0 - self._credit_at) * CPU_SHARE)
        self._credit_at = t0
        if self._credit <= 0:
            return False
        windows, window_of = self.learner.spread_windows()
        try:
            ok = spread_fits(
                ledger,
                candidate,
                state,
                windows,
                window_of,
                headroom=headroom,
                quantile=max(chosen),
                reserve_blocks=reserve_blocks,
            )
        except (ArithmeticError, ValueError):  # a figure it cannot judge: the peak decides
            log.exception("the spread ends' second opinion failed; the laid-out peak decides")
            ok = False
        t1 = self._timer()
        self._credit -= t1 - t0
        self._credit_at = t1
        if ok:
            self._refused.pop(pool.engine, None)
            self.admitted += 1
        else:
            self._refused[pool.engine] = (now, key)
        return ok
