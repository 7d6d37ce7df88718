"""Two bench-only proxies for the admission benchmark, each a small pure ASGI app on uvicorn.

``shim`` (between whatever the client talks to and vLLM) makes answers end early: a generation
request that carries ``x-bench-output-tokens: L`` reaches vLLM with ``max_tokens`` = L, while
everything in front of the shim (the sidecar, the shedder, the client's own accounting) saw the
client's larger ``max_tokens``. It stands in for an end of sequence the tiny random model never
emits: vLLM reserves nothing for output and allocates blocks as tokens are generated, so a request
cut at L tokens by ``max_tokens`` holds exactly the blocks one ended by EOS at L would.

``shedder`` is a utilization-threshold load shedder like the Kubernetes inference gateway's default
saturation detector: it polls vLLM's /metrics every ``--interval`` seconds and refuses generation
requests with 429 while ``kv_cache_usage_perc`` > ``--kv-threshold`` (0.8) or
``num_requests_waiting`` > ``--queue-threshold`` (5); everything else is forwarded.

    python -m bench.proxies shim --upstream http://127.0.0.1:8000 --port 8001
    python -m bench.proxies shedder --upstream http://127.0.0.1:8001 --port 8002
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
from typing import Any

import httpx
import uvicorn

from harness.vllm_cpu import free_port

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


class Relay:
    """Forward a request to the upstream and stream the answer back, unbuffered."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=5.0),
            limits=httpx.Limits(
                max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0
            ),
            trust_env=False,
        )

    async def read_body(self, receive: Receive) -> bytes:
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ConnectionResetError
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def forward(
        self, scope: Scope, send: Send, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        query = scope.get("query_string", b"")
        url = self.upstream + scope["path"] + ("?" + query.decode() if query else "")
        try:
            try:
                request = self.client.build_request(
                    scope["method"], url, headers=headers, content=body
                )
                response = await self.client.send(request, stream=True)
            except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError):
                # a pooled keep-alive connection the upstream had just closed: retry once, on a
                # new connection, as a gateway would
                request = self.client.build_request(
                    scope["method"], url, headers=headers, content=body
                )
                response = await self.client.send(request, stream=True)
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


class Shim:
    """Rewrites ``max_tokens`` to ``x-bench-output-tokens`` on generation requests."""

    def __init__(self, upstream: str) -> None:
        self.relay = Relay(upstream)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            body = await self.relay.read_body(receive)
        except ConnectionResetError:
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP]
        real = next((v for k, v in headers if k.lower() == OUTPUT_HEADER), None)
        if real is not None and scope["method"] == "POST" and scope["path"] in GENERATION:
            request = json.loads(body)
            request["max_tokens"] = int(real)
            request.pop("max_completion_tokens", None)
            body = json.dumps(request).encode()
            headers = [(k, v) for k, v in headers if k.lower() != OUTPUT_HEADER]
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
            body = await self.relay.read_body(receive)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["shim", "shedder"])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kv-threshold", type=float, default=0.8)
    parser.add_argument("--queue-threshold", type=float, default=5)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    app: Any
    if args.kind == "shim":
        app = Shim(args.upstream)
    else:
        app = Shedder(
            args.upstream,
            kv_threshold=args.kv_threshold,
            queue_threshold=args.queue_threshold,
            interval=args.interval,
        )
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


if __name__ == "__main__":
    main()
