"""The simulated-GPU benchmark's figures: per run, in simulated GPU seconds (a wall duration
divided by the run's time scale), and medians over the repetitions of a configuration
(``bench.admission.figures.aggregate``: every repetition kept beside the median)."""

from __future__ import annotations

import math
from typing import Any

from bench.admission.client import Outcome
from bench.admission.figures import aggregate, class_figures
from bench.admission.figures import figures as admission_figures
from harness.stats import percentile

__all__ = ["aggregate", "figures"]


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures; every time in simulated seconds."""
    scale = float(run.get("time_scale", 1.0))
    outs = [Outcome(**o) for o in run["outcomes"]]
    ok = [o for o in outs if o.status == 200 and o.completion_tokens > 0]
    ttft = [o.ttft / scale for o in ok if o.ttft is not None]
    e2e = [o.e2e / scale for o in ok if o.e2e is not None]
    # streamed answers: the time per output token after the first
    tpot = [
        (o.e2e - o.ttft) / scale / (o.completion_tokens - 1)
        for o in ok
        if o.ttft is not None and o.e2e is not None and o.completion_tokens > 1
    ]
    running = [s["num_requests_running"] for s in run["samples"] if "num_requests_running" in s]
    waiting = [s["num_requests_waiting"] for s in run["samples"] if "num_requests_waiting" in s]
    seconds = run["seconds"] / scale
    engine = run["engine"]
    lag = engine["cpu_lag_seconds"] / scale
    busy = engine["simulated_seconds"]
    base = admission_figures(run)
    return {
        "requests": len(outs),
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "refusals": sum(o.refusals for o in outs),
        "retried_requests": sum(1 for o in outs if o.refusals),
        "goodput_tps": sum(o.completion_tokens for o in ok) / seconds if seconds else None,
        "preemptions": run["preemptions"],
        "running_mean": sum(running) / len(running) if running else None,
        "running_max": max(running) if running else None,
        "waiting_max": max(waiting) if waiting else None,
        "ttft_p50": _p(ttft, 0.5),
        "ttft_p99": _p(ttft, 0.99),
        "tpot_p50": _p(tpot, 0.5),
        "tpot_p99": _p(tpot, 0.99),
        "e2e_p50": _p(e2e, 0.5),
        "e2e_p99": _p(e2e, 0.99),
        "seconds": seconds,
        "wall_seconds": run["seconds"],
        "gpu_busy_seconds": busy,
        "steps": engine["steps"],
        "cpu_lag_seconds": lag,
        # what preempted requests' recompute added to the steps (the cost model's seconds;
        # absent from runs before it was recorded)
        "recomputed_tokens": engine.get("recomputed_tokens"),
        "recompute_seconds": engine.get("recompute_seconds"),
        "recompute_share": (
            engine["recompute_seconds"] / busy if "recompute_seconds" in engine and busy else None
        ),
        # the share of the run's simulated span that this machine's CPU, not the cost model,
        # set (the engine core's part: the API server's own lag is not in it)
        "cpu_lag_share": lag / seconds if seconds else None,
        "kv_util_mean": _finite(base["kv_util_mean"]),
        "kv_util_max": _finite(base["kv_util_max"]),
        "pred_err_mean_abs_per_running": base["pred_err_mean_abs_per_running"],
        "reserved_minus_used_mean_blocks": base["reserved_minus_used_mean_blocks"],
        "load_before": (run.get("load_average_before") or [None])[0],
        **_classes(run, scale),
    }


def _classes(run: dict[str, Any], scale: float) -> dict[str, Any]:
    """The priority workload's per-class figures (``bench.admission.figures.class_figures``),
    in simulated seconds; nothing for the other workloads."""
    if run.get("workload") != "priority":
        return {}
    out: dict[str, Any] = {}
    for key, value in class_figures(run).items():
        if not key.startswith(("interactive_", "batch_")) or value is None:
            continue
        if key.endswith(("_ttft_p50", "_ttft_p99", "_e2e_p50", "_e2e_p99")):
            value = value / scale
        elif key.endswith("_goodput_tps"):
            value = value * scale
        out[key] = value
    return out


def _finite(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value
