"""Retry-After from trajectories: when would a refused request fit?

The in-flight requests' trajectories say when each ends; :func:`sidecar.kv.trajectory.
steps_until_fits` finds the first end after which the refused request fits beside what is left,
and the measured decode step time turns steps into seconds. Requests refused a moment ago are
coming back too: each refusal books the slot it was given (a trajectory that starts then), so
that the next refusal is told a later time instead of the same one, and a burst of clients that
honour Retry-After return in turn rather than all at once. A booking ends when its time has
passed (plus a grace) or when a request is admitted in its place.

Requests in flight, and booked ones, are taken to end where their class's answers likely end
(the learner's upper quartile; every class's answers while a class has few), not at their
reservation's end: a chat without
``max_tokens`` is reserved to the end of the context, and a client told to wait for that came back
long after the pool had emptied (BENCHMARKS.md: `--policy reject` lost most of the goodput on the
workloads whose answers end early). Told too early, a client is refused again with a new slot: one
round trip, against an idle pool.

A retry is the same request again (the official clients and gateways such as nginx resend the
same body): bookings carry the request's fingerprint (a digest of its body), and a request that
comes back takes its own booking out of the plan, whether it is admitted or refused again (then
it is booked anew). Without this, every refusal of one request stayed booked until its grace ran
out, and a burst of clients retrying pushed each other's slots out to the 60 s cap while the
pool sat idle (BENCHMARKS.md, the fleet run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.kv.ledger import Ledger, Reservation, likely_end
from sidecar.kv.trajectory import Columns, steps_until_fits

MIN_RETRY_AFTER = 1.0
MAX_RETRY_AFTER = 60.0
#: a booking outlives its slot by this share of its wait (and at least 2 s): the client's clock,
#: its retry jitter and the network stand between the slot and the request
_GRACE_SHARE = 0.5
_MIN_GRACE_S = 2.0
#: Retry-After is the slot's time times this, plus _LATE_S
_LATE_SHARE = 1.1
_LATE_S = 0.25
#: bookings kept at most (each one is a trajectory in every later plan)
MAX_BOOKINGS = 512


@dataclass(slots=True)
class _Booking:
    trajectories: Columns  # the refused request (it starts at its slot)
    slot_at: float  # monotonic time the client was told to come back
    expires_at: float
    key: int | None = None  # the request's fingerprint: its retry is recognised


class RetryPlanner:
    """Computes Retry-After for refusals and remembers the slots it handed out."""

    def __init__(self, ledger: Ledger, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self._clock = clock
        self._bookings: list[_Booking] = []

    def _live(self) -> list[_Booking]:
        now = self._clock()
        self._bookings = [b for b in self._bookings if b.expires_at > now]
        return self._bookings

    def admitted(self, key: int | None = None) -> None:
        """A request was admitted: its own booking (``key``), else the earliest booking whose
        slot has come, is used up."""
        if key is not None and self._forget(key):
            return
        now = self._clock()
        due = [b for b in self._live() if b.slot_at <= now]
        if due:
            self._bookings.remove(min(due, key=lambda b: b.slot_at))

    def _forget(self, key: int) -> bool:
        """Drop the booking of the request with fingerprint ``key``; whether there was one."""
        kept = [b for b in self._bookings if b.key != key]
        dropped = len(kept) != len(self._bookings)
        self._bookings = kept
        return dropped

    def plan(
        self,
        candidate: Reservation,
        *,
        ahead: Sequence[Reservation],
        budget_blocks: int | None,
        external_blocks: int,
        seconds_per_step: float | None,
        fallback: Callable[[], float],
        book: bool = True,
        key: int | None = None,
        likely: Callable[[str], int | None] | None = None,
    ) -> float:
        """Seconds until ``candidate`` would fit, after ``ahead`` (queued before it) and the
        requests refused before it; books that slot (unless ``book`` is False: a what-if, for
        choosing among several engines' pools). ``key``: the request's fingerprint; a booking it
        already had is its own, not another request's, and is replaced. ``likely``: a request
        class's likely answer length (a request in flight is then taken to end there, or at
        twice what it has once past it, within its reservation; else at its reservation's end)."""
        if book and key is not None:
            self._forget(key)
        if budget_blocks is None or seconds_per_step is None or seconds_per_step <= 0:
            return _clamp(fallback())
        now = self._clock()
        others = self.ledger.retry_columns(ahead, likely)
        for booking in self._live():
            if key is not None and booking.key == key:
                continue  # its own earlier slot (a what-if leaves it booked)
            steps_to_slot = max(0, round((booking.slot_at - now) / seconds_per_step))
            others.add_delayed(booking.trajectories, steps_to_slot)
        own = self.ledger.trajectories(
            [candidate], in_flight=False, likely_end=None if likely is None else likely_end(likely)
        )
        steps = steps_until_fits(others, own, budget_blocks - external_blocks, self.ledger.blocks)
        if steps is None:
            return _clamp(fallback())
        # a little late rather than early: the requests that make room must have ended and
        # been released when the client comes back, however the step time wavers
        seconds = _clamp(max(steps, 1) * seconds_per_step * _LATE_SHARE + _LATE_S)
        if book and len(self._bookings) < MAX_BOOKINGS:
            grace = max(_MIN_GRACE_S, _GRACE_SHARE * seconds)
            self._bookings.append(_Booking(own, now + seconds, now + seconds + grace, key))
        return seconds

    @property
    def bookings(self) -> int:
        return len(self._live())


def _clamp(seconds: float) -> float:
    return min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, seconds))
