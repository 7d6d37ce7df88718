"""Whether the priority workload's slow interactive answers waited through a stall.

``python -m bench.admission.stalls [RAW ...]`` reads the raw files of ``bench.admission``'s
priority runs (default: every ``bench/results/admission-priority*-raw.json``) and prints, per
class configuration and repetition, the interactive answers with a TTFT over 1 s and how many
of them waited through a stall: a gap of more than 1.2 s between two of the benchmark's 0.5 s
samples (its sampler reads vLLM's ``/metrics`` first), or a sample in which the sidecar's view of
vLLM (``snapshot_age``) was more than 1.2 s old.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

from harness.bench_util import RESULTS

SLOW_S = 1.0
STALL_S = 1.2
CONFIGS = ("sidecar-classes", "sidecar-classes-worst-case")


def stalls(run: dict[str, Any]) -> list[tuple[float, float]]:
    """The run's stalls, as (start, end) seconds into the run."""
    samples = run["samples"]
    times = [s["t"] for s in samples]
    gaps = [(a, b) for a, b in itertools.pairwise(times) if b - a > STALL_S]
    stale = [
        (s["t"] - s["sidecar"]["snapshot_age"], s["t"])
        for s in samples
        if (s.get("sidecar") or {}).get("snapshot_age") and s["sidecar"]["snapshot_age"] > STALL_S
    ]
    return gaps + stale


def slow_answers(run: dict[str, Any]) -> tuple[int, int]:
    """Interactive answers with a TTFT over SLOW_S, and those of them that waited through a
    stall."""
    spans = stalls(run)
    slow = [
        o
        for o in run["outcomes"]
        if o["kind"] == "interactive" and o.get("ttft") and o["ttft"] > SLOW_S
    ]
    hit = sum(
        1 for o in slow if any(a < o["arrived"] + o["ttft"] and b > o["arrived"] for a, b in spans)
    )
    return len(slow), hit


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or sorted(RESULTS.glob("admission-priority*-raw.json"))
    for path in paths:
        runs = json.loads(path.read_text())["runs"]["priority"]
        for config in CONFIGS:
            for rep, run in enumerate(runs.get(config, [])):
                slow, hit = slow_answers(run)
                print(f"{path.name} {config} repetition {rep + 1}: {slow} slow, {hit} in a stall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
