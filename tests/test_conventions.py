"""The ecosystem's conventions on the proxy port, against the fake vLLM (``harness/fake_vllm.py``):
every answer the sidecar makes carries ``X-Request-Id`` (the client's, else one it made, the one
vLLM got), and on Anthropic's ``/v1/messages`` the sidecar's refusals and errors are Anthropic's
error shape with the same status and Retry-After, while the OpenAI endpoints keep OpenAI's."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from harness.fake_vllm import FakeServer
from sidecar.http import refusals
from tests.support.openai_errors import openai_error, retry_after
from tests.support.relaying import relay_into
from tests.support.stack import run_sidecar
from tests.support.wait import eventually

PROMPT = "the quick brown fox jumps over the lazy dog"
HEX_ID = re.compile(r"[0-9a-f]{32}")
ANTHROPIC_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
}


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 16,
        **extra,
    }


def anthropic_error(resp: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    """Assert an Anthropic-shaped error answer; return its ``error`` object."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"type", "error", "request_id"}, body
    assert body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == type_ and type_ in ANTHROPIC_TYPES
    assert body["request_id"] == resp.headers["x-request-id"]
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return dict(body["error"])


async def test_refusals_echo_the_clients_request_id_or_carry_a_made_one(
    upstream: FakeServer,
) -> None:
    upstream.app.kv_cache_usage = 0.99  # the budget is taken: every request is refused
    async with run_sidecar(upstream, policy="reject") as stack:
        mine = {"x-request-id": "client-id-1"}
        resp = await stack.client.post("/v1/chat/completions", json=chat(), headers=mine)
        openai_error(resp, 429, "kv_cache_full")
        assert resp.headers["x-request-id"] == "client-id-1"
        resp = await stack.client.post("/v1/chat/completions", json=chat())
        openai_error(resp, 429, "kv_cache_full")
        assert HEX_ID.fullmatch(resp.headers["x-request-id"])
        bad = await stack.client.post("/v1/completions", content=b"{bad", headers=mine)
        openai_error(bad, 400, "invalid_json")
        assert bad.headers["x-request-id"] == "client-id-1"
        # refused before anything is read: the proxy's own 431
        crowded = {f"x-h{k}": "v" for k in range(120)}
        resp = await stack.client.post("/v1/completions", json=chat(), headers=crowded)
        openai_error(resp, 431, "request_header_fields_too_large")
        assert HEX_ID.fullmatch(resp.headers["x-request-id"])
        assert stack.fake.generations() == []


async def test_relayed_answers_carry_the_id_vllm_got(upstream: FakeServer) -> None:
    async with run_sidecar(upstream) as stack:
        resp = await stack.client.post("/v1/chat/completions", json=chat())
        assert resp.status_code == 200
        made = resp.headers["x-request-id"]
        assert HEX_ID.fullmatch(made)
        resp = await stack.client.post(
            "/v1/chat/completions", json=chat(stream=True), headers={"x-request-id": "abc"}
        )
        assert resp.status_code == 200 and resp.headers.get_list("x-request-id") == ["abc"]
        sent = [r.header("x-request-id") for r in stack.fake.generations()]
        assert sent == [made, "abc"]


async def test_upstream_down_answers_carry_the_id_and_the_shape_of_their_path(
    upstream: FakeServer,
) -> None:
    async with run_sidecar(upstream) as stack:
        await asyncio.to_thread(stack.upstream.stop)
        mine = {"x-request-id": "down-1"}
        resp = await stack.client.get("/v1/models", headers=mine)  # pass-through
        openai_error(resp, 503, "upstream_unavailable")
        assert resp.headers["x-request-id"] == "down-1"
        resp = await stack.client.post("/v1/messages/count_tokens", json=chat(), headers=mine)
        error = anthropic_error(resp, 503, "overloaded_error")
        assert error["message"].startswith("upstream_unavailable: ")
        retry_after(resp)
        resp = await stack.client.post("/v1/messages", json=chat(), headers=mine)
        error = anthropic_error(resp, 503, "overloaded_error")
        assert resp.json()["request_id"] == "down-1"
        retry_after(resp)
        await asyncio.to_thread(stack.upstream.start)


async def test_messages_refusals_are_anthropic_shaped(upstream: FakeServer) -> None:
    upstream.app.kv_cache_usage = 0.99
    async with run_sidecar(upstream, policy="reject") as stack:
        resp = await stack.client.post("/v1/messages", json=chat())
        error = anthropic_error(resp, 429, "rate_limit_error")
        assert error["message"].startswith("kv_cache_full: ")
        retry_after(resp)
        assert HEX_ID.fullmatch(resp.headers["x-request-id"])
        bad = await stack.client.post(
            "/v1/messages", content=b"{bad", headers={"content-type": "application/json"}
        )
        error = anthropic_error(bad, 400, "invalid_request_error")
        assert error["message"].startswith("invalid_json: ")
        too_long = await stack.client.post("/v1/messages", json=chat(max_tokens=100_000))
        assert too_long.status_code == 400
        anthropic_error(too_long, 400, "invalid_request_error")
        # the OpenAI endpoints keep OpenAI's shape for the same refusal
        resp = await stack.client.post("/v1/chat/completions", json=chat())
        openai_error(resp, 429, "kv_cache_full")
        assert stack.decisions("reject", "kv_cache_full") == 2
        assert stack.fake.generations() == []


async def test_messages_not_ready_and_too_large_are_anthropic_shaped(upstream: FakeServer) -> None:
    upstream.app.metrics_mode = "no_cache_config"  # vLLM still starting: nothing discovered
    async with run_sidecar(upstream, discovered=False) as stack:
        resp = await stack.client.post("/v1/messages", json=chat())
        anthropic_error(resp, 503, "overloaded_error")
        retry_after(resp)
        stack.fake.metrics_mode = "ok"
        await eventually(lambda: stack.sidecar.discovered, "discovered", within=5)
        stack.fake.num_gpu_blocks = 8  # 7 usable blocks: one answer of 1,000 tokens needs 8
        await eventually(lambda: stack.sidecar.admission.capacity_blocks == 7, "rescraped", 5)
        resp = await stack.client.post("/v1/messages", json=chat(max_tokens=1000))
        assert resp.status_code in (400, 413), resp.text
        anthropic_error(resp, resp.status_code, ANTHROPIC_STATUS[resp.status_code])


ANTHROPIC_STATUS = {400: "invalid_request_error", 413: "request_too_large"}


def test_vllms_queue_cap_on_messages_is_an_anthropic_429() -> None:
    """The generation path answers vLLM's queue-cap 503 with this 429, through the one place
    that shapes every answer for /v1/messages (the fake serves no /v1/messages)."""
    status, headers, body = refusals.anthropic_shaped(
        refusals.engine_queue_full("max_num_queued_reqs"), b"q-1"
    )
    resp = httpx.Response(status, headers=[*headers, (b"x-request-id", b"q-1")], content=body)
    error = anthropic_error(resp, 429, "rate_limit_error")
    assert error["message"].startswith("engine_queue_full: ")
    assert "--max-num-queued-reqs" in error["message"]
    assert retry_after(resp) == 1.0


async def test_vllms_queue_cap_refusal_carries_the_id_vllm_got(upstream: FakeServer) -> None:
    upstream.app.max_num_queued_reqs = 0  # vLLM refuses every generation with its queue-cap 503
    async with run_sidecar(upstream) as stack:
        resp = await stack.client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        openai_error(resp, 429, "engine_queue_full")
        assert resp.headers["x-request-id"] == stack.fake.generations()[-1].header("x-request-id")


class _Broken(httpx.AsyncByteStream):
    """An SSE answer that breaks off after its first event."""

    async def __aiter__(self) -> Any:
        yield b"event: message_start\ndata: {}\n\n"
        raise httpx.ReadError("reset")


@pytest.mark.parametrize("anthropic", [True, False])
async def test_a_broken_stream_ends_with_the_error_event_of_its_api(anthropic: bool) -> None:
    from sidecar.errors import UpstreamError

    sent: list[dict[str, Any]] = []
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Broken())
    with pytest.raises(UpstreamError):
        await relay_into(sent, response, request_id=b"s-1", anthropic=anthropic)
    assert (b"x-request-id", b"s-1") in sent[0]["headers"]
    last = sent[-2]["body"]
    if anthropic:
        assert last.startswith(b"event: error\ndata: ")
        body = json.loads(last.split(b"data: ", 1)[1])
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
    else:
        body = json.loads(last.removeprefix(b"data: "))
        assert body["error"]["code"] == "upstream_failed"


async def test_api_pages_are_off_on_both_ports_by_default(upstream: FakeServer) -> None:
    async with run_sidecar(upstream) as stack:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await stack.ops.get(path)).status_code == 404, path
        for path in ("/docs", "/redoc"):
            resp = await stack.client.get(path, headers={"x-request-id": "d-1"})
            error = openai_error(resp, 404, "not_found")
            assert "--docs" in error["message"] and resp.headers["x-request-id"] == "d-1"
        assert (await stack.ops.get("/state")).status_code == 200  # the rest is served
        seen = [r.path for r in stack.fake.requests if r.path in ("/docs", "/redoc")]
        assert seen == []  # refused here, never asked of vLLM


async def test_docs_serves_the_pages(upstream: FakeServer) -> None:
    async with run_sidecar(upstream, docs=True) as stack:
        page = await stack.ops.get("/docs")
        assert page.status_code == 200 and "swagger" in page.text.lower()
        spec = (await stack.ops.get("/openapi.json")).json()
        assert "/state" in spec["paths"] and "/readyz" in spec["paths"]
        assert (await stack.ops.get("/redoc")).status_code == 404  # only Swagger UI
        await stack.client.get("/docs")  # relayed to vLLM, whatever it answers
        assert [r.path for r in stack.fake.requests if r.path == "/docs"] == ["/docs"]
