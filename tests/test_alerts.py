"""The alert rules: valid for Prometheus, unit-tested in both directions, one source for both files.

``promtool`` comes from Debian's ``prometheus`` package (``scripts/system-deps.sh``); without it
these tests fail rather than skip.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from grafana import build
from grafana.alerts import ALERTS, rule_groups
from grafana.promql import CPU_SATURATION_SHARE
from tests.support.promtool import run_promtool

ROOT = Path(__file__).resolve().parent.parent
PROMTOOL_TESTS = Path(__file__).parent / "fixtures" / "promtool"
RUNBOOKS = ROOT / "docs" / "alerts.md"
UNIT_TEST_FILES = sorted(PROMTOOL_TESTS.glob("*.test.yaml"))


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_rules_file_passes_promtool_check() -> None:
    result = run_promtool("check", "rules", build.ALERTS_YAML)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_prometheus_rule_holds_the_same_groups_as_the_rules_file() -> None:
    rules_file = load_yaml(build.ALERTS_YAML)
    prometheus_rule = load_yaml(build.PROMETHEUS_RULE)
    assert prometheus_rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert prometheus_rule["kind"] == "PrometheusRule"
    assert prometheus_rule["metadata"]["name"] == "kv-sidecar"
    assert prometheus_rule["spec"]["groups"] == rules_file["groups"]
    assert rules_file["groups"] == rule_groups()


@pytest.mark.parametrize("path", [build.ALERTS_YAML, build.PROMETHEUS_RULE], ids=lambda p: p.name)
def test_committed_rule_files_are_what_the_builder_writes(path: Path) -> None:
    assert path.read_text(encoding="utf-8") == build.render()[path], (
        f"{path.relative_to(ROOT)} is out of date: run python -m grafana.build"
    )


def test_every_alert_has_severity_annotations_and_a_runbook_section() -> None:
    anchors = {
        re.sub(r"[^a-z0-9_-]", "", heading.strip().lower().replace(" ", "-"))
        for heading in re.findall(r"^#+ (.+)$", RUNBOOKS.read_text(encoding="utf-8"), re.M)
    }
    for rule in rule_groups()[0]["rules"]:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        assert "$labels" in annotations["description"] or "$value" in annotations["description"]
        url, _, anchor = annotations["runbook_url"].partition("#")
        assert url.endswith("docs/alerts.md"), annotations["runbook_url"]
        assert anchor == rule["alert"].lower() and anchor in anchors, (
            f"docs/alerts.md has no section for {rule['alert']}"
        )


@pytest.mark.parametrize("path", UNIT_TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(path: Path) -> None:
    result = run_promtool("test", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


def _rule_tests(path: Path) -> list[dict[str, Any]]:
    document = load_yaml(path)
    rule_files = [(path.parent / name).resolve() for name in document["rule_files"]]
    assert rule_files == [build.ALERTS_YAML], f"{path.name} must test grafana/alerts.yaml"
    return [case for group in document["tests"] for case in group.get("alert_rule_test", [])]


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a.name)
def test_every_alert_is_unit_tested_firing_and_not_firing(alert: Any) -> None:
    cases = [case for path in UNIT_TEST_FILES for case in _rule_tests(path)]
    mine = [case for case in cases if case["alertname"] == alert.name]
    assert any(case.get("exp_alerts") for case in mine), f"no test where {alert.name} fires"
    assert any(not case.get("exp_alerts") for case in mine), f"no test where {alert.name} is quiet"


# Mutation checks: the unit tests must notice a rule that always fires, one that never fires,
# and one that forgot its ``for``. Otherwise "both directions" would be a claim, not a test.
MUTATIONS: dict[str, dict[str, str]] = {
    "always fires": {"expr": "vector(1)"},
    "never fires": {"expr": "vector(1) == 0"},
    "no for": {"for": "0s"},
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a.name)
def test_unit_tests_catch_a_broken_rule(alert: Any, mutation: str, tmp_path: Path) -> None:
    groups = rule_groups()
    for rule in groups[0]["rules"]:
        if rule["alert"] == alert.name:
            rule.update(MUTATIONS[mutation])
    rules_path = tmp_path / "alerts.yaml"
    rules_path.write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    failed = []
    for path in UNIT_TEST_FILES:
        document = load_yaml(path)
        if not any(case["alertname"] == alert.name for case in _rule_tests(path)):
            continue
        document["rule_files"] = [str(rules_path)]
        mutated = tmp_path / path.name
        mutated.write_text(yaml.safe_dump(document), encoding="utf-8")
        failed.append(run_promtool("test", "rules", mutated).returncode != 0)
    assert failed and any(failed), f"the unit tests pass although {alert.name} {mutation}"


#: Ceilings KVSidecarCPUSaturated must not divide by: one core whatever ``--workers`` (the main
#: process and its relay workers are summed in process_cpu_seconds_total, so two workers at half
#: a core read as saturated), or one core per event loop whatever the CPU limit.
WRONG_CPU_CEILINGS: dict[str, str] = {
    "one core with workers": "clamp_max(kv_sidecar_cpu_limit_cores, 1)",
    "ignores the limit": "(1 + (kv_sidecar_relay_workers or kv_sidecar_cpu_limit_cores * 0))",
}


@pytest.mark.parametrize("ceiling", sorted(WRONG_CPU_CEILINGS))
def test_cpu_saturation_counts_one_core_per_process_up_to_the_limit(
    ceiling: str, tmp_path: Path
) -> None:
    groups = rule_groups()
    [rule] = [r for r in groups[0]["rules"] if r["alert"] == "KVSidecarCPUSaturated"]
    rule["expr"] = (
        "max by (namespace, pod) (\n"
        f"rate(process_cpu_seconds_total[5m]) / {WRONG_CPU_CEILINGS[ceiling]}\n"
        f") > {CPU_SATURATION_SHARE}"
    )
    rules_path = tmp_path / "alerts.yaml"
    rules_path.write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    document = load_yaml(PROMTOOL_TESTS / "cpu_saturated.test.yaml")
    document["rule_files"] = [str(rules_path)]
    mutated = tmp_path / "cpu_saturated.test.yaml"
    mutated.write_text(yaml.safe_dump(document), encoding="utf-8")
    result = run_promtool("test", "rules", mutated)
    assert result.returncode != 0, f"the unit tests pass although the rule {ceiling}"
