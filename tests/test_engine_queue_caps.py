"""vLLM's own queue caps as a second gate: a request the sidecar admitted and vLLM refused with
its queue-cap 503 gets the sidecar's backpressure (429 ``engine_queue_full`` with Retry-After),
its reservation released and the refusal counted; vLLM's ``vllm:admission_rejections_total`` is
relayed. Any other 503 is relayed as vLLM sent it.

The fake vLLM refuses as vLLM 0.32's source does (``max_num_queued_reqs``: the same status, body
and counter); the last test starts a real vLLM with ``--max-num-queued-reqs 1`` and holds its
engine (``frozen_engine``) while the one request vLLM took is unfinished, so that the race with
a fast host's decoding is gone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.fake_vllm import FakeServer, Refusal
from harness.vllm_cpu import VllmServer
from harness.workload import SidecarProcess, metric_value
from sidecar.admission.decisions import DECISION_LABELS, REFUSALS, Outcome, Reason
from sidecar.engine.queue_caps import ENGINE_QUEUE_FULL, QUEUE_FULL_BODY, queue_cap_reason
from tests.support.openai_errors import openai_error, retry_after
from tests.support.stack import Stack, run_sidecar
from tests.support.stepped import frozen_engine
from tests.support.wait import eventually

PROMPT = "the quick brown fox jumps over the lazy dog"
#: the refusal's series as /metrics writes it (the fake serves "tiny")
QUEUE_FULL_SERIES = (
    'kv_sidecar_requests_total{decision="reject",model_name="tiny",reason="engine_queue_full"}'
)


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, **extra}


def queue_full(stack: Stack) -> float:
    return stack.decisions("reject", "engine_queue_full")


def test_the_fakes_refusal_is_vllms() -> None:
    """The body the fake answers is the one vLLM's source builds, and the sidecar tells it."""
    from harness.fake_vllm import QUEUE_FULL_ERROR

    assert json.loads(QUEUE_FULL_ERROR) == json.loads(QUEUE_FULL_BODY)
    assert queue_cap_reason(503, QUEUE_FULL_ERROR) == "max_num_queued_reqs"
    assert queue_cap_reason(429, QUEUE_FULL_ERROR) is None
    assert queue_cap_reason(503, b"not json") is None
    # a reason of the decisions table, answered from it as every refusal is
    assert Reason(ENGINE_QUEUE_FULL) is Reason.ENGINE_QUEUE_FULL
    assert REFUSALS[Reason.ENGINE_QUEUE_FULL] == (429, "rate_limit_error", ENGINE_QUEUE_FULL)
    assert (Outcome.REJECT, Reason.ENGINE_QUEUE_FULL) in DECISION_LABELS


@pytest.mark.parametrize("stream", [False, True])
async def test_vllms_queue_cap_becomes_the_sidecars_429(upstream: FakeServer, stream: bool) -> None:
    fake = upstream.app
    fake.max_num_queued_reqs = 1
    fake.token_delay = 0.02  # the first request holds vLLM's one slot for about 0.6 s
    async with run_sidecar(upstream) as stack:
        first = asyncio.ensure_future(
            stack.client.post("/v1/completions", json=completion(max_tokens=30))
        )
        await eventually(lambda: fake.in_flight == 1, "the first request running in vLLM", 5)
        resp = await stack.client.post("/v1/completions", json=completion(stream=stream))
        error = openai_error(resp, 429, "engine_queue_full")
        assert error["type"] == "rate_limit_error"
        assert "--max-num-queued-reqs" in error["message"]
        assert retry_after(resp) == 1.0
        # the refused request's reservation is released at once; the first one still runs
        state = await stack.state()
        assert state["in_flight"] == 1, state
        assert queue_full(stack) == 1
        assert stack.decisions("admit", "fits") == 2  # the gate admitted both
        assert stack.sample("kv_sidecar_upstream_errors_total", kind="status_5xx") == 0
        assert stack.sample("kv_sidecar_retry_after_seconds_count") == 1
        assert (await first).status_code == 200
        await eventually(stack.ledger_empty, "every reservation released", 5)
        # vLLM's own counter, relayed from its /metrics
        await eventually(
            lambda: (
                stack.sample(
                    "kv_sidecar_vllm_admission_rejections_total", reason="max_num_queued_reqs"
                )
                == 1
            ),
            "vLLM's admission_rejections_total relayed",
            5,
        )
        text = (await stack.ops.get("/metrics")).text
        assert f"{QUEUE_FULL_SERIES} 1.0" in text
        rejections = 'kv_sidecar_vllm_admission_rejections_total{model_name="tiny",'
        assert f'{rejections}reason="max_num_queued_tokens"}} 0.0' in text


async def test_other_503s_are_relayed_as_vllm_sent_them(upstream: FakeServer) -> None:
    other = json.dumps(
        {
            "error": {
                "message": "Request failed; please retry",
                "type": "ServiceUnavailableError",
                "param": None,
                "code": 503,
            }
        }
    ).encode()
    upstream.app.plan_generation = lambda path, raw: Refusal(503, other)  # type: ignore[method-assign]
    async with run_sidecar(upstream) as stack:
        resp = await stack.client.post("/v1/completions", json=completion())
        assert resp.status_code == 503 and resp.content == other
        assert "retry-after" not in resp.headers
        assert queue_full(stack) == 0
        assert stack.sample("kv_sidecar_upstream_errors_total", kind="status_5xx") == 1
        assert stack.ledger_empty()


async def test_an_engine_refusal_is_counted_once_at_zero_before(upstream: FakeServer) -> None:
    async with run_sidecar(upstream) as stack:
        text = (await stack.ops.get("/metrics")).text
        assert f"{QUEUE_FULL_SERIES} 0.0" in text
        resp = await stack.client.post("/v1/completions", json=completion())
        assert resp.status_code == 200 and queue_full(stack) == 0


def test_relay_workers_carry_the_refusal_to_the_owner(upstream: FakeServer) -> None:
    """With --workers 2 the refusal happens in a worker and is counted on the owner's registry."""
    fake = upstream.app
    fake.max_num_queued_reqs = 0  # every generation refused
    sidecar = SidecarProcess(upstream.url, "--workers", "2", "--scrape-interval", "0.1")
    with sidecar.start(timeout=120), httpx.Client(timeout=30) as client:
        for _ in range(4):
            resp = client.post(sidecar.url + "/v1/completions", json=completion())
            openai_error(resp, 429, "engine_queue_full")
        deadline = time.monotonic() + 10
        while True:
            text = sidecar.metrics()
            refused = metric_value(
                text, "kv_sidecar_requests_total", decision="reject", reason="engine_queue_full"
            )
            if refused == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert refused == 4, text
        assert metric_value(text, "kv_sidecar_upstream_errors_total", kind="status_5xx") == 0
        assert sidecar.state()["in_flight"] == 0
        # Reason.ENGINE_QUEUE_FULL on the wire: each request counted once by its worker (at its
        # admission, not again at its refusal), each refusal's Retry-After observed
        served = sum(
            metric_value(text, "kv_sidecar_relay_worker_requests_total", worker=w) or 0
            for w in ("0", "1")
        )
        assert served == 4, text
        assert metric_value(text, "kv_sidecar_retry_after_seconds_count") == 4, text
    # started once (``with`` on a started process does not start another) and stopped: nothing
    # answers on its port any more
    with pytest.raises(httpx.ConnectError):
        httpx.get(sidecar.metrics_url + "/healthz", timeout=5)


# --- a real vLLM with --max-num-queued-reqs 1 ------------------------------------------------


@pytest.fixture(scope="module")
def capped_vllm() -> Iterator[VllmServer]:
    server = VllmServer(num_gpu_blocks=64, extra_args=["--max-num-queued-reqs", "1"])
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.vllm
def test_a_real_vllms_queue_cap_becomes_the_sidecars_429(capped_vllm: VllmServer) -> None:
    url = capped_vllm.url
    body = {
        "model": capped_vllm.served_name,
        "prompt": PROMPT,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with SidecarProcess(url) as sidecar, httpx.Client(timeout=120) as client:
        # one long stream, straight to vLLM, takes its one slot
        with client.stream("POST", url + "/v1/completions", json=body) as holder:
            assert holder.status_code == 200
            lines = holder.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it runs
            # and stays unfinished, however fast the host decodes: vLLM's API server counts it
            # against the cap and answers the others itself
            with frozen_engine(capped_vllm):
                # vLLM's own answer to a second request, as its source builds it
                direct = client.post(url + "/v1/completions", json={**body, "max_tokens": 4})
                assert direct.status_code == 503, direct.text
                assert queue_cap_reason(503, direct.content) == "max_num_queued_reqs", direct.text
                assert "retry-after" not in direct.headers
                # the same request through the sidecar: its own 429, both streamed and not
                for stream in (False, True):
                    resp = client.post(
                        sidecar.url + "/v1/completions",
                        json={**body, "max_tokens": 4, "stream": stream},
                    )
                    openai_error(resp, 429, "engine_queue_full")
                    assert retry_after(resp) == 1.0
            for _ in lines:
                pass
        deadline = time.monotonic() + 10
        while True:
            text = sidecar.metrics()
            rejected = metric_value(
                text, "kv_sidecar_vllm_admission_rejections_total", reason="max_num_queued_reqs"
            )
            if rejected == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert rejected == 3, text
        assert (
            metric_value(
                text, "kv_sidecar_requests_total", decision="reject", reason="engine_queue_full"
            )
            == 2
        )
        state = sidecar.state()
        assert state["in_flight"] == 0 and state["reserved_blocks"] == 0, state
        # vLLM's slot is free again: the sidecar admits and vLLM answers
        ok = client.post(
            sidecar.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}
        )
        assert ok.status_code == 200, ok.text
