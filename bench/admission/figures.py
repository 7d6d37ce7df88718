"""The admission benchmark's figures: per run (outcomes, KV use, the sidecar's prediction error
with its context), and medians over the repetitions of a configuration."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bench.admission.client import Outcome
from harness.bench_util import fmt
from harness.stats import median, percentile


def error_samples(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The sidecar's prediction error at each sample of a run, with the sample's context.

    ``error``: predicted minus actual blocks, both at the instant of the sidecar's last scrape
    of vLLM (its ledger moved to that scrape against vLLM's used blocks); only samples with a
    request in flight at that scrape. ``per_running``: ``|error|`` over the requests vLLM was
    running (its own gauge, read by the bench at the same sample; at least 1)."""
    out = []
    for s in run["samples"]:
        sc = s.get("sidecar")
        if not sc or sc.get("actual_blocks") is None:
            continue
        if not sc.get("in_flight_at_snapshot") or sc.get("predicted_at_snapshot_blocks") is None:
            continue
        error = sc["predicted_at_snapshot_blocks"] - sc["actual_blocks"]
        running = s.get("num_requests_running") or 0
        out.append(
            {
                "t": round(s["t"], 2),
                "error": error,
                "per_running": abs(error) / max(1.0, running),
                "predicted": sc["predicted_at_snapshot_blocks"],
                "actual": sc["actual_blocks"],
                "vllm_running": running,
                "vllm_waiting": s.get("num_requests_waiting"),
                "sidecar_in_flight": sc.get("in_flight"),
                "sidecar_in_flight_at_snapshot": sc.get("in_flight_at_snapshot"),
                "sidecar_queue_depth": sc.get("queue_depth"),
                "snapshot_age_s": sc.get("snapshot_age"),
                "shared_blocks": sc.get("shared_blocks"),
                "client": s.get("client"),
            }
        )
    return out


UNDER_PREDICTION_BLOCKS = -2  # samples at or below this error are logged with their context
UNDER_SAMPLES_KEPT = 200  # per configuration and workload, in admission.json (all: the raw file)


def error_stats(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Signed error over every sample given (all repetitions pooled)."""
    errors = [e["error"] for e in samples]
    if not errors:
        return {"samples": 0}
    under = [e for e in samples if e["error"] <= UNDER_PREDICTION_BLOCKS]
    return {
        "samples": len(errors),
        "mean": sum(errors) / len(errors),
        "mean_abs": sum(abs(e) for e in errors) / len(errors),
        "p5": percentile(errors, 0.05),
        "p95": percentile(errors, 0.95),
        "min": min(errors),
        "max": max(errors),
        "mean_abs_per_running": sum(e["per_running"] for e in samples) / len(samples),
        "under_predictions": len(under),
        "by_context": error_by_context(samples),
    }


#: the client-side context an error may come from: (name, test on a sample's ``client``)
CONTEXTS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "non-streamed request in flight": lambda c: c.get("not_streamed", 0) > 0,
    "n 2 request in flight": lambda c: c.get("multi_sequence", 0) > 0,
    "streamed request awaiting its first token": lambda c: (
        c.get("streamed_awaiting_first_token", 0) > 0
    ),
    "first token in the last second": lambda c: c.get("first_token_last_1s", 0) > 0,
    "answer finished in the last second": lambda c: c.get("finished_last_1s", 0) > 0,
}


def error_by_context(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean signed error (and samples) with and without each context: where errors come from."""
    out: dict[str, Any] = {}
    for name, test in CONTEXTS.items():
        yes = [e["error"] for e in samples if test(e.get("client") or {})]
        no = [e["error"] for e in samples if not test(e.get("client") or {})]
        out[name] = {
            "with": {"samples": len(yes), "mean": sum(yes) / len(yes) if yes else None},
            "without": {"samples": len(no), "mean": sum(no) / len(no) if no else None},
        }
    return out


def figures(run: dict[str, Any]) -> dict[str, Any]:
    outs = [Outcome(**o) for o in run["outcomes"]]
    ok = [o for o in outs if o.status == 200 and o.completion_tokens > 0]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    e2e = [o.e2e for o in ok if o.e2e is not None]
    busy = [s for s in run["samples"] if s.get("num_requests_running", 0) > 0]
    usage = [s["kv_cache_usage_perc"] for s in busy if "kv_cache_usage_perc" in s]
    errs = error_samples(run)
    err = [e["error"] for e in errs]
    over: list[float] = []
    for s in run["samples"]:
        sc = s.get("sidecar")
        if sc and sc.get("actual_blocks") is not None and sc.get("in_flight"):
            over.append(sc["reserved_blocks"] - sc["actual_blocks"])
    return {
        "preemptions": run["preemptions"],
        "requests": len(outs),
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "refusals": sum(o.refusals for o in outs),
        "retried_requests": sum(1 for o in outs if o.refusals),
        "goodput_tps": sum(o.completion_tokens for o in ok) / run["seconds"],
        "tokens_per_vllm_cpu_s": (
            sum(o.completion_tokens for o in ok) / run["vllm_cpu_seconds"]
            if run.get("vllm_cpu_seconds")
            else None
        ),
        "seconds": run["seconds"],
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "e2e_p50": percentile(e2e, 0.5),
        "e2e_p99": percentile(e2e, 0.99),
        "kv_util_mean": sum(usage) / len(usage) if usage else math.nan,
        "kv_util_max": max(usage) if usage else math.nan,
        "pred_err_mean_abs_blocks": sum(abs(e) for e in err) / len(err) if err else None,
        "pred_err_mean_blocks": sum(err) / len(err) if err else None,
        "pred_err_max_abs_blocks": max((abs(e) for e in err), default=None),
        "pred_err_mean_abs_per_running": (
            sum(e["per_running"] for e in errs) / len(errs) if errs else None
        ),
        "reserved_minus_used_mean_blocks": sum(over) / len(over) if over else None,
    }


def aggregate(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions of one configuration; every repetition's figures kept."""
    out: dict[str, Any] = {}
    for key in reps[0]:
        values = [r[key] for r in reps if r[key] is not None]
        out[key] = median(values) if values else None
    out["repetitions"] = len(reps)
    out["each"] = reps
    return out


def each(f: dict[str, Any], key: str, digits: int) -> str:
    """Every repetition's value, for a table cell: `` (3, 5, 4)``."""
    values = [r[key] for r in f.get("each", [])]
    if len(values) < 2:
        return ""
    return " (" + ", ".join(fmt(v, digits) for v in values) + ")"


def paired_ratio(f: dict[str, Any], d: dict[str, Any] | None, key: str) -> float | None:
    """Median of per-repetition ratios to direct (repetition i of both ran in the same round);
    the ratio of the medians when the two ran a different number of times (a configuration on
    its own server, or run fewer times, has no partner in each round)."""
    if d is None:
        return None
    if len(f.get("each", [f])) != len(d.get("each", [d])):
        return f[key] / d[key] if f[key] is not None and d[key] else None
    ratios = [
        a[key] / b[key]
        for a, b in zip(f.get("each", [f]), d.get("each", [d]), strict=False)
        if a[key] is not None and b[key]
    ]
    return median(ratios) if ratios else None


#: the priority workload's classes (its requests' ``kind``)
PRIORITY_KINDS = ("interactive", "batch")


def class_figures(run: dict[str, Any]) -> dict[str, Any]:
    """The priority workload's figures of one run, per class (``interactive_*``, ``batch_*``):
    requests, completed, refused answers (429/503), TTFT p50/p99 and E2E p50/p99 over the
    completed streams, and goodput: the class's completed output tokens over the seconds from
    its first arrival to its last answer (None for a class the run did not send)."""
    outs = [Outcome(**o) for o in run["outcomes"]]
    out: dict[str, Any] = {
        "preemptions": run["preemptions"],
        "seconds": run["seconds"],
        "refusals": sum(o.refusals for o in outs),
    }
    for kind in PRIORITY_KINDS:
        mine = [o for o in outs if o.kind == kind]
        ok = [o for o in mine if o.status == 200 and o.completion_tokens > 0]
        ttft = [o.ttft for o in ok if o.ttft is not None]
        e2e = [o.e2e for o in ok if o.e2e is not None]
        ends = [o.arrived + o.e2e for o in ok if o.e2e is not None]
        span = max(ends) - min(o.arrived for o in mine) if ends else None
        tokens = sum(o.completion_tokens for o in ok)
        sent = bool(mine)
        out.update(
            {
                f"{kind}_requests": len(mine) if sent else None,
                f"{kind}_completed": len(ok) if sent else None,
                f"{kind}_refusals": sum(o.refusals for o in mine) if sent else None,
                f"{kind}_tokens": tokens if sent else None,
                f"{kind}_goodput_tps": tokens / span if span else None,
                f"{kind}_ttft_p50": percentile(ttft, 0.5) if ttft else None,
                f"{kind}_ttft_p99": percentile(ttft, 0.99) if ttft else None,
                f"{kind}_e2e_p50": percentile(e2e, 0.5) if e2e else None,
                f"{kind}_e2e_p99": percentile(e2e, 0.99) if e2e else None,
            }
        )
    reasons = (run.get("sidecar_metrics") or {}).get("requests_by_reason") or {}
    out["sidecar_refused"] = (
        sum(v for k, v in reasons.items() if k.startswith("reject/")) if reasons else None
    )
    return out
