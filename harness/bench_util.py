"""Small helpers the benchmarks share: machine facts, process CPU and memory, figures, reports.

Nothing here measures anything by itself; ``bench/`` does. Process figures come from ``/proc``
(Linux only), so no extra dependency is needed. Percentiles and medians are
:mod:`harness.stats`'s, the one definition the tests and the demo use too.

    cpu = ProcStat(pid)           # CPU seconds and RSS of one process, read from /proc
    before = cpu.cpu_seconds()
    ...
    print(cpu.cpu_seconds() - before, cpu.rss_bytes() / 2**20)
    update_section(ROOT / "BENCHMARKS.md", "overhead", markdown)  # rewrite one marked section
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


# --- progress -----------------------------------------------------------------------------------

_T0 = time.monotonic()


def progress(msg: str) -> None:
    """One progress line on stderr, stamped with the seconds since the process started."""
    print(f"[bench {time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# --- the machine --------------------------------------------------------------------------------


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def cpu_model() -> str:
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git_revision() -> str:
    """The commit measured, with ``+dirty`` when the work tree has changes
    (``KV_SIDECAR_BENCH_COMMIT`` names it when the benchmark runs outside a git checkout)."""
    if os.environ.get("KV_SIDECAR_BENCH_COMMIT"):
        return os.environ["KV_SIDECAR_BENCH_COMMIT"]
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """Facts to record with every run: CPU, cores, memory, load, versions, commit, time."""
    mem_kib = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in load_average()],
        "commit": git_revision(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_line(info: dict[str, Any], load_after: Sequence[float] | None = None) -> str:
    after = f", after {' '.join(f'{x:.2f}' for x in load_after)}" if load_after else ""
    return (
        f"{info['date']}, commit `{info['commit']}`; {info['cpu']}, {info['cores']} cores, "
        f"{info['memory_gib']} GiB, Linux {info['kernel']}, Python {info['python']}; "
        f"load average before {' '.join(f'{x:.2f}' for x in info['load_average'])}{after} "
        "(the machine is shared: other processes ran too)"
    )


# --- processes ----------------------------------------------------------------------------------


class ProcStat:
    """CPU time and memory of one process (and optionally its children), read from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the process has used so far."""
        with open(f"/proc/{self.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        # fields[0] is the state (field 3); utime and stime are fields 14 and 15
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK

    def _status(self, key: str) -> int:
        with open(f"/proc/{self.pid}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def rss_bytes(self) -> int:
        return self._status("VmRSS")

    def peak_rss_bytes(self) -> int:
        """The high-water mark of the resident set (VmHWM) since the process started."""
        return self._status("VmHWM")


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (a vLLM server
    started in its own session: the API server, its engine core and its workers)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[2] is the process group (field 5)
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def children_pids(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (nginx's workers, a sidecar's relay workers).

    Read from every ``/proc/N/stat``, not from ``/proc/PID/task/PID/children``, which lists only
    the children that the main thread forked.
    """
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                # fields after the command's closing parenthesis: state, then the parent's pid
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return sorted(found)


# --- figures ------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    """A figure for a table: ``-`` for missing, thousands separators, fixed digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:,.{digits}f}{unit}"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# --- results and the report ---------------------------------------------------------------------


def write_json(name: str, data: Any) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def update_section(path: Path, name: str, body: str) -> None:
    """Replace what lies between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in ``path``.

    The prose around the markers is kept; a missing section is appended at the end.
    """
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)
