"""The CPU the sidecar process may use (pure: no HTTP, no metrics library).

That is its cgroup's CPU quota (Kubernetes' CPU limit), the tightest one on its cgroup and the
cgroups above it, capped by the CPUs its affinity mask allows; without a quota, those CPUs.
``sidecar.observability.cpu`` exports it as ``kv_sidecar_cpu_limit_cores``; the relay workers'
``auto`` and the counting slots size themselves by it. Read from the files the kernel
exposes: cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``. A file
that is missing, unreadable or malformed means "no quota there", never an error.

>>> parse_cpu_max("150000 100000")
1.5
>>> parse_cpu_max("max 100000") is None
True
>>> parse_cfs_quota("-1", "100000") is None
True
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def parse_cpu_max(text: str) -> float | None:
    """Cores a cgroup v2 ``cpu.max`` (``"<quota> <period>"`` in microseconds) allows.

    None for ``max`` (no quota) and for anything that is not two positive numbers.

    >>> parse_cpu_max("50000") is None  # the period is not optional in the kernel's output
    True
    """
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def parse_cfs_quota(quota: str, period: str) -> float | None:
    """Cores cgroup v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` allow (-1: no quota)."""
    return _ratio(quota.strip(), period.strip())


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:  # absent on this cgroup version or level, or not readable here
        return None


def _own_cgroups(self_cgroup: Path) -> dict[str, str]:
    """``/proc/self/cgroup`` as {controller: path}; the unified (v2) hierarchy under ``""``."""
    text = _read(self_cgroup) or ""
    found: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            found[controller] = path
    return found


def _up_to(base: Path, relative: str) -> Iterator[Path]:
    """``base/relative`` and each directory above it, ``base`` last.

    >>> [str(p) for p in _up_to(Path("/cg"), "/kubepods/pod1")]
    ['/cg/kubepods/pod1', '/cg/kubepods', '/cg']
    """
    parts = [part for part in relative.split("/") if part and part not in (".", "..")]
    for depth in range(len(parts), -1, -1):
        yield base.joinpath(*parts[:depth])


def cgroup_quota_cores(
    root: Path = CGROUP_ROOT, self_cgroup: Path = PROC_SELF_CGROUP
) -> float | None:
    """The tightest CPU quota on this process's cgroup and those above it, in cores.

    None when no level has one. In a container with its own cgroup namespace the process sees
    its cgroup as ``/`` and ``root`` is that cgroup; without one, ``root`` holds the host's
    hierarchy and the path from ``/proc/self/cgroup`` leads to it.
    """
    own = _own_cgroups(self_cgroup)
    quotas: list[float] = []
    if "" in own:  # cgroup v2 (or the unified part of a hybrid setup, where it has no cpu.max)
        for directory in _up_to(root, own[""]):
            text = _read(directory / "cpu.max")
            quota = parse_cpu_max(text) if text is not None else None
            if quota is not None:
                quotas.append(quota)
    if "cpu" in own:  # cgroup v1: the cpu controller's own mount
        for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            base = root / mount
            if not base.is_dir():
                continue
            for directory in _up_to(base, own["cpu"]):
                quota_text = _read(directory / "cpu.cfs_quota_us")
                period_text = _read(directory / "cpu.cfs_period_us")
                if quota_text is None or period_text is None:
                    continue
                quota = parse_cfs_quota(quota_text, period_text)
                if quota is not None:
                    quotas.append(quota)
            break
    return min(quotas) if quotas else None


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def cpu_limit_cores(root: Path = CGROUP_ROOT, self_cgroup: Path = PROC_SELF_CGROUP) -> float:
    """The cgroup quota capped by the CPUs available; without a quota, the CPUs available."""
    cpus = float(available_cpus())
    quota = cgroup_quota_cores(root, self_cgroup)
    return cpus if quota is None else min(quota, cpus)
