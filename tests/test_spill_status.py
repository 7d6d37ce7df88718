"""``--spill-status``: the HTTP status of a ``spilled`` refusal (429, or 503 for a gateway that
retries a 503 but cannot retry a 429, such as HAProxy 2.6).

The real proxy in front of the fake vLLM: ``--spill-status 503`` answers a spilled request, at
arrival or handed back from the queue, with 503, Retry-After and the OpenAI error shape, and the
sidecar still counts it as ``spilled``; the default stays 429.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from harness.fake_vllm import FakeServer
from tests.support.openai_errors import openai_error, retry_after
from tests.support.stack import Stack, run_sidecar
from tests.support.wait import eventually

# --- the proxy: --spill-status 503 ------------------------------------------------------------

#: one streamed completion held open: a 1-token prompt to max_tokens 1000 is 8 blocks to its end
HELD = {"model": "tiny", "prompt": "hi", "max_tokens": 1000, "stream": True}


async def hold(stack: Stack, count: int) -> list[asyncio.StreamWriter]:
    """``count`` streamed completions sent straight to the sidecar and never read."""
    body = json.dumps(HELD).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: sidecar\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    writers = []
    for _ in range(count):
        _, writer = await asyncio.open_connection("127.0.0.1", stack.port)
        writer.write(head + body)
        writers.append(writer)
    await eventually(lambda: stack.sidecar.admission.in_flight == count, "streams admitted", 10)
    return writers


def assert_spilled_503(resp: httpx.Response) -> None:
    error = openai_error(resp, 503, "spilled")
    assert error["type"] == "service_unavailable_error"
    assert retry_after(resp) >= 1.0
    assert resp.headers.get("x-request-id")


@pytest.mark.parametrize("status", [429, 503])
async def test_spill_status_sets_the_status_of_a_spilled_refusal(
    upstream: FakeServer, status: int
) -> None:
    """Seven streams hold 56 of the budget's 59 blocks; an eighth waits longer than
    --spill-wait (or unboundedly), and is refused at once, with --spill-status's status."""
    upstream.app.token_delay = 1.0
    async with run_sidecar(
        upstream, policy="spill", spill_status=status, reservation="worst-case"
    ) as stack:
        writers = await hold(stack, 7)
        # the step time, as a scrape of a busy vLLM teaches it (the fake exports no histogram)
        stack.sidecar.admission.pools[0].view.seconds_per_step = 0.02
        resp = await stack.client.post("/v1/completions", json={**HELD, "stream": False})
        if status == 503:
            assert_spilled_503(resp)
        else:
            assert openai_error(resp, 429, "spilled")["type"] == "rate_limit_error"
            assert retry_after(resp) >= 1.0
        assert stack.decisions("reject", "spilled") == 1
        assert len(upstream.app.generations()) == 7  # the refused one never reached vLLM
        for writer in writers:
            writer.close()


async def test_a_request_handed_back_from_the_queue_gets_the_503(upstream: FakeServer) -> None:
    """Two requests queued while the step time is unknown (cold: spill queues); once it is
    known, the second's wait is over the bar and it is handed back with the 503 at the next
    try of the queue (a scrape), the first keeps its place as the next to be admitted."""
    upstream.app.token_delay = 1.0
    async with run_sidecar(
        upstream, policy="spill", spill_status=503, reservation="worst-case", max_queue_wait=60
    ) as stack:
        writers = await hold(stack, 7)
        admission = stack.sidecar.admission
        assert admission.pools[0].view.seconds_per_step is None
        body = {**HELD, "stream": False}
        first = asyncio.create_task(stack.client.post("/v1/completions", json=body))
        await eventually(lambda: admission.queue_depth == 1, "the first queued", 10)
        second = asyncio.create_task(stack.client.post("/v1/completions", json=body))
        await eventually(lambda: admission.queue_depth == 2, "the second queued", 10)
        admission.pools[0].view.seconds_per_step = 0.02
        resp = await asyncio.wait_for(second, 10)
        assert_spilled_503(resp)
        assert "handed back" in resp.json()["error"]["message"]
        assert stack.decisions("reject", "spilled") == 1
        assert admission.queue_depth == 1 and not first.done()
        assert len(upstream.app.generations()) == 7
        first.cancel()
        for writer in writers:
            writer.close()
