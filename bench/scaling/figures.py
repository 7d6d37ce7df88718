"""The scaling benchmark's figures: medians and ranges over rounds for each curve, and the
arithmetic that sizes the sidecar's CPU request from them (deploy/README.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from harness.stats import median

#: the CPU request shipped in deploy/components/kv-sidecar/sidecar-patch.yaml, in millicores
SHIPPED_REQUEST_M = 500
#: the worked example in the deploy arithmetic: streams decoding at a pace, plus requests/s
EXAMPLE_STREAMS = 256
EXAMPLE_TOKENS_PER_S = 20
EXAMPLE_RPS = 20


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of per-round values."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": median(vals), "min": min(vals), "max": max(vals)}


def _connections(results: dict[str, Any]) -> dict[str, Any]:
    """Curve 1: per path and connection count."""
    out: dict[str, Any] = {"connections": {}}
    direct_conn = results["connections"]["direct"]
    for name, per in results["connections"].items():
        out["connections"][name] = {}
        for c, runs in per.items():
            d_runs = direct_conn[c]
            out["connections"][name][c] = {
                "rps": spread([r["rps"] for r in runs]),
                "cpu_us_per_request": spread(
                    [r["cpu_s"] / r["requests"] * 1e6 for r in runs if r["requests"]]
                ),
                "cores": spread([r["cpu_s"] / (r["duration_us"] / 1e6) for r in runs]),
                "upstream_cpu_us_per_request": spread(
                    [r["upstream_cpu_s"] / r["requests"] * 1e6 for r in runs if r["requests"]]
                ),
                "rps_ratio_to_direct": spread(
                    [
                        r["rps"] / d["rps"]
                        for r, d in zip(
                            sorted(runs, key=lambda x: x["round"]),
                            sorted(d_runs, key=lambda x: x["round"]),
                            strict=True,
                        )
                    ]
                ),
                "p50_us": spread([r["p50_us"] for r in runs]),
                "p99_us": spread([r["p99_us"] for r in runs]),
                "errors": sum(r["status_errors"] + r["other_errors"] for r in runs),
                "requests": sum(r["requests"] for r in runs),
            }
    return dict(out["connections"])


def _prompts(results: dict[str, Any]) -> dict[str, Any]:
    """Curve 2: per path and (prompt length x connections) cell."""
    out: dict[str, Any] = {"prompts": {}}
    for name, per in results["prompts"].items():
        out["prompts"][name] = {}
        for cell, runs in per.items():
            fig: dict[str, Any] = {
                "rps": spread([r["rps"] for r in runs]),
                "cpu_ms_per_request": spread(
                    [r["cpu_s"] / r["requests"] * 1e3 for r in runs if r["requests"]]
                ),
                "cores": spread([r["cpu_s"] / r["seconds"] for r in runs]),
                "upstream_cpu_ms_per_request": spread(
                    [r["upstream_cpu_s"] / r["requests"] * 1e3 for r in runs if r["requests"]]
                ),
                "p50_ms": spread([r["p50_us"] / 1e3 for r in runs]),
                "errors": sum(r["errors"] for r in runs),
                "requests": sum(r["requests"] for r in runs),
                "last_error": next((r["last_error"] for r in runs if r["last_error"]), ""),
            }
            if name == "sidecar":
                per_count = [
                    r["sidecar_counters"]["prompt_tokens"] / r["sidecar_counters"]["prompt_counts"]
                    for r in runs
                    if r["sidecar_counters"]["prompt_counts"]
                ]
                fig["prompt_tokens_per_request"] = spread(per_count)
                fig["cpu_us_per_prompt_token"] = spread(
                    [
                        r["cpu_s"] / r["sidecar_counters"]["prompt_tokens"] * 1e6
                        for r in runs
                        if r["sidecar_counters"]["prompt_tokens"]
                    ]
                )
                fig["counted_local"] = sum(r["sidecar_counters"]["local_counts"] for r in runs)
                fig["counted"] = sum(r["sidecar_counters"]["prompt_counts"] for r in runs)
            out["prompts"][name][cell] = fig
    return dict(out["prompts"])


def _in_flight(results: dict[str, Any]) -> dict[str, Any]:
    """Curve 3: per number of streams held."""
    out: dict[str, Any] = {"in_flight": {}}
    for n, runs in results["in_flight"].items():
        small = []
        for r in runs:
            streams_cost = r["alone_cpu_per_s"] * r["load_window_s"]
            small.append((r["load_cpu_s"] - streams_cost) / r["requests"] * 1e6)
        c = [r["sidecar_counters"] for r in runs]
        out["in_flight"][n] = {
            "in_flight_seen_min": min(r["state_before"]["in_flight"] for r in runs),
            "in_flight_after_min": min(r["in_flight_after"] for r in runs),
            "reserved_blocks": spread([r["state_before"]["reserved_blocks"] for r in runs]),
            "alone_cpu_ms_per_s": spread([r["alone_cpu_per_s"] * 1e3 for r in runs]),
            "alone_upstream_cpu_ms_per_s": spread(
                [r["alone_upstream_cpu_per_s"] * 1e3 for r in runs]
            ),
            "holder_cpu_ms_per_s": spread([r["alone_holder_cpu_per_s"] * 1e3 for r in runs]),
            "events_per_s": spread([r["holder"].get("events_per_s", 0.0) for r in runs]),
            "load_cpu_ms_per_s": spread([r["load_cpu_per_s"] * 1e3 for r in runs]),
            "rps": spread([r["rps"] for r in runs]),
            "cpu_us_per_small_request": spread(small),
            "cpu_us_per_small_request_unsubtracted": spread(
                [r["load_cpu_s"] / r["requests"] * 1e6 for r in runs if r["requests"]]
            ),
            "decision_mean_us": spread(
                [x["decision_sum"] / x["decision_count"] * 1e6 for x in c if x["decision_count"]]
            ),
            "p50_us": spread([r["p50_us"] for r in runs]),
            "p99_us": spread([r["p99_us"] for r in runs]),
            "errors": sum(r["status_errors"] + r["other_errors"] for r in runs),
            "streams_refused": sum(r["holder"].get("refused", 0) for r in runs),
            "streams_ended_early": sum(r["holder"].get("ended", 0) for r in runs),
        }
    return dict(out["in_flight"])


def figures(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "connections": _connections(results),
        "prompts": _prompts(results),
        "in_flight": _in_flight(results),
    }
    out["deploy"] = deploy_arithmetic(results, out)
    return out


def deploy_arithmetic(results: dict[str, Any], fig: dict[str, Any]) -> dict[str, Any]:
    """The figures the CPU request is computed from, and the rates the shipped request covers."""
    inf = fig["in_flight"]
    idle = inf["0"]["alone_cpu_ms_per_s"]["median"] if "0" in inf else math.nan
    largest = max((int(n) for n in inf if n != "0"), default=0)
    per_stream = (
        (inf[str(largest)]["alone_cpu_ms_per_s"]["median"] - idle) / largest
        if largest
        else math.nan
    )
    conn = fig["connections"]["sidecar"]
    per_request = {c: v["cpu_us_per_request"]["median"] for c, v in conn.items()}
    peak_rps = max(v["rps"]["median"] for v in conn.values())
    budget = SHIPPED_REQUEST_M - idle  # millicores left for requests
    covers = {c: budget / (us / 1e3) for c, us in per_request.items()}  # req/s
    prompts = fig["prompts"]["sidecar"]
    covers_prompts = {
        cell: budget / v["cpu_ms_per_request"]["median"] for cell, v in prompts.items()
    }
    slopes = {
        n: (v["alone_cpu_ms_per_s"]["median"] - idle) / int(n) for n, v in inf.items() if n != "0"
    }
    events_per_stream = 1000 / results["settings"]["stream_interval_ms"]
    # the example: EXAMPLE_STREAMS decoding at EXAMPLE_TOKENS_PER_S each, plus
    # EXAMPLE_RPS requests of ~1k-token prompts at 4 connections
    cell = f"1000x{max(results['settings']['prompt_connections'])}"
    example: dict[str, Any] = {}
    if cell in prompts and largest:
        per_event_ms = per_stream / events_per_stream
        events = EXAMPLE_STREAMS * EXAMPLE_TOKENS_PER_S
        example = {
            "streams": EXAMPLE_STREAMS,
            "tokens_per_s_each": EXAMPLE_TOKENS_PER_S,
            "events_per_s": events,
            "rps": EXAMPLE_RPS,
            "prompt_cell": cell,
            "cpu_ms_per_request": prompts[cell]["cpu_ms_per_request"]["median"],
            "streams_millicores": events * per_event_ms,
            "requests_millicores": EXAMPLE_RPS * prompts[cell]["cpu_ms_per_request"]["median"],
        }
        example["total_millicores"] = (
            idle + example["streams_millicores"] + example["requests_millicores"]
        )
    streams_for = {}
    for n in (100, 200, 500):
        left = budget - n * per_stream
        streams_for[str(n)] = {c: left / (us / 1e3) for c, us in per_request.items()}
    return {
        "shipped_request_millicores": SHIPPED_REQUEST_M,
        "idle_millicores": idle,
        "per_stream_millicores": per_stream,
        "per_stream_from_n": largest,
        "streams_alone_at_n_millicores": inf[str(largest)]["alone_cpu_ms_per_s"]["median"]
        if largest
        else math.nan,
        "stream_events_per_s": events_per_stream,
        "per_stream_millicores_by_n": slopes,
        "per_event_us": per_stream / events_per_stream * 1e3,
        "example": example,
        "cpu_us_per_small_request": per_request,
        "peak_rps_one_process": peak_rps,
        "rps_at_1": conn[min(conn, key=int)]["rps"]["median"],
        "covers_small_rps": covers,
        "covers_prompt_rps": covers_prompts,
        "covers_small_rps_with_streams": streams_for,
    }
