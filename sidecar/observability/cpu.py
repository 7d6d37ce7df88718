"""The CPU the sidecar process may use, exported as ``kv_sidecar_cpu_limit_cores``.

Its cgroup's CPU quota (Kubernetes' CPU limit) capped by the CPUs its affinity mask allows
(``sidecar.cgroup``). The alert on the sidecar's own CPU saturation divides
``rate(process_cpu_seconds_total)`` (the process collector on the same registry) by it. Read at
scrape time, like the process collector's figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.cgroup import (
    available_cpus,
    cgroup_quota_cores,
    cpu_limit_cores,
    parse_cfs_quota,
    parse_cpu_max,
)

__all__ = [
    "METRIC",
    "CpuLimitCollector",
    "available_cpus",
    "cgroup_quota_cores",
    "cpu_limit_cores",
    "parse_cfs_quota",
    "parse_cpu_max",
]

METRIC = "kv_sidecar_cpu_limit_cores"


class CpuLimitCollector(Collector):
    """Yields ``kv_sidecar_cpu_limit_cores`` at scrape time.

    >>> from prometheus_client import CollectorRegistry
    >>> registry = CollectorRegistry()
    >>> registry.register(CpuLimitCollector(lambda: 1.5))
    >>> registry.get_sample_value("kv_sidecar_cpu_limit_cores")
    1.5
    """

    def __init__(self, read: Callable[[], float] = cpu_limit_cores) -> None:
        self.read = read

    def describe(self) -> Iterable[Metric]:
        return []  # read at collect time only

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            METRIC,
            "CPU cores the sidecar process may use: its cgroup's CPU quota (the container's CPU "
            "limit) capped by the CPUs its affinity allows; without a quota, those CPUs.",
            value=self.read(),
        )
