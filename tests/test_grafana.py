"""The dashboard: committed files match the builder, every query parses, names the right series,
and filters by the dashboard's variables.

Metric and label names are checked against docs/metrics.md (the sidecar) and a real vLLM's
exposition (tests/fixtures/vllm-0.32.0-cpu/metrics-under-load.txt); PromQL syntax against
promtool, the parser Prometheus itself uses. ``dashboard_queries`` is public: the live test that
evaluates every panel against a real Prometheus imports it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from grafana import build
from grafana.alerts import rule_groups
from tests.test_alerts import run_promtool

ROOT = Path(__file__).resolve().parent.parent
METRICS_DOC = ROOT / "docs" / "metrics.md"
VLLM_METRICS = Path(__file__).parent / "fixtures" / "vllm-0.32.0-cpu" / "metrics-under-load.txt"

#: Sample values for the dashboard's template variables (Grafana's built-ins included).
SAMPLE_SUBSTITUTIONS: dict[str, str] = {
    "$datasource": "prometheus",
    "$namespace": "default",
    "$pod": "kv-sidecar-0",
    "$model": "tiny",
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
}
#: Labels the Prometheus scrape (Operator's ServiceMonitor / PodMonitor) adds to every series.
SCRAPE_LABELS = frozenset(
    {"namespace", "pod", "job", "instance", "container", "endpoint", "service"}
)
VARIABLES = ("datasource", "namespace", "pod", "model")
#: What the dashboard must show (the issue's list), by the series that carry it.
REQUIRED_SERIES = frozenset(
    {
        "kv_sidecar_kv_predicted_used_bytes",
        "kv_sidecar_kv_actual_used_bytes",
        "kv_sidecar_kv_prediction_error_bytes",
        "kv_sidecar_kv_prediction_relative_error_bucket",
        "kv_sidecar_kv_reserved_bytes",
        "kv_sidecar_kv_future_peak_bytes",
        "kv_sidecar_kv_prefix_shared_bytes",
        "kv_sidecar_expected_output_tokens",
        "kv_sidecar_kv_capacity_bytes",
        "kv_sidecar_oom_risk_ratio",
        "kv_sidecar_kv_exhaustion_seconds",
        "kv_sidecar_requests_total",
        "kv_sidecar_retry_after_seconds_bucket",
        "kv_sidecar_queue_depth",
        "kv_sidecar_queue_wait_seconds_bucket",
        "vllm:num_preemptions_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    }
)
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


# --- helpers other tests import ----------------------------------------------------------------


def substitute(text: str, substitutions: dict[str, str]) -> str:
    """Replace Grafana variables (``$name`` or ``${name}``) whose name is in ``substitutions``.

    Keys may be spelt ``$name``, ``${name}`` or ``name``; unknown variables are left as they are.

    >>> substitute('x{pod=~"$pod"}[${__rate_interval}]', {"$pod": "p", "__rate_interval": "1m"})
    'x{pod=~"p"}[1m]'
    """
    values = {key.strip("${}"): value for key, value in substitutions.items()}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, match.group(0))

    return _VARIABLE.sub(replace, text)


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels (collapsed rows) included; rows themselves excluded."""
    for panel in panels:
        if panel.get("type") == "row":
            yield from iter_panels(panel.get("panels", []))
        else:
            yield panel


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(build.DASHBOARD_JSON.read_text(encoding="utf-8"))
    return dashboard


def dashboard_queries(substitutions: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of the committed dashboard, variables substituted.

    >>> dashboard_queries({"$pod": "p"})[0][0]
    'vLLM preemptions /s'
    """
    return [
        (panel["title"], substitute(target["expr"], substitutions))
        for panel in iter_panels(load_dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


# --- what the metric names and labels may be --------------------------------------------------


@dataclass(frozen=True)
class Series:
    labels: frozenset[str]
    counter_like: bool  # rate() makes sense: a counter, or a histogram's bucket/sum/count


def _doc_series(text: str) -> dict[str, Series]:
    """The sidecar's series from docs/metrics.md's tables (histograms expanded)."""
    series: dict[str, Series] = {}
    columns: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == "name":
            columns = cells
            continue
        if columns is None or set(cells[0]) <= set("-: "):
            continue
        row = dict(zip(columns, cells, strict=False))
        first, *alternatives = re.findall(r"`([^`]+)`", row["name"])
        names = [first] + [re.sub(r"_[a-z]+$", alt, first) for alt in alternatives]
        kind = row["type"].split()[0]
        labels = frozenset(re.findall(r"`([^`]+)`", row.get("labels", "")))
        for name in names:
            if kind == "histogram":
                series[f"{name}_bucket"] = Series(labels | {"le"}, True)
                series[f"{name}_sum"] = Series(labels, True)
                series[f"{name}_count"] = Series(labels, True)
            else:
                series[name] = Series(labels, kind == "counter")
    return series


def _exposition_series(text: str) -> dict[str, Series]:
    series: dict[str, Series] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            known = series.get(sample.name, Series(frozenset(), False))
            series[sample.name] = Series(
                known.labels | set(sample.labels),
                family.type in {"counter", "histogram", "summary"}
                and not sample.name.endswith("_created"),
            )
    return series


@pytest.fixture(scope="module")
def known_series() -> dict[str, Series]:
    sidecar = _doc_series(METRICS_DOC.read_text(encoding="utf-8"))
    assert "kv_sidecar_requests_total" in sidecar and "kv_sidecar_kv_capacity_blocks" in sidecar
    assert sidecar["kv_sidecar_requests_total"].labels == {"decision", "reason"}
    vllm = _exposition_series(VLLM_METRICS.read_text(encoding="utf-8"))
    return {**vllm, **sidecar, "up": Series(frozenset(), False)}


# --- PromQL walking ---------------------------------------------------------------------------


def walk(node: Any) -> Iterator[Any]:
    """Every node of a parsed PromQL expression, depth first."""
    yield node
    for attribute in ("lhs", "rhs", "expr", "param", "vector_selector"):
        child = getattr(node, attribute, None)
        if isinstance(child, promql_parser.Expr):
            yield from walk(child)
    for argument in getattr(node, "args", None) or []:
        yield from walk(argument)


def selectors(node: Any) -> list[Any]:
    return [n for n in walk(node) if isinstance(n, promql_parser.VectorSelector)]


def _label_values_selector(query: str) -> tuple[str, str]:
    """``label_values(selector, label)`` -> (selector, label)."""
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
    assert match, f"not a label_values() query: {query}"
    return match.group(1), match.group(2)


def all_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every expression that ships: panels, variable selectors, alerts."""
    expressions = [
        (f"panel {title!r}", expr) for title, expr in dashboard_queries(SAMPLE_SUBSTITUTIONS)
    ]
    for variable in load_dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            selector, _ = _label_values_selector(
                substitute(variable["query"], SAMPLE_SUBSTITUTIONS)
            )
            expressions.append((f"variable {variable['name']!r}", selector))
    for group in rule_groups():
        for rule in group["rules"]:
            expressions.append((f"alert {rule['alert']}", rule["expr"]))
    return expressions


def promtool_check_expressions(expressions: list[tuple[str, str]], tmp_path: Path) -> str | None:
    """None if promtool parses every expression, else its complaint (with the culprits named)."""
    rules = [
        {"record": f"kv_sidecar_check:expr_{i}", "expr": expr}
        for i, (_, expr) in enumerate(expressions)
    ]
    path = tmp_path / "expressions.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
    result = run_promtool("check", "rules", path)
    if result.returncode == 0:
        return None
    listing = "\n".join(f"expr_{i}: {where}: {expr}" for i, (where, expr) in enumerate(expressions))
    return f"{result.stdout}{result.stderr}\n{listing}"


# --- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", [build.DASHBOARD_JSON, build.DASHBOARD_CONFIGMAP], ids=lambda p: p.name
)
def test_committed_dashboard_files_are_what_the_builder_writes(path: Path) -> None:
    assert path.read_text(encoding="utf-8") == build.render()[path], (
        f"{path.relative_to(ROOT)} is out of date: run python -m grafana.build"
    )


def test_configmap_carries_the_dashboard_for_grafanas_sidecar() -> None:
    configmap = yaml.safe_load(build.DASHBOARD_CONFIGMAP.read_text(encoding="utf-8"))
    assert configmap["apiVersion"] == "v1" and configmap["kind"] == "ConfigMap"
    assert configmap["metadata"]["name"] == "kv-sidecar-dashboard"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert list(configmap["data"]) == ["kv-sidecar.json"]
    assert json.loads(configmap["data"]["kv-sidecar.json"]) == load_dashboard()
    # `kubectl apply` keeps the whole object in an annotation, capped at 256 KiB.
    assert len(json.dumps(configmap)) < 200 * 1024


def test_dashboard_is_importable_shape() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "kv-sidecar" and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    assert "id" not in dashboard or dashboard["id"] is None  # Grafana assigns it on import
    top = dashboard["panels"]
    ids = [panel["id"] for panel in [*top, *(p for row in top for p in row.get("panels", []))]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]


def test_variables_datasource_namespace_pod_model() -> None:
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert tuple(variables) == VARIABLES
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name, label in (("namespace", "namespace"), ("pod", "pod"), ("model", "model_name")):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert _label_values_selector(variable["query"])[1] == label


def test_every_panel_has_targets_on_the_datasource_variable() -> None:
    panels = list(iter_panels(load_dashboard()["panels"]))
    assert len(panels) >= 20
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        targets = panel.get("targets", [])
        assert targets, f"panel {panel['title']!r} has no target"
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"] == panel["datasource"], panel["title"]


def test_rows_group_every_panel() -> None:
    panels = load_dashboard()["panels"]
    assert panels[0]["type"] == "row"
    rows = [panel["title"] for panel in panels if panel["type"] == "row"]
    assert rows[0] == "Is admission working?" and len(rows) == len(set(rows))


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    used = {
        vector.name
        for _, expr in dashboard_queries(SAMPLE_SUBSTITUTIONS)
        for vector in selectors(promql_parser.parse(expr))
    }
    assert REQUIRED_SERIES <= used, f"missing: {sorted(REQUIRED_SERIES - used)}"


def test_panels_empty_in_worst_case_mode_say_why() -> None:
    """The learned lengths exist only in expected mode: the empty panel says so, not "No data"."""
    panels = [
        panel
        for panel in iter_panels(load_dashboard()["panels"])
        if any("kv_sidecar_expected_output_tokens" in t["expr"] for t in panel["targets"])
    ]
    assert [panel["title"] for panel in panels] == ["Learned output tokens per class"]
    no_value = panels[0]["fieldConfig"]["defaults"]["noValue"]
    assert "worst-case" in no_value and "--expected-prior" in no_value


def test_no_variable_is_left_unsubstituted() -> None:
    for title, expr in dashboard_queries(SAMPLE_SUBSTITUTIONS):
        assert "$" not in expr, f"{title}: unknown variable in {expr}"


def test_every_query_filters_by_the_dashboard_variables() -> None:
    expected = {
        "namespace": SAMPLE_SUBSTITUTIONS["$namespace"],
        "pod": SAMPLE_SUBSTITUTIONS["$pod"],
        "model_name": SAMPLE_SUBSTITUTIONS["$model"],
    }
    for title, expr in dashboard_queries(SAMPLE_SUBSTITUTIONS):
        for vector in selectors(promql_parser.parse(expr)):
            matchers = {
                m.name: m.value
                for m in vector.matchers.matchers
                if m.op == promql_parser.MatchOp.Re
            }
            wanted = ["namespace", "pod"] + (
                ["model_name"] if vector.name.startswith("vllm:") else []
            )
            for label in wanted:
                assert matchers.get(label) == expected[label], (
                    f"{title}: {vector.name} is not filtered by {label}=~ the variable"
                )


def test_every_expression_parses_with_promtool(tmp_path: Path) -> None:
    problem = promtool_check_expressions(all_expressions(), tmp_path)
    assert problem is None, problem


def test_promtool_check_catches_a_broken_expression(tmp_path: Path) -> None:
    broken = [("ok", "sum(rate(up[5m]))"), ("broken", 'sum(rate(up{job="x"}[5m])')]
    problem = promtool_check_expressions(broken, tmp_path)
    assert problem is not None and "expr_1" in problem


def test_every_metric_and_label_exists(known_series: dict[str, Series]) -> None:
    for where, expr in all_expressions():
        for vector in selectors(promql_parser.parse(expr)):
            assert vector.name in known_series, (
                f"{where}: {vector.name} is neither in docs/metrics.md nor in vLLM's /metrics"
            )
            allowed = known_series[vector.name].labels | SCRAPE_LABELS
            for matcher in vector.matchers.matchers:
                assert matcher.name in allowed, (
                    f"{where}: {vector.name} has no label {matcher.name}"
                )


def test_grouping_labels_exist(known_series: dict[str, Series]) -> None:
    for where, expr in all_expressions():
        for node in walk(promql_parser.parse(expr)):
            modifier = getattr(node, "modifier", None)
            if not isinstance(node, promql_parser.AggregateExpr) or modifier is None:
                continue
            available = set(SCRAPE_LABELS)
            for vector in selectors(node):
                available |= known_series[vector.name].labels
            missing = set(modifier.labels) - available
            assert not missing, f"{where}: grouping by {sorted(missing)}, which no series carries"


def test_rate_only_over_counters_and_quantiles_only_over_buckets(
    known_series: dict[str, Series],
) -> None:
    for where, expr in all_expressions():
        for node in walk(promql_parser.parse(expr)):
            if not isinstance(node, promql_parser.Call):
                continue
            names = [vector.name for vector in selectors(node)]
            if node.func.name in {"rate", "irate", "increase"}:
                for name in names:
                    assert known_series[name].counter_like, f"{where}: {node.func.name}({name})"
            if node.func.name == "histogram_quantile":
                assert names and all(name.endswith("_bucket") for name in names), where
                grouping = node.args[1].modifier
                assert grouping is not None and "le" in grouping.labels, f"{where}: sum by (le)"
            if node.func.name.endswith("_over_time"):
                for name in names:
                    assert not known_series[name].counter_like, f"{where}: {node.func.name}({name})"
