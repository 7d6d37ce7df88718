"""Admission: forward now, queue, or refuse, against the KV budget.

The controller decides, places and keeps the bookkeeping; whether a request fits is
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
by policy, it is refused with 429 at once (``reject``), waits in a FIFO queue (``queue``,
``sidecar.admission.queue``: only the head may be admitted, so a large request is not starved by
small ones behind it) that is re-evaluated on every release and every scrape, or waits there
only if its expected wait is short (``spill``, ``sidecar.admission.spill``). A refusal's
Retry-After is when the trajectories say the request would fit (``sidecar.admission.retry``,
``sidecar.admission.waits``).

Data-parallel vLLM runs one KV pool per engine (``sidecar.admission.pools``): a request is
admitted into the pool it fits best (the most room left) and pinned there with vLLM's
``X-data-parallel-rank`` header; one that cannot be pinned (``/v1/responses``) is reserved in
every pool, and a client's own pin is kept.

Outcomes are values (:class:`Decision`), not exceptions; ``sidecar.http.refusals`` maps them
to HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from sidecar.admission.ask import Ask, KVState
from sidecar.admission.class_stats import ClassStats
from sidecar.admission.costs import EngineCosts
from sidecar.admission.decisions import Decision, Outcome, Reason, draining
from sidecar.admission.ends import Ends
from sidecar.admission.fit import budget_blocks, fits, keeps_step_target, room_blocks
from sidecar.admission.learner import LengthLearner, runs_to_max
from sidecar.admission.pacing import PacedPools
from sidecar.admission.pools import Pool, Pools, pool_state
from sidecar.admission.queue import WaitQueue
from sidecar.admission.retry import MIN_RETRY_AFTER
from sidecar.admission.second_opinion import SecondOpinion
from sidecar.admission.spill import Estimate, first_token, hand_back, judge
from sidecar.admission.tenants import TenantUsage
from sidecar.admission.waits import expected_wait, prefill_seconds, retry_in
from sidecar.config import Policy, ReservationMode, StalePolicy
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.blocks import BlockMath
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.projection import Projection

log = logging.getLogger("sidecar.admission")

#: where a paced request waits in the queue (under reject it would be refused, under observe
#: nothing is held)
_PACED_POLICIES = frozenset({Policy.queue, Policy.spill})


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
        tenant_shares: dict[str, float] | None = None,
        tenant_max_share: float = 1.0,
        tenant_max_queue: int | None = None,
        priority_reserve: float = 0.0,
        priority_pace: float = 0.0,
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
        self._pools = Pools(ledger, clock=clock)
        self.pools: list[Pool] = self._pools.live  # one per engine (re-pooled in place)
        #: each tenant's use of the KV cache (the queue's fair share, ``--tenant-max-share``)
        self.tenants = TenantUsage(
            clock=clock,
            shares=tenant_shares,
            max_share=tenant_max_share,
            budget=self.budget_blocks,
        )
        self.tenant_max_queue = tenant_max_queue  # requests one tenant may have queued
        #: share of each pool's budget a request of a positive priority may not take
        #: (``--priority-reserve``), less what priority 0 and better hold there themselves
        self.priority_reserve = priority_reserve
        self._favoured: dict[str, int] = {}  # engine -> blocks reserved by priority <= 0
        #: seconds of prefill a request of a positive priority may find ahead of it in vLLM's
        #: queue (``--priority-pace``, ``sidecar.admission.pacing``; 0: not paced)
        self.pacing = PacedPools(priority_pace, self.pump, clock=clock)
        self._queue = WaitQueue(self._admit_head, clock=clock, tenants=self.tenants)
        self.class_stats = ClassStats()  # decisions and waits per priority and tenant
        self._snapshot: EngineSnapshot | None = None
        self.draining = False
        #: adaptive mode's second opinion where the laid-out peak refuses
        self.second_opinion = SecondOpinion(self.learner, self.reserving, clock=clock)

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

    def configure(
        self, blocks: BlockMath, *, share_prefixes: bool, roofline: tuple[int, int] | None = None
    ) -> None:
        """vLLM's block geometry, prefix caching and weight and KV block bytes, every pool's."""
        self._pools.configure(blocks, share_prefixes=share_prefixes, roofline=roofline)

    # --- the engine's view -------------------------------------------------------------------

    @property
    def snapshot(self) -> EngineSnapshot | None:
        return self._snapshot

    @property
    def capacity_blocks(self) -> int | None:
        return self._pools.capacity_blocks

    @property
    def external_blocks(self) -> int:
        return self._pools.external_blocks

    @property
    def queue(self) -> WaitQueue:
        """The waiting requests (read by ``sidecar.admission.tuning`` and the exporter)."""
        return self._queue

    @property
    def queued_peak_blocks(self) -> int:
        """The projected peaks of the requests waiting in the queue (read by the HAProxy agent)."""
        return self._queue.peak_blocks

    @property
    def preemptions_seen(self) -> float:
        return self._pools.preemptions_seen

    @property
    def in_flight(self) -> int:
        return self._pools.in_flight

    def on_snapshot(self, snap: EngineSnapshot) -> None:
        """Reconcile with a fresh scrape of vLLM, then re-evaluate the queue."""
        self._snapshot = snap
        preempted = self._pools.update(snap)
        # whole ignore_eos reservations the costs now say to risk, as they would be laid now
        self._pools.revise(self.reserving, lambda res: self._guarded(res.priority))
        if self.reservation_mode is not ReservationMode.worst_case and snap.generation_lengths:
            if self.learner.seed(
                snap.generation_lengths,
                total_tokens=snap.generation_lengths_sum,
                at_length=snap.answers_at_length,
                stopped=snap.answers_stopped,
            ):
                log.info("answer lengths: %d from vLLM's history", self.learner.seeded)
        if preempted and self.reservation_mode is not ReservationMode.worst_case:
            self.learner.tighten()
            log.warning("vLLM preempted; expected-mode reservations tightened")
        self.pump()

    def is_stale(self) -> bool:
        snap = self._snapshot
        return snap is None or snap.age(self._clock()) > self.stale_after

    # --- the budget, summed over the pools (each pool's peak comes at its own time) -----------

    def budget_blocks(self) -> int | None:
        """The blocks admission may promise, in all the pools."""
        return self._pools.budget_blocks(self.headroom)

    def future_peak_blocks(self, *, worst_case: bool = False) -> int:
        """The most blocks the requests in flight can hold at once from now (an upper bound
        over several pools)."""
        return self._pools.future_peak_blocks(worst_case=worst_case)

    def committed_blocks(self) -> int:
        """Blocks spoken for in all the pools (``sidecar.admission.fit.committed_blocks``)."""
        return self._pools.committed_blocks(self.is_stale())

    def ends(
        self,
        projection: Projection,
        klass: str = "",
        costs: EngineCosts | None = None,
        in_flight: int = 0,
    ) -> tuple[int, ...]:
        """Output tokens to reserve per sequence, per prompt, in the configured mode
        (``sidecar.admission.ends``; ``costs``: the engine's, the first pool's when not given;
        ``in_flight``: the requests already in flight beside it in its pool)."""
        engine = costs if costs is not None else self.pools[0].view.costs
        concurrency = in_flight + 1
        least = projection.min_tokens  # what the answer generates at least (min_tokens)
        return tuple(
            max(min(least, m), self.reserving.end(klass, p, m, engine, concurrency))
            for p, m in zip(projection.prompt_tokens, projection.max_tokens, strict=True)
        )

    def reserve_blocks(self, pool: Pool, priority: int) -> int:
        """Blocks of ``pool``'s budget a request of ``priority`` may not take: for a positive
        priority, ``--priority-reserve`` of the budget less what priority 0 and better reserve
        there now; none for the others."""
        if priority <= 0 or self.priority_reserve <= 0:
            return 0
        budget = budget_blocks(pool.view.capacity_blocks, self.headroom)
        if budget is None:
            return 0
        kept = int(budget * self.priority_reserve)
        return max(0, kept - self._favoured.get(pool.engine, 0))

    def _guarded(self, priority: int) -> bool:
        """Whether a request of ``priority`` stays out of ``--priority-reserve`` by its whole
        trajectory: admitted only where its laid-out future fits, an ``ignore_eos`` answer
        reserved to its ``max_tokens`` (admitted as vLLM admits, or from the floor, it grows
        into the reserve: README, Priority classes)."""
        return priority > 0 and self.priority_reserve > 0

    def _fits(self, pool: Pool, candidate: Reservation, stale: bool, priority: int = 0) -> bool:
        guarded = self._guarded(priority)
        risked, averaged = (False, False) if guarded else self._routes(pool, candidate)
        if not fits(
            pool.ledger,
            candidate,
            pool_state(pool, stale),
            headroom=self.headroom,
            strict=self.reservation_mode is ReservationMode.worst_case,
            reserve_blocks=self.reserve_blocks(pool, priority),
            risked=risked,
            averaged=averaged,
        ) and (risked or not self._second_opinion(pool, candidate, stale, priority)):
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

    def _second_opinion(
        self, pool: Pool, candidate: Reservation, stale: bool, priority: int
    ) -> bool:
        """The spread ends' judgement (``sidecar.admission.second_opinion``), adaptive mode's."""
        if self.reservation_mode is not ReservationMode.adaptive:
            return False
        return self.second_opinion.fits(
            pool,
            candidate,
            pool_state(pool, stale),
            headroom=self.headroom,
            reserve_blocks=self.reserve_blocks(pool, priority),
            priority=priority,
        )

    def _routes(self, pool: Pool, candidate: Reservation) -> tuple[bool, bool]:
        """Whether adaptive mode admits ``candidate`` as vLLM admits (``Ends.risked``: its
        batch gain pays even for a certain recompute), and else whether by its trajectory's
        mean (``Ends.averaged``: known lengths, a cheap recompute), every prompt of it."""
        costs, klass, p = pool.view.costs, candidate.klass, candidate.projection
        pairs = list(zip(p.prompt_tokens, p.max_tokens, strict=True))
        if all(self.reserving.risked(klass, n, m, costs) for n, m in pairs):
            return True, False
        batch = len(pool.ledger) + 1
        return False, all(self.reserving.averaged(klass, n, m, costs, batch) for n, m in pairs)

    # --- placing ----------------------------------------------------------------------------

    def _candidate(self, pool: Pool, ask: Ask) -> Reservation:
        ends = self.ends(ask.projection, ask.klass, pool.view.costs, len(pool.ledger))
        if self._guarded(ask.priority) and runs_to_max(ask.klass):
            ends = tuple(ask.projection.max_tokens)
        return pool.ledger.candidate(
            ask.projection,
            streamed=ask.streamed,
            ends=ends,
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
            key=lambda p: room_blocks(p.ledger, pool_state(p, stale), headroom=self.headroom),
            reverse=True,
        )

    def _place(
        self, ask: Ask, stale: bool | None = None
    ) -> tuple[Pool, Reservation, list[tuple[Pool, Reservation]]] | None:
        """The pool (and candidate) the request fits in now, with its shadows (an unpinnable
        request on several engines must fit in every pool); None when it fits nowhere
        (``stale``: :meth:`is_stale`, where the caller has it)."""
        if stale is None:
            stale = self.is_stale()
        self._held_by_latency = False
        if self.tenants.capped(ask.tenant):
            return None  # its tenant holds --tenant-max-share of the budget: others go first
        pools = self._eligible(ask, stale)
        paced = ask.priority > 0 and self.pacing.seconds > 0 and self.policy in _PACED_POLICIES
        if ask.pin is None and not ask.pinnable and len(pools) > 1:
            if paced and any(self.pacing.holds(p.pace) for p in pools):
                return None
            placed = [(p, self._candidate(p, ask)) for p in pools]
            if all(self._fits(p, c, stale, ask.priority) for p, c in placed):
                return placed[0][0], placed[0][1], placed[1:]
            return None
        for pool in pools:
            if paced and self.pacing.holds(pool.pace):
                continue
            candidate = self._candidate(pool, ask)
            if self._fits(pool, candidate, stale, ask.priority):
                return pool, candidate, []
        return None

    def _sent(self, pool: Pool, ask: Ask) -> None:
        """The request's prompts add to ``pool``'s prefill backlog (kept only while paced)."""
        if self.pacing.seconds > 0:
            costs = pool.view.costs
            per_token, step = costs.prompt_seconds_per_token(), costs.decode_step_seconds
            pool.pace.sent(ask.projection.prompt_total, per_token, step)

    def _admit(
        self,
        ask: Ask,
        pool: Pool,
        candidate: Reservation,
        shadows: list[tuple[Pool, Reservation]],
    ) -> Reservation:
        pool.retry.admitted(ask.key)
        self._sent(pool, ask)
        res = pool.ledger.add(candidate)
        res.engine = pool.engine
        res.tenant = ask.tenant
        res.tenant_blocks = res.reserved_blocks
        self.tenants.hold(ask.tenant, res.tenant_blocks)
        res.priority = ask.priority
        for other, shadow in shadows:
            other.ledger.add(shadow).engine = other.engine
            self._sent(other, ask)
            shadow.priority = ask.priority
            shadow.tenant_blocks = shadow.reserved_blocks
            res.shadows.append(shadow)
        awaited = self.pacing.awaited(res)
        if ask.priority <= 0:
            for one in (res, *res.shadows):
                self._favoured[one.engine] = self._favoured.get(one.engine, 0) + one.tenant_blocks
                if awaited:
                    self.pacing.favoured_sent(self._pools.pool_of(one).pace)
        return res

    def _refuse(self, reason: Reason, message: str, ask: Ask, waited: float = 0.0) -> Decision:
        return Decision(
            Outcome.REJECT,
            reason,
            retry_after=self.retry_after(ask),
            message=message,
            waited_seconds=waited,
        )

    # --- deciding ---------------------------------------------------------------------------

    def try_admit(self, ask: Ask) -> Decision | None:
        """Decide at once; None means "queue it" (the caller then awaits :meth:`wait`)."""
        decision = self._decide(ask)
        if decision is not None:
            self.class_stats.decided(ask.priority, ask.tenant, decision.outcome.value)
        return decision

    def _decide(self, ask: Ask) -> Decision | None:
        if self.draining:
            return draining()
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
            placed = None if self._queue.has_ahead(ask) else self._place(ask)
            if placed is None:
                pool = self._eligible(ask, stale)[0]
                return Decision(
                    Outcome.ADMIT,
                    Reason.OBSERVED,
                    reservation=self._admit(ask, pool, self._candidate(pool, ask), []),
                )
            return Decision(Outcome.ADMIT, Reason.FITS, reservation=self._admit(ask, *placed))
        projection = ask.projection
        # too large only where vLLM could not run it either: one sequence over the pool, not the
        # whole request (vLLM schedules each sequence of n and each prompt of a list on its own)
        # and not the budget (a request over either within the pool runs alone, fit.fits)
        if len(self.pools) == 1:
            capacity = self.pools[0].view.capacity_blocks
        else:
            capacities = [p.view.capacity_blocks for p in self._open(ask)]
            capacity = None if None in capacities else max(c for c in capacities if c is not None)
        if capacity is not None and projection.exact and projection.sequence_peak_blocks > capacity:
            return Decision(
                Outcome.REJECT,
                Reason.TOO_LARGE,
                message=(
                    f"one sequence of this request can reach {projection.sequence_peak_blocks} "
                    f"KV blocks but vLLM's KV cache holds {capacity} blocks"
                    + (" per engine" if len(self.pools) > 1 else "")
                    + "; it can never run: lower max_tokens or the prompt"
                ),
            )
        ahead = self._queue.has_ahead(ask)
        if not ahead and (placed := self._place(ask, stale)) is not None:
            reason = Reason.STALE_OPEN if stale else Reason.FITS
            return Decision(Outcome.ADMIT, reason, reservation=self._admit(ask, *placed))
        if self.policy is Policy.reject:
            if self.tenants.capped(ask.tenant):
                return self._refuse(
                    Reason.TENANT_SHARE,
                    f"tenant {ask.tenant or '(none)'} holds its share of the KV cache "
                    "(--tenant-max-share); retry later",
                    ask,
                )
            if self._held_by_latency and not ahead:
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
                prefill_seconds=prefill_seconds(self.pools[0].view.costs, ask.projection),
                target=self.ttft_target,
            )
            if not verdict.queue:
                return self._refuse(Reason.TTFT_TARGET, verdict.message, ask)
        limit = self.tenant_max_queue
        if limit is not None and self._queue.depth(tenant=ask.tenant) >= limit:
            return self._refuse(
                Reason.TENANT_QUEUE_FULL,
                f"tenant {ask.tenant or '(none)'} has {limit} requests queued "
                "(--tenant-max-queue); retry later",
                ask,
            )
        if self._queue.full(self.max_queue_depth):
            victim = self._queue.displaceable(ask)
            if victim is None:
                return self._refuse(
                    Reason.QUEUE_FULL, "the admission queue is full; retry later", ask
                )
            self._queue.shed(
                victim,
                Reason.DISPLACED,
                f"a request of priority {ask.priority} took this one's place in the full "
                f"admission queue (priority {victim.ask.priority}); retry later",
            )
        return None

    async def wait(self, ask: Ask, cancelled: asyncio.Event | None = None) -> Decision:
        """Queue a request until it fits, its wait runs out, or ``cancelled`` is set."""
        decision = await self._wait(ask, cancelled)
        self.class_stats.decided(ask.priority, ask.tenant, decision.outcome.value)
        self.class_stats.queue_waited(ask.priority, decision.waited_seconds)
        return decision

    async def _wait(self, ask: Ask, cancelled: asyncio.Event | None) -> Decision:
        waiter = await self._queue.wait(ask, max_wait=self.max_queue_wait, cancelled=cancelled)
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
            return draining(waited)
        said = f"waited {waited:.1f}s for KV cache without room; retry later"
        reason, message = waiter.shed or (Reason.QUEUE_TIMEOUT, said)
        return self._refuse(reason, message, ask, waited)

    def pump(self) -> None:
        """Admit queued requests from the head while they fit (draining too: queued requests
        that can still start do; the rest wait out their deadline). Candidates are made afresh
        each time: the learned lengths and the pools' room move while a request waits. Under
        ``spill``, hand back the queued requests whose wait has grown (``spill.hand_back``)."""
        self._queue.pump()
        if self.policy is Policy.spill and self._queue:
            hand_back(self._queue, self.expected_waits, threshold=self.spill_wait)

    def _admit_head(self, ask: Ask) -> Reservation | None:
        """The queue's try of its head: its reservation, if it can start now."""
        if self.stale_policy is StalePolicy.closed and self.is_stale():
            return None  # wait for fresh engine data (or the deadline)
        placed = self._place(ask)
        return None if placed is None else self._admit(ask, *placed)

    def started(self, res: Reservation) -> None:
        """vLLM holds the request's prompt now (its first token came, or it was handed over)."""
        self._first_token(res)
        pool_of = self._pools.pool_of
        pool_of(res).ledger.start(res)
        for shadow in res.shadows:
            pool_of(shadow).ledger.start(shadow)

    def _first_token(self, res: Reservation) -> None:
        """A request of priority 0 or better has its first token, or ended first: paced
        requests no longer wait for it (``sidecar.admission.pacing``)."""
        if self.pacing.awaited(res):
            paces = [self._pools.pool_of(one).pace for one in (res, *res.shadows)]
            self.pacing.favoured_started(paces)

    def progressed(self, res: Reservation, generated_per_sequence: float) -> None:
        """The request has generated this many tokens per sequence."""
        pool_of = self._pools.pool_of
        pool_of(res).ledger.progressed(res, generated_per_sequence)
        for shadow in res.shadows:
            pool_of(shadow).ledger.progressed(shadow, generated_per_sequence)

    def release(self, res: Reservation, completion_tokens: int | None = None) -> None:
        """The request is over (answered, failed or abandoned). Idempotent. ``completion_tokens``:
        the answer's length, when it ended naturally (what the expected-mode learner learns)."""
        if res.released:
            return
        self._first_token(res)
        if completion_tokens is not None:
            per_sequence = completion_tokens // max(res.projection.sequences, 1)
            at_max = per_sequence >= min(res.projection.max_tokens, default=0)
            self.learner.observe(res.klass, per_sequence, at_max=at_max)
        self.tenants.free(res.tenant, res.tenant_blocks)
        if res.priority <= 0:
            for one in (res, *res.shadows):
                left = self._favoured.get(one.engine, 0) - one.tenant_blocks
                if left > 0:
                    self._favoured[one.engine] = left
                else:
                    self._favoured.pop(one.engine, None)
        self._pools.release(res)
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
        headroom = self.headroom
        kept, capacity = self.reserve_blocks(pool, ask.priority), pool.view.capacity_blocks
        if kept and capacity:  # the reserve is the candidate's headroom too
            headroom += kept / capacity
        return retry_in(
            pool,
            *self._behind(pool, ask),
            headroom=headroom,
            book=book,
            key=ask.key,
            likely=self.learner.likely,
        )

    def _behind(
        self, pool: Pool, ask: Ask, before: int | None = None
    ) -> tuple[Reservation, list[Reservation]]:
        """The request's candidate in ``pool``, and those of the queued requests that would be
        tried before it were it queued now (``WaitQueue.ahead_of``: with one priority and one
        tenant, every other; ``before``: it is queued, as that ``seq``)."""
        candidate = self._candidate(pool, ask)
        ahead = self._queue.ahead_of(ask, before=before)
        return candidate, [self._candidate(pool, w.ask) for w in ahead]

    def expected_waits(self, ask: Ask, before: int | None = None) -> list[Estimate]:
        """Per pool the request may run in, its expected wait if queued now (``before``: or
        where it is queued, as that ``seq``), by ``sidecar.admission.waits.expected_wait``;
        unknown where the pool is not known yet."""
        estimates = []
        for pool in self._eligible(ask, self.is_stale()):
            budget = budget_blocks(pool.view.capacity_blocks, self.headroom)
            if budget is None:  # the pool is not known yet: nothing to tell the wait by
                estimates.append(Estimate(None, None))
                continue
            behind = self._behind(pool, ask, before)
            budget -= self.reserve_blocks(pool, ask.priority)
            estimates.append(
                expected_wait(pool, *behind, budget=budget, likely=self.learner.likely)
            )
        return estimates

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
        predicted = self._pools.predicted_at_snapshot()
        actual = snap.used_blocks if snap is not None else None
        return predicted, actual, self.capacity_blocks

    def state(self) -> KVState:
        """The figures summed over the pools, and those per priority and tenant."""
        stats, now = self.class_stats, self._clock()
        queued: dict[tuple[str, str], int] = {}
        oldest: dict[str, float] = {}
        for waiter in self._queue.waiting():
            p = stats.priority_label(waiter.ask.priority)
            key = (p, stats.tenant_label(waiter.ask.tenant))
            queued[key] = queued.get(key, 0) + 1
            oldest[p] = max(oldest.get(p, 0.0), now - waiter.enqueued_at)
        kv = self._pools.state(
            self._snapshot,
            stale=self.is_stale(),
            worst_case=self.reservation_mode is ReservationMode.worst_case,
            headroom=self.headroom,
            queued_peak_blocks=self._queue.peak_blocks,
            queue_depth=len(self._queue),
            reserving=self.reserving,
        )
        return dataclasses.replace(
            kv,
            class_decisions=dict(stats.decisions),
            class_waited=dict(stats.waited),
            class_queued=queued,
            class_oldest_wait=oldest,
            spread_admitted=self.second_opinion.admitted,
        )

    def fail_queue(self) -> None:
        """Wake every waiter (shutdown): they re-check and leave with their refusal."""
        self._queue.fail()
