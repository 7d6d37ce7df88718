"""PromQL pieces shared by the dashboard and the alert rules.

Only string building: one place spells each selector, so the dashboard and the alerts cannot
disagree about which series a figure comes from.

>>> selector("kv_sidecar_queue_depth", 'pod="p"')
'kv_sidecar_queue_depth{pod="p"}'
"""

from __future__ import annotations

from collections.abc import Sequence

#: The refusals that answer 429 with Retry-After: the client should come back (docs/metrics.md).
REFUSED_429_REASONS: tuple[str, ...] = (
    "kv_cache_full",
    "queue_full",
    "queue_timeout",
    "counting_busy",
)

#: ``reason`` matcher selecting the 429 refusals of ``kv_sidecar_requests_total``.
REFUSED_429_MATCHERS: tuple[str, ...] = (
    'decision="reject"',
    f'reason=~"{"|".join(REFUSED_429_REASONS)}"',
)

#: Share of the CPU the sidecar can use above which it is saturated (KVSidecarCPUSaturated, and
#: the dashboard's line): past it, CPU throttling and a busy event loop delay every request.
CPU_SATURATION_SHARE = 0.8
#: The most CPU the sidecar's event loop can use: one thread, so one core whatever the limit.
EVENT_LOOP_CORES = 1


def selector(metric: str, *matchers: str) -> str:
    """``metric{m1, m2}``, or the bare name when there is no matcher.

    >>> selector("up")
    'up'
    """
    if not matchers:
        return metric
    return f"{metric}{{{', '.join(matchers)}}}"


def rate(series: str, window: str) -> str:
    """``rate(series[window])``."""
    return f"rate({series}[{window}])"


def histogram_quantile(
    quantile: float, bucket_series: str, window: str, by: Sequence[str] = ()
) -> str:
    """The ``quantile`` of a classic histogram, summed over everything but ``by`` and ``le``.

    >>> histogram_quantile(0.99, "x_bucket", "5m")
    'histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m])))'
    """
    labels = ", ".join([*by, "le"])
    return f"histogram_quantile({quantile}, sum by ({labels}) ({rate(bucket_series, window)}))"


def cpu_share(process_cpu: str, limit_cores: str, window: str) -> str:
    r"""The sidecar's CPU use over what it can use: its CPU limit, at most one core.

    The sidecar's work runs on one asyncio event loop (one thread; only long prompts are
    tokenized on worker threads), which saturates at one core however high the limit, and the
    process is throttled at its limit. Both series come from the sidecar's own scrape target, so
    the division's one-to-one match on every label drops the other containers' process series.

    >>> cpu_share("process_cpu_seconds_total", "kv_sidecar_cpu_limit_cores", "5m")
    'rate(process_cpu_seconds_total[5m])\n/\nclamp_max(kv_sidecar_cpu_limit_cores, 1)'
    """
    return f"{rate(process_cpu, window)}\n/\nclamp_max({limit_cores}, {EVENT_LOOP_CORES})"
