"""Learned output lengths, for ``--reservation expected``.

Answers are learned per *request class* (the endpoint and the ``max_tokens`` bucket, an absent
``max_tokens`` its own class, or a name the client gives in a header), as absolute completion
lengths, not as a share of ``max_tokens``: a class's answers end where the model stops, whatever
the client allowed.

What a class reserves is an upper confidence bound on a high quantile of its recent lengths: the
smallest order statistic that is at least the ``quantile`` with probability ``confidence``
(a binomial bound, distribution-free, so it holds from few samples: with the defaults 0.95 and
0.8, the largest of 32 answers; 45 for a 0.9 confidence). Until a class has that many, it
reserves ``prior`` of each request's ``max_tokens`` (1.0 unless the operator knows the workload:
what a fresh sidecar meets its first burst with). Each rise of vLLM's preemption counter adds a
boost, a share of the gap up to ``max_tokens``, that halves every ``boost_half_life`` seconds.

>>> learner = LengthLearner(quantile=0.9, confidence=0.8)
>>> learner.min_samples
16
>>> for n in range(16):
...     learner.observe("chat:none", 100 + n)
>>> learner.end("chat:none", 4000), learner.end("chat:512", 512)
(115, 512)
"""

from __future__ import annotations

import bisect
import functools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from statistics import NormalDist

#: classes kept at most (a header may name classes: the least recently used is dropped)
MAX_CLASSES = 256
#: a length vLLM's histogram only bounds from below (its +Inf bucket): up to max_tokens
UNBOUNDED = 1 << 31
#: Retry-After takes an in-flight request to end at this quantile of its class's lengths ...
LIKELY_QUANTILE = 0.75
#: ... once the class has this many answers
LIKELY_MIN_SAMPLES = 8


def min_samples_for(quantile: float, confidence: float) -> int:
    """Samples needed before the largest is an upper ``confidence`` bound on the quantile."""
    return max(1, math.ceil(math.log(1.0 - confidence) / math.log(quantile)))


@functools.lru_cache(maxsize=4096)
def _order_statistic_rank(n: int, quantile: float, confidence: float) -> int | None:
    """Smallest k (1-based) with P(X_(k) >= the quantile) >= confidence, None if none."""
    # P(X_(k) >= q-quantile) = P(Binomial(n, quantile) <= k - 1); the terms in logs: P(B = 0)
    # alone, 0.05 ** n, is below the smallest float from n = 237 on
    cdf = 0.0
    log_term = n * math.log1p(-quantile)  # log P(B = 0)
    log_ratio = math.log(quantile) - math.log1p(-quantile)
    for k in range(1, n + 1):
        cdf += math.exp(log_term)
        if cdf >= confidence:
            return k
        log_term += math.log(n - k + 1) - math.log(k) + log_ratio  # log P(B = k)
    return None


#: the class suffix of a request that asks vLLM to ignore the end-of-sequence token
#: (``ignore_eos``, as benchmark clients send it): its answer runs to its max_tokens
RUNS_TO_MAX = "+ignore_eos"


def request_class(
    endpoint: str, max_tokens: int | None, header: str | None = None, *, ignore_eos: bool = False
) -> str:
    """The class a request's answer length is learned in: a header's name, else the endpoint
    and the power-of-two bucket of ``max_tokens`` (``none`` when absent); with ``ignore_eos``,
    marked :data:`RUNS_TO_MAX` (nothing to learn: it ends at its max_tokens).

    >>> request_class("chat", None), request_class("completions", 300), request_class("chat", 9)
    ('chat:none', 'completions:512', 'chat:16')
    >>> request_class("completions", 300, ignore_eos=True)
    'completions:512+ignore_eos'
    """
    if header:
        klass = f"header:{header[:64]}"
    elif max_tokens is None:
        klass = f"{endpoint}:none"
    else:
        klass = f"{endpoint}:{1 << max(4, (max(1, max_tokens) - 1).bit_length())}"
    return klass + RUNS_TO_MAX if ignore_eos else klass


def runs_to_max(klass: str) -> bool:
    """Whether requests of ``klass`` ignore the end-of-sequence token: each runs to its
    max_tokens (unless a stop string it names ends it), so its length is known, not learned."""
    return klass.endswith(RUNS_TO_MAX)


class _Window:
    """The last ``maxlen`` lengths, in arrival order and kept sorted (each append costs a
    bisect and a memmove; a quantile is then an index, not a sort of the window)."""

    __slots__ = ("maxlen", "order", "ranked", "sums")

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self.order: deque[int] = deque()
        self.ranked: list[int] = []
        self.sums = [0, 0, 0]  # of the lengths, their squares and cubes (exact: integers)

    def append(self, length: int) -> None:
        sums = self.sums
        if len(self.order) >= self.maxlen:
            oldest = self.order.popleft()
            del self.ranked[bisect.bisect_left(self.ranked, oldest)]
            sums[0] -= oldest
            sums[1] -= oldest * oldest
            sums[2] -= oldest * oldest * oldest
        self.order.append(length)
        bisect.insort(self.ranked, length)
        sums[0] += length
        sums[1] += length * length
        sums[2] += length * length * length

    def moments(self) -> tuple[float, float, float]:
        """The lengths' mean, standard deviation and skewness (population figures)."""
        n = len(self.order)
        mean = self.sums[0] / n
        var = max(0.0, self.sums[1] / n - mean * mean)
        if var <= 0:
            return mean, 0.0, 0.0
        third = self.sums[2] / n - 3 * mean * self.sums[1] / n + 2 * mean**3
        return mean, math.sqrt(var), third / var**1.5

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)


_NORMAL = NormalDist()
_Z_CONFIDENCE = _NORMAL.inv_cdf(0.8)


#: answers a window needs before :func:`pooled_length` is taken from its moments
POOLED_MIN_SAMPLES = 32


def pooled_length(
    mean: float, sd: float, skew: float, quantile: float, n: float, samples: float
) -> int:
    """What each of ``n`` answers in flight (independent draws of a length distribution whose
    mean, standard deviation and skewness were measured on ``samples`` answers) may be reserved
    to, so that their sum outruns ``n`` such reservations with probability about
    ``1 - quantile``.

    A preemption comes when the pool runs short, not when one answer outruns its reservation,
    and ``n`` answers spread about their mean by ``sqrt(n)`` standard deviations, not ``n``: the
    sum's ``quantile`` by the Cornish-Fisher expansion (the normal quantile ``z`` corrected by
    the sum's skewness, ``skew / sqrt(n)``, taken at least 0 and at most 4), over ``n``. The
    mean is itself uncertain by ``sd / sqrt(samples)``, and that error does not shrink with
    ``n``: the spread per answer is ``sd x sqrt(1 / n + 1 / samples)`` (a prediction interval),
    with ``sd`` raised to its 80% upper confidence bound. Where rare long answers dominate (a
    skewed mix) the figure is above each answer's own ``quantile``: n such requests together
    reach the long ones far more often than one does.

    An approximation, checked by tests/test_adaptive.py: sums of 2 to 64 draws of uniform,
    exponential, log-normal and two-mode lengths outrun it in at most 1.5 x ``1 - quantile``
    plus a point of 4,000 draws with moments from 20,000 answers, and at most 4 x ``1 -
    quantile`` plus a point with moments from 32 (at 0.9, 0.95 and 0.99). Not for a mix where
    one answer in twenty is very long: the first holds at 0.99 only, and 32 answers often hold
    no long one, so that 16 and 64 in flight outran it in 12% and 18% of the test's trials at
    0.99 (an answer that outruns its reservation is widened as it decodes, and vLLM's
    preemptions widen every class's for a while, :meth:`LengthLearner.boosted`).

    >>> [pooled_length(125, 55, 0.0, 0.95, n, 10**9) for n in (4, 16, 64)]  # 30-220, uniform
    [171, 148, 137]
    >>> [pooled_length(125, 55, 0.0, 0.95, n, 32) for n in (4, 16, 64)]  # from 32 answers
    [179, 156, 147]
    """
    z = _NORMAL.inv_cdf(quantile)
    gamma = min(4.0, max(0.0, skew)) / math.sqrt(n)
    z_sum = z + (z * z - 1.0) * gamma / 6.0
    sd_upper = sd * (1.0 + _Z_CONFIDENCE / math.sqrt(2.0 * max(1.0, samples - 1.0)))
    return math.ceil(mean + sd_upper * z_sum * math.sqrt(1.0 / n + 1.0 / samples))


def _quantile(lengths: _Window, quantile: float) -> int:
    ordered = lengths.ranked
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


class LengthLearner:
    """Per-class completion lengths and the ends expected mode reserves."""

    def __init__(
        self,
        quantile: float = 0.95,
        *,
        confidence: float = 0.8,
        window: int = 512,
        prior: float = 1.0,
        boost_half_life: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < prior <= 1.0:
            raise ValueError(f"prior must be in (0, 1], got {prior!r}")
        if not 0.0 < quantile < 1.0 or not 0.0 < confidence < 1.0:
            raise ValueError("quantile and confidence must be in (0, 1)")
        self.quantile = quantile
        self.confidence = confidence
        self.prior = prior
        self.min_samples = min_samples_for(quantile, confidence)
        self._window = max(window, self.min_samples)
        self._lengths: dict[str, _Window] = {}
        self._bound: dict[str, int | None] = {}  # cached per class, None: not enough samples
        self._bounds: dict[tuple[str, float], int | None] = {}  # the same at other quantiles
        self._likely: dict[str, int | None] = {}  # the same, for likely()
        self._all = _Window(self._window)  # every class's, for a cold class
        self._likely_all: int | None = None
        self._likely_all_stale = False
        self._boost = 0.0
        self._boost_at = 0.0
        self.observed = 0  # answers observed (restored ones included)
        self._at_length = 0.0  # answers that ran to their max_tokens ...
        self._stopped = 0.0  # ... and that ended before it
        self.seeded = 0  # lengths taken from vLLM's histogram
        self._half_life = boost_half_life
        self._clock = clock

    def observe(self, klass: str, completion_tokens: int, *, at_max: bool | None = None) -> None:
        """An answer of ``klass`` ended naturally after this many tokens (per sequence);
        ``at_max``: whether that was all of its max_tokens (None: not known). A class that
        ignores the end-of-sequence token teaches nothing: its length was its max_tokens."""
        if runs_to_max(klass):
            return
        if at_max is not None:
            if at_max:
                self._at_length += 1
            else:
                self._stopped += 1
        lengths = self._lengths.pop(klass, None)
        if lengths is None:
            lengths = _Window(self._window)
            if len(self._lengths) >= MAX_CLASSES:
                oldest = next(iter(self._lengths))
                del self._lengths[oldest]
                self._bound.pop(oldest, None)
                self._likely.pop(oldest, None)
        self._lengths[klass] = lengths  # most recently used last
        lengths.append(max(0, completion_tokens))
        self._all.append(max(0, completion_tokens))
        self._bound.pop(klass, None)
        self._likely.pop(klass, None)
        self._likely_all_stale = True
        self._bounds.clear()
        self.observed += 1

    def learned(self, klass: str) -> int | None:
        """The class's length bound, None until it has enough answers."""
        if klass in self._bound:
            return self._bound[klass]
        lengths = self._lengths.get(klass)
        bound: int | None = None
        if lengths:
            rank = _order_statistic_rank(len(lengths), self.quantile, self.confidence)
            if rank is not None:
                bound = lengths.ranked[rank - 1]
        self._bound[klass] = bound
        return bound

    def bound(self, klass: str, quantile: float) -> int | None:
        """An upper ``confidence`` bound on the ``quantile`` of the class's lengths, or, while
        the class has too few answers for it, of every class's (vLLM's own history included,
        :meth:`seed`); None while neither has enough.

        >>> learner = LengthLearner()
        >>> for n in range(1, 11):
        ...     learner.observe("chat:none", 10 * n)
        >>> learner.bound("chat:none", 0.75), learner.bound("chat:none", 0.95)
        (100, None)
        """
        own = self.own_bound(klass, quantile)
        return own if own is not None else self.global_bound(quantile)

    def own_bound(self, klass: str, quantile: float) -> int | None:
        """:meth:`bound` from the class's own answers alone."""
        key = (klass, quantile)
        if key not in self._bounds:
            self._bounds[key] = self._order_bound(self._lengths.get(klass), quantile)
        return self._bounds[key]

    def global_bound(self, quantile: float) -> int | None:
        """:meth:`bound` from every class's answers (vLLM's history included)."""
        key = ("", quantile)  # "" is never a class name (request_class names the endpoint)
        if key not in self._bounds:
            self._bounds[key] = self._order_bound(self._all, quantile)
        return self._bounds[key]

    def pooled_bound(self, klass: str | None, quantile: float, concurrency: float) -> int | None:
        """The length each of ``concurrency`` requests in flight of the class (None: of every
        class) is reserved to, so that their answers together outrun their reservations
        together about as often as one answer outruns its ``quantile``
        (:func:`pooled_length` over the window's moments); None alone, or while the window has
        fewer than :data:`POOLED_MIN_SAMPLES` answers."""
        lengths = self._all if klass is None else self._lengths.get(klass)
        if concurrency <= 1 or lengths is None or len(lengths) < POOLED_MIN_SAMPLES:
            return None
        mean, sd, skew = lengths.moments()
        return pooled_length(mean, sd, skew, quantile, concurrency, len(lengths))

    def spread_window(self, klass: str) -> list[int] | None:
        """The answers ``sidecar.kv.spread`` spreads a request of ``klass``'s end over, sorted:
        the class's own, else every class's once vLLM's histogram no longer stands among them
        (its buckets' answers are placed, not measured); None with fewer than
        :data:`POOLED_MIN_SAMPLES`, or for a class that runs to its max_tokens.

        >>> learner = LengthLearner()
        >>> for n in range(40):
        ...     learner.observe("chat:none", 100 + n)
        >>> learner.spread_window("chat:none")[:3], len(learner.spread_window("chat:512"))
        ([100, 101, 102], 40)
        """
        if runs_to_max(klass):
            return None
        lengths = self._lengths.get(klass)
        if lengths is None or len(lengths) < POOLED_MIN_SAMPLES:
            lengths = self._all
            if self.observed < len(lengths):
                return None  # seeded from vLLM's histogram, still in the window
        if len(lengths) < POOLED_MIN_SAMPLES:
            return None
        return lengths.ranked

    def spread_windows(self) -> tuple[list[list[int]], Callable[[str], int]]:
        """The windows :meth:`spread_window` gives, filled as the returned function is asked for
        a class's index among them (-1: none)."""
        windows: list[list[int]] = []
        index: dict[str, int] = {}

        def window_of(klass: str) -> int:
            if klass not in index:
                window = self.spread_window(klass)
                index[klass] = -1 if window is None else len(windows)
                if window is not None:
                    windows.append(window)
            return index[klass]

        return windows, window_of

    def length_share(self) -> float:
        """The share of answers that ran to their max_tokens (vLLM's ``finished_reason``
        ``length`` at the first scrape, then the answers seen): how likely a request that names
        its max_tokens is to use all of it (0 while nothing is known)."""
        total = self._at_length + self._stopped
        return self._at_length / total if total else 0.0

    def _order_bound(self, lengths: _Window | None, quantile: float) -> int | None:
        if not lengths:
            return None
        rank = _order_statistic_rank(len(lengths), quantile, self.confidence)
        return None if rank is None else lengths.ranked[rank - 1]

    def seed(
        self,
        histogram: tuple[tuple[float, float], ...],
        *,
        total_tokens: float | None = None,
        at_length: float = 0.0,
        stopped: float = 0.0,
    ) -> int:
        """Take vLLM's own answer lengths (``vllm:request_generation_tokens``: cumulative counts
        by upper bound) as every class's history, when nothing is known yet: a sidecar started
        beside a vLLM that has answered starts from what vLLM has seen. A bucket's answers are
        spread evenly over its range (vLLM's 1-2-5 buckets are wide: their upper bounds alone
        read a 32..320-token answer mix as 500), the +Inf bucket's run up to max_tokens, in
        proportion, at most the window's worth; ``total_tokens`` (the histogram's ``_sum``)
        narrows the spread (:func:`_spread`); ``at_length`` and ``stopped`` (vLLM's answers by
        ``finished_reason``) give :meth:`length_share`. Returns the lengths taken (0 when the
        learner already knows answers)."""
        if self._all or not histogram:
            return 0
        self._at_length, self._stopped = at_length, stopped
        total = histogram[-1][1]
        if total <= 0:
            return 0
        scale = min(1.0, self._window / total)
        buckets: list[tuple[float, float, int]] = []  # (lower, upper, answers), +Inf last
        below, lower = 0.0, 0.0
        for le, cumulative in histogram:
            buckets.append((lower, le, round((cumulative - below) * scale)))
            below, lower = cumulative, le
        taken = 0
        for length in _spread(buckets, None if total_tokens is None else total_tokens * scale):
            self._all.append(length)
            taken += 1
        self._likely_all_stale = True
        self._bounds.clear()
        self.seeded = taken
        return taken

    def likely(self, klass: str) -> int | None:
        """Where an answer of ``klass`` likely ends: the ``LIKELY_QUANTILE`` of its recent
        lengths, or of every class's while it has fewer than ``LIKELY_MIN_SAMPLES`` (None
        while all of them together have fewer). Not a reservation: Retry-After uses it to tell
        when requests in flight will have made room, whatever mode reserves.

        >>> learner = LengthLearner()
        >>> for n in range(1, 9):
        ...     learner.observe("chat:none", 10 * n)
        >>> learner.likely("chat:none"), learner.likely("chat:16"), LengthLearner().likely("x")
        (70, 70, None)
        """
        if klass in self._likely:
            return self._likely[klass]
        if runs_to_max(klass):
            return None  # it ends at its max_tokens: its reserved end
        lengths = self._lengths.get(klass)
        if lengths is None or len(lengths) < LIKELY_MIN_SAMPLES:
            return self._likely_over_all()  # not cached per class: every answer changes it
        likely = _quantile(lengths, LIKELY_QUANTILE)
        self._likely[klass] = likely
        return likely

    def _likely_over_all(self) -> int | None:
        if self._likely_all_stale:
            self._likely_all_stale = False
            enough = len(self._all) >= LIKELY_MIN_SAMPLES
            self._likely_all = _quantile(self._all, LIKELY_QUANTILE) if enough else None
        return self._likely_all

    def tighten(self) -> None:
        """vLLM preempted: reserve more until the preemptions stop."""
        self._boost = min(1.0, max(0.1, self.boost * 2))
        self._boost_at = self._clock()

    def boosted(self, base: int, max_tokens: int) -> int:
        """``base`` widened by the boost (a share of the gap to ``max_tokens``)."""
        boost = self.boost
        if boost:
            base += math.ceil(boost * (max_tokens - base))
        return min(max_tokens, max(1, base))

    @property
    def boost(self) -> float:
        if self._boost == 0.0:
            return 0.0
        elapsed = self._clock() - self._boost_at
        return float(self._boost * 0.5 ** (elapsed / self._half_life))

    def end(self, klass: str, max_tokens: int) -> int:
        """Output tokens to reserve for one sequence of ``klass`` allowed ``max_tokens``."""
        learned = self.learned(klass)
        base = math.ceil(self.prior * max_tokens) if learned is None else min(learned, max_tokens)
        return self.boosted(base, max_tokens)

    def export(self) -> dict[str, list[int]]:
        """Every class's recent lengths, oldest first (what :meth:`restore` takes back)."""
        return {klass: list(lengths) for klass, lengths in self._lengths.items()}

    def restore(self, classes: dict[str, list[int]]) -> int:
        """Take back lengths that :meth:`export` gave (a restarted sidecar's cold start);
        returns the lengths taken. Lengths already observed stay, newest last."""
        taken = 0
        for klass, lengths in list(classes.items())[-MAX_CLASSES:]:
            seen = list(self._lengths.get(klass, ()))
            self._lengths.pop(klass, None)
            for length in lengths:
                self.observe(klass, length)
                taken += 1
            for length in seen:
                self.observe(klass, length)
        return taken

    def classes(self) -> dict[str, int | None]:
        """Every class seen and its learned length (None: still on the prior)."""
        return {klass: self.learned(klass) for klass in self._lengths}


def _spread(buckets: list[tuple[float, float, int]], total: float | None) -> Iterator[int]:
    """Lengths for a histogram's buckets, ``(lower, upper, count)`` in order (an infinite upper
    bound: :data:`UNBOUNDED` each): each bucket's answers spread evenly over ``(lower, upper]``,
    or, when ``total`` (the answers' summed lengths) says they sum to less, over the same share
    of each bucket from its lower bound, or to more, from its upper bound (where no answer is
    past the last finite bound: else the +Inf bucket's may hold the rest).

    >>> list(_spread([(0, 10, 2), (10, 100, 2)], None))
    [5, 10, 55, 100]
    >>> list(_spread([(0, 10, 2), (10, 100, 2)], 60))  # near the lower bounds
    [2, 3, 22, 34]
    >>> list(_spread([(0, 10, 2), (10, 100, 2)], 195))  # near the upper bounds
    [10, 8, 100, 78]
    """
    finite = [(lo, hi, n) for lo, hi, n in buckets if math.isfinite(hi) and n > 0]
    unbounded = sum(n for _, hi, n in buckets if not math.isfinite(hi))
    # at the share f of each bucket from its lower bound, k of n at lower + f * width * k / n:
    # the sum is floor + f * width_sum (f = 1: spread evenly)
    floor = sum(lo * n for lo, _, n in finite)
    width_sum = sum((hi - lo) * (n + 1) / 2 for lo, hi, n in finite)
    share, from_top = 1.0, False
    if total is not None and width_sum > 0:
        finite_total = total - unbounded * max((hi for _, hi, _ in finite), default=0.0)
        if finite_total < floor + width_sum:
            share = max(0.0, (finite_total - floor) / width_sum)
        elif not unbounded:  # k of n at upper - f * width * k / n: ceiling - f * down_sum
            ceiling = sum(hi * n for _, hi, n in finite)
            down_sum = sum((hi - lo) * (n - 1) / 2 for lo, hi, n in finite)
            if down_sum > 0:
                share = max(0.0, min(1.0, (ceiling - total) / down_sum))
                from_top = True
    for lo, hi, n in buckets:
        for k in range(n):
            if not math.isfinite(hi):
                yield UNBOUNDED
            elif from_top:
                yield min(math.floor(hi), math.ceil(hi - share * (hi - lo) * k / n))
            else:
                yield min(math.floor(hi), math.ceil(lo + share * (hi - lo) * (k + 1) / n))
