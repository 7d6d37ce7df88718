"""The KV pools admission places requests in: one per vLLM engine, and their figures summed.

Data-parallel vLLM (``--data-parallel-size N`` in one server) runs N engines, each with its own
KV pool: there is one :class:`Pool` (ledger, engine view, Retry-After planner) per engine, and the
controller admits a request into the pool it fits best (the most room left), then the proxy pins
it there with vLLM's ``X-data-parallel-rank`` header, which its chat, completions and messages
endpoints honour (``_get_data_parallel_rank`` in ``entrypoints/generate/base/serving.py``).
Without the pin vLLM 0.32 picks the engine with the lowest score
(``DPLBAsyncMPClient.get_core_engine_for_request``): its waiting plus running requests (the
coordinator's counts, or the API server's own in-flight count to it if higher), plus, when
requests wait there, ``6 * (kv_cache_usage - 0.5)`` per waiting request once the engine's KV usage
(blocks allocated) is above 50 %. That penalises a queue on a full engine but never weighs the
request's own need against the room each engine has left: hence the pin, and a request that
cannot be pinned (``/v1/responses``) is reserved in every pool; a client's own pin is kept.

:class:`Pools` keeps the set in step with vLLM's engines (known from the first scrape; a pool
whose engine is gone is retired, kept until its requests end), finds the pool a reservation
lives in, and sums the pools' figures for the exporter and /state (each pool's peak comes at its
own time, so a sum of peaks is an upper bound over several pools).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.admission.ask import KVState
from sidecar.admission.ends import Ends
from sidecar.admission.engine_view import EngineView
from sidecar.admission.fit import PoolState, budget_blocks, committed_blocks, in_flight_peak
from sidecar.admission.learner import runs_to_max
from sidecar.admission.pacing import PrefillPace
from sidecar.admission.retry import RetryPlanner
from sidecar.config import ReservationMode
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.blocks import BlockMath
from sidecar.kv.ledger import Ledger, Reservation

log = logging.getLogger("sidecar.admission")


@dataclass(eq=False)
class Pool:
    """One engine's KV pool: its ledger, vLLM's figures for it, its Retry-After planner."""

    engine: str  # vLLM's ``engine`` label ("" when vLLM runs one engine)
    ledger: Ledger
    view: EngineView
    retry: RetryPlanner
    pace: PrefillPace  # the prefill backlog forwarded to it (``--priority-pace``)


def pool_state(pool: Pool, stale: bool) -> PoolState:
    """What the fit test may use of vLLM's figures for ``pool``."""
    view = pool.view
    return PoolState(view.capacity_blocks, view.used_now_blocks(), view.external_blocks, stale)


class Pools:
    """The pools of vLLM's engines (:attr:`live`, in vLLM's order) and of engines gone."""

    def __init__(self, ledger: Ledger, *, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._roofline: tuple[int, int] | None = None  # weights, KV block bytes (configure())
        #: one pool per engine; the list is changed in place (the controller's ``pools`` is it)
        self.live: list[Pool] = [self._new("", ledger)]
        self.retired: dict[str, Pool] = {}  # pools of engines gone, until their requests end

    def _new(self, engine: str, ledger: Ledger) -> Pool:
        clock = self._clock
        view = EngineView(ledger)
        view.costs.roofline(*(self._roofline or (None, None)))
        return Pool(
            engine,
            ledger,
            view,
            RetryPlanner(ledger, clock=clock),
            PrefillPace(clock=clock),
        )

    def configure(
        self,
        blocks: BlockMath,
        *,
        share_prefixes: bool,
        roofline: tuple[int, int] | None = None,
    ) -> None:
        """vLLM's block geometry and prefix caching, and where known the model's weight bytes
        and a KV block's (the costs' roofline: ``EngineCosts.roofline``), for every pool (at
        discovery)."""
        self._roofline = roofline
        for pool in self.live:
            pool.ledger.blocks = blocks
            pool.ledger.share_prefixes = share_prefixes
            pool.view.costs.roofline(*(roofline or (None, None)))

    def update(self, snap: EngineSnapshot) -> float:
        """Take a fresh scrape of vLLM (re-pooling if its engines changed); the preemptions
        vLLM made since the last one."""
        parts = snap.pools
        if [part.engine for part in parts] != [pool.engine for pool in self.live]:
            self._repool([part.engine for part in parts])
        return sum(pool.view.update(part) for pool, part in zip(self.live, parts, strict=True))

    def revise(self, reserving: Ends, kept: Callable[[Reservation], bool]) -> int:
        """Lower the ends of the requests in flight that adaptive mode would reserve less now
        (``Ends.revised``), in every pool, but those ``kept`` says to keep; how many."""
        if reserving.mode is not ReservationMode.adaptive:
            return 0
        revised = 0
        for pool in self.live:
            ledger, costs = pool.ledger, pool.view.costs
            for res in ledger.whole(runs_to_max):
                ends = None if kept(res) else reserving.revised(res, costs, len(ledger))
                if ends is not None:
                    ledger.revise(res, ends)
                    revised += 1
        return revised

    def _repool(self, engines: list[str]) -> None:
        """vLLM's engines are not the pools' (the first scrape of a data-parallel vLLM):
        one pool per engine, keeping the pools of engines still there."""
        first = self.live[0].ledger
        kept = {pool.engine: pool for pool in self.live}
        pools = []
        for engine in engines:
            pool = kept.pop(engine, None)
            if pool is None:
                ledger = Ledger(
                    first.blocks, share_prefixes=first.share_prefixes, clock=self._clock
                )
                pool = self._new(engine, ledger)
            pools.append(pool)
        for engine, pool in kept.items():
            if len(pool.ledger):
                self.retired[engine] = pool
        self.live[:] = pools
        log.info("vLLM runs %d engines, each with its own KV pool", len(pools))

    def pool_of(self, res: Reservation) -> Pool:
        """The pool ``res`` (or a shadow of it) is reserved in."""
        for pool in self.live:
            if pool.engine == res.engine:
                return pool
        return self.retired[res.engine]

    def release(self, res: Reservation) -> None:
        """Free ``res`` and its shadows in their pools; a retired pool left empty goes."""
        for one in (res, *res.shadows):
            pool = self.pool_of(one)
            pool.ledger.release(one)
            if not len(pool.ledger) and self.retired.get(one.engine) is pool:
                del self.retired[one.engine]

    # --- the figures, summed over the pools ----------------------------------------------------

    @property
    def capacity_blocks(self) -> int | None:
        capacities = [pool.view.capacity_blocks for pool in self.live]
        return None if None in capacities else sum(c for c in capacities if c is not None)

    @property
    def external_blocks(self) -> int:
        return sum(pool.view.external_blocks for pool in self.live)

    @property
    def preemptions_seen(self) -> float:
        return sum(pool.view.preemptions_seen for pool in (*self.live, *self.retired.values()))

    @property
    def in_flight(self) -> int:
        return sum(len(pool.ledger) for pool in self.live) + sum(
            len(pool.ledger) for pool in self.retired.values()
        )

    def budget_blocks(self, headroom: float) -> int | None:
        """The blocks admission may promise, in all the pools."""
        budgets = [budget_blocks(p.view.capacity_blocks, headroom) for p in self.live]
        return None if None in budgets else sum(b for b in budgets if b is not None)

    def future_peak_blocks(self, *, worst_case: bool = False) -> int:
        return sum(in_flight_peak(p.ledger, worst_case=worst_case) for p in self.live)

    def committed_blocks(self, stale: bool) -> int:
        return sum(
            committed_blocks(in_flight_peak(p.ledger), pool_state(p, stale)) for p in self.live
        )

    def predicted_at_snapshot(self) -> int | None:
        """The blocks the ledgers predicted vLLM held at its last scrape (None until every pool
        has one)."""
        predicted: int | None = 0
        for pool in self.live:
            at = pool.view.at_snapshot
            if at is None or predicted is None:
                predicted = None
            else:
                predicted += at[0]
        return predicted

    def state(
        self,
        snap: EngineSnapshot | None,
        *,
        stale: bool,
        worst_case: bool,
        headroom: float,
        queued_peak_blocks: int,
        queue_depth: int,
        reserving: Ends,
    ) -> KVState:
        """The figures summed over the pools, with the queue's, and the first pool's costs and
        what ``reserving`` reserves per class with them."""
        costs = self.live[0].view.costs.figures()
        peak = committed = worst = reserved = predicted = shared = peaks = in_flight = 0
        at_predicted: int | None = 0
        at_in_flight = 0
        for pool in self.live:
            ledger = pool.ledger
            pool_peak = in_flight_peak(ledger)
            peak += pool_peak
            worst += pool_peak if worst_case else in_flight_peak(ledger, worst_case=True)
            committed += committed_blocks(pool_peak, pool_state(pool, stale))
            reserved += ledger.reserved_blocks
            predicted += ledger.predicted_blocks
            shared += ledger.shared_blocks_now()
            peaks += ledger.peak_blocks
            in_flight += len(ledger)
            at = pool.view.at_snapshot
            if at is None or at_predicted is None:
                at_predicted = None
            else:
                at_predicted += at[0]
                at_in_flight += at[1]
        return KVState(
            capacity_blocks=self.capacity_blocks,
            budget_blocks=self.budget_blocks(headroom),
            reserved_blocks=reserved,
            future_peak_blocks=peak,
            worst_case_peak_blocks=worst,
            predicted_blocks=predicted,
            shared_blocks=shared,
            actual_blocks=snap.used_blocks if snap is not None else None,
            external_blocks=self.external_blocks,
            committed_blocks=committed,
            peak_blocks_in_flight=peaks,
            peak_blocks_queued=queued_peak_blocks,
            in_flight=in_flight,
            queue_depth=queue_depth,
            snapshot_age=snap.age(self._clock()) if snap is not None else None,
            predicted_at_snapshot_blocks=at_predicted,
            in_flight_at_snapshot=at_in_flight,
            preemptions_seen=self.preemptions_seen,
            expected_output_tokens=reserving.per_class(self.live[0].view.costs),
            decode_step_seconds=costs.decode_step_seconds,
            step_seconds_per_token=costs.step_seconds_per_token,
            step_seconds_per_sequence=costs.step_seconds_per_sequence,
            prefill_tokens_per_step=costs.prefill_tokens_per_step,
            step_fixed_share=costs.fixed_share,
            batch_gain_steps_per_token=costs.gain_steps_per_token,
            prefill_backlog_seconds=sum(pool.pace.backlog() for pool in self.live),
            stream_lag_tokens=max(pool.ledger.lag_tokens() for pool in self.live),
        )
