"""vLLM's render endpoints against the real vLLM (the session's CPU build, started with
``--enable-scale-out``): what the prompt counter gets from them is what vLLM uses.

* every request shape of ``tests/support/shapes.py``, counted by a counter without a tokenizer
  (render), equals the ``usage`` vLLM reports for the request sent, and the local count;
* ``/v1/messages`` (Anthropic's shape), which ``/tokenize`` cannot take: render's count equals
  vLLM's ``usage.input_tokens``;
* the ``max_tokens`` render resolves is the one vLLM generates up to (a chat without one: the
  rest of the context), and, for every shape, the one the sidecar's own rule projects;
* the self-check of local counts asks render and agrees on every self-checked shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from sidecar.counting import CountMethod, ModelTokenizer, PromptCounter, PromptShape
from sidecar.counting.request import parse_generation
from sidecar.counting.upstream import RenderDeclined, VllmCounting
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.projection import project_counts
from tests.conftest import VllmInfo
from tests.support.external import unless_external
from tests.support.shapes import SHAPES

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as http:
        yield http


@pytest.fixture
async def render_served(vllm: VllmInfo, client: httpx.AsyncClient) -> None:
    answer = await client.post(
        vllm.url + "/v1/completions/render", json={"model": vllm.served_name, "prompt": "hi"}
    )
    if answer.status_code != 200:
        unless_external(f"vLLM does not serve render (HTTP {answer.status_code})")


@pytest.fixture(scope="module")
def served_tokenizer(vllm: VllmInfo) -> ModelTokenizer:
    if vllm.model_dir is None:
        unless_external("the model directory of the external vLLM is not readable here")
    return ModelTokenizer.load(vllm.model_dir)


def render_counter(vllm: VllmInfo, client: httpx.AsyncClient, **kwargs: Any) -> PromptCounter:
    return PromptCounter(
        client=client,
        upstream=vllm.url,
        served_model=vllm.served_name,
        tokenizer_path=None,
        max_model_len=vllm.max_model_len,
        render="always",
        **kwargs,
    )


async def usage_of(
    vllm: VllmInfo, client: httpx.AsyncClient, endpoint: str, body: dict[str, Any]
) -> int:
    sent = await client.post(vllm.url + PATHS[endpoint], json={"model": vllm.served_name, **body})
    assert sent.status_code == 200, sent.text
    usage = sent.json()["usage"]
    return int(
        usage["input_tokens"] if endpoint in ("responses", "messages") else usage["prompt_tokens"]
    )


@pytest.mark.parametrize(("endpoint", "body"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
async def test_render_counts_every_shape_as_vllm_uses_it(
    vllm: VllmInfo,
    render_served: None,
    served_tokenizer: ModelTokenizer,
    client: httpx.AsyncClient,
    endpoint: str,
    body: dict[str, Any],
) -> None:
    counter = render_counter(vllm, client, block_size=16)
    local = PromptCounter(
        client=None,
        upstream=None,
        served_model=vllm.served_name,  # the prefix's salt, as the render counter's
        tokenizer_path=None,
        tokenizer=served_tokenizer,
        max_model_len=vllm.max_model_len,
        block_size=16,
    )
    # one output token, as vLLM's truncation to the context depends on it
    request = {**body, ("max_output_tokens" if endpoint == "responses" else "max_tokens"): 1}
    by_render = await counter.count(endpoint, request)  # type: ignore[arg-type]
    by_local = await local.count(endpoint, request)  # type: ignore[arg-type]
    prompt = body.get("prompt")
    token_ids = isinstance(prompt, list) and all(isinstance(p, int | list) for p in prompt)
    assert by_render.method is (CountMethod.LOCAL if token_ids else CountMethod.UPSTREAM)
    assert counter.upstream.render_off == ""
    assert by_render.prompts == by_local.prompts
    # the prefix's block hashes come from render's ids: the ones the local tokenizer makes
    assert by_render.prefix == by_local.prefix
    assert by_render.total == await usage_of(vllm, client, endpoint, request)


@pytest.mark.parametrize(("endpoint", "body"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
async def test_the_max_tokens_render_resolves_is_the_sidecars_projection(
    vllm: VllmInfo,
    render_served: None,
    client: httpx.AsyncClient,
    endpoint: str,
    body: dict[str, Any],
) -> None:
    """Every shape as its client sent it (most without max_tokens): the max_tokens vLLM
    resolves for each prompt is what the sidecar's own rule (``project_counts``, vLLM 0.32's
    ``get_max_tokens``) projects from the same counts, so the projection agrees with vLLM
    where render is not asked too."""
    counting = VllmCounting(client, vllm.url, served_model=vllm.served_name, timeout_s=30)
    raw = json.dumps({"model": vllm.served_name, **body}).encode()
    request = parse_generation(endpoint, raw)  # type: ignore[arg-type]

    def own(counts: tuple[int, ...]) -> tuple[int, ...]:
        return project_counts(
            counts,
            requested_max_tokens=request.requested_max_tokens,
            n=1,
            max_model_len=vllm.max_model_len,
            blocks=UniformBlocks(16),
        ).max_tokens

    try:
        rendered = await counting.render(endpoint, body)  # type: ignore[arg-type]
    except RenderDeclined as exc:
        # a prompt truncated to the whole context leaves no output token: vLLM refuses it
        # ("max_tokens must be at least 1, got 0"), and so does its generating endpoint
        assert "max_tokens must be at least 1, got 0" in str(exc), exc
        sent = await client.post(vllm.url + PATHS[endpoint], content=raw)
        assert sent.status_code == 400, sent.text
        counted = await render_counter(vllm, client).count(endpoint, body)  # type: ignore[arg-type]
        assert min(own(counted.prompts)) == 0  # what the sidecar projects for it
        return
    resolved = tuple(r.max_tokens for r in rendered)
    assert own(tuple(len(r.ids) for r in rendered)) == resolved


async def test_messages_render_counts_what_vllm_uses(
    vllm: VllmInfo, render_served: None, client: httpx.AsyncClient
) -> None:
    counting = VllmCounting(client, vllm.url, served_model=vllm.served_name, timeout_s=30)
    body = {
        "max_tokens": 3,
        "system": "You answer in one word.",
        "messages": [
            {"role": "user", "content": "What colour is the sky on a clear day?"},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": [{"type": "text", "text": "And at night?"}]},
        ],
    }
    rendered = await counting.render("messages", body)
    assert len(rendered) == 1
    assert len(rendered[0].ids) == await usage_of(vllm, client, "messages", body)
    assert rendered[0].max_tokens == 3


async def test_render_resolves_the_max_tokens_vllm_generates_up_to(
    vllm: VllmInfo, render_served: None, client: httpx.AsyncClient
) -> None:
    counting = VllmCounting(client, vllm.url, served_model=vllm.served_name, timeout_s=30)
    chat = {"messages": [{"role": "user", "content": "count to a thousand"}]}
    (rendered,) = await counting.render("chat", chat)
    # no max_tokens and no generation config: the rest of the context
    assert rendered.max_tokens == vllm.max_model_len - len(rendered.ids)
    (completion, _) = await counting.render("completions", {"prompt": ["one two", "three"]})
    assert completion.max_tokens == 16  # CompletionRequest's default, left out of the JSON
    sent = await client.post(
        vllm.url + "/v1/completions",
        json={"model": vllm.served_name, "prompt": "one two", "ignore_eos": True},
    )
    assert sent.status_code == 200, sent.text
    assert sent.json()["usage"]["completion_tokens"] == completion.max_tokens


class Observer:
    def __init__(self) -> None:
        self.checks: list[tuple[PromptShape, bool]] = []

    def self_checked(self, shape: PromptShape, matched: bool) -> None:
        self.checks.append((shape, matched))


async def test_self_checks_against_render_agree_on_every_checked_shape(
    vllm: VllmInfo,
    render_served: None,
    served_tokenizer: ModelTokenizer,
    client: httpx.AsyncClient,
) -> None:
    observer = Observer()
    counter = render_counter(vllm, client, tokenizer=served_tokenizer, observer=observer)
    seen: set[PromptShape] = set()
    for _, endpoint, body in SHAPES:
        count = await counter.count(endpoint, body)  # type: ignore[arg-type]
        assert count.method is CountMethod.LOCAL
    for _ in range(500):
        if not counter._checks:
            break
        await asyncio.sleep(0.02)
    seen = {shape for shape, _ in observer.checks}
    assert seen == {
        PromptShape.COMPLETIONS_TEXT,
        PromptShape.CHAT_TEXT,
        PromptShape.CHAT_TEXT_TOOLS,
        PromptShape.RESPONSES_TEXT,
        PromptShape.RESPONSES_TEXT_TOOLS,
    }
    assert all(matched for _, matched in observer.checks), observer.checks
    assert counter.upstream.render_off == ""
