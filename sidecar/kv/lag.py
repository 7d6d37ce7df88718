"""How far behind vLLM a stream's visible progress may be, and the blocks that may hide.

The trajectories (``sidecar.kv.trajectory``) start every streamed request where the sidecar last
saw it. What it sees lags vLLM: vLLM merges a stream's tokens into one event when the stream's
reader falls behind, the relay reads several events in one chunk when its loop is busy, and a
worker's reports reach the owner in batches. A lag that every stream shares only moves the
whole picture later (the laid-out peak still bounds vLLM's from above). A lag that differs
between streams does not: streams that vLLM runs in lockstep look staggered, and their joint
peak looks lower than it is. In a fresh-clone CI run, a burst of eight lockstep streams through
two workers looked staggered that way, the owner admitted queued requests beside them, and
vLLM preempted.

:class:`StreamLag` takes the lag from the jumps themselves: a stream's progress that moved by
``j`` tokens per sequence in one report was ``j - 1`` behind just before it. The most any
stream was behind in the last :data:`LAG_WINDOW_S` (two windows, so that a maximum is kept for
at least one) is ``S``. If every started sequence is at most ``S`` tokens ahead of where it is
laid out, then at any step it holds at most ``ceil(S / block_size)`` more pages per KV-cache
group than laid out, and it ends no later than laid out; so the laid-out peak plus
:func:`lag_blocks` bounds vLLM's from above (``sidecar.admission.fit`` adds it where the
trajectories are laid out). While every report moves a stream by one token, ``S`` is 0 and
nothing is added.

>>> lag = StreamLag(window=1.0)
>>> lag.jumped(1.0, now=0.0); lag.tokens(now=0.0)
0.0
>>> lag.jumped(29.0, now=0.5); lag.tokens(now=1.2)
28.0
>>> lag.tokens(now=3.0)  # two windows with no jump past one token
0.0
>>> lag_blocks(28.0, sequences=8, block_size=128, groups=1)
8
"""

from __future__ import annotations

import math

#: seconds a stream's largest jump is remembered for (at least one window, at most two)
LAG_WINDOW_S = 5.0


class StreamLag:
    """The most tokens per sequence a stream's visible progress was behind vLLM's lately."""

    __slots__ = ("_current", "_previous", "_since", "window")

    def __init__(self, window: float = LAG_WINDOW_S) -> None:
        self.window = window
        self._since: float | None = None  # when the current window began
        self._current = 0.0  # the most behind in the current window
        self._previous = 0.0  # ... and in the one before it

    def _rotate(self, now: float) -> None:
        if self._since is None:
            self._since = now
            return
        passed = now - self._since
        if passed < self.window:
            return
        self._previous = self._current if passed < 2 * self.window else 0.0
        self._current = 0.0
        self._since = now

    def jumped(self, tokens: float, *, now: float) -> None:
        """A stream's visible progress moved by ``tokens`` per sequence in one report."""
        self._rotate(now)
        if tokens - 1 > self._current:
            self._current = tokens - 1

    def tokens(self, *, now: float) -> float:
        """The most tokens per sequence any stream was behind in the last window or two."""
        self._rotate(now)
        return max(self._current, self._previous)


def lag_blocks(lag_tokens: float, *, sequences: int, block_size: int, groups: int) -> int:
    """The most blocks ``sequences`` started sequences may hold beyond their laid-out
    trajectories at any one step, each up to ``lag_tokens`` ahead of where it is laid out (per
    KV-cache group, a sequence ``S`` tokens further holds at most ``ceil(S / block_size)``
    more pages, capped or not)."""
    if lag_tokens <= 0 or sequences <= 0:
        return 0
    return sequences * groups * math.ceil(lag_tokens / block_size)
