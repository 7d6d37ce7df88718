"""``--stream-usage`` in front of the real vLLM: a stream whose client asked for no usage is
asked for vLLM's count (on every event, or the final count), counted by it, and reaches its
client as vLLM sends it unasked (ids and timestamps aside: vLLM draws them per request; and
how the tokens fall into events aside: that varies with timing, see assert_as_vllm_sends_it); and
the vLLM 0.32 stream formats the fake and tests/test_stream_usage.py build on are the real
server's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from harness.workload import SidecarProcess, metric_value
from tests.conftest import VllmInfo
from tests.support.wait import wait_for

pytestmark = pytest.mark.vllm

TOKENS = 12


@pytest.fixture(scope="module", params=["every-event", "final"])
def sidecar(vllm: VllmInfo, request: pytest.FixtureRequest) -> Iterator[SidecarProcess]:
    """A sidecar asking vLLM for the usage on every event (worst-case mode's default), or for
    the final count only (the other modes')."""
    with SidecarProcess(vllm.url, "--stream-usage", request.param) as sc:
        yield sc


def _body(vllm: VllmInfo, chat: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": vllm.served_name,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": "Count the birds in the garden."}]
    else:
        body["prompt"] = "Count the birds in the garden."
    return body


def _post(url: str, path: str, body: dict[str, Any]) -> bytes:
    answer = httpx.post(url + path, json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.content


def _drawn(answer: bytes) -> bytes:
    """An answer with what vLLM draws per request blanked: its id and its timestamp."""
    answer = re.sub(rb'"id":"[^"]*"', b'"id":""', answer)
    return re.sub(rb'"created":\d+', b'"created":0', answer)


def _events(answer: bytes) -> list[bytes]:
    return [e for e in answer.split(b"\n\n") if e]


_TEXT = re.compile(rb'"(text|content)":"(?:[^"\\]|\\.)*"')


def _text(answer: bytes) -> str:
    """The answer's text, joined over its events."""
    parts = []
    for event in _events(answer)[:-1]:
        for choice in json.loads(event.removeprefix(b"data: "))["choices"]:
            parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def assert_as_vllm_sends_it(proxied: bytes, direct: bytes) -> None:
    """The proxied stream is one vLLM sends: its text is direct's, and every event is, text
    aside, one of direct's byte for byte, its last two direct's last two.
    Not the same list of events: vLLM's output collector merges the deltas its API server has
    not yet taken, so how one answer's tokens fall into events varies with timing (an empty
    delta sometimes stands alone, sometimes merges into the next), direct to direct. The last
    token's event may hold more text one time than another, so it too is compared text aside."""
    proxied, direct = _drawn(proxied), _drawn(direct)
    assert _events(proxied)[-1] == _events(direct)[-1] == b"data: [DONE]"
    assert _text(proxied) == _text(direct)
    forms = [_TEXT.sub(rb'"\1":""', e) for e in _events(direct)]
    proxied_forms = [_TEXT.sub(rb'"\1":""', e) for e in _events(proxied)]
    assert proxied_forms[-2:] == forms[-2:]
    for form in proxied_forms:
        assert form in forms, form


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_stream_formats_are_vllms(vllm: VllmInfo, chat: bool) -> None:
    """What sidecar/http/stream_usage.py strips, as vLLM 0.32 writes it: asked, every event
    carries the usage after its choices and a usage-only event carries the fingerprint;
    unasked, the last token's event carries it."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    options = {"include_usage": True, "continuous_usage_stats": True}
    asked = _events(_post(vllm.url, path, _body(vllm, chat, stream_options=options)))
    unasked = _events(_post(vllm.url, path, _body(vllm, chat)))
    assert asked[-1] == unasked[-1] == b"data: [DONE]"
    usage_only = json.loads(asked[-2].removeprefix(b"data: "))
    assert usage_only["choices"] == [] and usage_only["usage"]["completion_tokens"] == TOKENS
    assert "system_fingerprint" in usage_only
    for event in asked[:-2]:
        assert re.search(rb'\],"usage":\{"prompt_tokens":\d+,"total_tokens":\d+,', event), event
        assert b"system_fingerprint" not in event
    last = json.loads(unasked[-2].removeprefix(b"data: "))
    assert last["system_fingerprint"] == usage_only["system_fingerprint"]
    assert last["choices"][0]["finish_reason"] == "length"
    assert all(b'"usage"' not in e for e in unasked)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_that_asked_no_usage_reaches_its_client_as_vllm_sends_it(
    vllm: VllmInfo, sidecar: SidecarProcess, chat: bool
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    before = metric_value(sidecar.metrics(), "kv_sidecar_completion_tokens_total") or 0.0
    direct = _post(vllm.url, path, _body(vllm, chat))
    proxied = _post(sidecar.url, path, _body(vllm, chat))
    assert_as_vllm_sends_it(proxied, direct)
    wait_for(lambda: sidecar.state()["in_flight"] == 0, "the stream released", 30)
    after = metric_value(sidecar.metrics(), "kv_sidecar_completion_tokens_total")
    assert after == before + TOKENS


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_that_asked_for_the_final_count_reaches_its_client_as_asked(
    vllm: VllmInfo, sidecar: SidecarProcess, chat: bool
) -> None:
    """``include_usage`` alone (``vllm bench serve``'s ask): under ``every-event`` the sidecar
    asks for every event's count too and takes it out of all but the usage-only event; under
    ``final`` it sends the request as it came. Either way the client gets what vLLM sends it."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    options = {"include_usage": True}
    before = metric_value(sidecar.metrics(), "kv_sidecar_completion_tokens_total") or 0.0
    direct = _post(vllm.url, path, _body(vllm, chat, stream_options=options))
    proxied = _post(sidecar.url, path, _body(vllm, chat, stream_options=options))
    assert_as_vllm_sends_it(proxied, direct)
    assert b'"usage"' in _events(proxied)[-2] and b'"usage"' not in _events(proxied)[-3]
    wait_for(lambda: sidecar.state()["in_flight"] == 0, "the stream released", 30)
    after = metric_value(sidecar.metrics(), "kv_sidecar_completion_tokens_total")
    assert after == before + TOKENS


def test_the_openai_client_streams_through_it_at_its_defaults(
    vllm: VllmInfo, sidecar: SidecarProcess
) -> None:
    """The official client, streaming a chat: unasked, no chunk has a usage; asked, its own
    usage-only chunk arrives as vLLM sends it."""
    client = openai.OpenAI(base_url=sidecar.url + "/v1", api_key="unused")
    messages: Any = [{"role": "user", "content": "Count the birds in the garden."}]

    def chunks(**options: Any) -> list[Any]:
        return list(
            client.chat.completions.create(
                model=vllm.served_name,
                messages=messages,
                max_tokens=TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
                **options,
            )
        )

    unasked = chunks()
    assert all(c.usage is None for c in unasked)
    assert unasked[-1].choices[0].finish_reason == "length"
    assert unasked[-1].system_fingerprint is not None
    text = "".join(c.choices[0].delta.content or "" for c in unasked if c.choices)
    assert text
    asked = chunks(stream_options={"include_usage": True})
    assert asked[-1].choices == [] and asked[-1].usage is not None
    assert asked[-1].usage.completion_tokens == TOKENS
    client.close()
