"""The standard ``process_*`` metrics of the sidecar's processes (owner and workers), read from
``/proc`` at scrape time.

The figures are those of prometheus_client's :class:`~prometheus_client.ProcessCollector` (CPU
seconds, resident and virtual memory, start time from ``/proc/PID/stat``, the fd limit from
``/proc/PID/limits``, the open file descriptors), read more cheaply: the boot time once rather
than at every scrape, and the open file descriptors from the size Linux reports for
``/proc/PID/fd`` (6.2 and later: a count of the process's fd table) rather than by listing that
directory, which costs about 1 ms per thousand descriptors. A process relaying 2,000 requests
holds some 4,000 (its clients' and vLLM's connections), and a scrape runs on the event loop that
decides admission. An older kernel reports a size of 0 there: the directory is listed, as
prometheus_client does.

With relay workers (``--workers N``) the pod's sidecar is several processes; its CPU and memory
are theirs together. :class:`ProcessTreeCollector` adds them up: CPU seconds, resident and
virtual memory, open file descriptors. The start time and the fd limit are the owner's. A worker
that exits leaves its CPU seconds in the sum, so that the counter never goes back (a replaced
worker is not a counter reset). Without workers it reports this process alone, under
prometheus_client's names and help texts.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_SUMMED = {
    "process_virtual_memory_bytes": "Virtual memory size in bytes, summed over the processes.",
    "process_resident_memory_bytes": "Resident memory size in bytes, summed over the processes.",
    "process_open_fds": "Number of open file descriptors, summed over the processes.",
}
#: the help texts of prometheus_client's process collector (one process)
_ALONE = {
    "process_virtual_memory_bytes": "Virtual memory size in bytes.",
    "process_resident_memory_bytes": "Resident memory size in bytes.",
    "process_open_fds": "Number of open file descriptors.",
}
_OWNER = {
    "process_start_time_seconds": "Start time of the process since unix epoch in seconds.",
    "process_max_fds": "Maximum number of open file descriptors.",
}
CPU = "process_cpu_seconds_total"
#: the same in clock ticks, a whole number: sums of these are exact, so the total never steps
#: back when a process's share moves from the living to the exited ones
TICKS = "cpu_ticks"
PROC = "/proc"


def boot_time(proc: str = PROC) -> float | None:
    """The machine's boot time, seconds since the epoch (``btime`` in ``/proc/stat``); None
    where there is no /proc."""
    try:
        with open(os.path.join(proc, "stat"), "rb") as fh:
            for line in fh:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def open_fds(pid: int, proc: str = PROC) -> int:
    """How many file descriptors process ``pid`` has open: the size of ``/proc/PID/fd`` where
    the kernel reports it (Linux 6.2 and later), else the directory's entries. A process with no
    descriptor open also has size 0; its listing is then as cheap as it is empty."""
    path = os.path.join(proc, str(pid), "fd")
    size = os.stat(path).st_size
    return size if size > 0 else len(os.listdir(path))


class ProcessReader:
    """One process's ``process_*`` figures, as prometheus_client's ProcessCollector reads them."""

    def __init__(self, proc: str = PROC) -> None:
        self.proc = proc
        self.btime = boot_time(proc)
        self.ticks = float(os.sysconf("SC_CLK_TCK"))
        self.pagesize = resource.getpagesize()

    def read(self, pid: int, *, limits: bool = False) -> dict[str, float]:
        """Its figures (none: no /proc, or the process is gone); ``limits``: with its fd limit."""
        if self.btime is None:
            return {}
        out: dict[str, float] = {}
        base = os.path.join(self.proc, str(pid))
        try:
            with open(os.path.join(base, "stat"), "rb") as fh:
                parts = fh.read().split(b")")[-1].split()
            out["process_virtual_memory_bytes"] = float(parts[20])
            out["process_resident_memory_bytes"] = float(parts[21]) * self.pagesize
            out["process_start_time_seconds"] = float(parts[19]) / self.ticks + self.btime
            out[TICKS] = float(int(parts[11]) + int(parts[12]))
            out[CPU] = out[TICKS] / self.ticks
        except OSError:
            return {}
        try:
            if limits:
                with open(os.path.join(base, "limits"), "rb") as fh:
                    for line in fh:
                        if line.startswith(b"Max open file"):
                            out["process_max_fds"] = float(line.split()[3])
                            break
            out["process_open_fds"] = float(open_fds(pid, self.proc))
        except OSError:
            pass
        return out


class ProcessTreeCollector(Collector):
    """``process_*`` for this process and ``children()`` together (``children`` None: this
    process alone, as prometheus_client's ProcessCollector reports it)."""

    def __init__(
        self, children: Callable[[], Iterable[int]] | None = None, *, proc: str = PROC
    ) -> None:
        self.children = children
        self.reader = ProcessReader(proc)
        self._cpu_seen: dict[int, float] = {}  # the last CPU ticks read per worker pid
        self._cpu_gone = 0.0  # of workers that have exited

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        own = self.reader.read(os.getpid(), limits=True)
        if not own:  # no /proc here: nothing to report, as ProcessCollector
            return
        totals = {name: own[name] for name in _SUMMED if name in own}
        alive: dict[int, float] = {}
        for pid in self.children() if self.children is not None else ():
            samples = self.reader.read(pid)
            if not samples:
                continue
            for name in totals:
                totals[name] += samples.get(name, 0.0)
            alive[pid] = samples[TICKS]
        for pid, seconds in self._cpu_seen.items():
            if pid not in alive:
                self._cpu_gone += seconds
        self._cpu_seen = alive
        alone = self.children is None
        yield CounterMetricFamily(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds"
            + ("." if alone else ", summed over the processes."),
            value=(own[TICKS] + self._cpu_gone + sum(alive.values())) / self.reader.ticks,
        )
        for name, doc in (_ALONE if alone else _SUMMED).items():
            if name in totals:
                yield GaugeMetricFamily(name, doc, value=totals[name])
        for name, doc in _OWNER.items():
            if name in own:
                yield GaugeMetricFamily(name, doc, value=own[name])
