"""The admission model against the real vLLM: Retry-After that the official openai client, at
its default retries, can live by.

The test runs a fresh sidecar process in front of the session's vLLM (64 blocks of 128 tokens,
max_model_len 1,024 on the harness's server) and asserts that vLLM did not preempt. Future-peak
admission of answers at different stages, a shared prefix counted once and non-streamed
progress are asserted step by step on vLLM's own scheduler with a simulated GPU
(tests/test_admission_sim.py): sampled from this free-running engine, a loaded machine left
them too few samples.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from harness.vllm_info import VllmInfo
from harness.workload import SidecarProcess, make_prompts, metric_value
from tests.support.external import unless_external
from tests.support.vllm_idle import idle_preemptions

pytestmark = pytest.mark.vllm


def _sized(vllm: VllmInfo) -> None:
    if vllm.num_gpu_blocks != 64 or vllm.block_size != 128 or vllm.max_model_len < 1024:
        unless_external("sized for the harness's vLLM: 64 blocks of 128 tokens, max_model_len 1024")


def test_openai_client_at_its_default_retries_completes_an_over_budget_burst(
    vllm: VllmInfo,
) -> None:
    """16 answers of 8 blocks through --policy reject (7 fit at once): the official client, at
    its default max_retries (2), honours retry-after-ms, and every request completes because each
    refusal is given the slot when it will fit."""
    _sized(vllm)
    assert vllm.model_dir is not None
    prompts = make_prompts(vllm.model_dir, 16, 271, seed=9)
    # A fresh sidecar takes vLLM's own answer lengths (vllm:request_generation_tokens) as its
    # history; on the session vLLM that may be only the warm-up's 32-token answers. These
    # requests set ignore_eos, so Retry-After takes each in flight to its max_tokens, not to
    # where that history says answers end (before 9c85b7d it told the first refusals 1.7 s where
    # the first wave ran 14 s, and this test primed the history with seven answers of its kind).
    before = idle_preemptions(vllm.url)
    retry_after_ms: list[str | None] = []  # every 429's retry-after-ms, in order

    async def record(response: httpx.Response) -> None:
        if response.status_code == 429:
            retry_after_ms.append(response.headers.get("retry-after-ms"))

    async def run(url: str) -> list[int | BaseException]:
        http = httpx.AsyncClient(timeout=600, event_hooks={"response": [record]})
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", http_client=http)
        assert client.max_retries == 2  # the documented default, unchanged

        async def one(prompt: str) -> int:
            out = await client.completions.create(
                model=vllm.served_name,
                prompt=prompt,
                max_tokens=700,
                extra_body={"ignore_eos": True},
            )
            assert out.usage is not None
            return out.usage.completion_tokens

        try:
            return list(await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True))
        finally:
            await client.close()

    with SidecarProcess(vllm.url, "--policy", "reject") as sc:
        tokens = asyncio.run(run(sc.url))
    assert tokens == [700] * 16, f"{tokens} after 429s with retry-after-ms {retry_after_ms}"
    assert retry_after_ms  # the burst really was over budget, and was retried
    assert idle_preemptions(vllm.url) == before


def test_samples_that_together_outgrow_the_pool_are_served_as_vllm_serves_them(
    vllm: VllmInfo,
) -> None:
    """A chat without max_tokens asking for n = 8 on vLLM's pool of 63 blocks: each sample may
    reach the whole context (8 blocks), 64 together. vLLM schedules each sample as a request of
    its own, so it serves this; the sidecar in worst-case mode did not, answering 413 "can never
    run" before b733d53. Now it runs alone, and the official client gets its 8 choices."""
    _sized(vllm)
    assert vllm.model_dir is not None
    (prompt,) = make_prompts(vllm.model_dir, 1, 880, seed=3)  # short answers: ~140 tokens left
    with SidecarProcess(vllm.url, "--reservation", "worst-case") as sc:
        client = openai.OpenAI(base_url=sc.url + "/v1", api_key="unused")
        out = client.chat.completions.create(
            model=vllm.served_name, messages=[{"role": "user", "content": prompt}], n=8
        )
        client.close()
        assert len(out.choices) == 8
        assert out.usage is not None and out.usage.prompt_tokens + 1 <= vllm.max_model_len
        metrics = sc.metrics()
        assert metric_value(metrics, "kv_sidecar_requests_total", reason="too_large") == 0
        admitted = [
            metric_value(metrics, "kv_sidecar_requests_total", decision="admit", reason=r)
            for r in ("fits", "queued")  # queued while a previous test's requests ended
        ]
        assert sum(a or 0 for a in admitted) == 1, admitted
