"""Prompt token counts agree with vLLM: the local tokenizer, /tokenize, and what vLLM reports.

Three layers:
* offline, against ``fixtures/tokens/vllm-0.32.0.json`` (vLLM's own normalisation functions,
  captured by ``fixtures/tokens/capture_vllm.py``): content-format detection, message
  normalisation, tool dumps, Responses input conversion;
* against the real vLLM (``@pytest.mark.vllm``): for every shape in ``SHAPES``, the local count,
  the count through /tokenize (UPSTREAM mode) and ``usage`` of the request actually sent agree;
* fallbacks: a closed port and a real 404 give estimates that never undercount; a fake
  /tokenize (httpx.MockTransport) shows one concurrent call per prompt and 400s as PromptError.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.vllm_cpu import ensure_tokenizer_model, free_port
from harness.workload import metric_value
from sidecar.counting import (
    SELF_CHECKED_SHAPES,
    CountMethod,
    Endpoint,
    ModelTokenizer,
    PromptCounter,
    PromptShape,
    TokenCount,
    counting_view,
    parse_generation,
)
from sidecar.counting.content_format import detect_content_format
from sidecar.counting.plan import Truncation, plan_count
from sidecar.counting.render import (
    chat_tool,
    conversation,
    merge_kwargs,
    response_messages,
    response_tools,
)
from sidecar.errors import PromptError
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.prefix import block_hashes
from sidecar.kv.projection import project_counts
from tests.conftest import VllmInfo
from tests.support.external import unless_external
from tests.support.shapes import (
    CAPTURED,
    FIXTURES,
    LONG_TEXT,
    OVERLONG_TEXT,
    SHAPES,
    TOOL_TURNS,
    WEATHER_TOOL,
)

pytestmark = pytest.mark.timeout(300)

# --------------------------------------------------------------------------------------------
# The request shapes checked against the real vLLM
# --------------------------------------------------------------------------------------------

SHAPE_IDS = [shape[0] for shape in SHAPES]
HI = [{"role": "user", "content": "hi"}]
ENDPOINT_PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
}


async def wait_checks(counter: PromptCounter) -> None:
    """Wait for the counter's background self-checks in flight."""
    while counter._checks:
        await asyncio.gather(*counter._checks, return_exceptions=True)


def tokenize_payloads(endpoint: str, body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The /tokenize requests a client would send for ``body``; None where none applies."""
    if "truncate_prompt_tokens" in body or endpoint == "responses":
        return None  # /tokenize neither truncates nor speaks Responses
    if endpoint == "completions":
        prompt = body["prompt"]
        prompts = (
            prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]
        )
        if not all(isinstance(p, str) for p in prompts):
            return None  # /tokenize takes text only
        extra = {k: body[k] for k in ("add_special_tokens",) if k in body}
        return [{"prompt": p, **extra} for p in prompts]
    keys = (
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "add_special_tokens",
    )
    return [{k: body[k] for k in keys if k in body}]


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def served_tokenizer(vllm: VllmInfo) -> ModelTokenizer:
    """The tokenizer of the model the test vLLM serves."""
    if vllm.model_dir is None:
        unless_external("the model directory of the external vLLM is not readable here")
    return ModelTokenizer.load(vllm.model_dir)


@pytest.fixture
async def client() -> Any:
    async with httpx.AsyncClient(timeout=60) as http:
        yield http


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


# --------------------------------------------------------------------------------------------
# Against the real vLLM
# --------------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize(("endpoint", "body"), [s[1:] for s in SHAPES], ids=SHAPE_IDS)
async def test_counts_match_vllm(
    vllm: VllmInfo,
    served_tokenizer: ModelTokenizer,
    client: httpx.AsyncClient,
    endpoint: str,
    body: dict[str, Any],
) -> None:
    local = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=served_tokenizer,
        max_model_len=vllm.max_model_len,
    )
    upstream = PromptCounter(
        client=client, upstream=vllm.url, served_model=vllm.served_name, tokenizer_path=None
    )
    # Sent with one output token, as vLLM's truncation to the context depends on it.
    limit = {"max_output_tokens": 1} if endpoint == "responses" else {"max_tokens": 1}
    request = {**body, **limit}
    by_local = await local.count(endpoint, request)  # type: ignore[arg-type]
    by_upstream = await upstream.count(endpoint, request)  # type: ignore[arg-type]

    assert by_local.method is CountMethod.LOCAL
    prompt = body.get("prompt")
    token_ids = isinstance(prompt, list) and all(isinstance(p, int | list) for p in prompt)
    assert by_upstream.method is (CountMethod.LOCAL if token_ids else CountMethod.UPSTREAM)
    assert by_upstream.prompts == by_local.prompts

    payloads = tokenize_payloads(endpoint, body)
    if payloads is not None:
        tokenized = []
        for payload in payloads:
            answer = await client.post(
                vllm.url + "/tokenize", json={"model": vllm.served_name, **payload}
            )
            assert answer.status_code == 200, answer.text
            tokenized.append(answer.json()["count"])
        assert tuple(tokenized) == by_local.prompts

    sent = await client.post(
        vllm.url + ENDPOINT_PATHS[endpoint], json={"model": vllm.served_name, **request}
    )
    assert sent.status_code == 200, sent.text
    usage = sent.json()["usage"]
    reported = usage["input_tokens"] if endpoint == "responses" else usage["prompt_tokens"]
    assert by_local.total == reported


@pytest.mark.vllm
async def test_prompt_vllm_refuses_is_a_prompt_error(
    vllm: VllmInfo, client: httpx.AsyncClient
) -> None:
    """Content the tokenizer cannot expand goes to /tokenize; vLLM's refusal becomes ours."""
    counter = PromptCounter(
        client=client, upstream=vllm.url, served_model=vllm.served_name, tokenizer_path=None
    )
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}},
                ],
            }
        ]
    }
    with pytest.raises(PromptError) as refused:
        await counter.count("chat", body)
    sent = await client.post(
        vllm.url + "/v1/chat/completions", json={"model": vllm.served_name, **body}
    )
    assert sent.status_code == 400
    assert str(refused.value) == sent.json()["error"]["message"]


@pytest.mark.vllm
async def test_real_404_and_closed_port_give_estimates_that_do_not_undercount(
    vllm: VllmInfo, served_tokenizer: ModelTokenizer, client: httpx.AsyncClient
) -> None:
    local = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=served_tokenizer,
    )
    not_found = vllm.url + "/no-such-prefix"  # vLLM answers POST /no-such-prefix/tokenize: 404
    closed = closed_port_url()
    for upstream in (not_found, closed):
        counter = PromptCounter(
            client=client, upstream=upstream, served_model=vllm.served_name, tokenizer_path=None
        )
        for shape_id, endpoint, body in SHAPES:
            exact = await local.count(endpoint, body)  # type: ignore[arg-type]
            estimate = await counter.count(endpoint, body)  # type: ignore[arg-type]
            if estimate.method is CountMethod.LOCAL:  # token ids: exact without help
                assert estimate.prompts == exact.prompts, shape_id
                continue
            assert estimate.method is CountMethod.ESTIMATE, shape_id
            assert len(estimate.prompts) == len(exact.prompts), shape_id
            for guessed, counted in zip(estimate.prompts, exact.prompts, strict=True):
                assert guessed >= counted, (shape_id, guessed, counted)


@pytest.mark.vllm
async def test_tokenizer_loads_in_background(vllm: VllmInfo, client: httpx.AsyncClient) -> None:
    if vllm.model_dir is None:
        unless_external("the model directory of the external vLLM is not readable here")
    observer = RecordingObserver()
    counter = PromptCounter(
        client=client,
        upstream=vllm.url,
        served_model=vllm.served_name,
        tokenizer_path=vllm.model_dir,
        observer=observer,
    )
    try:
        assert await counter.wait_ready()
        for shape_id, endpoint, body in SHAPES:
            count = await counter.count(endpoint, body)  # type: ignore[arg-type]
            assert count.method is CountMethod.LOCAL, shape_id
        # The first local count of each shape was checked against /tokenize meanwhile.
        await wait_checks(counter)
        assert sorted(observer.checks) == [(shape, True) for shape in sorted(SELF_CHECKED_SHAPES)]
    finally:
        counter.close()


# --------------------------------------------------------------------------------------------
# Offline: vLLM's normalisation rules, captured from vLLM itself
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), sorted(CAPTURED["content_formats"].items()))
def test_content_format_detection_matches_vllm(name: str, expected: str) -> None:
    template = (FIXTURES / "templates" / name).read_text()
    assert detect_content_format(template) == expected


@pytest.mark.parametrize("case", CAPTURED["conversations"], ids=lambda c: json.dumps(c)[:60])
@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_message_normalisation_matches_vllm(case: dict[str, Any], content_format: str) -> None:
    got = conversation(case["messages"], content_format)  # type: ignore[arg-type]
    # Key order too: templates that dump a message with tojson see it.
    assert json.dumps(got) == json.dumps(case[content_format])


def test_message_normalisation_does_not_touch_the_body() -> None:
    messages = json.loads(json.dumps(TOOL_TURNS))
    conversation(messages, "openai")
    assert messages == TOOL_TURNS


@pytest.mark.parametrize("case", CAPTURED["chat_tools"], ids=lambda c: json.dumps(c)[:60])
def test_chat_tools_dump_as_vllm_dumps_them(case: dict[str, Any]) -> None:
    dumped = [chat_tool(tool) for tool in case["tools"]]
    assert json.dumps(dumped) == json.dumps(case["dumped"])


@pytest.mark.parametrize("case", CAPTURED["responses"], ids=lambda c: json.dumps(c["body"])[:60])
def test_responses_input_becomes_the_messages_vllm_builds(case: dict[str, Any]) -> None:
    body = case["body"]
    assert response_messages(body.get("instructions"), body["input"]) == case["messages"]
    assert response_tools(body.get("tools")) == case["tools"]
    plan = plan_count("responses", body)
    flags = {
        "add_generation_prompt": plan.add_generation_prompt,  # type: ignore[union-attr]
        "continue_final_message": plan.continue_final_message,  # type: ignore[union-attr]
    }
    merged = merge_kwargs(plan.template_kwargs, flags)  # type: ignore[union-attr]
    assert merged == case["chat_template_kwargs"]


def test_merge_kwargs_treats_none_and_auto_as_unset() -> None:
    assert merge_kwargs({"a": 1, "b": 2}, {"a": None, "b": "auto", "c": 3}) == {
        "a": 1,
        "b": 2,
        "c": 3,
    }


# --------------------------------------------------------------------------------------------
# Offline: plans, truncation, refusals
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "body", "message"),
    [
        ("completions", {}, "Either prompt or prompt_embeds"),
        ("completions", {"prompt": ""}, "Either prompt or prompt_embeds"),
        ("completions", {"prompt": []}, "at least one prompt"),
        ("completions", {"prompt": 42}, "`prompt` must be"),
        ("completions", {"prompt": [1, "a"]}, "`prompt` must be"),
        ("completions", {"prompt": [[1], "a"]}, "`prompt` must be"),
        ("completions", {"prompt": [-1]}, "non-negative"),
        ("completions", {"prompt": "x", "max_tokens": "many"}, "`max_tokens` must be"),
        ("chat", {"messages": "hello"}, "'messages' must be a non-empty list"),
        ("chat", {"messages": []}, "'messages' must be a non-empty list"),
        ("chat", {"messages": [{"content": "no role"}]}, r"'messages\[0\].role' must be a string"),
        (
            "chat",
            {"messages": HI, "add_generation_prompt": True, "continue_final_message": True},
            "Cannot set both",
        ),
        ("chat", {"messages": HI, "tools": [{"type": "web"}]}, "function tool"),
        ("chat", {"messages": HI, "chat_template_kwargs": "x"}, "must be an object"),
        ("responses", {"input": 3}, "`input` must be"),
        (
            "responses",
            {"input": [{"type": "reasoning", "encrypted_content": "zz"}]},
            "Encrypted content",
        ),
        ("embeddings", {"input": "x"}, "not supported for endpoint"),
    ],
)
async def test_uninterpretable_prompts_are_prompt_errors(
    endpoint: str, body: dict[str, Any], message: str
) -> None:
    counter = PromptCounter(client=None, upstream=None, served_model=None, tokenizer_path=None)
    with pytest.raises(PromptError, match=message) as refused:
        await counter.count(endpoint, body)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)


async def test_a_body_that_is_not_an_object_is_a_prompt_error() -> None:
    counter = PromptCounter(client=None, upstream=None, served_model=None, tokenizer_path=None)
    with pytest.raises(PromptError):
        await counter.count("chat", ["not", "a", "dict"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("keep", "max_output", "max_model_len", "count", "expected"),
    [
        (None, 16, 1024, 2000, 2000),
        (10, 16, 1024, 50, 10),
        (10, 16, 1024, 5, 5),
        (0, 16, 1024, 5, 0),
        (-1, 16, 1024, 2000, 1023),  # one token of context held back for output
        (-1, 0, 1024, 2000, 1024),
        (-1, 16, None, 2000, 2000),  # unknown context: leave it to vLLM
    ],
)
def test_truncation_as_vllm_applies_it(
    keep: int | None, max_output: int, max_model_len: int | None, count: int, expected: int
) -> None:
    assert Truncation(keep, max_output).apply(count, max_model_len) == expected


def test_completions_default_max_tokens_decides_truncation_headroom() -> None:
    plan = plan_count(
        "completions", {"prompt": "x", "truncate_prompt_tokens": -1, "max_tokens": None}
    )
    assert plan.truncation == Truncation(-1, 16)
    chat = plan_count("chat", {"messages": HI, "truncate_prompt_tokens": -1})
    assert chat.truncation == Truncation(-1, 0)


async def test_token_ids_and_forwarded_ids_need_no_tokenizer() -> None:
    counter = PromptCounter(client=None, upstream=None, served_model=None, tokenizer_path=None)
    ids = await counter.count("completions", {"prompt": [[1, 2, 3], [4]]})
    assert (ids.prompts, ids.method) == ((3, 1), CountMethod.LOCAL)
    reused = await counter.count(
        "chat",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "kv_transfer_params": {"prompt_token_ids": [7, 8, 9, 10]},
        },
    )
    assert (reused.prompts, reused.method) == ((4,), CountMethod.LOCAL)


async def test_unknowable_shapes_are_flagged_estimates(caplog: pytest.LogCaptureFixture) -> None:
    counter = PromptCounter(client=None, upstream=None, served_model=None, tokenizer_path=None)
    caplog.set_level(logging.WARNING, logger="sidecar.counting.counter")
    history = await counter.count("responses", {"input": "x" * 40, "previous_response_id": "r1"})
    assert history.method is CountMethod.ESTIMATE
    assert history.total >= 40
    fim = await counter.count("completions", {"prompt": "def f(", "suffix": "return x"})
    assert fim.method is CountMethod.ESTIMATE
    assert fim.total >= len("def f(return x")
    odd = await counter.count("responses", {"input": [{"type": "web_search_call", "id": "w"}]})
    assert odd.method is CountMethod.ESTIMATE
    assert len(caplog.records) == 3


# --------------------------------------------------------------------------------------------
# Fallbacks and the upstream protocol (fake /tokenize)
# --------------------------------------------------------------------------------------------


class FakeTokenize:
    """A /tokenize that answers ``count = len(prompt)`` after all expected calls arrived."""

    def __init__(self, status: int = 200, expect_concurrent: int = 1) -> None:
        self.status = status
        self.calls: list[dict[str, Any]] = []
        self.expect = expect_concurrent
        self.arrived = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/tokenize"
        payload = json.loads(request.content)
        self.calls.append(payload)
        if len(self.calls) >= self.expect:
            self.arrived.set()
        # Each call waits for the others: this only finishes if they are in flight together.
        await asyncio.wait_for(self.arrived.wait(), timeout=5)
        if self.status != 200:
            return httpx.Response(
                self.status,
                json={
                    "error": {
                        "message": "bad\nprompt",
                        "type": "BadRequestError",
                        "param": None,
                        "code": self.status,
                    }
                },
            )
        text = payload.get("prompt") or json.dumps(payload.get("messages"))
        return httpx.Response(200, json={"count": len(text), "max_model_len": 777, "tokens": []})


async def test_a_list_of_prompts_is_one_concurrent_call_per_prompt() -> None:
    fake = FakeTokenize(expect_concurrent=3)
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        counter = PromptCounter(
            client=http, upstream="http://vllm:8000/", served_model="tiny", tokenizer_path=None
        )
        count = await counter.count(
            "completions", {"prompt": ["a", "bb", "ccc"], "add_special_tokens": False}
        )
    assert (count.prompts, count.method) == ((1, 2, 3), CountMethod.UPSTREAM)
    assert sorted(c["prompt"] for c in fake.calls) == ["a", "bb", "ccc"]
    assert all(c["model"] == "tiny" and c["add_special_tokens"] is False for c in fake.calls)
    assert counter.max_model_len == 777  # learnt from the answer


async def test_chat_goes_upstream_with_the_template_inputs() -> None:
    fake = FakeTokenize()
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        counter = PromptCounter(
            client=http, upstream="http://vllm:8000", served_model="tiny", tokenizer_path=None
        )
        count = await counter.count(
            "chat",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [WEATHER_TOOL],
                "documents": [{"title": "t", "text": "x"}],
                "chat_template_kwargs": {"enable_thinking": False},
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
        )
    assert count.method is CountMethod.UPSTREAM
    (call,) = fake.calls
    assert call["tools"] == [chat_tool(WEATHER_TOOL)]
    assert call["chat_template_kwargs"] == {
        "enable_thinking": False,
        "documents": [{"title": "t", "text": "x"}],
    }
    assert (call["add_generation_prompt"], call["continue_final_message"]) == (False, True)
    assert call["add_special_tokens"] is False


async def test_responses_go_upstream_as_chat_messages() -> None:
    fake = FakeTokenize()
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        counter = PromptCounter(
            client=http, upstream="http://vllm:8000", served_model="tiny", tokenizer_path=None
        )
        await counter.count(
            "responses",
            {
                "instructions": "sys",
                "input": [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "a"},
                            {"type": "input_image", "image_url": "http://x/y.png"},
                        ],
                    }
                ],
            },
        )
    (call,) = fake.calls
    assert call["messages"] == [
        {"role": "system", "content": "sys"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
            ],
        },
    ]
    assert call["add_special_tokens"] is True


async def test_upstream_400_is_a_one_line_prompt_error() -> None:
    fake = FakeTokenize(status=400)
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        counter = PromptCounter(
            client=http, upstream="http://vllm:8000", served_model=None, tokenizer_path=None
        )
        with pytest.raises(PromptError) as refused:
            await counter.count("completions", {"prompt": "x"})
    assert str(refused.value) == "bad prompt"
    assert "model" not in fake.calls[0]


@pytest.mark.parametrize("status", [404, 500, 503])
async def test_upstream_failures_give_estimates_and_one_warning_a_minute(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeTokenize(status=status)
    caplog.set_level(logging.WARNING, logger="sidecar.counting.counter")
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        counter = PromptCounter(
            client=http, upstream="http://vllm:8000", served_model=None, tokenizer_path=None
        )
        counts = [await counter.count("completions", {"prompt": "hello"}) for _ in range(5)]
    assert {c.method for c in counts} == {CountMethod.ESTIMATE}
    assert all(c.total >= len("hello") for c in counts)
    assert len(fake.calls) == 1  # not asked again right after failing
    assert len(caplog.records) == 1
    assert "unavailable" in caplog.records[0].getMessage()


async def test_connection_refused_gives_an_estimate() -> None:
    async with httpx.AsyncClient() as http:
        counter = PromptCounter(
            client=http, upstream=closed_port_url(), served_model=None, tokenizer_path=None
        )
        count = await counter.count("chat", {"messages": [{"role": "user", "content": "hi"}]})
    assert count.method is CountMethod.ESTIMATE
    assert count.total > 0


async def test_an_unloadable_tokenizer_falls_back_upstream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sidecar.counting.counter")
    fake = FakeTokenize()
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        counter = PromptCounter(
            client=http, upstream="http://vllm:8000", served_model=None, tokenizer_path=tmp_path
        )
        try:
            assert not await counter.wait_ready()
            count = await counter.count("completions", {"prompt": "abc"})
        finally:
            counter.close()
    assert count.method is CountMethod.UPSTREAM
    assert any("cannot load the tokenizer" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------------
# Local counting: offload, robustness, speed (the generated model's tokenizer, no vLLM)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def recording_tokenizer(
    tiny_tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[int]]:
    """Thread ids of every ``encode_text`` call."""
    threads: list[int] = []
    original = tiny_tokenizer.encode_text

    def encode_text(text: str, *, add_special_tokens: bool) -> list[int]:
        threads.append(threading.get_ident())
        return original(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(tiny_tokenizer, "encode_text", encode_text)
    yield threads


async def test_long_prompts_are_counted_off_the_event_loop(
    tiny_tokenizer: ModelTokenizer, recording_tokenizer: list[int]
) -> None:
    counter = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=tiny_tokenizer,
        offload_threshold_chars=2000,
    )
    try:
        loop_thread = threading.get_ident()
        await counter.count("chat", {"messages": [{"role": "user", "content": "short"}]})
        assert recording_tokenizer == [loop_thread]

        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        ticking = asyncio.create_task(ticker())
        huge = "the cache block " * 40_000  # 640k chars: tens of milliseconds to tokenize
        count = await counter.count("chat", {"messages": [{"role": "user", "content": huge}]})
        stop.set()
        await ticking
        assert count.method is CountMethod.LOCAL
        assert recording_tokenizer[-1] != loop_thread
        assert ticks > 1  # the loop kept running while the worker thread tokenized
    finally:
        counter.close()


async def test_a_local_count_vllm_disagrees_with_moves_the_shape_upstream(
    tiny_tokenizer: ModelTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeTokenize()  # counts characters: not what the tokenizer says
    observer = RecordingObserver()
    caplog.set_level(logging.ERROR, logger="sidecar.counting.counter")
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        counter = PromptCounter(
            client=http,
            upstream="http://vllm:8000",
            served_model="tiny",
            tokenizer_path=None,
            tokenizer=tiny_tokenizer,
            observer=observer,
        )
        first = await counter.count("completions", {"prompt": "hello world"})
        await wait_checks(counter)
        second = await counter.count("completions", {"prompt": "hello world"})
        chat = await counter.count("chat", {"messages": [{"role": "user", "content": "x"}]})
        await wait_checks(counter)
        counter.close()
    assert (first.method, first.prompts) == (CountMethod.LOCAL, (3,))
    assert (second.method, second.prompts) == (CountMethod.UPSTREAM, (11,))
    assert chat.method is CountMethod.LOCAL  # chat is checked on its own
    assert observer.checks == [
        (PromptShape.COMPLETIONS_TEXT, False),
        (PromptShape.CHAT_TEXT, False),
    ]
    assert any("differs from vLLM's /tokenize" in r.getMessage() for r in caplog.records)


async def test_harmony_models_chat_counts_are_flagged(
    tiny_tokenizer: ModelTokenizer, tmp_path: Path
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tiny_tokenizer.path / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    harmony = ModelTokenizer.load(tmp_path)
    assert harmony.harmony
    counter = PromptCounter(
        client=None, upstream=None, served_model=None, tokenizer_path=None, tokenizer=harmony
    )
    chat = await counter.count("chat", {"messages": [{"role": "user", "content": "hi"}]})
    text = await counter.count("completions", {"prompt": "hi"})
    assert chat.method is CountMethod.ESTIMATE
    assert text.method is CountMethod.LOCAL


async def test_a_local_failure_costs_precision_not_the_request(
    tiny_tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("template exploded")

    monkeypatch.setattr(tiny_tokenizer, "render_chat", broken)
    counter = PromptCounter(
        client=None, upstream=None, served_model=None, tokenizer_path=None, tokenizer=tiny_tokenizer
    )
    count = await counter.count("chat", {"messages": [{"role": "user", "content": "hi"}]})
    assert count.method is CountMethod.ESTIMATE


async def test_local_counts_are_fast(tiny_tokenizer: ModelTokenizer) -> None:
    counter = PromptCounter(
        client=None, upstream=None, served_model=None, tokenizer_path=None, tokenizer=tiny_tokenizer
    )
    short = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
        ]
    }
    long_text = "The cache block token request model server queue memory budget. " * 230
    assert 2500 < tiny_tokenizer.count_text(long_text, add_special_tokens=False) < 3500
    long = {"messages": [{"role": "user", "content": long_text}]}
    try:
        for body in (short, long):
            await counter.count("chat", body)  # warm the template cache and the thread pool
        timings = {}
        for name, body in (("short chat", short), ("~3000-token chat", long)):
            samples = [(await counter.count("chat", body)).seconds for _ in range(20)]
            timings[name] = sorted(samples)[len(samples) // 2]
        print(  # shown with -s; the numbers quoted in docs come from here
            "local count median: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in timings.items())
        )
        # not a speed target (bench.counting measures those): a count that took seconds would
        # mean it stopped being the tokenizer's and became something else
        assert timings["short chat"] < 1.0, timings
        assert timings["~3000-token chat"] < 5.0, timings
    finally:
        counter.close()


def test_token_count_total() -> None:
    count = TokenCount((3, 4), CountMethod.UPSTREAM, 0.001)
    assert count.total == 7
    assert count.exact
    assert not TokenCount((1,), CountMethod.ESTIMATE, 0.0).exact


async def test_estimates_never_undercount_the_table(tiny_tokenizer: ModelTokenizer) -> None:
    """The estimator alone (no upstream at all) against the tokenizer, for every shape."""
    local = PromptCounter(
        client=None, upstream=None, served_model=None, tokenizer_path=None, tokenizer=tiny_tokenizer
    )
    blind = PromptCounter(client=None, upstream=None, served_model=None, tokenizer_path=None)
    for shape_id, endpoint, body in SHAPES:
        exact = await local.count(endpoint, body)  # type: ignore[arg-type]
        estimate = await blind.count(endpoint, body)  # type: ignore[arg-type]
        assert estimate.method in (CountMethod.ESTIMATE, CountMethod.LOCAL), shape_id
        for guessed, counted in zip(estimate.prompts, exact.prompts, strict=True):
            assert guessed >= counted, (shape_id, guessed, counted)


# --------------------------------------------------------------------------------------------
# Truncation: vLLM's rule, applied once, by the counter, whichever way it counted
# --------------------------------------------------------------------------------------------


async def test_every_way_of_counting_truncates() -> None:
    blind = PromptCounter(
        client=None, upstream=None, served_model=None, tokenizer_path=None, max_model_len=1024
    )
    estimate = await blind.count(
        "completions", {"prompt": "x" * 5000, "truncate_prompt_tokens": 10}
    )
    assert (estimate.method, estimate.prompts) == (CountMethod.ESTIMATE, (10,))
    ids = await blind.count(
        "completions", {"prompt": [[1] * 2000, [2] * 5], "truncate_prompt_tokens": -1}
    )
    assert (ids.method, ids.prompts) == (CountMethod.LOCAL, (1023, 5))  # default max_tokens 16
    chat_estimate = await blind.count(
        "chat",
        {"messages": [{"role": "user", "content": "y" * 3000}], "truncate_prompt_tokens": -1},
    )
    assert chat_estimate.prompts == (1024,)  # no max_tokens: the whole context may be kept

    async with httpx.AsyncClient(transport=httpx.MockTransport(FakeTokenize())) as http:
        upstream = PromptCounter(
            client=http, upstream="http://vllm:8000", served_model=None, tokenizer_path=None
        )
        body = {"prompt": "z" * 1000, "truncate_prompt_tokens": -1, "max_tokens": 5}
        counted = await upstream.count("completions", body)
    # max_model_len learnt from /tokenize (777), one token held back for the output
    assert (counted.method, counted.prompts) == (CountMethod.UPSTREAM, (776,))


@pytest.mark.parametrize(
    ("truncation", "truncated"),
    [(None, True), ("auto", True), ("disabled", False), ("absent", False)],
)
async def test_responses_truncate_unless_disabled_as_vllm(
    truncation: str | None, truncated: bool
) -> None:
    """vLLM: ``-1 if request.truncation != "disabled" else None`` (a null truncates)."""
    counter = PromptCounter(
        client=None, upstream=None, served_model=None, tokenizer_path=None, max_model_len=100
    )
    body: dict[str, Any] = {"input": "x" * 3000, "max_output_tokens": 10}
    if truncation != "absent":
        body["truncation"] = truncation
    count = await counter.count("responses", body)
    if truncated:
        assert count.prompts == (99,)
    else:
        assert count.prompts[0] > 3000


async def test_the_projection_gets_counts_truncated_once() -> None:
    """As the generation path projects: parse, count, project with the parsed request."""
    counter = PromptCounter(
        client=None, upstream=None, served_model=None, tokenizer_path=None, max_model_len=1024
    )
    blocks = UniformBlocks(16)

    async def projected(endpoint: Endpoint, body: dict[str, Any]) -> tuple[int, ...]:
        request = parse_generation(endpoint, json.dumps(body).encode())
        count = await counter.count(*counting_view(request))
        projection = project_counts(
            count.prompts,
            requested_max_tokens=request.max_tokens,
            n=request.n,
            max_model_len=1024,
            blocks=blocks,
            max_tokens_param=request.max_tokens_param,
            exact=count.exact,
        )
        assert projection.prompt_tokens == count.prompts
        return projection.prompt_tokens + projection.max_tokens

    ids = {"prompt": [1] * 2000, "truncate_prompt_tokens": -1, "max_tokens": 8}
    assert await projected("completions", ids) == (1023, 1)
    # Not a Responses field: vLLM ignores it, and so must the sidecar.
    stray = {"input": "x" * 40, "truncate_prompt_tokens": 5, "max_output_tokens": 8}
    prompt, _ = await projected("responses", stray)
    assert prompt > 40


# --------------------------------------------------------------------------------------------
# The self-check: sampled per request shape, off the request path, told to an observer
# --------------------------------------------------------------------------------------------


class RecordingObserver:
    def __init__(self) -> None:
        self.checks: list[tuple[PromptShape, bool]] = []

    def self_checked(self, shape: PromptShape, matched: bool) -> None:
        self.checks.append((shape, matched))


class TokenizeAs:
    """A /tokenize that counts as ``tokenizer`` does, except chats with tools (off by 7)."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list[dict[str, Any]] = []
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        self.calls.append(payload)
        await self.release.wait()
        if "prompt" in payload:
            count = self.tokenizer.count_text(
                payload["prompt"], add_special_tokens=payload["add_special_tokens"]
            )
        else:
            kwargs = {
                "add_generation_prompt": payload["add_generation_prompt"],
                "continue_final_message": payload["continue_final_message"],
                "tools": payload.get("tools"),
            }
            rendered = self.tokenizer.render_chat(payload["messages"], kwargs)
            assert isinstance(rendered, str)
            count = self.tokenizer.count_text(rendered, add_special_tokens=False)
            if payload.get("tools"):
                count += 7
        return httpx.Response(200, json={"count": count, "max_model_len": 1024, "tokens": []})


async def test_self_checks_sample_each_shape_and_report_mismatches(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    fake = TokenizeAs(tiny_tokenizer)
    observer = RecordingObserver()
    chat = {"messages": [{"role": "user", "content": "the cache block"}]}
    tools = {**chat, "tools": [WEATHER_TOOL]}
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        counter = PromptCounter(
            client=http,
            upstream="http://vllm:8000",
            served_model="tiny",
            tokenizer_path=None,
            tokenizer=tiny_tokenizer,
            self_check_every=3,
            observer=observer,
        )
        for i in range(7):
            count = await counter.count("completions", {"prompt": f"hello {i}"})
            assert count.method is CountMethod.LOCAL
            await wait_checks(counter)
        first_tools = await counter.count("chat", tools)
        await wait_checks(counter)
        then_tools = await counter.count("chat", tools)
        plain = await counter.count("chat", chat)
        await wait_checks(counter)
        counter.close()
    # the first of each shape, then one in three
    assert observer.checks == [
        (PromptShape.COMPLETIONS_TEXT, True),
        (PromptShape.COMPLETIONS_TEXT, True),
        (PromptShape.COMPLETIONS_TEXT, True),
        (PromptShape.CHAT_TEXT_TOOLS, False),
        (PromptShape.CHAT_TEXT, True),
    ]
    assert [c.get("prompt") for c in fake.calls[:3]] == ["hello 0", "hello 3", "hello 6"]
    # the mismatched shape goes upstream from then on; the others stay local
    assert first_tools.method is CountMethod.LOCAL
    assert (then_tools.method, then_tools.total) == (CountMethod.UPSTREAM, first_tools.total + 7)
    assert plain.method is CountMethod.LOCAL


async def test_self_checks_never_delay_a_request_nor_pile_up(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    fake = TokenizeAs(tiny_tokenizer)
    fake.release.clear()  # /tokenize answers only when the test says so
    observer = RecordingObserver()
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        counter = PromptCounter(
            client=http,
            upstream="http://vllm:8000",
            served_model="tiny",
            tokenizer_path=None,
            tokenizer=tiny_tokenizer,
            self_check_every=2,
            observer=observer,
        )
        counts = await asyncio.wait_for(
            asyncio.gather(*(counter.count("completions", {"prompt": "hi"}) for _ in range(10))),
            timeout=5,
        )
        assert {c.method for c in counts} == {CountMethod.LOCAL}
        await asyncio.sleep(0)
        assert len(fake.calls) == 1  # one check in flight for the shape, however many are due
        assert observer.checks == []
        fake.release.set()
        await wait_checks(counter)
        counter.close()
    assert observer.checks == [(PromptShape.COMPLETIONS_TEXT, True)]


def test_the_self_check_rate_is_bounded() -> None:
    with pytest.raises(ValueError, match="1 in"):
        PromptCounter(
            client=None,
            upstream=None,
            served_model=None,
            tokenizer_path=None,
            self_check_every=1,
        )


# --------------------------------------------------------------------------------------------
# Prefix: the chain hashes of the full blocks vLLM will cache, from the counted ids
# --------------------------------------------------------------------------------------------

#: ~300 tokens of system prompt (2+ blocks of 128), then two different user turns.
SHARED_SYSTEM = " ".join(f"Rule {i}: keep the cache block warm for the queue." for i in range(13))
USER_A = "Please answer one question about the memory budget. " * 12
USER_B = "Thanks, now tell me how the decode batch uses the gpu kernel. " * 12


@pytest.fixture(scope="session")
def hf_left() -> Any:
    """The generated model's tokenizer as vLLM loads it for generation: truncating on the left."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tokenizer_model()), truncation_side="left")


def vllm_text_ids(hf: Any, text: str, *, add_special_tokens: bool, keep: int | None) -> list[int]:
    """vLLM's tokenizer call (``TokenizeParams.get_encode_kwargs``): truncation by the tokenizer."""
    if keep is None:
        return list(hf(text, add_special_tokens=add_special_tokens)["input_ids"])
    encoded = hf(text, add_special_tokens=add_special_tokens, truncation=True, max_length=keep)
    return list(encoded["input_ids"])


def vllm_chat_ids(hf: Any, messages: list[dict[str, Any]], *, keep: int | None = None) -> list[int]:
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return vllm_text_ids(hf, text, add_special_tokens=False, keep=keep)


def hashes_of(ids_per_prompt: list[list[int]], block_size: int, model: str | None = None) -> Any:
    salt = (model, None)
    return tuple(block_hashes(ids, block_size=block_size, salt=salt) for ids in ids_per_prompt)


PREFIX_CASES: list[tuple[str, str, dict[str, Any], Any]] = [
    (
        "cmpl-text",
        "completions",
        {"prompt": LONG_TEXT},
        lambda hf: [vllm_text_ids(hf, LONG_TEXT, add_special_tokens=True, keep=None)],
    ),
    (
        "cmpl-texts",
        "completions",
        {"prompt": [LONG_TEXT, "the cache block " * 20]},
        lambda hf: [
            vllm_text_ids(hf, p, add_special_tokens=True, keep=None)
            for p in (LONG_TEXT, "the cache block " * 20)
        ],
    ),
    (
        "cmpl-ids",
        "completions",
        {"prompt": [list(range(40)), list(range(5, 50))]},
        lambda hf: [list(range(40)), list(range(5, 50))],
    ),
    (
        "cmpl-truncated",
        "completions",
        {"prompt": LONG_TEXT, "truncate_prompt_tokens": 50},
        lambda hf: [vllm_text_ids(hf, LONG_TEXT, add_special_tokens=True, keep=50)],
    ),
    (
        "cmpl-truncated-to-context",
        "completions",
        {"prompt": OVERLONG_TEXT, "truncate_prompt_tokens": -1},  # default max_tokens 16
        lambda hf: [vllm_text_ids(hf, OVERLONG_TEXT, add_special_tokens=True, keep=1023)],
    ),
    (
        "cmpl-ids-truncated",
        "completions",
        {"prompt": list(range(100)), "truncate_prompt_tokens": 40},
        lambda hf: [list(range(60, 100))],  # the last 40: vLLM truncates on the left
    ),
    (
        "chat",
        "chat",
        {
            "messages": [
                {"role": "system", "content": SHARED_SYSTEM},
                {"role": "user", "content": USER_A},
            ]
        },
        lambda hf: [
            vllm_chat_ids(
                hf,
                [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": USER_A}],
            )
        ],
    ),
    (
        "chat-truncated",
        "chat",
        {"messages": [{"role": "user", "content": USER_B}], "truncate_prompt_tokens": 70},
        lambda hf: [vllm_chat_ids(hf, [{"role": "user", "content": USER_B}], keep=70)],
    ),
    (
        "chat-forwarded-ids",
        "chat",
        {
            "messages": HI,
            "kv_transfer_params": {"prompt_token_ids": list(range(3, 60))},
            "truncate_prompt_tokens": 10,  # vLLM feeds forwarded ids to the engine as they are
        },
        lambda hf: [list(range(3, 60))],
    ),
]


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [c[1:] for c in PREFIX_CASES],
    ids=[c[0] for c in PREFIX_CASES],
)
async def test_local_prefix_is_the_block_hashes_of_the_ids_vllm_caches(
    tiny_tokenizer: ModelTokenizer, hf_left: Any, endpoint: str, body: dict[str, Any], expected: Any
) -> None:
    counter = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=tiny_tokenizer,
        max_model_len=1024,
        block_size=16,
    )
    ids = expected(hf_left)
    count = await counter.count(endpoint, body)  # type: ignore[arg-type]
    assert count.method is CountMethod.LOCAL
    assert count.prompts == tuple(len(i) for i in ids)
    assert count.prefix is not None and count.prefix == hashes_of(ids, 16)
    assert all(len(h) == n // 16 for h, n in zip(count.prefix, count.prompts, strict=True))


@pytest.mark.parametrize("add_special_tokens", [True, False])
async def test_truncation_keeps_the_tokens_the_tokenizer_adds(add_special_tokens: bool) -> None:
    """A tokenizer that adds BOS and EOS: vLLM's left truncation keeps both, cuts the text."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    path = ensure_tokenizer_model()
    hf = AutoTokenizer.from_pretrained(str(path), truncation_side="left")
    bos, eos = hf.bos_token_id, hf.eos_token_id
    hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|eos|>", special_tokens=[("<|bos|>", bos), ("<|eos|>", eos)]
    )
    counter = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=ModelTokenizer.from_transformers(hf, path=path),
        block_size=4,
    )
    body = {
        "prompt": LONG_TEXT,
        "truncate_prompt_tokens": 22,
        "add_special_tokens": add_special_tokens,
    }
    kept = vllm_text_ids(hf, LONG_TEXT, add_special_tokens=add_special_tokens, keep=22)
    if add_special_tokens:
        assert (kept[0], kept[-1]) == (bos, eos)
    count = await counter.count("completions", body)
    assert count.prompts == (22,)
    assert count.prefix == hashes_of([kept], 4)


async def test_no_prefix_without_the_exact_ids(
    tiny_tokenizer: ModelTokenizer, tmp_path: Path
) -> None:
    text = {"prompt": LONG_TEXT}
    off = PromptCounter(
        client=None, upstream=None, served_model=None, tokenizer_path=None, tokenizer=tiny_tokenizer
    )
    assert (await off.count("completions", text)).prefix is None  # no block_size: no hashing
    blind = PromptCounter(
        client=None, upstream=None, served_model=None, tokenizer_path=None, block_size=16
    )
    estimate = await blind.count("completions", text)
    assert (estimate.method, estimate.prefix) == (CountMethod.ESTIMATE, None)
    chat_estimate = await blind.count("chat", {"messages": [{"role": "user", "content": USER_A}]})
    assert (chat_estimate.method, chat_estimate.prefix) == (CountMethod.ESTIMATE, None)

    local = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=tiny_tokenizer,
        block_size=16,
    )
    assert (await local.count("completions", text)).prefix is not None
    fim = await local.count("completions", {"prompt": LONG_TEXT, "suffix": "x"})
    assert (fim.method, fim.prefix) == (CountMethod.ESTIMATE, None)
    # prompt logprobs make vLLM skip the prefix cache: nothing is shared
    logprobs = await local.count("completions", {**text, "prompt_logprobs": 1})
    assert (logprobs.method, logprobs.prefix) == (CountMethod.LOCAL, None)
    echo = await local.count("completions", {**text, "echo": True, "logprobs": 2})
    assert echo.prefix is None
    assert (await local.count("completions", {**text, "echo": True})).prefix is not None
    chat_echo = await local.count("chat", {"messages": HI, "echo": True})
    assert chat_echo.prefix is None

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tiny_tokenizer.path / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    harmony = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=ModelTokenizer.load(tmp_path),
        block_size=16,
    )
    rendered_otherwise = await harmony.count(
        "chat", {"messages": [{"role": "user", "content": USER_A}]}
    )
    assert (rendered_otherwise.method, rendered_otherwise.prefix) == (CountMethod.ESTIMATE, None)


def test_a_tokenizer_json_truncation_or_padding_is_not_applied() -> None:
    """vLLM's tokenizer call turns both off unless asked; the Rust tokenizer used here must too."""
    from transformers import AutoTokenizer

    path = ensure_tokenizer_model()
    hf = AutoTokenizer.from_pretrained(str(path))
    whole = len(hf(LONG_TEXT)["input_ids"])
    hf.backend_tokenizer.enable_truncation(8)
    hf.backend_tokenizer.enable_padding(length=4096, pad_id=hf.pad_token_id)
    tokenizer = ModelTokenizer.from_transformers(hf, path=path)
    assert tokenizer.count_text(LONG_TEXT, add_special_tokens=True) == whole


async def test_prefix_is_keyed_by_model_and_cache_salt(tiny_tokenizer: ModelTokenizer) -> None:
    counter = PromptCounter(
        client=None,
        upstream=None,
        served_model="tiny",
        tokenizer_path=None,
        tokenizer=tiny_tokenizer,
        block_size=16,
    )

    async def first_block(**extra: Any) -> int:
        count = await counter.count("completions", {"prompt": LONG_TEXT, **extra})
        assert count.prefix is not None
        return count.prefix[0][0]

    base = await first_block()
    assert await first_block(model="tiny") == base  # the served model, named or not
    assert await first_block(model="tiny-lora") != base  # an adapter's blocks are its own
    assert await first_block(cache_salt="tenant-a") != base
    assert await first_block(cache_salt="tenant-a") == await first_block(cache_salt="tenant-a")
    assert await first_block(cache_salt="tenant-a") != await first_block(cache_salt="tenant-b")


class TokenizeIds:
    """A /tokenize answering as vLLM's does (``tokens`` included), with ``tokenizer``."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        self.calls.append(payload)
        text = payload.get("prompt")
        if text is None:
            kwargs = {
                "add_generation_prompt": payload["add_generation_prompt"],
                "continue_final_message": payload["continue_final_message"],
                "tools": payload.get("tools"),
            }
            rendered = self.tokenizer.render_chat(payload["messages"], kwargs)
            assert isinstance(rendered, str)
            text = rendered
        ids = self.tokenizer.encode_text(text, add_special_tokens=payload["add_special_tokens"])
        return httpx.Response(200, json={"count": len(ids), "max_model_len": 1024, "tokens": ids})


async def test_upstream_prefix_hashes_the_ids_tokenize_answers(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    local = PromptCounter(
        client=None,
        upstream=None,
        served_model="tiny",
        tokenizer_path=None,
        tokenizer=tiny_tokenizer,
        max_model_len=1024,
        block_size=16,
    )
    chat = {
        "messages": [
            {"role": "system", "content": SHARED_SYSTEM},
            {"role": "user", "content": USER_B},
        ]
    }
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("completions", {"prompt": [LONG_TEXT, "the cache block " * 20]}),
        ("chat", chat),
        ("chat", {**chat, "truncate_prompt_tokens": 100}),
        (
            "completions",
            {"prompt": LONG_TEXT, "truncate_prompt_tokens": 64, "add_special_tokens": False},
        ),
    ]
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(TokenizeIds(tiny_tokenizer))
    ) as http:
        upstream = PromptCounter(
            client=http,
            upstream="http://vllm:8000",
            served_model="tiny",
            tokenizer_path=None,
            block_size=16,
        )
        for endpoint, body in bodies:
            by_vllm = await upstream.count(endpoint, body)  # type: ignore[arg-type]
            by_local = await local.count(endpoint, body)  # type: ignore[arg-type]
            assert by_vllm.method is CountMethod.UPSTREAM
            assert by_vllm.prompts == by_local.prompts
            assert by_vllm.prefix is not None and by_vllm.prefix == by_local.prefix, body
        # Truncated with special tokens: /tokenize does not say which ids the tokenizer added
        # (truncation keeps those), so the kept ids are not known: no prefix, the count stands.
        truncated = await upstream.count(
            "completions", {"prompt": LONG_TEXT, "truncate_prompt_tokens": 64}
        )
        assert (truncated.method, truncated.prompts, truncated.prefix) == (
            CountMethod.UPSTREAM,
            (64,),
            None,
        )
        whole = await upstream.count("completions", {"prompt": LONG_TEXT})
        assert whole.prefix is not None  # untruncated: every id is kept
    # A /tokenize whose ids are not those of its count gives no prefix, never a wrong one.
    async with httpx.AsyncClient(transport=httpx.MockTransport(FakeTokenize())) as http:
        odd = PromptCounter(
            client=http,
            upstream="http://vllm:8000",
            served_model=None,
            tokenizer_path=None,
            block_size=16,
        )
        answer = await odd.count("completions", {"prompt": "abc"})
        assert (answer.method, answer.prefix) == (CountMethod.UPSTREAM, None)


async def test_non_text_content_has_no_prefix(tiny_tokenizer: ModelTokenizer) -> None:
    """The placeholder ids /tokenize gives for an image are not what keys its blocks in vLLM
    (the image itself does): no prefix, although /tokenize answers consistent ids."""
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                ],
            }
        ]
    }
    ids = list(range(300))

    async def tokenize(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"count": len(ids), "max_model_len": 1024, "tokens": ids})

    async with httpx.AsyncClient(transport=httpx.MockTransport(tokenize)) as http:
        counter = PromptCounter(
            client=http,
            upstream="http://vllm:8000",
            served_model="tiny",
            tokenizer_path=None,
            tokenizer=tiny_tokenizer,
            block_size=16,
        )
        count = await counter.count("chat", body)
        text = await counter.count("chat", {"messages": [{"role": "user", "content": "x"}]})
    assert (count.method, count.prompts, count.prefix) == (CountMethod.UPSTREAM, (300,), None)
    assert text.prefix is not None


async def test_long_prompts_are_hashed_off_the_event_loop(tiny_tokenizer: ModelTokenizer) -> None:
    counter = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=tiny_tokenizer,
        block_size=16,
    )
    try:
        huge = "the cache block " * 40_000  # ~120k tokens: above the inline hashing limit
        count = await counter.count("completions", {"prompt": huge})
        ids = tiny_tokenizer.encode_text(huge, add_special_tokens=True)
        assert count.prompts == (len(ids),)
        assert count.prefix == hashes_of([ids], 16)
    finally:
        counter.close()


@pytest.mark.vllm
async def test_a_shared_system_prompt_shares_its_full_blocks_in_vllm(
    vllm: VllmInfo, served_tokenizer: ModelTokenizer, client: httpx.AsyncClient
) -> None:
    """Two chats with one long system prompt: their first k hashes agree, where k is the number
    of full blocks in the common prefix of the ids vLLM's /tokenize gives; the next differ. And
    vLLM itself reuses exactly those k blocks (its prefix-cache hits)."""
    block = vllm.block_size
    bodies = [
        {
            "model": vllm.served_name,
            "messages": [
                {"role": "system", "content": SHARED_SYSTEM},
                {"role": "user", "content": user},
            ],
            "max_tokens": 1,
        }
        for user in (USER_A, USER_B)
    ]
    vllm_ids = []
    for body in bodies:
        answer = await client.post(
            vllm.url + "/tokenize", json={"model": vllm.served_name, "messages": body["messages"]}
        )
        assert answer.status_code == 200, answer.text
        vllm_ids.append(answer.json()["tokens"])
    a_ids, b_ids = vllm_ids
    common = next(
        (i for i, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y),
        min(len(a_ids), len(b_ids)),
    )
    k = common // block
    assert k >= 1 and min(len(a_ids), len(b_ids)) >= (k + 1) * block, (common, block)

    local = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=served_tokenizer,
        max_model_len=vllm.max_model_len,
        block_size=block,
    )
    upstream = PromptCounter(
        client=client,
        upstream=vllm.url,
        served_model=vllm.served_name,
        tokenizer_path=None,
        block_size=block,
    )
    expected = [hashes_of([ids], block, vllm.served_name) for ids in vllm_ids]
    for counter, method in ((local, CountMethod.LOCAL), (upstream, CountMethod.UPSTREAM)):
        a, b = [await counter.count("chat", body) for body in bodies]
        assert (a.method, b.method) == (method, method)
        assert [a.prefix, b.prefix] == expected
        assert a.prefix is not None and b.prefix is not None
        assert a.prefix[0][:k] == b.prefix[0][:k]
        assert a.prefix[0][k] != b.prefix[0][k]

    cache = vllm.metrics_text()
    if 'enable_prefix_caching="True"' not in cache:
        return  # vLLM started without prefix caching: nothing to compare with
    # vLLM's own prefix cache: B, sent after A, finds exactly A's k shared blocks.
    for body in bodies[:1]:
        sent = await client.post(vllm.url + "/v1/chat/completions", json=body)
        assert sent.status_code == 200, sent.text
    before = metric_value(vllm.metrics_text(), "vllm:prefix_cache_hits_total") or 0.0
    sent = await client.post(vllm.url + "/v1/chat/completions", json=bodies[1])
    assert sent.status_code == 200, sent.text
    hits = 0.0
    for _ in range(50):  # vLLM publishes its counters a little after the step
        hits = (metric_value(vllm.metrics_text(), "vllm:prefix_cache_hits_total") or 0.0) - before
        if hits >= k * block:
            break
        await asyncio.sleep(0.1)
    print(f"shared prefix: {k} blocks of {block} tokens; vLLM's prefix-cache hits: {hits:g} tokens")
    assert hits == k * block
