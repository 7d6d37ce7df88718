"""Moving bytes between the client and vLLM: one request up, the answer back, chunk by chunk.

The upstream response is "peeked" (status and headers read) before the client's response starts;
its body is relayed without buffering (an SSE answer is handed on in whole events: the start of
an event cut on the way in waits for its end, :func:`_whole_events`), and a client that goes
away cancels the relay (closing the upstream response, so vLLM aborts the generation). The HTTP
client's errors leave this module as ``sidecar.errors.UpstreamError`` only.

A request runs in the server's task for it, plus one task that watches the client
(:class:`ClientWatch`): the upstream call and the relay run in the request's own task, and a
client that leaves cancels what that task awaits inside :meth:`ClientWatch.guard`. (It was five
tasks: the upstream send and the relay each raced against a disconnect in tasks of their own.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any, Protocol

import httpx

from sidecar.errors import BadRequest, UpstreamError
from sidecar.http import refusals
from sidecar.http.headers import REQUEST_ID_HEADER, forward_headers, request_id_of
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
        watch: ClientWatch,
        on_chunk: Callable[[bytes], None] | None = None,
        *,
        request_id: bytes | None = None,
        anthropic: bool = False,
        transform: EventFilter | None = None,
    ) -> bool:
        """Relay status, headers and body; False when the client went away first.

        ``request_id``: the ``X-Request-Id`` the answer carries when vLLM's has none (vLLM adds
        it only with ``--enable-request-id-headers``, from the one the sidecar sent).
        ``anthropic``: a stream that breaks off ends with Anthropic's ``event: error``.
        ``transform``: applied to a stream's whole events before they are relayed (what the
        sidecar added to vLLM's answer taken out: ``sidecar.http.stream_usage``); ``on_chunk``
        reads them before it.

        Raises :class:`~sidecar.errors.UpstreamError` when vLLM's answer broke off (the client's
        response is then already ended, with an SSE error event for a stream).
        """
        if watch.gone.is_set():
            return False
        headers = forward_headers(response.headers.raw)
        if request_id is not None and request_id_of(headers) is None:
            headers.append((REQUEST_ID_HEADER, request_id))
        sse = response.headers.get("content-type", "").startswith("text/event-stream")
        with watch.guard():
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": headers}
            )
            await _pump_body(response, send, on_chunk, sse, anthropic, transform)
            return True
        return False  # the client left: the guard stopped the relay


class EventFilter(Protocol):
    """What a stream's whole events pass through before they are relayed
    (``sidecar.http.stream_usage.UsageStripper``)."""

    def __call__(self, events: bytes) -> bytes: ...

    def flush(self) -> bytes:
        """What it still holds, at the stream's end."""
        ...


async def _pump_body(
    response: httpx.Response,
    send: Send,
    on_chunk: Callable[[bytes], None] | None,
    sse: bool,
    anthropic: bool = False,
    transform: EventFilter | None = None,
) -> None:
    held = b""  # an SSE event's first part, until its end arrives (_whole_events)
    try:
        with map_httpx_exceptions():
            async for chunk in response.aiter_raw():
                if on_chunk is not None:
                    on_chunk(chunk)
                if sse:
                    chunk, held = _whole_events(held + chunk)
                    if transform is not None and chunk:
                        chunk = transform(chunk)
                    if not chunk:
                        continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if transform is not None:
            held = transform.flush() + held
        if held:  # an answer that ended without its last separator: as vLLM sent it
            await send({"type": "http.response.body", "body": held, "more_body": True})
    except UpstreamError as exc:
        log.warning("upstream failed mid-answer: %s", exc)
        tail = transform.flush() if transform is not None else b""
        if tail:  # the event that ended the choice, held for the usage-only one that never came
            await send({"type": "http.response.body", "body": tail, "more_body": True})
        if sse:  # tell an SSE client what happened before ending the stream
            message = f"vLLM failed mid-answer: {type(exc.__cause__ or exc).__name__}"
            if anthropic:  # Anthropic's stream error event
                event = b"event: error\ndata: " + refusals.anthropic_body(500, message)
            else:
                body = refusals.error_body(message, type_="server_error", code="upstream_failed")
                event = b"data: " + body
            await send({"type": "http.response.body", "body": event + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        raise
    await send({"type": "http.response.body", "body": b"", "more_body": False})


#: SSE's event separators (the spec's three line ends, doubled)
_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")
#: the most of an SSE event held back waiting for its end (an upstream that never separates its
#: events is relayed as it comes, a chunk of this size at a time)
MAX_HELD = 1 << 16


def _whole_events(data: bytes) -> tuple[bytes, bytes]:
    r"""``data`` cut after its last SSE event separator: the whole events to relay now, and the
    start of the next event to hold until its end arrives (nothing held past :data:`MAX_HELD`).

    vLLM writes each event whole, and clients read them so: vLLM's own benchmark client
    (``vllm bench serve``) strips every chunk it reads before parsing, so a chunk cut just
    after an event's ``data: `` reached it as ``data:{...}``, which it could not parse (a
    request of a burst failed so through the sidecar). The sidecar's upstream reads end
    wherever vLLM's socket had data, so they are cut here again at event ends.

    >>> _whole_events(b'data: {"a": 1}\n\ndata: ')
    (b'data: {"a": 1}\n\n', b'data: ')
    >>> _whole_events(b"data: [DONE]\r\n\r\n")
    (b'data: [DONE]\r\n\r\n', b'')
    >>> _whole_events(b"data: {")
    (b'', b'data: {')
    """
    cut = max(data.rfind(sep) + len(sep) if sep in data else 0 for sep in _SEPARATORS)
    if cut == 0 and len(data) > MAX_HELD:
        return data, b""
    return data[:cut], data[cut:]


async def read_small(response: httpx.Response, limit: int) -> bytes | None:
    """The whole raw body of an answer that declares a length of at most ``limit`` bytes and no
    content encoding, read now (the answer can still be relayed: :func:`replay`); None, with
    nothing read, for any other answer. Raises :class:`~sidecar.errors.UpstreamError` when the
    body breaks off."""
    headers = response.headers
    length = headers.get("content-length", "")
    if headers.get("content-encoding") or not length.isdigit() or int(length) > limit:
        return None
    chunks: list[bytes] = []
    with map_httpx_exceptions():
        async for chunk in response.aiter_raw():
            chunks.append(chunk)
    return b"".join(chunks)


def replay(response: httpx.Response, body: bytes) -> httpx.Response:
    """``response`` again, with the raw ``body`` :func:`read_small` read from it, to relay."""
    return httpx.Response(
        response.status_code, headers=response.headers.raw, stream=httpx.ByteStream(body)
    )


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


class ClientWatch:
    """Watches one client for its disconnect, in one task of its own.

    ``gone`` is set when the client goes away. Code that the request's own task runs inside
    :meth:`guard` is cancelled then: the guard takes that cancellation back (``uncancel``, as
    ``asyncio.timeout`` does) and the code after the ``with`` block runs, with ``gone`` set. A
    cancellation from anyone else (the server cutting requests at the drain deadline) passes
    through. The watch starts when the request's body has been read (:meth:`start`): until then
    ``receive`` is the body's.
    """

    __slots__ = ("_cancelling", "_guarding", "_owner", "_receive", "_task", "gone")

    def __init__(self, receive: Receive, *, start: bool = True) -> None:
        self.gone = asyncio.Event()
        self._receive = receive
        self._owner: asyncio.Task[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._guarding = False
        self._cancelling = False
        if start:
            self.start()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._watch())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                break
        self.gone.set()
        owner = self._owner
        if self._guarding and owner is not None and not self._cancelling:
            # the request's task is suspended inside the guard (this task runs, so it does not):
            # the cancellation lands at that await, inside the guard
            self._cancelling = True
            owner.cancel()

    def guard(self) -> ClientWatch:
        """``with watch.guard():`` -- cancel the block when the client leaves (not nestable)."""
        return self

    def __enter__(self) -> None:
        assert not self._guarding, "ClientWatch.guard is not reentrant"
        self._owner = asyncio.current_task()
        self._guarding = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._guarding = False
        if not self._cancelling:
            return False
        self._cancelling = False
        assert self._owner is not None
        # ours to take back; suppress it unless someone else cancelled the task as well
        return self._owner.uncancel() == 0 and exc_type is asyncio.CancelledError
