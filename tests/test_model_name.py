"""``model_name`` on the sidecar's per-model series (docs/metrics.md, The model_name label): the
served model name discovery found, as vLLM labels its own series, on every series about the
model's KV pool, requests, decisions, predictions and engine; none on the sidecar process's own.
Before the first discovery the per-model series are exported without it, and from discovery on
each is exported once, with it.

Against the in-process fake vLLM (tests/support/fake_upstream.py), whose served name is "tiny".
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from harness.fake_vllm import FakeServer
from harness.vllm_formats import models_list
from tests.support.metrics_doc import metric_rows
from tests.support.stack import Stack, run_sidecar
from tests.support.wait import eventually

DOCS = Path(__file__).parent.parent / "docs" / "metrics.md"

#: The sidecar process's own series, by sample name (a histogram's by its base name): its CPU
#: and memory, its event loop, the cost of its own counting and deciding, its build, settings
#: and readiness, its relay workers; and vLLM's names relayed with vLLM's labels.
PROCESS_LEVEL = frozenset(
    {
        "kv_sidecar_cpu_limit_cores",
        "kv_sidecar_event_loop_tasks",
        "kv_sidecar_event_loop_lag_seconds",
        "kv_sidecar_tokenize_seconds",
        "kv_sidecar_decision_seconds",
        "kv_sidecar_build_info",
        "kv_sidecar_config_info",
        "kv_sidecar_setting",
        "kv_sidecar_setting_changes_total",
        "kv_sidecar_ready",
        "kv_sidecar_relay_workers",
        "kv_sidecar_relay_worker_requests_total",
        "kv_sidecar_relay_worker_disconnects_total",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
    }
)


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8, **extra}


def base_name(name: str) -> str:
    return re.sub(r"_(bucket|count|sum)$", "", name)


def process_level(name: str) -> bool:
    return name.startswith("process_") or base_name(name) in PROCESS_LEVEL


async def samples(stack: Stack) -> list[Sample]:
    text = (await stack.ops.get("/metrics")).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def documented_with_model_name() -> Iterator[tuple[str, bool]]:
    """Each sidecar series of docs/metrics.md's tables, and whether its labels name model_name."""
    for row, names in metric_rows(DOCS.read_text(encoding="utf-8")):
        labelled = "`model_name`" in row.get("labels", "")
        for name in names:
            yield name, labelled


async def test_per_model_series_carry_the_discovered_name_and_the_process_ones_do_not(
    upstream: FakeServer,
) -> None:
    async with run_sidecar(upstream) as stack:
        assert (await stack.client.post("/v1/completions", json=completion())).status_code == 200
        await eventually(lambda: stack.ledger_empty(), "request released", 5)
        exported = await samples(stack)
    labelled = {s.name for s in exported if "model_name" in s.labels}
    for s in exported:
        if process_level(s.name):
            assert "model_name" not in s.labels, s
        elif s.name.startswith("kv_sidecar_"):
            assert s.labels.get("model_name") == "tiny", s
    # the families the issue names, each there and labelled
    for name in (
        "kv_sidecar_kv_capacity_blocks",
        "kv_sidecar_kv_reserved_blocks",
        "kv_sidecar_kv_projected_usage_ratio",
        "kv_sidecar_kv_demand_ratio",
        "kv_sidecar_kv_prediction_relative_error_bucket",
        "kv_sidecar_requests_total",
        "kv_sidecar_requests_in_flight",
        "kv_sidecar_queue_depth",
        "kv_sidecar_class_requests_total",
        "kv_sidecar_request_duration_seconds_count",
        "kv_sidecar_prompt_counts_total",
        "kv_sidecar_completion_tokens_total",
        "kv_sidecar_vllm_up",
        "kv_sidecar_vllm_info",
    ):
        assert name in labelled, name
    assert {"kv_sidecar_ready", "kv_sidecar_build_info", "process_cpu_seconds_total"} <= {
        s.name for s in exported
    }


def test_docs_say_which_series_carry_model_name() -> None:
    documented = dict(documented_with_model_name())
    sidecar = {n: labelled for n, labelled in documented.items() if n.startswith("kv_sidecar_")}
    assert sidecar["kv_sidecar_requests_total"] and sidecar["kv_sidecar_kv_capacity_blocks"]
    for name, labelled in sidecar.items():
        assert labelled is not process_level(name), name
    for name in PROCESS_LEVEL:
        assert name in documented and not documented[name], name


async def test_before_discovery_the_series_have_no_model_name_and_after_it_one_each(
    upstream: FakeServer,
) -> None:
    upstream.app.metrics_mode = "no_cache_config"  # vLLM still starting: nothing discovered
    async with run_sidecar(upstream, discovered=False) as stack:
        resp = await stack.client.post("/v1/completions", json=completion())
        assert resp.status_code == 503
        before = await samples(stack)
        assert not [s for s in before if "model_name" in s.labels]
        names = {s.name for s in before}
        assert {"kv_sidecar_vllm_up", "kv_sidecar_requests_total", "kv_sidecar_queue_depth"} <= (
            names
        )
        refused = [
            s
            for s in before
            if s.name == "kv_sidecar_requests_total" and s.labels["reason"] == "not_ready"
        ]
        assert [s.value for s in refused] == [1.0]

        stack.fake.metrics_mode = "ok"
        await eventually(lambda: stack.sidecar.discovered, "discovered", within=5)
        after = await samples(stack)
        for s in after:
            if s.name.startswith("kv_sidecar_") and not process_level(s.name):
                assert s.labels.get("model_name") == "tiny", s
        # one series per thing: no unlabelled twin left beside the labelled one
        keys = [
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))
            for s in after
        ]
        assert len(keys) == len(set(keys))
        refused = [
            s
            for s in after
            if s.name == "kv_sidecar_requests_total" and s.labels["reason"] == "not_ready"
        ]
        assert [(s.labels["model_name"], s.value) for s in refused] == [("tiny", 1.0)]


async def test_served_model_name_picks_the_label_among_the_names_vllm_serves(
    upstream: FakeServer, model_dir: Path
) -> None:
    """vLLM serving two names (``--served-model-name a b``: /v1/models lists both) labels with the
    first unless ``--served-model-name`` names another."""
    app = upstream.app
    listed = [
        models_list(name, model_dir, app.max_model_len)["data"][0] for name in ("first", "tiny")
    ]
    app.models = lambda: {"object": "list", "data": listed}  # type: ignore[method-assign]
    for chosen, expected in ((None, "first"), ("tiny", "tiny")):
        async with run_sidecar(upstream, served_model_name=chosen) as stack:
            exported = await samples(stack)
        names = {s.labels["model_name"] for s in exported if "model_name" in s.labels}
        assert names == {expected}, chosen
