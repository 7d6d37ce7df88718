"""The ``process_*`` figures of the sidecar's processes (``sidecar.observability.process_tree``):
the same as prometheus_client's process collector reports for each process, summed over the
owner and its relay workers, the open file descriptors counted without listing ``/proc/PID/fd``
where the kernel reports its size (a scrape runs on the loop that decides admission)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, ProcessCollector

from sidecar.observability import process_tree
from sidecar.observability.process_tree import ProcessTreeCollector, open_fds

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

#: descriptors each child holds open besides its standard ones (pipes: two each)
CHILD_PIPES = 300
KERNEL_COUNTS = os.stat("/proc/self/fd").st_size > 0  # Linux 6.2 and later


def _child() -> subprocess.Popen[str]:
    code = (
        "import os, sys, time\n"
        f"pipes = [os.pipe() for _ in range({CHILD_PIPES})]\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs = [_child(), _child()]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def _values(collector: object) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    return {s.name: s.value for family in registry.collect() for s in family.samples}


def test_a_processs_figures_are_prometheus_clients(children: list[subprocess.Popen[str]]) -> None:
    pid = children[0].pid
    ours = process_tree.ProcessReader().read(pid, limits=True)
    ticks = ours.pop(process_tree.TICKS)  # ours alone: the CPU in whole clock ticks
    assert ticks == int(ticks) and ours[process_tree.CPU] == ticks / os.sysconf("SC_CLK_TCK")
    theirs = _values(ProcessCollector(pid=lambda: pid, registry=None))
    assert set(ours) == set(theirs)
    assert ours["process_open_fds"] == theirs["process_open_fds"] >= 2 * CHILD_PIPES
    for name in ("process_max_fds", "process_start_time_seconds", "process_virtual_memory_bytes"):
        assert ours[name] == theirs[name], name
    # the child sleeps on its stdin: its CPU and memory stay put between the two reads
    assert ours["process_cpu_seconds_total"] == pytest.approx(
        theirs["process_cpu_seconds_total"], abs=0.02
    )
    assert ours["process_resident_memory_bytes"] == pytest.approx(
        theirs["process_resident_memory_bytes"], rel=0.05
    )


@pytest.mark.skipif(not KERNEL_COUNTS, reason="the kernel reports no size for /proc/PID/fd")
def test_a_scrape_lists_no_descriptor_directory_where_the_kernel_counts(
    children: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing /proc/PID/fd costs some 3 ms at 4,000 descriptors (a worker's at 2,000 requests
    in flight), per worker and scrape, on the owner's loop: the kernel's count instead."""
    collector = ProcessTreeCollector(lambda: [p.pid for p in children])

    def listed(path: str) -> list[str]:
        raise AssertionError(f"listed {path}")

    monkeypatch.setattr(os, "listdir", listed)
    values = _values(collector)
    assert values["process_open_fds"] >= 2 * 2 * CHILD_PIPES


def test_an_old_kernel_gets_the_listing(
    children: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before Linux 6.2, /proc/PID/fd's size is 0: the entries are counted."""
    pid = children[0].pid
    expected = len(os.listdir(f"/proc/{pid}/fd"))
    real_stat = os.stat

    def sizeless(path: str) -> os.stat_result:
        st = real_stat(path)
        return os.stat_result((*st[:6], 0, *st[7:]))

    monkeypatch.setattr(os, "stat", sizeless)
    assert open_fds(pid) == expected


def test_the_figures_are_summed_over_the_owner_and_its_workers(
    children: list[subprocess.Popen[str]],
) -> None:
    pids = [p.pid for p in children]
    reader = process_tree.ProcessReader()
    tree = _values(ProcessTreeCollector(lambda: pids))
    each = [reader.read(pid) for pid in pids]
    own = reader.read(os.getpid(), limits=True)
    assert tree["process_open_fds"] == pytest.approx(
        own["process_open_fds"] + sum(e["process_open_fds"] for e in each), abs=3
    )
    assert tree["process_virtual_memory_bytes"] > own["process_virtual_memory_bytes"]
    # the start time and the fd limit are the owner's
    assert tree["process_start_time_seconds"] == own["process_start_time_seconds"]
    assert tree["process_max_fds"] == own["process_max_fds"]


def test_an_exited_workers_cpu_stays_in_the_sum(children: list[subprocess.Popen[str]]) -> None:
    alive = [p.pid for p in children]
    collector = ProcessTreeCollector(lambda: alive)
    before = _values(collector)["process_cpu_seconds_total"]
    children[1].kill()
    children[1].wait()
    alive.pop()
    assert _values(collector)["process_cpu_seconds_total"] >= before


def test_alone_it_reports_this_process_under_prometheus_clients_help() -> None:
    registry = CollectorRegistry()
    registry.register(ProcessTreeCollector())
    helps = {family.name: family.documentation for family in registry.collect()}
    theirs = {f.name: f.documentation for f in ProcessCollector(registry=None).collect()}
    assert helps == theirs
    assert registry.get_sample_value("process_open_fds") == pytest.approx(
        open_fds(os.getpid()), abs=2
    )
