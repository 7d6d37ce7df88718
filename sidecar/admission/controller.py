"""Admission: forward now, queue, or refuse, against the KV budget.

The budget is the blocks vLLM can hand out (from its ``/metrics``) less ``--headroom``. What a
request needs is judged the way vLLM spends KV (``sidecar.kv.trajectory``): the peak, over the
future, of the in-flight requests' trajectories plus the candidate's, each running to its
reserved end (``max_tokens`` in worst-case mode, a learned length in expected mode) and freeing
its blocks when it ends, with shared prompt blocks counted once. Added to it is whatever vLLM
holds beyond the ledger's prediction (traffic that bypasses the sidecar); and the candidate's
prompt must fit beside what vLLM reports taken now. A request that fits is admitted; otherwise,
by policy, it is refused with 429 at once or waits in a FIFO queue (only the head may be
admitted, so a large request is not starved by small ones behind it) that is re-evaluated on
every release and every scrape. A refusal's Retry-After is when the trajectories say the request
would fit (``sidecar.admission.retry``).

Outcomes are values (:class:`Decision`), not exceptions; ``sidecar.http.refusals`` maps them
to HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.admission.decisions import Decision, Outcome, Reason
from sidecar.admission.engine_view import EngineView
from sidecar.admission.learner import LengthLearner
from sidecar.admission.retry import MIN_RETRY_AFTER, RetryPlanner
from sidecar.config import Policy, ReservationMode, StalePolicy
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.prefix import BlockHashes
from sidecar.kv.projection import Projection
from sidecar.kv.trajectory import future_peak

log = logging.getLogger("sidecar.admission")


@dataclass(eq=False)
class _Waiter:
    candidate: Reservation  # not in the ledger until admitted
    enqueued_at: float
    future: asyncio.Future[Reservation] = field(repr=False)


@dataclass(frozen=True, slots=True)
class KVState:
    """A consistent view of the figures the exporter and /state report, in blocks."""

    capacity_blocks: int | None
    budget_blocks: int | None
    reserved_blocks: int  # the sum of the in-flight requests' reserved peaks
    future_peak_blocks: int  # the peak over the future of their sum (what admission checks)
    worst_case_peak_blocks: int  # the same with every request running to max_tokens
    predicted_blocks: int
    shared_blocks: int  # prompt blocks running requests share (held once by vLLM)
    actual_blocks: int | None
    external_blocks: int
    committed_blocks: int
    peak_blocks_in_flight: int
    peak_blocks_queued: int
    in_flight: int
    queue_depth: int
    snapshot_age: float
    # the ledger at the instant of the last scrape, to compare with what vLLM reported then
    predicted_at_snapshot_blocks: int | None
    in_flight_at_snapshot: int


class AdmissionController:
    """Decides, queues and releases. All methods run on the event loop; none blocks."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        policy: Policy = Policy.queue,
        headroom: float = 0.05,
        max_queue_depth: int = 256,
        max_queue_wait: float = 30.0,
        reservation: ReservationMode = ReservationMode.worst_case,
        expected_quantile: float = 0.95,
        expected_prior: float = 1.0,
        stale_after: float = 5.0,
        stale_policy: StalePolicy = StalePolicy.open,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.policy = Policy(policy)
        self.headroom = headroom
        self.max_queue_depth = max_queue_depth
        self.max_queue_wait = max_queue_wait
        self.reservation_mode = ReservationMode(reservation)
        self.stale_after = stale_after
        self.stale_policy = StalePolicy(stale_policy)
        self.learner = LengthLearner(expected_quantile, prior=expected_prior, clock=clock)
        self.engine = EngineView(ledger)
        self.retry = RetryPlanner(ledger, clock=clock)
        self._clock = clock
        self._queue: deque[_Waiter] = deque()
        self._queued_peak_blocks = 0
        self.draining = False

    # --- the engine's view -------------------------------------------------------------------

    @property
    def snapshot(self) -> EngineSnapshot | None:
        return self.engine.snapshot

    @property
    def capacity_blocks(self) -> int | None:
        return self.engine.capacity_blocks

    @property
    def external_blocks(self) -> int:
        return self.engine.external_blocks

    @property
    def preemptions_seen(self) -> float:
        return self.engine.preemptions_seen

    def on_snapshot(self, snap: EngineSnapshot) -> None:
        """Reconcile with a fresh scrape of vLLM, then re-evaluate the queue."""
        if self.engine.update(snap) and self.reservation_mode is ReservationMode.expected:
            self.learner.tighten()
            log.warning("vLLM preempted; expected-mode reservations tightened")
        self.pump()

    def is_stale(self) -> bool:
        snap = self.engine.snapshot
        return snap is None or snap.age(self._clock()) > self.stale_after

    # --- the budget -------------------------------------------------------------------------

    def budget_blocks(self) -> int | None:
        capacity = self.engine.capacity_blocks
        if capacity is None:
            return None
        return math.floor(capacity * (1.0 - self.headroom))

    def future_peak_blocks(self, *extra: Reservation, worst_case: bool = False) -> int:
        """The most blocks the requests in flight (and ``extra``) can hold at once from now."""
        return future_peak(
            self.ledger.trajectories(extra, worst_case=worst_case), self.ledger.blocks
        )

    def committed_blocks(self, peak: int | None = None) -> int:
        """Blocks spoken for (``peak``: the future peak, when already computed). On stale engine
        data, the ledger alone (fail-open on the engine, never on the ledger): what vLLM
        reported long ago no longer means anything."""
        if peak is None:
            peak = self.future_peak_blocks()
        if self.is_stale():
            return peak
        committed = peak + self.engine.external_blocks
        snap = self.engine.snapshot
        if snap is not None and snap.used_blocks is not None:
            committed = max(committed, snap.used_blocks)
        return committed

    def ends(self, projection: Projection, klass: str = "") -> tuple[int, ...]:
        """Output tokens to reserve per sequence, per prompt, in the configured mode."""
        if self.reservation_mode is ReservationMode.worst_case:
            return projection.max_tokens
        return tuple(self.learner.end(klass, m) for m in projection.max_tokens)

    def _fits(self, candidate: Reservation) -> bool:
        budget = self.budget_blocks()
        if budget is None:
            return True  # nothing known yet (fail-open start-up): vLLM is the only judge
        if self.reservation_mode is ReservationMode.worst_case and candidate.projection.exact:
            # The sum of the reserved peaks bounds the future peak from above (each request's
            # trajectory never holds more than its peak): when even that fits, the trajectories
            # need not be laid out. Not in expected mode, where an answer past its expected end
            # is expected to grow beyond what it reserved.
            if self._committed_fits(self.ledger.reserved_blocks, candidate, budget):
                return True
        peak = self.future_peak_blocks(candidate)
        if not candidate.projection.exact:
            # an upper-bound estimate must not make a request unrunnable: one over the budget
            # runs when nothing else does
            alone = future_peak(
                self.ledger.trajectories([candidate], in_flight=False), self.ledger.blocks
            )
            if alone > budget:
                return len(self.ledger) == 0 and self.engine.external_blocks == 0
        return self._committed_fits(peak, candidate, budget, with_candidate=True)

    def _committed_fits(
        self, peak: int, candidate: Reservation, budget: int, *, with_candidate: bool = False
    ) -> bool:
        """``peak`` (of the requests in flight, and the candidate's when ``with_candidate``)
        with what vLLM holds beyond the ledger, and the candidate's prompt beside what vLLM holds
        now, within the budget."""
        if not with_candidate:
            peak += candidate.reserved_blocks
        if self.is_stale():
            return peak <= budget
        committed = peak + self.engine.external_blocks
        snap = self.engine.snapshot
        if snap is not None and snap.used_blocks is not None:
            committed = max(committed, snap.used_blocks + candidate.projection.prompt_blocks)
        return committed <= budget

    # --- deciding ---------------------------------------------------------------------------

    def _candidate(
        self,
        projection: Projection,
        streamed: bool,
        klass: str,
        prefix: tuple[BlockHashes, ...] | None,
    ) -> Reservation:
        return self.ledger.candidate(
            projection,
            streamed=streamed,
            ends=self.ends(projection, klass),
            prefix=prefix,
            klass=klass,
        )

    def _admit(self, candidate: Reservation) -> Reservation:
        self.retry.admitted()
        return self.ledger.add(candidate)

    def _refuse(
        self, reason: Reason, message: str, candidate: Reservation, waited: float = 0.0
    ) -> Decision:
        return Decision(
            Outcome.REJECT,
            reason,
            retry_after=self.retry_after(candidate),
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

    def try_admit(
        self,
        projection: Projection,
        *,
        streamed: bool,
        klass: str = "",
        prefix: tuple[BlockHashes, ...] | None = None,
    ) -> Decision | None:
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
        candidate = self._candidate(projection, streamed, klass, prefix)
        budget = self.budget_blocks()
        if self.policy is Policy.observe:
            # dry run: account for everything, gate nothing
            reason = Reason.FITS if not self._queue and self._fits(candidate) else Reason.OBSERVED
            return Decision(Outcome.ADMIT, reason, reservation=self._admit(candidate))
        if budget is not None and projection.exact and projection.peak_blocks > budget:
            return Decision(
                Outcome.REJECT,
                Reason.TOO_LARGE,
                message=(
                    f"this request can reach {projection.peak_blocks} KV blocks "
                    f"({projection.peak_tokens} tokens) but the KV budget is {budget} blocks; "
                    "it can never run: lower max_tokens, n or the prompt"
                ),
            )
        if not self._queue and self._fits(candidate):
            reason = Reason.STALE_OPEN if stale else Reason.FITS
            return Decision(Outcome.ADMIT, reason, reservation=self._admit(candidate))
        if self.policy is Policy.reject:
            return self._refuse(
                Reason.KV_CACHE_FULL, "the KV cache is full; retry later", candidate
            )
        if len(self._queue) >= self.max_queue_depth:
            return self._refuse(
                Reason.QUEUE_FULL, "the admission queue is full; retry later", candidate
            )
        return None

    async def wait(
        self,
        projection: Projection,
        *,
        streamed: bool,
        cancelled: asyncio.Event | None = None,
        klass: str = "",
        prefix: tuple[BlockHashes, ...] | None = None,
    ) -> Decision:
        """Queue a request until it fits, its wait runs out, or ``cancelled`` is set."""
        loop = asyncio.get_running_loop()
        candidate = self._candidate(projection, streamed, klass, prefix)
        waiter = _Waiter(candidate, self._clock(), loop.create_future())
        self._queue.append(waiter)
        self._queued_peak_blocks += projection.peak_blocks
        watch: asyncio.Task[bool] | None = (
            asyncio.ensure_future(cancelled.wait()) if cancelled is not None else None
        )
        try:
            waitables: set[asyncio.Future[Any]] = {waiter.future}
            if watch is not None:
                waitables.add(watch)
            await asyncio.wait(
                waitables, timeout=self.max_queue_wait, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
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
        return self._refuse(
            Reason.QUEUE_TIMEOUT,
            f"waited {waited:.1f}s for KV cache without room; retry later",
            waiter.candidate,
            waited,
        )

    def _leave(self, waiter: _Waiter) -> None:
        """Remove a waiter that is done waiting; an admission it missed is handed back."""
        if waiter in self._queue:
            self._queue.remove(waiter)
            self._queued_peak_blocks -= waiter.candidate.projection.peak_blocks
            if not waiter.future.done():
                waiter.future.cancel()
            self.pump()  # the head may have changed

    def pump(self) -> None:
        """Admit queued requests from the head while they fit (draining too: queued requests
        that can still start do; the rest wait out their deadline)."""
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # its waiter gave up in this very tick
                self._queue.popleft()
                self._queued_peak_blocks -= head.candidate.projection.peak_blocks
                continue
            if self.stale_policy is StalePolicy.closed and self.is_stale():
                return  # wait for fresh engine data (or the deadline)
            if self.reservation_mode is ReservationMode.expected:
                # the learned lengths move while a request waits: reserve what they say now
                cand = head.candidate
                head.candidate = self._candidate(
                    cand.projection, cand.streamed, cand.klass, cand.prefix
                )
            if not self._fits(head.candidate):
                return
            self._queue.popleft()
            self._queued_peak_blocks -= head.candidate.projection.peak_blocks
            head.future.set_result(self._admit(head.candidate))

    def started(self, res: Reservation) -> None:
        """vLLM holds the request's prompt now (its first token came, or it was handed over)."""
        self.ledger.start(res)

    def progressed(self, res: Reservation, generated_per_sequence: float) -> None:
        """The request has generated this many tokens per sequence."""
        self.ledger.advance(res, generated_per_sequence)

    def release(self, res: Reservation) -> None:
        """The request is over (answered, failed or abandoned). Idempotent."""
        if res.released:
            return
        if res.completion_tokens is not None:
            self.learner.observe(
                res.klass, res.completion_tokens // max(res.projection.sequences, 1)
            )
        self.ledger.release(res)
        self.pump()

    # --- Retry-After ------------------------------------------------------------------------

    def retry_after(self, candidate: Reservation) -> float:
        """Seconds until ``candidate`` would fit, from the trajectories (or, without a measured
        step time, from the recent release rate)."""
        ahead = [w.candidate for w in self._queue if w.candidate is not candidate]
        return self.retry.plan(
            candidate,
            ahead=ahead,
            budget_blocks=self.budget_blocks(),
            external_blocks=self.engine.external_blocks,
            seconds_per_step=self.engine.seconds_per_step,
            fallback=lambda: self._release_rate_estimate(candidate, ahead),
        )

    def _release_rate_estimate(self, candidate: Reservation, ahead: list[Reservation]) -> float:
        budget = self.budget_blocks() or 0
        need = self.future_peak_blocks(*ahead, candidate) + self.engine.external_blocks
        deficit = max(1, need - budget)
        rate = self.ledger.freed_blocks_per_second()
        if rate > 0:
            return deficit / rate
        hold = self.ledger.mean_hold_seconds
        return hold / 2 if hold is not None else 2.0

    # --- state for the exporter ---------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def state(self) -> KVState:
        snap = self.engine.snapshot
        at_snapshot = self.engine.at_snapshot
        peak = self.future_peak_blocks()
        worst = (
            peak
            if self.reservation_mode is ReservationMode.worst_case
            else self.future_peak_blocks(worst_case=True)
        )
        return KVState(
            capacity_blocks=self.engine.capacity_blocks,
            budget_blocks=self.budget_blocks(),
            reserved_blocks=self.ledger.reserved_blocks,
            future_peak_blocks=peak,
            worst_case_peak_blocks=worst,
            predicted_blocks=self.ledger.predicted_blocks,
            shared_blocks=self.ledger.shared_blocks_now(),
            actual_blocks=snap.used_blocks if snap is not None else None,
            external_blocks=self.engine.external_blocks,
            committed_blocks=self.committed_blocks(peak),
            peak_blocks_in_flight=self.ledger.peak_blocks,
            peak_blocks_queued=self._queued_peak_blocks,
            in_flight=len(self.ledger),
            queue_depth=len(self._queue),
            snapshot_age=snap.age(self._clock()) if snap is not None else math.inf,
            predicted_at_snapshot_blocks=at_snapshot[0] if at_snapshot else None,
            in_flight_at_snapshot=at_snapshot[1] if at_snapshot else 0,
        )

    def fail_queue(self) -> None:
        """Wake every waiter (shutdown): they re-check and leave with their refusal."""
        for waiter in list(self._queue):
            if not waiter.future.done():
                waiter.future.cancel()
        self.pump()
