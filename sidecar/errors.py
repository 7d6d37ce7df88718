"""The one place where refusals become HTTP: status, retry headers and OpenAI-shaped bodies.

Body shape: ``{"error": {"message", "type", "param", "code"}}`` as OpenAI and vLLM send it.
"""

from __future__ import annotations

import json
import math

from sidecar.admission import Decision
from sidecar.request import BadRequest

Headers = list[tuple[bytes, bytes]]

#: reason label -> (HTTP status, OpenAI error type, error code)
REFUSALS: dict[str, tuple[int, str, str]] = {
    "kv_cache_full": (429, "rate_limit_error", "kv_cache_full"),
    "queue_full": (429, "rate_limit_error", "queue_full"),
    "queue_timeout": (429, "rate_limit_error", "queue_timeout"),
    "too_large": (413, "invalid_request_error", "kv_budget_exceeded"),
    "draining": (503, "service_unavailable_error", "draining"),
    "stale_closed": (503, "service_unavailable_error", "engine_metrics_stale"),
    "upstream_unavailable": (503, "service_unavailable_error", "upstream_unavailable"),
    "not_ready": (503, "service_unavailable_error", "engine_not_ready"),
    "upstream_timeout": (504, "timeout_error", "upstream_timeout"),
}


def error_body(
    message: str, *, type_: str, code: str | int | None, param: str | None = None
) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def retry_headers(seconds: float) -> Headers:
    """``Retry-After`` in whole seconds (at least 1) and ``retry-after-ms``, as OpenAI sends."""
    seconds = max(seconds, 0.001)
    return [
        (b"retry-after", str(max(1, math.ceil(seconds))).encode()),
        (b"retry-after-ms", str(max(1, round(seconds * 1000))).encode()),
    ]


def refusal(reason: str, message: str, retry_after: float | None) -> tuple[int, Headers, bytes]:
    status, type_, code = REFUSALS[reason]
    headers: Headers = [(b"content-type", b"application/json")]
    if retry_after is not None and status in (429, 503):
        headers += retry_headers(retry_after)
    return status, headers, error_body(message, type_=type_, code=code)


def from_decision(decision: Decision) -> tuple[int, Headers, bytes]:
    return refusal(decision.reason, decision.message, decision.retry_after)


def from_bad_request(exc: BadRequest) -> tuple[int, Headers, bytes]:
    type_ = "invalid_request_error" if exc.status < 500 else "server_error"
    body = error_body(exc.message, type_=type_, code=exc.code, param=exc.param)
    return exc.status, [(b"content-type", b"application/json")], body


def plain(status: int, message: str, *, code: str) -> tuple[int, Headers, bytes]:
    """A refusal of the sidecar's own that is not an admission decision (bad target, ...)."""
    body = error_body(message, type_="invalid_request_error", code=code)
    return status, [(b"content-type", b"application/json")], body
