"""Reading Prometheus exposition text (vLLM's ``/metrics``, the sidecar's): pure functions.

A leaf, shared by the workloads, the vLLM launcher and the description of a running vLLM.

>>> text = '''vllm:num_requests_running{engine="0"} 2.0
... vllm:num_requests_running{engine="1"} 3.0
... '''
>>> metric_value(text, "vllm:num_requests_running")
5.0
>>> metric_value(text, "vllm:num_requests_running", engine="1")
3.0
>>> metric_value(text, "vllm:num_requests_waiting") is None
True
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """Sum of a metric's samples whose labels include ``labels`` (None when absent)."""
    total: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + sample.value
    return total


def cache_config_labels(metrics_text: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (the first engine's, under data parallelism)."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:cache_config_info" and family.samples:
            return dict(family.samples[0].labels)
    raise LookupError("vllm:cache_config_info is not in vLLM's /metrics")
