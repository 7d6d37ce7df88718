"""The Grafana dashboard: is admission keeping vLLM out of preemption, and at what cost?

Built with grafana-foundation-sdk (typed builders for Grafana's dashboard schema, wrapped in
``panels.py``) and returned as a plain JSON-ready dict. Rows, top to bottom: the verdict in six
numbers; decisions beside vLLM's preemptions, running and waiting requests; the KV cache as
predicted against what vLLM holds; how prompts were counted and vLLM's prefix cache; latency
through the sidecar; reservations (the future peak admission checks, the sum of peaks, what shared
prefixes and learned answer lengths save) and risk; refusals and the queue; vLLM's latency and
throughput; the sidecar's health. The first three rows fit one screen and answer "is admission
working?".

Variables carry across dashboards: ``job``, ``instance``, ``model_name`` and ``engine`` are
vLLM's own label values under the names vLLM's example dashboards use, so the "vLLM dashboards"
link (every dashboard tagged ``vllm``, variables and time range kept) opens them on the same
engines. Sidecar series carry the ``namespace`` and ``pod`` labels the Prometheus scrape adds and
are filtered by ``$namespace`` and ``$pod``, and those about the model (all but the sidecar
process's own: docs/metrics.md, The model_name label) by ``$model_name`` too; vLLM's series,
scraped from the same pods, are filtered by those and by ``$job``, ``$instance`` and ``$engine``
too (the sidecar's own job and instance are other targets than vLLM's).

>>> build_dashboard()["uid"]
'kv-sidecar'
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dashboard_models

from grafana.panels import (
    DATASOURCE,
    NO_TRAFFIC,
    PanelBuilder,
    Query,
    Step,
    gauge_panel,
    stat_panel,
    timeseries_panel,
)
from grafana.promql import (
    CPU_SATURATION_SHARE,
    REFUSED_429_MATCHERS,
    RELAY_WORKERS,
    cpu_share,
    histogram_quantile,
    rate,
    selector,
)

UID = "kv-sidecar"
TITLE = "vLLM KV sidecar: admission"
#: vLLM's example dashboards carry this tag; the dashboard link lists every dashboard with it.
VLLM_DASHBOARD_TAG = "vllm"

#: Matchers every sidecar query carries.
SIDECAR_MATCHERS: tuple[str, ...] = ('namespace=~"$namespace"', 'pod=~"$pod"')
#: The model, as vLLM's series and the sidecar's per-model series label it.
MODEL_MATCHER = 'model_name=~"$model_name"'
#: Matchers every vLLM query carries: the pods, then vLLM's own labels.
VLLM_MATCHERS: tuple[str, ...] = (
    *SIDECAR_MATCHERS,
    'job=~"$job"',
    'instance=~"$instance"',
    MODEL_MATCHER,
    'engine=~"$engine"',
)
#: What a panel over vLLM's series alone shows when none is scraped.
NO_VLLM = "No vLLM scraped"
#: Grafana's rate window: at least four scrape intervals whatever the zoom.
RATE_WINDOW = "$__rate_interval"
#: Grafana's custom unit "count:<symbol>": 1.2K tok/s.
TOKENS_PER_SECOND = "count:tok/s"

#: Above this share of the KV pool the worst case of what vLLM runs is close to not fitting.
OOM_RISK_WARN = 0.8
#: ``kv_sidecar_kv_exhaustion_seconds`` is +Inf while nothing grows: capped to keep the axis usable.
EXHAUSTION_CAP_SECONDS = 3600
#: ``kv_sidecar_vllm_metrics_age_seconds`` is +Inf before the first good scrape: capped likewise.
METRICS_AGE_CAP_SECONDS = 300


def sidecar(metric: str, *matchers: str) -> str:
    """A per-model sidecar series (``model_name``) filtered by the dashboard's variables."""
    return selector(metric, *SIDECAR_MATCHERS, MODEL_MATCHER, *matchers)


def sidecar_process(metric: str, *matchers: str) -> str:
    """A series of the sidecar process's own (no ``model_name``), filtered by the pods."""
    return selector(metric, *SIDECAR_MATCHERS, *matchers)


def vllm(metric: str, *matchers: str) -> str:
    """A vLLM series filtered by the dashboard's variables."""
    return selector(metric, *VLLM_MATCHERS, *matchers)


def quantile(q: float, bucket_series: str, by: tuple[str, ...] = ()) -> str:
    """One quantile of a histogram over the selected pods (per ``by`` label values)."""
    return histogram_quantile(q, bucket_series, RATE_WINDOW, by)


def duration(q: float, bucket_series: str, by: tuple[str, ...] = ()) -> str:
    """A quantile of a histogram of durations, without the NaN of a window with no observation:
    a panel with nothing to draw then shows its "no value" text rather than a blank chart.

    >>> duration(0.5, "x_bucket")
    'histogram_quantile(0.5, sum by (le) (rate(x_bucket[$__rate_interval]))) >= 0'
    """
    return f"{quantile(q, bucket_series, by)} >= 0"


def per_second(series: str) -> str:
    return rate(series, RATE_WINDOW)


# --- the figures -------------------------------------------------------------------------------

REFUSED_429 = sidecar("kv_sidecar_requests_total", *REFUSED_429_MATCHERS)
ENGINE_QUEUE_FULL_429 = sidecar(
    "kv_sidecar_requests_total", 'decision="reject"', 'reason="engine_queue_full"'
)
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
            [Query(PREEMPTIONS_PER_SECOND, "preemptions/s")],
            [Step(None, "green"), Step(0.001, "red")],
            decimals=3,
            no_data=NO_VLLM,
        ),
        stat_panel(
            "429 share",
            "Share of generation requests refused with 429 (kv_cache_full, queue_full, "
            "queue_timeout, counting_busy): the price paid for no preemption. High and sustained: "
            "add replicas.",
            "percentunit",
            [Query(SHARE_429, "429 share")],
            [Step(None, "green"), Step(0.05, "orange"), Step(0.1, "red")],
            no_data=NO_TRAFFIC,
        ),
        stat_panel(
            "OOM risk ratio (max)",
            "Worst pod: projected peak KV of everything vLLM runs or will run (the sidecar's "
            "requests in flight, plus traffic that bypasses it) over capacity. Above 1, vLLM "
            "preempts if all of it runs to max_tokens.",
            "percentunit",
            [Query(OOM_RISK_MAX, "OOM risk")],
            [Step(None, "green"), Step(OOM_RISK_WARN, "orange"), Step(1, "red")],
            no_data="No KV capacity known yet",
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
            no_data="No prediction yet",
        ),
        stat_panel(
            "Queue wait p99",
            "99th percentile of the time queued requests waited for admission or refusal.",
            "s",
            [Query(duration(0.99, sidecar("kv_sidecar_queue_wait_seconds_bucket")), "p99")],
            [Step(None, "green"), Step(5, "orange"), Step(30, "red")],
            no_data="Nothing queued",
        ),
        stat_panel(
            "vLLM time to first token p99",
            "vLLM's own TTFT: includes its internal queue, not the sidecar's.",
            "s",
            [Query(duration(0.99, vllm("vllm:time_to_first_token_seconds_bucket")), "p99")],
            [Step(None, "green"), Step(2, "orange"), Step(10, "red")],
            no_data=NO_TRAFFIC,
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
            width=6,
            stacked=True,
            no_data=NO_TRAFFIC,
        ),
        timeseries_panel(
            "vLLM preemptions /s",
            "vLLM's preemptions: should stay at 0 while the sidecar admits. Preemptions while "
            "the sidecar admits everything (no 429, no queue) mean its budget is too generous.",
            "short",
            [Query(_per_pod("sum", per_second(vllm("vllm:num_preemptions_total"))), "{{pod}}")],
            width=6,
            min_value=0,
            no_data=NO_VLLM,
        ),
        timeseries_panel(
            "vLLM requests running / waiting",
            "vLLM's scheduler: running requests hold KV; waiting ones queue inside vLLM.",
            "short",
            [
                Query(_per_pod("sum", vllm("vllm:num_requests_running")), "{{pod}} running"),
                Query(_per_pod("sum", vllm("vllm:num_requests_waiting")), "{{pod}} waiting"),
            ],
            width=6,
            min_value=0,
            no_data=NO_VLLM,
        ),
        timeseries_panel(
            "vLLM waiting requests by reason",
            "Requests waiting inside vLLM, by vLLM 0.32's reason label "
            "(vllm:num_requests_waiting_by_reason): capacity, waiting for KV-cache blocks or a "
            "batch slot (the queue admission should keep short); deferred, held back by another "
            "constraint such as a LoRA budget or a pending KV transfer.",
            "short",
            [
                Query(
                    f"sum by (pod, reason) ({vllm('vllm:num_requests_waiting_by_reason')})",
                    "{{pod}} {{reason}}",
                )
            ],
            width=6,
            stacked=True,
            min_value=0,
            no_data="No vllm:num_requests_waiting_by_reason: older vLLM versions do not export it",
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


PROMPT_COUNTS = sidecar("kv_sidecar_prompt_counts_total")
CHECK_MISMATCHES = sidecar("kv_sidecar_prompt_count_checks_total", 'result="mismatch"')
CHECK_MATCHES = sidecar("kv_sidecar_prompt_count_checks_total", 'result="match"')


def _counting_row() -> list[PanelBuilder]:
    return [
        timeseries_panel(
            "vLLM prefix-cache hit rate",
            "Share of the prompt tokens vLLM looked up in its prefix cache that it found there "
            "(vllm:prefix_cache_hits_total over vllm:prefix_cache_queries_total). Blocks that "
            "running requests share count once in the sidecar's prediction too (KV saved by "
            "shared prefixes, below); hits on blocks of finished requests are what vLLM saves "
            "in prefill.",
            "percentunit",
            [
                Query(
                    f"{_per_pod('sum', per_second(vllm('vllm:prefix_cache_hits_total')))}\n/\n"
                    f"({_per_pod('sum', per_second(vllm('vllm:prefix_cache_queries_total')))}"
                    " > 0)",
                    "{{pod}}",
                )
            ],
            min_value=0,
            max_value=1,
            no_data=NO_TRAFFIC,
        ),
        timeseries_panel(
            "Prompts counted: exactly here, by vLLM's /tokenize, estimated",
            "Share of the prompts the sidecar counted by each method: exact_local (its own "
            "tokenizer and chat template), exact_upstream (vLLM's /tokenize: no usable local "
            "tokenizer, content only vLLM renders, or a shape that failed its self-check) and "
            "estimate (neither could count it: an upper bound, so admission over-reserves; "
            "alert KVSidecarPromptCountsEstimated).",
            "percentunit",
            [
                Query(
                    f"sum by (method) ({per_second(PROMPT_COUNTS)})\n"
                    "/ ignoring (method) group_left ()\n"
                    f"(sum({per_second(PROMPT_COUNTS)}) > 0)",
                    "{{method}}",
                )
            ],
            stacked=True,
            min_value=0,
            max_value=1,
            colors={"^estimate$": "red", "^exact_upstream$": "orange", "^exact_local$": "green"},
            no_data=NO_TRAFFIC,
        ),
        stat_panel(
            "Prompt-count self-checks (time range)",
            "Local prompt counts checked against vLLM's /tokenize in the background (the first "
            "request of each shape, then 1 in 100) over the dashboard's time range. A mismatch "
            "puts its shape on /tokenize until the sidecar restarts: alert "
            "KVSidecarPromptCountMismatch, runbook in docs/alerts.md.",
            "none",
            [
                Query(
                    f"sum by (shape) (increase({CHECK_MISMATCHES}[$__range]))",
                    "{{shape}} mismatches",
                ),
                Query(
                    f"sum(increase({CHECK_MATCHES}[$__range]))",
                    "matches",
                ),
            ],
            [Step(None, "green"), Step(1, "red")],
            decimals=0,
            width=8,
            height=8,
            colors={"^matches$": "blue"},
        ),
    ]


def _latency_row() -> list[PanelBuilder]:
    return [
        timeseries_panel(
            "Latency through the sidecar (p50 / p99)",
            "Admitted requests from the moment the sidecar starts counting the prompt to the end "
            "of the relayed answer: counting, deciding, the sidecar's queue wait, vLLM's work "
            "and the relay (kv_sidecar_request_duration_seconds). Dashed: vLLM's own end-to-end "
            "latency p99, which starts when vLLM receives the request: the gap is what the "
            "sidecar adds, mostly its queue.",
            "s",
            [
                Query(duration(0.5, sidecar("kv_sidecar_request_duration_seconds_bucket")), "p50"),
                Query(duration(0.99, sidecar("kv_sidecar_request_duration_seconds_bucket")), "p99"),
                Query(
                    duration(0.99, vllm("vllm:e2e_request_latency_seconds_bucket")),
                    "vLLM e2e p99",
                ),
            ],
            width=12,
            min_value=0,
            dashed="^vLLM e2e p99$",
            no_data=NO_TRAFFIC,
        ),
        timeseries_panel(
            "Counting and decision latency",
            "Time to count a prompt's tokens, p99 by method (a round trip to vLLM for "
            "exact_upstream), and to project and decide (p50 / p99, no queue wait): the "
            "sidecar's own cost before a request reaches vLLM or its queue.",
            "s",
            [
                Query(
                    duration(
                        0.99, sidecar_process("kv_sidecar_tokenize_seconds_bucket"), ("method",)
                    ),
                    "count p99 {{method}}",
                ),
                Query(
                    duration(0.5, sidecar_process("kv_sidecar_decision_seconds_bucket")),
                    "decide p50",
                ),
                Query(
                    duration(0.99, sidecar_process("kv_sidecar_decision_seconds_bucket")),
                    "decide p99",
                ),
            ],
            width=12,
            min_value=0,
            no_data=NO_TRAFFIC,
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
            "Expected and adaptive modes: the output tokens reserved per sequence for "
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
        timeseries_panel(
            "Engine costs: the decode step",
            "What admission learned of vLLM's costs: a decode step of its running batch (from "
            "its inter-token latency), what each sequence decoding adds to a step and what each "
            "prompt token computed adds (from vLLM's inter-token latency against the tokens "
            "its steps decoded and the prompt tokens they computed). "
            "--tpot-target is checked against the step a larger batch would make.",
            "s",
            [
                Query(
                    _per_pod("max", sidecar("kv_sidecar_engine_decode_step_seconds")),
                    "{{pod}} decode step",
                ),
                Query(
                    _per_pod("max", sidecar("kv_sidecar_engine_step_seconds_per_sequence")),
                    "{{pod}} per decode sequence",
                ),
                Query(
                    _per_pod("max", sidecar("kv_sidecar_engine_step_seconds_per_token")),
                    "{{pod}} per prompt token",
                ),
            ],
            width=12,
            min_value=0,
            no_data="Not measured yet: vLLM has not been busy through two scrapes",
        ),
        timeseries_panel(
            "Engine costs: a recompute",
            "Tokens whose recompute (the prefill a preemption makes vLLM redo) costs one decode "
            "step. Adaptive reservations (--reservation adaptive) risk a preemption where it "
            "is cheap and reserve more where it is dear: a request is reserved to the length "
            "quantile at which the recompute it risks costs at most what running it in the batch "
            "saves (per 1,000 tokens of its answer: the second series, in decode steps), and at "
            "least --risk-steps decode steps.",
            "short",
            [
                Query(
                    _per_pod("min", sidecar("kv_sidecar_engine_prefill_tokens_per_step")),
                    "{{pod}} tokens a step",
                ),
                Query(
                    _per_pod("min", sidecar("kv_sidecar_engine_batch_gain_steps_per_token"))
                    + " * 1000",
                    "{{pod}} steps saved per 1,000 tokens in the batch",
                ),
            ],
            width=12,
            min_value=0,
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
                Query(duration(0.5, sidecar("kv_sidecar_retry_after_seconds_bucket")), "p50"),
                Query(duration(0.99, sidecar("kv_sidecar_retry_after_seconds_bucket")), "p99"),
            ],
            width=6,
            min_value=0,
            no_data="No Retry-After given",
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
                Query(duration(0.5, sidecar("kv_sidecar_queue_wait_seconds_bucket")), "p50"),
                Query(duration(0.99, sidecar("kv_sidecar_queue_wait_seconds_bucket")), "p99"),
            ],
            width=6,
            min_value=0,
            no_data="Nothing queued",
        ),
        timeseries_panel(
            "vLLM's own queue caps",
            "Requests vLLM's own queue caps (--max-num-queued-reqs, --max-num-queued-tokens) "
            "refused with 503, by vLLM's reason (its vllm:admission_rejections_total, relayed by "
            "the sidecar), and those of them the sidecar had admitted and answered with its own "
            "429 engine_queue_full. The first above the second: requests that reach vLLM around "
            "the sidecar; either above zero: the caps bind before the sidecar's own gate.",
            "reqps",
            [
                Query(
                    f"sum by (reason) "
                    f"({per_second(sidecar('kv_sidecar_vllm_admission_rejections_total'))})",
                    "vLLM refused: {{reason}}",
                ),
                Query(
                    f"sum({per_second(ENGINE_QUEUE_FULL_429)})",
                    "answered 429 engine_queue_full",
                ),
            ],
            width=24,
            min_value=0,
        ),
    ]


def _classes_row() -> list[PanelBuilder]:
    """Priorities and tenants (README: How admission decides, Priorities and tenants)."""
    classes = "kv_sidecar_class_requests_total"
    return [
        timeseries_panel(
            "Queued by priority and tenant",
            "Requests waiting in the sidecar's queue, by priority (lower is served first) and "
            "tenant. The first 16 of each seen have their own label, later ones are 'other'.",
            "short",
            [
                Query(
                    f"sum by (priority, tenant) ({sidecar('kv_sidecar_class_queue_depth')})",
                    "p{{priority}} {{tenant}}",
                )
            ],
            width=8,
            min_value=0,
            stacked=True,
        ),
        timeseries_panel(
            "Oldest queued request by priority",
            "Seconds the longest-waiting queued request of each priority has waited. One that "
            "keeps growing while others are admitted is a starving class "
            "(KVSidecarPriorityStarved). Beside it, each pod's prefill backlog: the seconds of "
            "prefill it has sent vLLM and not yet presumed done; requests of a positive "
            "priority wait while it is over --priority-pace.",
            "s",
            [
                Query(
                    f"max by (priority) ({sidecar('kv_sidecar_class_oldest_wait_seconds')})",
                    "p{{priority}}",
                ),
                Query(
                    _per_pod("max", sidecar("kv_sidecar_prefill_backlog_seconds")),
                    "{{pod}} prefill backlog",
                ),
            ],
            width=8,
            min_value=0,
        ),
        timeseries_panel(
            "Admitted and refused by priority and tenant",
            "Gate decisions per second, by priority, tenant and decision (the refusals' reasons "
            "are in the 429 rate panel).",
            "reqps",
            [
                Query(
                    f"sum by (priority, tenant, decision) ({per_second(sidecar(classes))})",
                    "p{{priority}} {{tenant}} {{decision}}",
                )
            ],
            width=8,
            min_value=0,
            no_data="No generation requests",
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
                Query(duration(0.5, vllm("vllm:time_to_first_token_seconds_bucket")), "p50"),
                Query(duration(0.99, vllm("vllm:time_to_first_token_seconds_bucket")), "p99"),
            ],
            min_value=0,
            no_data=NO_TRAFFIC,
        ),
        timeseries_panel(
            "vLLM inter-token latency (p50 / p99)",
            "Time between tokens of a running request: grows with batch size and recomputation.",
            "s",
            [
                Query(duration(0.5, vllm("vllm:inter_token_latency_seconds_bucket")), "p50"),
                Query(duration(0.99, vllm("vllm:inter_token_latency_seconds_bucket")), "p99"),
            ],
            min_value=0,
            no_data=NO_TRAFFIC,
        ),
        timeseries_panel(
            "vLLM token throughput",
            "Prompt tokens prefilled and tokens generated per second.",
            TOKENS_PER_SECOND,
            [
                Query(
                    _per_pod("sum", per_second(vllm("vllm:prompt_tokens_total"))),
                    "{{pod}} prompt",
                ),
                Query(
                    _per_pod("sum", per_second(vllm("vllm:generation_tokens_total"))),
                    "{{pod}} generation",
                ),
            ],
            min_value=0,
            no_data=NO_VLLM,
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
            width=6,
            min_value=0,
        ),
        timeseries_panel(
            "vLLM reachable from the sidecar",
            "1 when the sidecar's last scrape of vLLM succeeded.",
            "short",
            [Query(_per_pod("min", sidecar("kv_sidecar_vllm_up")), "{{pod}}")],
            width=6,
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
            width=6,
            min_value=0,
        ),
        timeseries_panel(
            "Sidecar CPU (share of what it can use)",
            "The sidecar's CPU time per second (process_cpu_seconds_total, its main process and "
            "relay workers together) over what it can use: its CPU limit "
            "(kv_sidecar_cpu_limit_cores), at most one core per event loop (one thread each): "
            "the main process's, plus one per relay worker (kv_sidecar_relay_workers, with "
            "--workers above 1). Above the dashed line for 10 minutes: alert "
            "KVSidecarCPUSaturated; a saturated sidecar delays every request and its scrapes "
            "of vLLM.",
            "percentunit",
            [
                Query(
                    _per_pod(
                        "max",
                        cpu_share(
                            sidecar_process("process_cpu_seconds_total"),
                            sidecar_process("kv_sidecar_cpu_limit_cores"),
                            RATE_WINDOW,
                            relay_workers=sidecar_process(RELAY_WORKERS),
                        ),
                    ),
                    "{{pod}}",
                )
            ],
            width=6,
            min_value=0,
            threshold_line=CPU_SATURATION_SHARE,
        ),
        timeseries_panel(
            "Sidecar event-loop lag (p99)",
            "How late the sidecar's event loop ran a timer due every 100 ms "
            "(kv_sidecar_event_loop_lag_seconds; the owner's loop with relay workers), p99 over "
            "the rate window. Every request's next step waits as long: a few ms at most on a "
            "healthy sidecar; more when it is CPU-bound (see the CPU panel) or a call blocks it.",
            "s",
            [
                Query(
                    duration(
                        0.99, sidecar_process("kv_sidecar_event_loop_lag_seconds_bucket"), ("pod",)
                    ),
                    "{{pod}}",
                )
            ],
            width=6,
            min_value=0,
            no_data="no probe in the window: the sidecar is not running",
        ),
    ]


#: Top to bottom; the first three rows fit one screen and answer "is admission working?".
ROWS: tuple[tuple[str, Callable[[], list[PanelBuilder]]], ...] = (
    ("Is admission working?", _verdict_row),
    ("Admission against preemption", _against_preemption_row),
    ("KV cache: predicted vs actual", _kv_row),
    ("Prompt counting and vLLM's prefix cache", _counting_row),
    ("Latency through the sidecar", _latency_row),
    ("Reservations and risk", _risk_row),
    ("Refusals and queue", _refusals_and_queue_row),
    ("Priorities and tenants", _classes_row),
    ("vLLM latency and throughput", _vllm_latency_row),
    ("Sidecar health", _health_row),
)


#: The vLLM series the vLLM-side variables list their values from: every engine exports it.
VLLM_VARIABLE_SERIES = "vllm:num_requests_running"


def _query_variable(
    name: str, label: str, query: str, *, all_value: str | None = None
) -> dashboard_builders.QueryVariable:
    variable = (
        dashboard_builders.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
    )
    return variable if all_value is None else variable.all_value(all_value)


def _variables() -> list[Builder[dashboard_models.VariableModel]]:
    """Each variable lists its values under the ones before it.

    Namespaces and pods come from a series every running sidecar exports; their "All" keeps
    Grafana's default (the list of those values) rather than ".*", so vLLM panels never show
    pods without a sidecar. ``job``, ``instance``, ``model_name`` and ``engine`` are vLLM's
    labels of those pods, named as vLLM's example dashboards name them so that the link carries
    them there; their "All" is ".*", which also matches a vLLM without the ``engine`` label.
    """
    variables: list[Builder[dashboard_models.VariableModel]] = [
        dashboard_builders.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        _query_variable("namespace", "Namespace", "label_values(kv_sidecar_vllm_up, namespace)"),
        _query_variable(
            "pod", "Pod", 'label_values(kv_sidecar_vllm_up{namespace=~"$namespace"}, pod)'
        ),
    ]
    matchers = list(SIDECAR_MATCHERS)
    for name, label in (
        ("job", "Job"),
        ("instance", "Instance"),
        ("model_name", "Model"),
        ("engine", "Engine"),
    ):
        query = f"label_values({selector(VLLM_VARIABLE_SERIES, *matchers)}, {name})"
        variables.append(_query_variable(name, label, query, all_value=".*"))
        matchers.append(f'{name}=~"${name}"')
    return variables


def _links() -> list[Builder[dashboard_models.DashboardLink]]:
    """vLLM's dashboards (tagged ``vllm``), opened with this one's variables and time range."""
    return [
        dashboard_builders.DashboardLink("vLLM dashboards")
        .type(dashboard_models.DashboardLinkType.DASHBOARDS)
        .tags([VLLM_DASHBOARD_TAG])
        .as_dropdown(True)
        .include_vars(True)
        .keep_time(True)
        .tooltip("vLLM's own dashboards, on the same job, instance, model_name and engine")
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
        .tags([VLLM_DASHBOARD_TAG, "kv-sidecar", "kv-cache"])
        .timezone("browser")
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .variables(_variables())
        .links(_links())
    )
    for title, make_panels in ROWS:
        board = board.with_row(dashboard_builders.Row(title).id(next(ids)))
        for panel in make_panels():
            board = board.with_panel(panel.id(next(ids)))
    built: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return built
