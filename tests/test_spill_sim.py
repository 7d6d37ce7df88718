"""``--policy spill`` and ``--ttft-target`` against vLLM's own scheduler on the simulated GPU,
stepped by hand: with the pool held by three answers, a request whose expected wait is hundreds
of decode steps is refused at once (429 ``spilled``, or ``ttft_target`` under ``--policy queue``
with the objective, with Retry-After), and one whose wait is two steps is queued, then admitted
when the answer ahead of it ends.

The engine runs a step only when the test grants one (``harness.sim_server``, manual mode), so
the ledger's state at the decisions is exact; what is timed is only the decode step the sidecar
learns from vLLM's inter-token latency, which is the test's own pace of granting steps (tens to
hundreds of milliseconds here), and for the objective the prefill by the learned cost per
prompt token (little at that pace). The two waits are 2 and
about 355 steps, and ``--spill-wait`` and ``--ttft-target`` are 3 s: each decision holds for any
step time between 9 ms and 1.4 s.

One simulated server for the module: Llama-3.1-8B's config on an H100, 1,032 blocks of 16 tokens
(``--num-gpu-blocks-override``; 1,031 usable, the sidecar's budget with ``--headroom 0``), an
8,192-token context; the sidecar in worst-case mode (tests/conftest.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.sim_server import SimServer
from harness.workload import SidecarProcess, make_prompts
from tests.support.sim import cache_config, metrics, sim_8b
from tests.support.stepped import Clients, Stepper, admitted, held, streamed
from tests.support.wait import wait_for

pytestmark = pytest.mark.vllm

BLOCKS = 1032
MAX_MODEL_LEN = 8192
THRESHOLD = "3"  # seconds: --spill-wait, or --ttft-target
WITHIN = 30.0


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with sim_8b(MAX_MODEL_LEN, BLOCKS) as server:
        yield server


def body(sim: SimServer, prompt: str, max_tokens: int) -> dict[str, Any]:
    return streamed(
        {"model": sim.served_name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    )


def sidecar_counts(sc: SidecarProcess) -> dict[tuple[str, str], float]:
    text = httpx.get(sc.metrics_url + "/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("kv_sidecar_requests_total{"):
            labels, value = line[len("kv_sidecar_requests_total{") :].split("} ")
            pairs = dict(p.split("=", 1) for p in labels.split(","))
            out[(pairs["decision"].strip('"'), pairs["reason"].strip('"'))] = float(value)
    return out


@pytest.mark.parametrize(
    ("policy", "flag", "code"),
    [("spill", "--spill-wait", "spilled"), ("queue", "--ttft-target", "ttft_target")],
    ids=["spill", "ttft-target"],
)
def test_a_long_wait_is_refused_at_once_and_a_short_one_queued(
    sim: SimServer, policy: str, flag: str, code: str
) -> None:
    labels = cache_config(sim)
    assert labels["num_gpu_blocks"] == str(BLOCKS)
    block = int(labels["block_size"])
    # the pool's holders: one answer that ends after 40 tokens, two that run 392
    f1, f2, f3 = (
        make_prompts(sim.model_dir, 1, n, seed=seed)[0]
        for n, seed in ((1000, 31), (7800, 32), (7000, 33))
    )
    (short_prompt,) = make_prompts(sim.model_dir, 1, 700, seed=34)
    (long_prompt,) = make_prompts(sim.model_dir, 1, 900, seed=35)
    peaks = [math.ceil(t / block) for t in (1000 + 40, 7800 + 392, 7000 + 392)]
    budget = BLOCKS - 1
    short_peak, long_peak = math.ceil(800 / block), math.ceil(1000 / block)
    # the premise: neither fits beside the three now; once the first has ended the short one
    # does and the long one does not (not until one of the long answers has ended too)
    assert sum(peaks) - peaks[0] + short_peak <= budget < sum(peaks[1:]) + long_peak
    before = metrics(sim).get("vllm:num_preemptions_total", 0)
    args = [
        "--policy",
        policy,
        flag,
        THRESHOLD,
        "--headroom",
        "0",
        "--max-queue-wait",
        "300",
        "--scrape-interval",
        "0.05",
        "--model-config",
        str(sim.model_dir),
    ]
    with SidecarProcess(sim.url, *args) as sc:
        clients = Clients(sc.url, "/v1/completions", [body(sim, f1, 40)])
        with held(sim):
            stepper = Stepper(sim, sc, clients)
            clients.start()
            # the short answer first, and started: behind the two long ones it would wait for
            # their ends, and beside them unstarted the third would not fit (a request not
            # started yet is never freed in the trajectories, so it cannot count on ending
            # before them); started, it ends after 40 tokens and both long ones fit at once
            admitted(sc, 1)
            stepper.step()
            clients.send(body(sim, f2, 392))
            clients.send(body(sim, f3, 392))
            admitted(sc, 3)
            assert sc.state()["budget_blocks"] == budget
            # the first answer two tokens from its end, the others early in theirs
            while clients.answers[0].tokens < 38:
                assert stepper.sampled < 200, [a.tokens for a in clients.answers]
                stepper.step()
            state = stepper.sample()
            assert state["decode_step_seconds"] is not None  # the step time is learned: warm
            assert clients.answers[0].tokens == 38  # the engine is held: it stays there
            # what follows is counted from here
            counted = sidecar_counts(sc)

            # a wait of about 355 steps: refused at once, the engine still held
            resp = httpx.post(
                sc.url + "/v1/completions", json=body(sim, long_prompt, 100), timeout=WITHIN
            )
            assert resp.status_code == 429, resp.text
            error = resp.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", code)
            assert flag in error["message"]
            assert float(resp.headers["retry-after"]) >= 1
            assert int(resp.headers["retry-after-ms"]) >= 1000
            assert sc.state()["queue_depth"] == 0

            # a wait of two steps: queued
            short = clients.send(body(sim, short_prompt, 100))
            wait_for(lambda: sc.state()["queue_depth"] == 1, "the short one queued", within=WITHIN)
            assert short.status is None  # no answer yet: it waits in the sidecar
            stepper.step(2)  # the first answer ends: the short one is admitted
            wait_for(
                lambda: sc.state()["queue_depth"] == 0 and sc.state()["in_flight"] == 3,
                "the short one admitted",
                within=WITHIN,
            )
            counts = sidecar_counts(sc)
            assert counted.get(("reject", code), 0) == 0
            assert counts[("reject", code)] == 1
            assert counts[("admit", "queued")] == counted[("admit", "queued")] + 1
            assert counts[("admit", "fits")] + counts[("admit", "queued")] == 4
        sim.set_mode("0.001")  # the rest at a fixed 1 ms a step
        try:
            clients.stop(timeout=300)
        finally:
            sim.set_mode("roofline")
    assert not clients.errors, clients.errors
    assert [(a.status, a.tokens) for a in clients.answers] == [
        (200, 40),
        (200, 392),
        (200, 392),
        (200, 100),
    ]
    assert metrics(sim).get("vllm:num_preemptions_total", 0) == before
