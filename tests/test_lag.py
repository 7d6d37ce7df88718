"""Streams seen behind vLLM by different amounts (``sidecar.kv.lag``): lockstep streams look
staggered and their joint peak lower; strict mode adds what they may hold beyond where they
were seen. The case is the one a fresh-clone CI run hit through two workers: eight streams of
100 prompt and 700 output tokens on blocks of 128, all 40 tokens from their ends in vLLM, four
of them seen 40 tokens behind that."""

from __future__ import annotations

import pytest

from sidecar.admission.fit import PoolState, fits, in_flight_peak
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.lag import LAG_WINDOW_S, StreamLag, lag_blocks
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.projection import Projection, project_counts

BLOCKS = UniformBlocks(128)
POOL = PoolState(capacity_blocks=60, used_blocks=None, external_blocks=0, stale=False)
PROMPT, MAX_TOKENS = 100, 700


def proj(n: int = 1) -> Projection:
    return project_counts(
        (PROMPT,), requested_max_tokens=MAX_TOKENS, n=n, max_model_len=1024, blocks=BLOCKS
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def eight_streams(seen: list[int], *, jump: int = 1) -> tuple[Ledger, Clock]:
    """Eight started streams, each seen at ``seen[i]`` tokens, its last report ``jump`` tokens
    after the one before."""
    clock = Clock()
    ledger = Ledger(BLOCKS, share_prefixes=False, clock=clock)
    for tokens in seen:
        res = ledger.reserve(proj(), streamed=True)
        ledger.start(res)
        ledger.advance(res, tokens - jump)  # where it was (no report of its own)
        ledger.progressed(res, tokens)
    return ledger, clock


def admitted(ledger: Ledger, *, strict: bool) -> list[Reservation]:
    """Queued requests admitted one at a time while they fit (at most five, the queue)."""
    taken: list[Reservation] = []
    for _ in range(5):
        candidate = ledger.candidate(proj(), streamed=True)
        if not fits(ledger, candidate, POOL, headroom=0.0, strict=strict):
            break
        taken.append(ledger.reserve(proj(), streamed=True))
    return taken


STAGGERED = [660] * 4 + [620] * 4  # as seen: four 40 tokens behind where vLLM has them


def test_the_staggered_picture_admits_what_the_lockstep_truth_cannot_hold() -> None:
    """The premise: seen one token a report, the eight look staggered and four more fit beside
    them; in vLLM all eight are at 660, and those four beside them peak over the budget (each
    holds two blocks while the eight hold seven)."""
    seen, _ = eight_streams(STAGGERED)
    assert seen.lag_blocks() == 0
    assert len(admitted(seen, strict=True)) == 4
    truth, _ = eight_streams([660] * 8)
    four = [truth.candidate(proj(), streamed=True) for _ in range(4)]
    assert in_flight_peak(truth, *four) == 8 * 7 + 4 * 2 > POOL.capacity_blocks


def test_strict_mode_adds_what_streams_seen_behind_may_hold() -> None:
    """The four behind came in a report that moved them 41 tokens: 40 behind just before it.
    Each of the eight may hold a block more than laid out at any step, and none of the queue
    fits until some end."""
    seen, _ = eight_streams(STAGGERED, jump=41)
    assert seen.lag.tokens(now=0.0) == 40
    assert seen.lag_blocks() == 8 * 1
    assert admitted(seen, strict=True) == []


@pytest.mark.parametrize(("jump", "per_sequence"), [(2, 1), (129, 1), (130, 2), (257, 2)])
def test_each_block_of_lag_adds_a_block_a_sequence(jump: int, per_sequence: int) -> None:
    seen, _ = eight_streams([400] * 8, jump=jump)
    assert seen.lag_blocks() == 8 * per_sequence


def test_the_other_modes_take_the_risk() -> None:
    """Expected and adaptive modes lay out learned ends (a guess either way) and accept some
    preemptions: the lag is not added there."""
    seen, _ = eight_streams(STAGGERED, jump=41)
    assert len(admitted(seen, strict=False)) == 4


def test_a_lag_is_forgotten_after_two_windows_of_one_token_reports() -> None:
    seen, clock = eight_streams(STAGGERED, jump=41)
    clock.now = LAG_WINDOW_S + 0.1
    assert seen.lag_blocks() == 8  # the window before is kept
    clock.now = 2 * LAG_WINDOW_S + 0.2
    assert seen.lag_blocks() == 0
    assert len(admitted(seen, strict=True)) == 4


def test_only_a_started_stream_s_own_reports_count() -> None:
    """A stream's first token after its prefill, and a non-streamed request's progress (an
    estimate from vLLM's counters, ``Ledger.advance``), say nothing of a stream's lag."""
    ledger = Ledger(BLOCKS, share_prefixes=False, clock=Clock())
    res = ledger.reserve(proj(), streamed=True)
    ledger.progressed(res, 30)  # not started: no jump
    ledger.start(res)
    ledger.advance(res, 90)
    assert ledger.lag.tokens(now=0.0) == 0
    ledger.progressed(res, 95)
    assert ledger.lag.tokens(now=0.0) == 4


def test_n_sequences_count_per_sequence() -> None:
    ledger = Ledger(BLOCKS, share_prefixes=False, clock=Clock())
    res = ledger.reserve(proj(n=4), streamed=True)
    ledger.start(res)
    ledger.progressed(res, 0.25)
    ledger.progressed(res, 3.0)  # 11 events over 4 sequences
    assert ledger.lag.tokens(now=0.0) == pytest.approx(1.75)
    assert ledger.lag_blocks() == 4


@pytest.mark.parametrize("lag", [0.0, -1.0])
def test_no_lag_adds_nothing(lag: float) -> None:
    assert lag_blocks(lag, sequences=100, block_size=16, groups=2) == 0


def test_the_window_keeps_the_largest_jump() -> None:
    lag = StreamLag(window=1.0)
    for now, jump in [(0.0, 3.0), (0.2, 10.0), (0.4, 2.0)]:
        lag.jumped(jump, now=now)
    assert lag.tokens(now=0.5) == 9
    assert lag.tokens(now=1.5) == 9  # the window before
    lag.jumped(4.0, now=1.6)
    assert lag.tokens(now=2.7) == 3  # 9 is two windows old; 3 was in the last
