"""SIGTERM on a real sidecar process in front of the real vLLM, in the middle of a burst.

Every request in flight (and every queued one that can still start) completes, new requests get
503 with Retry-After, readiness is false from the signal on, and the process exits 0 in time.

The burst is sized from the sidecar's budget: as many requests of 500 + 300 tokens as fit, and
``QUEUED`` more that must wait (on the session vLLM: 8 of 7 blocks in the 59-block budget, 6
queued).
"""

from __future__ import annotations

import asyncio
import math
import signal
import time

import httpx
import pytest

from harness.workload import SidecarProcess, make_prompts, metric_value, one_completion
from tests.conftest import VllmInfo
from tests.faultkit import wait_for

pytestmark = pytest.mark.vllm

QUEUED = 6  # requests beyond what the budget holds at once
PROMPT_TOKENS = 500
MAX_TOKENS = 300
DRAIN = 180  # two waves of 300 decode steps, with room for a slow shared machine
#: The sidecar says it is draining as soon as it handles the signal; generous for a loaded machine.
UNREADY_WITHIN = 10.0


async def test_sigterm_drains_and_exits_zero(vllm: VllmInfo) -> None:
    assert vllm.model_dir is not None, "set KV_SIDECAR_TEST_MODEL_DIR for an external vLLM"
    sc = SidecarProcess(
        vllm.url, "--policy", "queue", "--max-queue-wait", str(DRAIN), "--drain-timeout", str(DRAIN)
    ).start()
    try:
        budget = sc.state()["budget_blocks"]
        assert budget, f"the sidecar reports no KV budget: {sc.state()}"
        prompt_tokens = min(PROMPT_TOKENS, vllm.max_model_len // 2)
        max_tokens = min(MAX_TOKENS, vllm.max_model_len - prompt_tokens - 1)
        blocks_each = vllm.blocks_for(prompt_tokens + max_tokens)
        requests = math.floor(budget / blocks_each) + QUEUED
        prompts = make_prompts(vllm.model_dir, requests, prompt_tokens, seed=11)
        async with httpx.AsyncClient(
            timeout=300, limits=httpx.Limits(max_connections=64)
        ) as client:
            burst = [
                asyncio.ensure_future(
                    one_completion(
                        client,
                        sc.url,
                        p,
                        max_tokens=max_tokens,
                        stream=True,
                        model=vllm.served_name,
                    )
                )
                for p in prompts
            ]
            deadline = time.monotonic() + 120
            while True:  # wait until the burst is in: some in flight, some queued
                state = (await client.get(sc.metrics_url + "/state")).json()
                admitted = (
                    metric_value(
                        (await client.get(sc.metrics_url + "/metrics")).text,
                        "kv_sidecar_requests_total",
                        decision="admit",
                    )
                    or 0
                )
                if admitted + state["queue_depth"] == requests and state["queue_depth"] > 0:
                    break  # every request of the burst is in: some running, some queued
                done = [t.result() for t in burst if t.done()]
                assert time.monotonic() < deadline, (
                    f"the burst of {requests} not all in (admitted {admitted}, some queued) "
                    f"within 120 s: {state}, finished early: {done[:3]}"
                )
                await asyncio.sleep(0.05)

            assert sc.proc is not None
            signalled = time.monotonic()
            sc.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(
                wait_for,
                lambda: httpx.get(sc.metrics_url + "/readyz", timeout=10).status_code == 503,
                "/readyz 503 after SIGTERM",
                UNREADY_WITHIN,
                0.05,
            )
            ready = await client.get(sc.metrics_url + "/readyz")
            assert ready.status_code == 503 and ready.json()["draining"] is True, ready.text
            late = await one_completion(
                client, sc.url, prompts[0], max_tokens=10, stream=False, model=vllm.served_name
            )
            assert late.status == 503
            assert int(late.headers["retry-after"]) >= 1 and "retry-after-ms" in late.headers
            assert (await client.get(sc.metrics_url + "/healthz")).status_code == 200

            results = await asyncio.gather(*burst)
        assert [r.status for r in results] == [200] * requests, [r.error for r in results]
        assert [r.completion_tokens for r in results] == [max_tokens] * requests
        code = await asyncio.to_thread(sc.proc.wait, DRAIN + 15)
        assert code == 0
        assert time.monotonic() - signalled < DRAIN + 10
        assert "drained" in sc.log()
    finally:
        sc.stop(signal.SIGKILL)
