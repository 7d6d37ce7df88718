"""The Grafana dashboard: is admission keeping vLLM out of preemption, and at what cost?

Built with grafana-foundation-sdk (typed builders for Grafana's dashboard schema) and returned as a
plain JSON-ready dict. Rows, top to bottom: the verdict in six numbers; decisions beside vLLM's
preemptions and running/waiting; the KV cache as predicted against what vLLM holds; reservations
(the future peak admission checks, the sum of peaks, what shared prefixes and learned answer
lengths save) and risk; refusals and the queue; vLLM's latency and throughput; the sidecar's
health. The first three rows fit one screen and answer "is admission working?".

Sidecar series carry the ``namespace`` and ``pod`` labels the Prometheus scrape adds; vLLM's
series, scraped from the same pod, also carry ``model_name``. Every query filters by the
``$namespace`` and ``$pod`` variables, vLLM's also by ``$model``.

>>> build_dashboard()["uid"]
'kv-sidecar'
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import gauge, prometheus, stat, timeseries
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models

from grafana.promql import REFUSED_429_MATCHERS, histogram_quantile, rate, selector

UID = "kv-sidecar"
TITLE = "vLLM KV sidecar: admission"

DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")

#: Matchers every sidecar query carries.
SIDECAR_MATCHERS: tuple[str, ...] = ('namespace=~"$namespace"', 'pod=~"$pod"')
#: Matchers every vLLM query carries.
VLLM_MATCHERS: tuple[str, ...] = (*SIDECAR_MATCHERS, 'model_name=~"$model"')
#: Grafana's rate window: at least four scrape intervals whatever the zoom.
RATE_WINDOW = "$__rate_interval"
REF_IDS = "ABCDEFGH"

#: Above this share of the KV pool the worst case of what vLLM runs is close to not fitting.
OOM_RISK_WARN = 0.8
#: ``kv_sidecar_kv_exhaustion_seconds`` is +Inf while nothing grows: capped to keep the axis usable.
EXHAUSTION_CAP_SECONDS = 3600
#: ``kv_sidecar_vllm_metrics_age_seconds`` is +Inf before the first good scrape: capped likewise.
METRICS_AGE_CAP_SECONDS = 300


def sidecar(metric: str, *matchers: str) -> str:
    """A sidecar series filtered by the dashboard's variables."""
    return selector(metric, *SIDECAR_MATCHERS, *matchers)


def vllm(metric: str, *matchers: str) -> str:
    """A vLLM series filtered by the dashboard's variables."""
    return selector(metric, *VLLM_MATCHERS, *matchers)


def quantile(q: float, bucket_series: str) -> str:
    """One quantile of a histogram over the selected pods."""
    return histogram_quantile(q, bucket_series, RATE_WINDOW)


def per_second(series: str) -> str:
    return rate(series, RATE_WINDOW)


PanelBuilder = timeseries.Panel | stat.Panel | gauge.Panel


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a panel and how its series are named in the legend."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Step:
    """A threshold: from ``value`` upwards (None: from -Inf) the colour is ``color``."""

    value: float | None
    color: str


def _targets(queries: Sequence[Query]) -> list[Builder[variants.Dataquery]]:
    if not 1 <= len(queries) <= len(REF_IDS):
        raise ValueError(f"a panel has 1 to {len(REF_IDS)} queries, not {len(queries)}")
    targets: list[Builder[variants.Dataquery]] = []
    for ref_id, query in zip(REF_IDS, queries, strict=False):
        target = (
            prometheus.Dataquery()
            .ref_id(ref_id)
            .datasource(DATASOURCE)
            .expr(query.expr)
            .legend_format(query.legend or "__auto")
        )
        targets.append(target.range())
    return targets


def _thresholds(steps: Sequence[Step]) -> dashboard_builders.ThresholdsConfig:
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
        .steps([dashboard_models.Threshold(value=s.value, color=s.color) for s in steps])
    )


def timeseries_panel(
    title: str,
    description: str,
    unit: str,
    queries: Sequence[Query],
    *,
    width: int = 8,
    height: int = 8,
    stacked: bool = False,
    threshold_line: float | None = None,
    min_value: float | None = None,
    max_value: float | None = None,
    dashed: str | None = None,
    no_data: str | None = None,
) -> timeseries.Panel:
    """A time series panel; ``dashed`` is a regex of series names drawn dashed (limits);
    ``no_data`` replaces Grafana's "No data" where an empty panel has a known reason."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_targets(queries))
        .unit(unit)
        .span(width)
        .height(height)
        .line_width(1)
        .fill_opacity(25 if stacked else 0)
        .show_points(common.VisibilityMode.NEVER)
        .legend(
            common_builders.VizLegendOptions()
            .show_legend(True)
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
        )
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
    )
    if stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
    if threshold_line is not None:
        panel = panel.thresholds(
            _thresholds([Step(None, "transparent"), Step(threshold_line, "red")])
        ).thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(
                common.GraphThresholdsStyleMode.DASHED
            )
        )
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    if dashed is not None:
        panel = panel.override_by_regexp(
            dashed,
            [
                dashboard_models.DynamicConfigValue(
                    id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}
                )
            ],
        )
    if no_data is not None:
        panel = panel.no_value(no_data)
    return panel


def stat_panel(
    title: str,
    description: str,
    unit: str,
    query: Query,
    steps: Sequence[Step],
    *,
    decimals: int = 2,
) -> stat.Panel:
    """A single number coloured by ``steps``, with its recent trend behind it."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_targets([query]))
        .unit(unit)
        .decimals(decimals)
        .span(4)
        .height(5)
        .thresholds(_thresholds(steps))
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.AREA)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
    )


def gauge_panel(
    title: str,
    description: str,
    unit: str,
    query: Query,
    steps: Sequence[Step],
    *,
    min_value: float,
    max_value: float,
) -> gauge.Panel:
    """A dial for a figure whose distance from zero matters in both directions."""
    return (
        gauge.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_targets([query]))
        .unit(unit)
        .decimals(1)
        .min(min_value)
        .max(max_value)
        .span(4)
        .height(5)
        .thresholds(_thresholds(steps))
        .show_threshold_markers(True)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
    )


# --- the figures -------------------------------------------------------------------------------

REFUSED_429 = sidecar("kv_sidecar_requests_total", *REFUSED_429_MATCHERS)
ALL_DECISIONS = sidecar("kv_sidecar_requests_total")

PREEMPTIONS_PER_SECOND = f"sum({per_second(vllm('vllm:num_preemptions_total'))})"
# No 429 yet means no series yet (labelled counters appear on first use): count that as 0.
SHARE_429 = f"(sum({per_second(REFUSED_429)}) or vector(0))\n/\nsum({per_second(ALL_DECISIONS)})"
OOM_RISK_MAX = f"max({sidecar('kv_sidecar_oom_risk_ratio')})"
PREDICTION_ERROR_SHARE = (
    f"sum({sidecar('kv_sidecar_kv_prediction_error_bytes')})\n"
    f"/\nsum({sidecar('kv_sidecar_kv_capacity_bytes')})"
)


def _per_pod(aggregation: str, series: str) -> str:
    return f"{aggregation} by (pod) ({series})"


def _share_of_capacity(metric: str) -> str:
    return (
        f"{_per_pod('sum', sidecar(metric))}\n"
        f"/\n{_per_pod('sum', sidecar('kv_sidecar_kv_capacity_bytes'))}"
    )


def _verdict_row() -> list[PanelBuilder]:
    return [
        stat_panel(
            "vLLM preemptions /s",
            "Should be 0: every preemption is work vLLM throws away because the KV pool ran dry "
            "mid-decode, the failure admission exists to prevent.",
            "short",
            Query(PREEMPTIONS_PER_SECOND, "preemptions/s"),
            [Step(None, "green"), Step(0.001, "red")],
            decimals=3,
        ),
        stat_panel(
            "429 share",
            "Share of generation requests refused with 429 (kv_cache_full, queue_full, "
            "queue_timeout): the price paid for no preemption. High and sustained: add replicas.",
            "percentunit",
            Query(SHARE_429, "429 share"),
            [Step(None, "green"), Step(0.05, "orange"), Step(0.1, "red")],
        ),
        stat_panel(
            "OOM risk ratio (max)",
            "Worst pod: projected peak KV of everything vLLM runs or will run (the sidecar's "
            "requests in flight, plus traffic that bypasses it) over capacity. Above 1, vLLM "
            "preempts if all of it runs to max_tokens.",
            "percentunit",
            Query(OOM_RISK_MAX, "OOM risk"),
            [Step(None, "green"), Step(OOM_RISK_WARN, "orange"), Step(1, "red")],
        ),
        gauge_panel(
            "Prediction error (share of capacity)",
            "Predicted minus actual KV over capacity, all selected pods. Near 0 means the ledger "
            "sees what vLLM holds; a steady offset means the model geometry is wrong.",
            "percentunit",
            Query(PREDICTION_ERROR_SHARE, "error"),
            [
                Step(None, "red"),
                Step(-0.1, "orange"),
                Step(-0.05, "green"),
                Step(0.05, "orange"),
                Step(0.1, "red"),
            ],
            min_value=-0.25,
            max_value=0.25,
        ),
        stat_panel(
            "Queue wait p99",
            "99th percentile of the time queued requests waited for admission or refusal.",
            "s",
            Query(quantile(0.99, sidecar("kv_sidecar_queue_wait_seconds_bucket")), "p99"),
            [Step(None, "green"), Step(5, "orange"), Step(30, "red")],
        ),
        stat_panel(
            "vLLM time to first token p99",
            "vLLM's own TTFT: includes its internal queue, not the sidecar's.",
            "s",
            Query(quantile(0.99, vllm("vllm:time_to_first_token_seconds_bucket")), "p99"),
            [Step(None, "green"), Step(2, "orange"), Step(10, "red")],
        ),
    ]


def _against_preemption_row() -> list[PanelBuilder]:
    return [
        timeseries_panel(
            "Decisions by reason",
            "Every generation request's outcome at the gate, by decision and reason.",
            "reqps",
            [
                Query(
                    f"sum by (decision, reason) ({per_second(ALL_DECISIONS)})",
                    "{{decision}} {{reason}}",
                )
            ],
            stacked=True,
        ),
        timeseries_panel(
            "vLLM preemptions /s",
            "vLLM's preemptions: should stay at 0 while the sidecar admits. Preemptions while "
            "the sidecar admits everything (no 429, no queue) mean its budget is too generous.",
            "short",
            [Query(_per_pod("sum", per_second(vllm("vllm:num_preemptions_total"))), "{{pod}}")],
            min_value=0,
        ),
        timeseries_panel(
            "vLLM requests running / waiting",
            "vLLM's scheduler: running requests hold KV; waiting ones queue inside vLLM.",
            "short",
            [
                Query(_per_pod("sum", vllm("vllm:num_requests_running")), "{{pod}} running"),
                Query(_per_pod("sum", vllm("vllm:num_requests_waiting")), "{{pod}} waiting"),
            ],
            min_value=0,
        ),
    ]


def _kv_row() -> list[PanelBuilder]:
    return [
        timeseries_panel(
            "Predicted vs actual KV (bytes)",
            "Predicted: the ledger's sum of ceil((prompt + generated) / block_size) blocks. "
            "Actual: vLLM's kv_cache_usage_perc times capacity. Dashed: capacity.",
            "bytes",
            [
                Query(
                    _per_pod("sum", sidecar("kv_sidecar_kv_predicted_used_bytes")),
                    "{{pod}} predicted",
                ),
                Query(
                    _per_pod("sum", sidecar("kv_sidecar_kv_actual_used_bytes")), "{{pod}} actual"
                ),
                Query(_per_pod("sum", sidecar("kv_sidecar_kv_capacity_bytes")), "{{pod}} capacity"),
            ],
            width=6,
            min_value=0,
            dashed=".* capacity$",
        ),
        timeseries_panel(
            "Predicted vs actual KV (% of capacity)",
            "The same as shares of the KV pool, beside vLLM's own kv_cache_usage_perc as a "
            "cross-check of the sidecar's scrape.",
            "percentunit",
            [
                Query(
                    _share_of_capacity("kv_sidecar_kv_predicted_used_bytes"), "{{pod}} predicted"
                ),
                Query(_share_of_capacity("kv_sidecar_kv_actual_used_bytes"), "{{pod}} actual"),
                Query(
                    _per_pod("avg", vllm("vllm:kv_cache_usage_perc")),
                    "{{pod}} vllm:kv_cache_usage_perc",
                ),
            ],
            width=6,
            min_value=0,
            max_value=1,
        ),
        timeseries_panel(
            "Prediction error (predicted - actual)",
            "Above 0: the ledger counts more KV than vLLM holds (finished requests not yet "
            "released, prefix sharing the ledger cannot see); below 0: vLLM holds more than "
            "predicted (wrong geometry, requests that bypass the sidecar).",
            "bytes",
            [
                Query(_per_pod("sum", sidecar("kv_sidecar_kv_prediction_error_bytes")), "{{pod}}"),
            ],
            width=6,
        ),
        timeseries_panel(
            "Relative prediction error (quantiles)",
            "Distribution of (predicted - actual) / capacity over the sidecar's scrapes of vLLM.",
            "percentunit",
            [
                Query(
                    quantile(q, sidecar("kv_sidecar_kv_prediction_relative_error_bucket")),
                    f"p{round(q * 100):02d}",
                )
                for q in (0.05, 0.5, 0.95)
            ],
            width=6,
        ),
    ]


def _risk_row() -> list[PanelBuilder]:
    return [
        timeseries_panel(
            "Future peak vs reserved vs capacity",
            "Future peak: the most KV the requests in flight can hold at once, each growing a "
            "token per step to its reserved end and then freeing its blocks, shared prompt blocks "
            "once; admission keeps it under the budget. Reserved: the sum of their peaks, as if "
            "all peaked together (the gap is what admitting by trajectories gains). Headroom: "
            "still promisable. Dashed: capacity.",
            "bytes",
            [
                Query(
                    _per_pod("sum", sidecar("kv_sidecar_kv_future_peak_bytes")),
                    "{{pod}} future peak",
                ),
                Query(
                    _per_pod("sum", sidecar("kv_sidecar_kv_reserved_bytes")),
                    "{{pod}} reserved (sum of peaks)",
                ),
                Query(_per_pod("sum", sidecar("kv_sidecar_kv_headroom_bytes")), "{{pod}} headroom"),
                Query(_per_pod("sum", sidecar("kv_sidecar_kv_capacity_bytes")), "{{pod}} capacity"),
            ],
            min_value=0,
            dashed=".* capacity$",
        ),
        timeseries_panel(
            "OOM risk ratio",
            "Projected peak KV (prompt + max_tokens) of everything vLLM runs or will run over "
            "capacity. Above the dashed line (1) vLLM preempts if all of it runs to max_tokens. "
            "Queued demand: what the sidecar's queue holds back, on the same scale.",
            "percentunit",
            [
                Query(_per_pod("max", sidecar("kv_sidecar_oom_risk_ratio")), "{{pod}} OOM risk"),
                Query(
                    _per_pod("max", sidecar("kv_sidecar_queued_demand_ratio")),
                    "{{pod}} queued demand",
                ),
            ],
            min_value=0,
            threshold_line=1,
        ),
        timeseries_panel(
            "Time to KV exhaustion",
            "Seconds until vLLM's free blocks run out at the current growth rate. Capped at "
            f"{EXHAUSTION_CAP_SECONDS} s: the sidecar reports +Inf while usage is not growing.",
            "s",
            [
                Query(
                    _per_pod(
                        "min",
                        f"clamp_max({sidecar('kv_sidecar_kv_exhaustion_seconds')}, "
                        f"{EXHAUSTION_CAP_SECONDS})",
                    ),
                    "{{pod}}",
                )
            ],
            min_value=0,
        ),
        timeseries_panel(
            "KV saved by shared prefixes",
            "Prompt KV that running requests share (the same full blocks of token ids) and "
            "vLLM's prefix cache holds once: the future peak and the prediction count it once, "
            "the sum of peaks (reserved) once per request. 0 while no two running requests "
            "share a prompt prefix.",
            "bytes",
            [Query(_per_pod("sum", sidecar("kv_sidecar_kv_prefix_shared_bytes")), "{{pod}}")],
            width=12,
            min_value=0,
        ),
        timeseries_panel(
            "Learned output tokens per class",
            "Expected mode (--reservation expected): the output tokens reserved per sequence for "
            "each request class (endpoint and power-of-two bucket of max_tokens, or the "
            "x-kv-sidecar-class header), an upper confidence bound on a high quantile of its "
            "recent answer lengths. Empty in worst-case mode, where every request reserves its "
            "max_tokens, and while every class is still on --expected-prior.",
            "short",
            # one series per pod and class already: no aggregation, the legend names both
            [Query(sidecar("kv_sidecar_expected_output_tokens"), "{{pod}} {{class}}")],
            width=12,
            min_value=0,
            no_data="No learned lengths: worst-case mode (every request reserves max_tokens), "
            "or every class still on --expected-prior",
        ),
    ]


def _refusals_and_queue_row() -> list[PanelBuilder]:
    return [
        timeseries_panel(
            "429 rate",
            "Requests refused with 429 and Retry-After, by reason.",
            "reqps",
            [Query(f"sum by (reason) ({per_second(REFUSED_429)})", "{{reason}}")],
            width=6,
            stacked=True,
        ),
        timeseries_panel(
            "Retry-After given (p50 / p99)",
            "Retry-After values handed out with 429 and 503, computed from how fast KV frees up.",
            "s",
            [
                Query(quantile(0.5, sidecar("kv_sidecar_retry_after_seconds_bucket")), "p50"),
                Query(quantile(0.99, sidecar("kv_sidecar_retry_after_seconds_bucket")), "p99"),
            ],
            width=6,
            min_value=0,
        ),
        timeseries_panel(
            "Queue depth and requests in flight",
            "Requests waiting in the sidecar's queue, and admitted requests not yet finished.",
            "short",
            [
                Query(_per_pod("sum", sidecar("kv_sidecar_queue_depth")), "{{pod}} queued"),
                Query(
                    _per_pod("sum", sidecar("kv_sidecar_requests_in_flight")), "{{pod}} in flight"
                ),
            ],
            width=6,
            min_value=0,
        ),
        timeseries_panel(
            "Queue wait (p50 / p99)",
            "Time from arrival to admission or refusal, for queued requests.",
            "s",
            [
                Query(quantile(0.5, sidecar("kv_sidecar_queue_wait_seconds_bucket")), "p50"),
                Query(quantile(0.99, sidecar("kv_sidecar_queue_wait_seconds_bucket")), "p99"),
            ],
            width=6,
            min_value=0,
        ),
    ]


def _vllm_latency_row() -> list[PanelBuilder]:
    return [
        timeseries_panel(
            "vLLM time to first token (p50 / p99)",
            "vLLM's TTFT from the request's arrival at vLLM: the sidecar's queue wait comes on "
            "top.",
            "s",
            [
                Query(quantile(0.5, vllm("vllm:time_to_first_token_seconds_bucket")), "p50"),
                Query(quantile(0.99, vllm("vllm:time_to_first_token_seconds_bucket")), "p99"),
            ],
            min_value=0,
        ),
        timeseries_panel(
            "vLLM inter-token latency (p50 / p99)",
            "Time between tokens of a running request: grows with batch size and recomputation.",
            "s",
            [
                Query(quantile(0.5, vllm("vllm:inter_token_latency_seconds_bucket")), "p50"),
                Query(quantile(0.99, vllm("vllm:inter_token_latency_seconds_bucket")), "p99"),
            ],
            min_value=0,
        ),
        timeseries_panel(
            "vLLM token throughput",
            "Prompt tokens prefilled and tokens generated per second.",
            "short",
            [
                Query(
                    _per_pod("sum", per_second(vllm("vllm:prompt_tokens_total"))),
                    "{{pod}} prompt tok/s",
                ),
                Query(
                    _per_pod("sum", per_second(vllm("vllm:generation_tokens_total"))),
                    "{{pod}} generation tok/s",
                ),
            ],
            min_value=0,
        ),
    ]


def _health_row() -> list[PanelBuilder]:
    return [
        timeseries_panel(
            "vLLM metrics age",
            "Age of the sidecar's last good scrape of vLLM's /metrics; past --metrics-stale-after "
            f"it decides on its ledger alone (or refuses). Capped at {METRICS_AGE_CAP_SECONDS} s "
            "(+Inf before the first scrape).",
            "s",
            [
                Query(
                    _per_pod(
                        "max",
                        f"clamp_max({sidecar('kv_sidecar_vllm_metrics_age_seconds')}, "
                        f"{METRICS_AGE_CAP_SECONDS})",
                    ),
                    "{{pod}}",
                )
            ],
            min_value=0,
        ),
        timeseries_panel(
            "vLLM reachable from the sidecar",
            "1 when the sidecar's last scrape of vLLM succeeded.",
            "short",
            [Query(_per_pod("min", sidecar("kv_sidecar_vllm_up")), "{{pod}}")],
            min_value=0,
            max_value=1,
        ),
        timeseries_panel(
            "Scrape and upstream errors /s",
            "Failed scrapes of vLLM's /metrics, and failed forwards to vLLM by kind.",
            "short",
            [
                Query(
                    _per_pod("sum", per_second(sidecar("kv_sidecar_vllm_scrape_errors_total"))),
                    "{{pod}} scrape",
                ),
                Query(
                    f"sum by (pod, kind) "
                    f"({per_second(sidecar('kv_sidecar_upstream_errors_total'))})",
                    "{{pod}} {{kind}}",
                ),
            ],
            min_value=0,
        ),
    ]


#: Top to bottom; the first three rows fit one screen and answer "is admission working?".
ROWS: tuple[tuple[str, Callable[[], list[PanelBuilder]]], ...] = (
    ("Is admission working?", _verdict_row),
    ("Admission against preemption", _against_preemption_row),
    ("KV cache: predicted vs actual", _kv_row),
    ("Reservations and risk", _risk_row),
    ("Refusals and queue", _refusals_and_queue_row),
    ("vLLM latency and throughput", _vllm_latency_row),
    ("Sidecar health", _health_row),
)


def _variables() -> list[Builder[dashboard_models.VariableModel]]:
    # Pods come from a series every running sidecar exports; "All" keeps Grafana's default (the
    # list of those pods) rather than ".*", so vLLM panels never show pods without a sidecar.
    return [
        dashboard_builders.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        dashboard_builders.QueryVariable("namespace")
        .label("Namespace")
        .datasource(DATASOURCE)
        .query("label_values(kv_sidecar_vllm_up, namespace)")
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC),
        dashboard_builders.QueryVariable("pod")
        .label("Pod")
        .datasource(DATASOURCE)
        .query('label_values(kv_sidecar_vllm_up{namespace=~"$namespace"}, pod)')
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True),
        dashboard_builders.QueryVariable("model")
        .label("Model")
        .datasource(DATASOURCE)
        .query(
            'label_values(vllm:num_requests_running{namespace=~"$namespace", pod=~"$pod"}, '
            "model_name)"
        )
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*"),
    ]


def build_dashboard() -> dict[str, Any]:
    """The dashboard as the JSON object Grafana imports."""
    ids = itertools.count(1)
    board = (
        dashboard_builders.Dashboard(TITLE)
        .uid(UID)
        .description(
            "Whether the KV sidecar's admission keeps vLLM out of preemption: predicted vs actual "
            "KV, reservations and risk, decisions, queue, beside vLLM's own latency and "
            "throughput."
        )
        .tags(["vllm", "kv-sidecar", "kv-cache"])
        .timezone("browser")
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .variables(_variables())
    )
    for title, make_panels in ROWS:
        board = board.with_row(dashboard_builders.Row(title).id(next(ids)))
        for panel in make_panels():
            board = board.with_panel(panel.id(next(ids)))
    built: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return built
