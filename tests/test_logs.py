"""Log lines of a real ``kv-sidecar serve`` process in front of the fake vLLM.

``--log-format json``: every line the process writes parses as one JSON object with time, level,
logger and message, uvicorn's lines included; each generation request has one access line with
its id, endpoint, decision and reason, prompt tokens, projected blocks, queue wait, status and
duration; pass-through requests have one only with ``--access-log all``. The default (text,
generation requests only) and ``--access-log off`` are checked too. No line holds the client's
credentials, its prompt or its messages. The fake is the shared ``upstream``
(tests/support/fake_upstream.py): a fresh one for each test, on one server for the module.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from typing import Any

import httpx

from harness.fake_vllm import FakeServer, FakeVllm, count_prompt
from harness.workload import SidecarProcess

SECRET = "sk-live-0c4e1f9a7b2d4c6e8a0f3b5d7e9c1a2b"
PROXY_SECRET = "cHJveHktc2VjcmV0LWxvZ3M="
#: the sidecar's own key for vLLM (--upstream-api-key)
OWN_KEY = "sk-own-5d1c9e7a3b0f4a2c8e6d4b2a0c9e7f5d"
#: words that appear only in prompts and messages: never in a log line
PROMPT_WORDS = "zanzibar quetzal marmalade"
MAX_TOKENS = 4


def fake_of(server: FakeServer) -> FakeVllm:
    app = server.app
    assert isinstance(app, FakeVllm)
    return app


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line parsed as one JSON object (a line that is not one fails the test)."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "the sidecar wrote no log line"
    parsed = []
    for line in lines:
        obj = json.loads(line)
        assert isinstance(obj, dict), line
        for key in ("time", "level", "logger", "message"):
            assert key in obj, (key, line)
        assert obj["level"] in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}, line
        assert obj["time"].endswith("Z"), line
        datetime.fromisoformat(obj["time"].replace("Z", "+00:00"))  # RFC 3339
        parsed.append(obj)
    return parsed


def access(lines: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    found = [
        obj
        for obj in lines
        if obj["logger"] == "sidecar.access" and obj.get("request_id") == request_id
    ]
    assert len(found) == 1, (request_id, found)
    return found[0]


def test_json_lines_for_every_request_and_no_secrets(upstream: FakeServer) -> None:
    fake = fake_of(upstream)
    sc = SidecarProcess(
        upstream.url,
        "--log-format",
        "json",
        "--access-log",
        "all",
        "--log-level",
        "debug",
        "--scrape-interval",
        "0.1",
        env={"KV_SIDECAR_UPSTREAM_API_KEY": OWN_KEY},
    ).start()
    auth = {"Authorization": f"Bearer {SECRET}", "Proxy-Authorization": PROXY_SECRET}
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"please {PROMPT_WORDS} now"}],
        "max_tokens": MAX_TOKENS,
    }
    completion = {"model": "tiny", "prompt": f"say {PROMPT_WORDS}", "max_tokens": MAX_TOKENS}
    too_long = {"model": "tiny", "prompt": f"{PROMPT_WORDS} " * 400, "max_tokens": MAX_TOKENS}
    try:
        with httpx.Client(base_url=sc.url, headers=auth, timeout=30) as client:
            admitted = client.post(
                "/v1/chat/completions", json=chat, headers={"X-Request-Id": "req-chat-1"}
            )
            assert admitted.status_code == 200, admitted.text
            streamed = completion | {"stream": True, "stream_options": {"include_usage": True}}
            with client.stream("POST", "/v1/completions", json=streamed) as resp:
                assert resp.status_code == 200 and b"[DONE]" in resp.read()
            refused = client.post(
                "/v1/completions", json=too_long, headers={"X-Request-Id": "req-long-1"}
            )
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "context_length_exceeded"
            bad = client.post(
                "/v1/chat/completions",
                content=b'{"messages": [' + PROMPT_WORDS.encode(),
                headers={"X-Request-Id": "req-bad-1", "Content-Type": "application/json"},
            )
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
            models = client.get("/v1/models", headers={"X-Request-Id": "req-models-1"})
            assert models.status_code == 200
    finally:
        assert sc.stop() == 0
    lines = json_lines(sc.log())

    # uvicorn's own lines go through the same format
    assert any(obj["logger"].startswith("uvicorn") for obj in lines)
    assert any(obj["level"] == "DEBUG" for obj in lines)  # the log was verbose

    line = access(lines, "req-chat-1")
    body_tokens = count_prompt(chat)
    assert line["level"] == "INFO"
    assert line["message"] == "POST /v1/chat/completions 200"
    assert line["method"] == "POST" and line["path"] == "/v1/chat/completions"
    assert line["endpoint"] == "chat" and line["model"] == "tiny" and line["stream"] is False
    assert (line["decision"], line["reason"]) == ("admit", "fits")
    assert line["prompt_tokens"] == body_tokens
    assert line["count_method"] == "exact_upstream"  # no tokenizer files: vLLM's /tokenize
    blocks = math.ceil((body_tokens + MAX_TOKENS) / fake.block_size)
    assert line["projected_blocks"] == blocks and line["reserved_blocks"] == blocks
    assert line["queue_wait_s"] == 0.0
    assert line["status"] == 200
    assert line["completion_tokens"] == MAX_TOKENS
    assert line["upstream_error"] is None
    assert 0 < line["duration_s"] < 30

    # the streamed completion had no id: the sidecar made one, logged it and sent it to vLLM
    streamed_lines = [
        obj
        for obj in lines
        if obj["logger"] == "sidecar.access" and obj.get("path") == "/v1/completions"
    ]
    made = [obj for obj in streamed_lines if obj["status"] == 200]
    assert len(made) == 1
    made_id = made[0]["request_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made_id)
    assert made[0]["stream"] is True and made[0]["completion_tokens"] == MAX_TOKENS
    sent = [r for r in fake.generations() if r.path == "/v1/completions"]
    assert [r.header("x-request-id") for r in sent] == [made_id]
    chats = [r for r in fake.generations() if r.path == "/v1/chat/completions"]
    assert [r.header("x-request-id") for r in chats] == ["req-chat-1"]  # the client's, as is

    line = access(lines, "req-long-1")
    assert (line["decision"], line["reason"], line["status"]) == ("reject", "prompt_too_long", 400)
    assert line["projected_blocks"] is None and line["queue_wait_s"] is None

    line = access(lines, "req-bad-1")
    assert (line["decision"], line["reason"], line["status"]) == ("reject", "bad_request", 400)
    assert line["prompt_tokens"] is None and line["model"] is None

    line = access(lines, "req-models-1")
    assert line["message"] == "GET /v1/models 200"
    assert (line["method"], line["path"], line["status"]) == ("GET", "/v1/models", 200)
    assert "decision" not in line

    # the sidecar's own key went to vLLM with its own calls, and into no line either
    assert any(r.header("authorization") == f"Bearer {OWN_KEY}" for r in fake.requests)
    text = sc.log()
    for secret in (SECRET, SECRET[3:20], PROXY_SECRET, OWN_KEY, *PROMPT_WORDS.split()):
        assert secret not in text, secret


def test_text_by_default_one_line_per_generation_request(upstream: FakeServer) -> None:
    with SidecarProcess(upstream.url) as sc:
        with httpx.Client(base_url=sc.url, timeout=30) as client:
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            resp = client.post(
                "/v1/chat/completions",
                json=chat | {"max_tokens": 2},
                headers={"X-Request-Id": "text-1"},
            )
            assert resp.status_code == 200
            assert client.get("/v1/models", headers={"X-Request-Id": "text-2"}).is_success
        sc.stop()
    log = sc.log()
    access_lines = [line for line in log.splitlines() if " sidecar.access: " in line]
    assert len(access_lines) == 1, access_lines  # the pass-through GET has none
    line = access_lines[0]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO sidecar\.access: ", line), line
    assert "POST /v1/chat/completions 200 request_id=text-1 " in line
    for pair in ("decision=admit", "reason=fits", "status=200", "queue_wait_s=0 "):
        assert pair in line, (pair, line)
    assert "upstream_error=" not in line  # None fields are left out of text lines
    assert not log.lstrip().startswith("{")  # text, not JSON


def test_access_log_off(upstream: FakeServer) -> None:
    with SidecarProcess(upstream.url, "--access-log", "off", "--log-format", "json") as sc:
        with httpx.Client(base_url=sc.url, timeout=30) as client:
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            assert client.post("/v1/chat/completions", json=chat | {"max_tokens": 2}).is_success
        sc.stop()
    lines = json_lines(sc.log())
    assert [obj for obj in lines if obj["logger"] == "sidecar.access"] == []
    assert any("vLLM discovered" in obj["message"] for obj in lines)  # other lines still come


def test_unknown_log_format_is_one_line_error(upstream: FakeServer) -> None:
    sc = SidecarProcess(upstream.url, "--log-format", "yaml")
    sc.start(wait_ready=False)
    code = sc.proc.wait(timeout=30) if sc.proc is not None else None
    assert code == 2
    log = sc.log()
    assert "--log-format (KV_SIDECAR_LOG_FORMAT)" in log and "Traceback" not in log
