"""Data-parallel vLLM (``--data-parallel-size 2``): two engines, each with its own KV pool of
20 blocks of 128 tokens. The sidecar models the pools per engine and pins each request to the
engine it was admitted on (vLLM's ``X-data-parallel-rank`` header).

A burst of six answers of 8 blocks each: two fit in one engine's 19 usable blocks at once, so
the six are three too many for the two engines together. Sent straight to vLLM, its coordinator
spreads them three to an engine and vLLM preempts; through the sidecar they complete with no
preemption. (Before, the sidecar summed the engines' labels into one pool of 78 blocks and let
the burst through: vLLM preempted 5 times.)
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import httpx
import pytest

from harness.vllm_cpu import VllmServer, ensure_model
from harness.workload import SidecarProcess, make_prompts, metric_value
from tests.support.vllm_idle import idle_preemptions

pytestmark = pytest.mark.vllm

EXTERNAL = os.environ.get("KV_SIDECAR_TEST_VLLM_URL")
BLOCKS_PER_ENGINE = 20


@pytest.fixture(scope="module")
def dp_vllm() -> Iterator[VllmServer]:
    if EXTERNAL:
        pytest.skip("starts its own data-parallel vLLM (KV_SIDECAR_TEST_VLLM_URL is set)")
    server = VllmServer(num_gpu_blocks=BLOCKS_PER_ENGINE, extra_args=["--data-parallel-size", "2"])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def burst(url: str, prompts: list[str], served_name: str) -> list[tuple[int, int]]:
    """(status, completion tokens) of each streamed answer of 753 tokens, all sent at once."""

    async def run() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(timeout=600) as client:

            async def one(prompt: str) -> tuple[int, int]:
                resp = await client.post(
                    url + "/v1/completions",
                    json={
                        "model": served_name,
                        "prompt": prompt,
                        "max_tokens": 753,  # 271 + 753 = 1024 tokens: 8 blocks at the end
                        "ignore_eos": True,
                    },
                )
                tokens = resp.json().get("usage", {}).get("completion_tokens", 0)
                return resp.status_code, tokens

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(run())


def engine_counts(url: str, name: str) -> list[float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return [metric_value(text, name, engine=e) or 0.0 for e in ("0", "1")]


def test_a_burst_over_each_engines_pool_completes_without_preemption(
    dp_vllm: VllmServer,
) -> None:
    prompts = make_prompts(ensure_model(), 6, 271, seed=31)
    before = idle_preemptions(dp_vllm.url)
    with SidecarProcess(dp_vllm.url, "--policy", "queue", "--max-queue-wait", "300") as sc:
        state = sc.state()
        # two pools of 19 usable blocks, not one of 2 x 40 - 2 (the labels' sum)
        assert state["capacity_blocks"] == 2 * (BLOCKS_PER_ENGINE - 1), state
        served_before = engine_counts(dp_vllm.url, "vllm:request_success_total")
        results = burst(sc.url, prompts, dp_vllm.served_name)
        served = engine_counts(dp_vllm.url, "vllm:request_success_total")
    assert results == [(200, 753)] * 6
    assert idle_preemptions(dp_vllm.url) == before
    # pinned to both engines (the emptier pool first; a queued request goes to the engine whose
    # answers ended first), two at a time each
    per_engine = [a - b for a, b in zip(served, served_before, strict=True)]
    assert sum(per_engine) == 6 and min(per_engine) >= 2, per_engine


def test_the_same_burst_straight_to_vllm_preempts(dp_vllm: VllmServer) -> None:
    """The workload above is one that data-parallel vLLM cannot run alone without preempting
    (so that the test above can fail)."""
    prompts = make_prompts(ensure_model(), 6, 271, seed=32)
    before = idle_preemptions(dp_vllm.url)
    results = burst(dp_vllm.url, prompts, dp_vllm.served_name)
    assert results == [(200, 753)] * 6
    assert idle_preemptions(dp_vllm.url) > before
