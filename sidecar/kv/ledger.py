"""The reservation ledger: KV blocks promised to, and predicted for, requests in flight.

One ledger per process (one event loop, no locks). Every admitted request holds a
:class:`Reservation` until its answer ends, fails or its client leaves; ``release`` is idempotent.
Totals are kept as running sums so the admission decision reads them in O(1).

>>> from sidecar.kv.geometry import UniformBlocks
>>> from sidecar.kv.projection import project_counts
>>> blocks = UniformBlocks(128)
>>> ledger = Ledger(blocks)
>>> p = project_counts((200,), requested_max_tokens=100, n=1, max_model_len=1024, blocks=blocks)
>>> r = ledger.reserve(p, reserved_blocks=p.peak_blocks, streamed=True)
>>> ledger.reserved_blocks, ledger.predicted_blocks
(3, 0)
>>> ledger.start(r); ledger.predicted_blocks
2
>>> ledger.advance(r, 60); ledger.predicted_blocks
3
>>> ledger.release(r), ledger.release(r), ledger.reserved_blocks
(3, 0, 0)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sidecar.kv.projection import BlockMath, Projection


@dataclass(slots=True, eq=False)
class Reservation:
    """One admitted request's share of the KV cache."""

    id: int
    projection: Projection
    reserved_blocks: int  # promised: never handed to another request while this one runs
    predicted_blocks: int  # what vLLM should hold for it now
    streamed: bool  # progress visible chunk by chunk (else estimated from vLLM's counters)
    admitted_at: float
    started: bool = False  # vLLM has the request (streamed: its first token arrived)
    generated: float = 0.0  # tokens generated per sequence so far (estimated when not streamed)
    completion_tokens: int | None = None  # exact, when vLLM's answer reported usage
    released: bool = field(default=False)

    @property
    def peak_blocks(self) -> int:
        return self.projection.peak_blocks


class Ledger:
    """Reservations of the requests in flight, with O(1) totals and a measured release rate."""

    def __init__(
        self,
        blocks: BlockMath,
        *,
        clock: Callable[[], float] = time.monotonic,
        rate_window_seconds: float = 30.0,
    ) -> None:
        self.blocks = blocks
        self._clock = clock
        self._next_id = 0
        self._active: dict[int, Reservation] = {}
        self.reserved_blocks = 0
        self.predicted_blocks = 0
        self.peak_blocks = 0
        self._rate_window = rate_window_seconds
        self._freed: deque[tuple[float, int]] = deque()
        self._freed_sum = 0
        self._hold_seconds_ewma: float | None = None

    def __len__(self) -> int:
        return len(self._active)

    def __iter__(self) -> Iterator[Reservation]:
        return iter(list(self._active.values()))

    def reserve(
        self, projection: Projection, *, reserved_blocks: int, streamed: bool
    ) -> Reservation:
        """Promise blocks to an admitted request. It holds none in vLLM until :meth:`start`."""
        self._next_id += 1
        res = Reservation(
            id=self._next_id,
            projection=projection,
            reserved_blocks=(
                max(reserved_blocks, projection.prompt_blocks)
                if projection.exact
                else reserved_blocks
            ),
            predicted_blocks=0,
            streamed=streamed,
            admitted_at=self._clock(),
        )
        self._active[res.id] = res
        self.reserved_blocks += res.reserved_blocks
        self.peak_blocks += projection.peak_blocks
        return res

    def start(self, res: Reservation) -> None:
        """vLLM holds the request's prompt now (its prefill ran, or it was handed over)."""
        if res.started or res.released:
            return
        res.started = True
        self._set_predicted(res, res.projection.blocks_at(int(res.generated), self.blocks))

    def advance(self, res: Reservation, generated_per_sequence: float) -> None:
        """Record generation progress; a request past its reservation grows it."""
        if res.released or generated_per_sequence <= res.generated:
            return
        res.generated = generated_per_sequence
        if not res.started:
            return  # counted from its start
        self._set_predicted(res, res.projection.blocks_at(int(generated_per_sequence), self.blocks))

    def _set_predicted(self, res: Reservation, predicted: int) -> None:
        if predicted != res.predicted_blocks:
            self.predicted_blocks += predicted - res.predicted_blocks
            res.predicted_blocks = predicted
            if predicted > res.reserved_blocks:
                self.reserved_blocks += predicted - res.reserved_blocks
                res.reserved_blocks = predicted

    def release(self, res: Reservation) -> int:
        """Give the reservation's blocks back; returns the blocks freed (0 if already released)."""
        if res.released:
            return 0
        res.released = True
        del self._active[res.id]
        self.reserved_blocks -= res.reserved_blocks
        self.predicted_blocks -= res.predicted_blocks
        self.peak_blocks -= res.projection.peak_blocks
        now = self._clock()
        held = now - res.admitted_at
        self._hold_seconds_ewma = (
            held if self._hold_seconds_ewma is None else 0.8 * self._hold_seconds_ewma + 0.2 * held
        )
        self._freed.append((now, res.reserved_blocks))
        self._freed_sum += res.reserved_blocks
        self._trim(now)
        return res.reserved_blocks

    def _trim(self, now: float) -> None:
        horizon = now - self._rate_window
        while self._freed and self._freed[0][0] < horizon:
            self._freed_sum -= self._freed.popleft()[1]

    def freed_blocks_per_second(self) -> float:
        """Blocks released per second over the recent window (0.0 when nothing was released)."""
        now = self._clock()
        self._trim(now)
        if not self._freed:
            return 0.0
        span = max(now - self._freed[0][0], 1.0)
        return self._freed_sum / span

    @property
    def mean_hold_seconds(self) -> float | None:
        """Smoothed time requests hold their reservation, None before the first release."""
        return self._hold_seconds_ewma
