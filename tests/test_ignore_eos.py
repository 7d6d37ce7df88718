"""Requests that set ``ignore_eos`` (as vLLM's benchmark client, and most load generators, send
them): each answer runs to its max_tokens, so the sidecar reserves all of it in every mode, never
learns their lengths as if they had ended naturally, and never tells Retry-After that one ends
where its class's answers usually end. And ``min_tokens``: an answer at least that long is never
reserved less.

The pool is 64 blocks of 128 tokens (a budget of 63); a request of 300 prompt and 700 output
tokens reaches 8 blocks."""

from __future__ import annotations

import json

import pytest

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.learner import LengthLearner, request_class
from sidecar.counting.request import parse_generation
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import Projection, project_counts
from tests.support.snapshots import Clock, snapshot

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


@pytest.mark.parametrize("reservation", ["adaptive", "expected", "worst-case"])
def test_an_ignore_eos_request_is_reserved_to_its_max_tokens_in_every_mode(
    reservation: str,
) -> None:
    clock = Clock()
    ac = controller(clock, reservation)
    teach_short_answers(ac)  # its class's answers end at 40-59 tokens
    assert ac.ends(proj(), EOS) == (700,)
    if reservation != "worst-case":
        assert ac.ends(proj(), PLAIN)[0] < 700  # the same request without ignore_eos
    # 8 blocks each: 7 fit in a budget of 63, not the dozens its class's short answers let in
    admitted = 0
    while (d := ac.try_admit(Ask(proj(), streamed=True, klass=EOS))) is not None:
        assert d.admitted
        admitted += 1
    assert admitted == 7


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
