"""The proxy port: a pure ASGI app that relays everything to vLLM and gates generation.

Every method and path goes to the configured upstream unchanged (status, headers minus hop-by-hop
ones, bodies, and streams in both directions, chunk by chunk). ``POST`` to a generation path
goes through :class:`~sidecar.http.generation.GenerationPath` first. A client that goes away
cancels the upstream request (vLLM then aborts the generation). vLLM's API pages (``/docs``,
``/redoc``: scripts from a CDN) are answered 404 here unless ``--docs``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx

from sidecar.counting import GENERATION_PATHS
from sidecar.errors import UpstreamError
from sidecar.http import refusals
from sidecar.http.generation import GenerationPath
from sidecar.http.headers import forward_headers, new_request_id, request_id_of, with_request_id
from sidecar.http.relay import ClientWatch, Relay, respond
from sidecar.http.seams import MetricsSink, Traffic
from sidecar.http.types import Receive, Scope, Send
from sidecar.observability.logs import clip, log_passthrough

_DROP_REQUEST_HEADERS = frozenset({b"host"})
#: vLLM's pages that load Swagger UI or ReDoc from a CDN (FastAPI's defaults); 404 unless --docs
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc"})


class _ClientGone(Exception):
    """The client disconnected while its request body was being relayed (control flow)."""


class Proxy:
    """The ASGI app of the proxy port."""

    def __init__(
        self,
        *,
        relay: Relay,
        generation: GenerationPath,
        traffic: Traffic,
        metrics: MetricsSink,
        max_headers: int,
        max_header_bytes: int,
        access_log: bool = False,
        docs: bool = False,
    ) -> None:
        self.relay = relay
        self.generation = generation
        self.traffic = traffic
        self.metrics = metrics
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes
        #: an access log line for each request that is not a generation request
        self.access_log = access_log
        self.docs = docs  # vLLM's /docs and /redoc pass through

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # websockets are not part of vLLM's API; uvicorn runs without lifespan
        start = time.perf_counter() if self.access_log else 0.0
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        if not raw_path.startswith(b"/"):
            # absolute-form or authority-form targets could name another host: never follow them
            refusal = refusals.plain(400, "request target must be a path", code="invalid_target")
            await respond(send, _with_id(scope, refusal))
            if self.access_log:
                _log(scope, 400, start)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if len(headers) > self.max_headers or (
            sum(len(k) + len(v) for k, v in headers) + 4 * len(headers) > self.max_header_bytes
        ):
            # refused before anything is forwarded: vLLM never sees them, and no per-header work
            # (cookie handling, copying) runs on the event loop
            message = (
                f"request headers exceed the limit of {self.max_headers} headers "
                f"or {self.max_header_bytes} bytes"
            )
            refusal = refusals.plain(431, message, code="request_header_fields_too_large")
            await respond(send, _with_id(scope, refusal))
            if self.access_log:
                _log(scope, 431, start)
            return
        if not self.docs and scope["path"] in DOCS_PATHS:
            message = "the API pages are off on this sidecar (kv-sidecar serve --docs)"
            await respond(send, _with_id(scope, refusals.plain(404, message, code="not_found")))
            if self.access_log:
                _log(scope, 404, start)
            return
        endpoint = None
        if scope["method"] == "POST":
            # classify on the path vLLM will route, after the URL's dot segments are resolved
            # (else "/x/../v1/completions" would pass as a non-generating request)
            path = scope["path"]
            if b"/." in raw_path or b"%2e" in raw_path.lower():  # parsing URLs is costly: only then
                path = self.relay.url(raw_path, b"").path[len(self.relay.base_prefix) :]
            endpoint = GENERATION_PATHS.get(path)
        try:
            if endpoint is None:
                self.traffic.passthrough_in_flight += 1  # a drain waits for these too
                status = 499  # the client left before an answer began (nginx's code)
                try:
                    status = await self._passthrough(scope, receive, send, raw_path)
                finally:
                    self.traffic.passthrough_in_flight -= 1
                    if self.access_log:
                        _log(scope, status, start)
            else:
                await self.generation(scope, receive, send, raw_path, endpoint)
        except asyncio.CancelledError:
            if not self.traffic.draining:
                raise
            # the server cut what was still running at the drain deadline: expected, logged once
            # by the drain, not as a traceback per request

    async def _passthrough(
        self, scope: Scope, receive: Receive, send: Send, raw_path: bytes
    ) -> int:
        """Relay one request and its answer; the status the client got (499: none)."""
        watch = ClientWatch(receive, start=False)  # started once the body is read

        async def body() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    watch.gone.set()
                    # abort the upstream request: ending the body here would hand vLLM a
                    # truncated body that looks complete
                    raise _ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    break
            watch.start()

        headers = forward_headers(scope["headers"], drop=_DROP_REQUEST_HEADERS)
        has_body = any(
            k.lower() in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"]
        )
        try:
            response: httpx.Response | None = None
            with watch.guard():
                try:
                    if has_body:
                        content: bytes | AsyncIterator[bytes] = body()
                    else:
                        content = b""
                        watch.start()
                    url = self.relay.url(raw_path, scope["query_string"])
                    response = await self.relay.send(scope["method"], url, headers, content)
                except UpstreamError as exc:
                    if isinstance(exc.__cause__, _ClientGone) or watch.gone.is_set():
                        return 499
                    self.metrics.upstream_failed(exc.kind)
                    refusal = refusals.from_error(exc)
                    await respond(send, _with_id(scope, refusal))
                    return refusal[0]
                except _ClientGone:
                    return 499
            if response is None:
                return 499  # the client left while vLLM had not answered
            try:
                watch.start()
                await self.relay.relay(response, send, watch)
            except UpstreamError as exc:
                self.metrics.upstream_failed(exc.kind)
            finally:
                await response.aclose()
            return response.status_code
        finally:
            watch.close()


def _with_id(scope: Scope, response: refusals.Response) -> refusals.Response:
    """An answer of the proxy's own with the client's X-Request-Id, else a new one, and in
    Anthropic's shape on its paths (a relayed pass-through answer is vLLM's, as it came)."""
    request_id = request_id_of(scope["headers"]) or new_request_id().encode()
    if refusals.is_anthropic_path(scope["path"]):
        response = refusals.anthropic_shaped(response, request_id)
    return with_request_id(response, request_id)


def _log(scope: Scope, status: int, start: float) -> None:
    request_id = None
    for key, value in scope["headers"]:
        if key.lower() == b"x-request-id":
            request_id = clip(bytes(value).decode("latin-1"))
            break
    log_passthrough(scope["method"], scope["path"], status, time.perf_counter() - start, request_id)
