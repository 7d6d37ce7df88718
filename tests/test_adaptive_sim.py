"""Adaptive admission (the default) in front of vLLM's own server and scheduler on the simulated
GPU (``harness.sim_vllm``), stepped by hand: a cold sidecar runs chats without ``max_tokens`` at
vLLM's own concurrency where worst-case holds them to two, admits them by their prompts (as vLLM
does) where their cold floors would not fit together, and a sidecar started beside a vLLM that
has answered takes its first lengths from vLLM's history.

One simulated server per module: Llama-3.1-8B's config on an H100 80 GB with 400 blocks of 16
tokens and a 2,048-token context. In manual mode the engine runs a step only when the test grants
it, so nothing ends while the test reads the sidecar's state; answers' lengths ride in
``vllm_xargs`` (``sim_output_tokens``), which the sidecar never reads.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.exposition import metric_value
from harness.sim_server import SimServer
from harness.workload import SidecarProcess
from sidecar.admission.learner import LengthLearner
from sidecar.engine.snapshot import parse_vllm_metrics
from tests.support.sim import sim_8b, wait_idle
from tests.support.wait import until

pytestmark = pytest.mark.vllm

BLOCKS = 400
BLOCK = 16
MAX_MODEL_LEN = 2048
QUESTION = "tell me about the cache " * 12


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with sim_8b(MAX_MODEL_LEN, BLOCKS) as server:
        yield server


def sidecar(sim: SimServer, reservation: str, *extra: str) -> SidecarProcess:
    return SidecarProcess(
        sim.url,
        "--reservation",
        reservation,
        "--model-config",
        str(sim.model_dir),
        "--policy",
        "queue",
        "--scrape-interval",
        "0.1",
        *extra,
    )


def chat_body(sim: SimServer, length: int) -> dict[str, Any]:
    """A streamed chat that names no max_tokens (the rest of the context, as vLLM reads it) and
    ends after ``length`` tokens in the simulation."""
    return {
        "model": sim.served_name,
        "messages": [{"role": "user", "content": QUESTION}],
        "stream": True,
        "vllm_xargs": {"sim_output_tokens": length},
    }


def prompt_tokens(sim: SimServer) -> int:
    body = {"model": sim.served_name, "messages": [{"role": "user", "content": QUESTION}]}
    return int(httpx.post(sim.url + "/tokenize", json=body, timeout=10).json()["count"])


def wait_decided(sc: SidecarProcess, count: int, timeout: float = 60.0) -> dict[str, Any]:
    """The sidecar's /state once ``count`` requests are in flight or queued."""
    return until(
        lambda: (s := sc.state())["in_flight"] + s["queue_depth"] >= count and s,
        f"{count} decided",
        timeout,
    )


async def _hold(url: str, bodies: list[dict[str, Any]], ready: asyncio.Event) -> None:
    """Open every stream and keep it open until ``ready`` is set (then leave: vLLM aborts)."""
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(body: dict[str, Any]) -> None:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200, await resp.aread()
                await ready.wait()

        tasks = [asyncio.ensure_future(one(b)) for b in bodies]
        await ready.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def admitted_while_held(sim: SimServer, sc: SidecarProcess, count: int) -> dict[str, Any]:
    """Send ``count`` chats with the engine stopped; the sidecar's state once all are decided."""

    async def run() -> dict[str, Any]:
        ready = asyncio.Event()
        held = asyncio.ensure_future(_hold(sc.url, [chat_body(sim, 100)] * count, ready))
        try:
            return await asyncio.to_thread(wait_decided, sc, count)
        finally:
            ready.set()
            await held

    sim.set_mode("manual")
    try:
        return asyncio.run(run())
    finally:
        sim.set_mode("roofline")
        wait_idle(sim)


def test_a_cold_sidecar_admits_chats_without_max_tokens_to_vllms_concurrency(
    sim: SimServer,
) -> None:
    """Twelve chats of ~100 prompt tokens and no max_tokens on 400 blocks of 16 (380 after the
    default 5 % headroom). vLLM itself would run all twelve (it admits by the prompt). Worst-case
    reserves each to the end of the 2,048-token context (128 blocks): two or three run (three by
    their future peak once two have started), the rest wait. A cold
    adaptive sidecar (a vLLM that has answered nothing) risks 256 output tokens each (about 23
    blocks): all twelve run at once."""
    text = httpx.get(sim.url + "/metrics", timeout=10).text
    assert (metric_value(text, "vllm:request_generation_tokens_count") or 0) == 0  # premise
    with sidecar(sim, "worst-case") as worst:
        state = admitted_while_held(sim, worst, 12)
    assert state["in_flight"] <= 3 and state["in_flight"] + state["queue_depth"] == 12, state
    with sidecar(sim, "adaptive") as adaptive:
        state = admitted_while_held(sim, adaptive, 12)
        per_request = math.ceil((prompt_tokens(sim) + 256) / BLOCK)
    assert (state["in_flight"], state["queue_depth"]) == (12, 0), state
    assert state["reserved_blocks"] == 12 * per_request, state


def test_where_the_floor_does_not_fit_chats_are_admitted_by_their_prompts_as_vllm_admits(
    sim: SimServer,
) -> None:
    """The same twelve chats on a budget of 159 blocks (``--headroom 0.6``): at the cold floor of
    256 output tokens each (about 23 blocks) their future peak holds some back (with the rule
    below off, eight ran and four waited), but a recompute of a ~100-token prompt costs well
    under two decode steps, so each is admitted as vLLM admits a request, by its prompt (7
    blocks): twelve prompts fit in 159 blocks, and all twelve run, as vLLM alone would run them.
    Worst-case on the same budget runs none beside the first (128 blocks each: one alone is
    admitted into an empty pool and no second fits)."""
    tokens = prompt_tokens(sim)
    prompt_blocks = math.ceil(tokens / BLOCK)
    floor_blocks = math.ceil((tokens + 256) / BLOCK)
    with sidecar(sim, "adaptive", "--headroom", "0.6") as adaptive:
        state = admitted_while_held(sim, adaptive, 12)
    # the premise: the floors do not fit together, the prompts do
    assert 12 * prompt_blocks <= state["budget_blocks"] < 12 * floor_blocks, state
    assert (state["in_flight"], state["queue_depth"]) == (12, 0), state
    with sidecar(sim, "worst-case", "--headroom", "0.6") as worst:
        state = admitted_while_held(sim, worst, 12)
    assert (state["in_flight"], state["queue_depth"]) == (1, 11), state


def test_a_chat_over_the_budget_but_within_the_pool_is_served_not_refused(
    sim: SimServer,
) -> None:
    """On a budget smaller than one context (``--headroom 0.7``: 119 blocks, a chat without
    max_tokens reaches 128) every such chat was refused with 413 "can never run", though vLLM's
    pool of 400 blocks serves it. Now adaptive admits all twelve by their prompts, and
    worst-case runs one alone (nothing beside it) while the others wait: none is refused."""
    with sidecar(sim, "adaptive", "--headroom", "0.7") as adaptive:
        state = admitted_while_held(sim, adaptive, 12)
    # the premise: a chat's worst case is over the budget and within the pool
    assert state["budget_blocks"] < MAX_MODEL_LEN // BLOCK <= state["capacity_blocks"], state
    assert (state["in_flight"], state["queue_depth"]) == (12, 0), state
    with sidecar(sim, "worst-case", "--headroom", "0.7") as worst:
        state = admitted_while_held(sim, worst, 12)
        refused = metric_value(worst.metrics(), "kv_sidecar_requests_total", reason="too_large")
    assert (state["in_flight"], state["queue_depth"]) == (1, 11), state
    assert not refused


def test_a_sidecar_beside_a_vllm_that_has_answered_starts_from_its_history(
    sim: SimServer,
) -> None:
    """vLLM answers 24 completions of 40 tokens first (its vllm:request_generation_tokens
    histogram: bucket 50, sum 960). A sidecar started after that reserves a chat without
    max_tokens to what that history says (the 0.75-quantile bound of it, its answers spread over
    each bucket as the histogram's sum allows), not to the end of the context and not to the
    cold 256."""

    async def answer_directly() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {
                "model": sim.served_name,
                "prompt": "history",
                "max_tokens": 500,
                "vllm_xargs": {"sim_output_tokens": 40},
            }
            for resp in await asyncio.gather(
                *(client.post(sim.url + "/v1/completions", json=body) for _ in range(24))
            ):
                assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 40

    asyncio.run(answer_directly())
    wait_idle(sim)
    history = parse_vllm_metrics(httpx.get(sim.url + "/metrics", timeout=10).text, taken_at=0)
    assert history.generation_lengths_sum == 24 * 40
    learner = LengthLearner()
    assert (
        learner.seed(history.generation_lengths, total_tokens=history.generation_lengths_sum) >= 24
    )
    expected = learner.bound("chat:none", 0.75)
    assert expected is not None and expected <= 50, history.generation_lengths
    with sidecar(sim, "adaptive") as sc:
        state = admitted_while_held(sim, sc, 1)
        tokens = prompt_tokens(sim)
    assert state["reserved_blocks"] == math.ceil((tokens + expected) / BLOCK), (state, expected)
