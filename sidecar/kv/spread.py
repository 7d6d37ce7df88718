"""The future peak with the in-flight answers' ends spread over their learned lengths.

``sidecar.kv.trajectory`` lays every request out to its reserved end, a high quantile of its
class's lengths. That is the peak if every answer ends late at once, and requests that start
together do not: with answers of 1,500-2,500 tokens the pool is fullest when the first of them
end (all alive, each ~1,500 tokens in), not at 2,400 tokens each. Each answer's own quantile, or
the pool's quantile of their summed lengths (``sidecar.admission.learner.pooled_length``), still
overstates that peak by the distance from the shortest answers to the long ones: here 13% of
the blocks for 3,000-token prompts with such answers (the example below).

Here each sequence ``i`` of a class with learned lengths ``W`` (its own answers, sorted) is alive
at future step ``t`` with probability ``S_i(t) = P(L >= g_i + t | L > g_i)`` (``g_i`` generated
so far; one not started yet is taken to start within ``start_slack`` steps: alive as if it started
that late, holding as many tokens as if it started now), holding ``blocks(A_i + t)``. Over a
grid of future steps, the demand's mean ``E(t) = sum S_i b_i`` and its variance as the sequences
end independently (``sum S_i (1 - S_i) b_i^2``) plus the error of each class's survival estimated
from ``m`` answers (``(sum over a class of b_i sqrt(S_i (1 - S_i) / m_i))^2``, the same for every
sequence of the class: it does not shrink with their number) give ``E + z sd``; the peak is its
maximum over the grid, each interval taken at its start's survival and its end's size (an upper
bound over the interval). A sequence of a class without enough answers, or past every answer
its class has seen, ends at its reserved end, for certain, as the trajectories lay it out.

An approximation for admission's second opinion (``sidecar.admission.controller``: adaptive mode
asks it only when the laid-out peak refuses), not a bound: independent ends, a window's answers
standing for the class, a normal sum. tests/test_spread.py draws the answers and checks how often
the drawn peak passes it.

>>> from sidecar.kv.geometry import UniformBlocks
>>> window = np.arange(1500, 2501, 10, dtype=np.int64)  # answers of 1,500-2,500 tokens
>>> rows = SpreadRows.of([3000] * 32, [0] * 32, [2400] * 32, [2560] * 32, [1] * 32,
...                      [False] * 32, [0] * 32)
>>> laid_out = 32 * UniformBlocks(16).blocks_for_tokens(3000 + 2400)  # each at its end
>>> spread = spread_peak(rows, [window], UniformBlocks(16), z=1.645, start_slack=16)
>>> laid_out, spread, round(spread / laid_out, 2)
(10816, 9451, 0.87)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sidecar.kv.blocks import BlockMath
from sidecar.kv.trajectory import IntArray, _blocks

#: future steps the spread demand is evaluated at (evenly over the longest remaining life)
GRID_POINTS = 48


@dataclass(frozen=True, slots=True)
class SpreadRows:
    """One row per (request, prompt): its ``weight`` sequences alike."""

    prompt: IntArray
    done: IntArray  # tokens generated so far per sequence
    end: IntArray  # the reserved end (output tokens), where a row's class has no window
    max_end: IntArray  # max_tokens: no answer runs past it
    weight: IntArray
    started: npt.NDArray[np.bool_]
    window: IntArray  # index into the windows, -1: none (it ends at its reserved end)

    @classmethod
    def of(
        cls,
        prompt: Sequence[int],
        done: Sequence[int],
        end: Sequence[int],
        max_end: Sequence[int],
        weight: Sequence[int],
        started: Sequence[bool],
        window: Sequence[int],
    ) -> SpreadRows:
        def a(values: Sequence[int]) -> IntArray:
            return np.asarray(values, dtype=np.int64)

        return cls(
            a(prompt),
            a(done),
            a(end),
            a(max_end),
            a(weight),
            np.asarray(started, dtype=bool),
            a(window),
        )

    def __len__(self) -> int:
        return len(self.prompt)

    def joined(self, other: SpreadRows) -> SpreadRows:
        return SpreadRows(
            *(
                np.concatenate([getattr(self, f), getattr(other, f)])
                for f in ("prompt", "done", "end", "max_end", "weight", "started", "window")
            )
        )


def spread_peak(
    rows: SpreadRows,
    windows: Sequence[IntArray],
    blocks: BlockMath,
    *,
    z: float,
    start_slack: int,
    points: int = GRID_POINTS,
) -> int:
    """The most blocks the rows are expected to hold at once, at ``z`` standard deviations
    above the mean (``windows``: each class's learned lengths, sorted)."""
    n = len(rows)
    if n == 0:
        return 0
    done = np.minimum(rows.done, rows.max_end)
    end = np.maximum(rows.end, done)
    started = rows.started
    slack = np.where(started, 0, max(0, start_slack))
    # survival: for rows with a window, the answers of it still running past what each has
    window = rows.window.copy()
    surv_base = np.ones(n, dtype=np.float64)  # answers longer than done: the denominator
    longest = np.zeros(n, dtype=np.int64)  # the longest answer that row may still give
    for k, lengths in enumerate(windows):
        mine = window == k
        if not mine.any():
            continue
        above = len(lengths) - np.searchsorted(lengths, done[mine], side="right")
        idx = np.flatnonzero(mine)
        past = above == 0  # past every answer its class has seen: its reserved end
        window[idx[past]] = -1
        surv_base[idx[~past]] = above[~past]
        longest[idx] = np.minimum(int(lengths[-1]), rows.max_end[idx])
    spread = window >= 0
    # the last step any row may be alive at
    life = np.where(spread, np.maximum(0, longest - done), end - done) + slack
    horizon = int(life.max())
    grid = np.unique(np.linspace(0, horizon, max(2, points)).round().astype(np.int64))
    starts, stops = grid[:-1], grid[1:]
    if len(starts) == 0:
        starts = stops = grid
    # sizes at each interval's end: tokens held then (capped at the answer's max_tokens)
    out_tokens = np.minimum(done[:, None] + stops[None, :], rows.max_end[:, None])
    out_tokens = np.where(spread[:, None], out_tokens, np.minimum(out_tokens, end[:, None]))
    caps = [c if c is None else c[:, None] for c in blocks.window_caps(rows.prompt, started)]
    size = _blocks(rows.prompt[:, None] + out_tokens, blocks, caps).astype(np.float64)
    # alive at each interval's start
    alive = np.zeros((n, len(starts)), dtype=np.float64)
    fixed = ~spread
    if fixed.any():
        # laid out as the trajectories do: a started one alive to its reserved end, one not
        # started yet never counted as freed
        left = (end - done)[fixed]
        alive[fixed] = np.where(
            started[fixed, None], starts[None, :] <= left[:, None], True
        ).astype(np.float64)
    est = np.zeros(len(starts), dtype=np.float64)
    for k, lengths in enumerate(windows):
        mine = np.flatnonzero(window == k)
        if len(mine) == 0:
            continue
        # P(L >= g + t | L > g): at t = 0 (or within the start slack) alive for certain
        since = np.maximum(1, starts[None, :] - slack[mine, None])
        reach = done[mine, None] + since
        ge = len(lengths) - np.searchsorted(lengths, reach.ravel(), side="left")
        s = np.minimum(1.0, ge.reshape(reach.shape) / surv_base[mine, None])
        s = np.where(reach <= rows.max_end[mine, None], s, 0.0)
        alive[mine] = s
        w = rows.weight[mine, None].astype(np.float64)
        spread_sd = (w * size[mine] * np.sqrt(s * (1.0 - s) / surv_base[mine, None])).sum(axis=0)
        est += spread_sd * spread_sd
    weight = rows.weight[:, None].astype(np.float64)
    mean = (weight * alive * size).sum(axis=0)
    var = (weight * alive * (1.0 - alive) * size * size).sum(axis=0)
    bound = mean + z * np.sqrt(var + est)
    return math.ceil(float(bound.max()))
