"""The owner's loop-lag histogram read from the sidecar's exposition, the difference of two
readings, and what a difference says: probes, the share within 5 ms, interpolated quantiles.

>>> text = '''kv_sidecar_event_loop_lag_seconds_bucket{le="0.0005"} 10.0
... kv_sidecar_event_loop_lag_seconds_bucket{le="0.001"} 80.0
... kv_sidecar_event_loop_lag_seconds_bucket{le="0.005"} 99.0
... kv_sidecar_event_loop_lag_seconds_bucket{le="+Inf"} 100.0
... kv_sidecar_event_loop_lag_seconds_count 100.0
... kv_sidecar_event_loop_lag_seconds_sum 0.2
... '''
>>> h = read_histogram(text)
>>> zero = {"buckets": [[le, 0.0] for le, _ in h["buckets"]], "count": 0.0, "sum": 0.0}
>>> s = summarize(delta(h, zero))
>>> s["probes"], s["share_within_5ms"], s["p99_under_5ms"]
(100, 0.99, True)
>>> round(s["p50_s"] * 1e3, 3)  # the 50th probe: 40 of the 70 in (0.5, 1] ms
0.786
>>> s["max_bucket"]
'> 5 ms'
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

LAG = "kv_sidecar_event_loop_lag_seconds"
#: the target: the probes' p99 under this many seconds
TARGET_S = 0.005


def read_histogram(text: str, name: str = LAG) -> dict[str, Any]:
    """``{"buckets": [[le, cumulative], ...] (ascending, +Inf last), "count", "sum"}``."""
    buckets: list[list[float]] = []
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                buckets.append([float(sample.labels["le"]), sample.value])
            elif sample.name == f"{name}_count":
                count = sample.value
            elif sample.name == f"{name}_sum":
                total = sample.value
    if not buckets:
        raise LookupError(f"{name} is not in the sidecar's /metrics")
    buckets.sort()
    return {"buckets": buckets, "count": count, "sum": total}


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The observations made between two readings of one histogram."""
    if [le for le, _ in after["buckets"]] != [le for le, _ in before["buckets"]]:
        raise ValueError("the two readings have different buckets")
    return {
        "buckets": [
            [le, a - b] for (le, a), (_, b) in zip(after["buckets"], before["buckets"], strict=True)
        ],
        "count": after["count"] - before["count"],
        "sum": after["sum"] - before["sum"],
    }


def quantile(h: dict[str, Any], q: float) -> float:
    """``histogram_quantile`` as Prometheus computes it: linear within the bucket the rank falls
    in (from 0 for the first); the largest finite bound when it falls in ``+Inf``."""
    count = h["count"]
    if count <= 0:
        return math.nan
    rank = q * count
    lower, below = 0.0, 0.0
    finite = [b for b in h["buckets"] if math.isfinite(b[0])]
    for le, cumulative in h["buckets"]:
        if cumulative >= rank:
            if not math.isfinite(le):
                return float(finite[-1][0])
            inside = cumulative - below
            return float(lower + (le - lower) * ((rank - below) / inside if inside else 1.0))
        lower, below = le, cumulative
    return float(finite[-1][0])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:g} ms"


def summarize(h: dict[str, Any]) -> dict[str, Any]:
    """What the probes of ``h`` (a difference of two readings) say about the target."""
    count = round(h["count"])
    within = next((c for le, c in h["buckets"] if le == TARGET_S), math.nan)
    share = within / count if count else math.nan
    top, lower = "none", 0.0
    per_bucket: list[dict[str, Any]] = []
    below = 0.0
    for le, cumulative in h["buckets"]:
        n = cumulative - below
        if n > 0:
            top = f"> {_ms(lower)}" if not math.isfinite(le) else f"{_ms(lower)} to {_ms(le)}"
        per_bucket.append({"le": le if math.isfinite(le) else "+Inf", "probes": round(n)})
        lower, below = le, cumulative
    return {
        "probes": count,
        "within_5ms": round(within) if math.isfinite(within) else None,
        "share_within_5ms": share,
        "p99_under_5ms": bool(count) and share >= 0.99,
        "p50_s": quantile(h, 0.5),
        "p99_s": quantile(h, 0.99),
        "mean_s": h["sum"] / count if count else math.nan,
        "max_bucket": top,
        "per_bucket": per_bucket,
    }
