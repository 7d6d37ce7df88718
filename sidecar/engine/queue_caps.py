"""vLLM's own admission: its queue caps, the 503 it answers when one is reached, its counter.

vLLM 0.32 refuses a request at its API server when ``--max-num-queued-reqs`` (requests waiting or
running, a request of ``n`` sequences counting ``n``) or ``--max-num-queued-tokens`` (prompt
tokens still in prefill) would be exceeded (``AsyncLLM.check_admission`` in
``vllm/v1/engine/async_llm.py``, called by each handler's ``_preflight`` before a response, a
stream's included, starts). It raises ``QueueOverflowError`` or ``MaxQueuedTokensError``
(``vllm/exceptions.py``), which ``create_error_response`` turns into HTTP 503 with the body
``{"error": {"message": M, "type": "Service Unavailable", "param": null, "code": 503}}`` and no
``Retry-After``; it counts the refusal in ``vllm:admission_rejections_total{model_name,reason}``
(``reason``: ``max_num_queued_reqs`` or ``max_num_queued_tokens``, ``vllm/v1/metrics/loggers.py``).

The sidecar recognises that answer (:func:`queue_cap_reason`, on the message, which is all that
tells it from another 503) and answers its client with its own backpressure instead: 429
``engine_queue_full`` with ``Retry-After`` (``sidecar.http.refusals.engine_queue_full``).

>>> queue_cap_reason(503, QUEUE_FULL_BODY)
'max_num_queued_reqs'
>>> queue_cap_reason(503, b'{"error": {"message": "Request failed; please retry", "code": 503}}')
"""

from __future__ import annotations

import json

#: the sidecar's refusal reason (``kv_sidecar_requests_total{decision="reject"}``) and error code:
#: ``Reason.ENGINE_QUEUE_FULL``'s value (``sidecar.admission.decisions``)
ENGINE_QUEUE_FULL = "engine_queue_full"
#: seconds the sidecar tells a client to wait after vLLM's queue cap refused it (vLLM says none;
#: its queue frees a slot when any request in it ends)
ENGINE_QUEUE_RETRY_AFTER = 1.0

#: vLLM 0.32's messages, by the reason label of ``vllm:admission_rejections_total``
QUEUE_CAP_MESSAGES: dict[str, str] = {
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.": "max_num_queued_reqs",
    "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance.": "max_num_queued_tokens",
}
#: the reasons of ``vllm:admission_rejections_total`` (``ADMISSION_REASONS`` in vLLM 0.32)
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
#: the most of a 503's body read to tell a queue cap's answer (vLLM's is about 180 bytes)
MAX_REFUSAL_BYTES = 4096

#: vLLM's answer when ``--max-num-queued-reqs`` is reached (for tests and fakes)
QUEUE_FULL_BODY = json.dumps(
    {
        "error": {
            "message": next(iter(QUEUE_CAP_MESSAGES)),
            "type": "Service Unavailable",
            "param": None,
            "code": 503,
        }
    }
).encode()


def queue_cap_reason(status: int, body: bytes) -> str | None:
    """vLLM's reason (``max_num_queued_reqs`` / ``max_num_queued_tokens``) when ``body`` is its
    answer to a request a queue cap refused; None for any other answer."""
    if status != 503 or len(body) > MAX_REFUSAL_BYTES:
        return None
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str):
        return None
    return QUEUE_CAP_MESSAGES.get(message.strip())
