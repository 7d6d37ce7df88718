"""Admission: forward now, queue, or refuse, against the KV budget.

The controller keeps the queue, the waiting and the bookkeeping; whether a request fits is
``sidecar.admission.fit`` (pure functions of the in-flight ledger, the candidate and the pool's
state). The budget is the blocks vLLM can hand out (from its ``/metrics``) less ``--headroom``.
What a request needs is judged the way vLLM spends KV (``sidecar.kv.trajectory``): the peak, over
the future, of the in-flight requests' trajectories plus the candidate's, each running to its
reserved end (``max_tokens`` in worst-case mode, a learned length in expected mode, a length
quantile chosen by the recompute's cost in adaptive mode) and freeing its blocks when it ends,
with shared prompt blocks counted once. Added to it is whatever vLLM holds beyond the ledger's
prediction (traffic that bypasses the sidecar); and the candidate's prompt must fit beside what
vLLM reports taken now; with ``--tpot-target``, the batch with it must keep vLLM's decode step
within the target. A request that fits is admitted; otherwise,
by policy, it is refused with 429 at once (``reject``), waits in a FIFO queue (``queue``; only
the head may be admitted, so a large request is not starved by small ones behind it) that is
re-evaluated on every release and every scrape, or waits there only if its expected wait is
short (``spill``, ``sidecar.admission.spill``). A refusal's Retry-After is when the trajectories
say the request would fit (``sidecar.admission.retry``).

Data-parallel vLLM (``--data-parallel-size N`` in one server) runs N engines, each with its own
KV pool: the controller keeps one :class:`Pool` (ledger, engine view, Retry-After planner) per
engine and admits a request into the pool it fits best (the most room left), then the proxy
pins it there with vLLM's ``X-data-parallel-rank`` header, which its chat, completions and
messages endpoints honour (``_get_data_parallel_rank`` in ``entrypoints/generate/base/
serving.py``). Without the pin vLLM 0.32 picks the engine with the lowest score
(``DPLBAsyncMPClient.get_core_engine_for_request``): its waiting plus running requests (the
coordinator's counts, or the API server's own in-flight count to it if higher), plus, when
requests wait there, ``6 * (kv_cache_usage - 0.5)`` per waiting request once the engine's KV usage
(blocks allocated) is above 50 %. That penalises a queue on a full engine but never weighs the
request's own need against the room each engine has left: hence the pin, and a request that
cannot be pinned (``/v1/responses``) is reserved in every pool; a client's own pin is kept.

Outcomes are values (:class:`Decision`), not exceptions; ``sidecar.http.refusals`` maps them
to HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.admission.ask import Ask, KVState
from sidecar.admission.costs import EngineCosts
from sidecar.admission.decisions import Decision, Outcome, Reason
from sidecar.admission.ends import Ends
from sidecar.admission.engine_view import EngineView
from sidecar.admission.fit import (
    PoolState,
    budget_blocks,
    committed_blocks,
    fits,
    in_flight_peak,
    keeps_step_target,
    room_blocks,
)
from sidecar.admission.learner import LengthLearner
from sidecar.admission.retry import MIN_RETRY_AFTER, RetryPlanner
from sidecar.admission.spill import Estimate, first_token, judge
from sidecar.config import Policy, ReservationMode, StalePolicy
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.blocks import BlockMath
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.projection import Projection

log = logging.getLogger("sidecar.admission")


@dataclass(eq=False)
class Pool:
    """One engine's KV pool: its ledger, vLLM's figures for it, its Retry-After planner."""

    engine: str  # vLLM's ``engine`` label ("" when vLLM runs one engine)
    ledger: Ledger
    view: EngineView
    retry: RetryPlanner


@dataclass(eq=False)
class _Waiter:
    ask: Ask
    enqueued_at: float
    future: asyncio.Future[Reservation] = field(repr=False)
    timer: asyncio.TimerHandle = field(repr=False)  # ends its wait (tuning.py moves it)
    shed: tuple[Reason, str] | None = None  # its refusal, when not queue_timeout (tuning.py)


class AdmissionController:
    """Decides, queues and releases. All methods run on the event loop; none blocks."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        policy: Policy = Policy.queue,
        headroom: float = 0.05,
        max_queue_depth: int = 256,
        max_queue_wait: float = 300.0,
        spill_wait: float = 2.0,
        reservation: ReservationMode = ReservationMode.worst_case,
        expected_quantile: float = 0.95,
        expected_prior: float = 1.0,
        risk_steps: float = 1.0,
        tpot_target: float | None = None,
        ttft_target: float | None = None,
        stale_after: float = 5.0,
        stale_policy: StalePolicy = StalePolicy.open,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = Policy(policy)
        self.headroom = headroom
        self.max_queue_depth = max_queue_depth
        self.max_queue_wait = max_queue_wait
        self.spill_wait = spill_wait  # --policy spill: the longest expected wait queued
        self.stale_after = stale_after
        self.stale_policy = StalePolicy(stale_policy)
        self.learner = LengthLearner(expected_quantile, prior=expected_prior, clock=clock)
        self.reserving = Ends(ReservationMode(reservation), self.learner, risk_steps=risk_steps)
        self.tpot_target = tpot_target  # seconds per decode step the running requests keep
        self.ttft_target = ttft_target  # seconds to a first token a queued request may expect
        self._held_by_latency = False  # the last placement failed on the step time alone
        self._clock = clock
        self.pools: list[Pool] = [self._new_pool("", ledger)]
        self._retired: dict[str, Pool] = {}  # pools of engines gone, until their requests end
        self._queue: deque[_Waiter] = deque()
        self._queued_peak_blocks = 0
        self._snapshot: EngineSnapshot | None = None
        self.draining = False

    def _new_pool(self, engine: str, ledger: Ledger) -> Pool:
        return Pool(engine, ledger, EngineView(ledger), RetryPlanner(ledger, clock=self._clock))

    @property
    def reservation_mode(self) -> ReservationMode:
        return self.reserving.mode

    @reservation_mode.setter
    def reservation_mode(self, mode: ReservationMode) -> None:
        self.reserving.mode = ReservationMode(mode)

    @property
    def ledger(self) -> Ledger:
        """The first pool's ledger: the only one unless vLLM runs data-parallel engines."""
        return self.pools[0].ledger

    def configure(self, blocks: BlockMath, *, share_prefixes: bool) -> None:
        """vLLM's block geometry and prefix caching, for every pool (at discovery)."""
        for pool in self.pools:
            pool.ledger.blocks = blocks
            pool.ledger.share_prefixes = share_prefixes

    def _pool_of(self, res: Reservation) -> Pool:
        for pool in self.pools:
            if pool.engine == res.engine:
                return pool
        return self._retired[res.engine]

    # --- the engine's view -------------------------------------------------------------------

    @property
    def snapshot(self) -> EngineSnapshot | None:
        return self._snapshot

    @property
    def capacity_blocks(self) -> int | None:
        capacities = [pool.view.capacity_blocks for pool in self.pools]
        return None if None in capacities else sum(c for c in capacities if c is not None)

    @property
    def external_blocks(self) -> int:
        return sum(pool.view.external_blocks for pool in self.pools)

    @property
    def queued_peak_blocks(self) -> int:
        """The projected peaks of the requests waiting in the queue (read by the HAProxy agent)."""
        return self._queued_peak_blocks

    @property
    def preemptions_seen(self) -> float:
        return sum(pool.view.preemptions_seen for pool in (*self.pools, *self._retired.values()))

    @property
    def in_flight(self) -> int:
        return sum(len(pool.ledger) for pool in self.pools) + sum(
            len(pool.ledger) for pool in self._retired.values()
        )

    def on_snapshot(self, snap: EngineSnapshot) -> None:
        """Reconcile with a fresh scrape of vLLM, then re-evaluate the queue."""
        self._snapshot = snap
        parts = snap.pools
        if [part.engine for part in parts] != [pool.engine for pool in self.pools]:
            self._repool([part.engine for part in parts])
        preempted = sum(
            pool.view.update(part) for pool, part in zip(self.pools, parts, strict=True)
        )
        if self.reservation_mode is not ReservationMode.worst_case and snap.generation_lengths:
            if self.learner.seed(
                snap.generation_lengths,
                total_tokens=snap.generation_lengths_sum,
                at_length=snap.answers_at_length,
                stopped=snap.answers_stopped,
            ):
                log.info(
                    "answer lengths: %d taken from vLLM's history (vllm:request_generation_tokens)",
                    self.learner.seeded,
                )
        if preempted and self.reservation_mode is not ReservationMode.worst_case:
            self.learner.tighten()
            log.warning("vLLM preempted; expected-mode reservations tightened")
        self.pump()

    def _repool(self, engines: list[str]) -> None:
        """vLLM's engines are not the pools' (the first scrape of a data-parallel vLLM):
        one pool per engine, keeping the pools of engines still there."""
        first = self.pools[0].ledger
        kept = {pool.engine: pool for pool in self.pools}
        pools = []
        for engine in engines:
            pool = kept.pop(engine, None)
            if pool is None:
                ledger = Ledger(
                    first.blocks, share_prefixes=first.share_prefixes, clock=self._clock
                )
                pool = self._new_pool(engine, ledger)
            pools.append(pool)
        for engine, pool in kept.items():
            if len(pool.ledger):
                self._retired[engine] = pool
        self.pools = pools
        log.info("vLLM runs %d engines, each with its own KV pool", len(pools))

    def is_stale(self) -> bool:
        snap = self._snapshot
        return snap is None or snap.age(self._clock()) > self.stale_after

    def _state(self, pool: Pool, stale: bool) -> PoolState:
        """What the fit test may use of vLLM's figures for ``pool``."""
        view = pool.view
        used = view.snapshot.used_blocks if view.snapshot is not None else None
        return PoolState(view.capacity_blocks, used, view.external_blocks, stale)

    # --- the budget, summed over the pools (each pool's peak comes at its own time) -----------

    def budget_blocks(self) -> int | None:
        """The blocks admission may promise, in all the pools."""
        budgets = [budget_blocks(p.view.capacity_blocks, self.headroom) for p in self.pools]
        return None if None in budgets else sum(b for b in budgets if b is not None)

    def future_peak_blocks(self, *, worst_case: bool = False) -> int:
        """The most blocks the requests in flight can hold at once from now (an upper bound
        over several pools)."""
        return sum(in_flight_peak(p.ledger, worst_case=worst_case) for p in self.pools)

    def committed_blocks(self) -> int:
        """Blocks spoken for in all the pools (``sidecar.admission.fit.committed_blocks``)."""
        stale = self.is_stale()
        return sum(
            committed_blocks(in_flight_peak(p.ledger), self._state(p, stale)) for p in self.pools
        )

    def ends(
        self, projection: Projection, klass: str = "", costs: EngineCosts | None = None
    ) -> tuple[int, ...]:
        """Output tokens to reserve per sequence, per prompt, in the configured mode
        (``sidecar.admission.ends``; ``costs``: the engine's, the first pool's when not given)."""
        engine = costs if costs is not None else self.pools[0].view.costs
        return tuple(
            self.reserving.end(klass, p, m, engine)
            for p, m in zip(projection.prompt_tokens, projection.max_tokens, strict=True)
        )

    def _fits(self, pool: Pool, candidate: Reservation, stale: bool) -> bool:
        if not fits(
            pool.ledger,
            candidate,
            self._state(pool, stale),
            headroom=self.headroom,
            strict=self.reservation_mode is ReservationMode.worst_case,
        ):
            return False
        if self.tpot_target is not None:
            running = pool.view.snapshot.running if pool.view.snapshot is not None else 0
            if not keeps_step_target(
                pool.view.costs,
                pool.ledger,
                candidate,
                running=running,
                target_seconds=self.tpot_target,
            ):
                self._held_by_latency = True
                return False
        return True

    # --- placing ----------------------------------------------------------------------------

    def _candidate(self, pool: Pool, ask: Ask) -> Reservation:
        return pool.ledger.candidate(
            ask.projection,
            streamed=ask.streamed,
            ends=self.ends(ask.projection, ask.klass, pool.view.costs),
            prefix=ask.prefix,
            klass=ask.klass,
        )

    def _open(self, ask: Ask) -> list[Pool]:
        """The pools the request may run in: the one its client pinned, else all."""
        if ask.pin is not None:
            return [p for p in self.pools if p.engine == ask.pin] or self.pools[:1]
        return self.pools

    def _eligible(self, ask: Ask, stale: bool) -> list[Pool]:
        """:meth:`_open`, the one with the most room first (vLLM's coordinator spreads load the
        same way)."""
        if ask.pin is not None or len(self.pools) == 1:
            return self._open(ask)
        return sorted(
            self.pools,
            key=lambda p: room_blocks(p.ledger, self._state(p, stale), headroom=self.headroom),
            reverse=True,
        )

    def _place(self, ask: Ask) -> tuple[Pool, Reservation, list[tuple[Pool, Reservation]]] | None:
        """The pool (and candidate) the request fits in now, with its shadows (an unpinnable
        request on several engines must fit in every pool); None when it fits nowhere."""
        stale = self.is_stale()
        self._held_by_latency = False
        pools = self._eligible(ask, stale)
        if ask.pin is None and not ask.pinnable and len(pools) > 1:
            placed = [(p, self._candidate(p, ask)) for p in pools]
            if all(self._fits(p, c, stale) for p, c in placed):
                return placed[0][0], placed[0][1], placed[1:]
            return None
        for pool in pools:
            candidate = self._candidate(pool, ask)
            if self._fits(pool, candidate, stale):
                return pool, candidate, []
        return None

    def _admit(
        self,
        pool: Pool,
        candidate: Reservation,
        shadows: list[tuple[Pool, Reservation]],
        key: int | None = None,
    ) -> Reservation:
        pool.retry.admitted(key)
        res = pool.ledger.add(candidate)
        res.engine = pool.engine
        for other, shadow in shadows:
            other.ledger.add(shadow).engine = other.engine
            res.shadows.append(shadow)
        return res

    def _refuse(self, reason: Reason, message: str, ask: Ask, waited: float = 0.0) -> Decision:
        return Decision(
            Outcome.REJECT,
            reason,
            retry_after=self.retry_after(ask),
            message=message,
            waited_seconds=waited,
        )

    @staticmethod
    def _draining_refusal(waited: float = 0.0) -> Decision:
        return Decision(
            Outcome.REJECT,
            Reason.DRAINING,
            retry_after=MIN_RETRY_AFTER,
            message="the sidecar is shutting down; retry on another replica",
            waited_seconds=waited,
        )

    # --- deciding ---------------------------------------------------------------------------

    def try_admit(self, ask: Ask) -> Decision | None:
        """Decide at once; None means "queue it" (the caller then awaits :meth:`wait`)."""
        if self.draining:
            return self._draining_refusal()
        stale = self.is_stale()
        if stale and self.stale_policy is StalePolicy.closed:
            return Decision(
                Outcome.REJECT,
                Reason.STALE_CLOSED,
                retry_after=MIN_RETRY_AFTER,
                message="vLLM's metrics are stale; refusing (stale policy closed)",
            )
        if self.policy is Policy.observe:
            # dry run: account for everything, gate nothing
            placed = None if self._queue else self._place(ask)
            if placed is None:
                pool = self._eligible(ask, stale)[0]
                return Decision(
                    Outcome.ADMIT,
                    Reason.OBSERVED,
                    reservation=self._admit(pool, self._candidate(pool, ask), []),
                )
            return Decision(Outcome.ADMIT, Reason.FITS, reservation=self._admit(*placed, ask.key))
        projection = ask.projection
        budgets = [budget_blocks(p.view.capacity_blocks, self.headroom) for p in self._open(ask)]
        budget = None if None in budgets else max(b for b in budgets if b is not None)
        if budget is not None and projection.exact and projection.peak_blocks > budget:
            return Decision(
                Outcome.REJECT,
                Reason.TOO_LARGE,
                message=(
                    f"this request can reach {projection.peak_blocks} KV blocks "
                    f"({projection.peak_tokens} tokens) but the KV budget is {budget} blocks"
                    + (" per engine" if len(self.pools) > 1 else "")
                    + "; it can never run: lower max_tokens, n or the prompt"
                ),
            )
        if not self._queue and (placed := self._place(ask)) is not None:
            reason = Reason.STALE_OPEN if stale else Reason.FITS
            return Decision(Outcome.ADMIT, reason, reservation=self._admit(*placed, ask.key))
        if self.policy is Policy.reject:
            if self._held_by_latency and not self._queue:
                return self._refuse(
                    Reason.LATENCY_TARGET,
                    "a larger batch would miss the decode-step target (--tpot-target); retry later",
                    ask,
                )
            return self._refuse(Reason.KV_CACHE_FULL, "the KV cache is full; retry later", ask)
        if self.policy is Policy.spill:
            verdict = judge(self.expected_waits(ask), threshold=self.spill_wait)
            if not verdict.queue:
                return self._refuse(Reason.SPILLED, verdict.message, ask)
        if self.ttft_target is not None:
            verdict = first_token(
                self.expected_waits(ask),
                prefill_seconds=self._prefill_seconds(ask),
                target=self.ttft_target,
            )
            if not verdict.queue:
                return self._refuse(Reason.TTFT_TARGET, verdict.message, ask)
        if len(self._queue) >= self.max_queue_depth:
            return self._refuse(Reason.QUEUE_FULL, "the admission queue is full; retry later", ask)
        return None

    async def wait(self, ask: Ask, cancelled: asyncio.Event | None = None) -> Decision:
        """Queue a request until it fits, its wait runs out, or ``cancelled`` is set."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        waiter = _Waiter(ask, self._clock(), fut, loop.call_later(self.max_queue_wait, fut.cancel))
        self._queue.append(waiter)
        self._queued_peak_blocks += ask.projection.peak_blocks
        watch: asyncio.Task[bool] | None = (
            asyncio.ensure_future(cancelled.wait()) if cancelled is not None else None
        )
        try:
            waitables: set[asyncio.Future[Any]] = {waiter.future}
            if watch is not None:
                waitables.add(watch)
            await asyncio.wait(waitables, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.timer.cancel()
            if watch is not None:
                watch.cancel()
            self._leave(waiter)
        waited = self._clock() - waiter.enqueued_at
        if waiter.future.done() and not waiter.future.cancelled():
            return Decision(
                Outcome.ADMIT,
                Reason.QUEUED,
                reservation=waiter.future.result(),
                waited_seconds=waited,
            )
        if cancelled is not None and cancelled.is_set():
            return Decision(Outcome.CANCEL, Reason.CLIENT_DISCONNECT, waited_seconds=waited)
        if self.draining:
            return self._draining_refusal(waited)
        said = f"waited {waited:.1f}s for KV cache without room; retry later"
        reason, message = waiter.shed or (Reason.QUEUE_TIMEOUT, said)
        return self._refuse(reason, message, ask, waited)

    def _leave(self, waiter: _Waiter) -> None:
        """Remove a waiter that is done waiting; an admission it missed is handed back."""
        if waiter in self._queue:
            self._queue.remove(waiter)
            self._queued_peak_blocks -= waiter.ask.projection.peak_blocks
            if not waiter.future.done():
                waiter.future.cancel()
            self.pump()  # the head may have changed

    def pump(self) -> None:
        """Admit queued requests from the head while they fit (draining too: queued requests
        that can still start do; the rest wait out their deadline). Candidates are made afresh
        each time: the learned lengths and the pools' room move while a request waits."""
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # its waiter gave up in this very tick
                self._queue.popleft()
                self._queued_peak_blocks -= head.ask.projection.peak_blocks
                continue
            if self.stale_policy is StalePolicy.closed and self.is_stale():
                return  # wait for fresh engine data (or the deadline)
            placed = self._place(head.ask)
            if placed is None:
                return
            self._queue.popleft()
            self._queued_peak_blocks -= head.ask.projection.peak_blocks
            head.future.set_result(self._admit(*placed, head.ask.key))

    def started(self, res: Reservation) -> None:
        """vLLM holds the request's prompt now (its first token came, or it was handed over)."""
        self._pool_of(res).ledger.start(res)
        for shadow in res.shadows:
            self._pool_of(shadow).ledger.start(shadow)

    def progressed(self, res: Reservation, generated_per_sequence: float) -> None:
        """The request has generated this many tokens per sequence."""
        self._pool_of(res).ledger.advance(res, generated_per_sequence)
        for shadow in res.shadows:
            self._pool_of(shadow).ledger.advance(shadow, generated_per_sequence)

    def release(self, res: Reservation, completion_tokens: int | None = None) -> None:
        """The request is over (answered, failed or abandoned). Idempotent. ``completion_tokens``:
        the answer's length, when it ended naturally (what the expected-mode learner learns)."""
        if res.released:
            return
        if completion_tokens is not None:
            per_sequence = completion_tokens // max(res.projection.sequences, 1)
            at_max = per_sequence >= min(res.projection.max_tokens, default=0)
            self.learner.observe(res.klass, per_sequence, at_max=at_max)
        for one in (res, *res.shadows):
            pool = self._pool_of(one)
            pool.ledger.release(one)
            if not len(pool.ledger) and self._retired.get(one.engine) is pool:
                del self._retired[one.engine]
        self.pump()

    # --- Retry-After ------------------------------------------------------------------------

    def retry_after(self, ask: Ask) -> float:
        """Seconds until the request would fit, from the trajectories (or, without a measured
        step time, from the recent release rate): the soonest pool's, booked there."""
        pools = self._eligible(ask, self.is_stale())
        if len(pools) == 1:
            return self._retry_in(pools[0], ask, book=True)
        soonest = min(pools, key=lambda p: self._retry_in(p, ask, book=False))
        return self._retry_in(soonest, ask, book=True)

    def _retry_in(self, pool: Pool, ask: Ask, *, book: bool) -> float:
        candidate = self._candidate(pool, ask)
        ahead = [self._candidate(pool, w.ask) for w in self._queue if w.ask is not ask]
        return pool.retry.plan(
            candidate,
            ahead=ahead,
            budget_blocks=budget_blocks(pool.view.capacity_blocks, self.headroom),
            external_blocks=pool.view.external_blocks,
            seconds_per_step=pool.view.seconds_per_step,
            fallback=lambda: self._release_rate_estimate(pool, candidate, ahead),
            book=book,
            key=ask.key,
            likely=self.learner.likely,
        )

    def _prefill_seconds(self, ask: Ask) -> float:
        """The request's prefill by the learned step line (its prompts' tokens x the line's
        slope; 0 until the line is measured)."""
        line = self.pools[0].view.costs.line()
        return 0.0 if line is None else sum(ask.projection.prompt_tokens) * line[1]

    def expected_waits(self, ask: Ask) -> list[Estimate]:
        """Per pool the request may run in, its expected wait if queued now: the decode steps
        until it fits behind the queue (``RetryPlanner.wait_steps``) and the step time."""
        estimates = []
        for pool in self._eligible(ask, self.is_stale()):
            budget = budget_blocks(pool.view.capacity_blocks, self.headroom)
            if budget is None:  # the pool is not known yet: nothing to tell the wait by
                estimates.append(Estimate(None, None))
                continue
            steps = pool.retry.wait_steps(
                self._candidate(pool, ask),
                ahead=[self._candidate(pool, w.ask) for w in self._queue if w.ask is not ask],
                budget_blocks=budget,
                external_blocks=pool.view.external_blocks,
                likely=self.learner.likely,
            )
            estimates.append(Estimate(steps, pool.view.seconds_per_step))
        return estimates

    def _release_rate_estimate(
        self, pool: Pool, candidate: Reservation, ahead: list[Reservation]
    ) -> float:
        budget = budget_blocks(pool.view.capacity_blocks, self.headroom) or 0
        need = in_flight_peak(pool.ledger, *ahead, candidate) + pool.view.external_blocks
        deficit = max(1, need - budget)
        rate = pool.ledger.freed_blocks_per_second()
        if rate > 0:
            return deficit / rate
        hold = pool.ledger.mean_hold_seconds
        return hold / 2 if hold is not None else 2.0

    # --- state for the exporter ---------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def at_snapshot(self) -> tuple[int | None, int | None, int | None]:
        """What :meth:`state` reports of the last scrape of vLLM, without the peaks it computes
        over the ledger (the exporter reads this after every scrape): the blocks the ledger
        predicted vLLM held then (None until every pool has a scrape), the blocks vLLM reported
        then, and the capacity."""
        snap = self._snapshot
        predicted: int | None = 0
        for pool in self.pools:
            at = pool.view.at_snapshot
            if at is None or predicted is None:
                predicted = None
            else:
                predicted += at[0]
        actual = snap.used_blocks if snap is not None else None
        return predicted, actual, self.capacity_blocks

    def state(self) -> KVState:
        """The figures summed over the pools."""
        snap = self._snapshot
        stale = self.is_stale()
        costs = self.pools[0].view.costs.figures()
        worst_case = self.reservation_mode is ReservationMode.worst_case
        peak = committed = worst = reserved = predicted = shared = peaks = in_flight = 0
        at_predicted: int | None = 0
        at_in_flight = 0
        for pool in self.pools:
            ledger = pool.ledger
            pool_peak = in_flight_peak(ledger)
            peak += pool_peak
            worst += pool_peak if worst_case else in_flight_peak(ledger, worst_case=True)
            committed += committed_blocks(pool_peak, self._state(pool, stale))
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
            budget_blocks=self.budget_blocks(),
            reserved_blocks=reserved,
            future_peak_blocks=peak,
            worst_case_peak_blocks=worst,
            predicted_blocks=predicted,
            shared_blocks=shared,
            actual_blocks=snap.used_blocks if snap is not None else None,
            external_blocks=self.external_blocks,
            committed_blocks=committed,
            peak_blocks_in_flight=peaks,
            peak_blocks_queued=self._queued_peak_blocks,
            in_flight=in_flight,
            queue_depth=len(self._queue),
            snapshot_age=snap.age(self._clock()) if snap is not None else None,
            predicted_at_snapshot_blocks=at_predicted,
            in_flight_at_snapshot=at_in_flight,
            preemptions_seen=self.preemptions_seen,
            expected_output_tokens=self.reserving.per_class(self.pools[0].view.costs),
            decode_step_seconds=costs.decode_step_seconds,
            step_seconds_per_token=costs.step_seconds_per_token,
            prefill_tokens_per_step=costs.prefill_tokens_per_step,
            step_fixed_share=costs.fixed_share,
            batch_gain_steps_per_token=costs.gain_steps_per_token,
        )

    def fail_queue(self) -> None:
        """Wake every waiter (shutdown): they re-check and leave with their refusal."""
        for waiter in list(self._queue):
            if not waiter.future.done():
                waiter.future.cancel()
        self.pump()
