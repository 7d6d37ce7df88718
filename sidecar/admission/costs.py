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
interval (requests running at both ends), from engine-core times only (vLLM stamps its
requests' steps in the engine core, so a slow API server or a busy host slows both sides of each
ratio alike):

- the **decode line**: vLLM's inter-token latency over the interval (a decode step of its
  running batch) against the batch, fitted as ``step = base + per_sequence x batch`` by
  exponentially weighted least squares: with the prompt tokens computed a step as a second
  variable and the tokens decoded a step as the batch, where vLLM counts its steps and both
  varied (the prefills taken out of the step: :meth:`EngineCosts.line`), else against its
  running requests. The step a larger batch would
  make (:meth:`EngineCosts.step_seconds`, what a latency objective is checked with) and the
  step's **fixed share**, ``base`` over the step at the recent batch: on a GPU, reading the
  weights once per step for the whole batch; what one sequence more gains
  (:meth:`EngineCosts.gain_steps`, over the recent batch or the one it would join, whichever
  is larger). A line whose slope is not positive tells nothing (noise, or a batch that never
  varied). Until one is solved the fixed share is the **roofline's** where the model's weights
  are known (:meth:`EngineCosts.roofline`): a decode step bound by memory reads the weights
  once and every sequence's KV, so at a full pool it is ``weights / (weights + the pool's KV
  bytes)``, whatever the memory's speed (the simulated 70B at TP 8: 0.72 by it over the
  benchmarks' pool, about 0.8 at 29 sequences by its decode steps at 29 and at 2 sequences in
  its thrash burst, 11.8 and 9.6 ms; the 8B: 0.43). Where the weights are not known
  either, it is :data:`PRIOR_FIXED_SHARE`, which admission weighs against a cheap recompute
  only (``sidecar.admission.ends``);
- the **prefill cost**, what a prompt token computed adds to the step it runs in: where vLLM
  counts its steps (``vllm:iteration_tokens_total``, one observation a step), the slope of the
  interval's mean step (its inter-token latency) on the prompt tokens computed a step
  (``vllm:prompt_tokens_total`` less ``vllm:prompt_tokens_cached_total``, over the steps), the
  tokens decoded a step held, by the same weighted least squares; until those varied apart,
  each finished request's prefill (``vllm:request_prefill_time_seconds``: from being scheduled
  to its first token) less a decode step, summed over the interval's requests and over their
  prompt tokens less the prefix cache's hits (``vllm:request_prompt_tokens``). The second reads
  too low where prompts of different sizes mix: vLLM reports a prefill when its request
  finishes, and the interval's mean step it is set against is lengthened by the prefills of
  other requests then (on the simulated 8B's priority workload it read 0, its chats' prefills
  reported while the batch's prompts were prefilled). A preemption's **recompute** is the cost
  times the preempted request's tokens, in plain decode steps (the same fit at no prompt tokens)
  (:meth:`EngineCosts.recompute_steps`);
- the **recent decode step**: vLLM's inter-token latency over the interval.

Measured on the CPU engine (a two-layer model, idle): a 1,900-token prompt's first token in
25 ms where a decode step took 3-4 ms and a 16-token prompt's 21 ms, so about 5 us a prompt
token. A line fitted through the step time against the tokens each step processed, as before,
read the same engine on a busy 2-core host at 0.6-3 ms a token with no base at all: steps ran
slow when the host was busy, and the host was busy when prompts arrived.

Until a prefill is measured, a recompute is taken to cost one decode step per
``PRIOR_PREFILL_TOKENS_PER_STEP`` tokens.

vLLM reports a request's prefill time when the request finishes, and requests prefilled
together in one step each report that whole step: where a burst's requests start and end
together, the step is counted once per request and the cost per prompt token read that many
times too high (on ``vllm bench serve``'s burst on the CPU engine it fell from the prior's
1,024 tokens a step to 35-40 once the first wave of 12 ended: BENCHMARKS.md, Known lengths
admitted by their trajectories' means). So the interval's prefill seconds are scaled by the
share of distinct steps among its finished requests, as the sidecar saw their first tokens
(``Ledger.prefill_share``: streamed answers whose first tokens came within half a decode step of
each other shared a step). Requests the sidecar did not relay, or did not stream, count as
steps of their own.

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
#: a decode step's fixed share (:meth:`EngineCosts.fixed_share`), until the decode line is
#: measured: the line needs the batch to vary, and a sidecar that holds the batch at what fits
#: may not see it vary for a whole burst (``vllm bench serve``'s burst on the CPU engine: the
#: line was first solved 18 s into a 20 s burst, at 0.82). On a GPU a decode step of an 8B model
#: reads its ~16 GB of weights once for the whole batch and each sequence's KV beside them
#: (~128 KB a token): at a batch of 12, about 0.9 of the step with contexts of 1,000 tokens
#: and 0.25 with contexts of 32,000; half is the round figure between them
PRIOR_FIXED_SHARE = 0.5
#: the length quantiles a request may be reserved to, from the most optimistic ...
QUANTILES = (0.75, 0.9, 0.95, 0.99)
#: ... and the median too where the measured batch gain is what pays for the risk, and none at
#: all (:data:`SURE`) where it pays even for a certain recompute: the request is then risked as
#: vLLM risks every request, at a floor widened as it decodes (``sidecar.admission.ends``)
SURE = 0.0
GAIN_QUANTILES = (SURE, 0.5, *QUANTILES)
#: weight of the newest interval in the decode step and the prefill cost (a scrape's worth) ...
_EWMA = 0.2
#: ... and in the decode line (about 20 intervals: a line needs loads that varied)
_LINE_EWMA = 0.05
#: a batch whose weighted variance is below this share of its squared mean (or of 1) never varied
_VARIED = 1e-4
#: a mean step whose weighted deviation stayed under this share of its mean held still: a
#: slope on it says nothing (a burst's chunked prefill makes every step alike, a full token
#: budget each, while the prompt tokens counted at their requests' first tokens vary: on the
#: simulated 8B's thrash burst the slope read under 0.4 us a token from 2.2 to 3.7 s, while
#: the sidecar's requests in flight went from 48 to 60 of the burst's 64)
_STILL = 0.02
#: a finished prefill's net time (less a decode step) under this share of its whole time reads
#: as nothing: the interval's mean step, lengthened by other prompts' prefills, took it all
_NOTHING = 0.01
#: intervals (weighted) the mean step's fit needs before it is read
_FIRST_INTERVALS = 3.5
#: the batch and the prompt tokens a step moved together (their squared correlation above
#: ``1 - _COLLINEAR``): the step's growth cannot be told apart between them
_COLLINEAR = 0.01


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
    step_base_seconds: float | None  # the decode line's base
    step_seconds_per_token: float | None  # what a prompt token computed adds to a step
    prefill_tokens_per_step: float  # tokens whose recompute costs one decode step
    fixed_share: float | None = None  # of a decode step, what does not grow with the batch
    gain_steps_per_token: float | None = None  # decode steps a sequence saves per token in it
    step_seconds_per_sequence: float | None = None  # what a decode sequence adds to a step


class _Line:
    """Exponentially weighted least squares of ``y`` on ``x``."""

    __slots__ = ("sx", "sxx", "sxy", "sy", "w")

    def __init__(self) -> None:
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def learn(self, x: float, y: float) -> None:
        decay = 1.0 - _LINE_EWMA
        self.w = decay * self.w + 1.0
        self.sx = decay * self.sx + x
        self.sy = decay * self.sy + y
        self.sxx = decay * self.sxx + x * x
        self.sxy = decay * self.sxy + x * y

    def solve(self) -> tuple[float, float] | None:
        """(base, slope); None until ``x`` varied, or where the slope is not positive."""
        if self.w <= 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var <= _VARIED * max(1.0, mx * mx):
            return None
        slope = (self.sxy / self.w - mx * my) / var
        if slope <= 0:
            return None
        return max(0.0, my - slope * mx), slope


class _Plane:
    """Exponentially weighted least squares of ``y`` on ``x`` and ``z``, with an intercept; the
    slope on ``z`` alone where ``x`` never varied (its share then in the intercept)."""

    __slots__ = ("fresh", "solved", "sx", "sxx", "sxy", "sxz", "sy", "syy", "sz", "szy", "szz", "w")

    def __init__(self) -> None:
        self.w = self.sx = self.sz = self.sy = 0.0
        self.sxx = self.szz = self.sxz = self.sxy = self.szy = self.syy = 0.0
        # what solve() found, kept until the next learn() (admission asks several times a
        # decision)
        self.solved: tuple[float, float, float] | None = None
        self.fresh = False

    def learn(self, x: float, z: float, y: float) -> None:
        self.fresh = False
        decay = 1.0 - _LINE_EWMA
        self.w = decay * self.w + 1.0
        self.sx = decay * self.sx + x
        self.sz = decay * self.sz + z
        self.sy = decay * self.sy + y
        self.syy = decay * self.syy + y * y
        self.sxx = decay * self.sxx + x * x
        self.szz = decay * self.szz + z * z
        self.sxz = decay * self.sxz + x * z
        self.sxy = decay * self.sxy + x * y
        self.szy = decay * self.szy + z * y

    def solve(self) -> tuple[float, float, float] | None:
        """(intercept, slope on ``x``, slope on ``z``); where ``x`` never varied, or its slope
        came out negative, it is left out (slope 0, its share in the intercept); None until
        ``z`` varied, and where ``x`` and ``z`` moved together (:data:`_COLLINEAR`), or while
        ``y`` held still (:data:`_STILL`) or fewer than :data:`_FIRST_INTERVALS` were
        learned."""
        if not self.fresh:
            self.solved, self.fresh = self._solve(), True
        return self.solved

    def _solve(self) -> tuple[float, float, float] | None:
        if self.w < _FIRST_INTERVALS:
            return None
        w = self.w
        mx, mz, my = self.sx / w, self.sz / w, self.sy / w
        if self.syy / w - my * my <= (_STILL * my) ** 2:
            return None
        vzz = self.szz / w - mz * mz
        if vzz <= _VARIED * max(1.0, mz * mz):
            return None
        czy = self.szy / w - mz * my
        z_alone = (my - czy / vzz * mz, 0.0, czy / vzz)
        vxx = self.sxx / w - mx * mx
        if vxx <= _VARIED * max(1.0, mx * mx):
            return z_alone
        vxz = self.sxz / w - mx * mz
        det = vxx * vzz - vxz * vxz
        if det <= _COLLINEAR * vxx * vzz:
            return None
        cxy = self.sxy / w - mx * my
        on_x, on_z = (cxy * vzz - czy * vxz) / det, (czy * vxx - cxy * vxz) / det
        if on_x < 0:  # more sequences never make a step faster: the fit without them
            return z_alone
        return my - on_x * mx - on_z * mz, on_x, on_z

    def z_slope(self) -> float | None:
        """The slope on ``z`` with ``x`` held (None: as :meth:`solve`)."""
        solved = self.solve()
        return None if solved is None else solved[2]


class EngineCosts:
    """Step costs of one engine, learned from its scrapes."""

    def __init__(self) -> None:
        self.decode_step_seconds: float | None = None  # smoothed inter-token latency
        self.batch: float = 0.0  # running sequences in the last interval learned from
        self._line = _Line()  # decode step against the batch
        # the mean step against the tokens decoded and the prompt tokens computed a step
        self._steps = _Plane()
        self._measured: tuple[float, float] | None = None  # the fit's last line (line())
        self._roofline: tuple[int, int] | None = None  # (weights, KV block) bytes (roofline())
        self.pool_blocks: int | None = None  # the pool vLLM reported last
        self._decoding = 0.0  # tokens decoded a step in the last interval with steps counted
        # prefills' own seconds (less a decode step each) and their computed prompt tokens
        self._prefill_seconds = 0.0
        self._prefill_tokens = 0.0
        # prefills' whole seconds (their steps' decoding included) and their prompt tokens
        self._gross_seconds = 0.0
        self._gross_tokens = 0.0

    def update(
        self, prev: EngineSnapshot, snap: EngineSnapshot, *, shared: float | None = None
    ) -> None:
        """Learn from the interval between two scrapes, when vLLM was busy through it;
        ``shared``: of the requests that finished in it, the prefill steps their prefills took
        over their number (``Ledger.prefill_share``: a step shared by k prefills is reported k
        times, and counted once here), None where not known (each its own step)."""
        if prev.running <= 0 or snap.running <= 0:
            return
        self.batch = (prev.running + snap.running) / 2.0
        tokens = snap.inter_token_latency_count - prev.inter_token_latency_count
        taken = snap.prompt_tokens_total - prev.prompt_tokens_total
        cached = snap.prompt_tokens_cached - prev.prompt_tokens_cached
        counted = prev.steps_total is not None and snap.steps_total is not None
        step: float | None = None
        if tokens > 0:
            step = max(0.0, snap.inter_token_latency_sum - prev.inter_token_latency_sum) / tokens
            old = self.decode_step_seconds
            self.decode_step_seconds = step if old is None else (1 - _EWMA) * old + _EWMA * step
            if not counted or taken - cached <= 0:
                # where vLLM counts its steps, only an interval that computed no prompt
                # token is one of decode steps alone (line())
                self._line.learn(self.batch, step)
        if step is not None and prev.steps_total is not None and snap.steps_total is not None:
            steps = snap.steps_total - prev.steps_total
            if steps > 0:
                self._decoding = tokens / steps
                self._steps.learn(self._decoding, max(0.0, taken - cached) / steps, step)
        step = step if step is not None else self.decode_step_seconds
        finished = snap.prefill_count - prev.prefill_count
        prompts = snap.prompt_tokens_sum - prev.prompt_tokens_sum
        if step is None or finished <= 0 or prompts <= 0:
            return
        computed = prompts * (1.0 - min(1.0, max(0.0, cached / taken)) if taken > 0 else 1.0)
        gross = max(0.0, snap.prefill_seconds_sum - prev.prefill_seconds_sum)
        spent = max(0.0, gross - finished * step)
        if shared is not None:
            share = min(1.0, max(0.0, shared))
            spent, gross = spent * share, gross * share
        decay = 1.0 - _EWMA
        self._prefill_seconds = decay * self._prefill_seconds + spent
        self._prefill_tokens = decay * self._prefill_tokens + computed
        self._gross_seconds = decay * self._gross_seconds + gross
        self._gross_tokens = decay * self._gross_tokens + prompts

    def line(self) -> tuple[float, float] | None:
        """(base, per sequence) of the decode line; None until measured: the mean step's fit at
        no prompt tokens where the tokens decoded a step varied in it (the step with the
        prefills in it taken out), else the inter-token latency against the running batch.
        The second needs the batch to vary while it decodes, which a sidecar that holds a burst
        at what fits may never see (on the simulated 8B's thrash burst, run a second time on
        the same vLLM: 29 requests held for 23 s, where vLLM alone
        ran 30 on average and its recomputes cost it 2.4-2.6% of its time); the first sees the
        batch grow as the burst's prompts are prefilled. Where neither is solved now, the
        last line the first gave: a window in which the batch held still says nothing of the
        slope, and the fit forgets the intervals in which it varied within some 20 more.

        Where vLLM counts its steps, the second learns only from intervals that computed no
        prompt token: the others carry prefills. On the simulated 8B's thrash burst, 2.2 s in,
        the burst's prompts prefilled in full 8,192-token chunks made every step some 0.24 s
        while the batch grew from 4 to 22, and a line read through them gave a fixed share of
        0.99, twice the roofline's: a request was let in at its floor on it (BENCHMARKS.md, A
        prompt token read as free)."""
        solved = self._steps.solve()
        if solved is not None and solved[1] > 0:
            self._measured = max(0.0, solved[0]), solved[1]
            return self._measured
        return self._line.solve() or self._measured

    def prefill_seconds_per_token(self) -> float | None:
        """What a prompt token computed adds to a step (None: not measured yet): the slope of
        the mean step on the prompt tokens computed a step, the tokens decoded a step held,
        where vLLM counts its steps and those varied; else the finished requests' prefills less
        a decode step each, over their computed tokens, where that is not nothing. The slope is
        at most :meth:`prefill_bound`. Each prefill is set against the mean step of the interval
        it finished in, which other prompts' prefills lengthen: on the simulated 8B's thrash
        burst, 3 s in, the burst's prompts had made that step 0.2 s, every finished prefill read
        less than it, and a prompt token read as free; a recompute then cost nothing, and 21
        requests were let in as vLLM admits them, 49 in flight where the pool holds some 30 at
        their ends (vLLM preempted 18 times in that run). Not measured until then."""
        slope = self._steps.z_slope()
        if slope is not None and slope > 0:
            bound = self.prefill_bound()
            return slope if bound is None else min(slope, bound)
        if self._prefill_tokens <= 0 or self._prefill_seconds <= _NOTHING * self._gross_seconds:
            return None
        return self._prefill_seconds / self._prefill_tokens

    def prefill_bound(self) -> float | None:
        """The most a computed prompt token can add to a step, by the finished requests' own
        reports (None: none yet): their prefills' whole seconds, a shared step counted once,
        over the prompt tokens they computed. A step that computes z prompt tokens lasts at
        least z times what one adds, so the steps its prompts were prefilled in can be no
        shorter. The steps' fit reads more where its intervals slow for what their prompts do
        not cost: on the CPU engine on two cores, a burst's arrival (vLLM's API server and the
        sidecar taking its prompts in) slowed every step of the intervals it came in, the fit
        charged it to their prompt tokens at 2.2-2.3e-4 s a token, where the finished prefills'
        seconds over their tokens, decayed as here, read 4.1-6.8e-5 s (as computed from the
        logged counters) and one request at a time on an idle engine 1.8e-5 s (BENCHMARKS.md,
        vllm bench serve's burst rerun after the cost changes of 7 Dec): a recompute was priced
        some ten times its cost."""
        if self._prefill_tokens <= 0:
            return None
        return self._gross_seconds / self._prefill_tokens

    def prompt_seconds_per_token(self) -> float | None:
        """A prompt's whole prefill time per prompt token (None: not measured yet): the steps
        it was prefilled in, their decoding of the running batch included, over its prompt
        tokens, prefix-cache hits included. What a prompt sent to vLLM holds its engine for, as
        ``--priority-pace`` counts it. Unlike :meth:`prefill_seconds_per_token` no decode step
        is taken off, so it is not read as nothing where a prefill's step took no longer than
        the interval's mean decode step, itself lengthened by other requests' prefills: on the
        simulated 8B priority workload that one read 0 from 2.5 simulated seconds on, where chats
        of 280-560 tokens were prefilled in steps of 0.015-0.022 s beside plain decode steps of
        0.013 s (BENCHMARKS.md, The pace held to the interactive class's first tokens)."""
        if self._gross_tokens <= 0:
            return None
        return self._gross_seconds / self._gross_tokens

    def plain_step_seconds(self) -> float | None:
        """A decode step with no prompt in it, at the recent batch (None: unknown): the mean
        step's fit at no prompt tokens a step, where solved; else the recent mean step. The
        mean step is lengthened by every prefill in its interval: on the simulated 8B's thrash
        burst it read 0.24 s 3 s into the burst and 0.016 s from 19 s on, with no prompt left
        to prefill, and a recompute counted in the first read fifteen times too cheap."""
        solved = self._steps.solve()
        if solved is not None:
            plain = solved[0] + solved[1] * self._decoding
            if plain > 0:
                return plain
        return self.decode_step_seconds

    def step_seconds(self, batch: float) -> float | None:
        """A decode step's expected time with ``batch`` sequences running (None: unknown):
        the line's, at least the recent one from the recent batch up. Without a line, the
        recent decode step (a larger batch never makes steps faster)."""
        recent = self.decode_step_seconds
        line = self.line()
        if line is None:
            return recent
        fitted = line[0] + line[1] * batch
        return fitted if recent is None or batch < self.batch else max(recent, fitted)

    def recompute_steps(self, tokens: float) -> float:
        """What recomputing ``tokens`` (a preempted request's prompt and output) costs, in
        plain decode steps at the recent batch (:meth:`plain_step_seconds`)."""
        per_token = self.prefill_seconds_per_token()
        step = self.plain_step_seconds()
        if per_token is None or step is None or step <= 0:
            return tokens / PRIOR_PREFILL_TOKENS_PER_STEP
        return tokens * per_token / step

    def roofline(self, weights_bytes: int | None, bytes_per_block: int | None) -> None:
        """The model's weight bytes and a KV block's (the whole model's, both: a tensor-parallel
        split divides them alike), for :meth:`fixed_share` while the decode line is not
        solved; None: not known."""
        self._roofline = None
        if weights_bytes and bytes_per_block and weights_bytes > 0 and bytes_per_block > 0:
            self._roofline = (weights_bytes, bytes_per_block)

    def fixed_share(self) -> float | None:
        """The share of a decode step at the recent batch that does not grow with the batch
        (the line's base over its step there, at most 1). On a GPU that is reading the
        weights, once per step for the whole batch. Until the line is solved, the roofline's
        share at a full pool (:meth:`roofline`; ``pool_blocks``: the pool vLLM reported: the
        lowest share while the pool holds any KV, where preemptions happen), once a prompt
        token's cost is measured too. Weighed against the prior's recompute (1,024 tokens a
        step, where the simulated 8B's steps gave some 350), it made a cold sidecar admit 44 of
        the 8B's thrash burst at their floor at once, where reserved to their quantiles 29 went
        in, and vLLM preempted 12-17 times a run (BENCHMARKS.md). None: unknown."""
        line = self.line()
        if line is None:
            if self._roofline is None or not self.pool_blocks:
                return None
            if self.prefill_seconds_per_token() is None:
                return None
            weights, block = self._roofline
            return weights / (weights + self.pool_blocks * block)
        step = line[0] + line[1] * max(1.0, self.batch)
        return min(1.0, line[0] / step) if step > 0 else None

    def gain_steps(self, tokens: float, batch: float = 1.0) -> float:
        """Decode steps of the engine's time a sequence saves by decoding ``tokens`` in the
        recent batch, or in ``batch`` (the requests in flight with it) where that is larger,
        rather than outside it; the fixed share is :data:`PRIOR_FIXED_SHARE` until measured.

        With the batch held back by the pool, the engine's time per token is ``base / batch +
        per_sequence`` (the decode line): one sequence more decodes its ``tokens`` at
        ``per_sequence`` each, where the same tokens cost ``base / batch`` more each in the batch
        without it. That
        saving, in decode steps, is ``tokens x fixed share / batch``. Adaptive mode lets a
        request risk that much recompute (the chance its answer outruns its reservation times
        what its recompute costs): running more pays for preemptions where a step's fixed
        share is large and the batch small."""
        share = self.fixed_share()
        if share is None:
            share = PRIOR_FIXED_SHARE
        if tokens <= 0:
            return 0.0
        return tokens * share / max(1.0, self.batch, batch)

    def figures(self) -> CostFigures:
        line = self.line()
        share = self.fixed_share()
        return CostFigures(
            decode_step_seconds=self.decode_step_seconds,
            step_base_seconds=line[0] if line is not None else None,
            step_seconds_per_token=self.prefill_seconds_per_token(),
            prefill_tokens_per_step=1.0 / max(self.recompute_steps(1.0), 1e-12),
            fixed_share=share,
            gain_steps_per_token=self.gain_steps(1.0),
            step_seconds_per_sequence=line[1] if line is not None else None,
        )
