"""The fleet benchmark's figures: per run (what each replica served, what nginx retried, the
client's waits), and medians over the repetitions of a configuration."""

from __future__ import annotations

import contextlib
import math
from typing import Any

from bench.fleet.run import BLOCK_SIZE, WEIGHTS
from harness.bench_util import fmt
from harness.stats import median, percentile
from sidecar.admission.retry import MAX_RETRY_AFTER


def gateway_log(run: dict[str, Any]) -> list[dict[str, str]]:
    """The gateway's log lines, one per request: nginx's access log, or HAProxy's httplog read
    into the same fields (``bench.fleet.haproxy.parse_log``: ``upstream`` is the server that
    answered, the last tried; HAProxy logs no earlier server or status, only ``retries``)."""
    return list(run.get("haproxy_log") or run.get("nginx_log") or [])


def served_by(run: dict[str, Any]) -> dict[int, str]:
    """Request id -> the replica whose answer was 200 (the last upstream the gateway tried)."""
    out: dict[int, str] = {}
    for line in gateway_log(run):
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
    lines = [x for x in gateway_log(run) if x.get("id", "").isdigit()]  # not the readiness GET
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
        # HAProxy logs only the last server: a retry shows as its retry count (%rc)
        retried = int(line.get("retries", "0").lstrip("+") or 0) > 0
        if len(addrs) > 1 or retried:
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


def retry_after_seconds(refusal: dict[str, Any]) -> float | None:
    """The Retry-After a refusal carried, in seconds (``retry-after-ms`` first, as the client
    reads it); None when it carried none."""
    for key, scale in (("retry_after_ms", 1e-3), ("retry_after", 1.0)):
        value = refusal.get(key)
        if value is not None:
            with contextlib.suppress(ValueError):
                return float(value) * scale
    return None


def request_peak_blocks(run: dict[str, Any]) -> int:
    """A burst request's KV peak in blocks: its prompt and max_tokens (every answer runs to it,
    ``ignore_eos``), rounded up to whole blocks."""
    size: list[int] = run.get("size", [24, 271, 700])
    return math.ceil((size[1] + size[2]) / run.get("block_size", BLOCK_SIZE))


def room(sample: dict[str, Any], replica: str, peak: int) -> bool | None:
    """Whether ``replica``'s sidecar had room for one more request at ``sample``: its budget less
    its committed blocks (what admission keeps under the budget) less the projected peaks of its
    queue holds ``peak`` blocks. None: no sidecar figures in the sample."""
    sc = (sample.get(replica) or {}).get("sidecar") or {}
    budget, committed, queued = (
        sc.get("budget_blocks"),
        sc.get("committed_blocks"),
        sc.get("peak_blocks_queued"),
    )
    if budget is None or committed is None or queued is None:
        return None
    return bool(budget - committed - queued >= peak)


#: the statuses of a refusal that carries the sidecar's Retry-After (as the gateway logs them)
_REFUSED = ("429", "503")


def retry_after_at_cap(run: dict[str, Any]) -> dict[str, Any]:
    """The refusals the client saw (429s, and 503s: ``--spill-status 503`` answers a spilled
    request with one) whose Retry-After was at the sidecar's cap (``MAX_RETRY_AFTER``), and of
    those, how many came while the other replica's sidecar had room (:func:`room`, in the sample
    nearest in time to the refusal) and while any replica's did. The replica that refused is the
    one the gateway's log names for that request's refusals, in order."""
    peak = request_peak_blocks(run)
    # samples with the clock and at least one sidecar's figures (none: direct, or an older run)
    samples = [
        s for s in run["samples"] if "m" in s and any(room(s, n, peak) is not None for n in WEIGHTS)
    ]
    log_429: dict[str, list[str]] = {}
    for line in gateway_log(run):
        if line.get("status") in _REFUSED:
            last = line.get("upstream", "").split(",")[-1].strip()
            log_429.setdefault(line.get("id", ""), []).append(run["port_to_replica"].get(last, "?"))
    at_cap = other_room = any_room = 0
    unknown = 0  # at the cap with no sidecar sample to judge room by
    gaps: list[float] = []
    for o in run["outcomes"]:
        refused = log_429.get(str(o["id"]), [])
        for k, r in enumerate(x for x in o.get("refusals", []) if str(x["status"]) in _REFUSED):
            seconds = retry_after_seconds(r)
            if seconds is None or seconds < MAX_RETRY_AFTER:
                continue
            at_cap += 1
            if not samples:
                unknown += 1
                continue
            nearest = min(samples, key=lambda s: abs(s["m"] - r["m"]))
            gaps.append(abs(nearest["m"] - r["m"]))
            by = refused[k] if k < len(refused) else "?"
            rooms = {n: room(nearest, n, peak) for n in WEIGHTS}
            if any(rooms[n] for n in WEIGHTS if n != by):
                other_room += 1
            if any(rooms.values()):
                any_room += 1
    return {
        "retry_after_cap_s": MAX_RETRY_AFTER,
        "retry_after_at_cap": at_cap,
        "retry_after_at_cap_other_room": other_room if samples else None,
        "retry_after_at_cap_any_room": any_room if samples else None,
        "retry_after_at_cap_unjudged": unknown,
        "retry_after_at_cap_sample_gap_max": max(gaps) if gaps else None,
    }


def agent_weights(run: dict[str, Any]) -> dict[str, Any] | None:
    """HAProxy's weights over the run (its ``show stat``, sampled every 0.5 s), per replica (the
    sum over its servers): first, min, max and last sample, and the samples in which a replica's
    weight was below its configured total. None without HAProxy."""
    rows = [s["haproxy"] for s in run["samples"] if s.get("haproxy")]
    if not rows:
        return None
    names = run["port_to_replica"]
    per: dict[str, list[int]] = {n: [] for n in WEIGHTS}
    for row in rows:
        for n in WEIGHTS:
            ws = [v["weight"] for k, v in row.items() if names.get(k) == n]
            if ws and all(w is not None for w in ws):
                per[n].append(sum(ws))
    out: dict[str, Any] = {"samples": len(rows)}
    for n, ws in per.items():
        if ws:
            full = run.get("haproxy_configured_weights", {}).get(n, 100 * WEIGHTS[n])
            out[n] = {
                "first": ws[0],
                "min": min(ws),
                "max": max(ws),
                "last": ws[-1],
                "samples_below_configured": sum(1 for w in ws if w < full),
            }
    return out


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
        # issue 21's bar: a request told to come back is admitted on its first or second return
        # (refused at most twice, then served)
        "served_by_second_return": sum(
            1 for o in ok if 1 <= o["client_429"] + o["client_503"] <= 2
        ),
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
        **retry_after_at_cap(run),
        "replicas": per,
        "agent_weights": agent_weights(run),
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
