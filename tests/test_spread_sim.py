"""Adaptive mode's second opinion (``sidecar.admission.second_opinion``: a placement the laid-out
future peak refused, judged again with the in-flight answers' ends spread over their learned
lengths, ``sidecar.kv.spread``) against vLLM's own scheduler and KV-cache manager on the simulated
GPU, stepped by hand: on a burst whose reservations laid out end to end do not fit the pool and
whose answers, ending where their learned lengths spread them, do, the sidecar admits past the
laid-out peak on the second opinion, and vLLM runs every admitted answer to its end without a
preemption, the sidecar's prediction matching vLLM's usage at every sampled step.

The class is warm from the start: the sidecar restores 64 answers of the class, spread evenly over
50-800 tokens, from a ``--lengths-file`` (no warm-up wave to run). The burst's answers end at
lengths of the same spread (a golden-ratio sequence over 50-800, so that any first part of the
burst covers the range evenly), carried in ``vllm_xargs`` (``sim_output_tokens``), which the
sidecar never reads. Its prompts are 1,600 tokens: with the engine's costs not measured yet a
recompute of a prompt and its likely answer (621 tokens, the class's 0.75 quantile) costs 2.2
decode steps by the prior (``sidecar.admission.costs``: 1,024 tokens a step), more than the two
under which a request is admitted by its prompt as vLLM admits (``Ends.risked``), so the
requests are reserved to a length quantile, laid out by the future peak, and the second opinion
is asked. Nothing else is measured before the decisions: they are taken with the engine held,
one request at a time, under ``--policy reject`` (a request that fits neither way is refused at
once, so no admission waits for a later, timed decision).

Worked out beforehand with the same decisions in-process (``AdmissionController`` with these
figures; the sidecar here made the same): the laid-out peak alone admits 24 of the burst on the
3,229-block budget, the second opinion 5 more; the 29 answers at these lengths peak at ~3,000
blocks of vLLM's 3,399 (prefills 5 a step), and none of 300 uniform draws of their lengths passed
3,399 (the 99th percentile: ~3,190).

One simulated server for the module: Llama-3.1-8B's config on an H100 80 GB with 3,400 blocks of
16 tokens (``--num-gpu-blocks-override``) and a 4,096-token context.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.exposition import metric_value
from harness.sim_server import SimServer
from harness.workload import SidecarProcess, make_prompts
from sidecar.admission import lengths_file
from sidecar.admission.costs import EngineCosts
from sidecar.admission.ends import Ends
from sidecar.admission.fit import SPREAD_MIN_SEQUENCES
from sidecar.admission.learner import LengthLearner
from sidecar.config import ReservationMode, Settings
from tests.support.sim import cache_config, metrics, sim_8b
from tests.support.stepped import Clients, Stepper, assert_predicted_at_every_step, held, streamed
from tests.support.wait import wait_for

pytestmark = pytest.mark.vllm

BLOCKS = 3400
MAX_MODEL_LEN = 4096
HEADROOM = 0.05
PROMPT_TOKENS = 1600
MAX_TOKENS = 1024
KLASS = "completions:1024"  # sidecar.admission.learner.request_class("completions", 1024)
SHORTEST, LONGEST = 50, 800  # the answers' lengths, learned and run alike
LEARNED = 64  # answers of the class in the lengths file (the spread needs 32 of its own)
#: requests sent: more than either judgement admits, so that the second opinion refuses too
BURST = 32
#: the burst is sampled every this many steps (each sample asserted)
SAMPLE_EVERY = 10
SCRAPE_INTERVAL = "0.05"
#: seconds any one wait may take: a deadline for a loaded machine, not a measurement
WITHIN = 30.0


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with sim_8b(MAX_MODEL_LEN, BLOCKS) as server:
        yield server


def preemptions(sim: SimServer) -> float:
    return metrics(sim).get("vllm:num_preemptions_total", 0)


def answer_lengths(count: int) -> list[int]:
    """``count`` lengths over SHORTEST..LONGEST, each first part of them spread evenly (a
    golden-ratio sequence): whichever part of the burst is admitted holds short and long
    answers alike, as draws of the learned lengths would."""
    golden = (math.sqrt(5) - 1) / 2
    return [SHORTEST + round((k * golden) % 1.0 * (LONGEST - SHORTEST)) for k in range(count)]


def write_lengths_file(path: Path, model: str) -> None:
    """What a sidecar that had seen LEARNED answers of the class would have saved
    (``sidecar.admission.lengths_file``): lengths spread evenly over SHORTEST..LONGEST."""
    step = (LONGEST - SHORTEST) / (LEARNED - 1)
    learned = [SHORTEST + round(k * step) for k in range(LEARNED)]
    path.write_text(json.dumps({"format": 1, "model": model, "classes": {KLASS: learned}}))


def test_the_second_opinion_admits_past_the_laid_out_peak_and_vllm_never_preempts(
    sim: SimServer, tmp_path: Path
) -> None:
    """32 streamed completions of 1,600 prompt tokens, answers of 50-800 tokens, sent one at a
    time to an adaptive sidecar with the engine held. The sidecar admits more of them than their
    reservations laid out fit (their future peak over the budget), the second opinion's
    admissions counted in /state and in kv_sidecar_spread_admissions_total, and refuses the
    rest. Then, stepped to the end: every admitted answer runs to its length, vLLM preempts
    nothing, and every tenth step the sidecar's prediction is vLLM's usage to within a block per
    request in flight."""
    assert cache_config(sim)["num_gpu_blocks"] == str(BLOCKS)
    capacity = BLOCKS - 1  # less the null block, as the sidecar counts it
    budget = math.floor(capacity * (1 - HEADROOM))
    path = tmp_path / "lengths.json"
    write_lengths_file(path, sim.served_name)
    # the premise, by the sidecar's own rules on the file: with no cost measured, a request of
    # the burst is too dear to recompute to be admitted by its prompt, so its reservation is
    # laid out by the future peak and the second opinion may be asked
    learner = LengthLearner()
    assert lengths_file.load(path, learner, model=sim.served_name) == LEARNED
    rule = Ends(
        ReservationMode.adaptive, learner, risk_steps=Settings.model_fields["risk_steps"].default
    )
    assert not rule.risked(KLASS, PROMPT_TOKENS, MAX_TOKENS, EngineCosts())
    assert rule.spread_quantile(KLASS, PROMPT_TOKENS, MAX_TOKENS, EngineCosts()) is not None
    prompts = make_prompts(sim.model_dir, BURST, PROMPT_TOKENS, seed=41)
    lengths = answer_lengths(BURST)
    bodies = [
        streamed(
            {
                "model": sim.served_name,
                "prompt": p,
                "max_tokens": MAX_TOKENS,
                "vllm_xargs": {"sim_output_tokens": n},
            }
        )
        for p, n in zip(prompts, lengths, strict=True)
    ]
    args = [
        "--reservation",
        "adaptive",
        "--policy",
        "reject",
        "--headroom",
        str(HEADROOM),
        "--scrape-interval",
        SCRAPE_INTERVAL,
        "--model-config",
        str(sim.model_dir),
        "--lengths-file",
        str(path),
    ]
    before = preemptions(sim)
    samples: list[dict[str, Any]] = []
    with SidecarProcess(sim.url, *args) as sc, held(sim):

        def warm() -> bool:
            state = sc.state()
            return state["capacity_blocks"] == capacity and KLASS in state["expected_output_tokens"]

        wait_for(warm, "the pool known and the lengths file restored", within=WITHIN)
        clients = Clients(sc.url, "/v1/completions", []).start()
        stepper = Stepper(sim, sc, clients)
        for sent, body in enumerate(bodies, start=1):
            # one at a time, each decided before the next: the same order every run
            clients.send(body)

            def decided(sent: int = sent) -> bool:
                refused = sum(a.status == 429 for a in clients.answers)
                return bool(sc.state()["in_flight"] + refused == sent)

            wait_for(decided, f"request {sent} decided", within=WITHIN)
        decisions = sc.state()
        spread_metric = metric_value(sc.metrics(), "kv_sidecar_spread_admissions_total")
        table = {
            k: decisions[k]
            for k in ("in_flight", "spread_admitted", "budget_blocks", "future_peak_blocks")
        }
        # past the laid-out peak on the second opinion, and not the whole burst
        assert decisions["budget_blocks"] == budget, table
        assert decisions["spread_admitted"] > 0, table
        assert spread_metric == decisions["spread_admitted"], (spread_metric, table)
        assert decisions["future_peak_blocks"] > budget, table  # laid out, they do not fit
        admitted = [
            (a, n) for a, n in zip(clients.answers, lengths, strict=True) if a.status != 429
        ]
        assert SPREAD_MIN_SEQUENCES <= decisions["in_flight"] == len(admitted) < BURST, table
        sim.wait_waiting()
        while clients.open:
            assert stepper.sampled <= sum(n for _, n in admitted), [a.tokens for a, _ in admitted]
            samples.append(stepper.step(SAMPLE_EVERY))
        clients.stop()
        assert sc.state()["reserved_blocks"] == 0
    # every admitted answer ran to its end, and vLLM never ran short
    assert not clients.errors, clients.errors
    assert [(a.status, a.tokens) for a, _ in admitted] == [(200, n) for _, n in admitted]
    preempted = preemptions(sim) - before
    assert preempted == 0, preempted
    assert_predicted_at_every_step(samples)
