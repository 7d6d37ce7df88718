"""Sliding-window and hybrid models on the real vLLM: the sidecar counts the blocks vLLM holds
for them.

Two variants of the harness's tiny model (``harness.tiny_model.VARIANTS``), each served with
blocks of 32 tokens, a 4k context and 400 blocks: ``sliding``, Mistral-shaped, every layer
attending to the last 256 tokens; ``mixed``, Gemma-2-shaped, a 256-token window and full
attention alternating (vLLM's hybrid allocator: a block holds a page of one group, and a request
takes blocks from both). vLLM frees the blocks that fall out of a sequence's window as it goes
(``SlidingWindowManager.remove_skipped_blocks``): a sliding group holds a sequence's prompt's
blocks while it prefills, then the window and the token in flight, 8-9 blocks (the sidecar
counts 9), however long it runs; a full group, every token's. Until this test's change the
sidecar counted the sliding group like a full one (its cap, the window plus a whole step's
chunk, is above these lengths): 113 blocks for a 600-token prompt and 3,000 tokens of answer, so
with that counting worst-case mode admits three of the ``sliding`` variant's four answers at
once (vLLM holds all four in 36 blocks at most) and one of the ``mixed`` variant's where two fit
(checked with the change reverted: both fail their first assertion).

A third variant, ``hybrid``, is Qwen3-Next-shaped: three gated delta-net linear-attention layers
and one full-attention layer, served at the block size vLLM aligns them to (256 tokens on the CPU
build) with 80 blocks and prefix caching on (vLLM's ``mamba_cache_mode`` ``align``). Each
linear layer is a group of its own holding a recurrent state: one block a request once it
decodes, two at a step that crosses a block boundary, which every prefill chunk does
(``MambaManager``). Until 2f599c2 the sidecar could not read such a config and
counted the model as full attention, three blocks a request short: worst-case mode admitted all
four answers where three fit with the state's blocks counted (checked with the change reverted).

A fourth, ``chunked``, is Llama-4-shaped: three layers of chunked local attention (chunks of 256
tokens) and one full, blocks of 32, 400 blocks. vLLM keeps a chunked layer's blocks of the
sequence's current chunk (``ChunkedLocalAttentionManager``) in each of its three chunked
groups, and every page in its full one. Until ba454eb the sidecar read every layer as full
attention in one group and counted an answer at its pages once (113 blocks), below what vLLM
holds: worst-case mode admitted three where two fit (checked with the count reverted).

The engine is stopped (``frozen_engine``) while the sidecar decides and while its prediction is
read, so what is compared does not depend on how fast this host decodes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from harness.vllm_cpu import VllmServer, ensure_model
from harness.vllm_info import VllmInfo
from harness.workload import SidecarProcess, make_prompts, metric_value
from tests.support.stepped import admitted, frozen_engine
from tests.support.vllm_geometry import vllm_geometry
from tests.support.vllm_idle import idle_preemptions
from tests.support.wait import wait_for

pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 600
MAX_TOKENS = 3000
REQUESTS = 4
BLOCK = 32
#: answer tokens after which a sequence has run a decode step since its prefill, which freed its
#: prompt's blocks that left the window
DECODING = 10


POOL = {"sliding": 400, "mixed": 400, "hybrid": 80, "chunked": 400}
#: per variant: (full-attention groups, sliding or chunked groups, recurrent-state groups) of
#: the hybrid allocator
GROUPS = {"sliding": (0, 1, 0), "mixed": (1, 1, 0), "hybrid": (1, 0, 3), "chunked": (1, 3, 0)}
#: the chunked variant's attention chunk
CHUNK = 256
#: a state group's blocks for one request: at its prefill and once it decodes (align mode)
STATE_PREFILL, STATE_DECODE = 2, 1


@pytest.fixture(scope="module", params=sorted(GROUPS))
def sliding_vllm(request: pytest.FixtureRequest) -> Iterator[tuple[str, VllmInfo]]:
    variant = request.param
    server = VllmServer(
        num_gpu_blocks=POOL[variant],
        max_model_len=4096,
        model_dir=ensure_model(variant=variant),
        served_name=f"tiny-{variant}",
        # a hybrid model's block size is vLLM's to align with its state's page
        extra_args=[] if GROUPS[variant][2] else ["--block-size", str(BLOCK)],
    )
    with server:
        yield request.param, server.info()


@dataclass
class Stream:
    """One streamed completion read on a thread, with vLLM's continuous usage in every event."""

    url: str
    body: dict[str, object]
    tokens: int = 0
    status: int | None = None
    error: BaseException | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url + "/v1/completions", json=self.body, timeout=600
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        self.tokens = event["usage"]["completion_tokens"]
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_sequences_are_counted_at_the_blocks_vllm_holds_for_them(
    sliding_vllm: tuple[str, VllmInfo],
) -> None:
    """Four 600-token prompts with 3,000 tokens to generate each, through worst-case mode:
    each is reserved at its whole length in the full group and at its prefill's 19 blocks in
    the sliding one (not 113), and as many are admitted at once as the budget holds so (all
    four on ``sliding``, two on ``mixed`` and ``chunked``, three on ``hybrid``; on ``mixed`` a
    third fits once the first two decode and hold only the window there); with every answer
    vLLM runs decoding past its window, the
    sidecar's prediction is what vLLM reports holding, never below it and above it only where
    its count is a ceiling: a block a request in each sliding group (the span of the window's
    tokens, wherever the window lies), and a block in each full or chunked group of a request
    whose seen tokens are one past a block (vLLM, scheduling one step at a time on the CPU, has
    not yet taken a slot for the token the stream just got); every answer completes in full and
    vLLM preempts nothing."""
    variant, vllm = sliding_vllm
    full, sliding, state_groups = GROUPS[variant]
    block, pool = vllm.block_size, POOL[variant]
    assert vllm.model_dir is not None and (state_groups or block == BLOCK), block
    before = idle_preemptions(vllm.url)
    prompts = make_prompts(vllm.model_dir, REQUESTS, PROMPT_TOKENS, seed=5)
    bodies = [
        {
            "model": vllm.served_name,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        for prompt in prompts
    ]
    each = (
        full * -(-(PROMPT_TOKENS + MAX_TOKENS) // block)
        + sliding * -(-PROMPT_TOKENS // block)
        + state_groups * STATE_PREFILL
    )
    with SidecarProcess(vllm.url, "--reservation", "worst-case", "--policy", "queue") as sc:
        with frozen_engine(vllm):
            streams = [Stream(sc.url, body) for body in bodies]
            state = admitted(sc, REQUESTS)
        fits = min(REQUESTS, state["budget_blocks"] // each)
        assert fits == {"sliding": 4, "mixed": 2, "hybrid": 3, "chunked": 2}[variant], (
            each,
            state,
        )
        assert (state["in_flight"], state["queue_depth"]) == (fits, REQUESTS - fits), state
        assert state["reserved_blocks"] == fits * each, state
        # every answer vLLM runs decoding, its prompt's blocks out of its window (a decode step
        # has run since its first token), none ended: what each holds in a sliding group no
        # longer grows (the engine decodes thousands of tokens a second: read it stopped).
        # Once the first answers decode, a queued one may fit beside them (they hold only the
        # window in the sliding group now): a stop that catches it before its first decode
        # steps is let go and taken again.
        # The stop is taken while an answer the stream has relayed is under half way through: the
        # relay lags the engine, and a stop taken as the last answers end would find nothing
        # running (a stop that finds nothing running is taken again).
        for _ in range(20):
            wait_for(
                lambda: any(DECODING <= s.tokens < MAX_TOKENS // 2 or s.error for s in streams),
                "an answer decoding",
                within=300,
            )
            with frozen_engine(vllm):
                running = _metric(vllm.url, "vllm:num_requests_running")
                held = round(_metric(vllm.url, "vllm:kv_cache_usage_perc") * (pool - 1))
                # the sidecar's own scrape of the stopped engine agrees, then its prediction,
                # once the streams have relayed what vLLM made before it stopped
                wait_for(
                    lambda held=held: sc.state()["actual_blocks"] == held,
                    f"a scrape of {held} blocks",
                    within=30,
                )
                seen = until_steady(lambda: [s.tokens for s in streams])
                state = sc.state()
            # a state group holds a second block at the step a sequence crosses into a new
            # block (align mode), and a chunked group frees the chunk before a step or two
            # after the sequence enters a new one: a stop there is taken again too
            boundary = block if state_groups else CHUNK if variant == "chunked" else 0
            crossing = boundary and any(
                (PROMPT_TOKENS + t) % boundary < 5 for t in seen if t < MAX_TOKENS
            )
            decoding = sum(DECODING <= t < MAX_TOKENS for t in seen)
            if running >= 1 and running == decoding and not crossing:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"no stop with every answer vLLM runs decoding: {seen}, {state}")
        for s in streams:
            s.thread.join(timeout=600)
        text = sc.metrics()
    assert [(s.error, s.status, s.tokens) for s in streams] == [(None, 200, MAX_TOKENS)] * REQUESTS
    assert running >= 1, seen  # the prediction was read with answers decoding
    window = (256 - 1 + 2 - 2) // block + 2  # the blocks the window and the in-flight token span
    longest = -(-(PROMPT_TOKENS + max(seen)) // block)
    most = sliding * window + full * longest + state_groups * STATE_DECODE
    assert 0 < held <= running * most, (held, seen)
    spans = 0 if variant == "chunked" else sliding  # counted at the span, wherever it lies
    paged = full + (sliding if variant == "chunked" else 0)  # counted at the tokens seen
    ceiling = sum(
        spans + paged * ((PROMPT_TOKENS + t) % block == 1)
        for t in seen
        if DECODING <= t < MAX_TOKENS
    )
    assert 0 <= state["predicted_blocks"] - held <= ceiling, (state, held, seen, ceiling)
    queued = metric_value(text, "kv_sidecar_requests_total", decision="admit", reason="queued")
    assert (queued or 0) == REQUESTS - fits, queued
    assert idle_preemptions(vllm.url) == before


def until_steady(read: Callable[[], list[int]], quiet: float = 1.0) -> list[int]:
    """``read()`` once it has not changed for ``quiet`` seconds (at most 30 s)."""
    last, since, deadline = read(), time.monotonic(), time.monotonic() + 30
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"still changing: {last}"
        time.sleep(0.1)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
    return last


def _metric(url: str, name: str) -> float:
    value = metric_value(httpx.get(url + "/metrics", timeout=10).text, name)
    assert value is not None, f"vLLM reports no {name}"
    return value


@pytest.mark.parametrize("sliding_vllm", ["hybrid"], indirect=True)
def test_a_hybrid_model_s_groups_are_vllm_s(sliding_vllm: tuple[str, VllmInfo]) -> None:
    """The geometry the sidecar builds for the hybrid model from its config and vLLM's
    ``cache_config_info`` (block size, ``mamba_cache_mode``) gives vLLM's own startup figure,
    ``kv_cache_max_concurrency``: the pool over one request of the whole context, each of the
    three state groups at its peak."""
    _, vllm = sliding_vllm
    geometry, info = vllm_geometry(vllm)
    assert info["mamba_cache_mode"] == "align", info
    assert sum(g.state for g in geometry.groups) == 3, geometry.groups
    reported = float(info["kv_cache_max_concurrency"])
    assert geometry.max_concurrency(int(info["num_gpu_blocks"])) == pytest.approx(reported)


#: tries at starting the four answers in step: vLLM's engine core takes requests in on a thread
#: of its own, and on the SIGCONT that ends ``frozen_engine`` its step loop may schedule before
#: that thread has handed it all four; answers that start a step apart never cross together
IN_STEP_TRIES = 3


def _big_steps(url: str) -> float:
    """vLLM's engine steps so far that computed more than 2,048 tokens (its own histogram,
    ``vllm:iteration_tokens_total``): here only a step that prefills all four 600-token prompts
    at once (three and the others' decodes make at most 1,803)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    every = metric_value(text, "vllm:iteration_tokens_total_count")
    at_most = metric_value(text, "vllm:iteration_tokens_total_bucket", le="2048.0")
    assert every is not None and at_most is not None, "vLLM reports no iteration_tokens_total"
    return every - at_most


@pytest.mark.parametrize("sliding_vllm", ["hybrid"], indirect=True)
def test_vllm_alone_runs_short_where_the_state_blocks_go_uncounted(
    sliding_vllm: tuple[str, VllmInfo],
) -> None:
    """Why the state's second block is counted: the same four answers sent straight to vLLM
    run in step (one prefill step for all four), hold 4 x (15 + 3) = 72 of the 79 blocks at
    their end, and cross each block boundary together, when each holds a second block in each
    of its three state groups: at the crossing into their fourteenth page (4 x (14 + 6) = 80)
    the pool is short and vLLM preempts, where counting one block a state group (or none, as
    a full-attention count does) says all four fit.

    That the four started in step is read from vLLM's own step histogram (a step of all four
    prompts), not assumed: where vLLM's step loop took them in two steps, they do not cross
    together and nothing is asserted of that try; the burst is sent again, up to
    ``IN_STEP_TRIES`` times, and the test fails if none starts in step."""
    _, vllm = sliding_vllm
    for _ in range(IN_STEP_TRIES):
        before, big = idle_preemptions(vllm.url), _big_steps(vllm.url)
        # prompts of exactly 600 token ids, sent while the engine is stopped: they start
        # together and stay in step
        with frozen_engine(vllm):
            streams = [
                Stream(
                    vllm.url,
                    {
                        "model": vllm.served_name,
                        "prompt": [10 + (i * 7 + j) % 400 for j in range(PROMPT_TOKENS)],
                        "max_tokens": MAX_TOKENS,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                    },
                )
                for i in range(REQUESTS)
            ]
            # vLLM's API server takes them in and hands them to the stopped engine core (its
            # gauges come from the engine, so nothing counts them meanwhile: a pause)
            time.sleep(3)
        for s in streams:
            s.thread.join(timeout=600)
        assert [(s.error, s.status, s.tokens) for s in streams] == [
            (None, 200, MAX_TOKENS)
        ] * REQUESTS
        if _big_steps(vllm.url) - big == 1:
            assert idle_preemptions(vllm.url) > before
            return
    pytest.fail(f"the four answers never started in one step in {IN_STEP_TRIES} tries")
