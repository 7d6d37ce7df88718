"""Prompts of a positive priority forwarded no faster than vLLM prefills them
(``--priority-pace``).

vLLM's own scheduler takes waiting requests first come, first served (``--scheduling-policy
fcfs``, its default), and it prefills a prompt before it answers the next one in line. When a
batch class sends hundreds of requests at once and the sidecar admits as many as the KV pool
holds, they all wait in vLLM's queue for their prefill: on the simulated 8B engine (BENCHMARKS.md,
The priority workload at GPU sizes) 52 prompts of 1,000-2,000 tokens, about 2.5 s of prefill,
and an interactive chat the sidecar admitted at once 0.5 s later waited behind them for 1.9 s.
No KV admission rule reaches that wait: the room is there, the queue is vLLM's.

So the sidecar keeps that queue short itself. It keeps, per engine, the **prefill backlog**: the
seconds of prefill of the prompts it has forwarded (every priority), each prompt at the learned
time a prompt's prefill holds the engine (below), drained at one second a second, the rate at
which vLLM works through them. A request of a positive priority (a class the operator ranked
below vLLM's default 0) goes only while that backlog is under ``--priority-pace`` seconds;
otherwise it waits in the sidecar's queue, where a request of a better priority passes it, and
the queue is tried again when the backlog will have drained. A request of priority 0 or better
is never held by it: it then finds at most ``--priority-pace`` seconds of lower-priority prefill
ahead of it in vLLM's queue (and one prompt more), however large the burst.

While a streamed request of priority 0 or better that the sidecar forwarded to an engine waits for
its first token, no request of a positive priority goes to that engine at all (the backlog's
count of what is ahead of the favoured request is an estimate; its first token is a fact). vLLM's
chunked prefill gives each step's token budget to the requests it already runs first, so a batch
prompt sent after an interactive one, while the interactive prompt still waits or is
half-prefilled, is prefilled in the same steps and lengthens them: on the simulated 8B engine
(BENCHMARKS.md, The pace held to the interactive class's first tokens) a chat's prompt of 294
tokens was prefilled 78 and then 216 tokens at a time, in the two steps that took in nine batch
prompts with it (0.23 and 0.16 simulated seconds, where a plain decode step took 0.013). A
non-streamed request's first token is not seen (it is counted as started when it is forwarded),
so it holds nothing. At a high enough rate of streamed requests of priority 0 and better, this
holds the batch class back for as long as any of them awaits its first token: that is what the
pace is for.

The backlog is an estimate from the sidecar's own clock, not vLLM's queue read back (vLLM's
gauges are a scrape old, half a second by default, and say nothing of a non-streamed request's
first token). Each prompt adds what a prompt's prefill held the engine for, per prompt token,
as measured on the requests vLLM finished (``EngineCosts.prompt_seconds_per_token``: the steps
it was prefilled in, the running batch's decoding in them included), and the backlog drains at
one second a second. vLLM prefills a prompt in a step that also decodes everything it runs, and
that step is not free: counted by the prompt's tokens alone (the learned cost of a computed
token, a decode step taken off each prefill), on the simulated 8B engine the backlog drained
faster than vLLM prefilled beside a batch of 40-60 decoding sequences, and the prompts sent
meanwhile piled up into steps of two to six prompts (0.08-0.23 simulated seconds, where a
plain decode step took 0.013). Until a prefill is measured, a prompt costs its tokens at
:data:`PRIOR_PREFILL_SECONDS_PER_TOKEN` and a decode step (the measured one, else
:data:`PRIOR_PREFILL_TOKENS_PER_STEP` tokens' worth). A step counted for each prompt overcounts
when vLLM fits several prompts into one step, which errs toward pacing too slowly. Where the KV
pool limits the batch (the usual case once the burst's first wave is in), admission holds it
long before the pace does.

>>> clock = [0.0]
>>> pace = PrefillPace(clock=lambda: clock[0])
>>> pace.hold(0.1)
0.0
>>> pace.sent(2000, 5e-5, None)  # 0.1 s of prefill (measured: 5e-5 s a prompt token)
>>> round(pace.hold(0.1), 9)  # the next waits until the backlog is under the pace
1e-09
>>> clock[0] = 0.05
>>> pace.hold(0.1)
0.0
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from sidecar.admission.costs import PRIOR_PREFILL_TOKENS_PER_STEP

if TYPE_CHECKING:
    from sidecar.kv.ledger import Reservation

#: seconds of prefill a prompt token costs until the engine's is measured: about an 8B model's
#: on one GPU of the H100 class (2 x 8e9 FLOPs a token at ~40% of ~1e15 FLOP/s is 4e-5 s),
#: rounded up so that a cold sidecar errs toward pacing too slowly for a second or two rather
#: than letting a whole burst into vLLM's queue; a smaller model or a larger GPU measures less
#: with its first finished requests (the CPU build's two-layer model: ~5e-6)
PRIOR_PREFILL_SECONDS_PER_TOKEN = 5e-5
#: the backlog counted as empty below this (float residue of many small drains)
_EPSILON = 1e-9


class PrefillPace:
    """One engine's prefill backlog: seconds of the prompts forwarded, drained by the clock; and
    the streamed requests of priority 0 or better forwarded to it still awaiting a first token."""

    __slots__ = ("_at", "_backlog", "_clock", "awaiting")

    def __init__(self, *, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._backlog = 0.0  # seconds of prefill, as of ``_at``
        self._at = clock()
        self.awaiting = 0

    def backlog(self) -> float:
        """Seconds of prefill forwarded and not yet presumed done."""
        now = self._clock()
        self._backlog = max(0.0, self._backlog - (now - self._at))
        self._at = now
        return self._backlog

    def hold(self, pace: float) -> float:
        """Seconds a request held to ``pace`` must still wait before it may go (0: now)."""
        over = self.backlog() - pace
        return over + _EPSILON if over >= 0 else 0.0

    def sent(
        self, prompt_tokens: int, seconds_per_token: float | None, step_seconds: float | None
    ) -> None:
        """A request with ``prompt_tokens`` to prefill was forwarded to this engine, at
        ``seconds_per_token`` (``EngineCosts.prompt_seconds_per_token``: a prompt's whole
        prefill, its steps' decoding included). Until that is measured: its tokens at the prior
        and a decode step of ``step_seconds`` (vLLM decodes its running batch in the step that
        prefills the prompt; None: not measured either, :data:`PRIOR_PREFILL_TOKENS_PER_STEP`
        tokens' worth)."""
        if seconds_per_token is not None:
            seconds = prompt_tokens * seconds_per_token
        else:
            prior = PRIOR_PREFILL_SECONDS_PER_TOKEN
            step = (
                step_seconds if step_seconds is not None else PRIOR_PREFILL_TOKENS_PER_STEP * prior
            )
            seconds = prompt_tokens * prior + step
        self._backlog = self.backlog() + seconds


class PacedPools:
    """``--priority-pace`` over the engines' pools: whether a request of a positive priority must
    wait for a pool's backlog, and the queue's next try when it must (``pump``, on the event
    loop, once the backlog will have drained)."""

    __slots__ = ("_clock", "_due", "_pump", "_timer", "seconds")

    def __init__(self, seconds: float, pump: Callable[[], None], *, clock: Callable[[], float]):
        self.seconds = seconds  # 0: not paced
        self._pump = pump
        self._clock = clock
        self._timer: asyncio.TimerHandle | None = None
        self._due = math.inf  # when the timer fires

    def holds(self, pace: PrefillPace) -> bool:
        """Whether a paced request must wait for the backlog ``pace`` keeps, or for the first
        token of a request of priority 0 or better (whose arrival pumps the queue)."""
        if pace.awaiting > 0:
            return True
        wait = pace.hold(self.seconds)
        if wait <= 0:
            return False
        due = self._clock() + wait
        if self._timer is None or due < self._due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # decided off the event loop (the pure core's tests)
                return True
            if self._timer is not None:
                self._timer.cancel()
            self._due = due
            self._timer = loop.call_later(wait, self._fire)
        return True

    def awaited(self, res: Reservation) -> bool:
        """Whether paced requests wait for ``res``'s first token: it is of priority 0 or better,
        streamed, and has neither started nor ended (and the sidecar paces at all)."""
        return (
            self.seconds > 0
            and res.priority <= 0
            and res.streamed
            and not res.started
            and not res.released
        )

    @staticmethod
    def favoured_sent(pace: PrefillPace) -> None:
        """An :meth:`awaited` request went to ``pace``'s engine: paced requests wait for it
        there."""
        pace.awaiting += 1

    def favoured_started(self, paces: list[PrefillPace]) -> None:
        """An :meth:`awaited` request (and its shadows, in ``paces``) has its first token, or
        ended first: the queue is tried again where it was the last one awaited."""
        freed = False
        for pace in paces:
            if pace.awaiting > 0:
                pace.awaiting -= 1
                freed = freed or pace.awaiting == 0
        if freed:
            self._pump()

    def _fire(self) -> None:
        self._timer, self._due = None, math.inf
        self._pump()
