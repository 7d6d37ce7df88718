"""The proxy port: a pure ASGI app that relays everything to vLLM and gates generation.

Every method and path goes to the configured upstream unchanged (status, headers minus hop-by-hop
ones, bodies, and streams in both directions, chunk by chunk). ``POST`` to a generation path goes
through the request path first::

    body -> parse -> count prompt tokens -> project KV -> admit / queue / refuse
         -> relay vLLM's answer (tracking generated tokens) -> release the reservation

The upstream response is "peeked" (status and headers read) before the client's response starts.
A client that goes away cancels the upstream request (vLLM then aborts the generation), and the
reservation is released in ``finally`` whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import httpx

from sidecar import errors
from sidecar.admission import Outcome
from sidecar.ledger import Reservation
from sidecar.projection import Projection, project
from sidecar.request import (
    GENERATION_PATHS,
    BadRequest,
    GenerationRequest,
    counting_view,
    parse_generation,
)
from sidecar.tokens import PromptError

if TYPE_CHECKING:
    from sidecar.app import Sidecar

log = logging.getLogger("sidecar.proxy")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

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
_USAGE_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TAIL_BYTES = 4096
_URL_CACHE_SIZE = 1024


def forward_headers(
    raw: list[tuple[bytes, bytes]], *, drop: frozenset[bytes] = frozenset()
) -> list[tuple[bytes, bytes]]:
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


class UsageTracker:
    """Reads generated-token progress out of vLLM's answer as it streams by, without copying it.

    SSE: one ``data:`` event per decoding step per sequence, and the exact ``usage`` in the last
    event when the client asked for it. JSON: ``usage.completion_tokens`` near the end of the body.
    """

    __slots__ = ("_tail", "completion_tokens", "events")

    def __init__(self) -> None:
        self.events = 0
        self.completion_tokens: int | None = None
        self._tail = b""

    def feed(self, chunk: bytes, *, sse: bool) -> None:
        if sse:
            self.events += chunk.count(b"data:")
        window = self._tail + chunk
        if b"completion_tokens" in window:
            matches = _USAGE_COMPLETION.findall(window)
            if matches:
                self.completion_tokens = int(matches[-1])
        self._tail = window[-_TAIL_BYTES:]


class _ClientGone(Exception):
    """The client disconnected while its request body was being relayed."""


class Proxy:
    """The ASGI app of the proxy port."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sc = sidecar
        base = httpx.URL(sidecar.settings.upstream)
        self._base = base
        self._base_path = base.raw_path.rstrip(b"/")
        self._base_prefix = base.path.rstrip("/")
        self._extensions = {"timeout": sidecar.client.timeout.as_dict()}  # the same limits
        self._urls: dict[tuple[bytes, bytes], httpx.URL] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets are not part of vLLM's API
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        if not raw_path.startswith(b"/"):
            # absolute-form or authority-form targets could name another host: never follow them
            await self._respond(
                send, *errors.plain(400, "request target must be a path", code="invalid_target")
            )
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        settings = self.sc.settings
        if len(headers) > settings.max_headers or (
            sum(len(k) + len(v) for k, v in headers) + 4 * len(headers) > settings.max_header_bytes
        ):
            # refused before anything is forwarded: vLLM never sees them, and no per-header work
            # (cookie handling, copying) runs on the event loop
            message = (
                f"request headers exceed the limit of {settings.max_headers} headers "
                f"or {settings.max_header_bytes} bytes"
            )
            await self._respond(
                send, *errors.plain(431, message, code="request_header_fields_too_large")
            )
            return
        endpoint = None
        if scope["method"] == "POST":
            # classify on the path vLLM will route, after the URL's dot segments are resolved
            # (else "/x/../v1/completions" would pass as a non-generating request)
            path = scope["path"]
            if b"/." in raw_path or b"%2e" in raw_path.lower():  # parsing URLs is costly: only then
                path = self._url(raw_path, b"").path[len(self._base_prefix) :]
            endpoint = GENERATION_PATHS.get(path)
        try:
            if endpoint is None:
                self.sc.passthrough_in_flight += 1  # a drain waits for these too
                try:
                    await self._passthrough(scope, receive, send, raw_path)
                finally:
                    self.sc.passthrough_in_flight -= 1
            else:
                await self._generate(scope, receive, send, raw_path, endpoint)
        except asyncio.CancelledError:
            if not self.sc.draining:
                raise
            # the server cut what was still running at the drain deadline: expected, logged once
            # by the drain, not as a traceback per request

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- plumbing ----------------------------------------------------------------------------

    def _url(self, raw_path: bytes, query: bytes) -> httpx.URL:
        key = (raw_path, query)
        url = self._urls.get(key)
        if url is None:  # parsing a URL costs more than the rest of a small request's routing
            target = self._base_path + raw_path + (b"?" + query if query else b"")
            url = self._base.copy_with(raw_path=target)
            if len(self._urls) >= _URL_CACHE_SIZE:
                self._urls.clear()  # arbitrary query strings must not grow it without bound
            self._urls[key] = url
        return url

    @staticmethod
    async def _respond(
        send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _read_body(self, receive: Receive, limit: int | None) -> bytes | None:
        """The whole request body, or None when it exceeds ``limit`` or the client left."""
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

    async def _send_upstream(
        self,
        method: str,
        url: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        content: bytes | AsyncIterator[bytes],
    ) -> httpx.Response:
        # Straight to the transport: httpx.AsyncClient's auth, redirect and cookie layers do
        # nothing for a proxy (it relays redirects and cookies) and cost a fifth of its CPU.
        def request() -> httpx.Request:
            return httpx.Request(
                method, url, headers=headers, content=content, extensions=self._extensions
            )

        transport = self.sc.transport
        try:
            return await transport.handle_async_request(request())
        except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.WriteError):
            if not isinstance(content, bytes):
                raise  # a streamed body cannot be sent twice
            # A pooled connection the server closed as it was reused: the request never reached
            # vLLM (no response head came), so sending it again on a fresh connection is safe.
            return await transport.handle_async_request(request())

    async def _relay(
        self,
        response: httpx.Response,
        send: Send,
        disconnected: asyncio.Event,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> bool:
        """Relay status, headers and body; False when the client went away first."""
        headers = forward_headers(response.headers.raw)
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        sse = response.headers.get("content-type", "").startswith("text/event-stream")
        relay = asyncio.ensure_future(self._pump_body(response, send, on_chunk, sse))
        watch = asyncio.ensure_future(disconnected.wait())
        try:
            done, _ = await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not relay.done():
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await relay
        if relay in done:
            relay.result()  # re-raise upstream failures
            return True
        return False

    @staticmethod
    async def _pump_body(
        response: httpx.Response,
        send: Send,
        on_chunk: Callable[[bytes], None] | None,
        sse: bool,
    ) -> None:
        try:
            async for chunk in response.aiter_raw():
                if on_chunk is not None:
                    on_chunk(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            log.warning("upstream failed mid-answer: %s", exc)
            if sse:  # tell an SSE client what happened before ending the stream
                body = errors.error_body(
                    f"vLLM failed mid-answer: {type(exc).__name__}",
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

    @staticmethod
    def _watch_disconnect(receive: Receive, disconnected: asyncio.Event) -> asyncio.Task[None]:
        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    return

        return asyncio.ensure_future(watch())

    # --- pass-through ------------------------------------------------------------------------

    async def _passthrough(
        self, scope: Scope, receive: Receive, send: Send, raw_path: bytes
    ) -> None:
        disconnected = asyncio.Event()
        watcher: asyncio.Task[None] | None = None

        async def body() -> AsyncIterator[bytes]:
            nonlocal watcher
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    # abort the upstream request: ending the body here would hand vLLM a
                    # truncated body that looks complete
                    raise _ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    break
            watcher = self._watch_disconnect(receive, disconnected)

        headers = forward_headers(scope["headers"], drop=frozenset({b"host"}))
        has_body = any(
            k.lower() in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"]
        )
        try:
            try:
                if has_body:
                    content: bytes | AsyncIterator[bytes] = body()
                else:
                    content = b""
                    watcher = self._watch_disconnect(receive, disconnected)
                response = await self._send_upstream(
                    scope["method"], self._url(raw_path, scope["query_string"]), headers, content
                )
            except _ClientGone:
                return
            except httpx.TimeoutException:
                self.sc.metrics.upstream_errors.labels("timeout").inc()
                await self._respond(
                    send, *errors.refusal("upstream_timeout", "vLLM did not answer in time", None)
                )
                return
            except httpx.HTTPError as exc:
                self.sc.metrics.upstream_errors.labels("connect").inc()
                await self._respond(
                    send,
                    *errors.refusal(
                        "upstream_unavailable", f"vLLM is unreachable: {type(exc).__name__}", 1.0
                    ),
                )
                return
            try:
                if watcher is None:
                    watcher = self._watch_disconnect(receive, disconnected)
                await self._relay(response, send, disconnected)
            except httpx.HTTPError:
                self.sc.metrics.upstream_errors.labels("protocol").inc()
            finally:
                await response.aclose()
        finally:
            if watcher is not None:
                watcher.cancel()

    # --- generation --------------------------------------------------------------------------

    async def _generate(
        self, scope: Scope, receive: Receive, send: Send, raw_path: bytes, endpoint: str
    ) -> None:
        sc = self.sc
        try:
            limit = sc.settings.max_body_bytes
            for name, value in scope["headers"]:
                if name.lower() == b"content-length" and value.isdigit() and int(value) > limit:
                    raise BadRequest(
                        f"request body exceeds {limit} bytes", code="body_too_large", status=413
                    )
            raw = await self._read_body(receive, limit)
            if raw is None:
                return  # the client left before sending its request
            request = parse_generation(endpoint, raw)  # type: ignore[arg-type]
        except BadRequest as exc:
            sc.metrics.refused("bad_request")
            await self._respond(send, *errors.from_bad_request(exc))
            return

        if not sc.engine_ready():
            retry = 2.0
            sc.metrics.refused("upstream_unavailable", retry)
            await self._respond(
                send, *errors.refusal("not_ready", "the sidecar has not reached vLLM yet", retry)
            )
            return

        disconnected = asyncio.Event()
        watcher = self._watch_disconnect(receive, disconnected)
        reservation: Reservation | None = None
        try:
            t0 = time.perf_counter()
            try:
                count = await sc.counter.count(*counting_view(request))
                sc.metrics.counted(count)
                t1 = time.perf_counter()
                projection = project(
                    request,
                    count.prompts,
                    max_model_len=sc.max_model_len,
                    blocks=sc.blocks,
                    exact=count.exact,
                )
            except (BadRequest, PromptError) as exc:
                bad = exc if isinstance(exc, BadRequest) else BadRequest(str(exc), param="prompt")
                reason = (
                    "prompt_too_long" if bad.code == "context_length_exceeded" else "bad_request"
                )
                sc.metrics.refused(reason)
                await self._respond(send, *errors.from_bad_request(bad))
                return
            sc.metrics.projected(projection, sc.engine.bytes_per_block)
            decision = sc.admission.try_admit(projection, streamed=request.stream)
            sc.metrics.decision_seconds.observe(time.perf_counter() - t1)
            if decision is None:  # queue it
                decision = await sc.admission.wait(
                    projection, streamed=request.stream, cancelled=disconnected
                )
                sc.metrics.queue_wait.observe(decision.waited_seconds)
            sc.metrics.decided(decision)
            if decision.outcome is Outcome.CANCEL:
                return
            if not decision.admitted:
                await self._respond(send, *errors.from_decision(decision))
                return
            reservation = decision.reservation
            assert reservation is not None
            if disconnected.is_set():
                return
            log.debug(
                "admitted %s: %d prompt tokens (%s), %d blocks reserved in %.0f us",
                endpoint,
                projection.prompt_total,
                count.method.value,
                reservation.reserved_blocks,
                (time.perf_counter() - t0) * 1e6,
            )
            await self._forward_generation(
                scope, send, raw_path, raw, request, projection, reservation, disconnected
            )
        finally:
            watcher.cancel()
            if reservation is not None:
                sc.admission.release(reservation)

    async def _forward_generation(
        self,
        scope: Scope,
        send: Send,
        raw_path: bytes,
        raw: bytes,
        request: GenerationRequest,
        projection: Projection,
        reservation: Reservation,
        disconnected: asyncio.Event,
    ) -> None:
        sc = self.sc
        headers = forward_headers(scope["headers"], drop=frozenset({b"host", b"content-length"}))
        # A non-streamed answer's headers come only when vLLM has finished: watch the client
        # meanwhile, and cancel (vLLM then aborts the generation) if it leaves.
        sending = asyncio.ensure_future(
            self._send_upstream("POST", self._url(raw_path, scope["query_string"]), headers, raw)
        )
        gone = asyncio.ensure_future(disconnected.wait())
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not sending.done():
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await sending
            return
        try:
            response = sending.result()
        except httpx.TimeoutException:
            sc.metrics.upstream_errors.labels("timeout").inc()
            await self._respond(
                send, *errors.refusal("upstream_timeout", "vLLM did not answer in time", None)
            )
            return
        except httpx.HTTPError as exc:
            sc.metrics.upstream_errors.labels("connect").inc()
            sc.metrics.refused("upstream_unavailable", 1.0)
            await self._respond(
                send,
                *errors.refusal(
                    "upstream_unavailable", f"vLLM is unreachable: {type(exc).__name__}", 1.0
                ),
            )
            return
        tracker = UsageTracker()
        sequences = max(projection.sequences, 1)
        ledger = sc.admission.ledger
        streamed = request.stream

        if not streamed:
            ledger.start(reservation)  # no sign of its prefill will come: count it from now

        def on_chunk(chunk: bytes) -> None:
            tracker.feed(chunk, sse=streamed)
            if streamed:
                ledger.start(reservation)  # the first event comes after vLLM's prefill
                ledger.advance(reservation, tracker.events / sequences)

        completed = False
        try:
            if response.status_code >= 500:
                sc.metrics.upstream_errors.labels("status_5xx").inc()
            completed = await self._relay(response, send, disconnected, on_chunk)
        except httpx.HTTPError:
            sc.metrics.upstream_errors.labels("protocol").inc()
        finally:
            await response.aclose()
        tokens = tracker.completion_tokens
        if tokens is None and streamed:
            tokens = tracker.events  # no usage chunk asked for: one event per token per sequence
        if tokens is not None:
            sc.metrics.completion_tokens.inc(tokens)
            # only natural ends teach the expected-mode learner how long answers run
            if completed and response.status_code == 200:
                reservation.completion_tokens = tokens
