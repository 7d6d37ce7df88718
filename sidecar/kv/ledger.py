"""The reservation ledger: the requests in flight, what each may reach and what each holds now.

One ledger per process (one event loop, no locks). Every admitted request holds a
:class:`Reservation` until its answer ends, fails or its client leaves; ``release`` is idempotent.
Each reservation keeps its trajectory: prompt tokens, progress, and the output tokens reserved
for it (its *ends*: ``max_tokens`` in worst-case mode, a learned length in expected mode).
:meth:`Ledger.trajectories` turns them into ``sidecar.kv.trajectory`` terms, with the full prompt
blocks that requests share (same chain hashes, ``sidecar.kv.prefix``) charged once, to the
sequence that lives longest; admission checks the peak over the future of their sum.

>>> from sidecar.kv.geometry import UniformBlocks
>>> from sidecar.kv.projection import project_counts
>>> blocks = UniformBlocks(128)
>>> ledger = Ledger(blocks)
>>> p = project_counts((200,), requested_max_tokens=100, n=1, max_model_len=1024, blocks=blocks)
>>> r = ledger.reserve(p, streamed=True)
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

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import cast

import numpy as np

from sidecar.kv.blocks import BlockMath
from sidecar.kv.crossing import tolerance_tokens
from sidecar.kv.lag import StreamLag, lag_blocks
from sidecar.kv.prefix import BlockHashes
from sidecar.kv.projection import Projection
from sidecar.kv.rows import Bound, Profile, Rows
from sidecar.kv.spread import SpreadRows
from sidecar.kv.trajectory import ArrayColumns, Columns

_NEVER = math.inf  # the remaining steps of a sequence not started yet: it may start any time


@dataclass(slots=True, eq=False)
class Reservation:
    """One admitted request's share of the KV cache."""

    id: int
    projection: Projection
    ends: tuple[int, ...]  # output tokens reserved per sequence, per prompt (<= max_tokens)
    reserved_blocks: int  # its blocks at its reserved ends (the promise, as a sum of peaks)
    predicted_blocks: int  # what vLLM should hold for it now (shared prompt blocks included)
    streamed: bool  # progress visible chunk by chunk (else estimated from vLLM's counters)
    admitted_at: float
    prefix: tuple[BlockHashes, ...] | None = None  # full prompt blocks' chain hashes, per prompt
    klass: str = ""  # the request class its answer length is learned in
    started: bool = False  # vLLM has the request (streamed: its first token arrived)
    started_at: float = 0.0
    generated: float = 0.0  # tokens generated per sequence so far: the larger of what its
    estimated: float = 0.0  # answer showed and its share of vLLM's generated tokens
    released: bool = field(default=False)
    engine: str = ""  # the data-parallel engine (its pool) the request was admitted on
    tenant: str = ""  # whose fair share it draws on (``sidecar.admission.tenants``)
    #: its blocks at admission, held in its tenant's use (and, at priority 0 or better, in
    #: what ``--priority-reserve`` counts as theirs) until it ends
    tenant_blocks: int = 0
    priority: int = 0  # its priority (lower first): priority 0 and better may use the reserve
    overran: bool = False  # it has generated its reserved end: its trajectory may pass its peak
    #: the same request reserved in the other engines' pools, when it cannot be sent to one
    #: engine (vLLM's coordinator then picks, and it may pick any)
    shadows: list[Reservation] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # its rows in the ledger's columns, per prompt
    #: per kept bound (``sidecar.kv.rows.Bound``; worst case second): the build it last moved
    #: under and its laid-out progress at that build
    marks: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    #: its blocks with every sequence at its reserved end (``Ledger.candidate``'s sum; -1: not
    #: known), what the kept bounds take for it while it has not run past an end
    laid_out: int = -1

    @property
    def peak_blocks(self) -> int:
        return self.projection.peak_blocks

    def end(self, i: int) -> int:
        """Output tokens prompt ``i``'s sequences may still be expected to reach: the reserved
        end, and past it (an answer longer than expected) twice what it has, up to max_tokens."""
        return widened(self.ends[i], self.projection.max_tokens[i], int(self.generated))


def widened(end: int, limit: int, done: int) -> int:
    """A sequence reserved to ``end`` that has generated ``done``: ``end``, and past it twice
    what it has, up to ``limit`` (its max_tokens)."""
    return min(limit, max(end, 2 * done)) if done >= end else end


def likely_end(likely: Callable[[str], int | None]) -> Callable[[Reservation, int], int]:
    """Where a request's sequence ``i`` likely ends: its class's ``likely`` length, or twice what
    it has generated once past that, within its reserved end."""

    def end(res: Reservation, i: int) -> int:
        reserved = res.end(i)
        length = likely(res.klass)
        if length is None:
            return reserved
        generated = int(res.generated)
        return min(reserved, length if generated < length else 2 * generated)

    return end


class Ledger:
    """Reservations of the requests in flight, with O(1) totals and a measured release rate."""

    def __init__(
        self,
        blocks: BlockMath,
        *,
        share_prefixes: bool = True,
        clock: Callable[[], float] = time.monotonic,
        rate_window_seconds: float = 30.0,
    ) -> None:
        self.blocks = blocks
        self.share_prefixes = share_prefixes  # vLLM's prefix caching is on
        self._clock = clock
        self._next_id = 0
        self._active: dict[int, Reservation] = {}
        self.reserved_blocks = 0
        self.predicted_blocks = 0
        self.peak_blocks = 0
        #: requests that have generated their reserved end (in flight): while there are none,
        #: every trajectory stays within its reserved blocks, and their sum bounds the future peak
        self.overruns = 0
        self._rate_window = rate_window_seconds
        self._freed: deque[tuple[float, int]] = deque()
        self._freed_sum = 0
        self._hold_seconds_ewma: float | None = None
        self._rows = Rows()
        self._uncapped = all(cap is None for cap in blocks.group_caps)
        #: bumped by every change to a trajectory: the profiles below are valid while it holds
        self.version = 0
        self.started_sequences = 0  # the sequences of started requests in flight
        #: the prompt blocks of the requests admitted but not started (vLLM may hold them now)
        self.unstarted_prompt_blocks = 0
        self.unstarted_sequences = 0  # ... and their sequences
        #: the blocks vLLM dropped for the started requests released so far (a running total:
        #: what vLLM holds fell by its growth since a scrape, ``sidecar.admission.pools``), less
        #: the prompt blocks another request in flight still holds (``_holders``)
        self.freed_total = 0
        self._holders: dict[int, int] = {}  # prefix chain hash -> requests in flight holding it
        #: (released at, first token at) of the streamed requests released since the last
        #: :meth:`prefill_share` (bounded: a scrape takes them every interval)
        self._first_tokens: deque[tuple[float, float]] = deque(maxlen=4096)
        self._profiles: dict[bool, tuple[int, Profile, int]] = {}
        self._bounds: dict[bool, Bound] = {}  # the profiles kept past changes, as upper bounds
        self._builds = 0
        self._crossing = (-1, 0, 0)  # (version, tolerance, :meth:`crossing_sequences`)
        #: how far behind vLLM the streams' visible progress was lately (``sidecar.kv.lag``)
        self.lag = StreamLag()

    def __len__(self) -> int:
        return len(self._active)

    def __iter__(self) -> Iterator[Reservation]:
        return iter(list(self._active.values()))

    def candidate(
        self,
        projection: Projection,
        *,
        streamed: bool,
        ends: Sequence[int] | None = None,
        prefix: tuple[BlockHashes, ...] | None = None,
        klass: str = "",
    ) -> Reservation:
        """A reservation for ``projection`` that is not in the ledger (yet): what
        :meth:`reserve` would add, for :meth:`trajectories` to weigh."""
        reserved_ends = tuple(projection.max_tokens if ends is None else ends)
        laid, reserved = self._at_ends(projection, reserved_ends)
        return Reservation(
            id=0,
            projection=projection,
            laid_out=laid,
            ends=reserved_ends,
            reserved_blocks=reserved,
            predicted_blocks=0,
            streamed=streamed,
            admitted_at=self._clock(),
            prefix=prefix if self.share_prefixes else None,
            klass=klass,
        )

    def _at_ends(self, projection: Projection, ends: Sequence[int]) -> tuple[int, int]:
        """Blocks with every sequence at ``ends``: laid out, and reserved (at least the prompt's
        for an exact count)."""
        laid = projection.n * sum(
            self.blocks.blocks_held(p + e, p, started=False)
            for p, e in zip(projection.prompt_tokens, ends, strict=True)
        )
        return laid, max(laid, projection.prompt_blocks) if projection.exact else laid

    def reserve(
        self,
        projection: Projection,
        *,
        streamed: bool,
        ends: Sequence[int] | None = None,
        prefix: tuple[BlockHashes, ...] | None = None,
        klass: str = "",
    ) -> Reservation:
        """Promise blocks to an admitted request. It holds none in vLLM until :meth:`start`."""
        return self.add(
            self.candidate(projection, streamed=streamed, ends=ends, prefix=prefix, klass=klass)
        )

    def add(self, res: Reservation) -> Reservation:
        """Enter a :meth:`candidate` into the ledger."""
        self._next_id += 1
        res.id = self._next_id
        res.admitted_at = self._clock()
        self._active[res.id] = res
        self.reserved_blocks += res.reserved_blocks
        if not res.started:
            self.unstarted_prompt_blocks += res.projection.prompt_blocks
            self.unstarted_sequences += res.projection.sequences
        holders = self._holders
        for hashes in res.prefix or ():
            for h in hashes:
                holders[h] = holders.get(h, 0) + 1
        self.peak_blocks += res.projection.peak_blocks
        self._rows.add(res, hashed=self.share_prefixes)
        self.version += 1
        for bound in self._bounds.values():
            bound.add(res)
        return res

    def start(self, res: Reservation) -> None:
        """vLLM holds the request's prompt now (its prefill ran, or it was handed over)."""
        if res.started or res.released:
            return
        res.started = True
        res.started_at = self._clock()
        self._set_predicted(res, res.projection.blocks_at(int(res.generated), self.blocks))
        if res.id in self._active:
            self.unstarted_prompt_blocks -= res.projection.prompt_blocks
            self.unstarted_sequences -= res.projection.sequences
            # laid out from its prompt until now, from what it has generated from now on
            self._moved(res, 0, int(res.generated), self._rows.update(res))
            self.version += 1
            self.started_sequences += res.projection.sequences

    def progressed(self, res: Reservation, generated_per_sequence: float) -> None:
        """A stream's own report of its progress: :meth:`advance`, and how far it moved in one
        report taken as how far behind vLLM it was (``sidecar.kv.lag``)."""
        moved = generated_per_sequence - res.generated
        if moved > 1 and res.started and not res.released:  # a token a report: never behind
            self.lag.jumped(moved, now=self._clock())
        self.advance(res, generated_per_sequence)

    def lag_tokens(self) -> float:
        """The most tokens per sequence a stream's visible progress was behind vLLM's lately
        (``sidecar.kv.lag``)."""
        return self.lag.tokens(now=self._clock())

    def lag_blocks(self) -> int:
        """The most blocks the started requests may hold at one step beyond their laid-out
        trajectories, their streams as far behind vLLM as any was lately
        (``sidecar.kv.lag``): 0 while every report moves a stream by one token."""
        return lag_blocks(
            self.lag_tokens(),
            sequences=self.started_sequences,
            block_size=self.blocks.block_size,
            groups=len(self.blocks.group_caps),
        )

    def advance(self, res: Reservation, generated_per_sequence: float) -> None:
        """Record generation progress; a request past its reservation grows it."""
        if res.released or generated_per_sequence <= res.generated:
            return
        before = int(res.generated)
        whole = before != int(generated_per_sequence)
        res.generated = generated_per_sequence
        tracked = res.id in self._active
        if not res.overran and tracked and generated_per_sequence >= min(res.ends):
            res.overran = True
            self.overruns += 1
        if tracked and whole:
            moved = self._rows.update(res)
            if res.started:
                self._moved(res, before, int(generated_per_sequence), moved)
            elif moved:
                self._moved(res, 0, 0, moved)
            self.version += 1
        if not res.started:
            return  # counted from its start
        self._set_predicted(res, res.projection.blocks_at(int(generated_per_sequence), self.blocks))

    def revise(self, res: Reservation, ends: Sequence[int]) -> None:
        """Lower the reserved ends of a request in flight (``sidecar.admission.ends.Ends.
        revised``): its reserved and laid-out blocks follow, the kept non-worst-case bound is
        dropped (an end moved); its tenant's blocks stay those it was admitted with."""
        ends = tuple(ends)
        if res.released or res.id not in self._active or ends == res.ends:
            return
        laid, reserved = self._at_ends(res.projection, ends)
        reserved = max(reserved, res.predicted_blocks)
        res.ends = ends
        res.laid_out = laid
        self.reserved_blocks += reserved - res.reserved_blocks
        res.reserved_blocks = reserved
        if not res.overran and res.generated >= min(ends):
            res.overran = True
            self.overruns += 1
        self._rows.update(res)
        done = int(res.generated) if res.started else 0
        self._moved(res, done, done, True)
        self.version += 1

    def whole(self, klass: Callable[[str], bool]) -> list[Reservation]:
        """The requests in flight of a class ``klass`` picks with a sequence laid out to its
        max_tokens (``sidecar.kv.rows.Rows.whole``)."""
        return cast(list[Reservation], self._rows.whole(klass))  # the rows' owners are ours

    def _set_predicted(self, res: Reservation, predicted: int) -> None:
        if predicted != res.predicted_blocks:
            self.predicted_blocks += predicted - res.predicted_blocks
            res.predicted_blocks = predicted
            if predicted > res.reserved_blocks:
                self.reserved_blocks += predicted - res.reserved_blocks
                res.reserved_blocks = predicted

    def release(self, res: Reservation) -> int:
        """Give the reservation's blocks back; returns the blocks freed (0 if already released)."""
        if res.released or res.id not in self._active:
            return 0
        res.released = True
        del self._active[res.id]
        self._moved(res, 0, 0, False, gone=True)
        self._rows.remove(res)
        self.version += 1
        if res.started:
            self.started_sequences -= res.projection.sequences
        else:
            self.unstarted_prompt_blocks -= res.projection.prompt_blocks
            self.unstarted_sequences -= res.projection.sequences
        # its prompt blocks another request in flight still holds, and those its own n
        # sequences held once (vLLM shares full prompt blocks between a request's sequences)
        kept = 0
        holders = self._holders
        for hashes in res.prefix or ():
            kept += (res.projection.n - 1) * len(hashes)
            for h in hashes:
                left = holders.get(h, 0) - 1
                if left > 0:
                    holders[h] = left
                    kept += 1
                else:
                    holders.pop(h, None)
        if res.started:
            self.freed_total += max(0, res.predicted_blocks - kept)
        if res.overran:
            self.overruns -= 1
        now = self._clock()
        if res.started and res.streamed:
            self._first_tokens.append((now, res.started_at))
        self.reserved_blocks -= res.reserved_blocks
        self.predicted_blocks -= res.predicted_blocks
        self.peak_blocks -= res.projection.peak_blocks
        held = now - res.admitted_at
        self._hold_seconds_ewma = (
            held if self._hold_seconds_ewma is None else 0.8 * self._hold_seconds_ewma + 0.2 * held
        )
        self._freed.append((now, res.reserved_blocks))
        self._freed_sum += res.reserved_blocks
        self._trim(now)
        return res.reserved_blocks

    def prefill_share(self, since: float, window: float) -> float | None:
        """Of the streamed requests released after ``since``, the prefill steps they took over
        their number (at most 1; None where none was): their first tokens grouped where each
        came less than ``window`` after the one before (requests prefilled in one step get
        theirs together; steps apart are a decode step apart at least). Forgets what it read.

        vLLM reports each request's prefill time when the request finishes, and requests
        prefilled together in one step each report that whole step
        (``sidecar.admission.costs``): this is the share of the interval's reports that are
        steps of their own.

        >>> from sidecar.kv.geometry import UniformBlocks
        >>> ledger = Ledger(UniformBlocks(16))
        >>> ledger._first_tokens.extend([(5.0, 1.0), (5.0, 1.001), (5.1, 1.002), (5.2, 2.0)])
        >>> ledger.prefill_share(4.0, window=0.005), ledger.prefill_share(4.0, window=0.005)
        (0.5, None)
        """
        firsts = sorted(first for released, first in self._first_tokens if released > since)
        self._first_tokens.clear()
        if not firsts:
            return None
        steps = 1 + sum(1 for a, b in pairwise(firsts) if b - a >= window)
        return steps / len(firsts)

    # --- the future --------------------------------------------------------------------------

    def profile(self, *, worst_case: bool = False) -> Profile:
        """The in-flight requests' demand profile (``sidecar.kv.rows``), kept until the ledger
        changes."""
        cached = self._profiles.get(worst_case)
        crossing = self.crossing_sequences()
        if cached is not None and cached[0] == self.version and cached[2] == crossing:
            return cached[1]
        profile = self._rows.profile(
            self.blocks, worst_case=worst_case, share=self.share_prefixes, crossing=crossing
        )
        self._profiles[worst_case] = (self.version, profile, crossing)
        self._builds += 1
        self._bounds[worst_case] = Bound(profile, self._builds, [])
        return profile

    def _moved(
        self, res: Reservation, before: int, after: int, end_moved: bool, *, gone: bool = False
    ) -> None:
        """``res`` changed: its laid-out progress went from ``before`` to ``after`` tokens per
        sequence, a reserved end moved, or (``gone``) it was released. The kept bounds take
        the most it can add and the most it can take away (``sidecar.kv.rows.Bound``)."""
        for worst_case, bound in self._bounds.items():
            if not bound.valid:
                continue
            if end_moved and not worst_case:  # the worst case lays out max_tokens: it never moves
                bound.valid = False
                continue
            k = 2 * worst_case
            if res.marks[k] != bound.serial:  # its first change since the build
                res.marks[k] = bound.serial
                res.marks[k + 1] = before
                if not (gone and bound.discard(res)):
                    bound.drop += self._laid_out_blocks(res, worst_case)
            elif gone:
                bound.discard(res)
            if gone:
                continue
            base = res.marks[k + 1]
            grown = self.blocks.blocks_for_tokens(after - base)
            grown -= self.blocks.blocks_for_tokens(before - base)
            bound.slack += res.projection.sequences * grown

    def _laid_out_blocks(self, res: Reservation, worst_case: bool) -> int:
        """The most blocks ``res`` is laid out to hold (at its ends)."""
        if not worst_case and not res.overran and res.laid_out >= 0:
            return res.laid_out  # short of every reserved end: its ends are the reserved ones
        p = res.projection
        return p.n * sum(
            self.blocks.blocks_for_tokens(prompt + (p.max_tokens[i] if worst_case else res.end(i)))
            for i, prompt in enumerate(p.prompt_tokens)
        )

    def peak_bounds(
        self, *extra: Reservation, worst_case: bool = False, coarse: bool = False
    ) -> tuple[int, int]:
        """The least and the most :meth:`peak_with` can be: both the exact peak when the ledger
        is unchanged since its profile was built, else the kept profile's bounds after the
        changes since (``sidecar.kv.rows.Bound``), and the exact peak where those were
        dropped. A decision the bounds settle needs no rebuild. ``coarse``: looser bounds
        without a pass over the profile (``sidecar.kv.rows.Profile.coarse_with``), the ledger
        changed or not; ask them first, and the others only where they do not settle it."""
        cached = self._profiles.get(worst_case)
        bound = self._bounds.get(worst_case)
        if self._uncapped and bound is not None and bound.valid:
            if coarse:  # a bound kept since the last build (a fresh one if nothing changed)
                return bound.peak_with(extra, self.blocks, worst_case=worst_case, coarse=True)
            if cached is None or cached[0] != self.version:
                return bound.peak_with(extra, self.blocks, worst_case=worst_case)
        peak = self.peak_with(*extra, worst_case=worst_case)
        return peak, peak

    def retry_columns(
        self, extra: Sequence[Reservation], likely: Callable[[str], int | None] | None
    ) -> Columns | ArrayColumns:
        """:meth:`trajectories` of the requests in flight and ``extra`` (queued ahead of a
        refused request) for Retry-After, with ``likely_end`` from a class's ``likely`` length
        (``sidecar.admission.learner``), from the kept columns. ``extra`` count their shared
        prompt blocks only among themselves (an upper bound where they share with requests in
        flight)."""
        ends = None if likely is None else likely_end(likely)
        arrays, gone = self._rows.retry_arrays(self.blocks, likely, share=self.share_prefixes)
        if not extra:
            return ArrayColumns(arrays, gone)
        queued = self.trajectories(extra, in_flight=False, likely_end=ends)
        held, left, weight, wshared, prompt, end, w_weight, w_wshared = arrays
        _, _, _, _, q_prompt, q_end, q_weight, q_wshared = queued.arrays()
        return ArrayColumns(
            (
                held,
                left,
                weight,
                wshared,
                np.concatenate([prompt, q_prompt]),
                np.concatenate([end, q_end]),
                np.concatenate([w_weight, q_weight]),
                np.concatenate([w_wshared, q_wshared]),
            ),
            gone,
        )

    def spread_rows(self, window_of: Callable[[str], int], *extra: Reservation) -> SpreadRows:
        """The requests in flight (and ``extra``, not started) as ``sidecar.kv.spread`` rows;
        ``window_of``: a class's index among the windows of learned lengths (-1: none)."""
        rows = self._rows
        n = rows.n
        by_class = np.array([window_of(k) for k in rows.classes] or [-1], dtype=np.int64)
        out = SpreadRows(
            rows.prompt[:n].copy(),
            rows.done[:n].copy(),
            rows.end[:n].copy(),
            rows.max_end[:n].copy(),
            rows.weight[:n].copy(),
            rows.started[:n].copy(),
            by_class[rows.klass[:n]],
        )
        for res in extra:
            p = res.projection
            k = len(p.prompt_tokens)
            out = out.joined(
                SpreadRows.of(
                    p.prompt_tokens,
                    [0] * k,
                    res.ends,
                    p.max_tokens,
                    [p.n] * k,
                    [False] * k,
                    [window_of(res.klass)] * k,
                )
            )
        return out

    def peak_with(self, *extra: Reservation, worst_case: bool = False) -> int:
        """The most blocks the requests in flight and ``extra`` (candidates, not started) can
        hold at once from now: :func:`sidecar.kv.trajectory.future_peak` of
        :meth:`trajectories`, from the columns the ledger keeps (:meth:`profile`: the state
        groups' crossings included)."""
        profile = self.profile(worst_case=worst_case)
        if not extra:
            return profile.peak
        return profile.peak_with(extra, self.blocks, worst_case=worst_case)

    def crossing_sequences(self) -> int:
        """The most started sequences that may cross a block boundary at one step, holding
        their recurrent-state groups' second blocks then (``sidecar.kv.crossing``; 0 for a
        model without such groups)."""
        if self.blocks.crossing_blocks == 0 or self.started_sequences == 0:
            return 0
        tolerance = tolerance_tokens(self.lag_tokens())
        cached = self._crossing
        if cached[:2] == (self.version, tolerance):
            return cached[2]
        sequences = self._rows.crossing_sequences(self.blocks.block_size, tolerance)
        self._crossing = (self.version, tolerance, sequences)
        return sequences

    def crossing_blocks(self) -> int:
        """The most blocks the started sequences hold at one future step beyond what their
        trajectories lay out (each decoding state group at one block): :meth:`profile` counts
        them where it is built, a figure computed apart adds these."""
        return self.blocks.crossing_blocks * self.crossing_sequences()

    def trajectories(
        self,
        extra: Iterable[Reservation] = (),
        *,
        worst_case: bool = False,
        started_only: bool = False,
        in_flight: bool = True,
        likely_end: Callable[[Reservation, int], int] | None = None,
    ) -> Columns:
        """The in-flight requests (and ``extra`` candidates, not started) as trajectories.

        ``worst_case`` takes every request to its ``max_tokens`` instead of its reserved end;
        ``started_only`` keeps what vLLM runs now (for the prediction of what it holds);
        ``in_flight=False`` leaves the ledger's own requests out (``extra`` alone);
        ``likely_end(res, i)``: where a started request in flight, or a candidate, will likely end
        (Retry-After's guess of when room is made): kept beside each trajectory as the steps
        until it is gone, while the trajectory itself still runs to its reserved end.
        """
        groups: list[tuple[Reservation, int, int, int, float]] = []  # res, i, generated, end, left
        gone: list[int | None] = []  # per group: steps until it likely ends (None: at its end)
        active = tuple(self._active.values()) if in_flight else ()
        for k, res in enumerate((*active, *extra)):
            if started_only and not res.started:
                continue
            started = res.started and res.id != 0
            done = int(res.generated) if started else 0
            # a request in flight that has not started is held at its worst: never freed
            likely = likely_end if started or k >= len(active) else None
            for i in range(len(res.projection.prompt_tokens)):
                end = res.projection.max_tokens[i] if worst_case else res.end(i)
                done_i = min(done, end)
                groups.append((res, i, done_i, end, end - done_i if started else _NEVER))
                gone.append(
                    max(0, min(end, likely(res, i)) - done_i) if likely is not None else None
                )
        owners = self._prefix_owners(groups)
        out = Columns()
        for k, (res, i, done, end, left) in enumerate(groups):
            prompt = res.projection.prompt_tokens[i]
            n = res.projection.n
            started = left != _NEVER
            hashes = res.prefix[i] if res.prefix is not None and owners is not None else ()
            elsewhere = sum(1 for h in hashes if owners is not None and owners[h][1] != k)
            if hashes and n > 1:
                # the n sequences of one prompt share its blocks: one holds them, n - 1 do not
                out.add(prompt, done, end, started, 1, elsewhere, gone[k])
                out.add(prompt, done, end, started, n - 1, len(hashes), gone[k])
            else:
                out.add(prompt, done, end, started, n, elsewhere, gone[k])
        return out

    def _prefix_owners(
        self, groups: Sequence[tuple[Reservation, int, int, int, float]]
    ) -> dict[int, tuple[float, int]] | None:
        """For each shared block hash, the group that holds it longest (left, index)."""
        if not self.share_prefixes or any(cap is not None for cap in self.blocks.group_caps):
            return None  # no prefix cache, or sliding-window groups that drop old blocks
        owners: dict[int, tuple[float, int]] = {}
        for k, (res, i, _, _, left) in enumerate(groups):
            if res.prefix is None:
                continue
            for h in res.prefix[i]:
                seen = owners.get(h)
                if seen is None or left > seen[0]:
                    owners[h] = (left, k)
        return owners

    def most_advanced(self, sequences: int) -> list[Reservation]:
        """The started requests in flight that have generated the most of their longest
        ``max_tokens``, the most first, at least enough of them to hold ``sequences`` sequences
        where there are so many."""
        ranked = self._rows.most_advanced(sequences)
        if ranked is not None:
            return cast(list[Reservation], ranked)  # the rows' owners are ours
        return heapq.nlargest(
            sequences,
            (r for r in self._active.values() if r.started),
            key=lambda r: r.generated / max(max(r.projection.max_tokens), 1),
        )

    def oldest_unstarted(self, sequences: int) -> list[Reservation]:
        """The requests admitted but not started, the oldest first, at least enough of them to
        hold ``sequences`` sequences where there are so many. They are the newest in the
        ledger, so it is read from its end (admission order is ``admitted_at`` order)."""
        if sequences <= 0 or self.unstarted_sequences <= 0:
            return []
        tail: list[Reservation] = []
        left = self.unstarted_sequences
        for res in reversed(self._active.values()):
            if not res.started:
                tail.append(res)
                left -= res.projection.sequences
                if left <= 0:
                    break
        tail.reverse()
        taken, out = 0, []
        for res in tail:
            if taken >= sequences:
                break
            out.append(res)
            taken += res.projection.sequences
        return out

    def shared_blocks_now(self) -> int:
        """Prompt blocks of running requests that vLLM holds once for several of them."""
        if not self._uncapped or not self.share_prefixes:
            return 0  # no prefix cache, or sliding-window groups that drop old blocks
        return self._rows.shared_started()

    # --- rates ---------------------------------------------------------------------------------

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
