"""The dashboard and the alert rules against a real Prometheus scraping the sidecar and real vLLM.

A Prometheus server (Debian's package, loopback, 1 s scrapes) scrapes the sidecar's metrics port
and vLLM's /metrics with the labels a Kubernetes scrape would add (``namespace``, ``pod``,
``container``), and evaluates grafana/alerts.yaml. Load through the sidecar overflows the KV pool:
requests are admitted at once, queued, and refused with 429 queue_full (clients come back after
Retry-After). Then every panel query of the committed dashboard, its variables resolved the way
Grafana resolves them, must return data through Prometheus' HTTP API: at the end of the load
(instant query) or, for figures that are legitimately empty once the load is over, somewhere in the
load window (range query, as the time series panels draw it).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from grafana.alerts import ALERTS
from grafana.build import ALERTS_YAML
from grafana.promql import cpu_share
from harness.workload import Result, SidecarProcess, make_prompts, metric_value, one_completion
from tests.conftest import VllmInfo
from tests.support.dashboard import dashboard_queries, load_dashboard
from tests.support.prometheus_server import PrometheusServer, Sample, ScrapeJob, has_data

pytestmark = pytest.mark.vllm

#: What a Kubernetes scrape (Prometheus Operator's PodMonitor) attaches: both containers of one pod.
NAMESPACE = "default"
POD = "llm-0"
SIDECAR_CONTAINER = "kv-sidecar"  # what grafana/alerts.py's SIDECAR_TARGET_MATCHER selects
VLLM_CONTAINER = "vllm"

#: Grafana's $__rate_interval is at least four scrape intervals of the data source's setting
#: (15 s by default), so 1m is what a default data source gets; the load fits inside it.
RATE_INTERVAL = "1m"
#: Grafana's $__range with the dashboard's default time range (``"time": {"from": "now-1h"}``).
DASHBOARD_RANGE = "1h"
STEP_SECONDS = 1.0

#: The load: clients in a closed loop for LOAD_SECONDS, each sending its next request as soon as
#: the last one is answered. There are more of them than the KV pool and the queue hold (sized
#: from the pool), so at any moment some run, up to MAX_QUEUE_DEPTH wait in the sidecar's queue,
#: and the rest are refused with 429 queue_full and come back after Retry-After: every outcome
#: recurs through the load whatever the machine's speed. Long prompts and short answers keep it
#: brief on a CPU, where prefill is cheap and decode steps are not. Each client repeats its own
#: prompt (make_prompts is slow at this length); its requests never overlap, so vLLM's prefix cache
#: shares nothing between requests in flight.
PROMPT_TOKENS = 800
MAX_TOKENS = (96, 128, 160)
MAX_QUEUE_DEPTH = 3
#: Clients beyond what the pool and the queue hold: these bounce off 429 at any moment.
SPARE_CLIENTS = 3
LOAD_SECONDS = 20.0
ARRIVAL_SPACING_SECONDS = 0.1
#: Clients honour Retry-After within these bounds (the cap keeps the test short).
RETRY_WAIT_SECONDS = (0.5, 3.0)
REQUEST_TIMEOUT_SECONDS = 180.0

#: Series every panel query over them must show above 0 at some point of the load.
MOVED_BY_THE_LOAD = (
    "kv_sidecar_requests_total",
    "kv_sidecar_kv_reserved_bytes",
    "kv_sidecar_kv_future_peak_bytes",
    "kv_sidecar_kv_predicted_used_bytes",
    "kv_sidecar_kv_actual_used_bytes",
    "kv_sidecar_oom_risk_ratio",
    "kv_sidecar_queue_depth",
    "kv_sidecar_requests_in_flight",
    "kv_sidecar_retry_after_seconds_bucket",
    "kv_sidecar_queue_wait_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    # issue 13's panels: latency through the sidecar, how prompts were counted and what it
    # cost, the sidecar's own CPU
    "kv_sidecar_request_duration_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "kv_sidecar_prompt_counts_total",
    "kv_sidecar_tokenize_seconds_bucket",
    "kv_sidecar_decision_seconds_bucket",
    "process_cpu_seconds_total",
)
#: Queries the load cannot move: vLLM's own queue caps refuse nothing here (the session vLLM has no
#: --max-num-queued-reqs; tests/test_engine_queue_caps.py starts one that has). They must still
#: return their series (exported from zero).
UNMOVED_BY_THE_LOAD = ('reason="engine_queue_full"',)
#: Series the sidecar exports only in expected mode (--reservation expected): the load runs in
#: worst-case mode (the default), where panels over them are empty and say why (their noValue).
EXPECTED_MODE_ONLY = ("kv_sidecar_expected_output_tokens",)
#: Learned figures exported only once measured (docs/metrics.md): the decode line's slope, and
#: the batch gain from it, need a batch that varied and a positive slope, which a short load on a
#: busy host may not give (a fresh-clone CI run saw neither); their panels' other queries must
#: still return data.
MEASURED_WHEN_THE_BATCH_VARIED = (
    "kv_sidecar_engine_step_seconds_per_sequence",
    "kv_sidecar_engine_batch_gain_steps_per_token",
)

_LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)")
_REGEX_SPECIAL = re.compile(r"[\\^$.|?*+()\[\]{}]")


@dataclass(frozen=True)
class Load:
    """What was sent, and when (Unix seconds)."""

    start: float
    end: float
    results: list[Result]


@dataclass
class Loaded:
    """A Prometheus that has scraped the sidecar and vLLM through the load."""

    prometheus: PrometheusServer
    sidecar: SidecarProcess
    vllm: VllmInfo
    load: Load
    sidecar_metrics: str  # the sidecar's own exposition right after the load


@dataclass(frozen=True)
class Outcome:
    """One panel query: whether it has data at the end of the load and over the load window."""

    title: str
    expr: str
    instant: list[Sample]
    ranged: list[Sample]

    @property
    def via(self) -> str:
        """``instant``: data at the end; ``range``: only earlier in the load window; "": none."""
        if has_data(self.instant):
            return "instant"
        return "range" if has_data(self.ranged) else ""

    @property
    def ok(self) -> bool:
        return bool(self.via)

    @property
    def range_max(self) -> float | None:
        values = [s.value for s in self.ranged if not math.isnan(s.value)]
        return max(values) if values else None

    def describe(self) -> str:
        def series(samples: list[Sample]) -> int:
            return len({tuple(sorted(s.labels.items())) for s in samples})

        def span(samples: list[Sample]) -> str:
            values = [s.value for s in samples if not math.isnan(s.value)]
            if not values:
                return ", no value"
            low, high = min(values), max(values)
            return f" ({low:.4g})" if low == high else f" ({low:.4g} .. {high:.4g})"

        return (
            f"now: {series(self.instant)} series{span(self.instant)}; "
            f"load window: {series(self.ranged)} series{span(self.ranged)}"
        )


# --- the load -----------------------------------------------------------------------------------


def _retry_wait(result: Result) -> float:
    low, high = RETRY_WAIT_SECONDS
    headers = result.headers
    seconds = (
        float(headers["retry-after-ms"]) / 1000
        if "retry-after-ms" in headers
        else float(headers.get("retry-after", low))
    )
    return min(high, max(low, seconds))


def client_count(vllm: VllmInfo) -> int:
    """Clients enough to fill the KV pool with the smallest requests, fill the queue, and more."""
    smallest_blocks = math.ceil((PROMPT_TOKENS + min(MAX_TOKENS)) / vllm.block_size)
    fit = (vllm.num_gpu_blocks - 1) // smallest_blocks + 1
    return fit + MAX_QUEUE_DEPTH + SPARE_CLIENTS


async def _client(
    client: httpx.AsyncClient,
    url: str,
    prompt: str,
    *,
    model: str,
    max_tokens: int,
    stream: bool,
    delay: float,
    stop_at: float,
) -> list[Result]:
    """One client: after ``delay``, one request after another until ``stop_at``, each 429
    retried after its Retry-After; it gives up at the first other failure."""
    await asyncio.sleep(delay)
    results: list[Result] = []
    while time.monotonic() < stop_at:
        result = await one_completion(
            client, url, prompt, max_tokens=max_tokens, stream=stream, model=model
        )
        results.append(result)
        if result.status == 429:
            await asyncio.sleep(_retry_wait(result))
        elif result.status != 200:
            break
    return results


async def drive_load(url: str, prompts: list[str], model: str) -> list[Result]:
    """Every attempt of every client; streamed (usage included) and non-streamed alternate."""
    stop_at = time.monotonic() + LOAD_SECONDS
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_SECONDS, limits=limits) as client:
        per_client = await asyncio.gather(
            *(
                _client(
                    client,
                    url,
                    prompt,
                    model=model,
                    max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)],
                    stream=i % 2 == 0,
                    delay=i * ARRIVAL_SPACING_SECONDS,
                    stop_at=stop_at,
                )
                for i, prompt in enumerate(prompts)
            )
        )
    return [result for results in per_client for result in results]


# --- Prometheus helpers -------------------------------------------------------------------------


def _value(prometheus: PrometheusServer, expr: str) -> float:
    """The single value of an instant query; NaN when it has none."""
    samples = prometheus.query(expr)
    return samples[0].value if len(samples) == 1 else math.nan


def _regex(values: list[str]) -> str:
    """A multi-value variable as Grafana writes it into a ``=~`` matcher.

    Grafana escapes regex metacharacters with two backslashes in the query text (one for the
    PromQL string, one for the regex): an instance's ``127.0.0.1:8000`` is ``127\\\\.0...``.

    >>> _regex(["127.0.0.1:8000"])
    '127\\\\\\\\.0\\\\\\\\.0\\\\\\\\.1:8000'
    """
    escaped = [_REGEX_SPECIAL.sub(lambda m: "\\\\" + m.group(0), value) for value in values]
    return escaped[0] if len(escaped) == 1 else f"({'|'.join(escaped)})"


def resolve_variables(prometheus: PrometheusServer) -> dict[str, list[str]]:
    """Each query variable's values, in dashboard order, each using the ones before it.

    Grafana's ``label_values(selector, label)`` lists ``label`` over the series ``selector``
    matches; ``count by (label) (selector)`` asks Prometheus the same.
    """
    resolved: dict[str, list[str]] = {}
    for variable in load_dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        for name, values in resolved.items():
            query = query.replace(f"${name}", _regex(values))
        match = _LABEL_VALUES.fullmatch(query.strip())
        assert match, f"variable {variable['name']}: not a label_values() query: {query}"
        label = match["label"]
        samples = prometheus.query(f"count by ({label}) ({match['selector']})")
        resolved[variable["name"]] = sorted({s.labels.get(label, "") for s in samples} - {""})
    return resolved


def evaluate(prometheus: PrometheusServer, title: str, expr: str, load: Load) -> Outcome:
    """The query now (instant) and from the load's start to now (range, as a panel draws it)."""
    now = time.time()
    return Outcome(
        title,
        expr,
        prometheus.query(expr, at=now),
        prometheus.query_range(expr, load.start - 5, now, STEP_SECONDS),
    )


def _table(outcomes: list[Outcome]) -> str:
    return "\n".join(
        f"{'ok  ' if o.ok else 'n/a ' if _expected_mode_only(o) else 'FAIL'} "
        f"{o.via or '-':7} {o.title}: {o.describe()}\n"
        f"     {' '.join(o.expr.split())}"
        for o in outcomes
    )


# --- the fixture: one Prometheus, one sidecar, one load for every test here ---------------------


@pytest.fixture(scope="module")
def loaded(vllm: VllmInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loaded]:
    assert vllm.model_dir is not None, "set KV_SIDECAR_TEST_MODEL_DIR to make prompts"
    assert vllm.max_model_len >= PROMPT_TOKENS + max(MAX_TOKENS)
    began = time.monotonic()
    prompts = make_prompts(vllm.model_dir, client_count(vllm), PROMPT_TOKENS, seed=11)
    print(f"\n{len(prompts)} prompts of {PROMPT_TOKENS} tokens in {time.monotonic() - began:.0f} s")
    args = ["--policy", "queue", "--max-queue-wait", "60"]
    args += ["--max-queue-depth", str(MAX_QUEUE_DEPTH)]
    with SidecarProcess(vllm.url, *args) as sidecar:
        pod = {"namespace": NAMESPACE, "pod": POD}
        jobs = [
            ScrapeJob(
                "kv-sidecar",
                f"127.0.0.1:{sidecar.metrics_port}",
                {**pod, "container": SIDECAR_CONTAINER},
            ),
            ScrapeJob(
                "vllm",
                vllm.url.removeprefix("http://").removeprefix("https://"),
                {**pod, "container": VLLM_CONTAINER},
            ),
        ]
        directory = tmp_path_factory.mktemp("prometheus")
        with PrometheusServer(directory, jobs, rule_files=[ALERTS_YAML]) as prometheus:
            prometheus.wait_for_targets_up()
            # a baseline of two scrapes of every target, so the load's first increments count
            prometheus.wait_for(
                "two scrapes of each target",
                lambda: _value(prometheus, "min(count_over_time(up[1m]))") >= 2,
            )
            start = time.time()
            results = asyncio.run(drive_load(sidecar.url, prompts, vllm.served_name))
            load = Load(start, time.time(), results)
            # Settled: every decision scraped, and both targets scraped after the last answer
            # (vLLM publishes some counters a little after the step that changed them).
            selector = f'{{namespace="{NAMESPACE}", pod="{POD}"}}'
            decided = sum(r.status in (200, 429) for r in results)
            prometheus.wait_for(
                f"{decided} decisions and a scrape after the load",
                lambda: (
                    _value(prometheus, f"sum(kv_sidecar_requests_total{selector})") >= decided
                    and _value(prometheus, f"min(timestamp(up{selector}))") > load.end + 2
                ),
            )
            yield Loaded(prometheus, sidecar, vllm, load, sidecar.metrics())


# --- the tests ----------------------------------------------------------------------------------


def test_load_admits_queues_and_refuses(loaded: Loaded) -> None:
    """The premise of the panels: every kind of outcome they chart happened."""
    statuses = [r.status for r in loaded.load.results]
    errors = [(r.status, r.error) for r in loaded.load.results if r.status not in (200, 429)]
    assert not errors, errors
    # How many are answered depends on the machine's speed; that some are refused does not.
    assert statuses.count(429) >= SPARE_CLIENTS and 200 in statuses, statuses
    text = loaded.sidecar_metrics
    for decision, reason in (("admit", "fits"), ("admit", "queued"), ("reject", "queue_full")):
        count = metric_value(text, "kv_sidecar_requests_total", decision=decision, reason=reason)
        assert count, f"no {decision}/{reason} decision in the load"
    assert metric_value(text, "kv_sidecar_retry_after_seconds_count")
    assert metric_value(text, "kv_sidecar_queue_wait_seconds_count")


def _vllm_label_values(vllm: VllmInfo, metric: str, label: str) -> list[str]:
    """The values of ``label`` on ``metric`` in vLLM's own /metrics, read from vLLM directly."""
    values = {
        sample.labels[label]
        for family in text_string_to_metric_families(vllm.metrics_text())
        for sample in family.samples
        if sample.name == metric and label in sample.labels
    }
    return sorted(values)


def test_template_variables_resolve_to_the_scraped_pod(loaded: Loaded) -> None:
    """Every variable's label_values() returns series through the real Prometheus: the pod's
    scrape labels, and vLLM's own job, instance, model_name and engine, as vLLM exports them."""
    resolved = resolve_variables(loaded.prometheus)
    engines = _vllm_label_values(loaded.vllm, "vllm:num_requests_running", "engine")
    assert engines, "vLLM 0.32 labels its series with engine"
    assert resolved == {
        "namespace": [NAMESPACE],
        "pod": [POD],
        "job": ["vllm"],  # vLLM's scrape job, not the sidecar's
        "instance": [loaded.vllm.url.removeprefix("http://").removeprefix("https://")],
        "model_name": [loaded.vllm.served_name],
        "engine": engines,
    }


@pytest.fixture(scope="module")
def outcomes(loaded: Loaded) -> list[Outcome]:
    """Every panel query of the dashboard, variables as Grafana fills them, evaluated."""
    resolved = resolve_variables(loaded.prometheus)
    assert all(resolved.values()), f"a dashboard variable has no value: {resolved}"
    substitutions = {
        "$datasource": "prometheus",
        **{f"${name}": _regex(values) for name, values in resolved.items()},
        "$__rate_interval": RATE_INTERVAL,
        "$__interval": f"{STEP_SECONDS:g}s",
        # the dashboard's default time range (now-1h): it holds the whole test, whenever each
        # query is evaluated
        "$__range": DASHBOARD_RANGE,
    }
    queries = dashboard_queries(substitutions)
    assert len(queries) >= 20
    evaluated = [evaluate(loaded.prometheus, title, expr, loaded.load) for title, expr in queries]
    load = loaded.load
    print(
        f"\nload {load.end - load.start:.0f} s, {len(load.results)} attempts, "
        f"{len(evaluated)} panel queries\n{_table(evaluated)}"
    )
    return evaluated


def _expected_mode_only(outcome: Outcome) -> bool:
    return any(metric in outcome.expr for metric in EXPECTED_MODE_ONLY)


def test_every_panel_query_returns_data(outcomes: list[Outcome]) -> None:
    failed = sorted(
        {
            o.title
            for o in outcomes
            if not o.ok
            and not _expected_mode_only(o)
            and not any(m in o.expr for m in MEASURED_WHEN_THE_BATCH_VARIED)
        }
    )
    assert not failed, f"panels without data: {failed}\n{_table(outcomes)}"


def test_expected_mode_panels_are_empty_in_worst_case_mode(
    loaded: Loaded, outcomes: list[Outcome]
) -> None:
    """Empty, not broken: Prometheus scraped the family (its metadata) with no series in it."""
    expected_only = [o for o in outcomes if _expected_mode_only(o)]
    assert expected_only, f"no panel over {EXPECTED_MODE_ONLY}"
    assert not any(o.ok for o in expected_only), _table(expected_only)
    for metric in EXPECTED_MODE_ONLY:
        metadata = loaded.prometheus.api("metadata", metric=metric)
        assert [m["type"] for m in metadata.get(metric, [])] == ["gauge"], metadata


def test_panels_show_the_load(outcomes: list[Outcome]) -> None:
    """Data is not enough where the load must move the figure: a flat 0 would hide it."""
    flat = [
        o
        for o in outcomes
        if any(metric in o.expr for metric in MOVED_BY_THE_LOAD)
        and not any(unmoved in o.expr for unmoved in UNMOVED_BY_THE_LOAD)
        and not (o.range_max is not None and o.range_max > 0)
    ]
    assert not flat, "flat at 0 through the load:\n" + _table(flat)


def test_alert_rules_load_and_evaluate(loaded: Loaded) -> None:
    prometheus = loaded.prometheus
    prometheus.wait_for_rules_evaluated()
    groups = prometheus.rule_groups()
    assert [g["file"] for g in groups] == [str(ALERTS_YAML)] * len(groups) and groups
    rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
    bad = {name: r["lastError"] for name, r in rules.items() if r["health"] != "ok"}
    assert not bad, bad
    # Both targets are up under the labels a pod scrape gives them: the "down" alerts, which
    # select the sidecar's target by container, must be quiet (absent() would make them pending).
    for name in ("KVSidecarDown", "KVSidecarVLLMDown", "KVSidecarVLLMMetricsStale"):
        assert rules[name]["state"] == "inactive", (name, rules[name].get("alerts"))


def _outcomes_of(outcomes: list[Outcome], title: str) -> list[Outcome]:
    found = [o for o in outcomes if o.title == title]
    assert found, f"no panel {title!r}"
    return found


def test_prompts_counted_shares_add_up_to_all_prompts(outcomes: list[Outcome]) -> None:
    """At every step with traffic the methods' shares sum to 1, and the local tokenizer (vLLM's
    model directory is readable here) counted some of them."""
    [outcome] = _outcomes_of(
        outcomes, "Prompts counted: exactly here, by vLLM's /tokenize, estimated"
    )
    by_time: dict[float, dict[str, float]] = {}
    for sample in outcome.ranged:
        by_time.setdefault(sample.at, {})[sample.labels["method"]] = sample.value
    assert by_time, outcome.describe()
    for at, shares in by_time.items():
        assert math.isclose(sum(shares.values()), 1.0, rel_tol=1e-9), (at, shares)
    assert max(shares.get("exact_local", 0.0) for shares in by_time.values()) > 0


def test_self_check_panel_counts_the_checks_of_the_load(outcomes: list[Outcome]) -> None:
    """The first local count of each shape is checked against vLLM's /tokenize: the load's
    completions were, so the panel's matches and mismatches over the dashboard's time range
    together are at least 1."""
    assert load_dashboard()["time"]["from"] == f"now-{DASHBOARD_RANGE}"
    checks = _outcomes_of(outcomes, "Prompt-count self-checks (time range)")
    assert len(checks) == 2
    assert {"shape"} <= {label for o in checks for s in o.instant for label in s.labels}
    total = sum(s.value for o in checks for s in o.instant if not math.isnan(s.value))
    assert total >= 1, _table(checks)


def test_the_sidecars_series_match_vllms_by_model_name(loaded: Loaded) -> None:
    """The sidecar labels its per-model series with the model_name vLLM labels its own with (the
    served name discovery read): matched on (namespace, pod, model_name), the sidecar's and vLLM's
    pair up; the sidecar process's own series have no model_name."""
    prometheus = loaded.prometheus
    pod = f'namespace="{NAMESPACE}", pod="{POD}"'
    by = "namespace, pod, model_name"
    at = loaded.load.end
    sidecar = prometheus.query(f"count by ({by}) (kv_sidecar_kv_capacity_blocks{{{pod}}})", at=at)
    vllm = prometheus.query(f"count by ({by}) (vllm:num_requests_running{{{pod}}})", at=at)
    expected = {"namespace": NAMESPACE, "pod": POD, "model_name": loaded.vllm.served_name}
    assert [s.labels for s in sidecar] == [s.labels for s in vllm] == [expected]
    [joined] = prometheus.query(
        f"sum by ({by}) (rate(kv_sidecar_requests_total{{{pod}}}[{RATE_INTERVAL}]))\n"
        f"and on ({by})\n"
        f"sum by ({by}) (vllm:num_requests_running{{{pod}}})",
        at=at,
    )
    assert joined.labels == expected and joined.value > 0
    unlabelled = prometheus.query(
        f'{{{pod}, container="{SIDECAR_CONTAINER}", model_name=""}}', at=at
    )
    assert {s.labels["__name__"] for s in unlabelled} >= {
        "process_cpu_seconds_total",
        "kv_sidecar_cpu_limit_cores",
        "kv_sidecar_build_info",
        "kv_sidecar_event_loop_lag_seconds_count",
    }
    assert not {s.labels["__name__"] for s in unlabelled} & {
        "kv_sidecar_requests_total",
        "kv_sidecar_kv_capacity_blocks",
        "kv_sidecar_vllm_up",
    }


def test_cpu_share_is_the_sidecars_own_process(loaded: Loaded) -> None:
    """The dashboard's and the alert's CPU share divide the sidecar's process CPU by its own
    limit gauge: vLLM's process series, scraped from the same pod, find no partner and drop out."""
    prometheus = loaded.prometheus
    pod = f'namespace="{NAMESPACE}", pod="{POD}"'
    processes = prometheus.query(f"process_cpu_seconds_total{{{pod}}}")
    assert {s.labels["container"] for s in processes} == {SIDECAR_CONTAINER, VLLM_CONTAINER}

    def share(window: str) -> list[Sample]:
        return prometheus.query(
            cpu_share(
                f"process_cpu_seconds_total{{{pod}}}",
                f"kv_sidecar_cpu_limit_cores{{{pod}}}",
                window,
            ),
            at=loaded.load.end,
        )

    [dashboard] = share(RATE_INTERVAL)
    assert dashboard.labels["container"] == SIDECAR_CONTAINER and dashboard.value > 0
    [alert] = [a for a in ALERTS if a.name == "KVSidecarCPUSaturated"]
    # the alert's expression without its threshold: the same figure, over its 5m window, per pod
    [sample] = prometheus.query(alert.expr.rsplit(">", 1)[0], at=loaded.load.end)
    [five_minutes] = share("5m")
    assert sample.labels == {"namespace": NAMESPACE, "pod": POD}
    assert sample.value == five_minutes.value > 0
