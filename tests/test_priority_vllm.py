"""Priority in front of the real vLLM (CPU build, the session server): an interactive request
goes ahead of a batch tenant's queued burst.

The sidecar's budget holds one request at a time (``--headroom`` from the pool, as
test_lifecycle sizes it), so a burst of batch requests (tenant ``batch``, priority 10 by
``--priority-rules``) runs one by one and the rest queue. vLLM's engine is stopped while they
arrive (``frozen_engine``): one is admitted and five queue, and then an interactive request
arrives through the official ``openai`` client, of the same tenant (so no fair share between
tenants orders it) but priority 0 by its ``x-kv-sidecar-priority`` header, which comes before
the rules. Once it is queued too, the engine runs again. The queue tries the best priority
first, so the interactive request is admitted at the first release and ends second, where FIFO
would end it last (with the rule at priority 0 it does: checked by hand, the test then fails
with the chat last). Nothing here depends on how fast vLLM decodes or on when the host gets
to the client: every request is in the sidecar's queue before a token is made, and the order
of admissions is the sidecar's, one at a time.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types import Completion

from harness.exposition import metric_value
from harness.workload import SidecarProcess, make_prompts, one_completion
from tests.conftest import VllmInfo
from tests.support.stepped import frozen_engine
from tests.support.vllm_idle import idle_preemptions

pytestmark = pytest.mark.vllm

BATCH = 6
PROMPT_TOKENS = 200
MAX_TOKENS = 300


async def test_an_interactive_request_is_admitted_ahead_of_a_queued_batch_burst(
    vllm: VllmInfo,
) -> None:
    assert vllm.model_dir is not None, "set KV_SIDECAR_TEST_MODEL_DIR for an external vLLM"
    max_tokens = min(MAX_TOKENS, vllm.max_model_len - PROMPT_TOKENS - 1)
    blocks_each = vllm.blocks_for(PROMPT_TOKENS + max_tokens)
    headroom = 1.0 - (blocks_each + 0.5) / (vllm.num_gpu_blocks - 1)
    prompts = make_prompts(vllm.model_dir, BATCH + 1, PROMPT_TOKENS, seed=23)
    before = idle_preemptions(vllm.url)
    args = ["--reservation", "worst-case", "--headroom", f"{headroom:.4f}"]
    with SidecarProcess(vllm.url, *args, "--priority-rules", "tenant:batch=10") as sc:
        assert sc.state()["budget_blocks"] == blocks_each, sc.state()
        finished: list[str] = []
        batch_headers = {"x-kv-sidecar-tenant": "batch"}
        async with httpx.AsyncClient(timeout=300, headers=batch_headers) as client:

            async def batch_one(k: int) -> int:
                r = await one_completion(
                    client, sc.url, prompts[k], max_tokens=max_tokens, stream=True,
                    model=vllm.served_name,
                )  # fmt: skip
                finished.append(f"batch-{k}")
                return r.status

            chat = AsyncOpenAI(base_url=sc.url + "/v1", api_key="sk-interactive", max_retries=0)

            async def interactive() -> Completion:
                answer = await chat.completions.create(
                    model=vllm.served_name,
                    prompt=prompts[BATCH],
                    max_tokens=max_tokens,
                    extra_body={"ignore_eos": True},
                    # the batch tenant's own: the priority alone puts it first, not a fair share
                    extra_headers={"x-kv-sidecar-tenant": "batch", "x-kv-sidecar-priority": "0"},
                )
                finished.append("chat")
                return answer

            async def settled(in_flight: int, queued: int) -> None:
                await _settled(client, sc.metrics_url, in_flight, queued)

            with frozen_engine(vllm):
                burst = [asyncio.ensure_future(batch_one(k)) for k in range(BATCH)]
                await settled(1, BATCH - 1)
                asked = asyncio.ensure_future(interactive())
                await settled(1, BATCH)
            answer = await asked
            statuses = await asyncio.gather(*burst)
            await chat.close()
        metrics = sc.metrics()
    assert statuses == [200] * BATCH
    assert answer.usage is not None and answer.usage.completion_tokens == max_tokens
    # FIFO would end it last; first by priority, it waits only for the one running
    assert finished.index("chat") == 1, finished
    assert (
        metric_value(
            metrics, "kv_sidecar_class_requests_total", priority="10", tenant="batch",
            decision="admit",
        )
        == BATCH
    )  # fmt: skip
    assert (
        metric_value(metrics, "kv_sidecar_class_requests_total", priority="0", decision="admit")
        == 1
    )
    assert idle_preemptions(vllm.url) == before


@pytest.mark.parametrize(("reserve", "batch_running"), [(0.34, 2), (0.0, 3)])
async def test_the_priority_reserve_starts_an_interactive_request_beside_a_batch_burst(
    vllm: VllmInfo, reserve: float, batch_running: int
) -> None:
    """A budget of three requests (``--headroom`` from the pool), a batch burst of five at
    priority 10, and vLLM's engine stopped while they arrive (``frozen_engine``: the decisions
    are the sidecar's, on any host). With ``--priority-reserve 0.34`` (a third of the budget:
    one request) two batch requests run and three queue, and an interactive request (priority
    0, another tenant) is admitted at once, beside them; with no reserve the batch takes all
    three places and the interactive request queues (first in line, for the next release)."""
    assert vllm.model_dir is not None, "set KV_SIDECAR_TEST_MODEL_DIR for an external vLLM"
    max_tokens = 32
    blocks_each = vllm.blocks_for(PROMPT_TOKENS + max_tokens)
    headroom = 1.0 - (3 * blocks_each + 0.5) / (vllm.num_gpu_blocks - 1)
    prompts = make_prompts(vllm.model_dir, 6, PROMPT_TOKENS, seed=29)
    args = ["--reservation", "worst-case", "--headroom", f"{headroom:.4f}"]
    args += ["--priority-rules", "tenant:batch=10", "--priority-reserve", str(reserve)]
    before = idle_preemptions(vllm.url)
    with SidecarProcess(vllm.url, *args) as sc:
        assert sc.state()["budget_blocks"] == 3 * blocks_each, sc.state()
        async with httpx.AsyncClient(timeout=300) as client:

            async def send(prompt: str, tenant: str) -> int:
                return await _tenant_completion(
                    client, sc.url, prompt, max_tokens, vllm.served_name, tenant
                )

            async def settled(in_flight: int, queued: int) -> None:
                await _settled(client, sc.metrics_url, in_flight, queued)

            with frozen_engine(vllm):
                burst = [asyncio.ensure_future(send(p, "batch")) for p in prompts[:5]]
                await settled(batch_running, 5 - batch_running)
                chat = asyncio.ensure_future(send(prompts[5], "chat"))
                if reserve:
                    await settled(batch_running + 1, 5 - batch_running)  # at once, beside them
                else:
                    await settled(batch_running, 5 - batch_running + 1)  # it waits its turn
                metrics = sc.metrics()
            statuses = await asyncio.gather(*burst, chat)
    assert statuses == [200] * 6
    admitted_now = metric_value(
        metrics, "kv_sidecar_class_requests_total", priority="0", tenant="chat", decision="admit"
    )
    assert (admitted_now or 0) == (1 if reserve else 0)
    assert idle_preemptions(vllm.url) == before


async def _tenant_completion(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, model: str, tenant: str
) -> int:
    """A streamed completion of ``tenant`` (its x-kv-sidecar-tenant header): its status."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"x-kv-sidecar-tenant": tenant}
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        async for _ in r.aiter_lines():
            pass
        return r.status_code


async def _settled(
    client: httpx.AsyncClient, metrics_url: str, in_flight: int, queued: int
) -> None:
    """Waits until the sidecar has ``in_flight`` requests at vLLM and ``queued`` in its queue."""
    deadline = time.monotonic() + 60
    while True:
        state = (await client.get(metrics_url + "/state")).json()
        if (state["in_flight"], state["queue_depth"]) == (in_flight, queued):
            return
        assert time.monotonic() < deadline, (in_flight, queued, state)
        await asyncio.sleep(0.02)
