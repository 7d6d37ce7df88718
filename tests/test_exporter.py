"""The sidecar's metrics on a fresh registry: every documented name is exported, with the right
values, and nothing undocumented or unbounded appears."""

from __future__ import annotations

import math
import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.admission.controller import AdmissionController
from sidecar.config import ReservationMode
from sidecar.engine.discovery import EngineConfig
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import project_counts
from sidecar.observability.exporter import Metrics
from tests.test_admission import Clock, snapshot

DOCS = Path(__file__).parent.parent / "docs" / "metrics.md"
BLOCKS = UniformBlocks(128, 131_072)


def documented_names() -> set[str]:
    names: set[str] = set()
    for cell in re.findall(r"`(kv_sidecar_[a-z_]+)`(?: / `(_[a-z]+)`)?", DOCS.read_text()):
        base, alt = cell
        names.add(base)
        if alt:  # "`kv_sidecar_kv_capacity_bytes` / `_blocks`"
            names.add(re.sub(r"_[a-z]+$", alt, base))
    return names


def build() -> tuple[CollectorRegistry, Metrics, AdmissionController, Clock]:
    clock = Clock()
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.0, policy="queue", stale_after=5
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
            blocks=UniformBlocks(128, 131_072),
            bytes_per_block=131_072,
        ),
        vllm_up=lambda: True,
        ready=lambda: True,
        scrape_errors=lambda: 3,
        config_labels={"policy": "queue", "reservation": "worst-case", "headroom": "0.0"},
        clock=clock,
    )
    return registry, metrics, ac, clock


def test_state_gauges_follow_the_ledger_and_the_engine() -> None:
    registry, metrics, ac, clock = build()
    ac.on_snapshot(snapshot(clock, used=0, running=0))
    p = project_counts((271,), requested_max_tokens=700, n=1, max_model_len=1024, blocks=BLOCKS)
    reservations = []
    for _ in range(3):
        d = ac.try_admit(p, streamed=True)
        assert d is not None and d.reservation is not None
        metrics.decided(d)
        ac.ledger.start(d.reservation)
        reservations.append(d.reservation)
    ac.ledger.advance(reservations[0], 300)  # 571 tokens: 5 blocks
    clock.now += 1
    ac.on_snapshot(snapshot(clock, used=10, running=3))  # predicted 5 + 3 + 3 = 11
    metrics.on_snapshot()

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("kv_sidecar_kv_capacity_blocks") == 63
    assert value("kv_sidecar_kv_capacity_bytes") == 63 * 131_072
    assert value("kv_sidecar_kv_reserved_blocks") == 24
    assert value("kv_sidecar_kv_predicted_used_blocks") == 11
    assert value("kv_sidecar_kv_actual_used_blocks") == 10
    assert value("kv_sidecar_kv_prediction_error_bytes") == 1 * 131_072
    # the future peak: the first (300 generated) ends at 971 tokens, 8 blocks, while the two
    # others hold 671 tokens, 6 blocks each: 20, less than the 24 of the sum of peaks
    assert value("kv_sidecar_kv_future_peak_blocks") == 20
    assert value("kv_sidecar_kv_prefix_shared_blocks") == 0
    assert value("kv_sidecar_kv_headroom_blocks") == 63 - 20
    assert value("kv_sidecar_oom_risk_ratio") == 20 / 63
    assert value("kv_sidecar_kv_projected_usage_ratio") == 20 / 63
    assert value("kv_sidecar_requests_in_flight") == 3
    assert value("kv_sidecar_requests_total", decision="admit", reason="fits") == 3
    assert value("kv_sidecar_vllm_scrape_errors_total") == 3
    assert (
        value(
            "kv_sidecar_vllm_info",
            model="tiny",
            block_size="128",
            num_gpu_blocks="64",
            cache_dtype="auto",
            prefix_caching="true",
        )
        == 1
    )
    assert value("kv_sidecar_kv_prediction_relative_error_count") == 1
    # vLLM's usage grows by 10 blocks a second: 43 free blocks last 4.3 s
    clock.now += 1
    ac.on_snapshot(snapshot(clock, used=20, running=3))
    metrics.on_snapshot()
    assert value("kv_sidecar_kv_exhaustion_seconds") == (63 - 20) / 10
    for r in reservations:
        ac.release(r)
    assert value("kv_sidecar_kv_reserved_blocks") == 0
    assert value("kv_sidecar_requests_in_flight") == 0


def test_every_documented_metric_is_exported_and_nothing_else() -> None:
    registry, metrics, ac, clock = build()
    ac.on_snapshot(snapshot(clock, used=5, running=1))
    metrics.on_snapshot()
    ac.reservation_mode = ReservationMode.expected  # the learned lengths are listed then
    for _ in range(ac.learner.min_samples):
        ac.learner.observe("chat:none", 100)
    text = generate_latest(registry).decode()
    exported = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = re.sub(r"_(bucket|count|sum|created|total|info)$", "", sample.name)
            exported.add(name)
            assert len(sample.labels) <= 5
    documented = {re.sub(r"_(total|info)$", "", n) for n in documented_names()}
    assert documented - exported == set(), "documented but not exported"
    assert exported - documented == set(), "exported but not documented"


def test_age_is_infinite_before_the_first_scrape() -> None:
    registry, _, _, _ = build()
    assert registry.get_sample_value("kv_sidecar_vllm_metrics_age_seconds") == math.inf
    assert registry.get_sample_value("kv_sidecar_kv_capacity_blocks") is None  # nothing known
