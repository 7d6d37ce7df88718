"""Which headers cross the proxy, and the request id every answer of the sidecar carries.

>>> forward_headers([(b"Connection", b"x-a"), (b"x-a", b"1"), (b"x-b", b"2"), (b"te", b"t")])
[(b'x-b', b'2')]
>>> with_request_id((429, [(b"retry-after", b"1")], b"{}"), b"req-1")
(429, [(b'retry-after', b'1'), (b'x-request-id', b'req-1')], b'{}')
"""

from __future__ import annotations

import os

from sidecar.http.types import Headers

#: the client's id of a request, else one the sidecar makes (and sends on to vLLM): every answer
#: the sidecar makes itself carries it, and so does every relayed answer to a generation request
REQUEST_ID_HEADER = b"x-request-id"

#: RFC 9110 7.6.1 connection-specific headers, never forwarded (plus the legacy ones).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)


def forward_headers(raw: Headers, *, drop: frozenset[bytes] = frozenset()) -> Headers:
    """Headers minus hop-by-hop ones, those the Connection header names, and ``drop``."""
    named: set[bytes] = set()
    for name, value in raw:
        if name.lower() == b"connection":
            named.update(tok.strip().lower() for tok in value.split(b","))
    return [
        (name, value)
        for name, value in raw
        if (low := name.lower()) not in HOP_BY_HOP and low not in named and low not in drop
    ]


def request_id_of(raw: Headers) -> bytes | None:
    """The request's ``X-Request-Id`` as the client sent it, or None."""
    for name, value in raw:
        if name.lower() == REQUEST_ID_HEADER:
            return bytes(value)
    return None


def new_request_id() -> str:
    """A request id for a request that came without one (32 hex digits)."""
    return os.urandom(16).hex()


def with_request_id(
    response: tuple[int, Headers, bytes], request_id: bytes
) -> tuple[int, Headers, bytes]:
    """``response`` (status, headers, body) with ``X-Request-Id: request_id``."""
    status, headers, body = response
    return status, [*headers, (REQUEST_ID_HEADER, request_id)], body
