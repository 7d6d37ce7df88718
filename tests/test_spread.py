"""The future peak with the in-flight answers' ends spread over their learned lengths
(``sidecar.kv.spread``), and adaptive mode's second opinion built on it
(``sidecar.admission.fit.spread_fits``, ``AdmissionController._spread_fits``)."""

from __future__ import annotations

from collections.abc import Callable
from statistics import NormalDist

import numpy as np
import pytest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.fit import SPREAD_MIN_SEQUENCES
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import project_counts
from sidecar.kv.spread import SpreadRows, spread_peak
from sidecar.kv.trajectory import Trajectory, future_peak
from tests.support.snapshots import Clock, snapshot, teach_costs

BLOCKS = UniformBlocks(16)
Draw = Callable[[np.random.Generator, int], np.ndarray]


def _uniform(rng: np.random.Generator, k: int) -> np.ndarray:
    return rng.integers(1500, 2501, k)


def _exponential(rng: np.random.Generator, k: int) -> np.ndarray:
    return np.minimum(8000, rng.exponential(300, k) + 1).astype(np.int64)


def _lognormal(rng: np.random.Generator, k: int) -> np.ndarray:
    return np.minimum(8000, rng.lognormal(5, 1, k) + 1).astype(np.int64)


def drawn_peak(prompts: np.ndarray, lengths: np.ndarray, delays: np.ndarray) -> int:
    """The most blocks the sequences hold at once, stepped exactly: each waits ``delay`` steps
    holding its prompt (vLLM has it queued: counted as held, the safe side), then grows one
    token a step to its length and frees everything after its last token."""
    horizon = int((lengths + delays).max()) + 1
    steps = np.arange(horizon)
    total = np.zeros(horizon, dtype=np.int64)
    for p, length, delay in zip(prompts, lengths, delays, strict=True):
        grown = np.clip(steps - delay, 0, length)
        held = -(-(p + grown) // BLOCKS.block_size)
        total += np.where(steps <= delay + length, held, 0)
    return int(total.max())


def unstarted(prompts: np.ndarray, end: int, window: int = 0) -> SpreadRows:
    n = len(prompts)
    return SpreadRows.of(
        prompts, [0] * n, [end] * n, [8192] * n, [1] * n, [False] * n, [window] * n
    )


@pytest.mark.parametrize(
    ("draw", "sequences", "quantile", "allowed"),
    [
        (_uniform, 16, 0.95, 0.05),
        (_uniform, 64, 0.95, 0.05),
        (_exponential, 16, 0.95, 0.05),
        (_exponential, 16, 0.9, 0.10),
        (_lognormal, 16, 0.95, 0.05),
        (_lognormal, 64, 0.9, 0.10),
    ],
)
def test_drawn_answers_pass_the_spread_peak_no_more_often_than_its_quantile(
    draw: Draw, sequences: int, quantile: float, allowed: float
) -> None:
    """Sequences with short prompts (50-300 tokens: the answers dominate the demand), their
    lengths learned from 64 answers of the same distribution, each starting within the slack:
    over 200 draws of their answers and start delays, the exact peak passes the spread figure
    at ``quantile`` in at most ``1 - quantile`` of them (SPREAD_MIN_QUANTILE and
    SPREAD_MIN_SEQUENCES rest on these)."""
    rng = np.random.default_rng(7)
    window = np.sort(draw(rng, 64))
    z = NormalDist().inv_cdf(quantile)
    passed = 0
    for _ in range(200):
        prompts = rng.integers(50, 301, sequences)
        figure = spread_peak(unstarted(prompts, 8192), [window], BLOCKS, z=z, start_slack=16)
        lengths = draw(rng, sequences)
        if drawn_peak(prompts, lengths, rng.integers(0, 17, sequences)) > figure:
            passed += 1
    assert passed / 200 <= allowed, passed


def test_answers_starting_together_peak_when_the_first_end_not_when_all_reach_their_bound() -> None:
    """32 completions of 2,000-4,000-token prompts whose answers run 1,500-2,500 tokens (the
    simulated GPU's thrash burst), laid out to the pool's quantile of their lengths (what
    adaptive mode reserves each beside the others, ~2,150) and to the same figure spread:
    the spread peak is at least 8% lower, and still above the peak of every one of 200 draws."""
    rng = np.random.default_rng(3)
    window = np.sort(_uniform(rng, 256))
    prompts = rng.integers(2000, 4001, 32)
    pooled_end = 2150
    laid_out = future_peak(
        [Trajectory(int(p), 0, pooled_end, started=False) for p in prompts], BLOCKS
    )
    figure = spread_peak(
        unstarted(prompts, pooled_end),
        [window],
        BLOCKS,
        z=NormalDist().inv_cdf(0.95),
        start_slack=16,
    )
    assert figure <= 0.92 * laid_out, (figure, laid_out)
    drawn = [drawn_peak(prompts, _uniform(rng, 32), rng.integers(0, 17, 32)) for _ in range(200)]
    assert max(drawn) <= figure, (max(drawn), figure)


def test_rows_without_learned_lengths_are_laid_out_to_their_reserved_ends() -> None:
    """No window: each sequence ends at its reserved end for certain, as the trajectories lay
    it out; the spread figure is that peak, or above it by at most the growth within one step
    of its grid (evaluated at each interval's end size)."""
    prompts = [300, 1200, 50, 700]
    done = [100, 0, 400, 20]
    ends = [900, 500, 450, 2000]
    started = [True, True, True, False]
    rows = SpreadRows.of(prompts, done, ends, [4096] * 4, [1, 2, 1, 1], started, [-1] * 4)
    exact = future_peak(
        [
            Trajectory(p, g, e, started=s, sequences=w)
            for p, g, e, s, w in zip(prompts, done, ends, started, [1, 2, 1, 1], strict=True)
        ],
        BLOCKS,
    )
    figure = spread_peak(rows, [], BLOCKS, z=2.0, start_slack=32)
    step = -(-2000 // 47)  # the grid's spacing over the longest life
    assert exact <= figure <= exact + 5 * -(-step // BLOCKS.block_size), (exact, figure)


def test_a_sequence_past_every_learned_answer_ends_at_its_reserved_end() -> None:
    """A started answer longer than any its class has given: nothing learned says where it
    ends, so it counts to its reserved end, not zero."""
    window = np.arange(100, 200, dtype=np.int64)
    past = SpreadRows.of([64], [250], [500], [4096], [1], [True], [0])
    alone = future_peak([Trajectory(64, 250, 500, started=True)], BLOCKS)
    assert spread_peak(past, [window], BLOCKS, z=1.0, start_slack=0) >= alone


# --- adaptive mode's second opinion in the controller -------------------------------------


def _burst(ac: AdmissionController, prompts: list[int], klass: str) -> int:
    admitted = 0
    for p in prompts:
        projection = project_counts(
            (p,), requested_max_tokens=2560, n=1, max_model_len=8192, blocks=BLOCKS
        )
        decision = ac.try_admit(Ask(projection, streamed=False, klass=klass))
        if decision is None:
            break
        admitted += 1
    return admitted


def _thrash_controller(clock: Clock, answers: list[int] | None) -> AdmissionController:
    """Adaptive mode on a pool of 10,304 blocks of 16 where a recompute of a long prompt is
    dear (a 64-sequence step of 29 ms, 0.3 ms a prompt token), with ``answers`` learned."""
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock),
        clock=clock,
        headroom=0.0,
        reservation="adaptive",  # type: ignore[arg-type]
    )
    base = snapshot(clock, blocks=10304, block_size=16)
    ac.on_snapshot(base)
    teach_costs(ac, clock, base, per_token=3e-4, running=64)
    for length in answers or ():
        ac.learner.observe("completions:4096", length)
    return ac


def test_a_burst_beside_learned_answers_is_admitted_past_the_laid_out_peak() -> None:
    """The thrash burst's prompts against the same learned answers (256 of 1,500-2,500
    tokens): the spread ends admit more of the burst at once than the ends laid out alone
    would (the second opinion off: nothing learned in a separate window), and no more than a
    pool that 200 draws of their answers never overfill; with too few learned answers it is
    not asked."""
    rng = np.random.default_rng(11)
    prompts = [int(p) for p in rng.integers(2000, 4001, 64)]
    answers = [int(a) for a in _uniform(rng, 256)]
    clock = Clock()
    spread = _thrash_controller(clock, answers)
    n_spread = _burst(spread, prompts, "completions:4096")
    laid = _thrash_controller(clock, answers)
    laid.learner.spread_window = lambda klass: None  # type: ignore[method-assign]
    n_laid = _burst(laid, prompts, "completions:4096")
    assert spread.second_opinion.admitted == n_spread - n_laid
    assert n_spread > n_laid, (n_spread, n_laid)
    head = np.array(prompts[:n_spread])
    drawn = [
        drawn_peak(head, _uniform(rng, n_spread), rng.integers(0, 33, n_spread)) for _ in range(200)
    ]
    assert max(drawn) <= 10303, max(drawn)
    few = _thrash_controller(clock, answers[:31])
    assert _burst(few, prompts, "completions:4096") <= n_laid
    assert few.second_opinion.admitted == 0
    assert SPREAD_MIN_SEQUENCES <= n_laid


def test_the_spread_ends_are_not_asked_while_preemptions_widen_the_ends() -> None:
    clock = Clock()
    ac = _thrash_controller(clock, [1500 + (1000 * k) // 255 for k in range(256)])
    ac.learner.tighten()
    _burst(ac, [3000] * 64, "completions:4096")
    assert ac.second_opinion.admitted == 0


def test_the_second_opinion_is_rationed_to_a_share_of_the_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each second opinion here takes 30 ms of the process's time (a fake timer): after its
    50 ms burst the laid-out peak alone decides, until the 10% share has paid the time back."""
    import sidecar.admission.second_opinion as second

    rng = np.random.default_rng(11)
    prompts = [int(p) for p in rng.integers(2000, 4001, 64)]
    answers = [int(a) for a in _uniform(rng, 256)]
    clock = Clock()
    ac = _thrash_controller(clock, answers)
    now = [0.0]
    computed = [0]
    real = second.spread_fits

    def slow(*args: object, **kw: object) -> bool:
        computed[0] += 1
        now[0] += 0.03
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(second, "spread_fits", slow)
    opinion = ac.second_opinion
    opinion._timer = lambda: now[0]
    opinion._credit_at = 0.0
    _burst(ac, prompts, "completions:4096")
    # 50 ms of credit: the first leaves 20 ms, the second runs it 10 ms into debt
    assert (computed[0], opinion.admitted) == (2, 2)
    _burst(ac, prompts, "completions:4096")
    assert computed[0] == 2  # the debt stands: the laid-out peak alone refused
    now[0] += 0.2  # 20 ms paid back at 10%: 10 ms of credit
    _burst(ac, prompts, "completions:4096")
    assert computed[0] == 3 and opinion.admitted == 3


def test_a_refusal_stands_while_only_progress_changed() -> None:
    """The pool full by the spread ends too: asked again with the same requests in flight and
    the same candidate, within 50 ms, it is not computed again; after them, or once a request
    ends, it is."""
    clock = Clock()
    ac = _thrash_controller(clock, [1500 + (1000 * k) // 255 for k in range(256)])
    _burst(ac, [3000] * 64, "completions:4096")
    opinion = ac.second_opinion
    calls = [0]
    real = opinion._timer

    def counted() -> float:
        calls[0] += 1
        return real()

    opinion._timer = counted
    _burst(ac, [3000], "completions:4096")
    assert calls[0] == 0
    clock.now += 0.06
    _burst(ac, [3000], "completions:4096")
    assert calls[0] == 2  # computed (and refused) once: before and after


def test_a_second_opinion_that_cannot_be_computed_leaves_the_decision_to_the_peak(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A figure the spread cannot judge (here a ValueError from inside it) is logged and the
    laid-out peak's refusal stands: queued, never a failed request."""
    import sidecar.admission.second_opinion as second

    def broken(*args: object, **kw: object) -> bool:
        raise ValueError("cannot convert float NaN to integer")

    monkeypatch.setattr(second, "spread_fits", broken)
    clock = Clock()
    ac = _thrash_controller(clock, [1500 + (1000 * k) // 255 for k in range(256)])
    admitted = _burst(ac, [3000] * 64, "completions:4096")
    assert 0 < admitted < 64 and ac.second_opinion.admitted == 0
    assert "second opinion failed" in caplog.text
