"""Every benchmark and bench tool, registered once: its name, what it measures in one line, the
module whose ``main(argv)`` runs it, what it needs, and the arguments of its smoke run.

``python -m bench --list`` prints this table; ``python -m bench NAME [ARGS]`` runs one entry
with its own arguments, the same as ``python -m bench.NAME [ARGS]``.

>>> [b.name for b in BENCHMARKS if b.default]
['micro', 'overhead', 'admission']
>>> find("scaling").command
'python -m bench.scaling'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.bench_util import RESULTS


@dataclass(frozen=True)
class Benchmark:
    name: str
    summary: str  # one line: what it measures
    entry: str  # the module whose main(argv) runs it
    duration: str  # a full run on the 2-core machine the results come from
    needs: str = ""  # besides the project's venv
    default: bool = False  # in the default set (``python -m bench``, ``make bench``)
    quick: tuple[str, ...] | None = ("--quick",)  # its smoke run's arguments; None: no smoke run
    tool: bool = False  # a load generator or a proxy the benchmarks start, not a benchmark

    @property
    def command(self) -> str:
        return f"python -m bench.{self.name}"

    def main(self) -> Callable[[list[str] | None], Any]:
        """Its ``main(argv)``, imported now (a benchmark's imports are its own)."""
        run: Callable[[list[str] | None], Any] = importlib.import_module(self.entry).main
        return run


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "micro",
        "the hot path's CPU per call: an admission decision, /metrics rendering, a reconcile",
        "bench.micro",
        "seconds",
        default=True,
        quick=("--no-report",),
    ),
    Benchmark(
        "overhead",
        "what the sidecar adds per request on loopback, against direct, nginx and plain relays",
        "bench.overhead.cli",
        "about 9 minutes",
        needs="wrk and nginx (scripts/system-deps.sh --bench), the vLLM CPU venv's model",
        default=True,
    ),
    Benchmark(
        "admission",
        "admission on the real vLLM CPU build: preemptions, goodput, latency, prediction error",
        "bench.admission.cli",
        "45 to 70 minutes",
        needs="the vLLM CPU venv",
        default=True,
    ),
    Benchmark(
        "simgpu",
        "admission at production scale on the simulated GPU engine (8B on H100, 70B at TP 8)",
        "bench.simgpu.cli",
        "about 40 minutes",
        needs="the vLLM CPU venv (the simulated executor; no GPU)",
    ),
    Benchmark(
        "hybrid",
        "a hybrid (Mamba-style state + attention) model's burst on the real vLLM, against an "
        "older sidecar (--baseline)",
        "bench.hybrid",
        "about 10 minutes",
        needs="the vLLM CPU venv",
        quick=("--repeat", "1", "--suffix=-quick"),
    ),
    Benchmark(
        "counting",
        "long prompts: what a count costs, and whether a stream beside 128k-token counts stalls",
        "bench.counting",
        "about 5 minutes",
    ),
    Benchmark(
        "render",
        "vLLM's render endpoints against /tokenize as the counter's upstream: a count's wall time",
        "bench.render",
        "about 2 minutes",
        needs="the vLLM CPU venv",
    ),
    Benchmark(
        "scaling",
        "the sidecar's CPU per request against connections, prompt length and streams in flight",
        "bench.scaling.cli",
        "about 8 minutes",
        needs="wrk (scripts/system-deps.sh --bench)",
    ),
    Benchmark(
        "owner_loop",
        "the owner's event-loop lag with relay workers at 500 requests/s, 2,000 in flight",
        "bench.owner_loop.cli",
        "about 2 minutes",
    ),
    Benchmark(
        "memory",
        "the owner's and each relay worker's RSS and PSS with a 151,665-token vocabulary",
        "bench.memory",
        "about 4 minutes (a minute the first time, to generate the vocabulary)",
    ),
    Benchmark(
        "fleet",
        "two vLLM replicas behind nginx: what a sidecar per replica changes for a fleet",
        "bench.fleet.cli",
        "about 30 minutes",
        needs="nginx, the vLLM CPU venv",
    ),
    Benchmark(
        "serve",
        "vLLM's own client (vllm bench serve) straight to vLLM and through the sidecar "
        "(--engine sim: the simulated 8B on an H100)",
        "bench.serve",
        "about 20 minutes",
        needs="the vLLM CPU venv",
        quick=(
            *("--num-prompts", "8", "--output-len", "128", "--reps", "1"),
            *("--out", str(RESULTS / "serve-quick.json")),
        ),
    ),
    Benchmark(
        "sse_client",
        "a lean SSE load generator: events/s a URL relays over keep-alive connections",
        "bench.sse_client",
        "--duration seconds",
        needs="a URL that streams completions (the fast fake vLLM, a sidecar, a proxy)",
        quick=None,
        tool=True,
    ),
    Benchmark(
        "proxies",
        "the bench-only proxies: the early-end shim, a threshold shedder, the plain relay",
        "bench.proxies",
        "until stopped",
        needs="an upstream URL",
        quick=None,
        tool=True,
    ),
)


def find(name: str) -> Benchmark:
    """The entry named ``name`` (``-`` and ``_`` alike); ``KeyError`` when there is none."""
    for b in BENCHMARKS:
        if b.name == name.replace("-", "_"):
            return b
    raise KeyError(name)


def listing() -> str:
    """``python -m bench --list``: one line per benchmark and tool, and the default set."""
    width = max(len(b.name) for b in BENCHMARKS)
    lines = ["benchmarks (* in the default set: python -m bench, make bench):"]
    for b in BENCHMARKS:
        if not b.tool:
            mark = "*" if b.default else " "
            lines.append(f"  {mark} {b.name:<{width}}  {b.summary} ({b.duration})")
            if b.needs:
                lines.append(f"    {'':<{width}}  needs {b.needs}")
    lines.append("tools the benchmarks use, runnable alone:")
    for b in BENCHMARKS:
        if b.tool:
            lines += [f"    {b.name:<{width}}  {b.summary}", f"    {'':<{width}}  needs {b.needs}"]
    others = ", ".join(b.name for b in BENCHMARKS if not b.tool and not b.default)
    lines += [
        "",
        f"Not in the default set, for their length: {others}; run them by name, or every",
        "benchmark with --all. `python -m bench NAME --help` shows a benchmark's own arguments.",
    ]
    return "\n".join(lines)
