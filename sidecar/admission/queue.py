"""The admission queue: the requests waiting for KV room, and the order they are tried in.

A request that does not fit now and is not refused (``--policy queue``, or ``spill`` with a short
expected wait) waits here until it fits, its wait (``--max-queue-wait``) runs out, its client
goes, or the sidecar shuts down. The queue is FIFO and only its head is tried: were any waiting
request that fits admitted, a large one would be starved by the small ones behind it, since
every release frees a little room that a small request takes first. The head is tried again on
every release and every scrape of vLLM (:meth:`WaitQueue.pump`), with a candidate made afresh
each time (the learned lengths and the pools' room move while a request waits).

What a try is, is the controller's (``admit``: the head's reservation if it can start now, else
None; the queue stops at the first that cannot); which request is tried next, and what a full
queue is, is this class's, so that another order (priority bands, a fair share per tenant) is
another queue, not another controller. ``sidecar.admission.tuning`` re-judges the waiters when
a runtime setting changes: it moves their timers and ends their waits with its own refusals
(:attr:`Waiter.shed`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sidecar.admission.ask import Ask
from sidecar.admission.decisions import Reason
from sidecar.kv.ledger import Reservation


@dataclass(eq=False)
class Waiter:
    """One queued request: its future holds its reservation once admitted, and is cancelled
    when its wait ends otherwise."""

    ask: Ask
    enqueued_at: float
    future: asyncio.Future[Reservation] = field(repr=False)
    timer: asyncio.TimerHandle = field(repr=False)  # ends its wait (tuning.py moves it)
    shed: tuple[Reason, str] | None = None  # its refusal, when not queue_timeout (tuning.py)


class WaitQueue:
    """The waiting requests, FIFO; the head is admitted while ``admit`` gives it a reservation.
    All methods run on the event loop; none blocks."""

    def __init__(
        self, admit: Callable[[Ask], Reservation | None], *, clock: Callable[[], float]
    ) -> None:
        self._admit = admit
        self._clock = clock
        self._waiters: deque[Waiter] = deque()
        #: the projected peaks of the requests waiting (read by the HAProxy agent and /state)
        self.peak_blocks = 0

    def __len__(self) -> int:
        return len(self._waiters)

    def __iter__(self) -> Iterator[Waiter]:
        """The waiters, in the order they are tried (oldest first); some may be done waiting
        in this very tick (their future is done)."""
        return iter(self._waiters)

    def full(self, depth: int) -> bool:
        """Whether a request arriving now finds no place (``--max-queue-depth``)."""
        return len(self._waiters) >= depth

    async def wait(
        self, ask: Ask, *, max_wait: float, cancelled: asyncio.Event | None = None
    ) -> Waiter:
        """Queue ``ask`` until it is admitted, ``max_wait`` seconds pass, ``cancelled`` is set
        or its future is cancelled; the waiter, out of the queue (the caller reads its end)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        waiter = Waiter(ask, self._clock(), fut, loop.call_later(max_wait, fut.cancel))
        self._waiters.append(waiter)
        self.peak_blocks += ask.projection.peak_blocks
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
        return waiter

    def _leave(self, waiter: Waiter) -> None:
        """Remove a waiter that is done waiting; an admission it missed is handed back."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            self.peak_blocks -= waiter.ask.projection.peak_blocks
            if not waiter.future.done():
                waiter.future.cancel()
            self.pump()  # the head may have changed

    def pump(self) -> None:
        """Admit waiters from the head while ``admit`` gives each a reservation."""
        waiters = self._waiters
        while waiters:
            head = waiters[0]
            if head.future.done():  # its waiter gave up in this very tick
                waiters.popleft()
                self.peak_blocks -= head.ask.projection.peak_blocks
                continue
            res = self._admit(head.ask)
            if res is None:
                return
            waiters.popleft()
            self.peak_blocks -= head.ask.projection.peak_blocks
            head.future.set_result(res)

    def fail(self) -> None:
        """Wake every waiter (shutdown): they re-check and leave with their refusal."""
        for waiter in list(self._waiters):
            if not waiter.future.done():
                waiter.future.cancel()
        self.pump()
