"""A real sidecar process's life: how it ends, and how it waits.

SIGTERM in front of the real vLLM, in the middle of a burst: every request in flight (and every
queued one that can still start) completes, new requests get 503 with Retry-After, readiness is
false from the signal on, and the process exits 0 in time. A model config that cannot be read
ends the process at once (one line, exit 2), while a vLLM that cannot be asked yet is waited for,
``/readyz`` saying why.

The burst is sized from the sidecar's budget: as many requests of 500 + 300 tokens as fit, and
``QUEUED`` more that must wait (on the session vLLM: 8 requests of 7 blocks in the 59-block
budget, 6 queued). It is sent, and the signal given, with vLLM's engine stopped
(``tests/support/stepped.frozen_engine``), so that at the signal exactly that many run and
that many wait, however fast the host decodes: sent to the free-running engine, a burst sized to
the whole budget ended before its last request arrived in a fresh-clone CI run (no queue to
signal into), and a budget for one request at a time (ce60133) still left the test to catch a
queue that lasts a few answers with two reads of the sidecar that took seconds on a busy host.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from harness.fake_vllm import FakeServer, write_model_dir
from harness.workload import SidecarProcess, make_prompts, one_completion
from tests.conftest import VllmInfo
from tests.support.faultkit import ToughFake
from tests.support.stepped import frozen_engine
from tests.support.wait import wait_for

QUEUED = 6  # requests beyond what the budget holds at once
PROMPT_TOKENS = 500
MAX_TOKENS = 300
DRAIN = 180  # two waves of 300 decode steps, with room for a slow shared machine
#: The sidecar says it is draining as soon as it handles the signal; generous for a loaded machine.
UNREADY_WITHIN = 10.0


@pytest.mark.vllm
async def test_sigterm_drains_and_exits_zero(vllm: VllmInfo) -> None:
    assert vllm.model_dir is not None, "set KV_SIDECAR_TEST_MODEL_DIR for an external vLLM"
    prompt_tokens = min(PROMPT_TOKENS, vllm.max_model_len // 2)
    max_tokens = min(MAX_TOKENS, vllm.max_model_len - prompt_tokens - 1)
    blocks_each = vllm.blocks_for(prompt_tokens + max_tokens)
    sc = SidecarProcess(
        vllm.url,
        "--policy",
        "queue",
        "--max-queue-wait",
        str(DRAIN),
        "--drain-timeout",
        str(DRAIN),
    ).start()
    try:
        running = sc.state()["budget_blocks"] // blocks_each
        assert running >= 1, sc.state()
        requests = running + QUEUED
        prompts = make_prompts(vllm.model_dir, requests, prompt_tokens, seed=11)
        async with httpx.AsyncClient(
            timeout=300, limits=httpx.Limits(max_connections=64)
        ) as client:
            with frozen_engine(vllm):
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
                while True:  # every request of the burst in: what fits in flight, the rest queued
                    state = (await client.get(sc.metrics_url + "/state")).json()
                    if (state["in_flight"], state["queue_depth"]) == (running, QUEUED):
                        break
                    assert not any(t.done() for t in burst), [t.result() for t in burst if t.done()]
                    assert time.monotonic() < deadline, (
                        f"the burst of {requests} not in within 120 s ({running} in flight, "
                        f"{QUEUED} queued): {state}"
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
                # the signal refused none of the burst: the queued wait to start, still held
                assert not any(t.done() for t in burst), [t.result() for t in burst if t.done()]

            results = await asyncio.gather(*burst)
        assert [r.status for r in results] == [200] * requests, [r.error for r in results]
        assert [r.completion_tokens for r in results] == [max_tokens] * requests
        code = await asyncio.to_thread(sc.proc.wait, DRAIN + 15)
        assert code == 0
        assert time.monotonic() - signalled < DRAIN + 10
        assert "drained" in sc.log()
    finally:
        sc.stop(signal.SIGKILL)


@pytest.mark.vllm
def test_a_garbled_model_config_ends_the_process_at_once(vllm: VllmInfo, tmp_path: Path) -> None:
    """Once vLLM answers, a --model-config that is not JSON cannot get better by waiting: the
    sidecar exits 2 with one line on stderr and no traceback, instead of sitting not ready."""
    garbled = tmp_path / "config.json"
    garbled.write_text('{"num_hidden_layers": 2,')
    sc = SidecarProcess(vllm.url, "--model-config", str(garbled), "--log-level", "error")
    sc.start(wait_ready=False)
    try:
        assert sc.proc is not None
        code = sc.proc.wait(timeout=60)
    finally:
        sc.stop(signal.SIGKILL)
    said = sc.log()
    assert code == 2, said
    assert "Traceback" not in said
    assert said.strip().splitlines() == [
        f"kv-sidecar serve: error: --model-config: model config {garbled} is not valid JSON: "
        "Expecting property name enclosed in double quotes at line 1"
    ]


def test_a_vllm_that_cannot_be_asked_yet_is_waited_for_and_readyz_says_why(
    tmp_path: Path,
) -> None:
    """vLLM guards /v1/models with --api-key and the sidecar was given none: its /metrics and
    /health answer, discovery gets 401. An answer from vLLM is not the sidecar's configuration
    (vLLM may be restarted with another key), so it is retried: the process keeps running, not
    ready, and /readyz's last_error says why (it said nothing before, the scrapes being fine);
    once vLLM lets it ask, it is ready."""
    app = ToughFake(model_root=write_model_dir(tmp_path / "tiny"), api_key="secret")
    with FakeServer(app) as fake:
        sc = SidecarProcess(fake.url, "--scrape-interval", "0.1", "--workers", "1")
        sc.start(wait_ready=False)
        try:

            def readyz() -> dict[str, object]:
                return dict(json.loads(httpx.get(sc.metrics_url + "/readyz", timeout=5).text))

            def says_why() -> bool:
                try:
                    return "401" in str(readyz()["last_error"])
                except httpx.HTTPError:
                    return False  # not listening yet

            wait_for(says_why, "/readyz's last_error names the 401", 30, 0.1)
            time.sleep(1.0)  # several more attempts
            assert sc.proc is not None and sc.proc.poll() is None, sc.log()
            state = readyz()
            assert state["ready"] is False and state["discovered"] is False, state
            assert state["vllm_up"] is True, state  # /metrics answers: discovery is the reason
            app.api_key = None
            sc.wait_ready(30)
            assert readyz()["last_error"] is None
            assert sc.stop(signal.SIGTERM) == 0
        finally:
            sc.stop(signal.SIGKILL)
