"""The fleet benchmark's figures: per run (what each replica served, what nginx retried, the
client's waits), and medians over the repetitions of a configuration."""

from __future__ import annotations

import math
from typing import Any

from bench.fleet.run import WEIGHTS
from harness.bench_util import fmt
from harness.stats import median, percentile


def served_by(run: dict[str, Any]) -> dict[int, str]:
    """Request id -> the replica whose answer was 200 (the last upstream nginx tried)."""
    out: dict[int, str] = {}
    for line in run["nginx_log"]:
        if line.get("status") != "200" or not line.get("id", "").isdigit():
            continue
        last = line["upstream"].split(",")[-1].strip()
        out[int(line["id"])] = run["port_to_replica"].get(last, "?")
    return out


def nginx_retries(run: dict[str, Any]) -> dict[str, Any]:
    """What nginx did: refusals per replica seen by nginx, and the requests it sent on."""
    refusals = {n: 0 for n in WEIGHTS}
    first_tries = {n: 0 for n in WEIGHTS}
    sent_on = 0
    both_refused = 0
    lines = [x for x in run["nginx_log"] if x.get("id", "").isdigit()]  # not the readiness GET
    for line in lines:
        addrs = [a.strip() for a in line.get("upstream", "").split(",") if a.strip()]
        codes = [c.strip() for c in line.get("upstream_status", "").split(",")]
        if addrs:
            first_tries[run["port_to_replica"].get(addrs[0], "?")] = (
                first_tries.get(run["port_to_replica"].get(addrs[0], "?"), 0) + 1
            )
        for addr, code in zip(addrs, codes, strict=False):
            if code in ("429", "503"):
                name = run["port_to_replica"].get(addr, "?")
                refusals[name] = refusals.get(name, 0) + 1
        if len(addrs) > 1:
            sent_on += 1
            if line.get("status") in ("429", "503"):
                both_refused += 1
    return {
        "attempts": len(lines),
        "first_tries": first_tries,
        "refusals": refusals,
        "sent_on": sent_on,
        "both_refused": both_refused,
    }


def _mean(total: float | None, count: float | None) -> float | None:
    return total / count if total is not None and count else None


def figures(run: dict[str, Any]) -> dict[str, Any]:
    outs = run["outcomes"]
    ok = [o for o in outs if o["status"] == 200 and o["completion_tokens"] > 0]
    by = served_by(run)
    ttft = [o["ttft"] for o in ok if o["ttft"] is not None]
    e2e = [o["e2e"] for o in ok if o["e2e"] is not None]
    nx = nginx_retries(run)
    per: dict[str, Any] = {}
    for name in WEIGHTS:
        mine = [o for o in ok if by.get(o["id"]) == name]
        vc = run["vllm_counters"][name]
        sc = run["sidecars"].get(name) or {}
        per[name] = {
            "preemptions": run["preemptions"][name],
            "served": len(mine),
            "first_tries": nx["first_tries"].get(name, 0),
            "refusals_to_nginx": nx["refusals"].get(name, 0),
            "vllm_requests": vc["vllm:request_success_total"],
            "vllm_generation_tokens": vc["vllm:generation_tokens_total"],
            "goodput_tps": sum(o["completion_tokens"] for o in mine) / run["seconds"],
            "ttft_p50": percentile([o["ttft"] for o in mine if o["ttft"] is not None], 0.5),
            "ttft_p99": percentile([o["ttft"] for o in mine if o["ttft"] is not None], 0.99),
            "e2e_p50": percentile([o["e2e"] for o in mine if o["e2e"] is not None], 0.5),
            "e2e_p99": percentile([o["e2e"] for o in mine if o["e2e"] is not None], 0.99),
            "vllm_queue_mean": _mean(
                vc["vllm:request_queue_time_seconds_sum"],
                vc["vllm:request_queue_time_seconds_count"],
            ),
            "vllm_ttft_mean": _mean(
                vc["vllm:time_to_first_token_seconds_sum"],
                vc["vllm:time_to_first_token_seconds_count"],
            ),
            "sidecar_queue_mean": _mean(sc.get("queue_wait_sum"), sc.get("queue_wait_count")),
            "sidecar_queued": sc.get("queue_wait_count"),
        }
    waits = sorted(ttft)
    sleeps = [d for o in outs for d in o["retry_after"]]
    return {
        "requests": len(outs),
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "gave_up": sum(1 for o in outs if o["error"] == "gave up"),
        "preemptions": sum(run["preemptions"].values()),
        "client_429": sum(o["client_429"] for o in outs),
        "client_503": sum(o["client_503"] for o in outs),
        "requests_refused_to_client": sum(1 for o in outs if o["client_429"] or o["client_503"]),
        "max_attempts": max((o["attempts"] for o in outs), default=0),
        "nginx_refusals": sum(nx["refusals"].values()),
        "nginx_sent_on": nx["sent_on"],
        "nginx_both_refused": nx["both_refused"],
        "nginx_rescued": nx["sent_on"] - nx["both_refused"],
        "goodput_tps": sum(o["completion_tokens"] for o in ok) / run["seconds"],
        "seconds": run["seconds"],
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "e2e_p50": percentile(e2e, 0.5),
        "e2e_p99": percentile(e2e, 0.99),
        "wait_mean": sum(waits) / len(waits) if waits else math.nan,
        "wait_max": max(waits) if waits else math.nan,
        "retry_sleep_mean": sum(o["retry_sleep"] for o in outs) / len(outs) if outs else 0.0,
        "retry_after_p50": percentile(sleeps, 0.5),
        "retry_after_max": max(sleeps) if sleeps else math.nan,
        "first_answer_s": min(e2e) if e2e else math.nan,
        "replicas": per,
    }


def aggregate(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions (per replica too); every repetition's figures kept."""

    def med(rows: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in rows[0]:
            if isinstance(rows[0][key], dict):
                continue
            values = [r[key] for r in rows if r[key] is not None]
            out[key] = median(values) if values else None
        return out

    out = med(reps)
    out["replicas"] = {n: med([r["replicas"][n] for r in reps]) for n in WEIGHTS}
    out["repetitions"] = len(reps)
    out["each"] = reps
    return out


def each(values: list[float | None], digits: int) -> str:
    if len(values) < 2:
        return ""
    return " (" + ", ".join(fmt(v, digits) for v in values) + ")"


def paired_ratio(f: dict[str, Any], d: dict[str, Any], key: str) -> float | None:
    ratios = [
        a[key] / b[key]
        for a, b in zip(f["each"], d["each"], strict=False)
        if a[key] is not None and b[key]
    ]
    return median(ratios) if ratios else None
