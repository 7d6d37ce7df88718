"""The dashboard: committed files match the builder, every query parses, names the right series,
and filters by the dashboard's variables.

Metric and label names are checked against docs/metrics.md (the sidecar) and a real vLLM's
exposition (tests/fixtures/vllm-0.32.0-cpu/metrics-under-load.txt); PromQL syntax against
promtool, the parser Prometheus itself uses. The dashboard's loader and queries are in
tests/support/dashboard.py, shared with the live test that evaluates every panel against a real
Prometheus.
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
from tests.support.dashboard import dashboard_queries, iter_panels, load_dashboard, substitute
from tests.support.metrics_doc import metric_rows
from tests.support.promtool import run_promtool

ROOT = Path(__file__).resolve().parent.parent
METRICS_DOC = ROOT / "docs" / "metrics.md"
VLLM_METRICS = Path(__file__).parent / "fixtures" / "vllm-0.32.0-cpu" / "metrics-under-load.txt"

#: Sample values for the dashboard's template variables (Grafana's built-ins included).
SAMPLE_SUBSTITUTIONS: dict[str, str] = {
    "$datasource": "prometheus",
    "$namespace": "default",
    "$pod": "kv-sidecar-0",
    "$job": "llm/llm",
    "$instance": "10.0.0.1:8000",
    "$model_name": "tiny",
    "$engine": "0",
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
}
#: Labels the Prometheus scrape (Operator's ServiceMonitor / PodMonitor) adds to every series.
SCRAPE_LABELS = frozenset(
    {"namespace", "pod", "job", "instance", "container", "endpoint", "service"}
)
VARIABLES = ("datasource", "namespace", "pod", "job", "instance", "model_name", "engine")
#: The variables of vLLM's example dashboards (examples/observability/dashboards/grafana in
#: vllm-project/vllm, e.g. vllm_kv_cache.json): the link carries ours to theirs by these names.
VLLM_DASHBOARD_VARIABLES = ("datasource", "job", "instance", "model_name", "engine")
#: Labels a vLLM query filters on, by the variable of the same name.
VLLM_FILTERS = ("namespace", "pod", "job", "instance", "model_name", "engine")
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
        # issue 13: what operators look for next to predicted vs actual KV
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:num_requests_waiting_by_reason",
        "vllm:e2e_request_latency_seconds_bucket",
        "kv_sidecar_request_duration_seconds_bucket",
        "kv_sidecar_prompt_counts_total",
        "kv_sidecar_prompt_count_checks_total",
        "kv_sidecar_tokenize_seconds_bucket",
        "kv_sidecar_decision_seconds_bucket",
        "process_cpu_seconds_total",
        "kv_sidecar_cpu_limit_cores",
    }
)


# --- what the metric names and labels may be --------------------------------------------------


@dataclass(frozen=True)
class Series:
    labels: frozenset[str]
    counter_like: bool  # rate() makes sense: a counter, or a histogram's bucket/sum/count


def _doc_series(text: str) -> dict[str, Series]:
    """The sidecar's series from docs/metrics.md's tables (histograms expanded)."""
    series: dict[str, Series] = {}
    for row, names in metric_rows(text):
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
    assert sidecar["kv_sidecar_requests_total"].labels == {"model_name", "decision", "reason"}
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


def test_variables_carry_across_dashboards() -> None:
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert tuple(variables) == VARIABLES
    assert set(VLLM_DASHBOARD_VARIABLES) <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in VARIABLES[1:]:
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variable["multi"] and variable["includeAll"], f"{name} is not multi-select"
        # each lists the values of its own label name (vLLM's, for the vLLM-side ones)
        assert _label_values_selector(variable["query"])[1] == name


def test_each_variable_lists_its_values_under_the_ones_before_it() -> None:
    """Picking a namespace narrows the pods, a pod vLLM's jobs, and so on down to the engine."""
    variables = [v for v in load_dashboard()["templating"]["list"] if v["type"] == "query"]
    for i, variable in enumerate(variables):
        selector, _ = _label_values_selector(variable["query"])
        [vector] = selectors(promql_parser.parse(selector))
        matchers = {m.name: m.value for m in vector.matchers.matchers}
        assert matchers == {v["name"]: f"${v['name']}" for v in variables[:i]}, variable["name"]


def test_link_to_vllms_dashboards_keeps_variables_and_time() -> None:
    dashboard = load_dashboard()
    assert "vllm" in dashboard["tags"]
    [link] = [link for link in dashboard["links"] if "vllm" in link.get("tags", [])]
    assert link["type"] == "dashboards" and link["tags"] == ["vllm"]
    assert link["includeVars"] is True and link["keepTime"] is True


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


def test_every_query_filters_by_the_dashboard_variables(
    known_series: dict[str, Series],
) -> None:
    expected = {label: SAMPLE_SUBSTITUTIONS[f"${label}"] for label in VLLM_FILTERS}
    for title, expr in dashboard_queries(SAMPLE_SUBSTITUTIONS):
        for vector in selectors(promql_parser.parse(expr)):
            matchers = {
                m.name: m.value
                for m in vector.matchers.matchers
                if m.op == promql_parser.MatchOp.Re
            }
            wanted: tuple[str, ...] = ("namespace", "pod")
            if vector.name.startswith("vllm:"):
                wanted = VLLM_FILTERS
            elif "model_name" in known_series[vector.name].labels:  # a per-model sidecar series
                wanted = (*wanted, "model_name")
            for label in wanted:
                assert matchers.get(label) == expected[label], (
                    f"{title}: {vector.name} is not filtered by {label}=~ the variable"
                )
            # vLLM's job and instance are other scrape targets than the sidecar's
            unwanted = set(matchers) & (set(VLLM_FILTERS) - set(wanted))
            assert not unwanted, f"{title}: {vector.name} filtered by vLLM's {sorted(unwanted)}"


def _divides_by_a_rate(node: Any) -> bool:
    return any(
        isinstance(n, promql_parser.BinaryExpr)
        and str(n.op) == "/"
        and any(isinstance(c, promql_parser.Call) and c.func.name == "rate" for c in walk(n.rhs))
        for n in walk(node)
    )


def test_ratios_of_traffic_say_no_traffic_instead_of_going_blank() -> None:
    """A share of traffic is 0/0 without traffic: the panel says so, not an empty "No data"
    (its denominator filtered ``> 0``) or a bare NaN (single numbers map NaN)."""
    ratio_panels = [
        panel
        for panel in iter_panels(load_dashboard()["panels"])
        if any(
            _divides_by_a_rate(promql_parser.parse(substitute(t["expr"], SAMPLE_SUBSTITUTIONS)))
            for t in panel["targets"]
        )
    ]
    titles = {panel["title"] for panel in ratio_panels}
    assert {
        "429 share",
        "vLLM prefix-cache hit rate",
        "Prompts counted: exactly here, by vLLM's /tokenize, estimated",
    } <= titles
    for panel in ratio_panels:
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults.get("noValue") == "No traffic", panel["title"]
        if panel["type"] in ("stat", "gauge"):
            specials = [m for m in defaults.get("mappings", []) if m["type"] == "special"]
            assert any(
                m["options"]["match"] == "nan" and m["options"]["result"]["text"] == "No traffic"
                for m in specials
            ), panel["title"]


def test_latency_panels_say_why_they_are_empty() -> None:
    """A quantile of no observation is NaN, which Grafana draws as nothing: every duration
    quantile drops it (``>= 0``), so that the panel shows its reason instead of a blank chart."""
    panels = [
        panel
        for panel in iter_panels(load_dashboard()["panels"])
        if any(re.search(r"_seconds_bucket\b", t["expr"]) for t in panel["targets"])
    ]
    assert len(panels) >= 8
    for panel in panels:
        assert panel["fieldConfig"]["defaults"].get("noValue"), panel["title"]
        for target in panel["targets"]:
            if "histogram_quantile" in target["expr"]:
                assert target["expr"].rstrip().endswith(">= 0"), (panel["title"], target["expr"])


def test_divides_by_a_rate_finds_one() -> None:
    assert _divides_by_a_rate(promql_parser.parse("sum(rate(a[1m])) / sum(rate(b[1m]))"))
    assert not _divides_by_a_rate(promql_parser.parse("sum(rate(a[1m])) / sum(b)"))


def test_token_throughput_is_in_tokens_per_second() -> None:
    token_rates = [
        panel
        for panel in iter_panels(load_dashboard()["panels"])
        if any(
            re.search(r"rate\(vllm:(prompt|generation)_tokens_total", t["expr"])
            for t in panel["targets"]
        )
    ]
    assert token_rates
    for panel in token_rates:
        # Grafana's custom count unit: the value scaled (K, M) and "tok/s" after it
        assert panel["fieldConfig"]["defaults"]["unit"] == "count:tok/s", panel["title"]


def test_vllms_waiting_reasons_exist_in_the_fixture(known_series: dict[str, Series]) -> None:
    """vLLM 0.32 names the reason a request waits; the panel groups by that label."""
    assert "reason" in known_series["vllm:num_requests_waiting_by_reason"].labels
    text = VLLM_METRICS.read_text(encoding="utf-8")
    reasons = set(
        re.findall(r'^vllm:num_requests_waiting_by_reason\{[^}]*reason="(\w+)"', text, re.M)
    )
    assert reasons == {"capacity", "deferred"}
    [panel] = [
        p
        for p in iter_panels(load_dashboard()["panels"])
        if p["title"] == "vLLM waiting requests by reason"
    ]
    assert all(reason in panel["description"] for reason in reasons)
    # vLLM versions from before the metric leave the panel empty: it says so
    no_value = panel["fieldConfig"]["defaults"]["noValue"]
    assert "vllm:num_requests_waiting_by_reason" in no_value and "older vLLM" in no_value


def test_panels_over_vllm_series_alone_say_why_they_are_empty() -> None:
    """A panel drawn from vLLM's series only is empty when no vLLM is scraped (or this vLLM
    lacks the series): it says so instead of Grafana's "No data"."""
    panels = [
        panel
        for panel in iter_panels(load_dashboard()["panels"])
        if panel.get("targets")
        and all(
            vector.name.startswith("vllm:")
            for target in panel["targets"]
            for vector in selectors(
                promql_parser.parse(substitute(target["expr"], SAMPLE_SUBSTITUTIONS))
            )
        )
    ]
    titles = {panel["title"] for panel in panels}
    assert {"vLLM requests running / waiting", "vLLM waiting requests by reason"} <= titles
    for panel in panels:
        assert panel["fieldConfig"]["defaults"].get("noValue"), panel["title"]


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
