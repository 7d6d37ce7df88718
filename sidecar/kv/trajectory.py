"""Future KV demand: the peak over time of the sum of in-flight requests' trajectories.

vLLM holds ``ceil((prompt + generated) / block_size)`` blocks per running sequence, every running
sequence gains one token per decode step, and a request frees all its blocks when it ends. So
the blocks vLLM will need are not the sum of every request's peak (that assumes all peaks come
at once) but the peak, over future steps ``t``, of

    U(t) = sum over started sequences i still running at t:  blocks(A_i + t) - D_i
         + sum over sequences j not started yet:             blocks(P_j + min(t, E_j)) - D_j

where a started sequence holds ``A_i = prompt + generated`` tokens now and runs ``R_i`` more
steps (to its reserved end), and a sequence not started yet (admitted, waiting for vLLM's
prefill, or the candidate itself) is taken at its worst: it may start at any moment, so at step
``t`` it holds at most ``blocks(P + min(t, E))`` and is never counted as freed. ``D`` is the
prompt blocks a sequence shares with a longer-lived one (a shared prefix is held once, by the
sequence that lives longest). Between two ends every term only grows, so the peak is at one of
the ends ``t = R_k`` or after the last (every unstarted sequence at its own peak): the check is
exact over those points.

Assumptions, and what covers them where they break: one token per step per running sequence
(speculative decoding can run ahead: the preemption counter tightens expected mode, and the
headroom absorbs a few tokens); progress is what the sidecar saw (a streamed answer lags vLLM,
by different amounts on different streams: lockstep streams then look staggered and their joint
peak lower. Where the lag shows as a stream's progress moving by many tokens in one report,
worst-case mode adds what it may hide, ``sidecar.kv.lag``; where vLLM merged tokens into fewer
events with no usage count in them it does not show, RELIABILITY.md's merged stream events; a
non-streamed answer is estimated from vLLM's counters); chunked prefill only delays a start,
which the unstarted bound covers.

>>> from sidecar.kv.geometry import UniformBlocks
>>> blocks = UniformBlocks(16)
>>> old = Trajectory(prompt_tokens=64, generated=60, end=64, started=True)  # 4 steps left
>>> new = Trajectory(prompt_tokens=64, generated=0, end=64, started=False)
>>> sum(blocks.blocks_for_tokens(128) for _ in (old, new))  # the sum of peaks
16
>>> future_peak([old, new], blocks)  # 8 + 5 as the old one ends, then the new one alone
13
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sidecar.kv.blocks import BlockMath

IntArray = npt.NDArray[np.int64]
#: started (held, left, weight, weight x shared) and not started (prompt, end, weight,
#: weight x shared) columns: ``weight x shared`` is the prompt blocks the rows' sequences hold
#: once for several (a sum over the row's sequences, so that rows can be merged)
Arrays = tuple[IntArray, IntArray, IntArray, IntArray, IntArray, IntArray, IntArray, IntArray]


@dataclass(frozen=True, slots=True)
class Trajectory:
    """``sequences`` identical sequences of one request, as admission sees them now."""

    prompt_tokens: int
    generated: int  # tokens generated so far, per sequence
    end: int  # output tokens reserved per sequence (max_tokens, or a learned length)
    started: bool  # vLLM runs it: it advances one token per step from now
    sequences: int = 1
    shared_blocks: int = 0  # prompt blocks per sequence held by a longer-lived sequence

    @property
    def remaining(self) -> int:
        return max(0, self.end - self.generated)


def _blocks(
    tokens: IntArray, blocks: BlockMath, caps: Sequence[IntArray | int | None] | None = None
) -> IntArray:
    """Vectorised ``blocks.blocks_for_tokens``, or ``blocks.blocks_held`` with ``caps`` from
    ``blocks.window_caps`` (broadcast against ``tokens``)."""
    size = blocks.block_size
    pages = np.where(tokens > 0, (tokens + size - 1) // size, 0)
    total = np.zeros_like(pages)
    for cap in blocks.group_caps if caps is None else caps:
        total += pages if cap is None else np.minimum(pages, cap)
    return total


class Columns:
    """Trajectories as columns, the form the profile computes on (appending to lists is cheaper
    than building objects; the ledger fills one of these directly)."""

    __slots__ = (
        "end",
        "gone",
        "held",
        "left",
        "prompt",
        "shared",
        "w_gone",
        "w_shared",
        "w_weight",
        "weight",
    )

    def __init__(self, trajectories: Iterable[Trajectory] = ()) -> None:
        self.held: list[int] = []  # started: prompt + generated
        self.left: list[int] = []  # started: steps to its end
        self.gone: list[int] = []  # started: steps until it likely ends (<= left)
        self.weight: list[int] = []
        self.shared: list[int] = []
        self.prompt: list[int] = []  # not started
        self.end: list[int] = []
        self.w_weight: list[int] = []
        self.w_shared: list[int] = []
        self.w_gone: list[int] = []  # not started: output tokens until it likely ends (<= end)
        for t in trajectories:
            self.add(t.prompt_tokens, t.generated, t.end, t.started, t.sequences, t.shared_blocks)

    def add(
        self,
        prompt: int,
        generated: int,
        end: int,
        started: bool,
        sequences: int,
        shared: int,
        gone: int | None = None,
    ) -> None:
        if started:
            left = max(0, end - generated)
            self.held.append(prompt + generated)
            self.left.append(left)
            self.gone.append(left if gone is None else min(left, gone))
            self.weight.append(sequences)
            self.shared.append(shared)
        else:
            self.prompt.append(prompt)
            self.end.append(end)
            self.w_gone.append(end if gone is None else min(end, gone))
            self.w_weight.append(sequences)
            self.w_shared.append(shared)

    def __len__(self) -> int:
        return len(self.held) + len(self.prompt)

    def add_delayed(self, other: Columns, steps: int) -> None:
        """``other``'s unstarted sequences as if they start ``steps`` from now: started ones
        that are behind by that much (holding a little more than they will before they start,
        the safe side to err on)."""
        for prompt, end, weight, shared, gone in zip(
            other.prompt, other.end, other.w_weight, other.w_shared, other.w_gone, strict=True
        ):
            self.held.append(max(0, prompt - steps))
            self.left.append(end + steps)
            self.gone.append(gone + steps)
            self.weight.append(weight)
            self.shared.append(shared)

    def shared_total(self) -> int:
        """Blocks held once for several sequences (the sum of weight x shared)."""
        return sum(w * d for w, d in zip(self.weight, self.shared, strict=True)) + sum(
            w * d for w, d in zip(self.w_weight, self.w_shared, strict=True)
        )

    def arrays(self) -> Arrays:
        def a(values: list[int]) -> IntArray:
            return np.array(values, dtype=np.int64)

        weight, w_weight = a(self.weight), a(self.w_weight)
        return (
            a(self.held),
            a(self.left),
            weight,
            weight * a(self.shared),
            a(self.prompt),
            a(self.end),
            w_weight,
            w_weight * a(self.w_shared),
        )


class ArrayColumns:
    """:class:`Columns` already in numpy form (the ledger's kept rows give these), with the
    same :meth:`arrays` and ``gone``; :meth:`add_delayed` appends as :class:`Columns` does."""

    __slots__ = ("_arrays", "gone")

    def __init__(self, arrays: Arrays, gone: IntArray) -> None:
        self._arrays = arrays
        self.gone = gone  # started: steps until each likely ends (<= left)

    def __len__(self) -> int:
        return len(self._arrays[0]) + len(self._arrays[4])

    def arrays(self) -> Arrays:
        return self._arrays

    def add_delayed(self, other: Columns, steps: int) -> None:
        """As :meth:`Columns.add_delayed`."""
        held, left, weight, wshared, *waiting = self._arrays
        _, _, _, _, prompt, end, w_weight, w_wshared = other.arrays()
        gone = np.array(other.w_gone, dtype=np.int64)
        self._arrays = (
            np.concatenate([held, np.maximum(0, prompt - steps)]),
            np.concatenate([left, end + steps]),
            np.concatenate([weight, w_weight]),
            np.concatenate([wshared, w_wshared]),
            *waiting,
        )  # type: ignore[assignment]
        self.gone = np.concatenate([self.gone, gone + steps])


def _columns(trajectories: Sequence[Trajectory] | Columns | ArrayColumns) -> Columns | ArrayColumns:
    if isinstance(trajectories, Columns | ArrayColumns):
        return trajectories
    return Columns(trajectories)


def demand_profile(
    trajectories: Sequence[Trajectory] | Columns, blocks: BlockMath
) -> tuple[IntArray, IntArray]:
    """``(steps, blocks)``: the demand ``U`` at each end of a started sequence and, last, after
    every end (``steps`` -1 stands for "from then on"). Its maximum is :func:`future_peak`.

    Full-attention geometry (every group uncapped) takes an ``O(n log n + n * block_size)``
    path; a sliding-window group, an ``O(n^2)`` one.
    """
    return _profile(_columns(trajectories).arrays(), blocks)


#: sequences x steps up to which the plain matrix is the quicker way to a capped profile
#: (``/work``-style check: 0.16 against 0.32 ms at 50 sequences, 5.4 against 1.1 ms at 500)
MATRIX_CELLS = 4096


def _profile(arrays: Arrays, blocks: BlockMath) -> tuple[IntArray, IntArray]:
    if all(cap is None for cap in blocks.group_caps):
        return _profile_uncapped(arrays, blocks.block_size, len(blocks.group_caps))
    if len(arrays[0]) * (len(arrays[0]) + len(arrays[4])) <= MATRIX_CELLS:
        return _profile_matrix(arrays, blocks)
    return _profile_capped(arrays, blocks)


def _before(ends: IntArray, values: IntArray, k: int) -> IntArray:
    """``out[j]`` (``j < k``): the sum of ``values[i]`` over the items with ``ends[i] > j``."""
    counts = np.bincount(ends, weights=values, minlength=k + 1)[: k + 1]
    return _suffix(counts.round().astype(np.int64))[1 : k + 1]


def _growing(
    base: IntArray, weight: IntArray, ends: IntArray, steps: IntArray, size: int
) -> IntArray:
    """``out[j]``: the sum of ``weight * pages(base + steps[j])`` over the items with
    ``ends > j`` (``pages(x) = q + tq + [r + tr >= size]``, as in :func:`_profile_uncapped`)."""
    k = len(steps)
    a = base + size - 1
    tq, tr = steps // size, steps % size
    order = np.argsort(ends, kind="stable")
    cuts = np.searchsorted(ends[order], np.arange(k), side="right")  # the first with end > j
    return (
        _before(ends, weight * (a // size), k)
        + tq * _before(ends, weight, k)
        + _suffix_residue_counts((a % size)[order], weight[order], cuts, size - tr, size)
    )


def _profile_capped(arrays: Arrays, blocks: BlockMath) -> tuple[IntArray, IntArray]:
    """:func:`_profile_matrix`'s figures in ``O(n log n + n * block_size)`` per KV-cache group:
    a sequence's pages grow one a block of steps until its group's cap, and stay there. Each
    sequence is split, per group, into the steps it grows (summed as :func:`_profile_uncapped`
    sums) and the steps it sits at its cap (a constant over a range: a running sum)."""
    held, left, weight, wshared, prompt, end, w_weight, w_wshared = arrays
    size = blocks.block_size
    steps = np.unique(left)  # sorted
    k = len(steps)
    values = np.zeros(k + 1, dtype=np.int64)  # at each step, then after every end
    alive = np.searchsorted(steps, left, side="right")  # started: steps [0, alive) see it
    values[:k] -= _before(alive, wshared, k)
    for cap in blocks.window_caps(held, True):
        if cap is None:
            grows = alive
        else:  # it grows while held + t < cap * size, then holds the cap until it ends
            grows = np.minimum(alive, np.searchsorted(steps, cap * size - held, side="left"))
            at_cap = weight * cap
            flat = np.bincount(grows, at_cap, k + 1) - np.bincount(alive, at_cap, k + 1)
            values[:k] += np.cumsum(flat)[:k].round().astype(np.int64)
        values[:k] += _growing(held, weight, grows, steps, size)
    # not started: grows from its prompt until its end or its cap, then holds that forever
    for cap in blocks.window_caps(prompt, False):
        top = _pages(prompt + end, size)
        last = end
        if cap is not None:
            top = np.minimum(top, cap)
            last = np.minimum(end, np.maximum(0, cap * size - prompt))
        grows = np.searchsorted(steps, last, side="left")
        values += np.cumsum(np.bincount(grows, w_weight * top, k + 1)).round().astype(np.int64)
        values[:k] += _growing(prompt, w_weight, grows, steps, size)
    values -= int(w_wshared.sum())
    return np.append(steps, -1).astype(np.int64), values


def _pages(tokens: IntArray, size: int) -> IntArray:
    return np.where(tokens > 0, (tokens + size - 1) // size, 0)


def _suffix_residue_counts(
    rem: IntArray, weight: IntArray, cuts: IntArray, at_least: IntArray, size: int
) -> IntArray:
    """``out[k]``: the summed weight of items ``cuts[k]..`` whose remainder is at least
    ``at_least[k]`` (``cuts`` nondecreasing; ``at_least`` in ``0..size``).

    Items are binned by the last cut at or before them and by remainder (one ``bincount``), then
    summed from the back over cuts and over remainders: ``O(n log k + k * size)``.
    """
    k = len(cuts)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    # the last cut at or before each item, counted from the back (so that the sums run forwards
    # over contiguous memory); remainders from the top
    marks = np.bincount(cuts, minlength=len(rem) + 1)[: len(rem)]
    group = k - np.cumsum(marks)  # k - 1 - (index of the last cut <= item); k: before them all
    keep = group < k
    flat = group[keep] * size + (size - 1 - rem[keep])
    if bool((weight == 1).all()):
        table = np.bincount(flat, minlength=k * size)
    else:
        table = np.bincount(flat, weights=weight[keep], minlength=k * size).round()
    table = table.astype(np.int64).reshape(k, size)
    np.cumsum(table, axis=0, out=table)  # items from cut k on
    np.cumsum(table, axis=1, out=table)  # column j: remainder >= size - 1 - j
    table = np.concatenate([np.zeros((k, 1), dtype=np.int64), table], axis=1)
    # remainder >= v is column size - v; cut k is row k - 1 - k
    return table[k - 1 - np.arange(k), size - at_least]


def _suffix(values: IntArray) -> IntArray:
    """``S[s]``: the sum of ``values[s:]`` (``S[len]`` is 0)."""
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values[::-1], out=out[-2::-1])
    return out


def _profile_uncapped(arrays: Arrays, size: int, groups: int) -> tuple[IntArray, IntArray]:
    # pages(x) = ceil(x / size) = q + tq + [r + tr >= size] with a = x - t + size - 1 = q*size + r
    # and t = tq*size + tr: summed over a suffix of sequences, three suffix sums and one count of
    # remainders. Ties in a sort order do not matter: every sum runs over whole runs of ties.
    held, left, weight, wshared, prompt, end, w_weight, w_wshared = arrays
    order = np.argsort(left)
    held, left, weight, wshared = held[order], left[order], weight[order], wshared[order]
    a = held + size - 1
    if len(left):
        new = np.empty(len(left), dtype=bool)
        new[0] = True
        np.not_equal(left[1:], left[:-1], out=new[1:])
        first = np.flatnonzero(new)  # the sequences still running at a step start here
        steps = left[first]
    else:
        first = steps = np.zeros(0, dtype=np.int64)
    tq, tr = steps // size, steps % size
    started_part = (
        groups
        * (
            _suffix(weight * (a // size))[first]
            + tq * _suffix(weight)[first]
            + _suffix_residue_counts(a % size, weight, first, size - tr, size)
        )
        - _suffix(wshared)[first]
    )
    if not len(end):  # nothing waiting to start
        return (
            np.append(steps, -1).astype(np.int64),
            np.append(started_part, 0).astype(np.int64),
        )
    w_order = np.argsort(end)
    prompt, end, w_weight = prompt[w_order], end[w_order], w_weight[w_order]
    peak = np.where(prompt + end > 0, (prompt + end + size - 1) // size, 0) * groups * w_weight
    at_peak = np.zeros(len(peak) + 1, dtype=np.int64)  # items before j are at their end
    np.cumsum(peak, out=at_peak[1:])
    b = prompt + size - 1
    growing = np.searchsorted(end, steps, side="right")  # those with end > step still grow
    held_once = int(w_wshared.sum())
    waiting_part = (
        at_peak[growing]
        + groups
        * (
            _suffix(w_weight * (b // size))[growing]
            + tq * _suffix(w_weight)[growing]
            + _suffix_residue_counts(b % size, w_weight, growing, size - tr, size)
        )
        - held_once
    )
    after = int(at_peak[-1]) - held_once
    return (
        np.append(steps, -1).astype(np.int64),
        np.append(started_part + waiting_part, after).astype(np.int64),
    )


def _profile_matrix(arrays: Arrays, blocks: BlockMath) -> tuple[IntArray, IntArray]:
    """The demand profile as its definition reads, one step by one sequence (``O(n^2)``): the
    figures the fast paths are checked against (tests/test_trajectory.py)."""
    held, left, weight, wshared, prompt, end, w_weight, w_wshared = arrays
    steps = np.unique(left)  # sorted
    # started sequences still running at each step (left >= step), at their size then (a
    # sliding-window group's as they decode; one not started, the most its prefill holds)
    decoding = blocks.window_caps(held, True)
    grid_tokens = held[None, :] + steps[:, None]
    alive = left[None, :] >= steps[:, None]
    started_part = (
        np.where(
            alive, _blocks(grid_tokens, blocks, decoding) * weight[None, :] - wshared[None, :], 0
        )
        .sum(axis=1)
        .astype(np.int64)
    )
    prefilling = blocks.window_caps(prompt, False)
    waiting_tokens = prompt[None, :] + np.minimum(steps[:, None], end[None, :])
    waiting_part = (
        (_blocks(waiting_tokens, blocks, prefilling) * w_weight[None, :] - w_wshared[None, :])
        .sum(axis=1)
        .astype(np.int64)
    )
    after = int((_blocks(prompt + end, blocks, prefilling) * w_weight - w_wshared).sum())
    return (
        np.append(steps, -1).astype(np.int64),
        np.append(started_part + waiting_part, after).astype(np.int64),
    )


def future_peak(trajectories: Sequence[Trajectory] | Columns, blocks: BlockMath) -> int:
    """The most blocks the trajectories can hold at once, now or at any future step."""
    if not trajectories:
        return 0
    return int(demand_profile(trajectories, blocks)[1].max())


#: most start times :func:`steps_until_fits` tries (spread over the ends): it answers a hint
MAX_TRIED_STARTS = 48


def steps_until_fits(
    trajectories: Sequence[Trajectory] | Columns | ArrayColumns,
    candidate: Sequence[Trajectory] | Columns,
    budget_blocks: int,
    blocks: BlockMath,
    *,
    not_before: int = 0,
) -> int | None:
    """Decode steps until ``candidate`` (unstarted) fits under ``budget_blocks`` beside the
    others, if it were admitted then: ``not_before`` (0: now) if it fits then, None if it never
    fits (not even alone). ``not_before``: the step it cannot start before (the request queued
    ahead of it starts then).

    The candidate is tried at ends of started sequences (all of them, or at most
    ``MAX_TRIED_STARTS`` spread over them, always with the last): the others' demand from then
    on plus the candidate's worst case must stay within the budget. A started sequence ends
    where its ``gone`` column says (its likely end, at most its reserved one); until then it
    runs on towards its reserved end, as admission counts it.
    """
    own = _columns(candidate).arrays()
    if int(_profile(own, blocks)[1].max(initial=0)) > budget_blocks:
        return None
    columns = _columns(trajectories)
    held, left, weight, wshared, prompt, end, w_weight, w_wshared = columns.arrays()
    gone = np.array(columns.gone, dtype=np.int64)
    _, _, _, _, c_prompt, c_end, c_weight, c_wshared = own
    waiting = (
        np.concatenate([prompt, c_prompt]),
        np.concatenate([end, c_end]),
        np.concatenate([w_weight, c_weight]),
        np.concatenate([w_wshared, c_wshared]),
    )
    starts = np.unique(np.append(gone, not_before))
    starts = starts[starts >= not_before]
    if len(starts) > MAX_TRIED_STARTS:
        picks = np.linspace(0, len(starts) - 1, MAX_TRIED_STARTS).round().astype(np.int64)
        starts = starts[np.unique(picks)]
    if all(cap is None for cap in blocks.group_caps):
        # the demand at the start itself bounds the peak from below: starts where even that
        # is over the budget need no profile
        size, groups = blocks.block_size, len(blocks.group_caps)
        order = np.argsort(gone)
        g, a, w = gone[order], held[order] + size - 1, weight[order]
        cuts = np.searchsorted(g, starts, side="right")  # the sequences still running then
        tq, tr = starts // size, starts % size
        now = (
            groups
            * (
                _suffix(w * (a // size))[cuts]
                + tq * _suffix(w)[cuts]
                + _suffix_residue_counts(a % size, w, cuts, size - tr, size)
            )
            - _suffix(wshared[order])[cuts]
        )
        w_prompt, _, w_w, w_ws = waiting
        now += int((_blocks(w_prompt, blocks) * w_w - w_ws).sum())
        starts = starts[now <= budget_blocks]
    for step in starts.tolist():
        keep = gone > step
        moved: Arrays = (
            held[keep] + step,
            left[keep] - step,
            weight[keep],
            wshared[keep],
            *waiting,
        )
        if int(_profile(moved, blocks)[1].max(initial=0)) <= budget_blocks:
            return int(step)
    return None  # only the unstarted ones ahead of it stand in the way: unknown
