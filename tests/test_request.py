"""Parsing and validating generation bodies: what is refused, and with which message."""

from __future__ import annotations

import json

import pytest

from sidecar.counting import PromptCounter
from sidecar.counting.request import parse_generation
from sidecar.errors import BadRequest, PromptError


def body(**kw: object) -> bytes:
    return json.dumps(kw).encode()


CHAT = [{"role": "user", "content": "hi"}]


def test_chat_fields() -> None:
    r = parse_generation(
        "chat",
        body(
            model="m",
            messages=CHAT,
            max_completion_tokens=9,
            max_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            foo="bar",
        ),
    )
    assert (r.max_tokens, r.max_tokens_param, r.n, r.stream) == (
        9,
        "max_completion_tokens",
        2,
        True,
    )
    assert r.body["foo"] == "bar"


def test_completions_prompt_shapes() -> None:
    for prompt in ("x", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert parse_generation("completions", body(prompt=prompt)).max_tokens is None


def test_responses_and_messages() -> None:
    r = parse_generation("responses", body(input="hello", max_output_tokens=5))
    assert (r.max_tokens, r.max_tokens_param) == (5, "max_output_tokens")
    m = parse_generation("messages", body(messages=CHAT, max_tokens=7))
    assert m.max_tokens == 7


@pytest.mark.parametrize(
    ("endpoint", "raw", "message", "param"),
    [
        ("chat", b"{not json", "not valid JSON", None),
        ("chat", b"[1, 2]", "must be a JSON object", None),
        ("chat", b"\xff\xfe", "not valid JSON", None),
        ("chat", body(messages=[]), "'messages' must be a non-empty list", "messages"),
        ("chat", body(messages="hi"), "'messages' must be a non-empty list", "messages"),
        ("chat", body(messages=[{"content": "x"}]), "role' must be a string", "messages"),
        (
            "chat",
            body(messages=CHAT, max_tokens=0),
            "'max_tokens' must be at least 1",
            "max_tokens",
        ),
        ("chat", body(messages=CHAT, max_tokens=-5), "at least 1", "max_tokens"),
        ("chat", body(messages=CHAT, max_tokens=2.5), "must be an integer", "max_tokens"),
        ("chat", body(messages=CHAT, max_tokens="10"), "must be an integer", "max_tokens"),
        ("chat", body(messages=CHAT, max_tokens=True), "must be an integer", "max_tokens"),
        ("chat", body(messages=CHAT, n=0), "'n' must be at least 1", "n"),
        ("chat", body(messages=CHAT, n=10_000), "'n' must be at most", "n"),
        ("chat", body(messages=CHAT, stream="yes"), "'stream' must be a boolean", "stream"),
        ("chat", body(messages=CHAT, model=5), "'model' must be a string", "model"),
        ("completions", body(max_tokens=5), "'prompt' is required", "prompt"),
        ("completions", body(prompt=[]), "'prompt' must be", "prompt"),
        ("completions", body(prompt=[1, "a"]), "non-negative integers", "prompt"),
        ("completions", body(prompt=[[1], []]), "non-empty lists", "prompt"),
        ("completions", body(prompt={"a": 1}), "'prompt' must be", "prompt"),
        ("messages", body(messages=CHAT), "'max_tokens' is required", "max_tokens"),
        ("responses", body(input=5), "'input' must be", "input"),
    ],
)
def test_bad_bodies(endpoint: str, raw: bytes, message: str, param: str | None) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        parse_generation(endpoint, raw)  # type: ignore[arg-type]
    assert info.value.param == param
    assert info.value.status == 400


def test_huge_integer_and_deep_nesting() -> None:
    with pytest.raises(BadRequest):
        parse_generation("chat", b'{"messages": [{"role": "user", "content": "x"}], "n": 1e400}')
    deep = (
        b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 200 + b"]" * 200 + b"}"
    )
    with pytest.raises(BadRequest, match="nested"):
        parse_generation("chat", deep)
    deeper = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(BadRequest):
        parse_generation("chat", deeper)


def test_float_integers_are_accepted_like_pydantic() -> None:
    assert parse_generation("chat", body(messages=CHAT, max_tokens=16.0)).max_tokens == 16


def test_a_long_token_id_prompt_is_one_prompt() -> None:
    assert parse_generation("completions", body(prompt=[7] * 5000)).n == 1
    with pytest.raises(BadRequest, match="more than 1024 prompts"):
        parse_generation("completions", body(prompt=["x"] * 1025))


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"content": "no role"}],
        [{"role": 5, "content": "x"}],
        [{"role": "user", "content": 5}],
    ],
    ids=repr,
)
async def test_messages_are_checked_once_for_parsing_and_counting(messages: object) -> None:
    """One check, one message: the proxy's parse and the prompt counter refuse alike."""
    with pytest.raises(BadRequest) as parsed:
        parse_generation("chat", body(messages=messages))
    counter = PromptCounter(client=None, upstream=None, served_model=None, tokenizer_path=None)
    with pytest.raises(PromptError) as counted:
        await counter.count("chat", {"messages": messages})
    assert str(counted.value) == str(parsed.value)
    assert parsed.value.param == "messages"


# --- vLLM 0.32's max_tokens defaults per endpoint -----------------------------------------------


@pytest.mark.parametrize(
    ("raw", "client", "requested"),
    [
        (body(prompt="x"), None, 16),  # CompletionRequest.max_tokens: int | None = 16
        (body(prompt="x", max_tokens=None), None, 16),  # normalize_null_max_tokens: also 16
        (body(prompt="x", max_tokens=5), 5, 5),
        (body(prompt="x", max_tokens=5000), 5000, 5000),  # refused later, by the projection
        (body(prompt="x", echo=True, max_tokens=0), 0, 1),  # echo_without_generation: 1 token
    ],
    ids=["absent", "null", "explicit", "too-large", "echo-0"],
)
def test_completions_default_is_16_absent_or_null(
    raw: bytes, client: int | None, requested: int
) -> None:
    r = parse_generation("completions", raw)
    assert (r.max_tokens, r.requested_max_tokens, r.max_tokens_param) == (
        client,
        requested,
        "max_tokens",
    )


def test_max_tokens_0_without_echo_is_refused_as_vllm_does() -> None:
    for raw in (body(prompt="x", max_tokens=0), body(prompt="x", echo=False, max_tokens=0)):
        with pytest.raises(BadRequest, match="at least 1"):
            parse_generation("completions", raw)
    with pytest.raises(BadRequest, match="at least 1"):
        parse_generation("chat", body(messages=CHAT, echo=True, max_tokens=0))


@pytest.mark.parametrize(
    ("fields", "requested", "param"),
    [
        ({}, None, "max_tokens"),
        ({"max_tokens": None}, None, "max_tokens"),
        ({"max_tokens": None, "max_completion_tokens": None}, None, "max_tokens"),
        ({"max_tokens": 7}, 7, "max_tokens"),
        ({"max_completion_tokens": 9}, 9, "max_completion_tokens"),
        ({"max_completion_tokens": 9, "max_tokens": 3}, 9, "max_completion_tokens"),
        ({"max_completion_tokens": None, "max_tokens": 3}, 3, "max_tokens"),
    ],
)
def test_chat_prefers_max_completion_tokens_and_leaves_none_to_the_server(
    fields: dict[str, object], requested: int | None, param: str
) -> None:
    r = parse_generation("chat", body(messages=CHAT, **fields))
    assert (r.max_tokens, r.requested_max_tokens, r.max_tokens_param) == (
        requested,
        requested,
        param,
    )


def test_responses_and_messages_defaults() -> None:
    # Responses: max_output_tokens None -> the generation config's default (get_max_tokens)
    for raw in (body(input="x"), body(input="x", max_output_tokens=None)):
        r = parse_generation("responses", raw)
        assert (r.requested_max_tokens, r.max_tokens_param) == (None, "max_output_tokens")
    # Anthropic messages: max_tokens is required and positive
    assert parse_generation("messages", body(messages=CHAT, max_tokens=3)).requested_max_tokens == 3
    with pytest.raises(BadRequest, match="required"):
        parse_generation("messages", body(messages=CHAT, max_tokens=None))
