"""Retry-After from trajectories: when would a refused request fit?

The in-flight requests' trajectories say when each ends; :func:`sidecar.kv.trajectory.
steps_until_fits` finds the first end after which the refused request fits beside what is left,
and the measured decode step time turns steps into seconds. Requests refused a moment ago are
coming back too: each refusal books the slot it was given (a trajectory that starts then), so
that the next refusal is told a later time instead of the same one, and a burst of clients that
honour Retry-After return in turn rather than all at once. The requests queued ahead of it
start in turn, each where it first fits beside those before it, and then end as the requests in
flight do: laid out together, as if all of them started at once, a few long ones ahead of it
outweighed the budget, and the planner found no bound and fell back to the release rate, which
early in a run is low and gives a long wait. A booking ends when its time has passed (plus a
grace), when a request is admitted in its place, or, while nothing confirms that its request is
coming back, after a short hold (below).

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

A booking must not outlive the evidence that its request is coming back. Behind a gateway that
retries another replica on 429 (nginx's ``proxy_next_upstream http_429``), most refused requests
are served there and never return; their bookings piled up and pushed every later slot to the
60 s cap. So a booking is **provisional** at first: it counts in later plans for
:data:`PROVISIONAL_HOLD_S` (or until its slot, if that comes sooner), long enough to space out a
burst refused together, and then stops counting. It is **confirmed** when its request comes back
(the same fingerprint, refused again while the sidecar still remembers it): a confirmed booking
counts until its slot plus the grace, as every booking did before. The fingerprint is remembered
until the slot plus the grace either way, so a client that honours Retry-After (the official
``openai`` client sleeps exactly what ``retry-after-ms`` or ``Retry-After`` says, up to two
minutes in openai 3.57, and retries twice by default) is recognised when it returns at its slot,
however long after the hold that is; its new booking keeps the old one's place in line (the
requests refused after it were told to come after it, and do not push it back). A request
admitted takes its own booking out, confirmed or not.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.kv.ledger import Ledger, Reservation, likely_end
from sidecar.kv.trajectory import ArrayColumns, Columns, steps_until_fits

MIN_RETRY_AFTER = 1.0
MAX_RETRY_AFTER = 60.0
#: a booking outlives its slot by this share of its wait (and at least 2 s): the client's clock,
#: its retry jitter and the network stand between the slot and the request
_GRACE_SHARE = 0.5
_MIN_GRACE_S = 2.0
#: Retry-After is the slot's time times this, plus _LATE_S
_LATE_SHARE = 1.1
_LATE_S = 0.25
#: bookings kept at most (each one that counts is a trajectory in every later plan)
MAX_BOOKINGS = 512
#: seconds a booking counts in later plans before its request is seen again (or until its slot, if
#: sooner): a burst refused together is refused within about a second, and a gateway retries
#: another replica within milliseconds
PROVISIONAL_HOLD_S = 3.0
#: requests queued ahead of a refused one that its plan starts one at a time (each where it first
#: fits); beyond this many, all of them are laid out together with it, as if they started with it.
#: Each costs a fit test: 16 ahead of one request beside 266 in flight took 6.6 ms a plan against
#: 0.8 ms laid out together (a hand check on the 2-core development machine)
MAX_PLACED = 16


def fingerprint(body: bytes) -> int:
    """A request's fingerprint: a digest of its body, the same in every process (``hash`` of
    bytes is salted per process, and a retry may reach another relay worker)."""
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "big")


@dataclass(slots=True)
class _Booking:
    trajectories: Columns  # the refused request (it starts at its slot)
    slot_at: float  # monotonic time the client was told to come back
    expires_at: float  # its slot plus the grace: remembered (and, confirmed, counted) until then
    key: int | None = None  # the request's fingerprint: its retry is recognised
    held_until: float = 0.0  # provisional: counted in plans until then
    confirmed: bool = False  # its request came back (refused again): counted until expires_at
    rank: int = 0  # its place in line: bookings made after it were told to come after it

    def counts(self, now: float) -> bool:
        """Whether the booking stands in later plans at ``now``."""
        return now < (self.expires_at if self.confirmed else self.held_until)


class RetryPlanner:
    """Computes Retry-After for refusals and remembers the slots it handed out."""

    def __init__(self, ledger: Ledger, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self._clock = clock
        self._bookings: list[_Booking] = []
        self._ranks = 0  # bookings made: the next one's place in line

    def _live(self) -> list[_Booking]:
        """The bookings remembered (their request may still come back and be recognised)."""
        now = self._clock()
        self._bookings = [b for b in self._bookings if b.expires_at > now]
        return self._bookings

    def _counted(self) -> list[_Booking]:
        """The bookings that stand in plans now: provisional ones within their hold, confirmed
        ones until their slot plus the grace."""
        now = self._clock()
        return [b for b in self._live() if b.counts(now)]

    def admitted(self, key: int | None = None) -> None:
        """A request was admitted: its own booking (``key``), else the earliest booking whose
        slot has come, is used up."""
        if not self._bookings:
            return
        if key is not None and self._forget(key):
            return
        now = self._clock()
        due = [b for b in self._counted() if b.slot_at <= now]
        if due:
            self._bookings.remove(min(due, key=lambda b: b.slot_at))

    def _forget(self, key: int) -> bool:
        """Drop the booking of the request with fingerprint ``key``; whether one was remembered."""
        kept = [b for b in self._live() if b.key != key]
        dropped = len(kept) != len(self._bookings)
        self._bookings = kept
        return dropped

    def wait_steps(
        self,
        candidate: Reservation,
        *,
        ahead: Sequence[Reservation],
        budget_blocks: int | None,
        external_blocks: int,
        likely: Callable[[str], int | None] | None = None,
    ) -> int | None:
        """Decode steps until ``candidate`` would fit if it were queued now, behind ``ahead``:
        :meth:`plan`'s steps without the bookings (a request queued now is served before any
        refused request that comes back later) and without Retry-After's margin. The requests
        queued ahead start in turn (:meth:`_steps`). None: the trajectories cannot bound it (the
        budget is unknown, or a request never fits even alone). Requests admitted and not started
        by vLLM yet are laid out as starting now (``sidecar.kv.rows``)."""
        if budget_blocks is None:
            return None
        others, queued = self._columns(ahead, likely)
        own = self._own(candidate, likely)
        return self._steps(
            others, queued, own, self._budget(budget_blocks, external_blocks), likely
        )

    def _columns(
        self, ahead: Sequence[Reservation], likely: Callable[[str], int | None] | None
    ) -> tuple[Columns | ArrayColumns, Sequence[Reservation]]:
        """The in-flight trajectories, and the requests queued ahead left to :meth:`_steps` to
        start in turn (all of them together with the candidate, beyond :data:`MAX_PLACED`)."""
        if len(ahead) > MAX_PLACED:
            return self.ledger.retry_columns(ahead, likely), ()
        return self.ledger.retry_columns((), likely), ahead

    def _steps(
        self,
        others: Columns | ArrayColumns,
        queued: Sequence[Reservation],
        candidate: Columns,
        budget: int,
        likely: Callable[[str], int | None] | None,
        booked: Sequence[tuple[Columns, int]] = (),
    ) -> int | None:
        """Steps until ``candidate`` (its trajectories) fits beside ``others`` once ``queued``
        (ahead of it, in order) have started: each starts where it first fits beside what
        started before it, and no sooner than the one ahead of it (the queue tries its head
        only), and then runs as the requests in flight do, to where its class's answers likely
        end. ``booked``: refused requests coming back (each starting that many steps from now),
        laid out after the queued ones, which are served before them. None: one of them never
        fits."""
        start = 0
        for res in queued:
            own = self._own(res, likely)
            at = steps_until_fits(others, own, budget, self.ledger.blocks, not_before=start)
            if at is None:
                return None
            others.add_delayed(own, at)
            start = at
        for trajectories, steps_to_slot in booked:
            others.add_delayed(trajectories, steps_to_slot)
        return steps_until_fits(others, candidate, budget, self.ledger.blocks, not_before=start)

    def _budget(self, budget_blocks: int, external_blocks: int) -> int:
        """What the trajectories may hold: the budget less what vLLM holds beyond the ledger and
        the state groups' crossings (``sidecar.kv.crossing``), which they do not lay out."""
        return budget_blocks - external_blocks - self.ledger.crossing_blocks()

    def _own(self, candidate: Reservation, likely: Callable[[str], int | None] | None) -> Columns:
        ends = None if likely is None else likely_end(likely)
        return self.ledger.trajectories([candidate], in_flight=False, likely_end=ends)

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
        already had is its own, not another request's, and is replaced, in its place in line:
        the bookings made after it do not push it back. ``likely``: a request
        class's likely answer length (a request in flight is then taken to end there, or at
        twice what it has once past it, within its reservation; else at its reservation's end)."""
        # its request came back: the evidence that confirms its new booking, which keeps the
        # old one's place in line (the requests refused after it were told to come after it)
        mine = self._booking_of(key)
        if book and key is not None:
            self._forget(key)
        now = self._clock()
        if budget_blocks is None or seconds_per_step is None or seconds_per_step <= 0:
            return self._fallback(fallback, now, book, key, mine)
        others, queued = self._columns(ahead, likely)
        booked = [
            (b.trajectories, max(0, round((b.slot_at - now) / seconds_per_step)))
            for b in self._counted()
            # not its own earlier slot (a what-if leaves it booked), nor those refused after
            # it (told to come back after it)
            if (key is None or b.key != key) and (mine is None or b.rank <= mine.rank)
        ]
        own = self._own(candidate, likely)
        budget = self._budget(budget_blocks, external_blocks)
        steps = self._steps(others, queued, own, budget, likely, booked)
        if steps is None:
            return self._fallback(fallback, now, book, key, mine)
        # a little late rather than early: the requests that make room must have ended and
        # been released when the client comes back, however the step time wavers
        seconds = _clamp(max(steps, 1) * seconds_per_step * _LATE_SHARE + _LATE_S)
        if book:
            self._book(own, now, seconds, key, mine)
        return seconds

    def remembers(self, key: int | None) -> bool:
        """Whether a request with fingerprint ``key`` was refused here and its booking is still
        remembered: the request has come back (its client's retry)."""
        return self._booking_of(key) is not None

    def _fallback(
        self,
        fallback: Callable[[], float],
        now: float,
        book: bool,
        key: int | None,
        old: _Booking | None,
    ) -> float:
        """Retry-After where the trajectories give none (no step time, or a wait they cannot
        bound): ``fallback``'s, the request's fingerprint remembered with no trajectory (it
        holds no slot in later plans), so that its retry is still known as one."""
        seconds = _clamp(fallback())
        if book and key is not None:
            self._book(Columns(), now, seconds, key, old)
        return seconds

    def _booking_of(self, key: int | None) -> _Booking | None:
        """The booking remembered for the request with fingerprint ``key``, if any."""
        if key is None:
            return None
        return next((b for b in self._live() if b.key == key), None)

    def _book(
        self, own: Columns, now: float, seconds: float, key: int | None, old: _Booking | None
    ) -> None:
        """Book the refused request's slot; ``old``: its earlier booking (it came back: the new
        one is confirmed, in the old one's place)."""
        if len(self._bookings) >= MAX_BOOKINGS:
            # make room by forgetting what no longer counts (remembered only to recognise a
            # retry), the oldest first
            stale = sorted(
                (b for b in self._bookings if not b.counts(now)), key=lambda b: b.slot_at
            )
            for booking in stale[: len(self._bookings) - MAX_BOOKINGS + 1]:
                self._bookings.remove(booking)
            if len(self._bookings) >= MAX_BOOKINGS:
                return
        grace = max(_MIN_GRACE_S, _GRACE_SHARE * seconds)
        held = now + min(PROVISIONAL_HOLD_S, seconds)
        if old is None:
            self._ranks += 1
        rank = old.rank if old is not None else self._ranks
        self._bookings.append(
            _Booking(own, now + seconds, now + seconds + grace, key, held, old is not None, rank)
        )

    @property
    def bookings(self) -> int:
        """Bookings that stand in plans now."""
        return len(self._counted())

    @property
    def remembered(self) -> int:
        """Bookings remembered, counted or not (a retry of their request is recognised)."""
        return len(self._live())


def _clamp(seconds: float) -> float:
    return min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, seconds))
