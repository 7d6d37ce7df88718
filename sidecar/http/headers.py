"""Which headers cross the proxy.

>>> forward_headers([(b"Connection", b"x-a"), (b"x-a", b"1"), (b"x-b", b"2"), (b"te", b"t")])
[(b'x-b', b'2')]
"""

from __future__ import annotations

from sidecar.http.types import Headers

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
