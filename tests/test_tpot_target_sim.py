"""``--tpot-target`` against vLLM's own scheduler on the simulated GPU, stepped by hand: a sidecar
that has learned vLLM's decode step against its batch holds vLLM's batch at the sequences whose
step keeps the target. Eight answers sent to it run three at a time, every step of vLLM within
the target, the rest waiting in the sidecar's queue until others end (or refused at once with 429
``latency_target`` under ``--policy reject``); without the target the same eight run together,
in steps 38 % over it.

The sidecar learns the step from vLLM's inter-token latency, which vLLM stamps in its engine core
as each step returns. In manual mode (``harness.sim_server``) a step returns when the test grants
it, so the test paces its grants: each step is granted ``SCALE`` (20) times its simulated time
after the one before, that time being ``harness.sim_cost.step_cost`` of the batch vLLM scheduled
(the waiting step's requests, read from the control channel before the grant; the executor's own
figure for the step is checked against it afterwards). The sidecar's target is ``SCALE`` times the
simulated one, as under time dilation (docs/simulated-engine.md). The test's own waits take a few
milliseconds of the 165-236 ms a step is given, so vLLM reports the cost model's steps, dilated,
to a fraction of a millisecond.

Figures (Llama-3.1-8B's config on an H100 80 GB, ``harness/sim_cost.py``): a decode step of ``b``
sequences at 16,016 tokens of context each takes 7.349 ms (the weights, 6.849 ms, and the 0.5 ms
overhead) plus 0.894 ms per sequence (each reads its context's KV, 128 KiB a token): 10.034 ms
for 3 sequences, 10.930 ms for 4, 14.511 ms for 8. The target is midway between 3 and 4, 10.482 ms
(0.2096 s dilated): the cost model keeps exactly 3 within it. The prompts are 16,016 tokens that
share their first 16,000 (1,000 blocks), which a primer puts in vLLM's prefix cache, so each
request's own prefill is 16 tokens and a step that takes one in costs what a step of one more
decode does (to a microsecond): every step is a decode step of its batch, and the batch alone
decides it. The pool, 9,000 blocks (``--num-gpu-blocks-override``) and a 16,384-token context,
holds the eight answers' worst-case reservations (1,003 blocks each) beside each other, so the
KV budget never holds one back: only the target does.

The bound is exactly 3 because of how the sidecar learns (``sidecar.admission.costs``): it fits
``step = base + per_sequence x batch`` through each scrape interval's inter-token latency against
its mean running count, and admits a request while the step at the batch with it is within the
target. A warm-up sent straight to vLLM, five answers of 4, 8, 12, 16 and 20 tokens at once, gives
it batches 5 down to 1. Where an answer ended within an interval, the interval's batch is half a
sequence below the batch that made its step, so the fit leans up: over ten warm-ups here the
sidecar's line (its /state: the slope, and the base from the step's fixed share at a batch of 1,
where the warm-up ends) was 7.40-7.51 ms + 0.90-0.94 ms per sequence, 10.18-10.22 ms at 3 and
11.11-11.15 ms at 4: at least 0.26 ms inside the target at 3 and 0.62 ms over it at 4 (5 and 12 ms
of wall time at x20, where the pacing is off by tenths of a millisecond). So the learned line, like
the cost model, admits a third sequence and refuses a fourth: the test asserts that it did (3 of 8
admitted with vLLM idle), then that no step of vLLM ran more than 3 requests and every step stayed
within the target. A line that had learned the step at 4 within the target would have admitted a
fourth at once, and the contrast (the same eight with no target: 8 at once, steps of 14.5 ms) shows
the assertions fail where the target is not applied.

The answers' lengths (6, 8, 11, 10, 5, 9, 7 and 4 tokens, each carried in ``vllm_xargs``, which
the sidecar never reads) end one at a time, so the queued ones are admitted one at a time as the
answers ahead end, each joining vLLM's batch as one has left it: whichever step each of the first
three joins (vLLM schedules the first alone, the next two one or two steps later, by when they
arrive), no two answers end in the same step.

One simulated server for the module; the sidecar in worst-case mode (tests/conftest.py),
``--scrape-interval 0.05``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from harness import sim_cost
from harness.exposition import metric_value
from harness.gpus import gpu
from harness.sim_server import SimServer, model_config
from harness.workload import SidecarProcess, make_prompts
from tests.support.sim import cache_config, metrics, sim_8b, wait_idle
from tests.support.stepped import Clients, held, streamed
from tests.support.wait import wait_for

pytestmark = pytest.mark.vllm

MODEL = "llama-3.1-8b-instruct"  # tests.support.sim.sim_8b's
GPU = "h100-80gb"
BLOCKS = 9000
MAX_MODEL_LEN = 16384
PREFIX_TOKENS = 16000  # shared, held in vLLM's prefix cache: 1,000 blocks of 16
SUFFIX_TOKENS = 16  # each request's own: its whole prefill
PROMPT_TOKENS = PREFIX_TOKENS + SUFFIX_TOKENS
MAX_TOKENS = 32
#: wall seconds per simulated second: the pace of the grants, and the target's dilation
SCALE = 20.0
#: sequences whose decode step keeps the target
K = 3
#: the warm-up's answers, straight to vLLM: batches 5 down to 1, four steps each
WARM_UP = (4, 8, 12, 16, 20)
#: the workload's answers, sent one at a time in this order
LENGTHS = (6, 8, 11, 10, 5, 9, 7, 4)
#: how far a step's simulated time may be from the cost model's at the prompt's context: the
#: tokens an answer has generated (20 at most, ~56 ns of KV read each) and a 16-token prefill in
#: place of a decode (~1 us); one sequence more or fewer is 894 us
COMPOSITION_TOLERANCE = 50e-6
SCRAPE_INTERVAL = "0.05"
WITHIN = 30.0

SHAPE = sim_cost.ModelShape.from_config(json.loads(model_config(MODEL).read_text()))


def decode_step(batch: int) -> float:
    """The simulated seconds of a decode step of ``batch`` sequences at the prompt's context."""
    work = [sim_cost.SeqWork(new_tokens=1, context_tokens=PROMPT_TOKENS)] * batch
    return sim_cost.step_cost(SHAPE, gpu(GPU), work).seconds


#: simulated seconds a decode step may take: midway between K and K + 1 sequences
TARGET = (decode_step(K) + decode_step(K + 1)) / 2


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with sim_8b(MAX_MODEL_LEN, BLOCKS) as server:
        yield server


@pytest.fixture(scope="module")
def prefix(sim: SimServer) -> list[int]:
    """The shared prefix's token ids (BOS first), prefilled once (in roofline mode) so that
    vLLM's prefix cache holds it for every request after."""
    (ids,) = token_ids(sim, make_prompts(sim.model_dir, 1, PREFIX_TOKENS, seed=51))
    assert len(ids) == PREFIX_TOKENS
    primer = {"model": sim.served_name, "prompt": ids + suffixes(sim, 1, seed=50)[0]}
    resp = httpx.post(sim.url + "/v1/completions", json={**primer, "max_tokens": 1}, timeout=60)
    assert resp.status_code == 200, resp.text
    wait_idle(sim)
    return ids


def token_ids(sim: SimServer, texts: list[str]) -> list[list[int]]:
    """Each text's token ids as vLLM's tokenizer makes them for a completion (BOS first)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(sim.model_dir))
    return [list(tokenizer(t)["input_ids"]) for t in texts]


def suffixes(sim: SimServer, count: int, *, seed: int) -> list[list[int]]:
    """``count`` distinct runs of SUFFIX_TOKENS token ids (no BOS)."""
    texts = make_prompts(sim.model_dir, count, SUFFIX_TOKENS + 1, seed=seed)
    out = [ids[1:] for ids in token_ids(sim, texts)]
    assert all(len(s) == SUFFIX_TOKENS for s in out)
    return out


def bodies(sim: SimServer, prefix: list[int], lengths: tuple[int, ...], seed: int) -> list[Any]:
    """Streamed completions of the shared prefix and a suffix of their own (token ids), each
    ending after its length (``sim_output_tokens``)."""
    return [
        streamed(
            {
                "model": sim.served_name,
                "prompt": prefix + suffix,
                "max_tokens": MAX_TOKENS,
                "vllm_xargs": {"sim_output_tokens": n},
            }
        )
        for suffix, n in zip(suffixes(sim, len(lengths), seed=seed), lengths, strict=True)
    ]


@dataclass
class Step:
    requests: int  # vLLM's batch in the step (the executor's count)
    tokens: int  # tokens it computed: one per decode, 16 per prefill
    seconds: float  # its simulated time (the executor's cost model)
    predicted: float  # the cost model's decode step of its batch, which paced its grant
    late: float  # wall seconds the grant came after its time (the test's own lag)


@dataclass
class Pacer:
    """Grants vLLM's steps one at a time, each SCALE times its simulated time after the one
    before (the gap vLLM stamps as the inter-token latency of every sequence in it)."""

    sim: SimServer
    last_grant: float | None = None

    def run(self, clients: Clients, *, paced: bool = True) -> list[Step]:
        """Until every answer has ended; the steps run meanwhile."""
        out: list[Step] = []
        while True:
            # a batch waits for its grant, or every answer has ended (vLLM may have none while
            # the sidecar forwards the ones it admits as others end)
            wait_for(
                lambda: clients.open == 0 or self.sim.state()["waiting"],
                "a batch waiting for its step",
                within=WITHIN,
            )
            state = self.sim.state()
            if not state["waiting"]:
                return out
            predicted = decode_step(int(state["running"]))  # the waiting step's requests
            late = 0.0
            if paced and self.last_grant is not None:
                wait = self.last_grant + SCALE * predicted - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                else:
                    late = -wait
            self.last_grant = time.monotonic()
            last = self.sim.step(1)["last_step"]
            step = Step(last["requests"], last["tokens"], last["seconds"], predicted, late)
            out.append(step)


def scraped_after(sc: SidecarProcess, instant: float) -> dict[str, Any]:
    """The sidecar's /state once its last scrape of vLLM was taken after ``instant``."""
    state: dict[str, Any] = {}

    def fresh() -> bool:
        nonlocal state
        sent = time.monotonic()
        state = sc.state()
        age = state["snapshot_age"]
        return age is not None and sent - age >= instant

    wait_for(fresh, "a scrape after the last step", within=WITHIN)
    return state


def send_one_at_a_time(sc: SidecarProcess, clients: Clients, work: list[Any]) -> dict[str, Any]:
    """Each request decided (admitted, queued or refused) before the next is sent: the same
    order every run. The sidecar's /state after the last."""
    for sent, body in enumerate(work, start=1):
        clients.send(body)

        def decided(sent: int = sent) -> bool:
            state = sc.state()
            refused = sum(a.status == 429 for a in clients.answers)
            return bool(state["in_flight"] + state["queue_depth"] + refused == sent)

        wait_for(decided, f"request {sent} decided", within=WITHIN)
    return sc.state()


def sidecar_args(sim: SimServer, policy: str, *extra: str) -> list[str]:
    return [
        "--policy",
        policy,
        "--scrape-interval",
        SCRAPE_INTERVAL,
        "--model-config",
        str(sim.model_dir),
        *extra,
    ]


def decisions(sc: SidecarProcess, decision: str, reason: str) -> float:
    value = metric_value(
        sc.metrics(), "kv_sidecar_requests_total", decision=decision, reason=reason
    )
    return value or 0.0


def preemptions(sim: SimServer) -> float:
    return metrics(sim).get("vllm:num_preemptions_total", 0)


def test_the_figures() -> None:
    """The cost model's steps as the module's docstring gives them, and the target between 3
    and 4 sequences."""
    assert [round(decode_step(b) * 1e3, 3) for b in (1, 3, 4, 8)] == [8.244, 10.034, 10.93, 14.511]
    assert round(TARGET * 1e3, 3) == 10.482
    assert decode_step(K) <= TARGET < decode_step(K + 1)


@pytest.mark.parametrize("policy", ["queue", "reject"])
def test_the_decode_step_target_holds_vllms_batch_to_what_keeps_it(
    sim: SimServer, prefix: list[int], policy: str
) -> None:
    """After a warm-up that teaches the sidecar vLLM's step against its batch, eight answers sent
    one at a time: three admitted, the other five queued (``queue``) or refused with 429
    ``latency_target`` (``reject``). Stepped to the end at the paced step times: vLLM never runs
    more than three requests in a step and runs three, every step within the target, and every
    answer admitted runs to its length (queued ones admitted as others end), with no
    preemption."""
    assert cache_config(sim)["num_gpu_blocks"] == str(BLOCKS)
    warm = bodies(sim, prefix, WARM_UP, seed=61)
    work = bodies(sim, prefix, LENGTHS, seed=71)
    before = preemptions(sim)
    args = sidecar_args(sim, policy, "--tpot-target", repr(SCALE * TARGET))
    with SidecarProcess(sim.url, *args) as sc, held(sim):
        pacer = Pacer(sim)
        # the warm-up, straight to vLLM: the sidecar learns from its scrapes alone
        direct = Clients(sim.url, "/v1/completions", warm).start()
        warm_steps = pacer.run(direct)
        direct.stop()
        assert pacer.last_grant is not None
        learned = scraped_after(sc, pacer.last_grant)
        figures = {
            k: learned[k] and learned[k] / SCALE
            for k in ("decode_step_seconds", "step_seconds_per_sequence")
        }
        lag = max(s.late for s in warm_steps)
        # the premise: the step and its line against the batch are learned
        assert None not in figures.values(), (figures, learned["step_fixed_share"])

        clients = Clients(sc.url, "/v1/completions", []).start()
        state = send_one_at_a_time(sc, clients, work)
        # with vLLM idle, the learned line admits three and holds the fourth back
        table = (figures, learned["step_fixed_share"], f"lag {lag:.3f}s")
        assert state["in_flight"] == K, (state["in_flight"], table)
        if policy == "queue":
            assert state["queue_depth"] == len(work) - K, table
        steps = pacer.run(clients)
        clients.stop()
        counts = {
            (d, r): decisions(sc, d, r)
            for d, r in (
                ("admit", "fits"),
                ("admit", "queued"),
                ("reject", "latency_target"),
                ("reject", "kv_cache_full"),
            )
        }
    assert not clients.errors, clients.errors
    composition = [(s.requests, s.tokens, round(s.seconds * 1e3, 3)) for s in steps]
    # every step's batch is the one it was paced for: its simulated time is the cost model's
    # decode step of it (and so vLLM's inter-token latency was the cost model's, dilated)
    unlike = [
        (s.requests, s.tokens, s.seconds, s.predicted)
        for s in warm_steps + steps
        if abs(s.seconds - s.predicted) >= COMPOSITION_TOLERANCE
    ]
    assert not unlike
    # vLLM never ran more than the target keeps, and ran that many
    assert max(s.requests for s in steps) == K, composition
    # every step with the sidecar's requests within the target
    assert max(s.seconds for s in steps) <= TARGET, composition
    answers = [(a.status, a.tokens) for a in clients.answers]
    if policy == "queue":
        # every answer ran to its end, the five held back admitted from the queue
        assert answers == [(200, n) for n in LENGTHS]
        assert counts == {
            ("admit", "fits"): K,
            ("admit", "queued"): len(work) - K,
            ("reject", "latency_target"): 0,
            ("reject", "kv_cache_full"): 0,
        }
    else:
        # the three admitted ran to their ends; the rest were refused at once, for the target
        assert answers == [(200, n) for n in LENGTHS[:K]] + [(429, 0)] * (len(work) - K)
        assert counts == {
            ("admit", "fits"): K,
            ("admit", "queued"): 0,
            ("reject", "latency_target"): len(work) - K,
            ("reject", "kv_cache_full"): 0,
        }
    assert preemptions(sim) == before


def test_without_the_target_the_same_answers_run_together_past_it(
    sim: SimServer, prefix: list[int]
) -> None:
    """The contrast: the same eight answers to a sidecar without ``--tpot-target`` are all
    admitted (the pool holds their reservations), vLLM runs all eight in one step and its steps
    take 14.5 ms, 38 % over the target: the assertions above fail where the target is not
    applied."""
    work = bodies(sim, prefix, LENGTHS, seed=71)
    with SidecarProcess(sim.url, *sidecar_args(sim, "queue")) as sc, held(sim):
        clients = Clients(sc.url, "/v1/completions", []).start()
        state = send_one_at_a_time(sc, clients, work)
        assert (state["in_flight"], state["queue_depth"]) == (len(work), 0), state
        steps = Pacer(sim).run(clients, paced=False)
        clients.stop()
    assert not clients.errors, clients.errors
    composition = [(s.requests, s.tokens, round(s.seconds * 1e3, 3)) for s in steps]
    assert max(s.requests for s in steps) == len(work) > K, composition
    assert max(s.seconds for s in steps) > TARGET, composition
    assert [(a.status, a.tokens) for a in clients.answers] == [(200, n) for n in LENGTHS]
