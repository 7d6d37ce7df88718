"""The one place where refusals and errors become HTTP: status, retry headers, OpenAI bodies.

Body shape: ``{"error": {"message", "type", "param", "code"}}`` as OpenAI and vLLM send it. The
gate's refusals read their status and code from ``sidecar.admission.decisions.REFUSALS`` (a
``spilled`` one's status from ``--spill-status``, ``refusal_of``); errors
from the tree in ``sidecar.errors`` map here (:func:`from_error`). On Anthropic's endpoint
(``/v1/messages`` and below it) the same answer is given in Anthropic's shape
(:func:`anthropic_shaped`): same status and headers, ``{"type": "error", "error": {"type",
"message"}, "request_id"}``.

>>> status, headers, body = from_decision(
...     Decision(Outcome.REJECT, Reason.QUEUE_FULL, retry_after=2.5, message="full"))
>>> status, dict(headers)[b"retry-after"], json.loads(body)["error"]["code"]
(429, b'3', 'queue_full')
"""

from __future__ import annotations

import json
import math

from sidecar.admission.decisions import Decision, Outcome, Reason, refusal_of
from sidecar.engine.queue_caps import ENGINE_QUEUE_RETRY_AFTER
from sidecar.errors import BadRequest, SidecarError, UpstreamTimeout
from sidecar.http.types import Headers

Response = tuple[int, Headers, bytes]

_JSON: Headers = [(b"content-type", b"application/json")]
#: seconds a client should wait before retrying when vLLM cannot be reached
UPSTREAM_RETRY_AFTER = 1.0


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


def _response(
    status: int, type_: str, code: str, message: str, retry_after: float | None
) -> Response:
    headers = list(_JSON)
    if retry_after is not None and status in (429, 503):
        headers += retry_headers(retry_after)
    return status, headers, error_body(message, type_=type_, code=code)


def from_decision(decision: Decision, *, spill_status: int = 429) -> Response:
    """The response for a refusing decision (``spill_status``: a ``spilled`` refusal's status,
    ``--spill-status``).

    >>> status, headers, body = from_decision(
    ...     Decision(Outcome.REJECT, Reason.SPILLED, retry_after=4.2, message="long"),
    ...     spill_status=503)
    >>> status, dict(headers)[b"retry-after"], json.loads(body)["error"]["code"]
    (503, b'5', 'spilled')
    """
    assert decision.outcome is Outcome.REJECT, decision
    refusal = refusal_of(decision.reason, spill_status=spill_status)
    return _response(
        refusal.status, refusal.type, refusal.code, decision.message, decision.retry_after
    )


def refusal(reason: Reason, message: str, retry_after: float | None = None) -> Response:
    """The response for a refusal the gate did not decide (not ready, for example)."""
    return from_decision(Decision(Outcome.REJECT, reason, retry_after=retry_after, message=message))


#: vLLM's queue-cap reasons, as the flags an operator sets
_CAP_FLAGS = {
    "max_num_queued_reqs": "--max-num-queued-reqs",
    "max_num_queued_tokens": "--max-num-queued-tokens",
}


def engine_queue_full(vllm_reason: str) -> Response:
    """The sidecar's backpressure in place of vLLM's 503 when its own queue cap refused an
    admitted request: 429 ``engine_queue_full`` with Retry-After, as the gate's refusals read.

    >>> status, headers, body = engine_queue_full("max_num_queued_reqs")
    >>> status, dict(headers)[b"retry-after"], json.loads(body)["error"]["code"]
    (429, b'1', 'engine_queue_full')
    """
    flag = _CAP_FLAGS.get(vllm_reason, vllm_reason)
    message = f"vLLM's own queue cap ({flag}) is reached; retry later or on another replica"
    return refusal(Reason.ENGINE_QUEUE_FULL, message, ENGINE_QUEUE_RETRY_AFTER)


def from_error(exc: SidecarError) -> Response:
    """The response for an error of the sidecar's tree."""
    if isinstance(exc, BadRequest):
        type_ = "invalid_request_error" if exc.status < 500 else "server_error"
        body = error_body(exc.message, type_=type_, code=exc.code, param=exc.param)
        return exc.status, list(_JSON), body
    if isinstance(exc, UpstreamTimeout):
        return _response(504, "timeout_error", "upstream_timeout", str(exc), None)
    # unreachable, reset, or broken before an answer: the client may retry shortly
    return _response(
        503, "service_unavailable_error", "upstream_unavailable", str(exc), UPSTREAM_RETRY_AFTER
    )


def plain(status: int, message: str, *, code: str) -> Response:
    """A refusal of the proxy's own that is not an admission decision (bad target, ...)."""
    body = error_body(message, type_="invalid_request_error", code=code)
    return status, list(_JSON), body


#: Anthropic's error type by HTTP status (docs.claude.com/en/api/errors); any other 4xx is an
#: invalid_request_error, any other 5xx an api_error. 503 stays 503 (Anthropic's own overload is
#: a 529): the status is the sidecar's, whatever the shape.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    """``/v1/messages`` and the paths below it (``/v1/messages/count_tokens``): Anthropic's API.

    >>> is_anthropic_path("/v1/messages"), is_anthropic_path("/v1/chat/completions")
    (True, False)
    """
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_body(status: int, message: str, *, request_id: str | None = None) -> bytes:
    """An Anthropic error body: ``{"type": "error", "error": {"type", "message"}}`` (and
    ``request_id`` when known, as Anthropic's API answers)."""
    type_ = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    out: dict[str, object] = {"type": "error", "error": {"type": type_, "message": message}}
    if request_id is not None:
        out["request_id"] = request_id
    return json.dumps(out).encode()


def anthropic_shaped(response: Response, request_id: bytes | None = None) -> Response:
    """One of this module's OpenAI-shaped answers in Anthropic's shape: the same status and
    headers (Retry-After included); the error's code leads its message (``kv_cache_full: ...``),
    as Anthropic's body has no field for it.

    >>> status, _, body = anthropic_shaped(refusal(Reason.QUEUE_FULL, "full", 2.0), b"r1")
    >>> status, json.loads(body)
    (429, {'type': 'error', 'error': {'type': 'rate_limit_error', 'message': 'queue_full: full'}, \
'request_id': 'r1'})
    """
    status, headers, body = response
    error = json.loads(body)["error"]
    code, message = error.get("code"), str(error.get("message") or "")
    if isinstance(code, str) and code:
        message = f"{code}: {message}"
    rid = request_id.decode("latin-1") if request_id is not None else None
    return status, headers, anthropic_body(status, message, request_id=rid)
