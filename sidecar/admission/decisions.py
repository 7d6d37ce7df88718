"""Decisions and their reasons: closed enums, and the one table from reason to HTTP.

A decision is a value (:class:`Decision`), never an exception. ``Outcome`` and ``Reason`` are
the labels of ``kv_sidecar_requests_total{decision,reason}`` (low cardinality, every pair
exported from zero); :data:`REFUSALS` gives each refusing reason its HTTP status, OpenAI error
type and error code (:func:`refusal_of`: ``spilled`` as ``--spill-status`` sets it).
``sidecar.http.refusals`` turns a decision into a response from this table alone.

>>> REFUSALS[Reason.KV_CACHE_FULL]
Refusal(status=429, type='rate_limit_error', code='kv_cache_full')
>>> sorted({outcome.value for outcome, _ in DECISION_LABELS})
['admit', 'cancel', 'reject']
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple

from sidecar.admission.retry import MIN_RETRY_AFTER

if TYPE_CHECKING:
    from sidecar.kv.ledger import Reservation


class Outcome(StrEnum):
    ADMIT = "admit"
    REJECT = "reject"
    CANCEL = "cancel"


class Reason(StrEnum):
    """Why the gate decided as it did (the ``reason`` label)."""

    # admitted
    FITS = "fits"
    QUEUED = "queued"
    STALE_OPEN = "stale_open"
    OBSERVED = "observed"
    # refused by the gate
    KV_CACHE_FULL = "kv_cache_full"
    LATENCY_TARGET = "latency_target"  # a larger batch would miss --tpot-target
    TTFT_TARGET = "ttft_target"  # its first token expected later than --ttft-target
    SPILLED = "spilled"  # --policy spill: the expected wait here is over --spill-wait (or grew)
    QUEUE_FULL = "queue_full"
    TENANT_QUEUE_FULL = "tenant_queue_full"  # its tenant has --tenant-max-queue queued
    TENANT_SHARE = "tenant_share"  # policy reject: its tenant holds --tenant-max-share
    DISPLACED = "displaced"  # queued, then refused to make room for a higher priority
    QUEUE_TIMEOUT = "queue_timeout"
    TOO_LARGE = "too_large"
    DRAINING = "draining"
    STALE_CLOSED = "stale_closed"
    NOT_READY = "not_ready"
    # refused after the gate: vLLM's own queue cap answered 503 (sidecar.engine.queue_caps)
    ENGINE_QUEUE_FULL = "engine_queue_full"
    # refused before the gate
    COUNTING_BUSY = "counting_busy"
    PROMPT_TOO_LONG = "prompt_too_long"
    BAD_REQUEST = "bad_request"
    # cancelled
    CLIENT_DISCONNECT = "client_disconnect"


class Refusal(NamedTuple):
    """How a refusal reads on the wire."""

    status: int
    type: str
    code: str


#: reason -> (HTTP status, OpenAI error type, error code); bad requests carry their own code
REFUSALS: dict[Reason, Refusal] = {
    Reason.KV_CACHE_FULL: Refusal(429, "rate_limit_error", "kv_cache_full"),
    Reason.LATENCY_TARGET: Refusal(429, "rate_limit_error", "latency_target"),
    Reason.TTFT_TARGET: Refusal(429, "rate_limit_error", "ttft_target"),
    Reason.SPILLED: Refusal(429, "rate_limit_error", "spilled"),
    Reason.QUEUE_FULL: Refusal(429, "rate_limit_error", "queue_full"),
    Reason.TENANT_QUEUE_FULL: Refusal(429, "rate_limit_error", "tenant_queue_full"),
    Reason.TENANT_SHARE: Refusal(429, "rate_limit_error", "tenant_share"),
    Reason.DISPLACED: Refusal(429, "rate_limit_error", "displaced"),
    Reason.QUEUE_TIMEOUT: Refusal(429, "rate_limit_error", "queue_timeout"),
    Reason.TOO_LARGE: Refusal(413, "invalid_request_error", "kv_budget_exceeded"),
    Reason.DRAINING: Refusal(503, "service_unavailable_error", "draining"),
    Reason.STALE_CLOSED: Refusal(503, "service_unavailable_error", "engine_metrics_stale"),
    Reason.NOT_READY: Refusal(503, "service_unavailable_error", "engine_not_ready"),
    # 429, not 503: shedding prompt counting is load, not a broken pod (a 5xx would count
    # toward a load balancer's outlier ejection)
    Reason.COUNTING_BUSY: Refusal(429, "rate_limit_error", "counting_busy"),
    # the sidecar's backpressure in place of vLLM's queue-cap 503, for a request it had admitted
    Reason.ENGINE_QUEUE_FULL: Refusal(429, "rate_limit_error", "engine_queue_full"),
}


def refusal_of(reason: Reason, *, spill_status: int = 429) -> Refusal:
    """How ``reason`` reads on the wire: :data:`REFUSALS`, with a ``spilled`` refusal's status
    as ``--spill-status`` sets it (503: a gateway that cannot retry a 429, such as HAProxy 2.6,
    retries a 503; the code stays ``spilled``, the type that of the sidecar's other 503s).

    >>> refusal_of(Reason.SPILLED, spill_status=503)
    Refusal(status=503, type='service_unavailable_error', code='spilled')
    >>> refusal_of(Reason.QUEUE_FULL, spill_status=503).status
    429
    """
    refusal = REFUSALS[reason]
    if reason is Reason.SPILLED and spill_status == 503:
        return Refusal(503, "service_unavailable_error", refusal.code)
    return refusal


_ADMIT = (Reason.FITS, Reason.QUEUED, Reason.STALE_OPEN, Reason.OBSERVED)
_CANCEL = (Reason.CLIENT_DISCONNECT,)

#: every (decision, reason) pair the sidecar counts, exported from zero
DECISION_LABELS: tuple[tuple[Outcome, Reason], ...] = (
    *((Outcome.ADMIT, r) for r in _ADMIT),
    *((Outcome.REJECT, r) for r in Reason if r not in _ADMIT and r not in _CANCEL),
    *((Outcome.CANCEL, r) for r in _CANCEL),
)


@dataclass(frozen=True, slots=True)
class Decision:
    """The gate's answer for one request."""

    outcome: Outcome
    reason: Reason
    reservation: Reservation | None = None
    retry_after: float | None = None
    message: str = ""
    waited_seconds: float = 0.0

    @property
    def admitted(self) -> bool:
        return self.outcome is Outcome.ADMIT


def draining(waited: float = 0.0) -> Decision:
    """The refusal of a sidecar shutting down: another replica can take the request at once."""
    return Decision(
        Outcome.REJECT,
        Reason.DRAINING,
        retry_after=MIN_RETRY_AFTER,
        message="the sidecar is shutting down; retry on another replica",
        waited_seconds=waited,
    )
