"""What the tests on the simulated engine read of vLLM's /metrics (one engine, one model)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.exposition import cache_config_labels
from harness.sim_server import SimServer
from tests.support.wait import wait_for


@contextmanager
def sim_8b(max_model_len: int, blocks: int, *extra_args: str) -> Iterator[SimServer]:
    """The simulated Llama-3.1-8B on one H100 the step-driven tests run against, its pool pinned
    to ``blocks`` (``--num-gpu-blocks-override``), started and stopped."""
    server = SimServer(
        model="llama-3.1-8b-instruct",
        gpu="h100-80gb",
        max_model_len=max_model_len,
        extra_args=["--num-gpu-blocks-override", str(blocks), *extra_args],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def metrics(sim: SimServer) -> dict[str, float]:
    """Unlabelled view of vLLM's samples: name -> value (the first sample of each name)."""
    out: dict[str, float] = {}
    text = httpx.get(sim.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, sample.value)
    return out


def cache_config(sim: SimServer) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``."""
    return cache_config_labels(httpx.get(sim.url + "/metrics", timeout=10).text)


def wait_idle(sim: SimServer, within: float = 60.0) -> None:
    """Until vLLM runs and holds waiting no request (its own gauges)."""

    def idle() -> bool:
        m = metrics(sim)
        return m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0

    wait_for(idle, "vLLM idle", within=within)
