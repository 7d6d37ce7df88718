"""PromQL pieces shared by the dashboard and the alert rules.

Only string building: one place spells each selector, so the dashboard and the alerts cannot
disagree about which series a figure comes from.

>>> selector("kv_sidecar_queue_depth", 'pod="p"')
'kv_sidecar_queue_depth{pod="p"}'
"""

from __future__ import annotations

from collections.abc import Sequence

#: The refusals that answer 429 with Retry-After: the client should come back (docs/metrics.md).
REFUSED_429_REASONS: tuple[str, ...] = ("kv_cache_full", "queue_full", "queue_timeout")

#: ``reason`` matcher selecting the 429 refusals of ``kv_sidecar_requests_total``.
REFUSED_429_MATCHERS: tuple[str, ...] = (
    'decision="reject"',
    f'reason=~"{"|".join(REFUSED_429_REASONS)}"',
)


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
