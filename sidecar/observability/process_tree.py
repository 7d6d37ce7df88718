"""The standard ``process_*`` metrics summed over the sidecar's processes (owner and workers).

With relay workers (``--workers N``) the pod's sidecar is several processes; its CPU and memory
are theirs together. :class:`ProcessTreeCollector` takes prometheus_client's
:class:`~prometheus_client.ProcessCollector` figures for each process and adds them up: CPU
seconds, resident and virtual memory, open file descriptors. The start time and the fd limit are
the owner's. A worker that exits leaves its CPU seconds in the sum, so that the counter never
goes back (a replaced worker is not a counter reset).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_SUMMED = {
    "process_virtual_memory_bytes": "Virtual memory size in bytes, summed over the processes.",
    "process_resident_memory_bytes": "Resident memory size in bytes, summed over the processes.",
    "process_open_fds": "Number of open file descriptors, summed over the processes.",
}
_OWNER = {
    "process_start_time_seconds": "Start time of the process since unix epoch in seconds.",
    "process_max_fds": "Maximum number of open file descriptors.",
}
CPU = "process_cpu_seconds_total"


def _samples(pid: int) -> dict[str, float]:
    collector = ProcessCollector(pid=lambda: pid, registry=None)
    return {s.name: s.value for family in collector.collect() for s in family.samples}


class ProcessTreeCollector(Collector):
    """``process_*`` for this process and ``children()`` together."""

    def __init__(self, children: Callable[[], Iterable[int]]) -> None:
        self.children = children
        self._cpu_seen: dict[int, float] = {}  # the last CPU seconds read per worker pid
        self._cpu_gone = 0.0  # of workers that have exited

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        own = _samples(os.getpid())
        if not own:  # no /proc here: nothing to report, as ProcessCollector
            return
        totals = {name: own.get(name, 0.0) for name in _SUMMED}
        cpu = own.get(CPU, 0.0)
        alive: dict[int, float] = {}
        for pid in self.children():
            samples = _samples(pid)
            if not samples:
                continue
            for name in _SUMMED:
                totals[name] += samples.get(name, 0.0)
            alive[pid] = samples.get(CPU, 0.0)
        for pid, seconds in self._cpu_seen.items():
            if pid not in alive:
                self._cpu_gone += seconds
        self._cpu_seen = alive
        yield CounterMetricFamily(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds, summed over the processes.",
            value=cpu + self._cpu_gone + sum(alive.values()),
        )
        for name, doc in _SUMMED.items():
            yield GaugeMetricFamily(name, doc, value=totals[name])
        for name, doc in _OWNER.items():
            if name in own:
                yield GaugeMetricFamily(name, doc, value=own[name])
