"""The ledger reconciled with vLLM's own figures, at every scrape.

From each snapshot: the pool (capacity), preemptions seen, the progress of non-streamed answers
(invisible until they end), the ledger's prediction moved to the instant of the scrape, the
blocks vLLM holds beyond what the ledger explains (traffic that bypasses the sidecar), and how
long one decode step takes (vLLM's inter-token latency, to turn steps into seconds for
Retry-After).
"""

from __future__ import annotations

from sidecar.admission.costs import EngineCosts
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.ledger import Ledger

#: weight of the newest measurement in the smoothed step time
_STEP_EWMA = 0.3


class EngineView:
    """What vLLM reported last, and what follows from it for the ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.snapshot: EngineSnapshot | None = None
        self.capacity_blocks: int | None = None
        self.external_blocks = 0
        self.preemptions_seen = 0.0
        self.seconds_per_step: float | None = None  # one decode step of every running sequence
        self.at_snapshot: tuple[int, int] | None = None  # (predicted blocks, in flight)
        self.costs = EngineCosts()  # the engine's step and recompute costs
        #: the ledger's ``freed_total`` when the snapshot was taken (:meth:`used_now_blocks`)
        self.freed_at_snapshot = 0
        #: the snapshot whose ``used_blocks`` is kept below (read on every decision)
        self._used_of: EngineSnapshot | None = None
        self._used_blocks: int | None = None

    def update(self, snap: EngineSnapshot) -> float:
        """Take a new snapshot; returns the preemptions vLLM made since the last one."""
        prev, self.snapshot = self.snapshot, snap
        self.freed_at_snapshot = self.ledger.freed_total
        if snap.capacity_blocks is not None:
            self.capacity_blocks = self.costs.pool_blocks = snap.capacity_blocks
        preempted = 0.0
        if prev is not None:
            preempted = max(0.0, snap.preemptions_total - prev.preemptions_total)
            self.preemptions_seen += preempted
            self._hidden_progress(prev, snap)
            # the releases since the last scrape: how many prefill steps their reports span
            step = self.costs.decode_step_seconds
            shared = self.ledger.prefill_share(prev.taken_at, window=step / 2 if step else 0.0)
            self.costs.update(prev, snap, shared=shared)
        self._step_time(prev, snap)
        predicted = self.aligned_prediction(snap)
        self.at_snapshot = (predicted, len(self.ledger))
        used = snap.used_blocks
        if used is not None:
            # vLLM holds more than the ledger explains (requests that bypass the sidecar, or
            # progress the ledger cannot see): count it as committed. One block per request of
            # slack absorbs the ledger's rounding and timing.
            slack = len(self.ledger)
            self.external_blocks = max(0, used - predicted - slack)
        return preempted

    def used_now_blocks(self) -> int | None:
        """What vLLM holds now, as far as the sidecar can tell: its usage at the last scrape
        less the blocks of the requests that ended since (each request's own blocks; prompt
        blocks another request in flight holds stay). Without it, a wave of answers that ends
        just after a scrape holds admission back until the next one, as if vLLM still held
        them (measured on the CPU engine: up to a scrape interval after every release, with
        the ledger's own projection far below). None: not reported."""
        snap = self.snapshot
        if snap is None:
            return None
        if snap is not self._used_of:
            self._used_of, self._used_blocks = snap, snap.used_blocks
        used = self._used_blocks
        if used is None:
            return None
        return max(0, used - (self.ledger.freed_total - self.freed_at_snapshot))

    def _hidden_progress(self, prev: EngineSnapshot, snap: EngineSnapshot) -> None:
        """Advance running non-streamed requests by their share of vLLM's generated tokens (they
        show nothing else until they end), and learn the step time.

        Continuous batching decodes one token per running sequence per step, so the growth of
        ``generation_tokens_total`` over the running sequences is each one's progress.
        """
        generated = snap.generation_tokens_total - prev.generation_tokens_total
        elapsed = snap.taken_at - prev.taken_at
        if generated <= 0:
            return
        per_sequence = generated / max(snap.running, 1)
        if (
            elapsed > 0
            and prev.running > 0
            and snap.running > 0
            and snap.inter_token_latency_count == 0
        ):
            # no inter-token histogram: steps from the token counter, when vLLM was busy
            # through the interval (an idle part would make steps look slow)
            self._learn_step(elapsed / per_sequence)
        for res in self.ledger:
            if not res.started or res.streamed:
                # a streamed answer's own events count its tokens: an estimate could run ahead
                # of them (vLLM's counters lag and jump), and progress overestimated is the
                # unsafe side (an answer taken to end sooner than it will)
                continue
            # its share of the interval's tokens, for the part of the interval it ran
            ran = snap.taken_at - max(prev.taken_at, res.started_at)
            if ran > 0:
                res.estimated += per_sequence * min(1.0, ran / elapsed) if elapsed > 0 else 0.0
                self.ledger.advance(res, res.estimated)

    def _step_time(self, prev: EngineSnapshot | None, snap: EngineSnapshot) -> None:
        """vLLM's inter-token latency histogram: the mean since it started as a first guess,
        then the mean of each scrape interval's tokens."""
        if snap.inter_token_latency_count <= 0:
            return
        if self.seconds_per_step is None:
            self.seconds_per_step = snap.inter_token_latency_sum / snap.inter_token_latency_count
            return
        if prev is None:
            return
        tokens = snap.inter_token_latency_count - prev.inter_token_latency_count
        if tokens > 0:
            seconds = snap.inter_token_latency_sum - prev.inter_token_latency_sum
            self._learn_step(max(0.0, seconds) / tokens)

    def _learn_step(self, step: float) -> None:
        self.seconds_per_step = (
            step
            if self.seconds_per_step is None
            else (1 - _STEP_EWMA) * self.seconds_per_step + _STEP_EWMA * step
        )

    def aligned_prediction(self, snap: EngineSnapshot) -> int:
        """The ledger's prediction moved to the instant vLLM's metrics describe.

        The ledger sees a request start when its first token arrives and end when its last
        chunk has passed, both a little after vLLM allocated or freed its blocks. vLLM's running
        count, read in the same scrape as its usage, says how many of ours it really holds:
        surplus started requests are taken as finished (the most advanced first), and a
        shortfall as admitted requests whose prefill already runs (the oldest first). Prompt
        blocks that running requests share are held once.
        """
        ledger = self.ledger
        running = snap.running
        if running <= 0:
            return 0  # vLLM runs none: every started request has finished there
        predicted = ledger.predicted_blocks - ledger.shared_blocks_now()
        ours = ledger.started_sequences
        if running < ours:
            surplus = ours - running
            # each request has a sequence at least: the surplus most advanced cover it
            for res in ledger.most_advanced(surplus):
                if surplus <= 0:
                    break
                predicted -= res.predicted_blocks
                surplus -= res.projection.sequences
        elif running > ours:
            shortfall = running - ours
            for res in ledger.oldest_unstarted(shortfall):
                if shortfall <= 0:
                    break
                predicted += res.projection.prompt_blocks
                shortfall -= res.projection.sequences
        return max(0, predicted)
