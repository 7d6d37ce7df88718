"""The admission queue: the requests waiting for KV room, and the order they are tried in.

A request that does not fit now and is not refused (``--policy queue``, or ``spill`` with a short
expected wait) waits here until it fits, its wait (``--max-queue-wait``) runs out, its client
goes, or the sidecar shuts down. The queue is tried again on every release and every scrape of
vLLM (:meth:`WaitQueue.pump`), with a candidate made afresh each time (the learned lengths and
the pools' room move while a request waits).

The order (``sidecar.admission.classes`` gives each request its priority and tenant):

- **Priority first.** The waiters of the best priority (the lowest number, as vLLM orders its
  ``priority`` field) are tried before any other, and only then the next band's.
- **Inside a priority, a fair share per tenant.** The tenant tried first is the one whose use
  of the KV cache is lowest against its share (``--tenant-shares``): the block-seconds its
  admitted requests have held, decayed (:class:`sidecar.admission.tenants.TenantUsage`), not its
  request count, so that one tenant's burst cannot starve another's. A tenant at its cap
  (``--tenant-max-share`` of the budget) is passed over until it frees blocks.
- **Inside a tenant, first come first served.**

Only the request that comes first by that order is tried, and the queue stops when it cannot
start: were any waiting request that fits admitted, a large one would be starved by the small
ones behind it, since every release frees a little room that a small request takes first. With
one priority and one tenant (the default) this is a FIFO queue that tries its head.

What a try is, is the controller's (``admit``: the request's reservation if it can start now,
else None); which request is tried next, who is ahead of whom, which request leaves first when
the queue must shed, and what a full queue is, are this class's. ``sidecar.admission.tuning``
re-judges the waiters when a runtime setting changes, through :meth:`WaitQueue.waiting` and
:meth:`WaitQueue.shed_order`, ending waits with its own refusals (:attr:`Waiter.shed`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sidecar.admission.ask import Ask
from sidecar.admission.decisions import Reason
from sidecar.admission.tenants import TenantUsage
from sidecar.kv.ledger import Reservation


@dataclass(eq=False)
class Waiter:
    """One queued request: its future holds its reservation once admitted, and is cancelled
    when its wait ends otherwise."""

    ask: Ask
    enqueued_at: float
    future: asyncio.Future[Reservation] = field(repr=False)
    timer: asyncio.TimerHandle = field(repr=False)  # ends its wait (tuning.py moves it)
    shed: tuple[Reason, str] | None = None  # its refusal, when not queue_timeout
    seq: int = 0  # its place in arrival order


class WaitQueue:
    """The waiting requests, by priority, tenant share and arrival; the first by that order is
    admitted while ``admit`` gives it a reservation. All methods run on the event loop; none
    blocks."""

    def __init__(
        self,
        admit: Callable[[Ask], Reservation | None],
        *,
        clock: Callable[[], float],
        tenants: TenantUsage | None = None,
    ) -> None:
        self._admit = admit
        self._clock = clock
        self.tenants = tenants if tenants is not None else TenantUsage(clock=clock)
        #: priority -> tenant -> its waiters, oldest first
        self._bands: dict[int, dict[str, deque[Waiter]]] = {}
        self._count = 0
        self._seq = 0
        #: the projected peaks of the requests waiting (read by the HAProxy agent and /state)
        self.peak_blocks = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[Waiter]:
        """The waiters, by arrival (some may be done waiting in this very tick: their future
        is done)."""
        return iter(sorted(self._all(), key=lambda w: w.seq))

    def _all(self) -> Iterator[Waiter]:
        for band in self._bands.values():
            for line in band.values():
                yield from line

    def waiting(self) -> list[Waiter]:
        """The waiters still waiting, in arrival order."""
        return [w for w in self if not w.future.done()]

    def depth(self, *, tenant: str | None = None, priority: int | None = None) -> int:
        """Requests queued, of one tenant or one priority (None: all)."""
        if tenant is None and priority is None:
            return self._count
        bands = self._bands.values() if priority is None else [self._bands.get(priority, {})]
        return sum(len(line) for band in bands for t, line in band.items() if tenant in (None, t))

    def full(self, depth: int) -> bool:
        """Whether a request arriving now finds no place (``--max-queue-depth``)."""
        return self._count >= depth

    # --- the order --------------------------------------------------------------------------

    def _score(self, tenant: str) -> float:
        return self.tenants.score(tenant)

    def _next(self, band: dict[str, deque[Waiter]]) -> deque[Waiter] | None:
        """The tenant line of ``band`` tried first: the lowest use against its share (ties:
        the oldest head), passing over tenants at their cap."""
        best: tuple[float, int] | None = None
        chosen = None
        for tenant, line in band.items():
            if not line or self.tenants.capped(tenant, line[0].ask):
                continue
            key = (self._score(tenant), line[0].seq)
            if best is None or key < best:
                best, chosen = key, line
        return chosen

    def _first(self) -> deque[Waiter] | None:
        """The line whose head is tried next (None: nothing may be tried now)."""
        for priority in sorted(self._bands):
            line = self._next(self._bands[priority])
            if line is not None:
                return line
        return None

    def has_ahead(self, ask: Ask) -> bool:
        """Whether a request arriving now with ``ask`` comes after a waiter (it may then not
        jump the queue): a waiter of a better priority, or of its own priority whose tenant
        comes first (its own tenant's included)."""
        if not self._count:
            return False
        for priority, others in self._bands.items():
            if priority < ask.priority and any(others.values()):
                return True
        band = self._bands.get(ask.priority)
        if not band:
            return False
        if band.get(ask.tenant):
            return True
        mine = self._score(ask.tenant)
        return any(
            line and not self.tenants.capped(t, line[0].ask) and self._score(t) <= mine
            for t, line in band.items()
        )

    def ahead_of(self, ask: Ask, *, before: int | None = None) -> list[Waiter]:
        """The waiters that would be tried before a request arriving now with ``ask`` (itself
        excluded, if it waits here): those of a better priority, those of its priority whose
        tenant's use is at most its tenant's, and its own tenant's (``before``: the ``seq`` of
        a queued request's own waiter: only those of its tenant that came before it)."""
        mine = self._score(ask.tenant)
        out: list[Waiter] = []
        for priority, band in self._bands.items():
            if priority > ask.priority:
                continue
            for tenant, line in band.items():
                own = priority == ask.priority and tenant == ask.tenant
                if priority == ask.priority and not own and self._score(tenant) > mine:
                    continue
                out.extend(
                    w
                    for w in line
                    if w.ask is not ask
                    and not w.future.done()
                    and (before is None or not own or w.seq < before)
                )
        return out

    def lines(self) -> list[list[Waiter]]:
        """Every tenant's line in every priority, each oldest first (copies)."""
        return [list(line) for band in self._bands.values() for line in band.values()]

    def next_waiter(self) -> Waiter | None:
        """The waiter the queue tries next (None: none may be tried now)."""
        line = self._first()
        return line[0] if line else None

    def shed_order(self) -> list[Waiter]:
        """The waiters still waiting, the first to leave when the queue must shed first: the
        worst priority, the tenant most over its share, the newest."""
        waiting = self.waiting()
        return sorted(waiting, key=lambda w: (-w.ask.priority, -self._score(w.ask.tenant), -w.seq))

    def displaceable(self, ask: Ask) -> Waiter | None:
        """The waiter a request with ``ask`` may take the place of in a full queue: the first to
        shed (:meth:`shed_order`) if its priority is worse than ``ask``'s, else None."""
        for waiter in self.shed_order():
            return waiter if waiter.ask.priority > ask.priority else None
        return None

    def oldest(self) -> Waiter | None:
        """The waiter that has waited longest."""
        waiting = (w for w in self._all() if not w.future.done())
        return min(waiting, key=lambda w: w.seq, default=None)

    def oldest_by_priority(self) -> dict[int, float]:
        """Per priority with waiters, when its longest-waiting request was queued."""
        out: dict[int, float] = {}
        for priority, band in self._bands.items():
            heads = [line[0].enqueued_at for line in band.values() if line]
            if heads:
                out[priority] = min(heads)
        return out

    # --- waiting ----------------------------------------------------------------------------

    async def wait(
        self, ask: Ask, *, max_wait: float, cancelled: asyncio.Event | None = None
    ) -> Waiter:
        """Queue ``ask`` until it is admitted, ``max_wait`` seconds pass, ``cancelled`` is set
        or its future is cancelled; the waiter, out of the queue (the caller reads its end)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._seq += 1
        waiter = Waiter(
            ask, self._clock(), fut, loop.call_later(max_wait, fut.cancel), seq=self._seq
        )
        self._bands.setdefault(ask.priority, {}).setdefault(ask.tenant, deque()).append(waiter)
        self._count += 1
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

    def _remove(self, waiter: Waiter, line: deque[Waiter] | None = None) -> None:
        ask = waiter.ask
        band = self._bands[ask.priority]
        line = band[ask.tenant] if line is None else line
        line.remove(waiter)
        if not line:
            del band[ask.tenant]
            if not band:
                del self._bands[ask.priority]
        self._count -= 1
        self.peak_blocks -= ask.projection.peak_blocks

    def _queued(self, waiter: Waiter) -> bool:
        line = self._bands.get(waiter.ask.priority, {}).get(waiter.ask.tenant)
        return line is not None and waiter in line

    def _leave(self, waiter: Waiter) -> None:
        """Remove a waiter that is done waiting; an admission it missed is handed back."""
        if self._queued(waiter):
            self._remove(waiter)
            if not waiter.future.done():
                waiter.future.cancel()
            self.pump()  # the first in line may have changed

    def shed(self, waiter: Waiter, reason: Reason, message: str) -> None:
        """End a queued request's wait with a refusal (``AdmissionController.wait`` gives it):
        out of the queue at once, so that it holds no place in this very tick."""
        if self._queued(waiter):
            self._remove(waiter)
        waiter.shed = (reason, message)
        if not waiter.future.done():
            waiter.future.cancel()

    def pump(self) -> None:
        """Admit waiters, first in order first, while ``admit`` gives each a reservation."""
        while self._count:
            line = self._first()
            if line is None:
                return  # every tenant with waiters is at its cap
            head = line[0]
            if head.future.done():  # its waiter gave up in this very tick
                self._remove(head, line)
                continue
            res = self._admit(head.ask)
            if res is None:
                return
            self._remove(head, line)
            head.future.set_result(res)

    def fail(self) -> None:
        """Wake every waiter (shutdown): they re-check and leave with their refusal."""
        for waiter in list(self._all()):
            if not waiter.future.done():
                waiter.future.cancel()
        self.pump()
