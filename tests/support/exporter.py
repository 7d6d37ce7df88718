"""An exporter over a real admission controller on a fake clock, no vLLM: the tiny engine's
geometry (64 blocks of 128 tokens, a 1,024-token context)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from sidecar.admission.controller import AdmissionController
from sidecar.config import Policy
from sidecar.engine.discovery import EngineConfig
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.observability.exporter import Metrics
from sidecar.observability.model_name import MODEL_NAME
from tests.support.snapshots import Clock

BLOCKS = UniformBlocks(128, 131_072)


def build_metrics(
    *,
    ready: Callable[[], bool] = lambda: True,
    scrape_errors: int = 0,
    config_labels: dict[str, str] | None = None,
) -> tuple[CollectorRegistry, Metrics, AdmissionController, Clock]:
    """A fresh registry with the sidecar's metrics, the controller they read, and its clock."""
    clock = Clock()
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.0, policy=Policy.queue, stale_after=5
    )
    registry = CollectorRegistry()
    metrics = Metrics(
        registry,
        ac,
        engine=lambda: EngineConfig(
            model="tiny",
            max_model_len=1024,
            block_size=128,
            num_gpu_blocks=64,
            cache_dtype="auto",
            prefix_caching=True,
            blocks=BLOCKS,
            bytes_per_block=131_072,
        ),
        vllm_up=lambda: True,
        ready=ready,
        scrape_errors=lambda: scrape_errors,
        config_labels={"policy": "queue"} if config_labels is None else config_labels,
        clock=clock,
    )
    return registry, metrics, ac, clock


def sample_value(registry: Collector, name: str, labels: Mapping[str, str]) -> float | None:
    """The value of the sample ``name`` whose labels are ``labels``, the ``model_name`` of the
    per-model series aside (``registry.get_sample_value`` wants every label; these tests ask by
    the labels that tell series apart, and tests/test_model_name.py checks ``model_name``).

    >>> from prometheus_client import Counter
    >>> registry = CollectorRegistry()
    >>> Counter("c", "", ["model_name", "k"], registry=registry).labels("m", "v").inc()
    >>> sample_value(registry, "c_total", {"k": "v"}), sample_value(registry, "c_total", {})
    (1.0, None)
    """
    wanted = dict(labels)
    for family in registry.collect():
        for sample in family.samples:
            if sample.name != name:
                continue
            if {k: v for k, v in sample.labels.items() if k != MODEL_NAME} == wanted:
                return float(sample.value)
    return None
