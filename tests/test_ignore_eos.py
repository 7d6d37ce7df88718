"""Requests that set ``ignore_eos`` (as vLLM's benchmark client, and most load generators, send
them): each answer runs to its max_tokens, so the sidecar reserves all of it (in adaptive mode
unless running it now pays even for a certain recompute, as vLLM risks it), never
learns their lengths as if they had ended naturally, and never tells Retry-After that one ends
where its class's answers usually end. And ``min_tokens``: an answer at least that long is never
reserved less.

The pool is 64 blocks of 128 tokens (a budget of 63); a request of 300 prompt and 700 output
tokens reaches 8 blocks."""

from __future__ import annotations

import json
import math

import pytest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.costs import PRIOR_FIXED_SHARE, EngineCosts
from sidecar.admission.ends import CHEAP_RECOMPUTE_STEPS, COLD_OUTPUT_TOKENS, Ends
from sidecar.admission.learner import LengthLearner, request_class, runs_to_max
from sidecar.config import ReservationMode
from sidecar.counting.request import parse_generation
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import Projection, project_counts
from tests.support.snapshots import Clock, snapshot, teach_costs

BLOCKS = UniformBlocks(128)
PLAIN = request_class("completions", 700)
EOS = request_class("completions", 700, ignore_eos=True)


def proj(prompt: int = 300, max_tokens: int = 700) -> Projection:
    return project_counts(
        (prompt,), requested_max_tokens=max_tokens, n=1, max_model_len=1024, blocks=BLOCKS
    )


def controller(clock: Clock, reservation: str) -> AdmissionController:
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock),
        clock=clock,
        headroom=0.0,
        reservation=reservation,  # type: ignore[arg-type]
    )
    ac.on_snapshot(snapshot(clock))
    return ac


def teach_short_answers(ac: AdmissionController, klass: str = PLAIN, n: int = 64) -> None:
    for k in range(n):
        ac.learner.observe(klass, 40 + k % 20, at_max=False)


@pytest.mark.parametrize(
    ("body", "ignore_eos"),
    [
        ({"ignore_eos": True}, True),
        ({"ignore_eos": "true"}, True),  # pydantic's lax bool, as vLLM reads it
        ({"ignore_eos": 1}, True),
        ({"ignore_eos": False}, False),
        ({"ignore_eos": None}, False),
        ({}, False),
    ],
)
def test_ignore_eos_is_read_as_vllm_reads_it(body: dict[str, object], ignore_eos: bool) -> None:
    raw = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 700, **body}).encode()
    request = parse_generation("completions", raw)
    assert request.ignore_eos is ignore_eos
    klass = request_class("completions", request.requested_max_tokens, ignore_eos=ignore_eos)
    assert klass == (EOS if ignore_eos else PLAIN)


@pytest.mark.parametrize(
    ("reservation", "engine"),
    [("expected", None), ("worst-case", None), ("adaptive", "dear"), ("adaptive", "wide")],
)
def test_an_ignore_eos_request_is_reserved_to_its_max_tokens(
    reservation: str, engine: str | None
) -> None:
    """Its class's short answers never shorten it. Adaptive mode on an engine where running
    it saves less than even a certain recompute costs: ``dear``, a 29.2 ms step of 64
    sequences, 34% of it fixed, and 0.3 ms a prompt token (the recompute of 1,000 tokens ~10
    steps, the gain of 700 tokens in the batch ~3.7); ``wide``, a 20.2 ms step of 512
    sequences, 49% fixed, and 20 us a prompt token (a recompute of ~1 step, a gain of ~0.7)."""
    clock = Clock()
    ac = controller(clock, reservation)
    if engine is not None:
        running, per_token = {"dear": (64, 3e-4), "wide": (512, 2e-5)}[engine]
        teach_costs(ac, clock, snapshot(clock), per_token=per_token, running=running)
    teach_short_answers(ac)  # its class's answers end at 40-59 tokens
    assert ac.ends(proj(), EOS) == (700,)
    if reservation != "worst-case":
        assert ac.ends(proj(), PLAIN)[0] < 700  # the same request without ignore_eos
    # 8 blocks each: 7 fit in a budget of 63, not the dozens its class's short answers let in;
    # adaptive mode, where the recompute is cheap (about a decode step on the wide engine),
    # takes them at their trajectories' means (5.5 blocks each, from the prompt's 3 to the
    # peak's 8: Ends.averaged): 11, still not the dozens
    admitted = 0
    while (d := ac.try_admit(Ask(proj(), streamed=True, klass=EOS))) is not None:
        assert d.admitted
        assert d.reservation is not None and d.reservation.reserved_blocks == 8
        admitted += 1
    assert admitted == (11 if engine == "wide" else 7)


def test_a_cold_adaptive_sidecar_risks_an_ignore_eos_request_from_the_floor() -> None:
    """Cold, the decode step's fixed share is the prior's half (``PRIOR_FIXED_SHARE``): one
    sequence more in a batch of k saves 700 x 0.5 / k decode steps, more than the recompute of
    its 1,000 tokens costs by the prior (about one step) for any batch this pool holds, so it is
    risked as vLLM risks it, from the floor (``COLD_OUTPUT_TOKENS``) widened as it decodes, and
    laid out by the floor's peak: 5 blocks each (300 + 256 tokens), 12 in the budget of 63
    where its max_tokens' 8 blocks let 7 in."""
    clock = Clock()
    ac = controller(clock, "adaptive")
    costs = ac.pools[0].view.costs
    assert costs.fixed_share() is None
    assert costs.gain_steps(700, 15) == pytest.approx(700 * PRIOR_FIXED_SHARE / 15)
    assert costs.gain_steps(700, 15) > costs.recompute_steps(1000)
    assert ac.ends(proj(), EOS) == (COLD_OUTPUT_TOKENS,)
    admitted = 0
    while (d := ac.try_admit(Ask(proj(), streamed=True, klass=EOS))) is not None:
        assert d.admitted
        admitted += 1
    assert admitted == 63 // math.ceil((300 + COLD_OUTPUT_TOKENS) / 128)


def test_a_guessed_fixed_share_risks_no_dear_recompute() -> None:
    """The prior's fixed share is a guess: it risks a request from the floor only where the
    recompute is cheap (at most ``CHEAP_RECOMPUTE_STEPS`` decode steps). A prompt of 3,000 tokens
    with an answer of 700 recomputes in 3.6 steps by the prior's 1,024 tokens a step, less than
    the 23 steps the guessed share says it saves in a batch of 15, and is still reserved all of
    its max_tokens until the decode line is measured; a long-prompt request that does not run to
    its max_tokens is reserved to a length quantile (the second opinion may judge it), not risked
    from the floor."""
    rule = Ends(ReservationMode.adaptive, LengthLearner(), risk_steps=1.0)
    costs = EngineCosts()
    assert costs.fixed_share() is None
    assert costs.recompute_steps(3700) > CHEAP_RECOMPUTE_STEPS
    assert costs.gain_steps(700, 15) > costs.recompute_steps(3700)
    assert rule.end(EOS, 300, 700, costs, 15) == COLD_OUTPUT_TOKENS  # cheap: risked
    assert rule.end(EOS, 3000, 700, costs, 15) == 700  # dear: all of it
    klass = request_class("completions", 1024)
    assert costs.recompute_steps(2000 + COLD_OUTPUT_TOKENS) > CHEAP_RECOMPUTE_STEPS
    assert rule.spread_quantile(klass, 2000, 1024, costs) is not None


def test_an_ignore_eos_answer_teaches_the_learner_nothing() -> None:
    learner = LengthLearner()
    for _ in range(64):
        learner.observe(EOS, 700, at_max=True)
    assert learner.classes() == {}
    assert learner.likely(EOS) is None and learner.likely(PLAIN) is None
    assert learner.length_share() == 0.0


def test_retry_after_takes_an_ignore_eos_request_to_its_max_tokens() -> None:
    """Seven requests in flight (the whole budget), 100 tokens into their answers; their
    class's answers usually end at 40-59 tokens (so the plain ones are taken to end soon, at
    twice what they have at most), but ignore_eos ones run to 700: an eighth waits for them,
    some 600 steps."""
    waits = {}
    for klass in (PLAIN, EOS):
        clock = Clock()
        ac = controller(clock, "worst-case")
        teach_short_answers(ac)
        for _ in range(7):
            d = ac.try_admit(Ask(proj(), streamed=True, klass=klass))
            assert d is not None and d.reservation is not None
            ac.started(d.reservation)
            ac.progressed(d.reservation, 100)
        (estimate,) = ac.expected_waits(Ask(proj(), streamed=True, klass=klass))
        waits[klass] = estimate.steps
    plain, eos = waits[PLAIN], waits[EOS]
    assert plain is not None and eos is not None
    assert eos >= 600 - 1  # to 700 from 100, less a block's rounding
    assert plain <= 200  # twice what they have: 200, from 100


@pytest.mark.parametrize("reservation", ["adaptive", "expected"])
def test_min_tokens_is_the_least_an_answer_is_reserved(reservation: str) -> None:
    raw = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 700, "min_tokens": 500})
    request = parse_generation("completions", raw.encode())
    assert request.min_tokens == 500
    clock = Clock()
    ac = controller(clock, reservation)
    teach_short_answers(ac)  # its class's answers end at 40-59 tokens: 500 is still reserved
    floor = project_counts(
        (300,), requested_max_tokens=700, n=1, max_model_len=1024, blocks=BLOCKS, min_tokens=500
    )
    assert ac.ends(proj(), PLAIN)[0] < 500
    assert ac.ends(floor, PLAIN) == (500,)
    # never past max_tokens, whatever min_tokens says (vLLM refuses min_tokens > max_tokens)
    over = project_counts(
        (300,), requested_max_tokens=100, n=1, max_model_len=1024, blocks=BLOCKS, min_tokens=500
    )
    assert ac.ends(over, PLAIN) == (100,)


def long_proj() -> Projection:
    """A 3,000-token prompt running to 700 tokens: 29 blocks of 128 at its end, 26 at the floor."""
    return project_counts((3000,), requested_max_tokens=700, n=1, max_model_len=4096, blocks=BLOCKS)


def test_a_reservation_laid_down_cold_is_lowered_once_the_costs_say_to_risk_it() -> None:
    """Admitted before the engine's costs are measured, a 3,000-token prompt that runs to its
    700 tokens is reserved all of them (29 blocks): the prior's recompute of its 3,700 tokens
    (3.6 steps) is not cheap, and a guessed fixed share risks no dear one. 8 fill a pool of
    256. Once the costs are measured (a step of 10 ms + 27 us a sequence with 8 decoding, 27 us
    a prompt token: one more sequence saves ~86 steps, a certain recompute costs ~10) adaptive
    mode risks such a request from the floor (26 blocks), and the scrape that measured them
    lowers the 8 in flight to it too, so a ninth fits (8 x 26 + 26 = 234). Without that, the
    8 whole reservations (232) left it no room until one ended: on the simulated 8B's
    two-round burst the last requests of a round waited the whole round. Worst-case mode
    keeps every reservation whole."""
    clock = Clock()
    ac = controller(clock, "adaptive")
    ac.on_snapshot(snapshot(clock, blocks=257))
    costs = ac.pools[0].view.costs
    assert costs.fixed_share() is None and costs.recompute_steps(3700) > CHEAP_RECOMPUTE_STEPS
    held = []
    while (d := ac.try_admit(Ask(long_proj(), streamed=True, klass=EOS))) is not None:
        assert d.admitted and d.reservation is not None
        held.append(d.reservation)
    assert [r.ends for r in held] == [(700,)] * 8 and ac.ledger.reserved_blocks == 8 * 29
    teach_costs(ac, clock, snapshot(clock, blocks=257), per_token=2.7e-5, running=8)
    assert costs.fixed_share() is not None
    assert costs.gain_steps(700, 8) > costs.recompute_steps(3700)
    assert [r.ends for r in held] == [(COLD_OUTPUT_TOKENS,)] * 8
    assert ac.ledger.reserved_blocks == 8 * 26
    d = ac.try_admit(Ask(long_proj(), streamed=True, klass=EOS))
    assert d is not None and d.admitted
    assert ac.try_admit(Ask(long_proj(), streamed=True, klass=EOS)) is None  # 9 x 26 + 26 > 256
    strict = controller(clock, "worst-case")
    strict.on_snapshot(snapshot(clock, blocks=257))
    kept = [strict.try_admit(Ask(long_proj(), streamed=True, klass=EOS)) for _ in range(8)]
    teach_costs(strict, clock, snapshot(clock, blocks=257), per_token=2.7e-5, running=8)
    assert all(k is not None and k.reservation is not None for k in kept)
    assert strict.ledger.reserved_blocks == 8 * 29


def test_an_answer_past_the_floor_is_lowered_only_to_where_it_is_expected_to_run() -> None:
    """Revised in flight, a sequence that has generated 100 tokens of its 700 falls to the floor
    (256: 5 blocks of 128 for its 300-token prompt, not 8), one that has generated 300 is not
    taken back to the floor it has passed: an answer past its end is expected to run to twice
    what it has (``Reservation.end``), so its end falls to 600, and one that has generated 400
    keeps 700. An answer whose length is learned (no ``ignore_eos``) is not revised here, nor
    one reserved no higher than the floor already. The ledger's future peak follows."""
    rule = Ends(ReservationMode.adaptive, LengthLearner(), risk_steps=1.0)
    costs = EngineCosts()
    assert rule.end(EOS, 300, 700, costs, 15) == COLD_OUTPUT_TOKENS
    ledger = Ledger(BLOCKS)
    early, past, further, plain, low = (
        ledger.reserve(proj(), streamed=True, ends=(700,), klass=k)
        for k in (EOS, EOS, EOS, PLAIN, EOS)
    )
    ledger.revise(low, (COLD_OUTPUT_TOKENS,))
    whole = {r.id for r in ledger.whole(runs_to_max)}
    assert whole == {early.id, past.id, further.id}  # not the learned class, nor the lowered
    for res, generated in ((early, 100), (past, 300), (further, 400)):
        ledger.start(res)
        ledger.advance(res, generated)
    assert rule.revised(early, costs, 15) == (COLD_OUTPUT_TOKENS,)
    assert rule.revised(past, costs, 15) == (600,)
    assert rule.revised(further, costs, 15) is None
    assert rule.revised(plain, costs, 15) is None
    assert rule.revised(low, costs, 15) is None
    reserved, peak = ledger.reserved_blocks, ledger.peak_with()
    assert ledger.peak_bounds() == (peak, peak)  # a profile built, and its bound kept
    ledger.revise(early, (COLD_OUTPUT_TOKENS,))
    ledger.revise(past, (600,))
    assert early.ends == (COLD_OUTPUT_TOKENS,) and past.ends == (600,)
    assert not early.overran and not past.overran
    assert early.reserved_blocks == 5 and past.reserved_blocks == 8
    assert ledger.reserved_blocks == reserved - 3
    lowered = ledger.peak_with()
    assert lowered < peak
    assert ledger.peak_bounds() == (lowered, lowered)  # the kept bound dropped, not stale
