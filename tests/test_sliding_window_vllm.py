"""A sliding-window model on the real vLLM: the sidecar counts the blocks vLLM holds for it.

The model is the harness's tiny one made Mistral-shaped (``harness.tiny_model.SLIDING``: every
layer attends to the last 256 tokens), served with blocks of 32 tokens, a 4k context and 200
blocks. vLLM frees the blocks that fall out of a sequence's window as it goes
(``SlidingWindowManager.remove_skipped_blocks``): a sequence holds its prompt's blocks while it
prefills, then the window and the tokens in flight, 9-10 blocks, however long it runs. Until
this test's change the sidecar counted such a sequence at ``ceil((prompt + generated) / 32)``
blocks and reserved it to its end: 113 blocks for a 600-token prompt and 3,000 tokens of answer,
so worst-case mode ran one of these at a time where vLLM holds four in 40 blocks.

The engine is stopped (``frozen_engine``) while the sidecar decides and while its prediction is
read, so what is compared does not depend on how fast this host decodes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from harness.vllm_cpu import VllmServer, ensure_model
from harness.vllm_info import VllmInfo
from harness.workload import SidecarProcess, make_prompts, metric_value
from tests.support.stepped import admitted, frozen_engine
from tests.support.vllm_idle import idle_preemptions
from tests.support.wait import wait_for

pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 600
MAX_TOKENS = 3000
REQUESTS = 4
BLOCK = 32


@pytest.fixture(scope="module")
def sliding_vllm() -> Iterator[VllmInfo]:
    server = VllmServer(
        num_gpu_blocks=200,
        max_model_len=4096,
        model_dir=ensure_model(sliding=True),
        served_name="tiny-sliding",
        extra_args=["--block-size", str(BLOCK)],
    )
    with server:
        yield server.info()


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


def test_sequences_are_counted_at_the_blocks_vllm_holds_for_them(sliding_vllm: VllmInfo) -> None:
    """Four 600-token prompts with 3,000 tokens to generate each, through worst-case mode:
    all four are admitted at once (each reserved at its prefill's 19 blocks, not the 113 of its
    whole length); with all four decoding past their windows, the sidecar's prediction is what
    vLLM reports holding to within a block per request, never below it; every answer completes
    in full and vLLM preempts nothing."""
    vllm = sliding_vllm
    assert vllm.model_dir is not None and vllm.block_size == BLOCK
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
    with SidecarProcess(vllm.url, "--reservation", "worst-case", "--policy", "queue") as sc:
        with frozen_engine(vllm):
            streams = [Stream(sc.url, body) for body in bodies]
            state = admitted(sc, REQUESTS)
        assert (state["in_flight"], state["queue_depth"]) == (REQUESTS, 0), state
        assert state["reserved_blocks"] == REQUESTS * -(-PROMPT_TOKENS // BLOCK), state
        # every answer decoding, its prompt's blocks out of its window: what each holds no
        # longer grows (the engine decodes thousands of tokens a second: read it stopped)
        wait_for(
            lambda: all(s.tokens >= 100 or s.error for s in streams),
            "every stream 100 tokens in",
            within=300,
        )
        with frozen_engine(vllm):
            running = _metric(vllm.url, "vllm:num_requests_running")
            held = round(_metric(vllm.url, "vllm:kv_cache_usage_perc") * (vllm.num_gpu_blocks - 1))
            # the sidecar's own scrape of the stopped engine agrees, then its prediction
            wait_for(
                lambda: sc.state()["actual_blocks"] == held, f"a scrape of {held} blocks", within=30
            )
            state = sc.state()
        for s in streams:
            s.thread.join(timeout=600)
        text = sc.metrics()
    assert [(s.error, s.status, s.tokens) for s in streams] == [(None, 200, MAX_TOKENS)] * REQUESTS
    assert running == REQUESTS  # the prediction was read with all four decoding
    assert 0 < held <= REQUESTS * (-(-(256 + 2) // BLOCK) + 1), held  # the window, not the length
    assert 0 <= state["predicted_blocks"] - held <= REQUESTS, state
    queued = metric_value(text, "kv_sidecar_requests_total", decision="admit", reason="queued")
    assert not queued, queued
    assert idle_preemptions(vllm.url) == before


def _metric(url: str, name: str) -> float:
    value = metric_value(httpx.get(url + "/metrics", timeout=10).text, name)
    assert value is not None, f"vLLM reports no {name}"
    return value
