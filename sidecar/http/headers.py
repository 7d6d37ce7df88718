"""Which headers cross the proxy, and the request id every answer of the sidecar carries.

>>> forward_headers([(b"Connection", b"x-a"), (b"x-a", b"1"), (b"x-b", b"2"), (b"te", b"t")])
[(b'x-b', b'2')]
>>> with_request_id((429, [(b"retry-after", b"1")], b"{}"), b"req-1")
(429, [(b'retry-after', b'1'), (b'x-request-id', b'req-1')], b'{}')
"""

from __future__ import annotations

import os

from sidecar.http.types import ASGIApp, Headers, Message, Receive, Scope, Send

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


class RequestIdMiddleware:
    """Every answer of the wrapped ASGI app (the metrics port's) carries ``X-Request-Id``: the
    client's as sent, else one made here; an answer that sets its own keeps it.

    >>> import asyncio
    >>> async def app(scope, receive, send):
    ...     await send({"type": "http.response.start", "status": 404, "headers": []})
    ...     await send({"type": "http.response.body", "body": b""})
    >>> sent = []
    >>> async def send(message):
    ...     sent.append(message)
    >>> scope = {"type": "http", "headers": [(b"x-request-id", b"abc")]}
    >>> asyncio.run(RequestIdMiddleware(app)(scope, None, send))
    >>> sent[0]["headers"]
    [(b'x-request-id', b'abc')]
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope.get("headers") or []) or new_request_id().encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                if request_id_of(headers) is None:
                    headers.append((REQUEST_ID_HEADER, request_id))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
