"""vLLM's render endpoints as the prompt counter's fallback and self-check oracle, against the fake
vLLM (``harness.fake_vllm``, whose render endpoints answer as vLLM 0.32's source does: 403 unless
``scale_out``, a ``GenerateRequest`` per engine prompt otherwise) and against the shapes a real
vLLM 0.32 CPU build answered (``fixtures/vllm-0.32.0-cpu/render-*.json``).

What is claimed: with render served, a counter without a tokenizer counts every endpoint in one
call and asks ``/tokenize`` nothing; shapes /tokenize cannot count (``suffix``) go to render and
come back as estimates when it refuses; without render (vLLM's default 403, an old vLLM's 404,
an answer that is not render's) the counter counts with /tokenize and tries render again only a
minute later; a body render would refuse for its own reasons (beam search) never reaches it; a
render refusal is never a 400 of the sidecar's; render's ids give the prefix's block hashes;
the self-check asks render, not /tokenize, and reports a disagreement.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import sidecar.counting.upstream as upstream_module
from harness.fake_vllm import FakeServer, FakeVllm
from harness.vllm_cpu import free_port
from harness.vllm_formats import RENDER_DISABLED_ERROR, count_prompt
from sidecar.counting import CountMethod, ModelTokenizer, PromptCounter, PromptShape
from sidecar.counting.upstream import RENDER_PATHS, RENDER_RETRY_S, VllmCounting
from sidecar.kv.prefix import block_hashes
from tests.support.fake_upstream import serve_fresh
from tests.support.stack import run_sidecar

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-0.32.0-cpu"
HI = [{"role": "user", "content": "hello there my friend"}]


@pytest.fixture
def fake(server: FakeServer, model_dir: Path) -> FakeVllm:
    app = FakeVllm(model_root=model_dir)
    app.scale_out = True
    serve_fresh(server, app)
    return app


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


def counter_for(http: httpx.AsyncClient, url: str, **kwargs: Any) -> PromptCounter:
    return PromptCounter(
        client=http,
        upstream=url,
        served_model="tiny",
        tokenizer_path=None,
        max_model_len=1024,
        render="always",
        **kwargs,
    )


def paths(app: FakeVllm) -> list[str]:
    return [r.path for r in app.requests if r.method == "POST"]


# --- the fake's render endpoints answer in vLLM's shape -----------------------------------------


def test_the_fakes_answers_have_the_real_vllms_fields(fake: FakeVllm) -> None:
    for path, fixture, body in (
        ("/v1/chat/completions/render", "render-chat.json", {"messages": HI, "max_tokens": 7}),
        ("/v1/completions/render", "render-completions.json", {"prompt": ["a b", "c"]}),
    ):
        real = json.loads((FIXTURES / fixture).read_text())
        status, raw = fake.render(path, json.dumps({"model": "tiny", **body}).encode())
        answer = json.loads(raw)
        assert status == 200
        if isinstance(real, list):
            assert isinstance(answer, list) and len(answer) == len(real)
            real, answer = real[0], answer[0]
        assert list(answer) == list(real)
        # max_tokens is left out at SamplingParams' default of 16, as the real completions show
        assert list(answer["sampling_params"]) == list(real["sampling_params"])


def test_without_scale_out_the_fake_answers_vllms_403(server: FakeServer, model_dir: Path) -> None:
    app = FakeVllm(model_root=model_dir)  # vLLM's default: no --enable-scale-out
    serve_fresh(server, app)
    for path in RENDER_PATHS.values():
        answer = httpx.post(server.url + path, json={"messages": HI})
        assert (answer.status_code, answer.content) == (403, RENDER_DISABLED_ERROR)
        assert answer.json()["error"]["type"] == "PermissionDeniedError"


# --- the fallback: render first, /tokenize where it is not served ------------------------------


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        ("chat", {"messages": HI}, (count_prompt({"messages": HI}),)),
        ("completions", {"prompt": ["a b c", "d e"]}, (4, 3)),
        ("responses", {"input": "hello there my friend"}, (count_prompt({"messages": HI}),)),
    ],
    ids=["chat", "completions-list", "responses"],
)
async def test_with_render_served_one_call_counts_each_endpoint(
    fake: FakeVllm,
    server: FakeServer,
    http: httpx.AsyncClient,
    endpoint: str,
    body: dict[str, Any],
    expected: tuple[int, ...],
) -> None:
    counter = counter_for(http, server.url)
    count = await counter.count(endpoint, body)  # type: ignore[arg-type]
    assert (count.method, count.prompts) == (CountMethod.UPSTREAM, expected)
    assert paths(fake) == [RENDER_PATHS[endpoint]]  # one call, /tokenize never asked


@pytest.mark.parametrize(
    ("endpoint", "body", "path"),
    [
        ("chat", {"messages": HI}, "/tokenize"),
        ("completions", {"prompt": "a b c"}, "/tokenize"),
        ("completions", {"prompt": ["a b c", "d e"]}, "/v1/completions/render"),
        ("responses", {"input": "hello there my friend"}, "/v1/responses/render"),
    ],
    ids=["chat", "completions-one", "completions-list", "responses"],
)
async def test_the_product_renders_where_render_is_better(
    fake: FakeVllm,
    server: FakeServer,
    http: httpx.AsyncClient,
    endpoint: str,
    body: dict[str, Any],
    path: str,
) -> None:
    """``render="better"`` (what the sidecar runs with): render for Responses and several
    prompts, /tokenize for a chat or one prompt, which bench.render measured cheaper there."""
    counter = counter_for(http, server.url)
    counter.render = "better"
    count = await counter.count(endpoint, body)  # type: ignore[arg-type]
    assert count.method is CountMethod.UPSTREAM
    assert paths(fake) == [path]  # one call, to one of the two


async def test_without_render_the_counter_uses_tokenize_and_retries_a_minute_later(
    server: FakeServer, model_dir: Path, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = FakeVllm(model_root=model_dir)
    serve_fresh(server, app)
    counter = counter_for(http, server.url)
    first = await counter.count("chat", {"messages": HI})
    second = await counter.count("chat", {"messages": HI})
    assert first.method is second.method is CountMethod.UPSTREAM
    assert first.prompts == second.prompts == (count_prompt({"messages": HI}),)
    assert paths(app) == ["/v1/chat/completions/render", "/tokenize", "/tokenize"]
    assert (
        "403" in counter.upstream.render_off and "--enable-scale-out" in counter.upstream.render_off
    )

    # a minute later vLLM has been restarted with --enable-scale-out: render is used again
    app.scale_out = True
    now = upstream_module.time.monotonic()
    monkeypatch.setattr(upstream_module.time, "monotonic", lambda: now + RENDER_RETRY_S + 1)
    third = await counter.count("chat", {"messages": HI})
    assert (third.method, third.prompts) == (CountMethod.UPSTREAM, first.prompts)
    assert paths(app)[-1] == "/v1/chat/completions/render"
    assert counter.upstream.render_off == ""


@pytest.mark.parametrize(
    ("status", "answer"),
    [
        (404, {"detail": "Not Found"}),  # a vLLM before render
        (405, {"detail": "Method Not Allowed"}),
        (200, {"count": 3}),  # not render's answer
    ],
    ids=["route-404", "405", "not-render"],
)
async def test_a_server_without_render_is_counted_by_tokenize(
    status: int, answer: dict[str, Any]
) -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": 5, "max_model_len": 1024, "tokens": []})
        return httpx.Response(status, json=answer)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        counter = counter_for(http, "http://vllm:8000")
        for _ in range(2):
            count = await counter.count("chat", {"messages": HI})
            assert (count.method, count.prompts) == (CountMethod.UPSTREAM, (5,))
    assert seen == ["/v1/chat/completions/render", "/tokenize", "/tokenize"]


async def test_a_render_refusal_is_asked_of_tokenize_never_refused_by_the_sidecar(
    fake: FakeVllm, server: FakeServer, http: httpx.AsyncClient
) -> None:
    counter = counter_for(http, server.url)
    # an unknown model: vLLM's own 404 (not a missing route) for this body only
    count = await counter.count("chat", {"model": "other", "messages": HI})
    assert (count.method, count.prompts) == (
        CountMethod.UPSTREAM,
        (count_prompt({"messages": HI}),),
    )
    assert paths(fake) == ["/v1/chat/completions/render", "/tokenize"]
    # render stays in use for the next body
    await counter.count("chat", {"messages": HI})
    assert paths(fake)[-1] == "/v1/chat/completions/render"


async def test_beam_search_never_goes_to_render(
    fake: FakeVllm, server: FakeServer, http: httpx.AsyncClient
) -> None:
    counter = counter_for(http, server.url)
    count = await counter.count("chat", {"messages": HI, "use_beam_search": True, "n": 2})
    assert count.method is CountMethod.UPSTREAM
    assert paths(fake) == ["/tokenize"]


async def test_a_suffix_render_refuses_stays_an_estimate(
    fake: FakeVllm, server: FakeServer, http: httpx.AsyncClient
) -> None:
    counter = counter_for(http, server.url)
    count = await counter.count("completions", {"prompt": "def f(", "suffix": "return 1"})
    assert count.method is CountMethod.ESTIMATE
    assert paths(fake) == ["/v1/completions/render"]  # asked; a plain model refuses FIM


async def test_render_counts_come_truncated_and_give_the_prefix(
    fake: FakeVllm, server: FakeServer, http: httpx.AsyncClient
) -> None:
    counter = counter_for(http, server.url, block_size=4)
    words = " ".join(f"w{i}" for i in range(40))  # 40 words and the BOS: 41 tokens
    count = await counter.count(
        "completions", {"prompt": words, "truncate_prompt_tokens": 10, "max_tokens": 1}
    )
    assert (count.method, count.prompts) == (CountMethod.UPSTREAM, (10,))
    kept = list(range(41))[-10:]  # the fake's ids, kept on the left as vLLM truncates
    assert count.prefix == (block_hashes(kept, block_size=4, salt=("tiny", None)),)


async def test_an_unreachable_vllm_gives_estimates_at_once(http: httpx.AsyncClient) -> None:
    counter = counter_for(http, f"http://127.0.0.1:{free_port()}")
    first = await counter.count("chat", {"messages": HI})
    assert first.method is CountMethod.ESTIMATE
    assert counter.upstream.failing  # neither render nor /tokenize is asked again for a second
    second = await counter.count("chat", {"messages": HI})
    assert second.method is CountMethod.ESTIMATE and second.seconds < 0.05


# --- the self-check's oracle -------------------------------------------------------------------


class Observer:
    def __init__(self) -> None:
        self.checks: list[tuple[PromptShape, bool]] = []

    def self_checked(self, shape: PromptShape, matched: bool) -> None:
        self.checks.append((shape, matched))


def counts_as(tokenizer: ModelTokenizer, extra: int = 0) -> Any:
    """A prompt counter for the fake that counts as the local tokenizer does (``extra`` off)."""

    def count(body: dict[str, Any]) -> int:
        if "messages" in body:
            kwargs = {"add_generation_prompt": True, "continue_final_message": False}
            rendered = tokenizer.render_chat(body["messages"], {**kwargs, "tools": None})
            assert isinstance(rendered, str)
            return tokenizer.count_text(rendered, add_special_tokens=False) + extra
        prompt = body["prompt"]
        if isinstance(prompt, list):
            return len(prompt)
        special = body.get("add_special_tokens", True)
        return tokenizer.count_text(prompt, add_special_tokens=special) + extra

    return count


@pytest.mark.parametrize("extra", [0, 3], ids=["agrees", "differs"])
async def test_the_self_check_asks_render_and_reports_what_it_says(
    fake: FakeVllm,
    server: FakeServer,
    http: httpx.AsyncClient,
    tiny_tokenizer: ModelTokenizer,
    extra: int,
) -> None:
    fake.prompt_counter = counts_as(tiny_tokenizer, extra)
    observer = Observer()
    counter = counter_for(http, server.url, tokenizer=tiny_tokenizer, observer=observer)
    count = await counter.count("chat", {"messages": HI})
    assert count.method is CountMethod.LOCAL
    await _wait_checks(counter)
    assert observer.checks == [(PromptShape.CHAT_TEXT, extra == 0)]
    assert paths(fake) == ["/v1/chat/completions/render"]  # the oracle; /tokenize never asked
    again = await counter.count("chat", {"messages": HI})
    # a disagreement sends the shape to vLLM (render) from then on
    assert again.method is (CountMethod.LOCAL if extra == 0 else CountMethod.UPSTREAM)
    if extra:
        assert again.total == count.total + extra


async def test_the_self_check_compares_truncated_counts_with_render(
    fake: FakeVllm, server: FakeServer, http: httpx.AsyncClient, tiny_tokenizer: ModelTokenizer
) -> None:
    fake.prompt_counter = counts_as(tiny_tokenizer)
    observer = Observer()
    counter = counter_for(http, server.url, tokenizer=tiny_tokenizer, observer=observer)
    words = " ".join(f"word{i}" for i in range(200))
    count = await counter.count("completions", {"prompt": words, "truncate_prompt_tokens": 5})
    await _wait_checks(counter)
    assert count.prompts == (5,)
    assert observer.checks == [(PromptShape.COMPLETIONS_TEXT, True)]


async def _wait_checks(counter: PromptCounter) -> None:
    for _ in range(200):
        if not counter._checks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("self-checks still in flight")


def test_vllm_counting_without_an_upstream_is_not_configured() -> None:
    counting = VllmCounting(None, None, served_model=None, timeout_s=1.0)
    assert not counting.configured and not counting.render_ready()


# --- the max_tokens vLLM resolved, in the projection ---------------------------------------------


async def test_a_rendered_request_is_projected_with_the_max_tokens_vllm_resolved(
    upstream: FakeServer,
) -> None:
    """vLLM started with a cap the sidecar was not told of (``max_tokens_cap``: vLLM's
    ``override_max_tokens``, which caps even a request's own max_tokens): completions of two
    prompts (counted by render) asking for 200 tokens each are projected to vLLM's 77 each;
    one prompt, counted by /tokenize, keeps the sidecar's own rule (no cap known: 200)."""
    async with run_sidecar(upstream) as stack:
        stack.fake.scale_out = True
        stack.fake.max_tokens_cap = 77
        two = {"model": "tiny", "prompt": ["a b c", "d e"], "max_tokens": 200}
        resp = await stack.client.post("/v1/completions", json=two)
        assert resp.status_code == 200, resp.text
        assert stack.sample("kv_sidecar_request_max_tokens_count") == 2
        assert stack.sample("kv_sidecar_request_max_tokens_sum") == 2 * 77
        one = {"model": "tiny", "prompt": "a b c", "max_tokens": 200}
        assert (await stack.client.post("/v1/completions", json=one)).status_code == 200
        assert stack.sample("kv_sidecar_request_max_tokens_count") == 3
        assert stack.sample("kv_sidecar_request_max_tokens_sum") == 2 * 77 + 200
