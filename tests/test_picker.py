"""The llm-d endpoint picker recipe (deploy/llm-d/) against the picker's source and the sidecar.

The picker's configuration names, plugin types and extraction rules are vendored in
tests/fixtures/llm-d-router/facts.json, each with the llm-d-router file and commit it was read
from (CI has no network). The first tests check the shipped EndpointPickerConfig and InferencePool
against those facts and against the rendered base (the ports it names are the sidecar's). The last
one starts a real sidecar process in front of the fake vLLM (serving LoRA adapters, so that vLLM
exports vllm:lora_requests_info) and reads its metrics port the way the picker does (a plain GET,
the Prometheus text format): every series the recipe's specs name is there, of a type whose value
the picker reads, with the labels it parses.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness.fake_vllm import FakeServer, FakeVllm, write_model_dir
from harness.workload import SidecarProcess
from tests.support.manifests import SIDECAR, container, container_port, of_kind, render

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "deploy" / "llm-d"
FACTS: dict[str, Any] = json.loads(
    (Path(__file__).parent / "fixtures" / "llm-d-router" / "facts.json").read_text()
)
#: The engine-config fields that name a metric (the rest are names and label overrides).
SPEC_FIELDS = (
    "queuedRequestsSpec",
    "runningRequestsSpec",
    "kvUsageSpec",
    "loraSpec",
    "cacheInfoSpec",
    "cacheBlockSizeSpec",
    "cacheNumBlocksSpec",
)


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((RECIPE / name).read_text())
    return doc


def plugins_of(config: dict[str, Any], type_: str) -> list[dict[str, Any]]:
    return [p for p in config["plugins"] if p["type"] == type_]


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """The picker's parseStringToSpec (spec.go): ``name{label=value,...}``, quotes optional."""
    extraction = FACTS["extraction"]
    quoted = re.sub(r'(\w+)\s*=\s*([^",}\s]+)', r'\1="\2"', spec)
    match = re.match(extraction["metric_spec_regex"], quoted)
    assert match, f"not a metric spec the picker parses: {spec!r}"
    name = match[1]
    assert re.match(extraction["legacy_metric_name_regex"], name), name
    labels: dict[str, str] = {}
    for pair in filter(None, (match[2] or "").split(",")):
        pair_match = re.fullmatch(r'\s*(\S+?)\s*=\s*"([^"]*)"\s*', pair)
        assert pair_match, f"bad label pair {pair!r} in {spec!r}"
        labels[pair_match[1]] = pair_match[2]
    return name, labels


def engine_specs() -> dict[str, str]:
    """Field -> spec of the recipe's sidecar engine config (the one its defaultEngine names)."""
    (extractor,) = plugins_of(load("endpoint-picker-config.yaml"), "core-metrics-extractor")
    params = extractor["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    return {field: engine[field] for field in SPEC_FIELDS if engine.get(field)}


# --- the config against the picker's source -----------------------------------------------------


def test_config_uses_only_names_the_picker_has() -> None:
    config = load("endpoint-picker-config.yaml")
    facts = FACTS["config"]
    assert (config["apiVersion"], config["kind"]) == (facts["apiVersion"], facts["kind"])
    assert set(config) <= set(facts["top_level_keys"]), set(config) - set(facts["top_level_keys"])
    types = set(FACTS["plugin_types"]["types"])
    names = set()
    for plugin in config["plugins"]:
        assert set(plugin) <= set(facts["plugin_keys"]), plugin
        assert plugin["type"] in types, plugin["type"]
        names.add(plugin.get("name", plugin["type"]))
    # every reference resolves to a declared plugin
    data = config["dataLayer"]
    assert set(data) <= set(facts["data_layer_keys"])
    for source in data["sources"]:
        assert set(source) <= set(facts["data_layer_source_keys"])
        assert source["pluginRef"] in names
        for extractor in source["extractors"]:
            assert set(extractor) <= set(facts["data_layer_extractor_keys"])
            assert extractor["pluginRef"] in names
    for profile in config["schedulingProfiles"]:
        assert set(profile) <= set(facts["scheduling_profile_keys"])
        for ref in profile["plugins"]:
            assert set(ref) <= set(facts["scheduling_plugin_keys"])
            assert ref["pluginRef"] in names


def test_the_data_source_scrapes_the_sidecar_metrics_port() -> None:
    """The picker scrapes one port per pod: the port override must be the sidecar's metrics
    port as the base renders it, and the source must feed the extractor."""
    config = load("endpoint-picker-config.yaml")
    (source,) = plugins_of(config, "metrics-data-source")
    params = source["parameters"]
    assert set(params) <= set(FACTS["metrics_data_source"]["parameters"]), params
    (deployment,) = of_kind(render("base"), "Deployment")
    sidecar = container(deployment, SIDECAR)
    assert 1 <= params["port"] <= 65535
    assert params["port"] == container_port(sidecar, "metrics")
    assert params.get("path", "/metrics") == "/metrics"
    (wired,) = [s for s in config["dataLayer"]["sources"] if s["pluginRef"] == source["type"]]
    assert [e["pluginRef"] for e in wired["extractors"]] == ["core-metrics-extractor"]


def test_the_extractor_maps_every_figure_to_the_sidecar() -> None:
    (extractor,) = plugins_of(load("endpoint-picker-config.yaml"), "core-metrics-extractor")
    params = extractor["parameters"]
    facts = FACTS["core_metrics_extractor"]
    assert set(params) <= set(facts["parameters"]), params
    names = [e["name"] for e in params["engineConfigs"]]
    assert facts["reserved_engine_name"] not in names
    assert params["defaultEngine"] in names
    for engine in params["engineConfigs"]:
        assert set(engine) <= set(facts["engine_config_fields"]), engine
    specs = engine_specs()
    # every figure the built-in vLLM mapping reads has a counterpart here (none left disabled)
    assert set(facts["builtin_vllm"]) <= set(specs), set(facts["builtin_vllm"]) - set(specs)
    # and the KV figure is the sidecar's projection, not vLLM's allocated blocks
    assert parse_spec(specs["kvUsageSpec"])[0] == "kv_sidecar_kv_projected_usage_ratio"
    for spec in specs.values():
        parse_spec(spec)


def test_the_inference_pool_sends_traffic_to_the_sidecar_proxy_port() -> None:
    pool = load("inferencepool.yaml")
    facts = FACTS["inference_pool"]
    assert (pool["apiVersion"], pool["kind"]) == (facts["apiVersion"], facts["kind"])
    assert set(pool["spec"]) <= set(facts["spec_keys"])
    (deployment,) = of_kind(render("base"), "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector and all(labels.get(k) == v for k, v in selector.items())
    sidecar = container(deployment, SIDECAR)
    (port,) = pool["spec"]["targetPorts"]
    assert port["number"] == container_port(sidecar, "http")


def test_readme_recipe_uses_no_refused_flag() -> None:
    """The picker refuses its old metric flags; the recipe must not tell anyone to set them."""
    readme = (ROOT / "deploy" / "README.md").read_text()
    for flag in FACTS["refused_flags"]["flags"]:
        assert f"--{flag}=" not in readme, flag
    assert "--model-server-metrics-port=" not in readme


# --- the specs against the sidecar's live exposition --------------------------------------------


def _newest_lora(fake: FakeVllm) -> dict[str, str]:
    """The labels of the fake vLLM's newest vllm:lora_requests_info series."""
    (running, waiting), _ = max(fake.lora_series.items(), key=lambda item: item[1])
    return {
        "max_lora": str(fake.max_loras),
        "running_lora_adapters": running,
        "waiting_lora_adapters": waiting,
    }


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FakeVllm]]:
    """The sidecar's metrics port as the picker reads it, once discovery has found vLLM and the
    sidecar has relayed vLLM's newest LoRA sample. vLLM serves LoRA here (--max-loras 4) and its
    exposition holds two series of vllm:lora_requests_info, an older and a newer adapter set: the
    sidecar must relay the newer one only."""
    fake = FakeVllm(model_root=write_model_dir(tmp_path_factory.mktemp("model") / "tiny"))
    fake.max_loras = 4
    fake.record_lora(running=["sql"], waiting=["chat"])
    with FakeServer(fake) as upstream, SidecarProcess(upstream.url) as sidecar:

        def relayed(until: dict[str, str]) -> httpx.Response:
            deadline = time.monotonic() + 30
            while True:
                # a plain GET, like the picker's HTTP source (no Accept header for OpenMetrics)
                resp = httpx.get(sidecar.metrics_url + "/metrics", timeout=5)
                assert resp.status_code == 200
                families = {f.name: f for f in text_string_to_metric_families(resp.text)}
                lora = families.get("vllm:lora_requests_info")
                if "vllm:cache_config_info" in families and lora is not None:
                    if [s.labels for s in lora.samples] == [until]:
                        return resp
                assert time.monotonic() < deadline, (
                    f"the sidecar never served vllm:cache_config_info and {until}:\n{resp.text}"
                )
                time.sleep(0.2)

        relayed(_newest_lora(fake))
        time.sleep(0.01)  # a later time for the newer series
        fake.record_lora(running=["sql", "chat"])
        resp = relayed(_newest_lora(fake))
        assert len(fake.lora_series) == 2  # vLLM keeps the older series beside the newer one
        assert resp.headers["content-type"].startswith("text/plain")
        yield resp.text, fake


def test_every_spec_finds_a_series_the_picker_can_read(exposition: tuple[str, FakeVllm]) -> None:
    text, fake = exposition
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value_types = set(FACTS["extraction"]["value_types"])
    specs = engine_specs()
    assert "loraSpec" in specs
    for field, spec in specs.items():
        name, labels = parse_spec(spec)
        # prometheus_client drops a counter's _total from the family name; the picker does not.
        # Every spec must find its series: the fake vLLM serves LoRA, so vllm:lora_requests_info,
        # which the picker would skip silently if absent, must be relayed too.
        family = families.get(name) or families.get(name.removesuffix("_total"))
        assert family is not None, f"{field}: {name} is not on the sidecar's metrics port"
        matching = [
            s for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert matching, f"{field}: no {name} series with {labels}"
        if field == "cacheInfoSpec":
            sample = matching[0]
            for label in FACTS["extraction"]["cache_info_labels"]:
                assert re.fullmatch(r"\d+", sample.labels[label]), (label, sample.labels)
            # the pool vLLM reports, and its block size (the fake serves vLLM 0.32's text)
            assert int(sample.labels["num_gpu_blocks"]) == fake.num_gpu_blocks
            assert int(sample.labels["block_size"]) == 128
        elif field == "loraSpec":
            assert family.type in value_types, f"{field}: {name} is a {family.type}"
            # vLLM's newest sample as it was: its labels, and its value (the time vLLM set it)
            (sample,) = matching
            assert set(FACTS["extraction"]["lora_labels"]) <= set(sample.labels), sample.labels
            assert sample.labels == _newest_lora(fake)
            assert sample.value == max(fake.lora_series.values())
        else:
            assert family.type in value_types, f"{field}: {name} is a {family.type}"
    kv = families["kv_sidecar_kv_projected_usage_ratio"].samples[0].value
    assert 0.0 <= kv <= 1.0
