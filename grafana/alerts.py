"""The Prometheus alert rules: one source for ``grafana/alerts.yaml`` and the PrometheusRule.

Each alert names its runbook in ``docs/alerts.md`` (the anchor is the alert's name in lower
case). Sidecar alerts aggregate ``by (namespace, pod)``: one sidecar per vLLM pod, so each alert
names one pod, and a pod scraped twice does not alert twice. Those over the model's series
(docs/metrics.md, The model_name label) aggregate by ``model_name`` too, as VLLMPreempting does
over vLLM's: one sidecar fronts one model, so they still alert once per pod, and name the model
(no ``model_name`` before the sidecar has discovered vLLM).

Two things differ from one installation to the next and are parameters of :func:`rule_groups`
(``python -m grafana.build --runbook-base URL --sidecar-matcher MATCHER``), with the defaults
below: where the runbooks live, and the matcher that finds the sidecar's scrape targets.

>>> [rule["alert"] for rule in rule_groups()[0]["rules"]][:2]
['KVSidecarOOMRiskHigh', 'VLLMPreempting']
>>> rule_groups("https://wiki.example.com/kv")[0]["rules"][0]["annotations"]["runbook_url"]
'https://wiki.example.com/kv#kvsidecaroomriskhigh'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from grafana.promql import (
    CPU_SATURATION_SHARE,
    EVENT_LOOP_CORES,
    REFUSED_429_MATCHERS,
    cpu_share,
    rate,
    selector,
)

GROUP = "kv-sidecar"

#: Label matcher selecting the sidecar's own scrape targets in ``up`` (the default of
#: ``python -m grafana.build --sidecar-matcher``). The job label cannot tell them apart:
#: deploy/components/monitoring/podmonitor.yaml scrapes vLLM's port and the sidecar's metrics
#: port of each pod under one job (``<namespace>/llm``). Prometheus Operator labels every target
#: with its container, so select on that; give another matcher if your sidecar container has
#: another name, or match on ``job`` where the sidecar has a job of its own. KVSidecarVLLMDown
#: covers vLLM.
SIDECAR_TARGET_MATCHER = 'container="kv-sidecar"'

#: Where the runbooks live by default; each alert links to ``<base>#<alert name in lower case>``.
RUNBOOK_BASE_URL = "https://github.com/vllm-kv-sidecar/vllm-kv-sidecar/blob/main/docs/alerts.md"

#: Label matchers as PromQL spells them in a selector: each a label name, an operator and a
#: double-quoted value, comma-separated.
_ONE_MATCHER = r'[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"'
_MATCHERS = re.compile(rf"{_ONE_MATCHER}(?:\s*,\s*{_ONE_MATCHER})*")

#: Past this age the sidecar's view of vLLM is stale: 3x the default --metrics-stale-after (5 s)
#: and 30 of its default scrape intervals (0.5 s), so a slow scrape or two never fires it.
VLLM_METRICS_STALE_SECONDS = 15
#: Sustained |predicted - actual| above this share of capacity means a wrong geometry, not noise.
PREDICTION_ERROR_SHARE = 0.1
#: Share of generation requests refused with 429 above which capacity is short of demand.
REJECT_SHARE = 0.1
#: Share of prompts counted by an upper-bound estimate above which admission over-reserves
#: noticeably. A few requests of forms nothing can count exactly (a Responses
#: ``previous_response_id``, a completions ``suffix``) stay below it; a lost /tokenize does not.
ESTIMATE_SHARE = 0.05
#: Minutes KVSidecarPromptCountMismatch fires after a mismatch. A shape mismatches once per
#: sidecar process (it is counted by vLLM from then on, and no longer checked), so the
#: counter moves once and the alert resolves this long after, although the shape stays counted
#: by vLLM until the sidecar restarts.
PROMPT_COUNT_MISMATCH_MINUTES = 30
#: Minutes of CPU use above CPU_SATURATION_SHARE before KVSidecarCPUSaturated fires: long enough
#: that a burst of long prompts to tokenize does not, short enough to catch a sidecar starved
#: by a CPU limit set too low.
CPU_SATURATION_MINUTES = 10
#: Seconds the oldest queued request of one priority may wait, while the pod admits others,
#: before KVSidecarPriorityStarved: past a minute's worth of answers on a busy pool, and well
#: inside the 300 s default --max-queue-wait, so that it fires before those requests time out.
STARVED_WAIT_SECONDS = 120


@dataclass(frozen=True)
class Alert:
    """One alerting rule; ``description`` may use ``$labels`` and ``$value`` templates."""

    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    def rule(self, runbook_base: str = RUNBOOK_BASE_URL) -> dict[str, Any]:
        """The rule as Prometheus's rules file spells it, its runbook under ``runbook_base``."""
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": f"{runbook_base}#{self.name.lower()}",
            },
        }


_WHERE = "{{ $labels.namespace }}/{{ $labels.pod }}"
#: Where, and the model where the alert has one (the per-model alerts').
_WHERE_MODEL = _WHERE + "{{ with $labels.model_name }} (model {{ . }}){{ end }}"
#: The grouping of the alerts over the sidecar's per-model series.
_PER_MODEL = "namespace, pod, model_name"
_ESTIMATED = selector("kv_sidecar_prompt_counts_total", 'method="estimate"')

#: Every alert but KVSidecarDown (:func:`sidecar_down`) and KVSidecarVLLMDown, in order.
_PER_POD_ALERTS: tuple[Alert, ...] = (
    Alert(
        name="KVSidecarOOMRiskHigh",
        expr=f"max by ({_PER_MODEL}) (kv_sidecar_oom_risk_ratio) > 1",
        for_="5m",
        severity="warning",
        summary="KV demand of what vLLM runs exceeds its KV pool.",
        description=(
            f"{_WHERE_MODEL}: requests in flight (and traffic that bypasses the sidecar) would "
            "need {{ $value | humanizePercentage }} of the KV pool if they all ran to max_tokens, "
            "for 5 minutes. vLLM preempts if they do."
        ),
    ),
    Alert(
        name="VLLMPreempting",
        expr=(
            f"sum by (namespace, pod, model_name) ({rate('vllm:num_preemptions_total', '5m')}) > 0"
        ),
        for_="5m",
        severity="warning",
        summary="vLLM is preempting requests: its KV cache runs dry mid-decode.",
        description=(
            f"vLLM in {_WHERE} (model {{{{ $labels.model_name }}}}) has been preempting "
            '{{ printf "%.3g" $value }} requests/s for 5 minutes: it throws their KV away and '
            "recomputes it, and latency and throughput collapse."
        ),
    ),
    Alert(
        name="KVSidecarPredictionErrorHigh",
        expr=(
            f"max by ({_PER_MODEL}) "
            "(abs(avg_over_time(kv_sidecar_kv_prediction_error_bytes[10m])))\n"
            "/\n"
            f"max by ({_PER_MODEL}) (kv_sidecar_kv_capacity_bytes > 0)\n"
            f"> {PREDICTION_ERROR_SHARE}"
        ),
        for_="10m",
        severity="warning",
        summary="The sidecar's predicted KV use is far from what vLLM reports.",
        description=(
            f"{_WHERE_MODEL}: predicted minus actual KV averaged "
            "{{ $value | humanizePercentage }} of capacity over 10 minutes, for 10 minutes. "
            "The model config or KV geometry the sidecar uses is probably wrong, so its "
            "admission decisions are too."
        ),
    ),
    Alert(
        name="KVSidecarVLLMMetricsStale",
        expr=(
            f"max by ({_PER_MODEL}) (kv_sidecar_vllm_metrics_age_seconds) "
            f"> {VLLM_METRICS_STALE_SECONDS}"
        ),
        for_="2m",
        severity="warning",
        summary="The sidecar's view of vLLM's KV cache is stale.",
        description=(
            f"{_WHERE_MODEL}: the last good scrape of vLLM's /metrics is "
            "{{ $value | humanizeDuration }} old. The sidecar decides on its ledger alone "
            "(--stale-policy open) or refuses with 503 (closed)."
        ),
    ),
    Alert(
        name="KVSidecarHighRejectRate",
        expr=(
            f"sum by ({_PER_MODEL}) "
            f"({rate(selector('kv_sidecar_requests_total', *REFUSED_429_MATCHERS), '5m')})\n"
            "/\n"
            f"sum by ({_PER_MODEL}) ({rate('kv_sidecar_requests_total', '5m')})\n"
            f"> {REJECT_SHARE}"
        ),
        for_="10m",
        severity="warning",
        summary="The sidecar refuses many requests with 429: KV capacity is short of demand.",
        description=(
            f"{_WHERE_MODEL}: {{{{ $value | humanizePercentage }}}} of generation requests were "
            "refused with 429 (kv_cache_full, queue_full, queue_timeout, counting_busy) for 10 "
            "minutes."
        ),
    ),
    Alert(
        name="KVSidecarPromptCountsEstimated",
        expr=(
            f"sum by ({_PER_MODEL}) "
            f"({rate(_ESTIMATED, '10m')})\n"
            "/\n"
            f"sum by ({_PER_MODEL}) ({rate('kv_sidecar_prompt_counts_total', '10m')})\n"
            f"> {ESTIMATE_SHARE}"
        ),
        for_="10m",
        severity="warning",
        summary="The sidecar estimates many prompt lengths instead of counting them.",
        description=(
            f"{_WHERE_MODEL}: {{{{ $value | humanizePercentage }}}} of prompts were counted by an "
            "upper-bound estimate over 10 minutes, for 10 minutes. Admission over-reserves KV "
            "for those requests, so it queues and refuses more than it needs to. Usually vLLM's "
            "/tokenize is unreachable or the sidecar cannot read the model's tokenizer."
        ),
    ),
    Alert(
        name="KVSidecarPromptCountMismatch",
        expr=(
            f"sum by ({_PER_MODEL}, shape) (increase("
            + selector("kv_sidecar_prompt_count_checks_total", 'result="mismatch"')
            + f"[{PROMPT_COUNT_MISMATCH_MINUTES}m])) > 0"
        ),
        # One mismatch is a fact, not noise: the ``for`` is a single evaluation interval.
        for_="1m",
        severity="warning",
        summary="The sidecar's local prompt count disagrees with vLLM's.",
        description=(
            f"{_WHERE_MODEL}: a local count of a {{{{ $labels.shape }}}} prompt differed from "
            f"vLLM's (render or /tokenize) in the last {PROMPT_COUNT_MISMATCH_MINUTES} minutes. "
            "The sidecar counts {{ $labels.shape }} prompts with vLLM until it restarts (exact, "
            "but a round trip per request): its tokenizer or chat template does not render that "
            "shape as vLLM does."
        ),
    ),
    Alert(
        name="KVSidecarPriorityStarved",
        expr=(
            f"max by ({_PER_MODEL}, priority) (kv_sidecar_class_oldest_wait_seconds) > "
            f"{STARVED_WAIT_SECONDS}\nand on ({_PER_MODEL})\n"
            f"sum by ({_PER_MODEL}) ("
            + rate(selector("kv_sidecar_class_requests_total", 'decision="admit"'), "5m")
            + ") > 0"
        ),
        for_="5m",
        severity="warning",
        summary="Requests of one priority wait in the queue while others are admitted.",
        description=(
            f"{_WHERE_MODEL}: the oldest queued request of priority {{{{ $labels.priority }}}} has "
            f"waited over {STARVED_WAIT_SECONDS} s for 5 minutes while the sidecar admitted "
            "other requests: better priorities (or other tenants' shares) take all the KV "
            "that frees. Its requests time out with 429 queue_timeout at --max-queue-wait."
        ),
    ),
    Alert(
        name="KVSidecarCPUSaturated",
        expr=(
            "max by (namespace, pod) (\n"
            + cpu_share("process_cpu_seconds_total", "kv_sidecar_cpu_limit_cores", "5m")
            + f"\n) > {CPU_SATURATION_SHARE}"
        ),
        for_=f"{CPU_SATURATION_MINUTES}m",
        severity="warning",
        summary="The sidecar uses nearly all the CPU it can: every request waits for it.",
        description=(
            f"{_WHERE}: the sidecar's processes have used {{{{ $value | humanizePercentage }}}} "
            f"of the CPU they can use (their CPU limit, at most {EVENT_LOOP_CORES} core per "
            "event loop: the main process and each relay worker) for "
            f"{CPU_SATURATION_MINUTES} minutes. Counting, admission, the relay and its scrapes "
            "of vLLM all wait for it: latency grows and its view of vLLM can go stale."
        ),
    ),
)

_VLLM_DOWN = Alert(
    name="KVSidecarVLLMDown",
    expr=f"max by ({_PER_MODEL}) (kv_sidecar_vllm_up) == 0",
    for_="2m",
    severity="critical",
    summary="The sidecar cannot reach vLLM.",
    description=(
        f"{_WHERE_MODEL}: the sidecar's scrapes of vLLM's /metrics have failed for 2 minutes. "
        "Generation requests get 503 with Retry-After."
    ),
)


def sidecar_down(sidecar_matcher: str = SIDECAR_TARGET_MATCHER) -> Alert:
    """KVSidecarDown, on the scrape targets ``up{<sidecar_matcher>}`` selects."""
    up = selector("up", sidecar_matcher)
    return Alert(
        name="KVSidecarDown",
        expr=f"{up} == 0\nor\nabsent({up})",
        for_="5m",
        severity="critical",
        summary="Prometheus cannot scrape the KV sidecar.",
        description=(
            "{{ if $labels.instance }}Prometheus cannot scrape the sidecar at "
            "{{ $labels.instance }} ("
            + _WHERE
            + "){{ else }}No target matching up{"
            + sidecar_matcher.replace('"', "'")
            + "} is scraped{{ end }}. Clients of a sidecar that is down get no answer, and its "
            "admission is unobserved."
        ),
    )


def alerts(sidecar_matcher: str = SIDECAR_TARGET_MATCHER) -> tuple[Alert, ...]:
    """Every alert, KVSidecarDown on the targets ``sidecar_matcher`` selects (one matcher or
    several, comma-separated, as in a PromQL selector)."""
    if not _MATCHERS.fullmatch(sidecar_matcher):
        raise ValueError(
            f'not PromQL label matchers (label="value", or =~, !=, !~): {sidecar_matcher!r}'
        )
    return (*_PER_POD_ALERTS, sidecar_down(sidecar_matcher), _VLLM_DOWN)


#: The alerts with the default sidecar matcher.
ALERTS: tuple[Alert, ...] = alerts()


def rule_groups(
    runbook_base: str = RUNBOOK_BASE_URL, sidecar_matcher: str = SIDECAR_TARGET_MATCHER
) -> list[dict[str, Any]]:
    """The ``groups`` of a Prometheus rules file (and of the PrometheusRule's spec): runbooks
    under ``runbook_base`` (a URL without a fragment), KVSidecarDown on ``sidecar_matcher``."""
    if not re.fullmatch(r"https?://[^\s#]+", runbook_base):
        raise ValueError(f"not an http(s) URL without a #fragment: {runbook_base!r}")
    rules = [alert.rule(runbook_base) for alert in alerts(sidecar_matcher)]
    return [{"name": GROUP, "rules": rules}]
