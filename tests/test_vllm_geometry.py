"""`plan` agrees with a real vLLM (CPU build, generated model) on blocks, tokens and concurrency."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from harness.vllm_cpu import VllmServer
from tests.conftest import VllmInfo

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def unpinned_vllm() -> Iterator[VllmServer]:
    """vLLM sizing its own pool from 1 GiB of KV memory (no block override)."""
    with VllmServer(num_gpu_blocks=None, kv_cache_space_gib=1) as server:
        yield server


def plan_json(*args: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "plan", *args, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(proc.stdout))


def test_plan_matches_vllm_sizing_its_pool(unpinned_vllm: VllmServer) -> None:
    labels = unpinned_vllm.cache_config()
    assert labels["num_gpu_blocks_override"] == "None"
    block_size = int(labels["block_size"])
    memory = int(labels["kv_cache_memory_bytes"])
    plan = plan_json(
        "--model-config",
        str(unpinned_vllm.model_dir),
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(unpinned_vllm.max_model_len),
        "--kv-cache-memory-gib",
        str(memory / (1 << 30)),
    )
    assert int(labels["num_gpu_blocks"]) == memory // int(plan["bytes_per_block"])  # type: ignore[call-overload]
    assert plan["num_blocks"] == int(labels["num_gpu_blocks"])
    assert plan["kv_cache_size_tokens"] == int(labels["kv_cache_size_tokens"])
    assert plan["max_concurrency"] == float(labels["kv_cache_max_concurrency"])


def test_plan_matches_the_pinned_session_pool(vllm: VllmInfo) -> None:
    assert vllm.model_dir is not None, "set KV_SIDECAR_TEST_MODEL_DIR for an external vLLM"
    labels = {}
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(vllm.metrics_text()):
        if fam.name == "vllm:cache_config_info":
            labels = fam.samples[0].labels
    plan = plan_json(
        "--model-config",
        str(vllm.model_dir),
        "--block-size",
        str(vllm.block_size),
        "--max-model-len",
        str(vllm.max_model_len),
    )
    concurrency = vllm.num_gpu_blocks / int(plan["blocks_per_sequence"])  # type: ignore[call-overload]
    assert concurrency == float(labels["kv_cache_max_concurrency"])
    assert int(concurrency * vllm.max_model_len) == int(labels["kv_cache_size_tokens"])
