"""The in-flight sequences as numpy columns, kept as requests are admitted, start, advance and
end, so that admission lays out no trajectory per decision.

The ledger (``sidecar.kv.ledger``) owns one :class:`Rows`: a row per prompt of each reservation
(its ``n`` sequences as the row's weight), with the prompt, the tokens generated, the reserved end
and ``max_tokens``. :meth:`Rows.arrays` turns them into the columns ``sidecar.kv.trajectory``
computes the demand profile on, with the full prompt blocks that sequences share charged once,
to the sequence that lives longest, as :meth:`sidecar.kv.ledger.Ledger.trajectories` does.

A :class:`Profile` is that demand at every end of a started sequence, with what is needed to add
unstarted candidates to it exactly: a candidate is never freed (it may start at any moment), so
it only adds its own growth at each of the profile's steps, less the prompt blocks it shares with
sequences still alive then. Adding candidates to a profile costs ``O(steps)``; building one,
``O(n log n)`` in numpy.

>>> from sidecar.kv.geometry import UniformBlocks
>>> from sidecar.kv.ledger import Ledger
>>> from sidecar.kv.projection import project_counts
>>> blocks = UniformBlocks(16)
>>> ledger = Ledger(blocks)
>>> p = project_counts((64,), requested_max_tokens=64, n=1, max_model_len=1024, blocks=blocks)
>>> r = ledger.reserve(p, streamed=True); ledger.start(r); ledger.advance(r, 60)
>>> ledger.peak_with(ledger.candidate(p, streamed=True))  # 8 + 5 as the old one ends
13
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from sidecar.kv.blocks import BlockMath
from sidecar.kv.crossing import crossing_sequences
from sidecar.kv.prefix import BlockHashes
from sidecar.kv.projection import Projection
from sidecar.kv.trajectory import Arrays, IntArray, _blocks, _profile, _suffix


class Reservation(Protocol):
    """What the columns read of a ``sidecar.kv.ledger.Reservation``."""

    projection: Projection
    prefix: tuple[BlockHashes, ...] | None
    klass: str
    started: bool
    streamed: bool
    generated: float
    rows: list[int]

    def end(self, i: int) -> int: ...


#: an unstarted sequence's remaining steps in the prefix-owner order: it may never be freed
_FOREVER = math.inf


_COLUMNS = (
    "prompt",
    "done",
    "end",
    "max_end",
    "weight",
    "nhash",
    "started",
    "streamed",
    "klass",
)


class Rows:
    """Dense numpy columns, one row per (reservation, prompt); removal moves the last row into
    the hole, so that the columns stay contiguous."""

    __slots__ = (
        "classes",
        "done",
        "end",
        "klass",
        "max_end",
        "multi",
        "n",
        "nhash",
        "owner",
        "prefixed",
        "prompt",
        "started",
        "streamed",
        "weight",
    )

    def __init__(self, capacity: int = 64) -> None:
        self.n = 0
        self.prompt = np.zeros(capacity, dtype=np.int64)
        self.done = np.zeros(capacity, dtype=np.int64)  # int(generated) per sequence
        self.end = np.zeros(capacity, dtype=np.int64)  # the reserved end (res.end(i))
        self.max_end = np.zeros(capacity, dtype=np.int64)  # max_tokens
        self.weight = np.zeros(capacity, dtype=np.int64)  # sequences (n)
        self.nhash = np.zeros(capacity, dtype=np.int64)  # full prompt blocks with a chain hash
        self.started = np.zeros(capacity, dtype=bool)
        self.streamed = np.zeros(capacity, dtype=bool)  # progress seen (else estimated)
        self.klass = np.zeros(capacity, dtype=np.int64)  # the request class, in ``classes``
        self.classes: dict[str, int] = {}
        self.owner: list[tuple[Reservation, int]] = []
        self.prefixed = 0  # rows with chain hashes (prefix sharing to work out)
        self.multi = 0  # rows past a reservation's first (requests with several prompts)

    def __len__(self) -> int:
        return self.n

    def _grow(self) -> None:
        size = 2 * len(self.prompt)
        for name in _COLUMNS:
            old = getattr(self, name)
            new = np.zeros(size, dtype=old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def add(self, res: Reservation, hashed: bool) -> None:
        """Rows for every prompt of ``res`` (not started); their indices go to ``res.rows``."""
        p = res.projection
        res.rows = []
        for i, prompt in enumerate(p.prompt_tokens):
            if self.n == len(self.prompt):
                self._grow()
            r = self.n
            self.n += 1
            self.prompt[r] = prompt
            self.done[r] = int(res.generated)
            self.end[r] = res.end(i)
            self.max_end[r] = p.max_tokens[i]
            self.weight[r] = p.n
            hashes = len(res.prefix[i]) if hashed and res.prefix is not None else 0
            self.nhash[r] = hashes
            self.prefixed += hashes > 0
            self.started[r] = res.started
            self.streamed[r] = res.streamed
            self.klass[r] = self.classes.setdefault(res.klass, len(self.classes))
            self.owner.append((res, i))
            self.multi += i > 0
            res.rows.append(r)

    def update(self, res: Reservation) -> bool:
        """``res`` started or advanced: its rows' progress, started flag and reserved end.
        Returns whether a reserved end moved."""
        done = int(res.generated)
        started = res.started
        moved = False
        for i, r in enumerate(res.rows):
            self.done[r] = done
            end = res.end(i)
            if self.end[r] != end:
                moved = True
                self.end[r] = end
            if self.started[r] != started:
                self.started[r] = started
        return moved

    def whole(self, klass: Callable[[str], bool]) -> list[Reservation]:
        """The requests with a row of a class ``klass`` picks laid out to its max_tokens (one
        vectorised pass: every scrape asks, ``sidecar.admission.pools.Pools.revise``)."""
        picked = [i for name, i in self.classes.items() if klass(name)]
        n = self.n
        if not picked or not n:
            return []
        hit = np.flatnonzero((self.end[:n] == self.max_end[:n]) & np.isin(self.klass[:n], picked))
        found: dict[int, Reservation] = {}
        for r in hit:
            res = self.owner[r][0]
            found[id(res)] = res
        return list(found.values())

    def remove(self, res: Reservation) -> None:
        for r in sorted(res.rows, reverse=True):
            self.prefixed -= self.nhash[r] > 0
            self.multi -= self.owner[r][1] > 0
            last = self.n - 1
            if r != last:
                for name in _COLUMNS:
                    column = getattr(self, name)
                    column[r] = column[last]
                moved, i = self.owner[last]
                self.owner[r] = self.owner[last]
                moved.rows[i] = r
            self.owner.pop()
            self.n = last
        res.rows = []

    # --- the profile ------------------------------------------------------------------------

    def profile(
        self, blocks: BlockMath, *, worst_case: bool, share: bool, crossing: int = 0
    ) -> Profile:
        """The demand profile of every row (``worst_case``: each to its ``max_tokens``);
        ``share``: vLLM's prefix cache holds shared full prompt blocks once; ``crossing``: the
        most started sequences that cross a block boundary at one step (:meth:`crossing_sequences`),
        each holding ``blocks.crossing_blocks`` more then, at most those still running at a
        step."""
        n = self.n
        end = (self.max_end if worst_case else self.end)[:n]
        done = np.minimum(self.done[:n], end)
        prompt, weight, started = self.prompt[:n], self.weight[:n], self.started[:n]
        owners: dict[int, float] | None = None
        wshared = np.zeros(n, dtype=np.int64)
        if share and all(cap is None for cap in blocks.group_caps):
            owners = {}
            if self.prefixed:
                wshared = self._shared(end - done, owners)
        arrays = _split(prompt, done, end, weight, wshared, started)
        steps, values = _profile(arrays, blocks)
        if crossing and blocks.crossing_blocks:
            left, running = arrays[1], arrays[2]
            order = np.argsort(left)
            # the sequences still running at each step (left >= step), no more than cross at once
            alive = _suffix(running[order])[np.searchsorted(left[order], steps[:-1])]
            values[:-1] += blocks.crossing_blocks * np.minimum(alive, crossing)
        return Profile(steps, values, owners)

    def crossing_sequences(self, block_size: int, tolerance: int) -> int:
        """``sidecar.kv.crossing.crossing_sequences`` of the started rows: those streamed by
        their tokens, the others (progress estimated) as crossing with every class."""
        n = self.n
        started, weight = self.started[:n], self.weight[:n]
        seen = started & self.streamed[:n]
        return crossing_sequences(
            (self.prompt[:n] + self.done[:n])[seen],
            weight[seen],
            int(weight[started & ~seen].sum()),
            block_size=block_size,
            tolerance=tolerance,
        )

    def retry_arrays(
        self, blocks: BlockMath, likely: Callable[[str], int | None] | None, *, share: bool
    ) -> tuple[Arrays, IntArray]:
        """The rows as :meth:`sidecar.kv.ledger.Ledger.trajectories` lays them out for
        Retry-After, with ``gone``: the steps until each one likely ends (its class's ``likely``
        length, or twice what it has once past that, within its reserved end).

        Every row is laid out as started, those vLLM has not started yet as starting now: they
        were admitted because they fit, and vLLM starts them within its next steps. Laid out as
        waiting, as a queued request is, each would start only at the step a refused request is
        tried at, and a pool whose burst was admitted a moment ago (its prompts not prefilled
        yet) put every refusal after the one before it had run to its end: on the simulated 8B's
        fleet burst (``bench.fleet --engine sim-8b``), two sidecars that had each just admitted
        17 requests told the 14 they refused 25 s, 52 s, then the 60 s cap, where those 34
        answers ended 27 s into the burst."""
        n = self.n
        end, raw = self.end[:n], self.done[:n]
        done = np.minimum(raw, end)
        prompt, weight = self.prompt[:n], self.weight[:n]
        every = np.ones(n, dtype=np.bool_)  # all laid out as started
        wshared = np.zeros(n, dtype=np.int64)
        if share and self.prefixed and all(cap is None for cap in blocks.group_caps):
            wshared = self._shared(end - done, {})
        gone = end - done
        if likely is not None and n:
            known = [likely(k) for k in self.classes]
            by_class = np.array([-1 if v is None else v for v in known], dtype=np.int64)
            length = by_class[self.klass[:n]]
            likely_end = np.where(raw < length, length, 2 * raw)
            gone = np.where(length < 0, gone, np.maximum(0, np.minimum(end, likely_end) - done))
        return _split(prompt, done, end, weight, wshared, every), gone

    def most_advanced(self, count: int) -> list[Reservation] | None:
        """The started reservations that have generated the most of their ``max_tokens``, the
        most first, enough of them to hold ``count`` sequences where there are so many (each
        holds one at least); None where a reservation has several prompts (the caller ranks
        those itself). ``O(n)`` in numpy: it runs at every scrape where vLLM runs fewer
        sequences than the ledger has started."""
        if self.multi:
            return None
        started = np.flatnonzero(self.started[: self.n])
        k = min(count, len(started))
        if k <= 0:
            return []
        key = self.done[started] / np.maximum(self.max_end[started], 1)
        top = np.argpartition(-key, k - 1)[:k] if k < len(started) else np.arange(k)
        top = top[np.argsort(-key[top], kind="stable")]
        return [self.owner[int(started[j])][0] for j in top]

    def shared_started(self) -> int:
        """Prompt blocks that the started sequences hold once for several of them (their
        ``weight x shared`` summed, owners among the started ones only)."""
        if not self.prefixed:
            return 0
        n = self.n
        left = self.end[:n] - np.minimum(self.done[:n], self.end[:n])
        return int(self._shared(left, {}, only=self.started[:n]).sum())

    def _shared(
        self, left: IntArray, owners: dict[int, float], only: npt.NDArray[np.bool_] | None = None
    ) -> IntArray:
        """``weight x shared`` per row, and ``owners``: each shared chain hash's owner's
        remaining steps (the longest-lived holder; unstarted holders live forever). ``only``:
        the rows to count (the others neither hold nor share)."""
        rows: list[tuple[int, tuple[int, ...], float]] = []
        started = self.started
        holder: dict[int, int] = {}
        hashed = self.nhash[: self.n] > 0
        if only is not None:
            hashed &= only
        for r in np.flatnonzero(hashed).tolist():
            res, i = self.owner[r]
            assert res.prefix is not None
            hashes = res.prefix[i]
            life = float(left[r]) if started[r] else _FOREVER
            rows.append((r, hashes, life))
            for h in hashes:
                seen = owners.get(h)
                if seen is None or life > seen:
                    owners[h] = life
                    holder[h] = r
        wshared = np.zeros(self.n, dtype=np.int64)
        for r, hashes, _ in rows:
            elsewhere = sum(1 for h in hashes if holder[h] != r)
            wshared[r] = elsewhere + (int(self.weight[r]) - 1) * len(hashes)
        return wshared


def _split(
    prompt: IntArray,
    done: IntArray,
    end: IntArray,
    weight: IntArray,
    wshared: IntArray,
    started: npt.NDArray[np.bool_],
) -> Arrays:
    """The rows as ``sidecar.kv.trajectory`` columns: started ones (held, left, weight, weight x
    shared), then the ones not started (prompt, end, weight, weight x shared)."""
    waiting = ~started
    return (
        prompt[started] + done[started],
        end[started] - done[started],
        weight[started],
        wshared[started],
        prompt[waiting],
        end[waiting],
        weight[waiting],
        wshared[waiting],
    )


@dataclass(frozen=True, slots=True)
class Profile:
    """The demand at each end of a started sequence (``steps``; -1 last: after every end), and
    each shared chain hash's owner's remaining steps (None: no prefix sharing counted)."""

    steps: IntArray
    values: IntArray
    owners: dict[int, float] | None
    #: the peak and the step it is at (-1: after every end), taken once at the build
    top: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.values):
            at = int(self.values.argmax())
            top = (int(self.values[at]), int(self.steps[at]))
        else:
            top = (0, -1)
        object.__setattr__(self, "top", top)

    @property
    def peak(self) -> int:
        return self.top[0]

    def coarse_with(
        self, candidates: Iterable[Reservation], blocks: BlockMath, *, worst_case: bool = False
    ) -> tuple[int, int]:
        """The least and the most :meth:`peak_with` can be, in ``O(1)`` per candidate: an
        unstarted candidate adds at most its blocks at its end at any step, and at least what
        it holds at the profile's peak step (nothing counted there where it may share a
        prompt: shared blocks only lower the sum)."""
        peak, at = self.top
        least = most = peak
        for cand in candidates:
            p = cand.projection
            shares = self.owners is not None and cand.prefix is not None
            for i, prompt in enumerate(p.prompt_tokens):
                end = p.max_tokens[i] if worst_case else cand.end(i)
                most += p.n * blocks.blocks_for_tokens(prompt + end)
                if not shares:
                    held = end if at < 0 else min(at, end)
                    least += p.n * blocks.blocks_for_tokens(prompt + held)
        return least, most

    def peak_with(
        self, candidates: Iterable[Reservation], blocks: BlockMath, *, worst_case: bool = False
    ) -> int:
        """The peak with ``candidates`` added, unstarted (a sliding-window group's pages capped
        as ``blocks.blocks_held`` caps an unstarted sequence's)."""
        total = self.values.copy()
        steps = self.steps[:-1]
        size = blocks.block_size
        uniform = blocks.group_caps == (None,)
        held: dict[int, float] = {}  # hashes the candidates before this one hold, forever
        for cand in candidates:
            p = cand.projection
            for i, prompt in enumerate(p.prompt_tokens):
                end = p.max_tokens[i] if worst_case else cand.end(i)
                tokens = np.minimum(steps, end)
                tokens += prompt
                if uniform:  # ceil(tokens / size)
                    tokens += size - 1
                    tokens //= size
                    grown = tokens
                else:
                    caps = blocks.window_caps(np.array([prompt], dtype=np.int64), False)
                    grown = _blocks(tokens, blocks, caps)
                if p.n != 1:
                    grown *= p.n
                total[:-1] += grown
                total[-1] += p.n * blocks.blocks_held(prompt + end, prompt, started=False)
                if self.owners is None or cand.prefix is None:
                    continue
                hashes = cand.prefix[i]
                total -= (p.n - 1) * len(hashes)
                # held already while the longest-lived holder runs (after every end: only by
                # unstarted ones); a hash chain's holders only thin out along it
                lives = np.array(
                    [held.get(h, self.owners.get(h, -1.0)) for h in hashes], dtype=np.float64
                )
                if len(lives):
                    lives.sort()
                    alive = len(lives) - np.searchsorted(lives, steps, side="left")
                    forever = len(lives) - np.searchsorted(lives, _FOREVER, side="left")
                    total -= np.append(alive, forever).astype(np.int64)
                for h in hashes:
                    held[h] = _FOREVER
        return int(total.max()) if len(total) else 0


#: candidates a :class:`Bound` carries beside its profile before it gives up (each costs one
#: candidate's pass over the profile's steps per decision)
PENDING_MAX = 4


@dataclass(slots=True)
class Bound:
    """A :class:`Profile` kept past the ledger's changes as bounds on its peak, so that a
    decision far enough from the budget takes no rebuild while streams advance.

    From above, each change moves the true peak (with any candidates) up by at most:

    - a request added: nothing once it is carried in ``pending`` as a candidate (an unstarted
      request is one: its growth from its prompt, never freed);
    - a request started or released: nothing (a started request is freed at its end, a
      released one holds nothing);
    - ``k`` tokens of progress since the profile was built (a started request's or, at its
      start, the tokens it had then): each of its sequences holds at any future step the blocks
      of ``k`` more tokens than it was laid out with, at most ``blocks_for_tokens(k)`` more, and
      ends sooner; prefix sharing only lowers that (uncapped geometry: a block is held once
      while anyone holds it);
    - a reserved end moved (an answer past its reserved end): unbounded here, so the bound is
      dropped (``valid``) and the next decision rebuilds the profile.

    From below, a request that started, advanced or was released since holds at any step at
    least nothing, where it was laid out with at most its blocks at its end: ``drop`` sums those
    (each request once per build; ``sidecar.kv.ledger.Reservation.marks``).

    :meth:`peak_with`: the profile's peak with ``pending`` and the candidates, less ``drop``
    and plus ``slack``."""

    profile: Profile
    serial: int  # which build: a reservation's ``marks`` record its progress at the build
    pending: list[Reservation]
    slack: int = 0
    drop: int = 0
    valid: bool = True

    def add(self, res: Reservation) -> None:
        if len(self.pending) < PENDING_MAX:
            self.pending.append(res)
        else:
            self.valid = False

    def discard(self, res: Reservation) -> bool:
        """Take a released request out of ``pending``; whether it was there."""
        if res in self.pending:
            self.pending.remove(res)
            return True
        return False

    def peak_with(
        self,
        candidates: Iterable[Reservation],
        blocks: BlockMath,
        *,
        worst_case: bool,
        coarse: bool = False,
    ) -> tuple[int, int]:
        """The least and the most the peak with ``candidates`` can be (``coarse``: looser, from
        :meth:`Profile.coarse_with`, without a pass over the profile's steps)."""
        extra = [*self.pending, *candidates]
        if not extra:
            least = most = self.profile.peak
        elif coarse:
            least, most = self.profile.coarse_with(extra, blocks, worst_case=worst_case)
        else:
            least = most = self.profile.peak_with(extra, blocks, worst_case=worst_case)
        return max(0, least - self.drop), most + self.slack
