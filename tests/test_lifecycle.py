"""SIGTERM on a real sidecar process in front of the real vLLM, in the middle of a burst.

Every request in flight (and every queued one that can still start) completes, new requests get
503 with Retry-After, readiness is false from the signal on, and the process exits 0 in time.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from harness.workload import SidecarProcess, make_prompts, metric_value, one_completion
from tests.conftest import VllmInfo

pytestmark = pytest.mark.vllm

REQUESTS = 14  # 500 + 300 tokens = 7 blocks each: 8 fit in the 59-block budget, 6 queue
PROMPT_TOKENS = 500
MAX_TOKENS = 300
DRAIN = 180  # two waves of 300 decode steps, with room for a slow shared machine


async def test_sigterm_drains_and_exits_zero(vllm: VllmInfo) -> None:
    assert vllm.model_dir is not None
    prompts = make_prompts(vllm.model_dir, REQUESTS, PROMPT_TOKENS, seed=11)
    sc = SidecarProcess(
        vllm.url, "--policy", "queue", "--max-queue-wait", str(DRAIN), "--drain-timeout", str(DRAIN)
    ).start()
    try:
        async with httpx.AsyncClient(
            timeout=300, limits=httpx.Limits(max_connections=64)
        ) as client:
            burst = [
                asyncio.ensure_future(
                    one_completion(client, sc.url, p, max_tokens=MAX_TOKENS, stream=True)
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
                if admitted + state["queue_depth"] == REQUESTS and state["queue_depth"] > 0:
                    break  # every request of the burst is in: some running, some queued
                done = [t.result() for t in burst if t.done()]
                assert time.monotonic() < deadline, (state, done[:3])
                await asyncio.sleep(0.05)

            assert sc.proc is not None
            signalled = time.monotonic()
            sc.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            ready = await client.get(sc.metrics_url + "/readyz")
            assert ready.status_code == 503 and ready.json()["draining"] is True
            late = await one_completion(client, sc.url, prompts[0], max_tokens=10, stream=False)
            assert late.status == 503
            assert int(late.headers["retry-after"]) >= 1 and "retry-after-ms" in late.headers
            assert (await client.get(sc.metrics_url + "/healthz")).status_code == 200

            results = await asyncio.gather(*burst)
        assert [r.status for r in results] == [200] * REQUESTS, [r.error for r in results]
        assert [r.completion_tokens for r in results] == [MAX_TOKENS] * REQUESTS
        code = await asyncio.to_thread(sc.proc.wait, DRAIN + 15)
        assert code == 0
        assert time.monotonic() - signalled < DRAIN + 10
        assert "drained" in sc.log()
    finally:
        sc.stop(signal.SIGKILL)
