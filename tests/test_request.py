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
