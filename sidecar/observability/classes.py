"""The exporter's figures per priority and tenant (``sidecar.admission.class_stats`` bounds their
labels: the first 16 of each seen get their own, later ones ``other``; the empty tenant is
``none``).

>>> from sidecar.admission.ask import KVState
>>> state = KVState(None, None, 0, 0, 0, 0, 0, None, 0, 0, 0, 0, 0, 0, None, None, 0,
...                 class_decisions={("0", "none", "admit"): 3}, class_queued={("5", "etl"): 2},
...                 class_oldest_wait={"5": 7.5})
>>> samples = [s for f in class_families(state) for s in f.samples]
>>> [(s.labels, s.value) for s in samples if s.name == "kv_sidecar_class_queue_depth"]
[({'priority': '0', 'tenant': 'none'}, 0), ({'priority': '5', 'tenant': 'etl'}, 2)]
>>> [(s.labels, s.value) for s in samples if s.name.endswith("oldest_wait_seconds")]
[({'priority': '0'}, 0.0), ({'priority': '5'}, 7.5)]
"""

from __future__ import annotations

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from sidecar.admission.ask import KVState

PREFIX = "kv_sidecar"
#: the class every request is in unless it says otherwise: its series exist from the start
_DEFAULT = ("0", "none")


def class_families(state: KVState) -> list[Metric]:
    """``kv_sidecar_class_*``: decisions, queue depth, oldest wait and queue wait per class."""
    decided = CounterMetricFamily(
        f"{PREFIX}_class_requests",
        "Generation requests decided by the gate, by priority, tenant and decision (admit, "
        "reject, cancel).",
        labels=("priority", "tenant", "decision"),
    )
    decisions = dict(state.class_decisions)
    for outcome in ("admit", "reject", "cancel"):
        decisions.setdefault((*_DEFAULT, outcome), 0)
    for (priority, tenant, outcome), count in sorted(decisions.items()):
        decided.add_metric([priority, tenant, outcome], count)
    depth = GaugeMetricFamily(
        f"{PREFIX}_class_queue_depth",
        "Requests waiting in the admission queue, by priority and tenant.",
        labels=("priority", "tenant"),
    )
    queued = dict(state.class_queued)
    queued.setdefault(_DEFAULT, 0)
    for (priority, tenant), count in sorted(queued.items()):
        depth.add_metric([priority, tenant], count)
    priorities = {p for p, _, _ in decisions} | {p for p, _ in queued}
    oldest = GaugeMetricFamily(
        f"{PREFIX}_class_oldest_wait_seconds",
        "Seconds the longest-waiting queued request of each priority has waited (0: none "
        "queued); one that keeps growing while others are admitted is a starving class.",
        labels=("priority",),
    )
    for priority in sorted(priorities):
        oldest.add_metric([priority], state.class_oldest_wait.get(priority, 0.0))
    waited = SummaryMetricFamily(
        f"{PREFIX}_class_queue_wait_seconds",
        "Seconds queued requests waited before their decision, by priority.",
        labels=("priority",),
    )
    for priority in sorted(priorities):
        total, count = state.class_waited.get(priority, (0.0, 0))
        waited.add_metric([priority], count_value=count, sum_value=total)
    return [decided, depth, oldest, waited]
