"""The sidecar's HTTP clients to vLLM: the proxy's pooled transport and the sidecar's own client.

Shared by the composition root (one process) and each relay worker (several processes): every
process that relays makes its own pool with these settings.
"""

from __future__ import annotations

import http.cookiejar
from typing import Any

import httpx

from sidecar.config import Settings
from sidecar.http.transport import UpstreamTransport

OWN_CONNECTIONS = 64  # the sidecar's own calls: scrapes, /health, discovery, /tokenize


def make_transport(settings: Settings, max_connections: int | None = None) -> UpstreamTransport:
    # keepalive_expiry shorter than uvicorn's 5 s keep-alive (vLLM's server): a pooled
    # connection the server is closing would fail the next request with "disconnected"
    return UpstreamTransport(
        max_connections=max_connections or settings.upstream_max_connections,
        keepalive_expiry=2.0,
    )


def upstream_timeout(settings: Settings) -> httpx.Timeout:
    return httpx.Timeout(
        connect=settings.upstream_connect_timeout,
        read=settings.upstream_read_timeout,
        write=settings.upstream_read_timeout,
        pool=settings.upstream_connect_timeout,
    )


def own_client(settings: Settings, connections: int = OWN_CONNECTIONS) -> httpx.AsyncClient:
    """The sidecar's own small client to vLLM (scrapes, /health, discovery, /tokenize): its own
    ``connections``, carrying vLLM's --api-key when set (clients' requests carry their own)."""
    key = settings.upstream_api_key
    return make_client(
        settings,
        transport=make_transport(settings, connections),
        headers={"Authorization": f"Bearer {key.get_secret_value()}"} if key else None,
    )


def make_client(
    settings: Settings,
    *,
    transport: UpstreamTransport | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.AsyncClient:
    """A pooled client to vLLM with no default headers but ``headers``.

    The proxy sends on its transport directly (each client's own headers, nothing added); the
    sidecar's own calls (scrapes, /health, discovery, /tokenize) use a small client of their own,
    carrying vLLM's --api-key when set, so that they never wait behind a burst of clients in the
    proxy's pool.
    """
    client = httpx.AsyncClient(
        timeout=upstream_timeout(settings),
        transport=transport or make_transport(settings),
        follow_redirects=False,
        trust_env=False,
    )
    for name in list(client.headers.keys()):
        del client.headers[name]
    client.headers.update(headers or {})
    # The client is shared by every caller: a Set-Cookie in one caller's answer must never be
    # sent with another's request. Cookies pass through untouched, as headers.
    client.cookies = _NoCookieJar()
    return client


class _NoCookieJar(http.cookiejar.CookieJar):
    """A jar that keeps nothing and skips parsing: the proxy relays cookies, never stores them."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        return None
