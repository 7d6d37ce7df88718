"""The fit test (``sidecar.admission.fit``) as tables of cases: in-flight set, candidate and the
engine's state in, fits or not out. No controller, no clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sidecar.admission.engine_view import EngineView
from sidecar.admission.fit import (
    PRIMED_SEQUENCES,
    PoolState,
    budget_blocks,
    committed_blocks,
    fits,
    held_now_blocks,
    in_flight_peak,
    room_blocks,
)
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.prefix import block_hashes
from sidecar.kv.projection import Projection, project_counts

BLOCKS = UniformBlocks(16)


def proj(prompt: int, max_tokens: int, *, n: int = 1, exact: bool = True) -> Projection:
    return project_counts(
        (prompt,),
        requested_max_tokens=max_tokens,
        n=n,
        max_model_len=4096,
        blocks=BLOCKS,
        exact=exact,
    )


@dataclass(frozen=True)
class Running:
    """A request in flight: prompt, max_tokens, tokens generated so far (None: not started)."""

    prompt: int
    max_tokens: int
    generated: int | None = 0
    prefix: bool = False  # its prompt is the shared one


SHARED_PROMPT = list(range(64))  # 3 shareable blocks of 16 (vLLM recomputes the last token)


def ledger_of(running: list[Running], *, share_prefixes: bool = True) -> Ledger:
    ledger = Ledger(BLOCKS, share_prefixes=share_prefixes)
    for r in running:
        prefix = (block_hashes(SHARED_PROMPT, block_size=16),) if r.prefix else None
        res = ledger.reserve(proj(r.prompt, r.max_tokens), streamed=True, prefix=prefix)
        if r.generated is not None:
            ledger.start(res)
            ledger.advance(res, r.generated)
    return ledger


def candidate(ledger: Ledger, prompt: int, max_tokens: int, **kw: object) -> Reservation:
    prefix = (block_hashes(SHARED_PROMPT, block_size=16),) if kw.pop("prefix", False) else None
    return ledger.candidate(proj(prompt, max_tokens, **kw), streamed=True, prefix=prefix)  # type: ignore[arg-type]


FRESH = PoolState(capacity_blocks=20, used_blocks=0, external_blocks=0, stale=False)

# (what is running, the candidate (prompt, max_tokens), the engine's state, headroom,
#  strict (worst-case), fits?, why)
CASES = [
    ([], (64, 64), FRESH, 0.0, True, True, "an empty pool takes 8 blocks of 20"),
    ([], (64, 64), PoolState(None, None, 0, False), 0.0, True, True, "unknown capacity admits"),
    ([], (300, 100), FRESH, 0.0, True, False, "25 blocks never fit in 20"),
    ([], (150, 100), FRESH, 0.5, True, True, "16 blocks over the budget of 10 run alone"),
    ([], (150, 100), FRESH, 0.5, False, True, "and in the other modes"),
    ([Running(16, 16)], (150, 100), FRESH, 0.5, True, False, "but not beside another"),
    (
        [],
        (150, 100),
        PoolState(capacity_blocks=20, used_blocks=2, external_blocks=2, stale=False),
        0.5,
        True,
        False,
        "nor beside traffic that bypasses the sidecar",
    ),
    ([Running(64, 64)], (64, 64), FRESH, 0.0, True, True, "8 + 8 = 16 of 20"),
    ([Running(64, 64)] * 2, (64, 64), FRESH, 0.0, True, False, "3 x 8 = 24 > 20"),
    (
        [Running(64, 64, generated=60)] * 2,
        (64, 64),
        PoolState(21, used_blocks=0, external_blocks=0, stale=False),
        0.0,
        True,
        True,
        "two nearly done: 8 + 8 + 5 as they end (future peak 21, where the peaks sum to 24)",
    ),
    (
        [Running(64, 64, generated=60)] * 2,
        (64, 64),
        PoolState(20, used_blocks=0, external_blocks=0, stale=False),
        0.0,
        True,
        False,
        "the same in 20 blocks: 21 > 20",
    ),
    ([Running(64, 64)], (64, 64), FRESH, 0.25, True, False, "headroom 25%: 16 > 15"),
    (
        [Running(64, 64)],
        (64, 64),
        PoolState(20, used_blocks=0, external_blocks=6, stale=False),
        0.0,
        True,
        False,
        "6 blocks held beyond the ledger count: 8 + 8 + 6 > 20",
    ),
    (
        [Running(64, 64)],
        (64, 64),
        PoolState(20, used_blocks=0, external_blocks=6, stale=True),
        0.0,
        True,
        True,
        "stale figures: only the ledger counts",
    ),
    (
        [],
        (64, 64),
        PoolState(20, used_blocks=17, external_blocks=0, stale=False),
        0.0,
        True,
        False,
        "vLLM holds 17 now: the prompt's 4 blocks do not fit beside them",
    ),
    (
        [],
        (64, 64),
        PoolState(20, used_blocks=16, external_blocks=0, stale=False),
        0.0,
        True,
        True,
        "vLLM holds 16 now: the prompt's 4 fit",
    ),
    (
        [Running(64, 64, prefix=True)] * 3,
        (64, 64, "prefix"),
        PoolState(23, used_blocks=0, external_blocks=0, stale=False),
        0.0,
        True,
        True,
        "a prompt whose 3 full blocks all four share: 4 x 8 - 3 x 3 = 23",
    ),
    (
        [Running(64, 64)] * 3,
        (64, 64),
        PoolState(23, used_blocks=0, external_blocks=0, stale=False),
        0.0,
        True,
        False,
        "the same prompts not shared: 32 > 23",
    ),
    (
        [Running(64, 64, prefix=True)] * 3,
        (64, 64, "prefix"),
        PoolState(22, used_blocks=0, external_blocks=0, stale=False),
        0.0,
        True,
        False,
        "shared, in 22 blocks: 23 > 22",
    ),
]


@pytest.mark.parametrize(
    ("running", "ask", "pool", "headroom", "strict", "expected", "why"),
    CASES,
    ids=[case[-1] for case in CASES],
)
def test_fits(
    running: list[Running],
    ask: tuple[object, ...],
    pool: PoolState,
    headroom: float,
    strict: bool,
    expected: bool,
    why: str,
) -> None:
    ledger = ledger_of(running)
    prompt, max_tokens, *shared = ask
    cand = candidate(ledger, prompt, max_tokens, prefix=bool(shared))  # type: ignore[arg-type]
    assert fits(ledger, cand, pool, headroom=headroom, strict=strict) is expected, why


@pytest.mark.parametrize("strict", [True, False])
def test_sequences_that_together_outgrow_the_pool_run_alone(strict: bool) -> None:
    """n = 2 of 13 blocks each (26 over a pool of 20): each sequence fits, so vLLM serves it;
    it runs into an empty pool, never beside another. One sequence of 25 never fits."""
    two = candidate(ledger_of([]), 200, 8, n=2)
    assert (two.projection.peak_blocks, two.projection.sequence_peak_blocks) == (26, 13)
    assert fits(ledger_of([]), two, FRESH, headroom=0.0, strict=strict)
    busy = ledger_of([Running(10, 6)])
    assert not fits(
        busy, busy.candidate(two.projection, streamed=True), FRESH, headroom=0.0, strict=strict
    )
    one = candidate(ledger_of([]), 300, 100)
    assert not fits(ledger_of([]), one, FRESH, headroom=0.0, strict=strict)


def test_strict_and_expected_agree_where_the_reserved_peaks_fit() -> None:
    """The worst-case shortcut (sum of the reserved peaks) never admits what the trajectories
    refuse: over random in-flight sets, strict's answer equals the trajectory check's."""
    for n in range(6):
        ledger = ledger_of([Running(64, 64, generated=10 * k) for k in range(n)])
        for pool in (FRESH, PoolState(20, 12, 2, False)):
            cand = candidate(ledger, 64, 64)
            assert fits(ledger, cand, pool, headroom=0.0, strict=True) == fits(
                ledger, cand, pool, headroom=0.0, strict=False
            ), (n, pool)


def test_an_estimated_prompt_over_the_budget_runs_only_alone() -> None:
    empty = Ledger(BLOCKS)
    big = candidate(empty, 400, 16, exact=False)  # 26 blocks as an upper bound, budget 20
    assert fits(empty, big, FRESH, headroom=0.0, strict=True)
    busy = ledger_of([Running(16, 16)])
    assert not fits(busy, candidate(busy, 400, 16, exact=False), FRESH, headroom=0.0, strict=True)
    held = PoolState(20, used_blocks=0, external_blocks=1, stale=False)
    assert not fits(empty, big, held, headroom=0.0, strict=True)


@pytest.mark.parametrize(
    ("capacity", "headroom", "budget"),
    [(None, 0.05, None), (100, 0.0, 100), (100, 0.05, 95), (19, 0.05, 18), (0, 0.1, 0)],
)
def test_budget(capacity: int | None, headroom: float, budget: int | None) -> None:
    assert budget_blocks(capacity, headroom) == budget


@pytest.mark.parametrize(
    ("peak", "pool", "prompt", "committed"),
    [
        (10, PoolState(100, None, 0, False), 0, 10),
        (10, PoolState(100, None, 3, False), 0, 13),
        (10, PoolState(100, 30, 3, False), 0, 30),
        (10, PoolState(100, 30, 3, False), 5, 35),
        (40, PoolState(100, 30, 3, False), 5, 43),
        (10, PoolState(100, 30, 3, True), 5, 10),
    ],
)
def test_committed(peak: int, pool: PoolState, prompt: int, committed: int) -> None:
    assert committed_blocks(peak, pool, prompt_blocks=prompt) == committed


def test_room_is_the_budget_less_what_is_committed() -> None:
    ledger = ledger_of([Running(64, 64), Running(64, 64, generated=None)])
    assert in_flight_peak(ledger) == 16
    assert room_blocks(ledger, FRESH, headroom=0.0) == 4
    assert room_blocks(ledger, PoolState(20, 18, 0, False), headroom=0.0) == 2
    assert room_blocks(ledger, PoolState(10, 0, 0, False), headroom=0.0) == -6


def test_an_answer_past_its_reserved_end_turns_the_shortcut_off() -> None:
    """A 64-token prompt reserved 32 output tokens (expected or adaptive mode) that has run to
    100: it is expected to run to 200 (264 tokens, 17 blocks), more than the 11 blocks it holds
    and reserves. The sum of reserved blocks (11 + 8) would fit in 20; the trajectories (17 + 8
    as it ends) do not, and the ledger counts the overrun that says so."""
    ledger = Ledger(BLOCKS)
    res = ledger.reserve(proj(64, 512), streamed=True, ends=(32,))
    ledger.start(res)
    ledger.advance(res, 100)
    assert ledger.overruns == 1 and ledger.reserved_blocks == 11
    cand = ledger.candidate(proj(64, 64), streamed=True)
    pool = PoolState(capacity_blocks=20, used_blocks=0, external_blocks=0, stale=False)
    assert ledger.reserved_blocks + cand.reserved_blocks <= 20
    assert not fits(ledger, cand, pool, headroom=0.0, strict=False)
    ledger.release(res)
    assert ledger.overruns == 0


# --- admitted as vLLM admits (adaptive mode's cheap recomputes) ------------------------------


#: the sidecar's admitted requests vLLM has not started: as many as may wait in its queue
WAITING = [Running(16, 16, generated=None)] * PRIMED_SEQUENCES
TWO = [Running(64, 4000, generated=100)] * 2  # 2 x 11 blocks held now


@pytest.mark.parametrize(
    ("running", "used", "candidate", "fits_now_"),
    [
        # vLLM's rule: the prompt fits beside what is held now (22 blocks) and the prompts
        # waiting for vLLM (4 x 1), however far the answers may grow: 26 + 3 of 30 fits ...
        (TWO + WAITING, None, proj(48, 4000), True),
        (TWO + WAITING, None, proj(64, 4000), True),
        # ... 26 + 5 does not
        (TWO + WAITING, None, proj(80, 4000), False),
        # vLLM reports more than the ledger (traffic that bypasses the sidecar): its figure
        (TWO + WAITING, 25, proj(48, 4000), False),
        # fewer waiting for vLLM than may: it waits there too
        (TWO + WAITING[1:], 25, proj(48, 4000), True),
    ],
)
def test_a_risked_candidate_fits_as_vllm_admits(
    running: list[Running], used: int | None, candidate: Projection, fits_now_: bool
) -> None:
    """30 blocks of budget. The future peak of every case is far over it (answers of up to
    4,000 tokens): without ``risked`` none fits."""
    ledger = ledger_of(running)
    pool = PoolState(capacity_blocks=30, used_blocks=used, external_blocks=0, stale=False)
    cand = ledger.candidate(candidate, streamed=True)
    assert not fits(ledger, cand, pool, headroom=0.0, strict=False)
    assert fits(ledger, cand, pool, headroom=0.0, strict=False, risked=True) is fits_now_


def test_a_few_risked_requests_may_wait_in_vllms_own_queue() -> None:
    """A full pool: a risked request is admitted anyway while fewer than PRIMED_SEQUENCES the
    sidecar admitted wait for vLLM to start them (vLLM starts each when its prompt fits, by the
    same rule), and not beyond."""
    ledger = ledger_of([Running(64, 4000, generated=300)])  # 23 blocks held
    pool = PoolState(capacity_blocks=24, used_blocks=None, external_blocks=0, stale=False)
    admitted = 0
    while fits(
        ledger,
        ledger.candidate(proj(64, 4000), streamed=True),
        pool,
        headroom=0.0,
        strict=False,
        risked=True,
    ):
        ledger.reserve(proj(64, 4000), streamed=True)
        admitted += 1
        assert admitted <= PRIMED_SEQUENCES
    assert admitted == PRIMED_SEQUENCES
    assert held_now_blocks(ledger, pool) == 23 + 4 * PRIMED_SEQUENCES


def test_what_vllm_held_at_the_scrape_falls_by_what_ended_since() -> None:
    """vLLM held 20 blocks at the scrape; a request of 8 (a 64-token prompt and 60 tokens of
    answer, 16 tokens a block) ended since: 12 are taken as held, where the scrape's 20 would
    hold admission back until the next one. A prompt block another request in flight holds
    stays held, and so do the full prompt blocks a request's own n sequences shared."""
    ledger = Ledger(BLOCKS)
    view = EngineView(ledger)
    view.update(
        EngineSnapshot(
            taken_at=0.0,
            block_size=16,
            num_gpu_blocks=101,
            engines=1,
            kv_cache_usage=0.2,
            running=2,
            preemptions_total=0,
            generation_tokens_total=0,
            cache_dtype="auto",
            prefix_caching=True,
            kv_cache_memory_bytes=None,
            has_cache_config=True,
        )
    )
    assert view.used_now_blocks() == 20
    shared = (block_hashes(SHARED_PROMPT, block_size=16),)
    a = ledger.reserve(proj(64, 100), streamed=True, prefix=shared)
    b = ledger.reserve(proj(64, 100), streamed=True, prefix=shared)
    for res in (a, b):
        ledger.start(res)
        ledger.advance(res, 60)
    assert a.predicted_blocks == 8
    ledger.release(a)  # its 3 shared prompt blocks stay: b holds them
    assert view.used_now_blocks() == 15
    ledger.release(b)  # b's all go
    assert view.used_now_blocks() == 7
    pair = ledger.reserve(proj(64, 100, n=2), streamed=True, prefix=shared)
    ledger.start(pair)
    ledger.advance(pair, 60)
    assert pair.predicted_blocks == 16  # two sequences of 8, the 3 full prompt blocks held once
    ledger.release(pair)
    assert view.used_now_blocks() == 0  # 7 - 13, at least 0
    unstarted = ledger.reserve(proj(64, 100), streamed=True)
    ledger.release(unstarted)  # never started: vLLM held nothing for it that the scrape saw
    assert ledger.freed_total == 8 + 5 + 13


@pytest.mark.parametrize(
    ("running", "used", "fits_by_means"),
    [
        # two started 64-token prompts running to 128 tokens (4 blocks now, 12 at their ends):
        # by their peaks the candidate makes 36 of 30, by their means (8 each) 24
        ([Running(64, 128), Running(64, 128)], 8, True),
        # the same, not started yet: their prompts count as held
        ([Running(64, 128, generated=None), Running(64, 128, generated=None)], 0, True),
        # vLLM holds 27 now: the candidate's prompt (4) does not fit beside it
        ([Running(64, 128), Running(64, 128)], 27, False),
        # three in flight: 32 by their means
        ([Running(64, 128), Running(64, 128), Running(64, 128)], 12, False),
    ],
)
def test_known_lengths_with_a_cheap_recompute_fit_by_their_means(
    running: list[Running], used: int, fits_by_means: bool
) -> None:
    """30 blocks of budget, a 64-token prompt running to 128 tokens as the candidate: by the
    laid-out peaks it never fits; ``averaged`` (``Ends.averaged``) admits it where every
    request's mean over the rest of its trajectory fits and its prompt fits now."""
    ledger = ledger_of(running)
    pool = PoolState(capacity_blocks=30, used_blocks=used, external_blocks=0, stale=False)
    cand = ledger.candidate(proj(64, 128), streamed=True)
    assert not fits(ledger, cand, pool, headroom=0.0, strict=False)
    assert fits(ledger, cand, pool, headroom=0.0, strict=False, averaged=True) is fits_by_means
    assert not fits(ledger, cand, pool, headroom=0.0, strict=True, averaged=True)


def test_no_mean_is_taken_while_an_answer_runs_past_its_reserved_end() -> None:
    """A chat reserved to 200 of its 1,000 max_tokens has run to 250: where it ends is not known,
    so no candidate is admitted by the means (30 blocks of budget; the same candidate fits by
    them beside the chat at 100, within its end: 8 + 14 + 8 blocks)."""
    for generated, fits_by_means in ((100, True), (250, False)):
        ledger = ledger_of([Running(64, 128)])
        chat = ledger.reserve(proj(64, 1000), streamed=True, ends=(200,))
        ledger.start(chat)
        ledger.advance(chat, generated)
        assert ledger.overruns == (generated > 200)
        pool = PoolState(capacity_blocks=30, used_blocks=16, external_blocks=0, stale=False)
        cand = ledger.candidate(proj(64, 128), streamed=True)
        assert not fits(ledger, cand, pool, headroom=0.0, strict=False)
        averaged = fits(ledger, cand, pool, headroom=0.0, strict=False, averaged=True)
        assert averaged is fits_by_means, generated


def test_a_candidate_with_n_sequences_is_weighed_at_all_of_them_by_the_means() -> None:
    """``n`` 2: the candidate's two sequences both count at their means. Beside one started
    request of 64 tokens running to 128 (8 blocks at its mean), a single candidate (8 more)
    fits a budget of 17 by the means; the same with n 2 (its reserved peak 24, its prompt 8
    for the two sequences: 16 at the mean, 24 in all) does not."""
    ledger = ledger_of([Running(64, 128)])
    pool = PoolState(capacity_blocks=17, used_blocks=4, external_blocks=0, stale=False)
    one = ledger.candidate(proj(64, 128), streamed=True)
    two = ledger.candidate(proj(64, 128, n=2), streamed=True)
    assert two.reserved_blocks == 2 * one.reserved_blocks
    assert fits(ledger, one, pool, headroom=0.0, strict=False, averaged=True)
    assert not fits(ledger, two, pool, headroom=0.0, strict=False, averaged=True)
