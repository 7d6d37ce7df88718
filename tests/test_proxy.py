"""The proxy port against a fake vLLM that speaks vLLM 0.32's formats (``harness/fake_vllm.py``).

Each test runs the real sidecar: ``Sidecar`` with its proxy and ops apps served by
uvicorn on loopback ports, configured as ``serve()`` configures them, in the test's event loop;
the fake runs in a thread, so a test can stop it, slow it or change what its /metrics reports
under a running sidecar. A few tests at the end run ``kv-sidecar serve`` as a real process.

The fake has no tokenizer files in its model directory, so the sidecar counts prompts with the
fake's ``/tokenize`` (method ``exact_upstream``). What is claimed here about vLLM itself is also
checked against a real vLLM in ``test_proxy_vllm.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.fake_vllm import (
    GZIP_BODY,
    FakeServer,
    FakeVllm,
    count_prompt,
    write_model_dir,
)
from harness.workload import SidecarProcess
from sidecar.http.types import Message
from tests.support.fake_upstream import serve_fresh
from tests.support.openai_errors import openai_error, retry_after
from tests.support.stack import Stack, run_sidecar
from tests.support.wait import eventually

PROMPT = "the quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": PROMPT}]


# --- the stack (tests/support/stack.py) -------------------------------------------------------

# The fake's servers live for the module (starting one costs a tenth of a second); each test
# gets a fresh fake app on them, so no knob, log or counter outlives its test. The upstream is
# the shared one (``model_dir``, ``server``, ``upstream`` in tests/support/fake_upstream.py).


@pytest.fixture(scope="module")
def evil_server() -> Iterator[FakeServer]:
    with FakeServer(FakeVllm(model_root=None)) as server:
        yield server


@pytest.fixture
def evil(evil_server: FakeServer) -> FakeServer:
    """Another host on loopback: nothing sent to the proxy may ever reach it."""
    return serve_fresh(evil_server, FakeVllm(model_root=None))


@pytest.fixture
async def stack(upstream: FakeServer) -> AsyncIterator[Stack]:
    async with run_sidecar(upstream) as s:
        yield s


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT, "max_tokens": 16, **extra}


async def raw_http(port: int, request: bytes) -> tuple[int, bytes]:
    """Write ``request`` as is on a socket to ``port``; the status and the whole answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, answer


# --- pass-through -------------------------------------------------------------------------


async def test_every_method_path_query_body_and_header_passes_unchanged(stack: Stack) -> None:
    target = "/echo/Some/Path%20with%2Fescapes/x.json?b=2&a=1&a=%20x&flag&e=%C3%A9"
    for method in ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"):
        body = b"" if method in ("GET", "HEAD") else f'{{"method": "{method}"}}'.encode()
        headers = {
            "Authorization": "Bearer sk-secret",
            "X-Request-Id": f"req-{method}",
            "Accept": "application/json",
            "User-Agent": "test-client/1.0",
            "Host": "client-chosen.example",
        }
        if body:
            headers["Content-Type"] = "application/json"
        resp = await stack.client.request(method, target, content=body, headers=headers)
        assert resp.status_code == 200, (method, resp.text)
        rec = stack.fake.non_probe_requests()[-1]
        sent = resp.request
        assert rec.method == method
        assert rec.raw_path + b"?" + rec.query == sent.url.raw_path, method
        assert rec.body == body, method
        for name in ("authorization", "x-request-id", "accept", "user-agent", "content-type"):
            assert rec.header(name) == sent.headers.get(name), (method, name)
        # the upstream is addressed as itself, whatever Host the client named
        assert rec.header("host") == f"127.0.0.1:{stack.upstream.port}"
        if method == "HEAD":
            assert resp.content == b""
            assert int(resp.headers["content-length"]) > 0
        else:
            echo = resp.json()
            assert echo["method"] == method and echo["body"] == body.decode()
    assert stack.fake.generations() == []
    assert stack.decisions("admit", "fits") == 0  # pass-through is not admission's business


async def test_hop_by_hop_request_headers_are_not_forwarded(stack: Stack) -> None:
    headers = [
        ("Connection", "keep-alive, X-Named-Hop"),
        ("X-Named-Hop", "must not pass"),
        ("Keep-Alive", "timeout=5"),
        ("TE", "trailers"),
        ("Trailer", "X-Checksum"),
        ("Upgrade", "websocket-not-really"),
        ("Proxy-Authorization", "Basic cHJveHk6c2VjcmV0"),
        ("Proxy-Connection", "keep-alive"),
        ("Authorization", "Bearer end-to-end"),
        ("X-End-To-End", "passes"),
    ]
    resp = await stack.client.post("/echo/hop", content=b"x", headers=headers)
    assert resp.status_code == 200
    rec = stack.fake.requests_to("/echo/hop")[-1]
    for name in ("x-named-hop", "keep-alive", "te", "trailer", "upgrade"):
        assert rec.header(name) is None, name
    assert rec.header("proxy-authorization") is None
    assert rec.header("proxy-connection") is None
    assert "x-named-hop" not in (rec.header("connection") or "").lower()
    assert rec.header("authorization") == "Bearer end-to-end"
    assert rec.header("x-end-to-end") == "passes"


async def test_status_and_end_to_end_response_headers_come_back(stack: Stack) -> None:
    for status in (200, 201, 204, 301, 404, 418, 500):
        resp = await stack.client.get(f"/status/{status}?q=1")
        assert resp.status_code == status
        assert resp.headers["x-end-to-end"] == "kept", status
        assert resp.headers.get_list("set-cookie") == ["a=1", "b=2"], status
        for name in ("x-custom", "keep-alive", "proxy-authenticate", "trailer", "upgrade"):
            assert name not in resp.headers, (status, name)
        assert "x-custom" not in resp.headers.get("connection", ""), status
        if status == 204:
            assert resp.content == b""
        else:
            assert resp.content == f"status {status}\n".encode(), status
        if status == 301:  # relayed, not followed
            assert resp.headers["location"] == "http://elsewhere.invalid/moved"
    assert len(stack.fake.requests_to("/status/301")) == 1
    assert len(stack.fake.non_probe_requests()) == 7


async def test_gzip_body_passes_byte_for_byte(stack: Stack) -> None:
    async with stack.client.stream("GET", "/gzip", headers={"Accept-Encoding": "gzip"}) as resp:
        raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    assert resp.status_code == 200
    assert raw == GZIP_BODY
    assert resp.headers["content-encoding"] == "gzip"
    assert resp.headers["content-length"] == str(len(GZIP_BODY))
    assert resp.headers["vary"] == "Accept-Encoding"


async def test_metrics_on_the_proxy_port_are_vllms(stack: Stack) -> None:
    stack.fake.kv_cache_usage = 0.125
    proxied = await stack.client.get("/metrics")
    assert proxied.status_code == 200
    assert proxied.text == stack.fake.metrics_text()
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.125' in proxied.text
    assert "kv_sidecar_" not in proxied.text
    own = await stack.ops.get("/metrics")
    assert 'kv_sidecar_queue_depth{model_name="tiny"} 0.0' in own.text
    assert 'kv_sidecar_vllm_up{model_name="tiny"} 1.0' in own.text
    # of vLLM's names, only the cache config the endpoint picker reads is served there
    served = {line.split("{")[0] for line in own.text.splitlines() if line.startswith("vllm:")}
    assert served == {"vllm:cache_config_info"}


async def test_streamed_body_arrives_chunk_by_chunk(stack: Stack) -> None:
    t0 = time.monotonic()
    arrivals: list[float] = []
    async with stack.client.stream("GET", "/slow?chunks=5&delay=0.2&size=512") as resp:
        async for chunk in resp.aiter_raw():
            if chunk:
                arrivals.append(time.monotonic() - t0)
    assert arrivals[-1] >= 0.75  # the upstream took 4 x 0.2 s
    # the first chunk came while the upstream still had at least two to send
    assert arrivals[0] < arrivals[-1] - 0.35, arrivals
    assert len(arrivals) >= 4, arrivals


async def test_large_chunked_upload_streams_through(stack: Stack) -> None:
    chunk = bytes(range(256)) * 4096  # 1 MiB
    parts = 8
    last_sent_at = 0.0

    async def body() -> AsyncIterator[bytes]:
        nonlocal last_sent_at
        for i in range(parts):
            if i:
                await asyncio.sleep(0.05)
            last_sent_at = time.monotonic()
            yield chunk

    resp = await stack.client.put("/echo/upload", content=body())
    assert resp.status_code == 200
    echo = resp.json()
    assert echo["body_len"] == parts * len(chunk)
    assert echo["body_sha256"] == hashlib.sha256(chunk * parts).hexdigest()
    rec = stack.fake.requests_to("/echo/upload")[-1]
    assert rec.header("transfer-encoding") == "chunked"
    # the upstream had the first bytes while the client was still sending: no buffering
    assert stack.fake.first_body_chunk_at is not None
    assert stack.fake.first_body_chunk_at < last_sent_at


async def test_pass_through_disconnect_cancels_the_upstream_stream(stack: Stack) -> None:
    async with stack.client.stream("GET", "/slow?chunks=200&delay=0.05") as resp:
        async for chunk in resp.aiter_raw():
            if chunk:
                break
    await eventually(lambda: stack.fake.aborted == 1, "the upstream saw the disconnect")
    assert stack.fake.in_flight == 0


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
async def test_client_leaving_mid_upload_aborts_the_upstream_request(
    stack: Stack, framing: str
) -> None:
    length = (
        (b"transfer-encoding", b"chunked") if framing == "chunked" else (b"content-length", b"100")
    )
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/echo/upload",
        "raw_path": b"/echo/upload",
        "query_string": b"",
        "headers": [(b"host", b"x"), length],
    }
    messages = [{"type": "http.request", "body": b"hello", "more_body": True}]

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await eventually(lambda: stack.fake.first_body_chunk_at is not None, "upload started")
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        pass

    await stack.sidecar.proxy(scope, receive, send)  # must not raise
    await eventually(lambda: stack.fake.requests_to("/echo/upload") != [], "vLLM got it")
    assert stack.fake.requests_to("/echo/upload")[0].complete is False


# --- generation ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_generation_passes_through_byte_for_byte(
    stack: Stack, path: str, stream: bool
) -> None:
    body = chat() if path.endswith("chat/completions") else completion()
    if stream:  # every event's count asked for already: nothing for the sidecar to add
        body |= {"stream": True, "stream_options": ASKED["every-event"]}
    raw = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-x"}
    direct = await stack.direct.post(path, content=raw, headers=headers)
    proxied = await stack.client.post(path, content=raw, headers=headers)
    assert proxied.status_code == direct.status_code == 200
    assert proxied.content == direct.content
    assert proxied.headers["content-type"] == direct.headers["content-type"]
    if stream:
        assert proxied.text.endswith("data: [DONE]\n\n")

    sent = stack.fake.requests_to(path)
    assert len(sent) == 2  # direct and proxied
    assert sent[-1].body == raw
    assert sent[-1].header("authorization") == "Bearer sk-x"
    await eventually(stack.ledger_empty, "the reservation was released")
    state = await stack.state()
    assert state["reserved_blocks"] == 0 and state["in_flight"] == 0
    assert state["queue_depth"] == 0

    assert stack.decisions("admit", "fits") == 1
    prompt_tokens = count_prompt(body)
    assert stack.sample("kv_sidecar_prompt_counts_total", method="exact_upstream") == 1
    assert stack.sample("kv_sidecar_prompt_tokens_total", method="exact_upstream") == (
        prompt_tokens
    )
    tokenized = stack.fake.requests_to("/tokenize")[-1].json()
    assert tokenized["model"] == "tiny"
    assert count_prompt(tokenized) == prompt_tokens
    assert stack.sample("kv_sidecar_completion_tokens_total") == 16


def _without_ids(answer: bytes) -> bytes:
    """An answer with its id blanked: the fake derives it from the body it got."""
    return re.sub(rb'"id":"[^"]*"', b'"id":""', answer)


ASKED = {
    "every-event": {"include_usage": True, "continuous_usage_stats": True},
    "final": {"include_usage": True},
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("mode", "reservation"),
    [("auto", "adaptive"), ("auto", "worst-case"), ("every-event", "adaptive"), ("final", None)],
)
async def test_a_stream_that_asked_no_usage_is_counted_by_vllms_count_and_relayed_as_asked(
    upstream: FakeServer, path: str, mode: str, reservation: str | None
) -> None:
    """``--stream-usage``: the sidecar asks vLLM for the usage of a stream whose client asked
    for none (every event's in worst-case mode, the final count in the others, by default), and
    the client gets what it asked for."""
    settings: dict[str, Any] = {"stream_usage": mode}
    if reservation is not None:
        settings["reservation"] = reservation
    asked = "every-event" if mode == "every-event" or reservation == "worst-case" else "final"
    async with run_sidecar(upstream, **settings) as stack:
        body = (chat if path.endswith("chat/completions") else completion)(stream=True)
        raw = json.dumps(body).encode()
        direct = await stack.direct.post(path, content=raw)
        proxied = await stack.client.post(path, content=raw)
        assert proxied.status_code == direct.status_code == 200
        assert b'"usage"' not in direct.content and b"system_fingerprint" in direct.content
        assert _without_ids(proxied.content) == _without_ids(direct.content)
        sent = stack.fake.requests_to(path)[-1].json()
        assert sent.pop("stream_options") == ASKED[asked]
        assert sent == body
        await eventually(stack.ledger_empty, "the reservation was released")
        assert stack.sample("kv_sidecar_completion_tokens_total") == 16


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stream_that_asked_for_the_final_count_is_asked_for_every_events_in_worst_case(
    upstream: FakeServer, path: str
) -> None:
    """Worst-case mode (``auto``: ``every-event``): a client that asked for ``include_usage``
    alone gets its stream as it asked, its usage-only event included, while the sidecar reads
    vLLM's count on every event."""
    async with run_sidecar(upstream, reservation="worst-case") as stack:
        options = {"include_usage": True}
        body = (chat if path.endswith("chat/completions") else completion)(
            stream=True, stream_options=options
        )
        raw = json.dumps(body).encode()
        direct = await stack.direct.post(path, content=raw)
        proxied = await stack.client.post(path, content=raw)
        assert proxied.status_code == direct.status_code == 200
        assert _without_ids(proxied.content) == _without_ids(direct.content)
        sent = stack.fake.requests_to(path)[-1].json()
        assert sent.pop("stream_options") == ASKED["every-event"]
        assert sent == {k: v for k, v in body.items() if k != "stream_options"}
        await eventually(stack.ledger_empty, "the reservation was released")
        assert stack.sample("kv_sidecar_completion_tokens_total") == 16


@pytest.mark.parametrize(
    "extra",
    [{"n": 2}, {"stream_options": {"include_usage": False}}],
    ids=["n2", "own-options"],
)
async def test_a_stream_of_several_choices_or_with_its_own_options_goes_as_sent(
    stack: Stack, extra: dict[str, Any]
) -> None:
    raw = json.dumps(completion(stream=True, **extra)).encode()
    direct = await stack.direct.post("/v1/completions", content=raw)
    proxied = await stack.client.post("/v1/completions", content=raw)
    assert proxied.content == direct.content
    assert stack.fake.requests_to("/v1/completions")[-1].body == raw


async def test_without_stream_usage_a_stream_goes_as_sent(upstream: FakeServer) -> None:
    async with run_sidecar(upstream, stream_usage="off") as stack:
        raw = json.dumps(completion(stream=True)).encode()
        direct = await stack.direct.post("/v1/completions", content=raw)
        proxied = await stack.client.post("/v1/completions", content=raw)
        assert proxied.content == direct.content
        assert stack.fake.requests_to("/v1/completions")[-1].body == raw


async def test_a_stream_holds_its_reservation_until_it_ends(stack: Stack) -> None:
    stack.fake.token_delay = 0.02
    body = completion(max_tokens=30, stream=True)  # 10 + 30 tokens: 1 block of 128
    async with stack.client.stream("POST", "/v1/completions", json=body) as resp:
        seen = 0
        async for line in resp.aiter_lines():
            seen += line.startswith("data: {")
            if seen == 5:
                state = await stack.state()
                assert state["in_flight"] == 1
                assert state["reserved_blocks"] == 1
                assert state["predicted_blocks"] == 1
    assert seen == 30
    await eventually(stack.ledger_empty, "the reservation was released")


async def test_vllms_own_refusal_is_relayed_and_releases(stack: Stack) -> None:
    body = completion(model="no-such-model")
    direct = await stack.direct.post("/v1/completions", json=body)
    resp = await stack.client.post("/v1/completions", json=body)
    assert resp.status_code == direct.status_code == 404
    assert resp.content == direct.content
    await eventually(stack.ledger_empty, "the reservation was released")


async def test_upstream_crash_mid_stream_ends_the_stream_with_an_error_event(stack: Stack) -> None:
    stack.fake.fail_after = 3
    body = completion(stream=True, stream_options={"include_usage": True})
    async with stack.client.stream("POST", "/v1/completions", json=body) as resp:
        raw = await resp.aread()
    assert resp.status_code == 200
    events = [e for e in raw.decode().split("\n\n") if e]
    assert len(events) == 4  # three tokens, then the sidecar's word on what happened
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "upstream_failed"
    await eventually(stack.ledger_empty, "the reservation was released")
    assert stack.sample("kv_sidecar_upstream_errors_total", kind="protocol") == 1


async def test_upstream_crash_before_a_json_answer_is_relayed(stack: Stack) -> None:
    stack.fake.fail_after = 3
    resp = await stack.client.post("/v1/completions", json=completion())
    assert resp.status_code == 500  # uvicorn's answer for vLLM's app raising
    await eventually(stack.ledger_empty, "the reservation was released")
    assert stack.sample("kv_sidecar_upstream_errors_total", kind="status_5xx") == 1


# --- refusals -----------------------------------------------------------------------------


async def test_full_cache_with_policy_reject_gets_429(upstream: FakeServer) -> None:
    upstream.app.kv_cache_usage = 0.99  # 62 of 63 blocks taken; the budget is 59
    async with run_sidecar(upstream, policy="reject") as stack:
        resp = await stack.client.post("/v1/chat/completions", json=chat())
        error = openai_error(resp, 429, "kv_cache_full")
        assert error["type"] == "rate_limit_error"
        retry_after(resp)
        assert stack.fake.generations() == []
        assert stack.decisions("reject", "kv_cache_full") == 1
        assert stack.ledger_empty()


async def test_request_that_can_never_fit_gets_413(upstream: FakeServer) -> None:
    upstream.app.num_gpu_blocks = 8  # 7 usable blocks of 128 tokens
    async with run_sidecar(upstream) as stack:
        # one sequence of 10 + 1000 tokens: 8 blocks, more than vLLM's whole pool
        resp = await stack.client.post("/v1/completions", json=completion(max_tokens=1000))
        error = openai_error(resp, 413, "kv_budget_exceeded")
        assert "can reach 8 KV blocks" in error["message"], error
        assert "holds 7 blocks" in error["message"], error
        assert stack.fake.generations() == []
        assert stack.decisions("reject", "too_large") == 1


async def test_samples_that_together_outgrow_the_pool_are_served(stack: Stack) -> None:
    """10 samples of 10 + 1000 tokens: 80 blocks at their peaks, over vLLM's pool of 63, but
    each sample is a request of its own in vLLM's scheduler and fits it: vLLM serves it, and
    so does the sidecar (alone in the pool in worst-case mode), not a 413."""
    resp = await stack.client.post("/v1/completions", json=completion(n=10, max_tokens=1000))
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 10
    assert stack.decisions("reject", "too_large") == 0
    assert stack.ledger_empty()


async def test_max_tokens_beyond_the_context_gets_vllms_400(stack: Stack) -> None:
    body = completion(max_tokens=5000)
    direct = await stack.direct.post("/v1/completions", json=body)
    resp = await stack.client.post("/v1/completions", json=body)
    error = openai_error(resp, 400, "max_tokens_too_large")
    assert error["message"] == direct.json()["error"]["message"]
    assert error["message"] == (
        "max_tokens=5000 cannot be greater than max_model_len=1024. "
        "Please request fewer output tokens."
    )
    assert len(stack.fake.generations()) == 1  # the direct one only


BAD_BODIES: list[tuple[str, str, bytes, int, str]] = [
    ("truncated JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("not UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "invalid_json"),
    ("no prompt", "/v1/completions", b'{"model": "tiny", "max_tokens": 4}', 400, "invalid_request"),
    *(
        (name, path, json.dumps(body).encode(), 400, "invalid_request")
        for name, path, body in (
            ("max_tokens a string", "/v1/completions", completion(max_tokens="ten")),
            ("max_tokens -1", "/v1/completions", completion(max_tokens=-1)),
            ("stream a string", "/v1/chat/completions", chat(stream="yes")),
            ("n = 0", "/v1/chat/completions", chat(n=0)),
            ("no messages", "/v1/chat/completions", chat(messages=[])),
            ("message without role", "/v1/chat/completions", chat(messages=[{"content": "x"}])),
        )
    ),
    ("over max_body_bytes", "/v1/completions", json.dumps(completion(prompt="w " * 3000)).encode(),
     413, "body_too_large"),
]  # fmt: skip


async def test_bad_input_gets_4xx_and_is_never_forwarded(upstream: FakeServer) -> None:
    async with run_sidecar(upstream, max_body_bytes=4096) as stack:
        for i, (name, path, raw, status, code) in enumerate(BAD_BODIES, 1):
            resp = await stack.client.post(
                path, content=raw, headers={"Content-Type": "application/json"}
            )
            assert resp.status_code == status, (name, resp.text)
            openai_error(resp, status, code)
            assert stack.decisions("reject", "bad_request") == i, name
        assert stack.fake.generations() == []
        assert stack.fake.requests_to("/tokenize") == []  # refused before any counting


async def test_chunked_body_over_the_limit_gets_413(upstream: FakeServer) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(8):
            yield b"word " * 200
        yield b'"}'

    async with run_sidecar(upstream, max_body_bytes=4096) as stack:
        resp = await stack.client.post("/v1/completions", content=body())
        assert "content-length" not in resp.request.headers
        openai_error(resp, 413, "body_too_large")
        assert stack.fake.generations() == []


async def test_queued_request_is_admitted_when_usage_drops(upstream: FakeServer) -> None:
    upstream.app.kv_cache_usage = 0.99
    async with run_sidecar(upstream, policy="queue", max_queue_wait=5) as stack:
        pending = asyncio.ensure_future(stack.client.post("/v1/completions", json=completion()))
        await eventually(lambda: stack.sidecar.admission.queue_depth == 1, "queued")
        assert stack.fake.generations() == []
        stack.fake.kv_cache_usage = 0.0  # vLLM freed its blocks; the next scrape tells
        resp = await asyncio.wait_for(pending, 2)
        assert resp.status_code == 200
        assert len(stack.fake.generations()) == 1
        assert stack.decisions("admit", "queued") == 1
        assert stack.sample("kv_sidecar_queue_wait_seconds_count") == 1
        await eventually(stack.ledger_empty, "the reservation was released")


async def test_queued_request_times_out_with_429(upstream: FakeServer) -> None:
    upstream.app.kv_cache_usage = 0.99
    async with run_sidecar(upstream, policy="queue", max_queue_wait=0.3) as stack:
        t0 = time.monotonic()
        resp = await stack.client.post("/v1/completions", json=completion())
        assert time.monotonic() - t0 >= 0.3
        openai_error(resp, 429, "queue_timeout")
        retry_after(resp)
        assert stack.fake.generations() == []
        assert stack.decisions("reject", "queue_timeout") == 1
        assert stack.ledger_empty()


async def test_full_queue_gets_429(upstream: FakeServer) -> None:
    upstream.app.kv_cache_usage = 0.99
    async with run_sidecar(upstream, policy="queue", max_queue_wait=5, max_queue_depth=1) as stack:
        first = asyncio.ensure_future(stack.client.post("/v1/completions", json=completion()))
        await eventually(lambda: stack.sidecar.admission.queue_depth == 1, "queued")
        resp = await stack.client.post("/v1/completions", json=completion())
        openai_error(resp, 429, "queue_full")
        retry_after(resp)
        assert stack.decisions("reject", "queue_full") == 1
        stack.fake.kv_cache_usage = 0.0
        assert (await asyncio.wait_for(first, 2)).status_code == 200
        assert len(stack.fake.generations()) == 1


# --- disconnects --------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_mid_stream_cancels_upstream_and_releases(stack: Stack, path: str) -> None:
    stack.fake.token_delay = 0.05
    body = chat(max_tokens=200) if "chat" in path else completion(max_tokens=200)
    async with stack.client.stream("POST", path, json=body | {"stream": True}) as resp:
        events = 0
        async for line in resp.aiter_lines():
            events += line.startswith("data: {")
            if events == 3:
                assert stack.sidecar.admission.state().in_flight == 1
                break
    await eventually(lambda: stack.fake.aborted == 1, "the upstream saw the disconnect")
    await eventually(stack.ledger_empty, "the reservation was released")
    assert stack.fake.completed == 0 and stack.fake.in_flight == 0


async def test_disconnect_during_non_streamed_generation_cancels_upstream(stack: Stack) -> None:
    stack.fake.token_delay = 0.05  # 40 tokens: the answer is ready after 2 s
    pending = asyncio.ensure_future(
        stack.client.post("/v1/completions", json=completion(max_tokens=40))
    )
    await eventually(lambda: stack.fake.in_flight == 1, "the upstream is generating")
    pending.cancel()  # the client goes away
    await asyncio.gather(pending, return_exceptions=True)
    await eventually(lambda: stack.fake.aborted == 1, "the upstream saw the disconnect")
    await eventually(stack.ledger_empty, "the reservation was released")


async def test_disconnect_while_queued_leaves_the_queue(upstream: FakeServer) -> None:
    upstream.app.kv_cache_usage = 0.99
    async with run_sidecar(upstream, policy="queue", max_queue_wait=10) as stack:
        pending = asyncio.ensure_future(stack.client.post("/v1/completions", json=completion()))
        await eventually(lambda: stack.sidecar.admission.queue_depth == 1, "queued")
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await eventually(lambda: stack.sidecar.admission.queue_depth == 0, "left the queue")
        await eventually(
            lambda: stack.decisions("cancel", "client_disconnect") == 1, "cancel counted"
        )
        assert stack.ledger_empty()
        stack.fake.kv_cache_usage = 0.0
        await asyncio.sleep(0.15)  # a few scrapes: nothing left to admit
        assert stack.fake.generations() == []


# --- upstream down ------------------------------------------------------------------------


async def test_upstream_down_gives_503_and_recovers(stack: Stack) -> None:
    await asyncio.to_thread(stack.upstream.stop)
    counted, connect_errors = (
        stack.decisions_total(),
        stack.sample("kv_sidecar_upstream_errors_total", kind="connect"),
    )

    resp = await stack.client.post("/v1/completions", json=completion())
    error = openai_error(resp, 503, "upstream_unavailable")
    assert error["type"] == "service_unavailable_error"
    retry_after(resp)
    # admitted, then the connect failed: one decision (docs/metrics.md), one upstream error
    assert stack.decisions_total() == counted + 1
    assert stack.sample("kv_sidecar_upstream_errors_total", kind="connect") == connect_errors + 1
    passthrough = await stack.client.get("/v1/models")
    openai_error(passthrough, 503, "upstream_unavailable")
    retry_after(passthrough)
    await eventually(lambda: not stack.sidecar.scraper.up, "a scrape failed")
    info = (await stack.ops.get("/readyz")).json()
    assert await stack.ready_status() == 503 and info["vllm_up"] is False
    await eventually(stack.ledger_empty, "nothing held for a request that failed")

    await asyncio.to_thread(stack.upstream.start)
    await eventually(stack.sidecar.ready, "ready again")
    assert await stack.ready_status() == 200
    resp = await stack.client.post("/v1/completions", json=completion())
    assert resp.status_code == 200


async def test_before_discovery_generation_gets_503_engine_not_ready(
    upstream: FakeServer,
) -> None:
    upstream.app.metrics_mode = "no_cache_config"  # vLLM still starting: no block size yet
    async with run_sidecar(upstream, discovered=False) as stack:
        resp = await stack.client.post("/v1/chat/completions", json=chat())
        openai_error(resp, 503, "engine_not_ready")
        retry_after(resp)
        assert stack.decisions("reject", "not_ready") == 1  # the label says what the code says
        assert stack.decisions("reject", "upstream_unavailable") == 0
        assert stack.fake.generations() == []
        assert (await stack.client.get("/health")).status_code == 200  # pass-through works
        assert await stack.ready_status() == 503

        stack.fake.metrics_mode = "ok"
        await eventually(lambda: stack.sidecar.discovered, "discovered", within=5)
        assert (await stack.client.post("/v1/chat/completions", json=chat())).status_code == 200


async def test_event_loop_tasks_are_exported_and_return_to_rest(upstream: FakeServer) -> None:
    async with run_sidecar(upstream) as stack:
        rest = (await stack.state())["event_loop_tasks"]
        assert rest > 0
        upstream.app.token_delay = 0.05
        sending = [
            asyncio.ensure_future(stack.client.post("/v1/completions", json=completion()))
            for _ in range(8)
        ]
        await eventually(lambda: len(stack.sidecar.admission.ledger) == 8, "8 in flight", within=5)
        busy = stack.sidecar.event_loop_tasks()
        # the test's own 8 requests run on this loop too: the sidecar's are the rest
        assert busy >= rest + 16, (rest, busy)
        await asyncio.gather(*sending)
        await eventually(lambda: stack.sidecar.event_loop_tasks() <= rest, "back to rest", 5)
        assert stack.sample("kv_sidecar_event_loop_tasks") <= rest


async def test_a_blocked_event_loop_shows_in_the_lag_histogram(upstream: FakeServer) -> None:
    """The loop-lag probe (a timer every 100 ms) sees a call that holds the loop 500 ms: one
    observation over 250 ms; before it, none over 250 ms."""
    async with run_sidecar(upstream) as stack:
        name = "kv_sidecar_event_loop_lag_seconds"

        def over_250ms() -> float:
            return stack.sample(f"{name}_count") - stack.sample(f"{name}_bucket", le="0.25")

        await eventually(lambda: stack.sample(f"{name}_count") >= 2, "two probes", within=5)
        assert over_250ms() == 0
        time.sleep(0.5)  # noqa: ASYNC251 - holds the loop on purpose: the sidecar runs on it
        await eventually(lambda: over_250ms() == 1, "the lag seen", within=5)


async def test_one_failed_scrape_does_not_drop_readiness_stale_data_does(
    upstream: FakeServer,
) -> None:
    """A scrape that fails under a burst must not take the pod out of service at once."""
    async with run_sidecar(upstream, metrics_stale_after=1.5) as stack:
        await eventually(stack.sidecar.ready, "ready")
        stack.fake.metrics_mode = "error"
        await eventually(lambda: not stack.sidecar.scraper.up, "scrape failing", within=2)
        info = (await stack.ops.get("/readyz")).json()
        assert info["vllm_up"] is False and info["last_error"]  # said at once ...
        assert info["ready"] is True  # ... but the snapshot is still fresh
        await eventually(lambda: not stack.sidecar.ready(), "stale", within=3)
        assert await stack.ready_status() == 503
        stack.fake.metrics_mode = "ok"
        await eventually(stack.sidecar.ready, "ready again", within=3)


async def test_not_ready_until_the_local_tokenizer_has_loaded() -> None:
    """The load holds the GIL in long stretches: no traffic may be admitted behind it."""
    from harness.vllm_cpu import ensure_tokenizer_model

    with FakeServer(FakeVllm(model_root=ensure_tokenizer_model())) as server:
        async with run_sidecar(server, discovered=False) as stack:
            await eventually(lambda: stack.sidecar.discovered, "discovered", within=60)
            assert stack.sidecar.counter.local_available  # loaded before, not after
            resp = await stack.ops.get("/readyz")
            assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("mode", ["hang", "error", "garbage"])
async def test_readyz_turns_503_when_vllm_metrics_go_stale(upstream: FakeServer, mode: str) -> None:
    async with run_sidecar(upstream, metrics_stale_after=0.3) as stack:
        await eventually(stack.sidecar.ready, "ready")
        assert await stack.ready_status() == 200
        stack.fake.metrics_mode = mode  # type: ignore[assignment]
        await eventually(lambda: not stack.sidecar.ready(), "not ready", within=2)
        resp = await stack.ops.get("/readyz")
        assert resp.status_code == 503
        info = resp.json()
        assert info["ready"] is False
        if mode == "hang":  # the scrape is still waiting: vLLM is not known down, only stale
            assert info["vllm_metrics_age_seconds"] > 0.3
        else:
            assert info["vllm_up"] is False and info["last_error"]
        stack.fake.metrics_mode = "ok"
        await eventually(stack.sidecar.ready, "ready again", within=3)
        assert await stack.ready_status() == 200


# --- security -----------------------------------------------------------------------------


async def test_absolute_form_target_never_reaches_another_host(
    stack: Stack, evil: FakeServer
) -> None:
    authority = f"127.0.0.1:{evil.port}"
    request = (
        f"GET http://{authority}/steal?x=1 HTTP/1.1\r\nHost: {authority}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    status, answer = await raw_http(stack.port, request)
    assert evil.app.requests == []
    seen = stack.fake.non_probe_requests()
    if status == 400:  # refused by the proxy: nothing forwarded at all
        assert b"invalid_target" in answer and seen == []
    else:  # uvicorn's httptools hands the app the path alone: it went to vLLM as a path
        assert [(r.method, r.raw_path, r.query) for r in seen] == [("GET", b"/steal", b"x=1")]
        assert seen[0].header("host") == f"127.0.0.1:{stack.upstream.port}"
        assert status == 404


async def test_proxy_app_refuses_a_target_that_is_not_a_path(stack: Stack) -> None:
    """What an HTTP server that keeps the target as written (h11) hands the app."""
    for target in (b"http://evil.example/steal", b"evil.example:443", b"*"):
        scope: dict[str, Any] = {
            "type": "http",
            "method": "GET",
            "path": target.decode(),
            "raw_path": target,
            "query_string": b"",
            "headers": [(b"host", b"evil.example")],
        }
        sent: list[Message] = []

        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message, sent: list[Message] = sent) -> None:
            sent.append(message)

        await stack.sidecar.proxy(scope, receive, send)
        assert sent[0]["status"] == 400, target
        assert json.loads(sent[1]["body"])["error"]["code"] == "invalid_target"
    assert stack.fake.non_probe_requests() == []


async def test_dot_segments_and_double_slashes_stay_on_the_upstream(
    stack: Stack, evil: FakeServer
) -> None:
    for target in (
        "/echo/a/../../../../steal",
        "/echo/%2e%2e/%2e%2e/steal",
        f"//127.0.0.1:{evil.port}/steal",
        f"/..//127.0.0.1:{evil.port}/steal",
    ):
        request = f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        status, _ = await raw_http(stack.port, request)
        assert status in (200, 400, 404), target
        assert evil.app.requests == [], target
        for rec in stack.fake.non_probe_requests():
            assert rec.raw_path.startswith(b"/")
            assert rec.header("host") == f"127.0.0.1:{stack.upstream.port}"
    assert len(stack.fake.non_probe_requests()) >= 3


async def test_dot_segments_do_not_bypass_admission(upstream: FakeServer) -> None:
    upstream.app.kv_cache_usage = 0.99
    async with run_sidecar(upstream, policy="reject") as stack:
        body = json.dumps(completion()).encode()
        for target in ("/x/../v1/completions", "/v1/./completions"):
            request = (
                f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body
            status, answer = await raw_http(stack.port, request)
            # refused (the KV cache is full), or passed on unchanged (vLLM would 404 it)
            assert status in (404, 429), (target, answer[:200])
        assert stack.fake.generations() == []


# --- the real process ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def process_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    fake = FakeVllm(model_root=write_model_dir(tmp_path_factory.mktemp("model") / "tiny"))
    with FakeServer(fake) as server:
        yield server


@pytest.fixture(scope="module")
def sidecar_process(process_upstream: FakeServer) -> Iterator[SidecarProcess]:
    process = SidecarProcess(
        process_upstream.url, "--scrape-interval", "0.1", "--log-level", "warning"
    )
    try:  # not `with`: a start that fails waiting for readiness must not leave it running
        yield process.start()
    finally:
        process.stop()


def test_process_serves_vllms_metrics_and_its_own(
    sidecar_process: SidecarProcess, process_upstream: FakeServer
) -> None:
    proxied = httpx.get(sidecar_process.url + "/metrics")
    assert proxied.text == process_upstream.app.metrics_text()
    own = sidecar_process.metrics()
    for name in (
        "kv_sidecar_kv_capacity_bytes",
        "kv_sidecar_kv_reserved_bytes",
        "kv_sidecar_oom_risk_ratio",
        "kv_sidecar_queue_depth",
        "kv_sidecar_vllm_metrics_age_seconds",
    ):
        assert name in own, name
    # 63 usable blocks of 128 tokens x 1 KiB (2 layers x 2 KV heads x 64 x bf16 x K and V)
    assert 'kv_sidecar_kv_capacity_bytes{model_name="tiny"} 8.257536e+06' in own


def test_process_streams_a_chat_byte_for_byte(
    sidecar_process: SidecarProcess, process_upstream: FakeServer
) -> None:
    # every event's count asked for already: nothing for the sidecar to add (sidecar.http.
    # stream_usage; what it adds is tested above)
    body = chat(stream=True, stream_options=ASKED["every-event"])
    direct = httpx.post(process_upstream.url + "/v1/chat/completions", json=body)
    with httpx.stream("POST", sidecar_process.url + "/v1/chat/completions", json=body) as resp:
        proxied = b"".join(resp.iter_raw())
    assert resp.status_code == 200 and proxied == direct.content
    deadline = time.monotonic() + 2
    while sidecar_process.state()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    state = sidecar_process.state()
    assert state["in_flight"] == 0 and state["reserved_blocks"] == 0


async def test_process_never_forwards_to_another_host(
    sidecar_process: SidecarProcess, process_upstream: FakeServer, evil: FakeServer
) -> None:
    authority = f"127.0.0.1:{evil.port}"
    for target in (f"http://{authority}/steal", f"//{authority}/steal", "/a/../../steal"):
        request = (
            f"GET {target} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
        ).encode()
        status, _ = await raw_http(sidecar_process.port, request)
        assert status in (400, 404), target
    assert evil.app.requests == []


# --- vLLM's max_tokens defaults (checked against a real vLLM in test_vllm_defaults.py) ----------


def projected_max_tokens(stack: Stack) -> float:
    """The sum of every effective max_tokens the sidecar projected so far."""
    return stack.sample("kv_sidecar_request_max_tokens_sum")


async def generated(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["completion_tokens"])


async def test_completion_without_max_tokens_projects_16_as_vllm_generates(stack: Stack) -> None:
    for body in (
        {"model": "tiny", "prompt": PROMPT},
        {"model": "tiny", "prompt": PROMPT, "max_tokens": None},
    ):
        before = projected_max_tokens(stack)
        assert await generated(await stack.client.post("/v1/completions", json=body)) == 16
        assert projected_max_tokens(stack) - before == 16
    await eventually(stack.ledger_empty, "the reservations were released")


async def test_chat_without_max_tokens_projects_the_rest_of_the_context(stack: Stack) -> None:
    body = {"model": "tiny", "messages": CHAT}
    room = stack.fake.max_model_len - count_prompt(body)
    assert await generated(await stack.client.post("/v1/chat/completions", json=body)) == room
    assert projected_max_tokens(stack) == room
    assert stack.sidecar.engine is not None
    assert stack.sidecar.engine.config.default_max_tokens is None


async def test_generation_config_default_is_read_from_the_model_dir(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = write_model_dir(tmp_path / "gen", max_new_tokens=40)
    fake = FakeVllm(model_root=root)
    assert fake.default_max_tokens == 40  # the fake reads it as vLLM's "auto" does
    caplog.set_level("INFO", logger="sidecar.engine.discovery")
    with FakeServer(fake) as server:
        async with run_sidecar(server) as stack:
            assert stack.sidecar.engine is not None
            assert stack.sidecar.engine.config.default_max_tokens == 40
            assert stack.sidecar.engine.config.max_tokens_cap is None
            chat_body = {"model": "tiny", "messages": CHAT}
            resp = await stack.client.post("/v1/chat/completions", json=chat_body)
            assert await generated(resp) == 40
            assert projected_max_tokens(stack) == 40
            # an explicit max_tokens wins over the default, larger or smaller
            for asked in (7, 100):
                before = projected_max_tokens(stack)
                resp = await stack.client.post(
                    "/v1/chat/completions", json={**chat_body, "max_tokens": asked}
                )
                assert await generated(resp) == asked
                assert projected_max_tokens(stack) - before == asked
            # completions keep their own 16
            before = projected_max_tokens(stack)
            resp = await stack.client.post("/v1/completions", json={"prompt": PROMPT})
            assert await generated(resp) == 16
            assert projected_max_tokens(stack) - before == 16
    assert any(
        "get 40 (max_new_tokens in" in r.getMessage() and "generation_config.json" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


async def test_default_max_tokens_flag_wins_over_the_file(tmp_path: Path) -> None:
    root = write_model_dir(tmp_path / "gen", max_new_tokens=40)
    fake = FakeVllm(model_root=root)
    fake.default_max_tokens = None  # vLLM started with --generation-config vllm
    body = {"model": "tiny", "messages": CHAT}
    room = fake.max_model_len - count_prompt(body)
    with FakeServer(fake) as server:
        async with run_sidecar(server, default_max_tokens=0) as stack:
            assert stack.sidecar.engine is not None
            assert stack.sidecar.engine.config.default_max_tokens is None
            resp = await stack.client.post("/v1/chat/completions", json=body)
            assert await generated(resp) == room
            assert projected_max_tokens(stack) == room
        fake.default_max_tokens = 25  # vLLM with --generation-config DIR (and no cap there)
        async with run_sidecar(server, default_max_tokens=25) as stack:
            resp = await stack.client.post("/v1/chat/completions", json=body)
            assert await generated(resp) == 25
            assert projected_max_tokens(stack) == 25


async def test_max_tokens_cap_bounds_every_request(upstream: FakeServer) -> None:
    upstream.app.max_tokens_cap = 20  # vLLM: --override-generation-config '{"max_new_tokens": 20}'
    async with run_sidecar(upstream, max_tokens_cap=20) as stack:
        assert stack.sidecar.engine is not None
        assert stack.sidecar.engine.config.max_tokens_cap == 20
        cases: list[tuple[str, dict[str, Any], int]] = [
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100}, 20),
            ("/v1/completions", {"prompt": PROMPT}, 16),
            ("/v1/chat/completions", {"messages": CHAT}, 20),
            ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 500}, 20),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5}, 5),
        ]
        for path, body, expected in cases:
            before = projected_max_tokens(stack)
            resp = await stack.client.post(path, json={"model": "tiny", **body})
            assert await generated(resp) == expected, (path, body)
            assert projected_max_tokens(stack) - before == expected, (path, body)
        # the cap does not lift vLLM's 400 for a max_tokens beyond the context
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5000}
        direct = await stack.direct.post("/v1/completions", json=body)
        resp = await stack.client.post("/v1/completions", json=body)
        assert resp.status_code == direct.status_code == 400


async def test_echo_with_max_tokens_0_is_forwarded_and_projects_one_token(stack: Stack) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "max_tokens": 0}
    assert await generated(await stack.client.post("/v1/completions", json=body)) == 1
    assert projected_max_tokens(stack) == 1
    resp = await stack.client.post("/v1/completions", json={**body, "echo": False})
    assert openai_error(resp, 400, "invalid_request")["param"] == "max_tokens"


async def test_a_non_streamed_request_runs_in_the_ledger_while_vllm_answers(
    stack: Stack,
) -> None:
    """Its answer's head comes only when vLLM has finished: it must count as running (holding
    its prompt, its progress estimated) from the moment it is sent, not from its end."""
    stack.fake.token_delay = 0.05  # 16 tokens: 0.8 s
    sending = asyncio.ensure_future(stack.client.post("/v1/completions", json=completion()))
    await eventually(
        lambda: stack.sidecar.admission.state().predicted_blocks > 0, "started in the ledger"
    )
    assert not sending.done()
    assert (await sending).status_code == 200
    await eventually(stack.ledger_empty, "released at the end")
