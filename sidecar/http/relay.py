"""Moving bytes between the client and vLLM: one request up, the answer back, chunk by chunk.

The upstream response is "peeked" (status and headers read) before the client's response starts;
its body is relayed without buffering, and a client that goes away cancels the relay (closing
the upstream response, so vLLM aborts the generation). The HTTP client's errors leave this
module as ``sidecar.errors.UpstreamError`` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import httpx

from sidecar.errors import BadRequest, UpstreamError
from sidecar.http import refusals
from sidecar.http.headers import forward_headers
from sidecar.http.seams import Upstream
from sidecar.http.transport.errors import map_httpx_exceptions
from sidecar.http.types import Headers, Receive, Send

log = logging.getLogger(__name__)

_URL_CACHE_SIZE = 1024


class Relay:
    """Sends requests to one upstream base URL and relays answers to ASGI clients."""

    def __init__(self, upstream: Upstream, base_url: str, timeout: httpx.Timeout) -> None:
        self.upstream = upstream
        base = httpx.URL(base_url)
        self._base = base
        self._base_path = base.raw_path.rstrip(b"/")
        self.base_prefix = base.path.rstrip("/")
        self._extensions = {"timeout": timeout.as_dict()}
        self._urls: dict[tuple[bytes, bytes], httpx.URL] = {}

    def url(self, raw_path: bytes, query: bytes) -> httpx.URL:
        key = (raw_path, query)
        url = self._urls.get(key)
        if url is None:  # parsing a URL costs more than the rest of a small request's routing
            target = self._base_path + raw_path + (b"?" + query if query else b"")
            url = self._base.copy_with(raw_path=target)
            if len(self._urls) >= _URL_CACHE_SIZE:
                self._urls.clear()  # arbitrary query strings must not grow it without bound
            self._urls[key] = url
        return url

    async def send(
        self,
        method: str,
        url: httpx.URL,
        headers: Headers,
        content: bytes | AsyncIterator[bytes],
    ) -> httpx.Response:
        """One request to vLLM; its head is read, its body is left to :meth:`relay`.

        Straight to the transport: httpx.AsyncClient's auth, redirect and cookie layers do
        nothing for a proxy (it relays redirects and cookies) and cost a fifth of its CPU. A
        request that never reached vLLM on a stale pooled connection is retried by the transport.
        """
        request = httpx.Request(
            method, url, headers=headers, content=content, extensions=self._extensions
        )
        with map_httpx_exceptions():
            return await self.upstream.handle_async_request(request)

    async def relay(
        self,
        response: httpx.Response,
        send: Send,
        disconnected: asyncio.Event,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> bool:
        """Relay status, headers and body; False when the client went away first.

        Raises :class:`~sidecar.errors.UpstreamError` when vLLM's answer broke off (the client's
        response is then already ended, with an SSE error event for a stream).
        """
        headers = forward_headers(response.headers.raw)
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        sse = response.headers.get("content-type", "").startswith("text/event-stream")
        pump = asyncio.ensure_future(_pump_body(response, send, on_chunk, sse))
        watch = asyncio.ensure_future(disconnected.wait())
        try:
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pump
        if pump in done:
            pump.result()  # re-raise upstream failures
            return True
        return False


async def _pump_body(
    response: httpx.Response,
    send: Send,
    on_chunk: Callable[[bytes], None] | None,
    sse: bool,
) -> None:
    try:
        with map_httpx_exceptions():
            async for chunk in response.aiter_raw():
                if on_chunk is not None:
                    on_chunk(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UpstreamError as exc:
        log.warning("upstream failed mid-answer: %s", exc)
        if sse:  # tell an SSE client what happened before ending the stream
            body = refusals.error_body(
                f"vLLM failed mid-answer: {type(exc.__cause__ or exc).__name__}",
                type_="server_error",
                code="upstream_failed",
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + body + b"\n\n",
                    "more_body": True,
                }
            )
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        raise
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def respond(send: Send, response: refusals.Response) -> None:
    """Send a whole small response (a refusal or an error)."""
    status, headers, body = response
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def read_body(receive: Receive, limit: int | None) -> bytes | None:
    """The whole request body, or None when the client left; BadRequest (413) above ``limit``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BadRequest(
                f"request body exceeds {limit} bytes", code="body_too_large", status=413
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def watch_disconnect(receive: Receive, disconnected: asyncio.Event) -> asyncio.Task[None]:
    """A task that sets ``disconnected`` when the client goes away."""

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected.set()
                return

    return asyncio.ensure_future(watch())
