"""Helpers for the reliability tests (``test_faults``, ``test_soak``, ``test_hostile``).

- :func:`proc_stats`: a process's RSS, threads and open file descriptors, read from ``/proc``
  (psutil is not a dependency).
- :class:`ThreadedSidecar`: the real sidecar (``Sidecar`` with its proxy and ops apps on
  uvicorn, wired as ``serve()`` wires them) on its own event loop in a thread, so synchronous
  tests (hypothesis, raw sockets) can drive it over real HTTP and still look at its ledger.
- :class:`ToughFake`: the fake vLLM of ``harness/fake_vllm.py`` with a few more knobs: a firehose
  route that counts the bytes it manages to send, the peak of concurrent generations, and vLLM's
  ``--api-key`` guard.
- :func:`raw_http`: one request written byte for byte on a socket.

    with FakeServer(ToughFake(model_root=model_dir)) as fake, ThreadedSidecar(fake.url) as sc:
        httpx.post(sc.url + "/v1/completions", json={...})
        assert sc.call(lambda: len(sc.sidecar.admission.ledger)) == 0
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

import httpx

from harness.fake_vllm import FakeVllm, Message, Receive, Scope, Send, bound_socket, respond
from sidecar.app import Sidecar, _Server, _uvicorn_config
from sidecar.config import Settings
from tests.support.exporter import sample_value

T = TypeVar("T")

#: vLLM's ``--api-key`` middleware guards these path prefixes (vllm 0.32,
#: ``vllm/entrypoints/serve/middleware/authenticate.py``); /health, /metrics, /tokenize are open.
VLLM_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


# --- /proc ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcStats:
    rss_bytes: int
    threads: int
    fds: int

    def as_dict(self) -> dict[str, int]:
        return {"rss_bytes": self.rss_bytes, "threads": self.threads, "fds": self.fds}


def proc_stats(pid: int) -> ProcStats:
    """RSS (``VmRSS``), thread count and open file descriptors of process ``pid``."""
    fields: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    rss_kib = int(fields["VmRSS"].split()[0])
    return ProcStats(
        rss_bytes=rss_kib * 1024,
        threads=int(fields["Threads"]),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
    )


# --- the sidecar in a thread ----------------------------------------------------------------


class ThreadedSidecar:
    """The in-process sidecar on a private event loop in a daemon thread."""

    def __init__(self, upstream: str, *, discovered: bool = True, **overrides: Any) -> None:
        self._socks = (bound_socket(), bound_socket())
        options: dict[str, Any] = {"scrape_interval": 0.05, "log_level": "warning"}
        options.update(overrides)
        self.settings = Settings(
            upstream=upstream,
            host="127.0.0.1",
            port=self._socks[0].getsockname()[1],
            metrics_port=self._socks[1].getsockname()[1],
            **options,
        )
        self._wait_discovered = discovered
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._servers: list[_Server] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.sidecar: Sidecar | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def ops_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.metrics_port}"

    @property
    def port(self) -> int:
        return self.settings.port

    @property
    def sc(self) -> Sidecar:
        assert self.sidecar is not None
        return self.sidecar

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the sidecar's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Call ``fn`` on the sidecar's loop (its state is only consistent there)."""
        future: Future[T] = Future()

        def invoke() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(invoke)
        return future.result(timeout)

    def alive(self) -> bool:
        """Both uvicorn servers still serving (a crash of the app would end their task)."""
        return self._thread.is_alive() and not any(t.done() for t in self._tasks)

    def ledger_figures(self) -> dict[str, int]:
        """Totals as the ledger keeps them, and as re-summed from its reservations."""

        def read() -> dict[str, int]:
            ledger = self.sc.admission.ledger
            reservations = list(ledger)
            return {
                "in_flight": len(ledger),
                "reserved_blocks": ledger.reserved_blocks,
                "predicted_blocks": ledger.predicted_blocks,
                "resummed_reserved": sum(r.reserved_blocks for r in reservations),
                "resummed_predicted": sum(r.predicted_blocks for r in reservations),
                "queue_depth": self.sc.admission.queue_depth,
            }

        return self.call(read)

    def ledger_empty(self) -> bool:
        f = self.ledger_figures()
        return f["in_flight"] == 0 and f["reserved_blocks"] == 0 and f["queue_depth"] == 0

    def sample(self, name: str, **labels: str) -> float:
        value = self.call(lambda: sample_value(self.sc.registry, name, labels))
        return 0.0 if value is None else float(value)

    async def _start(self) -> None:
        self.sidecar = Sidecar(self.settings)
        await self.sidecar.start()
        for app, sock in (
            (self.sidecar.proxy, self._socks[0]),
            (self.sidecar.ops, self._socks[1]),
        ):
            port = sock.getsockname()[1]
            server = _Server(_uvicorn_config(app, self.settings, port))
            self._servers.append(server)
            self._tasks.append(asyncio.ensure_future(server.serve(sockets=[sock])))
        deadline = time.monotonic() + 10
        while not all(s.started for s in self._servers):
            assert time.monotonic() < deadline, "the sidecar's servers did not start"
            await asyncio.sleep(0.01)
        if self._wait_discovered:
            while not self.sidecar.discovered:
                assert time.monotonic() < deadline, "the sidecar did not discover the upstream"
                await asyncio.sleep(0.01)

    async def _stop(self) -> None:
        for server in self._servers:
            server.should_exit = True
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if self.sidecar is not None:
            await self.sidecar.stop()

    def start(self) -> ThreadedSidecar:
        self._thread.start()
        try:
            self.run(self._start())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self.run(self._stop(), timeout=20)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> ThreadedSidecar:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- a tougher fake -----------------------------------------------------------------------


class ToughFake(FakeVllm):
    """:class:`FakeVllm` plus fault-injection routes and counters for the reliability tests.

    - ``GET /firehose?chunks=N&size=S`` (and a generation body carrying ``"firehose": N``):
      an SSE stream of ``N`` events of ``S`` bytes sent as fast as the reader takes them;
      ``firehose_sent`` counts the bytes handed to the server so far.
    - ``GET /redirect?to=URL``: a 307 to ``URL`` (a proxy must relay it, never follow it).
    - ``peak_in_flight``: the most generations running at once.
    - ``api_key``: when set, answers 401 on vLLM's guarded paths without the bearer token, as
      ``vllm serve --api-key`` does.
    """

    def __init__(self, *, api_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api_key = api_key
        self.firehose_sent = 0
        self.firehose_done = False
        self.peak_in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if self.api_key is not None and scope["method"] != "OPTIONS":
            if path.startswith(VLLM_GUARDED_PREFIXES) and not self._authorized(scope):
                body, _ = await self._read_body(receive, record_first_chunk=False)
                self.requests.append(_record(scope, body))
                await respond(send, 401, b'{"error":"Unauthorized"}')
                return
        if path == "/redirect":
            body, _ = await self._read_body(receive, record_first_chunk=False)
            self.requests.append(_record(scope, body))
            query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
            location = query.get("to", "/").encode()
            await respond(send, 307, b"", headers=[(b"location", location)])
            return
        if path == "/_fake/stats":
            await respond(send, 200, json.dumps(self.stats()).encode())
            return
        if path == "/firehose":
            body, _ = await self._read_body(receive, record_first_chunk=False)
            self.requests.append(_record(scope, body))
            query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
            await self._firehose(
                receive, send, int(query.get("chunks", "100")), int(query.get("size", "65536"))
            )
            return
        if scope["method"] == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            body, complete = await self._read_body(receive, record_first_chunk=False)
            try:
                parsed = json.loads(body) if complete else None
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("firehose"), int):
                self.requests.append(_record(scope, body))
                size = int(parsed.get("firehose_size", 1024))
                await self._firehose(receive, send, parsed["firehose"], size)
                return
            await super().__call__(scope, _replay(body, complete, receive), send)
            return
        await super().__call__(scope, receive, send)

    def stats(self) -> dict[str, Any]:
        """Counters, for a fake running in another process (``GET /_fake/stats``)."""
        return {
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "aborted": self.aborted,
            "completed": self.completed,
            "generation_body_sizes": [len(r.body) for r in self.generations()],
        }

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return bool(scheme.lower() == "bearer" and token == self.api_key)
        return False

    async def _run_watched(self, receive: Receive, work: Awaitable[None]) -> None:
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight + 1)
        await super()._run_watched(receive, work)

    async def _firehose(self, receive: Receive, send: Send, chunks: int, size: int) -> None:
        self.firehose_sent = 0
        self.firehose_done = False
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )
        filler = b"x" * max(size - 16, 1)

        async def body() -> None:
            for i in range(chunks):
                event = b"data: " + str(i % 10).encode() + filler + b"\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": True})
                self.firehose_sent += len(event)
                # uvicorn's send returns at once after a disconnect: yield, so that the
                # disconnect watcher can end this stream
                await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            self.firehose_done = True

        await self._run_watched(receive, body())


def _record(scope: Scope, body: bytes) -> Any:
    from harness.fake_vllm import Recorded

    return Recorded(
        scope["method"],
        scope["path"],
        scope.get("raw_path") or scope["path"].encode(),
        scope["query_string"],
        list(scope["headers"]),
        body,
    )


def _replay(body: bytes, complete: bool, receive: Receive) -> Receive:
    """A ``receive`` that hands ``body`` out once more, then defers to the real one."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            if not complete:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# --- raw sockets ----------------------------------------------------------------------------


def raw_http(port: int, request: bytes, *, timeout: float = 10.0) -> tuple[int, bytes]:
    """Write ``request`` as is to ``port``; the status (0: none) and everything answered.

    A connection the server resets counts as status 0 with what arrived before the reset; one it
    keeps open ends after ``timeout`` with what arrived by then.
    """
    chunks: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        with contextlib.suppress(ConnectionError):
            sock.sendall(request)
        deadline = time.monotonic() + timeout
        with contextlib.suppress(ConnectionError, TimeoutError):
            while time.monotonic() < deadline:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
    answer = b"".join(chunks)
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, answer


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def http_client(**kwargs: Any) -> httpx.Client:
    return httpx.Client(timeout=kwargs.pop("timeout", 10.0), trust_env=False, **kwargs)
