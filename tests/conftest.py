"""Shared fixtures: the real vLLM (CPU build, generated model) and fixture-file helpers.

The ``vllm`` fixture starts one vLLM server per test session with a small fixed KV pool (64
blocks of 128 tokens). Set ``KV_SIDECAR_TEST_VLLM_URL`` to run the same tests against a vLLM
that is already running (for example the GPU build with a real model); ``KV_SIDECAR_TEST_MODEL_DIR``
then names its model directory when it is readable from here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.vllm_cpu import VllmServer, http_get

FIXTURES = Path(__file__).parent / "fixtures"

#: The session server's KV pool: small enough that a burst of long requests preempts.
SESSION_BLOCKS = 64


@dataclass(frozen=True)
class VllmInfo:
    """What a test needs to know about the real vLLM it talks to."""

    url: str
    served_name: str
    model_dir: Path | None
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    server: VllmServer | None  # None when the server was started outside the tests

    def metrics_text(self) -> str:
        return http_get(self.url + "/metrics").decode()


def _describe(url: str, server: VllmServer | None) -> VllmInfo:
    from prometheus_client.parser import text_string_to_metric_families

    models = json.loads(http_get(url + "/v1/models"))["data"][0]
    labels: dict[str, str] = {}
    for family in text_string_to_metric_families(http_get(url + "/metrics").decode()):
        if family.name == "vllm:cache_config_info":
            labels = dict(family.samples[0].labels)
    model_dir: Path | None = None
    if server is not None:
        model_dir = server.model_dir
    elif os.environ.get("KV_SIDECAR_TEST_MODEL_DIR"):
        model_dir = Path(os.environ["KV_SIDECAR_TEST_MODEL_DIR"])
    elif Path(str(models.get("root", ""))).is_dir():
        model_dir = Path(models["root"])
    return VllmInfo(
        url=url,
        served_name=models["id"],
        model_dir=model_dir,
        max_model_len=int(models["max_model_len"]),
        block_size=int(labels["block_size"]),
        num_gpu_blocks=int(labels["num_gpu_blocks"]),
        server=server,
    )


@pytest.fixture(scope="session")
def vllm() -> Iterator[VllmInfo]:
    """A running real vLLM: started here (CPU build, 64 blocks) or the one at the env URL."""
    external = os.environ.get("KV_SIDECAR_TEST_VLLM_URL")
    if external:
        yield _describe(external.rstrip("/"), None)
        return
    server = VllmServer(num_gpu_blocks=SESSION_BLOCKS)
    server.start()
    try:
        yield _describe(server.url, server)
    finally:
        server.stop()


@pytest.fixture
def fixture_text() -> Iterator[object]:
    def read(*parts: str) -> str:
        return FIXTURES.joinpath(*parts).read_text()

    yield read
