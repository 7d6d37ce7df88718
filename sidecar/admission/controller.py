"""Admission: forward now, queue, or refuse, against the KV budget.

The budget is the blocks vLLM can hand out (from its ``/metrics``) less ``--headroom``. What is
committed is the ledger's reservations plus whatever vLLM holds beyond the ledger's prediction
(traffic that bypasses the sidecar), and never less than what vLLM reports taken. A request is
admitted when its reservation fits; otherwise, by policy, it is refused with 429 at once or waits
in a FIFO queue (only the head may be admitted, so a large request is not starved by small ones
behind it) that is re-evaluated on every release and every scrape.

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
from sidecar.config import Policy, ReservationMode, StalePolicy
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.projection import Projection

log = logging.getLogger("sidecar.admission.controller")

MIN_RETRY_AFTER = 1.0
MAX_RETRY_AFTER = 60.0


class CompletionLearner:
    """Learns how much of ``max_tokens`` answers really use, for ``--reservation expected``.

    Keeps the last ``window`` completion/max_tokens ratios and reserves a high quantile of them.
    Until ``min_samples`` answers are seen it reserves ``prior`` (1.0, everything, unless the
    operator knows the workload: a fresh sidecar meets its first burst with it). Each rise of vLLM's
    preemption counter adds a safety boost that decays by half every ``boost_half_life`` seconds.
    """

    def __init__(
        self,
        quantile: float = 0.95,
        *,
        window: int = 1000,
        min_samples: int = 20,
        prior: float = 1.0,
        boost_half_life: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < prior <= 1.0:
            raise ValueError(f"prior must be in (0, 1], got {prior!r}")
        self.quantile = quantile
        self.prior = prior
        self.min_samples = min_samples
        self._ratios: deque[float] = deque(maxlen=window)
        self._cached: float | None = None
        self._since_sort = 0
        self._boost = 0.0
        self._boost_at = 0.0
        self._half_life = boost_half_life
        self._clock = clock

    def observe(self, completion_tokens: int, max_tokens: int) -> None:
        if max_tokens <= 0:
            return
        self._ratios.append(min(1.0, completion_tokens / max_tokens))
        self._since_sort += 1
        if self._cached is None or self._since_sort >= 16:
            self._cached = None

    def tighten(self) -> None:
        """vLLM preempted: reserve more until the preemptions stop."""
        self._boost = min(1.0, max(0.1, self.boost * 2))
        self._boost_at = self._clock()

    @property
    def boost(self) -> float:
        if self._boost == 0.0:
            return 0.0
        elapsed = self._clock() - self._boost_at
        return float(self._boost * 0.5 ** (elapsed / self._half_life))

    @property
    def learned_ratio(self) -> float:
        if len(self._ratios) < self.min_samples:
            return self.prior
        if self._cached is None:
            ordered = sorted(self._ratios)
            self._cached = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
            self._since_sort = 0
        return self._cached

    def ratio(self) -> float:
        return min(1.0, self.learned_ratio + self.boost)


@dataclass(eq=False)
class _Waiter:
    projection: Projection
    need_blocks: int
    streamed: bool
    enqueued_at: float
    future: asyncio.Future[Reservation] = field(repr=False)


@dataclass(frozen=True, slots=True)
class KVState:
    """A consistent view of the figures the exporter and /readyz report, in blocks."""

    capacity_blocks: int | None
    budget_blocks: int | None
    reserved_blocks: int
    predicted_blocks: int
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
        policy: Policy = Policy.QUEUE,
        headroom: float = 0.05,
        max_queue_depth: int = 256,
        max_queue_wait: float = 30.0,
        reservation: ReservationMode = ReservationMode.WORST_CASE,
        expected_quantile: float = 0.95,
        expected_prior: float = 1.0,
        stale_after: float = 5.0,
        stale_policy: StalePolicy = StalePolicy.OPEN,
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
        self.learner = CompletionLearner(expected_quantile, prior=expected_prior, clock=clock)
        self._clock = clock
        self._queue: deque[_Waiter] = deque()
        self._queued_peak_blocks = 0
        self.snapshot: EngineSnapshot | None = None
        self.capacity_blocks: int | None = None
        self.external_blocks = 0
        self.draining = False
        self.preemptions_seen = 0.0
        self._last_generation_total: float | None = None
        self._at_snapshot: tuple[int, int] | None = None  # (predicted blocks, in flight)

    # --- the engine's view -------------------------------------------------------------------

    def on_snapshot(self, snap: EngineSnapshot) -> None:
        """Reconcile with a fresh scrape of vLLM, then re-evaluate the queue."""
        prev = self.snapshot
        self.snapshot = snap
        if snap.capacity_blocks is not None:
            self.capacity_blocks = snap.capacity_blocks
        if prev is not None and snap.preemptions_total > prev.preemptions_total:
            self.preemptions_seen += snap.preemptions_total - prev.preemptions_total
            if self.reservation_mode is ReservationMode.EXPECTED:
                self.learner.tighten()
                log.warning("vLLM preempted; expected-mode reservations tightened")
        self._estimate_hidden_progress(snap)
        predicted = self._aligned_prediction(snap)
        self._at_snapshot = (predicted, len(self.ledger))
        used = snap.used_blocks
        if used is not None:
            # vLLM holds more than the ledger explains (requests that bypass the sidecar, or
            # progress the ledger cannot see): count it as committed. One block per request of
            # slack absorbs the ledger's rounding and timing.
            slack = len(self.ledger)
            self.external_blocks = max(0, used - predicted - slack)
        self.pump()

    def _aligned_prediction(self, snap: EngineSnapshot) -> int:
        """The ledger's prediction moved to the instant vLLM's metrics describe.

        The ledger sees a request start when its first token arrives and end when its last
        chunk has passed, both a little after vLLM allocated or freed its blocks. vLLM's running
        count, read in the same scrape as its usage, says how many of ours it really holds:
        surplus started requests are taken as finished (the most advanced first), and a
        shortfall as admitted requests whose prefill already runs (the oldest first).
        """
        predicted = self.ledger.predicted_blocks
        started = [r for r in self.ledger if r.started]
        ours = sum(r.projection.sequences for r in started)
        running = snap.running
        if running < ours:
            surplus = ours - running
            by_progress = sorted(
                started,
                key=lambda r: r.generated / max(max(r.projection.max_tokens), 1),
                reverse=True,
            )
            for res in by_progress:
                if surplus <= 0:
                    break
                predicted -= res.predicted_blocks
                surplus -= res.projection.sequences
        elif running > ours:
            shortfall = running - ours
            for res in sorted(
                (r for r in self.ledger if not r.started), key=lambda r: r.admitted_at
            ):
                if shortfall <= 0:
                    break
                predicted += res.projection.prompt_blocks
                shortfall -= res.projection.sequences
        return predicted

    def _estimate_hidden_progress(self, snap: EngineSnapshot) -> None:
        """Advance non-streamed requests by their share of vLLM's generated tokens.

        Continuous batching decodes one token per running sequence per step, so the growth of
        ``generation_tokens_total`` divided by the running sequences is each one's progress.
        """
        total = snap.generation_tokens_total
        last, self._last_generation_total = self._last_generation_total, total
        if last is None or total < last:
            return
        per_sequence = (total - last) / max(snap.running, 1)
        if per_sequence <= 0:
            return
        for res in self.ledger:
            if res.started and not res.streamed:
                self.ledger.advance(res, res.generated + per_sequence)

    def is_stale(self) -> bool:
        snap = self.snapshot
        return snap is None or snap.age(self._clock()) > self.stale_after

    # --- the budget -------------------------------------------------------------------------

    def budget_blocks(self) -> int | None:
        if self.capacity_blocks is None:
            return None
        return math.floor(self.capacity_blocks * (1.0 - self.headroom))

    def committed_blocks(self) -> int:
        """Blocks spoken for. On stale engine data, the ledger alone (fail-open on the engine,
        never on the ledger): what vLLM reported long ago no longer means anything."""
        if self.is_stale():
            return self.ledger.reserved_blocks
        committed = self.ledger.reserved_blocks + self.external_blocks
        snap = self.snapshot
        if snap is not None and snap.used_blocks is not None:
            committed = max(committed, snap.used_blocks)
        return committed

    def need_blocks(self, projection: Projection) -> int:
        """Blocks to reserve for a request under the configured reservation mode."""
        need = self._need_blocks(projection)
        budget = self.budget_blocks()
        if not projection.exact and budget is not None:
            need = min(need, budget)  # an over-estimate must not make a request unrunnable
        return need

    def _need_blocks(self, projection: Projection) -> int:
        if self.reservation_mode is ReservationMode.WORST_CASE:
            return projection.peak_blocks
        ratio = self.learner.ratio()
        if ratio >= 1.0:
            return projection.peak_blocks
        blocks = self.ledger.blocks
        return projection.n * sum(
            blocks.blocks_for_tokens(p + math.ceil(ratio * m))
            for p, m in zip(projection.prompt_tokens, projection.max_tokens, strict=True)
        )

    def _fits(self, need: int) -> bool:
        budget = self.budget_blocks()
        if budget is None:
            return True  # nothing known yet (fail-open start-up): vLLM is the only judge
        return self.committed_blocks() + need <= budget

    # --- deciding ---------------------------------------------------------------------------

    def _admit(self, projection: Projection, need: int, streamed: bool) -> Reservation:
        return self.ledger.reserve(projection, reserved_blocks=need, streamed=streamed)

    def _refuse(self, reason: Reason, message: str, need: int, waited: float = 0.0) -> Decision:
        return Decision(
            Outcome.REJECT,
            reason,
            retry_after=self.retry_after(need),
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

    def try_admit(self, projection: Projection, *, streamed: bool) -> Decision | None:
        """Decide at once; None means "queue it" (the caller then awaits :meth:`wait`)."""
        if self.draining:
            return self._draining_refusal()
        need = self.need_blocks(projection)
        stale = self.is_stale()
        if stale and self.stale_policy is StalePolicy.CLOSED:
            return Decision(
                Outcome.REJECT,
                Reason.STALE_CLOSED,
                retry_after=MIN_RETRY_AFTER,
                message="vLLM's metrics are stale; refusing (stale policy closed)",
            )
        budget = self.budget_blocks()
        if self.policy is Policy.OBSERVE:
            # dry run: account for everything, gate nothing
            reason = Reason.FITS if not self._queue and self._fits(need) else Reason.OBSERVED
            return Decision(
                Outcome.ADMIT, reason, reservation=self._admit(projection, need, streamed)
            )
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
        if not self._queue and self._fits(need):
            reason = Reason.STALE_OPEN if stale else Reason.FITS
            return Decision(
                Outcome.ADMIT, reason, reservation=self._admit(projection, need, streamed)
            )
        if self.policy is Policy.REJECT:
            return self._refuse(Reason.KV_CACHE_FULL, "the KV cache is full; retry later", need)
        if len(self._queue) >= self.max_queue_depth:
            return self._refuse(Reason.QUEUE_FULL, "the admission queue is full; retry later", need)
        return None

    async def wait(
        self,
        projection: Projection,
        *,
        streamed: bool,
        cancelled: asyncio.Event | None = None,
    ) -> Decision:
        """Queue a request until it fits, its wait runs out, or ``cancelled`` is set."""
        need = self.need_blocks(projection)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(projection, need, streamed, self._clock(), loop.create_future())
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
            need,
            waited,
        )

    def _leave(self, waiter: _Waiter) -> None:
        """Remove a waiter that is done waiting; an admission it missed is handed back."""
        if waiter in self._queue:
            self._queue.remove(waiter)
            self._queued_peak_blocks -= waiter.projection.peak_blocks
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
                self._queued_peak_blocks -= head.projection.peak_blocks
                continue
            if self.stale_policy is StalePolicy.CLOSED and self.is_stale():
                return  # wait for fresh engine data (or the deadline)
            if self.reservation_mode is ReservationMode.EXPECTED:
                # the learned ratio moves while a request waits: reserve what it says now
                head.need_blocks = self.need_blocks(head.projection)
            if not self._fits(head.need_blocks):
                return
            self._queue.popleft()
            self._queued_peak_blocks -= head.projection.peak_blocks
            head.future.set_result(self._admit(head.projection, head.need_blocks, head.streamed))

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
            per_sequence = res.completion_tokens // max(res.projection.sequences, 1)
            for m in res.projection.max_tokens:
                self.learner.observe(per_sequence, m)
        self.ledger.release(res)
        self.pump()

    # --- Retry-After ------------------------------------------------------------------------

    def retry_after(self, need: int) -> float:
        """Seconds until ``need`` blocks are likely free, from the measured release rate."""
        budget = self.budget_blocks()
        queued = sum(w.need_blocks for w in self._queue)
        deficit = max(1, self.committed_blocks() + queued + need - (budget or 0))
        rate = self.ledger.freed_blocks_per_second()
        if rate > 0:
            seconds = deficit / rate
        else:
            hold = self.ledger.mean_hold_seconds
            seconds = hold / 2 if hold is not None else 2.0
        return min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, seconds))

    # --- state for the exporter ---------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def state(self) -> KVState:
        snap = self.snapshot
        return KVState(
            capacity_blocks=self.capacity_blocks,
            budget_blocks=self.budget_blocks(),
            reserved_blocks=self.ledger.reserved_blocks,
            predicted_blocks=self.ledger.predicted_blocks,
            actual_blocks=snap.used_blocks if snap is not None else None,
            external_blocks=self.external_blocks,
            committed_blocks=self.committed_blocks(),
            peak_blocks_in_flight=self.ledger.peak_blocks,
            peak_blocks_queued=self._queued_peak_blocks,
            in_flight=len(self.ledger),
            queue_depth=len(self._queue),
            snapshot_age=snap.age(self._clock()) if snap is not None else math.inf,
            predicted_at_snapshot_blocks=self._at_snapshot[0] if self._at_snapshot else None,
            in_flight_at_snapshot=self._at_snapshot[1] if self._at_snapshot else 0,
        )

    def fail_queue(self) -> None:
        """Wake every waiter (shutdown): they re-check and leave with their refusal."""
        for waiter in list(self._queue):
            if not waiter.future.done():
                waiter.future.cancel()
        self.pump()
