"""Counting slots: how many long prompts are tokenized at once, and how long the others wait.

A prompt long enough to be counted on a worker thread (``PromptCounter.offload_threshold_chars``)
takes one of ``slots`` for as long as its thread works on it. A count that finds them all taken
waits its turn (first come, first served), but only while the counting work ahead of it is
expected to end within ``max_wait_s``: beyond that it is shed at once, and a count still waiting
after ``max_wait_s`` is shed then. Shedding raises :class:`~sidecar.errors.CountingBusy`, whose
``retry_after_s`` is when the work ahead should be done; the generation path answers it with
429 ``counting_busy``. Short prompts are counted on the event loop and never take a slot.

The expected wait is the work ahead spread over the slots: the characters waiting, and half of
those being counted, times the seconds per character that counts have been taking (learned
from their wall time; :data:`PRIOR_SECONDS_PER_CHAR` until then). It bounds how much a flood
of huge prompts can hold: the bodies waiting add up to about ``slots * max_wait_s`` seconds of
counting, whatever the flood's size (docs/counting-load.md).

>>> import asyncio
>>> async def flood() -> list[str]:
...     slots = CountingSlots(1, max_wait_s=0.0)
...     first = await slots.acquire(1_000_000)
...     try:
...         await slots.acquire(1_000_000)  # no slot, and no waiting allowed
...     except CountingBusy as exc:
...         shed = type(exc).__name__
...     slots.release(first, seconds=0.25)
...     return [shed, f"{slots.seconds_per_char * 1e9:.0f} ns/char"]
>>> asyncio.run(flood())
['CountingBusy', '290 ns/char']
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.errors import CountingBusy

__all__ = [
    "DEFAULT_MAX_COUNT_WAIT_S",
    "MAX_DEFAULT_SLOTS",
    "PRIOR_SECONDS_PER_CHAR",
    "CountingSlots",
    "Slot",
    "default_slots",
]

#: Seconds a long prompt may wait for a counting slot (``--max-count-wait``).
DEFAULT_MAX_COUNT_WAIT_S = 10.0
#: What a character costs to count before any count has been timed: 0.3 us, about what byte-level
#: BPE tokenizers take for English prose (one token per ~4 characters at ~1.2 us a token).
PRIOR_SECONDS_PER_CHAR = 0.3e-6
#: Weight of the newest count in the learned seconds per character.
_LEARN_WEIGHT = 0.2
#: The shortest Retry-After a shed count is given.
_MIN_RETRY_AFTER_S = 0.5


#: The most long counts at once by default: four slots count about 3M tokens a second (at ~1.2 us
#: a token), more than one vLLM engine prefills; more would only take CPU from the node.
MAX_DEFAULT_SLOTS = 4


def default_slots() -> int:
    """Long counts at once by default: the CPUs the process may use (its cgroup quota, else its
    affinity), less one left to the event loop that relays the streams; from 1 to
    :data:`MAX_DEFAULT_SLOTS`."""
    from sidecar.cgroup import cpu_limit_cores

    return max(1, min(MAX_DEFAULT_SLOTS, math.floor(cpu_limit_cores()) - 1))


@dataclass(slots=True, eq=False)
class Slot:
    """One long count's hold on a slot, from :meth:`CountingSlots.acquire` to its release."""

    chars: int
    acquired_at: float
    released: bool = False


@dataclass(slots=True, eq=False)
class _Waiter:
    chars: int
    future: asyncio.Future[Slot] = field(repr=False)


class CountingSlots:
    """At most ``slots`` long counts at once, a wait bounded by ``max_wait_s`` for the others.

    Event-loop side only (acquire and release from the loop's thread); the counter releases a
    slot when its worker thread has finished, not when the awaiting request goes away.
    """

    def __init__(
        self,
        slots: int,
        *,
        max_wait_s: float = DEFAULT_MAX_COUNT_WAIT_S,
        seconds_per_char: float = PRIOR_SECONDS_PER_CHAR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if slots < 1:
            raise ValueError(f"counting slots must be at least 1, not {slots}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must not be negative, not {max_wait_s}")
        self.slots = slots
        self.max_wait_s = max_wait_s
        #: learned from the counts' wall time (thread hop, tokenization, contention included)
        self.seconds_per_char = seconds_per_char
        self._clock = clock
        self._running = 0
        self._running_chars = 0
        self._waiting: deque[_Waiter] = deque()
        self._waiting_chars = 0
        #: counts shed so far (too long a wait expected, or waited too long)
        self.shed = 0

    @property
    def running(self) -> int:
        """Long counts holding a slot now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Long counts waiting for a slot now."""
        return len(self._waiting)

    def expected_wait_s(self) -> float:
        """Seconds a long count arriving now would wait for a slot (0 with one free)."""
        if self._running < self.slots and not self._waiting:
            return 0.0
        ahead_chars = self._waiting_chars + self._running_chars / 2
        return ahead_chars * self.seconds_per_char / self.slots

    async def acquire(self, chars: int) -> Slot:
        """A slot for counting ``chars`` characters: now, after a bounded wait, or
        :class:`CountingBusy`. Cancellation while waiting gives up the place in line."""
        if self._running < self.slots and not self._waiting:
            return self._take(chars)
        expected = self.expected_wait_s()
        if expected > self.max_wait_s:
            raise self._busy(
                f"{self._running} long prompts are being counted and {self.waiting} wait, "
                f"about {expected:.1f} s of work (more than the {self.max_wait_s:g} s allowed)",
                expected,
            )
        waiter = _Waiter(chars, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        self._waiting_chars += chars
        try:
            async with asyncio.timeout(self.max_wait_s):
                return await waiter.future
        except BaseException as exc:
            future = waiter.future
            if future.done() and not future.cancelled():
                # granted as the wait ended: hand the slot on
                self.release(future.result(), seconds=None)
            else:
                self._forget(waiter)
            if isinstance(exc, TimeoutError):
                raise self._busy(
                    f"no prompt counting slot came free in {self.max_wait_s:g} s",
                    self.expected_wait_s(),
                ) from None
            raise

    def held_s(self, slot: Slot) -> float:
        """Seconds since ``slot`` was granted."""
        return self._clock() - slot.acquired_at

    def release(self, slot: Slot, *, seconds: float | None) -> None:
        """Give ``slot`` back (idempotent); ``seconds``: the count's wall time, to learn from
        (None: it failed or was cancelled, nothing to learn)."""
        if slot.released:
            return
        slot.released = True
        self._running -= 1
        self._running_chars -= slot.chars
        if seconds is not None and slot.chars > 0:
            rate = seconds / slot.chars
            self.seconds_per_char += _LEARN_WEIGHT * (rate - self.seconds_per_char)
        while self._waiting and self._running < self.slots:
            waiter = self._waiting.popleft()
            self._waiting_chars -= waiter.chars
            if waiter.future.done():  # cancelled, not yet resumed to leave the line
                continue
            waiter.future.set_result(self._take(waiter.chars))

    def _take(self, chars: int) -> Slot:
        self._running += 1
        self._running_chars += chars
        return Slot(chars, self._clock())

    def _forget(self, waiter: _Waiter) -> None:
        try:
            self._waiting.remove(waiter)
        except ValueError:
            return  # already taken off the line by a release
        self._waiting_chars -= waiter.chars

    def _busy(self, message: str, retry_after_s: float) -> CountingBusy:
        self.shed += 1
        return CountingBusy(
            "the sidecar is counting too many long prompts; retry later: " + message,
            retry_after_s=max(_MIN_RETRY_AFTER_S, retry_after_s),
        )
