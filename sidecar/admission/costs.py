"""The engine's costs, learned online from vLLM's own metrics: what an engine step takes against
the tokens it processes, and so what a larger batch and a preemption would cost.

A preemption in vLLM v1 is a recompute: the preempted request's prompt and everything it had
generated are prefilled again when it is rescheduled. With short prompts that is a few decode
steps, and running more sequences pays for it; with prompts of thousands of tokens on a large
model it throws away seconds of prefill, and vLLM can preempt the same requests again and again.
Admission weighs the two: a request is reserved to the length quantile at which the recompute it
risks (:meth:`EngineCosts.recompute_steps`, times the chance its answer outruns the quantile)
costs at most what running it in the batch saves (:meth:`EngineCosts.gain_steps`), and at least
``risk_steps`` decode steps (:func:`reserve_quantile`). Where the saving exceeds even a certain
recompute, no quantile is needed: the request is risked at a floor, as vLLM risks all of them.

Learned from each pair of scrapes (``sidecar.engine.snapshot``) while vLLM was busy through the
interval (requests running at both ends):

- the **step line**: vLLM's ``vllm:iteration_tokens_total`` histogram counts the engine's steps
  and sums the tokens they processed (prefill and decode); the interval over its steps is the
  mean step time. A line ``step = base + per_token x tokens in the step`` is fitted to those
  points by exponentially weighted least squares. A decode step processes one token per running
  sequence, so the line tells what a larger batch costs each step (a latency objective is checked
  with it before a request is admitted, :meth:`EngineCosts.step_seconds`); a prefill processes
  its prompt, so ``per_token`` times a preempted request's tokens is what its recompute costs;
- the **recent decode step**: vLLM's inter-token latency histogram over the interval.

Until the line has a slope (two different loads seen), a recompute is taken to cost one decode
step per ``PRIOR_PREFILL_TOKENS_PER_STEP`` tokens.

>>> costs = EngineCosts()
>>> costs.recompute_steps(2048)
2.0
>>> [reserve_quantile(steps, risk_steps=1.0) for steps in (1, 4, 9, 19, 99, 500)]
[0.75, 0.75, 0.9, 0.95, 0.99, None]
>>> reserve_quantile(30, risk_steps=15.0, quantiles=GAIN_QUANTILES)
0.5
>>> reserve_quantile(30, risk_steps=30.0, quantiles=GAIN_QUANTILES)  # a sure recompute pays
0.0
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.engine.snapshot import EngineSnapshot

#: prefill tokens that cost one decode step, until measured: on a GPU a decode step of an 8B
#: model (bound by reading the weights, ~16 GB at ~3 TB/s: ~6-10 ms with its KV) and a prefill
#: of ~1,000 tokens (bound by compute, 2 x 8e9 x 1,000 FLOPs at ~40 % of ~1e15 FLOP/s: ~40 ms)
#: are within a few x of each other; 1,024 is the round figure between them
PRIOR_PREFILL_TOKENS_PER_STEP = 1024.0
#: the length quantiles a request may be reserved to, from the most optimistic ...
QUANTILES = (0.75, 0.9, 0.95, 0.99)
#: ... and the median too where the measured batch gain is what pays for the risk, and none at
#: all (:data:`SURE`) where it pays even for a certain recompute: the request is then risked as
#: vLLM risks every request, at a floor widened as it decodes (``sidecar.admission.ends``)
SURE = 0.0
GAIN_QUANTILES = (SURE, 0.5, *QUANTILES)
#: weight of the newest interval in the learned figures
_EWMA = 0.2
#: intervals with fewer engine steps than this are too short to learn from
_MIN_STEPS = 4


def reserve_quantile(
    recompute_steps: float, *, risk_steps: float, quantiles: tuple[float, ...] = QUANTILES
) -> float | None:
    """The lowest length quantile ``q`` of ``quantiles`` whose risk, ``(1 - q)`` times the
    recompute's cost in decode steps, is at most ``risk_steps``; None when even the highest is
    too risky (the request is then reserved to its ``max_tokens``)."""
    for q in quantiles:
        if round((1.0 - q) * recompute_steps, 9) <= risk_steps:
            return q
    return None


@dataclass(frozen=True, slots=True)
class CostFigures:
    """What :class:`EngineCosts` has learned, for the exporter (None: not measured yet)."""

    decode_step_seconds: float | None  # a decode step at the recent batch
    step_base_seconds: float | None  # the step line's value at no token ...
    step_seconds_per_token: float | None  # ... and its slope per token processed
    prefill_tokens_per_step: float  # tokens whose recompute costs one decode step
    fixed_share: float | None = None  # of a decode step, what does not grow with the batch
    gain_steps_per_token: float | None = None  # decode steps a sequence saves per token in it


class EngineCosts:
    """Step costs of one engine, learned from its scrapes."""

    def __init__(self) -> None:
        self.decode_step_seconds: float | None = None  # smoothed inter-token latency
        self.batch: float = 0.0  # running sequences in the last interval learned from
        # exponentially weighted sums for the line step = base + per_token * tokens
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def update(self, prev: EngineSnapshot, snap: EngineSnapshot) -> None:
        """Learn from the interval between two scrapes, when vLLM was busy through it."""
        if prev.running <= 0 or snap.running <= 0:
            return
        self.batch = (prev.running + snap.running) / 2.0
        tokens = snap.inter_token_latency_count - prev.inter_token_latency_count
        if tokens > 0:
            step = max(0.0, snap.inter_token_latency_sum - prev.inter_token_latency_sum) / tokens
            old = self.decode_step_seconds
            self.decode_step_seconds = step if old is None else (1 - _EWMA) * old + _EWMA * step
        steps = snap.steps_total - prev.steps_total
        elapsed = snap.taken_at - prev.taken_at
        if steps >= _MIN_STEPS and elapsed > 0:
            per_step = (snap.step_tokens_total - prev.step_tokens_total) / steps
            self._learn(per_step, elapsed / steps)

    def _learn(self, tokens_per_step: float, seconds_per_step: float) -> None:
        decay = 1.0 - _EWMA
        self._w = decay * self._w + 1.0
        self._x = decay * self._x + tokens_per_step
        self._y = decay * self._y + seconds_per_step
        self._xx = decay * self._xx + tokens_per_step * tokens_per_step
        self._xy = decay * self._xy + tokens_per_step * seconds_per_step

    def line(self) -> tuple[float, float] | None:
        """(base, per token) of the step line; None until two different loads were seen."""
        if self._w <= 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var <= 1e-6 * max(1.0, mean_x * mean_x):
            return None  # one load only: no slope to tell
        slope = (self._xy / self._w - mean_x * mean_y) / var
        if slope <= 0:
            return None  # noise: more tokens never make a step faster
        return max(0.0, mean_y - slope * mean_x), slope

    def step_seconds(self, batch: float) -> float | None:
        """A decode step's expected time with ``batch`` sequences running (None: unknown).
        Without a slope, the recent decode step (a larger batch never makes steps faster)."""
        recent = self.decode_step_seconds
        line = self.line()
        if line is None:
            return recent
        base, per_token = line
        fitted = base + per_token * batch
        return fitted if recent is None or batch < self.batch else max(recent, fitted)

    def recompute_steps(self, tokens: float) -> float:
        """What recomputing ``tokens`` (a preempted request's prompt and output) costs, in
        decode steps at the recent batch."""
        line = self.line()
        step = self.step_seconds(self.batch) if line is not None else None
        if line is None or step is None or step <= 0:
            return tokens / PRIOR_PREFILL_TOKENS_PER_STEP
        return tokens * line[1] / step

    def fixed_share(self) -> float | None:
        """The share of a decode step at the recent batch that does not grow with the batch
        (the step line's base over the recent decode step, at most 1; None: unknown). On a GPU
        that is reading the weights, once per step for the whole batch."""
        line = self.line()
        step = self.decode_step_seconds
        if line is None or step is None or step <= 0:
            return None
        return min(1.0, line[0] / step)

    def gain_steps(self, tokens: float) -> float:
        """Decode steps of the engine's time a sequence saves by decoding ``tokens`` in the
        recent batch rather than outside it (0 where unknown).

        With the batch held back by the pool, the engine's time per token is ``base / batch +
        per_token``: one sequence more decodes its ``tokens`` at ``per_token`` each, where the
        same tokens cost ``base / batch`` more each in the batch without it. That saving, in
        decode steps, is ``tokens x fixed share / batch``. Adaptive mode lets a request risk
        that much recompute (the chance its answer outruns its reservation times what its
        recompute costs): running more pays for preemptions where a step's fixed share is
        large and the batch small."""
        share = self.fixed_share()
        if share is None or tokens <= 0:
            return 0.0
        return tokens * share / max(1.0, self.batch)

    def figures(self) -> CostFigures:
        line = self.line()
        share = self.fixed_share()
        return CostFigures(
            decode_step_seconds=self.decode_step_seconds,
            step_base_seconds=line[0] if line is not None else None,
            step_seconds_per_token=line[1] if line is not None else None,
            prefill_tokens_per_step=1.0 / max(self.recompute_steps(1.0), 1e-12),
            fixed_share=share,
            gain_steps_per_token=self.gain_steps(1.0) if share is not None else None,
        )
