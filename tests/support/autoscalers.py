"""The shipped autoscalers' inputs, read from the rendered overlays, and the HPA's replica formula.

``rendered()`` reads ``deploy/overlays/autoscaling-keda`` and ``.../autoscaling-hpa`` as
``kubectl kustomize`` renders them (:func:`tests.support.manifests.render`) and returns KEDA's
query, threshold and metric type and the HPA's Pods metric and target; ``keda_desired`` is the
count KEDA's HPA aims for.

>>> keda_desired(2.97, 0.8, "AverageValue", current=1)
4
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tests.support.manifests import of_kind, render


@dataclass(frozen=True)
class Rendered:
    """The shipped autoscalers' inputs: KEDA's query and threshold, the HPA's metric and target."""

    keda_query: str
    keda_threshold: float
    keda_metric_type: str
    keda_max: int
    hpa_metric: str
    hpa_target: float


def _quantity(value: str | int | float) -> float:
    """A Kubernetes quantity as the HPA reads it ("800m" -> 0.8)."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def rendered() -> Rendered:
    (scaled,) = of_kind(render("overlays/autoscaling-keda"), "ScaledObject")
    (kv,) = [t for t in scaled["spec"]["triggers"] if t["name"] == "kv-demand"]
    (hpa,) = of_kind(render("overlays/autoscaling-hpa"), "HorizontalPodAutoscaler")
    (pods,) = [
        m["pods"]
        for m in hpa["spec"]["metrics"]
        if m["type"] == "Pods" and m["pods"]["metric"]["name"] != "kv_sidecar_queue_depth"
    ]
    assert pods["target"]["type"] == "AverageValue"
    return Rendered(
        keda_query=kv["metadata"]["query"],
        keda_threshold=float(kv["metadata"]["threshold"]),
        keda_metric_type=kv.get("metricType", "AverageValue"),
        keda_max=int(scaled["spec"]["maxReplicaCount"]),
        hpa_metric=pods["metric"]["name"],
        hpa_target=_quantity(pods["target"]["averageValue"]),
    )


def keda_desired(metric: float, threshold: float, metric_type: str, current: int) -> int:
    """The replicas KEDA's HPA aims for (before min/max and the behaviour's rate limits)."""
    if metric_type == "AverageValue":
        return math.ceil(metric / threshold)
    assert metric_type == "Value", metric_type
    return math.ceil(current * metric / threshold)
