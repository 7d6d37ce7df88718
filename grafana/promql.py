"""PromQL pieces shared by the dashboard and the alert rules.

Only string building: one place spells each selector, so the dashboard and the alerts cannot
disagree about which series a figure comes from.

>>> selector("kv_sidecar_queue_depth", 'pod="p"')
'kv_sidecar_queue_depth{pod="p"}'
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.admission.decisions import REFUSALS

#: The refusals that answer 429 with Retry-After: the client should come back (docs/metrics.md).
#: From the decisions table, so that a new 429 reason reaches the dashboard and the alerts (the
#: one the sidecar answers in place of vLLM's own queue-cap 503, ``engine_queue_full``, too).
REFUSED_429_REASONS: tuple[str, ...] = tuple(
    reason.value for reason, refusal in REFUSALS.items() if refusal.status == 429
)

#: ``reason`` matcher selecting the 429 refusals of ``kv_sidecar_requests_total``.
REFUSED_429_MATCHERS: tuple[str, ...] = (
    'decision="reject"',
    f'reason=~"{"|".join(REFUSED_429_REASONS)}"',
)

#: Share of the CPU the sidecar can use above which it is saturated (KVSidecarCPUSaturated, and
#: the dashboard's line): past it, CPU throttling and a busy event loop delay every request.
CPU_SATURATION_SHARE = 0.8
#: The most CPU one event loop can use: one thread, so one core whatever the limit. The sidecar
#: has one (its main process) plus one per relay worker (``--workers`` above 1).
EVENT_LOOP_CORES = 1
#: Relay workers connected to the main process (a gauge, only with ``--workers`` above 1).
RELAY_WORKERS = "kv_sidecar_relay_workers"


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


def cpu_share(
    process_cpu: str, limit_cores: str, window: str, relay_workers: str = RELAY_WORKERS
) -> str:
    r"""The sidecar's CPU use over what it can use: its CPU limit, at most one core per event loop.

    Each sidecar process does its work on one asyncio event loop (one thread; only long prompts
    are tokenized on worker threads), which saturates at one core however high the limit: the
    main process, plus each relay worker with ``--workers`` above 1. ``process_cpu`` is summed
    over all of them, ``relay_workers`` counts the connected workers (the series exists only
    with ``--workers`` above 1: missing, it counts as 0, taking the labels of ``limit_cores``),
    and the processes are throttled together at the limit. The smaller of the two ceilings is
    the limit where it is at most ``1 + workers`` (the comparison keeps it) or else ``1 +
    workers``. Every series comes from the sidecar's own scrape target with the same labels, and
    each binary operation matches on every label but the metric name: it pairs a target's own
    series, and the division drops the process series of other containers (whose targets have
    no limit gauge).

    >>> print(cpu_share("cpu", "limit", "5m", relay_workers="workers"))
    rate(cpu[5m])
    /
    (
      (limit <= 1 + (workers or limit * 0))
      or
      1 + (workers or limit * 0)
    )
    """
    cores = f"{EVENT_LOOP_CORES} + ({relay_workers} or {limit_cores} * 0)"
    return f"{rate(process_cpu, window)}\n/\n(\n  ({limit_cores} <= {cores})\n  or\n  {cores}\n)"
