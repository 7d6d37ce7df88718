"""Bench-only proxies, each a small pure ASGI app on uvicorn: two for the admission benchmark, and
the plain relay of the overhead benchmark on three HTTP clients.

``shim`` (between whatever the client talks to and vLLM) makes answers end early: a generation
request that carries ``x-bench-output-tokens: L`` ends after L tokens, while everything in front
of the shim (the sidecar, the shedder, the client's own accounting) saw the client's request
unchanged. It stands in for an end of sequence the tiny random model does not choose by itself.
With ``--eos-token-id ID`` the answer ends at a real end of sequence: the shim sets ``min_tokens``
L - 1 and a logit bias of +100 on ID, so that vLLM's own stop check ends it at its L-th token with
``finish_reason`` ``stop``, as a real model's answer ends, and vLLM's histograms
(``vllm:request_success_total{finished_reason}``, ``vllm:request_generation_tokens``) hold what
they hold under real traffic; a ``ignore_eos`` the client sent is dropped there. A generation
request without the header then runs to its ``max_tokens`` (the shim sets ``ignore_eos``: the
random model must not end it early by chance). Without ``--eos-token-id`` the shim cuts the answer
with ``max_tokens`` = L (``finish_reason`` ``length``). Either way vLLM allocates blocks as tokens
are generated, so the request holds exactly the blocks one ended by EOS at L would.

``shedder`` is a utilization-threshold load shedder like the Kubernetes inference gateway's default
saturation detector: it polls vLLM's /metrics every ``--interval`` seconds and refuses generation
requests with 429 while ``kv_cache_usage_perc`` > ``--kv-threshold`` (0.8) or
``num_requests_waiting`` > ``--queue-threshold`` (5); everything else is forwarded.

Without the header the shim is a plain relay: the overhead benchmark's reference for what a proxy's
own stack costs. ``--client`` picks what it forwards with: ``httpx`` (one ``httpx.AsyncClient`` on
its default transport), ``upstream-transport`` (the sidecar's own transport,
``sidecar.http.transport``, called as the sidecar calls it) or ``aiohttp`` (one
``aiohttp.ClientSession``, as production-stack's router relays; ``pip install -e .[bench]``).

    python -m bench.proxies shim --upstream http://127.0.0.1:8000 --port 8001
    python -m bench.proxies shedder --upstream http://127.0.0.1:8001 --port 8002
    python -m bench.proxies shim --client aiohttp --upstream http://127.0.0.1:8000 --port 8003

``--server granian`` serves the same app on granian (a Rust HTTP server for ASGI apps) instead of
uvicorn + httptools + uvloop: the overhead benchmark's measure of the server under the app.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol

import httpx
import uvicorn

from harness.local import free_port

ROOT = Path(__file__).resolve().parent.parent

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

GENERATION = frozenset({"/v1/completions", "/v1/chat/completions"})
HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"host", b"content-length"})
OUTPUT_HEADER = b"x-bench-output-tokens"
_USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.eE+-]+)$", re.M)
_WAITING = re.compile(r"^vllm:num_requests_waiting\{[^}]*\} ([0-9.eE+-]+)$", re.M)
_TIMEOUTS = {"timeout": httpx.Timeout(600.0, connect=5.0).as_dict()}


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class Forwarder(Protocol):
    async def forward(
        self, scope: Scope, send: Send, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None: ...


class Relay:
    """Forward a request to the upstream and stream the answer back, unbuffered.

    ``own_transport``: the sidecar's ``UpstreamTransport`` instead of httpcore, called the way
    the sidecar calls it (``handle_async_request``, without the client's auth, redirect and
    cookie layers, which a relay does not need).
    """

    def __init__(self, upstream: str, *, own_transport: bool = False) -> None:
        self.upstream = upstream.rstrip("/")
        transport = None
        if own_transport:
            from sidecar.http.transport import UpstreamTransport

            transport = UpstreamTransport(
                max_connections=1024, max_keepalive=256, keepalive_expiry=2.0
            )
        self.transport = transport
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=5.0),
            limits=httpx.Limits(
                max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0
            ),
            trust_env=False,
            transport=transport,
        )

    async def _send(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> httpx.Response:
        try:
            request = self.client.build_request(method, url, headers=headers, content=body)
            return await self.client.send(request, stream=True)
        except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError):
            # a pooled keep-alive connection the upstream had just closed: retry once, on a new
            # connection, as a gateway would
            request = self.client.build_request(method, url, headers=headers, content=body)
            return await self.client.send(request, stream=True)

    async def forward(
        self, scope: Scope, send: Send, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        query = scope.get("query_string", b"")
        url = self.upstream + scope["path"] + ("?" + query.decode() if query else "")
        try:
            if self.transport is not None:  # it retries a request that never left by itself
                request = httpx.Request(
                    scope["method"], url, headers=headers, content=body, extensions=_TIMEOUTS
                )
                response = await self.transport.handle_async_request(request)
            else:
                response = await self._send(scope["method"], url, headers, body)
        except httpx.HTTPError as exc:
            await respond(
                send,
                502,
                {
                    "error": {
                        "message": f"upstream: {type(exc).__name__}: {exc}",
                        "type": "proxy",
                        "param": None,
                        "code": "bad_gateway",
                    }
                },
            )
            return
        try:
            out = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP]
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": out}
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


class AiohttpRelay:
    """:class:`Relay` on one ``aiohttp.ClientSession`` (same limits, timeouts and retry), the way
    a relay built on aiohttp uses it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self._session: Any = None  # made on the first request: it needs the running loop

    def session(self) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=2.0),
                timeout=aiohttp.ClientTimeout(total=600.0, connect=5.0),
                auto_decompress=False,
            )
        return self._session

    async def forward(
        self, scope: Scope, send: Send, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        import aiohttp

        query = scope.get("query_string", b"")
        url = self.upstream + scope["path"] + ("?" + query.decode() if query else "")
        out_headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        session = self.session()
        try:
            try:
                response = await session.request(
                    scope["method"], url, headers=out_headers, data=body
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionError):
                # as Relay: a pooled connection the upstream had just closed, retried once
                response = await session.request(
                    scope["method"], url, headers=out_headers, data=body
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            await respond(
                send,
                502,
                {
                    "error": {
                        "message": f"upstream: {type(exc).__name__}: {exc}",
                        "type": "proxy",
                        "param": None,
                        "code": "bad_gateway",
                    }
                },
            )
            return
        try:
            out = [(k, v) for k, v in response.raw_headers if k.lower() not in HOP]
            await send({"type": "http.response.start", "status": response.status, "headers": out})
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (aiohttp.ClientError, TimeoutError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            response.release()


async def respond(
    send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


#: the logit bias that makes the end-of-sequence token the certain next one once ``min_tokens``
#: no longer masks it (vLLM clamps a bias to [-100, 100])
EOS_BIAS = 100.0


def end_at(request: dict[str, Any], tokens: int, eos_token_id: int | None) -> dict[str, Any]:
    """``request`` rewritten so that each of its answers ends after ``tokens`` tokens: at a real
    end of sequence when ``eos_token_id`` is given, else cut by ``max_tokens``.

    >>> end_at({"max_tokens": 500, "ignore_eos": True}, 40, 1)
    {'max_tokens': 500, 'min_tokens': 39, 'logit_bias': {'1': 100.0}}
    >>> end_at({"max_tokens": 500}, 40, None)
    {'max_tokens': 40}
    """
    out = dict(request)
    if eos_token_id is None:
        out["max_tokens"] = tokens
        out.pop("max_completion_tokens", None)
        return out
    out.pop("ignore_eos", None)
    out["min_tokens"] = max(0, tokens - 1)
    bias = dict(out.get("logit_bias") or {})
    bias[str(eos_token_id)] = EOS_BIAS
    out["logit_bias"] = bias
    return out


class Shim:
    """Ends generation requests after ``x-bench-output-tokens`` tokens (see the module's
    docstring); with ``eos_token_id``, at a real end of sequence, and a request without the
    header runs to its ``max_tokens``."""

    def __init__(
        self, upstream: str, client: str = "httpx", eos_token_id: int | None = None
    ) -> None:
        self.relay: Forwarder = (
            AiohttpRelay(upstream)
            if client == "aiohttp"
            else Relay(upstream, own_transport=client == "upstream-transport")
        )
        self.eos_token_id = eos_token_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            body = await read_body(receive)
        except ConnectionResetError:
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP]
        real = next((v for k, v in headers if k.lower() == OUTPUT_HEADER), None)
        generation = scope["method"] == "POST" and scope["path"] in GENERATION
        if real is not None and generation:
            body = json.dumps(end_at(json.loads(body), int(real), self.eos_token_id)).encode()
            headers = [(k, v) for k, v in headers if k.lower() != OUTPUT_HEADER]
        elif generation and self.eos_token_id is not None:
            request = json.loads(body)
            request["ignore_eos"] = True
            body = json.dumps(request).encode()
        await self.relay.forward(scope, send, body, headers)


class Shedder:
    """Refuses generation requests while vLLM's KV usage or waiting queue is over a threshold."""

    def __init__(
        self, upstream: str, *, kv_threshold: float, queue_threshold: float, interval: float
    ) -> None:
        self.relay = Relay(upstream)
        self.kv_threshold = kv_threshold
        self.queue_threshold = queue_threshold
        self.interval = interval
        self.kv_usage = 0.0
        self.waiting = 0.0
        self.refused = 0
        self.forwarded = 0
        self._task: asyncio.Task[None] | None = None

    async def poll(self) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                text = (await self.relay.client.get(self.relay.upstream + "/metrics")).text
                usage = _USAGE.findall(text)
                waiting = _WAITING.findall(text)
                self.kv_usage = max((float(x) for x in usage), default=0.0)
                self.waiting = sum(float(x) for x in waiting)
            await asyncio.sleep(self.interval)

    def saturated(self) -> bool:
        return self.kv_usage > self.kv_threshold or self.waiting > self.queue_threshold

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self._task = asyncio.ensure_future(self.poll())
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self._task is not None:
                        self._task.cancel()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"] == "/bench/shedder":
            await respond(
                send,
                200,
                {
                    "refused": self.refused,
                    "forwarded": self.forwarded,
                    "kv_usage": self.kv_usage,
                    "waiting": self.waiting,
                },
            )
            return
        try:
            body = await read_body(receive)
        except ConnectionResetError:
            return
        if scope["method"] == "POST" and scope["path"] in GENERATION:
            if self.saturated():
                self.refused += 1
                await respond(
                    send,
                    429,
                    {
                        "error": {
                            "message": f"saturated: KV usage {self.kv_usage:.2f}, waiting "
                            f"{self.waiting:.0f}",
                            "type": "rate_limit",
                            "param": None,
                            "code": "saturated",
                        }
                    },
                )
                return
            self.forwarded += 1
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP]
        await self.relay.forward(scope, send, body, headers)


class BenchProxy:
    """``python -m bench.proxies KIND`` on a free port."""

    def __init__(self, kind: str, upstream: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.proxies",
                kind,
                "--upstream",
                upstream,
                "--port",
                str(self.port),
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(self.url + "/v1/models", timeout=2).raise_for_status()
                return
            time.sleep(0.2)
        raise TimeoutError(f"bench proxy {kind} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.proxies", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("kind", choices=["shim", "shedder"])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--client", choices=["httpx", "upstream-transport", "aiohttp"], default="httpx"
    )
    parser.add_argument("--server", choices=["uvicorn", "granian"], default="uvicorn")
    parser.add_argument("--kv-threshold", type=float, default=0.8)
    parser.add_argument("--queue-threshold", type=float, default=5)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument(
        "--eos-token-id",
        type=int,
        default=None,
        help="shim: end answers at this end-of-sequence token (else cut them by max_tokens)",
    )
    args = parser.parse_args(argv)
    app: Any
    if args.kind == "shim":
        app = Shim(args.upstream, args.client, args.eos_token_id)
    else:
        app = Shedder(
            args.upstream,
            kv_threshold=args.kv_threshold,
            queue_threshold=args.queue_threshold,
            interval=args.interval,
        )
    if args.server == "granian":
        _serve_granian(app, args.port, lifespan=args.kind == "shedder")
        return
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on" if args.kind == "shedder" else "off",
        loop="uvloop",
        http="httptools",
        timeout_keep_alive=30,
    )


def _serve_granian(app: Any, port: int, *, lifespan: bool) -> None:
    """The app on granian's embedded server, one worker on this process's uvloop loop: the same
    process model as uvicorn's (``pip install -e .[bench]``)."""
    import uvloop
    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    async def run() -> None:
        server = Server(
            app,
            address="127.0.0.1",
            port=port,
            interface=Interfaces.ASGI if lifespan else Interfaces.ASGINL,
            http=HTTPModes.http1,
            log_enabled=False,
        )
        await server.serve()

    uvloop.run(run())


if __name__ == "__main__":
    main()
