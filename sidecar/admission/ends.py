"""How many output tokens a request is promised: the reservation strategies of
``--reservation``, as one pure function of the mode, the learned lengths and the engine's costs.

- ``worst-case``: every sequence its ``max_tokens`` (no preemption, ever);
- ``expected``: the class's learned length bound at ``--expected-quantile``, its prior share of
  ``max_tokens`` until it has enough answers (``sidecar.admission.learner``);
- ``adaptive``: the length quantile at which the recompute a preemption would cost on this
  engine (``sidecar.admission.costs``) is at most what running the request in the batch saves
  (a step's fixed share of its answer's steps over the batch), and at least ``risk_steps``
  decode steps (where the saving exceeds even a certain recompute, the floor
  :data:`COLD_OUTPUT_TOKENS` or the class's likely length if shorter, widened as the answer
  runs past it but not by vLLM's preemptions), from the class's
  answers, else every class's (vLLM's own history included). A class with none of its own whose
  requests name their max_tokens (``class:none`` names none) reserves all of it while at least
  ``1 - q`` of the answers seen ran to their max_tokens (vLLM's ``finished_reason="length"``):
  such a request is that likely to use it all. A cold start (nothing known) risks
  :data:`COLD_OUTPUT_TOKENS` where a recompute is cheap and ``max_tokens`` where it is not.

Beside other requests in flight, adaptive mode reserves to the pool's quantile rather than
the request's own (``LengthLearner.pooled_bound``: the quantile of the sum of the answers in
flight, over their number), once the class, else every class, has 32 answers.

A request that sets ``ignore_eos`` (its class ends in ``+ignore_eos``) will reach its
``max_tokens``: it is reserved all of it, except in adaptive mode where running it now saves more
than even a certain recompute costs (then it is risked at the floor, as vLLM risks it: cold, by
the priors, a decode step half fixed and 1,024 prompt tokens a step, that is every such request
whose answer is long beside its prompt and the batch it joins and whose recompute costs at most
:data:`CHEAP_RECOMPUTE_STEPS`: a guessed share risks no dearer one). In every
mode an answer past its end is expected to run to twice what it has
(``Reservation.end``), and vLLM's preemptions widen the learned ends for a while.

>>> from sidecar.admission.costs import EngineCosts
>>> from sidecar.admission.learner import LengthLearner
>>> rule = Ends(ReservationMode.adaptive, LengthLearner(), risk_steps=1.0)
>>> rule.end("chat:none", 300, 1748, EngineCosts())  # cold, a cheap recompute: the floor
256
"""

from __future__ import annotations

from sidecar.admission.costs import GAIN_QUANTILES, QUANTILES, SURE, EngineCosts, reserve_quantile
from sidecar.admission.learner import UNBOUNDED, LengthLearner, runs_to_max
from sidecar.config import ReservationMode
from sidecar.kv.ledger import Reservation, widened

#: adaptive mode, while nothing is known of answer lengths: output tokens risked per sequence
#: where a recompute is cheap (a few decode steps), widened as the answer runs past them (LightLLM
#: and SGLang likewise start low and grow an estimate as a request decodes) ...
COLD_OUTPUT_TOKENS = 256
#: ... as long as the quantile the recompute's cost asks for is at most this one
COLD_QUANTILE = 0.9
#: a recompute that costs at most this many decode steps is risked as vLLM risks every request
#: (admitted when its prompt fits: ``Ends.risked``), whatever the batch gains: a preemption costs
#: the engine about what a step or two of the batch does, a small part of any answer's run,
#: where holding requests back costs the batch they would have joined. On the CPU engine a
#: chat's recompute is about a step (prompts of a few hundred tokens at ~5-10 us a token, as
#: measured on an idle machine, beside a 3-40 ms step); on a GPU an 8B's prompts of a few
#: hundred tokens are within it, prompts of thousands are not
CHEAP_RECOMPUTE_STEPS = 2.0
#: the highest quantile the pool's answers are reserved to where a recompute costs more than
#: one request alone may risk even at 0.99 (beyond it the expansion and 32 answers say little)
MAX_POOLED_QUANTILE = 0.999
#: the lowest quantile of the in-flight demand the spread ends are kept within (tests/
#: test_spread.py: with 16 sequences in flight the drawn peak passed the 0.9 figure in at most
#: 7% of draws, exponential and log-normal answers included)
SPREAD_MIN_QUANTILE = 0.9


class Ends:
    """The output tokens each sequence is promised, in one ``--reservation`` mode."""

    def __init__(self, mode: ReservationMode, learner: LengthLearner, *, risk_steps: float) -> None:
        self.mode = ReservationMode(mode)
        self.learner = learner
        self.risk_steps = risk_steps

    def end(
        self,
        klass: str,
        prompt_tokens: int,
        max_tokens: int,
        costs: EngineCosts,
        concurrency: float = 1.0,
    ) -> int:
        """Output tokens to reserve for one sequence of ``klass`` with this prompt;
        ``concurrency``: the requests in flight in its pool with it (adaptive mode pools their
        risk: ``LengthLearner.pooled_bound``)."""
        if self.mode is ReservationMode.worst_case:
            return max_tokens
        if runs_to_max(klass):
            return self._runs_to_max(prompt_tokens, max_tokens, costs, concurrency)
        if self.mode is ReservationMode.expected:
            return self.learner.end(klass, max_tokens)
        return self._adaptive(klass, prompt_tokens, max_tokens, costs, concurrency)

    def risked(self, klass: str, prompt_tokens: int, max_tokens: int, costs: EngineCosts) -> bool:
        """Whether the request is admitted as vLLM admits a request (its prompt fits now:
        ``sidecar.admission.fit.fits_now``): in adaptive mode, where its recompute costs at most
        :data:`CHEAP_RECOMPUTE_STEPS` decode steps. Its reserved end (:meth:`end`) then only
        tells the others' fit tests where it likely ends.

        Not where only the batch gain pays for a certain recompute (long prompts with long
        answers on a weight-bound engine): such a request is reserved from the floor and laid
        out by the future peak as before, since admitting every one of them by its prompt is
        what makes vLLM run dry mid-decode and preempt the same requests again and again
        (measured on the simulated 8B: the thrash burst preempted 17-24 times a run, as direct
        did, where the floor by the future peak preempted none). Nor an ``ignore_eos`` request:
        its whole trajectory is known."""
        if self.mode is not ReservationMode.adaptive or runs_to_max(klass):
            return False
        likely = self._likely(klass, max_tokens)
        return costs.recompute_steps(prompt_tokens + likely) <= CHEAP_RECOMPUTE_STEPS

    def averaged(
        self,
        klass: str,
        prompt_tokens: int,
        max_tokens: int,
        costs: EngineCosts,
        concurrency: float = 1.0,
    ) -> bool:
        """Whether an ``ignore_eos`` request whose recompute is cheap (at most
        :data:`CHEAP_RECOMPUTE_STEPS` decode steps even at its end) may also be admitted where
        the requests in flight, each at the mean of the rest of its trajectory, fit beside its
        own mean (``sidecar.admission.fit.fits``, ``averaged``), in adaptive mode.

        Answers of one length that start together peak together: laid out by their known
        peaks, a burst of them runs in waves that use the pool fully only at their end (about
        two thirds of it over the wave for prompts of 256 and answers of 600 tokens), where
        vLLM alone fills it and preempts. By their means, a wave holds about as many as a
        staggered stream would at its peak; vLLM preempts the last of them near the wave's
        end, each for a recompute that costs a step or two, and their restarts stagger the
        next wave (``vllm bench serve``'s burst: BENCHMARKS.md). Where lengths vary, the
        laid-out peaks stagger a burst themselves. Not where the batch gain pays even a
        certain recompute (``_runs_to_max`` reserves it from the floor then)."""
        if self.mode is not ReservationMode.adaptive or not runs_to_max(klass):
            return False
        if self._risks_to_max(prompt_tokens, max_tokens, costs, concurrency):
            return False
        return costs.recompute_steps(prompt_tokens + max_tokens) <= CHEAP_RECOMPUTE_STEPS

    def revised(
        self, res: Reservation, costs: EngineCosts, concurrency: float = 1.0
    ) -> tuple[int, ...] | None:
        """Lower ends for an ``ignore_eos`` request in flight that was reserved more than
        adaptive mode would reserve it now, or None where none is lower (another mode, a class
        whose lengths are learned, ends that stay).

        A request admitted before the engine's costs were measured is reserved its whole
        ``max_tokens`` where the prior's recompute is not cheap (``_gain``: a guess risks no
        dear one), and it kept that reservation after the costs were measured and said to
        risk it from the floor. On the simulated 8B's two-round burst the second round was
        admitted in the second after the first ended, before the next scrape measured the
        costs: 17 whole reservations then left no room for the last two requests of the
        round, each of which waited the whole round and then ran with one other (the run took
        72 s against 57 s where two more fitted: BENCHMARKS.md, HAProxy with one server per
        replica). The revised end is the floor, or, for a sequence that has generated it,
        where an answer past its end is expected to run (``Reservation.end``); never higher
        than the one it has, and never under its ``min_tokens``."""
        if self.mode is not ReservationMode.adaptive or not runs_to_max(res.klass):
            return None
        p = res.projection
        done = int(res.generated)
        ends = []
        for prompt, limit, end in zip(p.prompt_tokens, p.max_tokens, res.ends, strict=True):
            new = widened(self._runs_to_max(prompt, limit, costs, concurrency), limit, done)
            ends.append(min(end, max(min(p.min_tokens, limit), new)))
        revised = tuple(ends)
        return revised if revised != res.ends else None

    def spread_quantile(
        self,
        klass: str,
        prompt_tokens: int,
        max_tokens: int,
        costs: EngineCosts,
        concurrency: float = 1.0,
    ) -> float | None:
        """The quantile of the in-flight demand adaptive mode's second opinion keeps a request
        of ``klass`` within (``sidecar.kv.spread``, ``sidecar.admission.fit.spread_fits``): the
        one its own reservation is chosen at (at least :data:`SPREAD_MIN_QUANTILE`), or, where
        none is safe enough alone, ``1 - risk / recompute`` as for the pool's tail. None in the
        other modes, for a request that runs to its max_tokens (its length is known), and where
        even a certain recompute pays (it is reserved from the floor already)."""
        if self.mode is not ReservationMode.adaptive or runs_to_max(klass):
            return None
        quantile, _, risk, recompute = self._choice(
            klass, prompt_tokens, max_tokens, costs, concurrency
        )
        if quantile == SURE:
            return None
        if quantile is None:
            quantile = 1.0 - risk / recompute
        return min(MAX_POOLED_QUANTILE, max(SPREAD_MIN_QUANTILE, quantile))

    def _likely(self, klass: str, max_tokens: int) -> int:
        """Where an answer of ``klass`` likely ends, within ``max_tokens`` (the cold floor while
        nothing is known)."""
        return min(max_tokens, self.learner.likely(klass) or COLD_OUTPUT_TOKENS)

    def _choice(
        self,
        klass: str,
        prompt_tokens: int,
        max_tokens: int,
        costs: EngineCosts,
        concurrency: float = 1.0,
    ) -> tuple[float | None, int, float, float]:
        """The length quantile adaptive mode reserves the request to (None: none is safe
        enough alone; :data:`SURE`: even a certain recompute pays), with its class's likely
        length, the batch gain it may risk and what its recompute costs, in decode steps."""
        likely = self._likely(klass, max_tokens)
        # the recompute a request may risk: what running it in the batch saves (measured; it
        # may then be reserved to the median), at least --risk-steps
        recompute = costs.recompute_steps(prompt_tokens + likely)
        gain = _gain(costs, likely, concurrency, recompute)
        risk = max(self.risk_steps, gain)
        if recompute <= CHEAP_RECOMPUTE_STEPS:
            return SURE, likely, risk, recompute
        quantile = reserve_quantile(
            recompute,
            risk_steps=risk,
            quantiles=GAIN_QUANTILES if gain > self.risk_steps else QUANTILES,
        )
        return quantile, likely, risk, recompute

    def _adaptive(
        self,
        klass: str,
        prompt_tokens: int,
        max_tokens: int,
        costs: EngineCosts,
        concurrency: float = 1.0,
    ) -> int:
        learner = self.learner
        quantile, likely, risk, recompute = self._choice(
            klass, prompt_tokens, max_tokens, costs, concurrency
        )
        if quantile is None:
            # too costly a recompute for one request alone even at 0.99; beside others, the
            # pool's answers together may still outrun rarely enough: at 1 - risk / recompute
            return self._pooled_tail(klass, 1.0 - risk / recompute, max_tokens, concurrency)
        if quantile == SURE:
            # running it now saves more than its recompute would cost even if vLLM preempts it:
            # risk it as vLLM does, from the floor, widened as it decodes (Reservation.end). Not
            # widened by vLLM's preemptions (the boost): it is admitted knowing it may be
            # preempted, and widening it there would hold the batch back for a risk it pays for
            return min(COLD_OUTPUT_TOKENS, likely)
        bound = learner.own_bound(klass, quantile)
        # beside others in flight, their answers together must outrun their reservations
        # together no more often than one alone would: mostly less than each one's quantile,
        # more where rare long answers dominate (LengthLearner.pooled_bound)
        pooled = learner.pooled_bound(klass, quantile, concurrency)
        if pooled is not None:
            bound = pooled
        elif bound is None:
            named = not klass.endswith(":none")
            if named and learner.length_share() >= 1.0 - quantile:
                return max_tokens
            bound = learner.global_bound(quantile)
            pooled = learner.pooled_bound(None, quantile, concurrency)
            if pooled is not None:
                bound = pooled
        if bound is None:
            if quantile > COLD_QUANTILE:
                return max_tokens
            bound = COLD_OUTPUT_TOKENS
        return learner.boosted(min(bound, max_tokens), max_tokens)

    def _runs_to_max(
        self, prompt_tokens: int, max_tokens: int, costs: EngineCosts, concurrency: float = 1.0
    ) -> int:
        """An ``ignore_eos`` request reaches its ``max_tokens``: every quantile of its length is
        that. Only adaptive mode, where running it now saves more than even a certain recompute
        costs, risks it from the floor as vLLM does; otherwise all of it is reserved."""
        if self.mode is ReservationMode.adaptive and self._risks_to_max(
            prompt_tokens, max_tokens, costs, concurrency
        ):
            return min(COLD_OUTPUT_TOKENS, max_tokens)
        return max_tokens

    def _risks_to_max(
        self, prompt_tokens: int, max_tokens: int, costs: EngineCosts, concurrency: float = 1.0
    ) -> bool:
        """Whether a request that runs to its ``max_tokens`` is risked as vLLM risks it: only
        where running it now saves more than even a certain recompute costs. A cheap recompute
        alone does not do: its length is known, so its whole trajectory is (what vLLM's own
        benchmark client sends), and vLLM would preempt it for certain where the pool cannot
        hold it to its end."""
        recompute = costs.recompute_steps(prompt_tokens + max_tokens)
        gain = _gain(costs, max_tokens, concurrency, recompute)
        return gain > self.risk_steps and gain >= recompute

    def _pooled_tail(self, klass: str, quantile: float, max_tokens: int, concurrency: float) -> int:
        """Where one request alone would be reserved to ``max_tokens``: beside others in flight,
        the pool's quantile (``LengthLearner.pooled_bound``) at ``quantile`` (at most
        :data:`MAX_POOLED_QUANTILE`), from the class's answers, else every class's; still
        ``max_tokens`` alone, with fewer than 32 answers, or for a class that names its
        max_tokens with none of its own while answers run to it that often."""
        learner = self.learner
        quantile = min(MAX_POOLED_QUANTILE, quantile)
        pooled = learner.pooled_bound(klass, quantile, concurrency)
        if pooled is None:
            named = not klass.endswith(":none")
            if named and learner.length_share() >= 1.0 - quantile:
                return max_tokens
            pooled = learner.pooled_bound(None, quantile, concurrency)
        if pooled is None:
            return max_tokens
        return learner.boosted(min(pooled, max_tokens), max_tokens)

    def per_class(self, costs: EngineCosts) -> dict[str, int]:
        """What each class seen reserves for a short prompt (``kv_sidecar_expected_output_
        tokens``): none in worst-case mode, none still on the prior in expected mode, and in
        adaptive mode every class whose end does not wait on its request's max_tokens."""
        if self.mode is ReservationMode.worst_case:
            return {}
        if self.mode is ReservationMode.expected:
            return {k: n for k, n in self.learner.classes().items() if n is not None}
        out = {}
        for klass in self.learner.classes():
            # a class bucketed by max_tokens ("chat:512") is reserved at most its bucket; one
            # without (no max_tokens, a header's name) is unbounded here, and while vLLM's
            # preemptions widen reservations (the boost) its end is a share of each request's
            # own rest of the context: not a figure of the class, so left out then
            _, _, bucket = klass.partition(":")
            bucket = bucket.split("+", 1)[0]
            max_tokens = int(bucket) if bucket.isdigit() else UNBOUNDED
            if max_tokens == UNBOUNDED and self.learner.boost:
                continue
            end = self._adaptive(klass, 0, max_tokens, costs)
            if end < UNBOUNDED:
                out[klass] = end
        return out


def _gain(costs: EngineCosts, tokens: float, concurrency: float, recompute: float) -> float:
    """What running a sequence of ``tokens`` in the batch saves, in decode steps
    (``EngineCosts.gain_steps``), as admission may weigh it against a recompute of ``recompute``
    steps: while the decode line is not measured the step's fixed share is a prior
    (``PRIOR_FIXED_SHARE``), and a guess risks only a cheap recompute (at most
    :data:`CHEAP_RECOMPUTE_STEPS`); a dearer one waits for the measured share (0 until then).
    Taken on a guess, a burst of long prompts with long answers would be admitted by its
    floor, which is what makes vLLM run dry mid-decode and preempt (``Ends.risked``)."""
    if costs.fixed_share() is None and recompute > CHEAP_RECOMPUTE_STEPS:
        return 0.0
    return costs.gain_steps(tokens, concurrency)
