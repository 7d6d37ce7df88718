"""The HTTP/1.1 transport under the shared httpx client: pooling, framing, backpressure, errors,
and the one retry of a request that never left on a stale pooled connection.

A raw asyncio server plays vLLM here, so each test controls the bytes on the wire; where a test
needs the server to close a connection while the client's event loop does not run (so that the
close waits in the socket, unprocessed), a blocking server in a thread plays it instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from sidecar.http.transport import UpstreamTransport
from sidecar.http.transport.pool import _Connection

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _on_connect(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.lower(): v for k, _, v in (line.partition(b": ") for line in lines[1:] if line)}
    body = b""
    if b"content-length" in headers:
        body = await r.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding") == b"chunked":
        while True:
            size = int((await r.readuntil(b"\r\n"))[:-2], 16)
            chunk = await r.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    return lines[0], headers, body


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def echo_forever(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while True:
        line, _, body = await read_request(r)
        w.write(ok(line + b"|" + body))
        await w.drain()


def client(**kw: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=UpstreamTransport(**kw), timeout=5)  # type: ignore[arg-type]


async def test_keep_alive_reuses_one_connection_and_bodies_are_framed() -> None:
    srv = Server(echo_forever)
    async with srv as url, client() as c:
        for i in range(5):
            r = await c.post(url + f"/v1/x?i={i}", content=b"abc")
            assert r.status_code == 200 and r.content == f"POST /v1/x?i={i} HTTP/1.1|abc".encode()

        async def chunks() -> AsyncIterator[bytes]:
            for part in (b"he", b"", b"llo"):
                yield part

        r = await c.post(url + "/stream", content=chunks())
        assert r.content.endswith(b"|hello")
    assert srv.connections == 1


async def test_idle_connections_expire_and_concurrency_opens_more() -> None:
    srv = Server(echo_forever)
    async with srv as url, client(keepalive_expiry=0.05) as c:
        await c.get(url + "/a")
        await asyncio.sleep(0.1)
        await c.get(url + "/b")  # the idle one expired: a fresh connection
        assert srv.connections == 2
        await asyncio.gather(*(c.get(url + f"/{i}") for i in range(4)))
        assert srv.connections >= 3


async def test_max_connections_makes_requests_wait_then_pool_timeout() -> None:
    gate = asyncio.Event()

    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await gate.wait()
        w.write(ok(b"done"))
        await w.drain()

    srv = Server(slow)
    async with srv as url:
        c = httpx.AsyncClient(
            transport=UpstreamTransport(max_connections=1), timeout=httpx.Timeout(5, pool=0.2)
        )
        async with c:
            first = asyncio.create_task(c.get(url + "/1"))
            await asyncio.sleep(0.05)
            with pytest.raises(httpx.PoolTimeout):
                await c.get(url + "/2")
            gate.set()
            assert (await first).content == b"done"


async def test_backpressure_pauses_reading_while_the_consumer_is_slow() -> None:
    sent = 0

    async def firehose(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        block = b"x" * 65536
        for _ in range(400):  # 25 MiB if nobody pushed back
            w.write(b"%x\r\n%s\r\n" % (len(block), block))
            await w.drain()
            sent += len(block)
        w.write(b"0\r\n\r\n")
        await w.drain()

    srv = Server(firehose)
    async with srv as url, client(max_buffered_bytes=128 * 1024) as c:
        async with c.stream("GET", url + "/big") as resp:
            it = resp.aiter_raw()
            total = len(await it.__anext__())
            await asyncio.sleep(0.5)  # a client that does not read
            # kernel socket buffers hold a few MiB at most; without backpressure it would be 25
            assert sent < 12 * 1024 * 1024
            async for chunk in it:
                total += len(chunk)
        assert total == 400 * 65536


async def test_what_arrived_while_the_consumer_was_busy_comes_as_one_chunk() -> None:
    events = [b"data: %d\n\n" % k for k in range(5)]

    async def burst(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        w.write(b"%x\r\n%s\r\n" % (len(events[0]), events[0]))
        await w.drain()
        await asyncio.sleep(0.2)
        for event in events[1:]:  # four chunks, each its own write, while the client sleeps
            w.write(b"%x\r\n%s\r\n" % (len(event), event))
            await w.drain()
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.6)
        w.write(b"0\r\n\r\n")
        await w.drain()

    srv = Server(burst)
    async with srv as url, client() as c:
        async with c.stream("GET", url + "/sse") as resp:
            it = resp.aiter_raw()
            assert await it.__anext__() == events[0]
            await asyncio.sleep(0.5)  # busy while the other four arrive
            rest = [chunk async for chunk in it]
    assert rest == [b"".join(events[1:])]


async def test_errors_map_to_httpx_exceptions() -> None:
    async with client() as c:
        with pytest.raises(httpx.ConnectError):
            await c.get("http://127.0.0.1:9/nothing-listens")

    async def hang_up(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)

    async with Server(hang_up) as url, client() as c:
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await c.get(url + "/")

    async def truncated(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await w.drain()

    async with Server(truncated) as url, client() as c:
        with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
            await c.get(url + "/")

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await asyncio.sleep(5)

    async with Server(silent) as url:
        c = httpx.AsyncClient(transport=UpstreamTransport(), timeout=httpx.Timeout(5, read=0.1))
        async with c:
            with pytest.raises(httpx.ReadTimeout):
                await c.get(url + "/")

    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"NOT HTTP AT ALL\r\n\r\n")
        await w.drain()

    async with Server(garbage) as url, client() as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.get(url + "/")


async def test_head_no_content_and_interim_responses() -> None:
    async def answers(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            line, _, _ = await read_request(r)
            if line.startswith(b"HEAD"):
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n")
            elif b"/204" in line:
                w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            else:
                w.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"after 100", b"x-a: 1\r\n"))
            await w.drain()

    srv = Server(answers)
    async with srv as url, client() as c:
        head = await c.head(url + "/")
        assert head.status_code == 200 and head.headers["content-length"] == "1234"
        assert (await c.get(url + "/204")).status_code == 204
        r = await c.get(url + "/")
        assert r.status_code == 200 and r.content == b"after 100" and r.headers["x-a"] == "1"
        assert (await c.head(url + "/")).status_code == 200
    assert srv.connections == 1  # all on one keep-alive connection


async def test_an_abandoned_body_closes_its_connection() -> None:
    async def slow_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            line, _, _ = await read_request(r)
            if b"/slow" in line:
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello")
                await w.drain()
                await asyncio.sleep(0.3)
                w.write(b"world")
            else:
                w.write(ok(b"fast"))
            await w.drain()

    srv = Server(slow_body)
    async with srv as url, client() as c:
        async with c.stream("GET", url + "/slow") as resp:
            async for _ in resp.aiter_raw():
                break  # left mid-message: the connection cannot carry another request
        assert (await c.get(url + "/next")).content == b"fast"
    assert srv.connections == 2


def reset(w: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (RST), not a FIN: what a crashed or killed server leaves."""
    sock = w.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


# --- connection resets surface as httpx.ReadError ----------------------------------------------


async def test_a_reset_before_the_answer_raises_read_error() -> None:
    async def crash(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        reset(w)

    async with Server(crash) as url, client() as c:
        with pytest.raises(httpx.ReadError):
            await c.get(url + "/")


async def test_a_reset_mid_body_raises_read_error_to_the_reader() -> None:
    got_first = asyncio.Event()

    async def crash_mid_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst")
        await w.drain()
        await got_first.wait()
        reset(w)

    async with Server(crash_mid_body) as url, client() as c:
        async with c.stream("GET", url + "/") as resp:
            chunks = resp.aiter_raw()
            assert await chunks.__anext__() == b"first"
            got_first.set()
            with pytest.raises(httpx.ReadError):
                await chunks.__anext__()


# --- the pool's slots ------------------------------------------------------------------------


async def hold_or_answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """``/hold`` gets half an answer and then nothing (its connection stays busy); others "ok"."""
    while True:
        line, _, _ = await read_request(r)
        if b"/hold" in line:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
            await w.drain()
            await r.read()  # until the client closes
            return
        w.write(ok(b"ok"))
        await w.drain()


async def test_a_waiter_that_times_out_as_it_is_woken_passes_the_slot_on() -> None:
    async with Server(hold_or_answer) as url:
        transport = UpstreamTransport(max_connections=1)
        async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5, pool=1)) as c:
            hold = await c.send(c.build_request("GET", url + "/hold"), stream=True)
            first = asyncio.create_task(c.get(url + "/first", timeout=httpx.Timeout(5, pool=0.1)))
            second = asyncio.create_task(c.get(url + "/second"))
            await asyncio.sleep(0.02)  # both wait for the one slot, /first ahead
            time.sleep(0.15)  # noqa: ASYNC251 (a busy loop: /first's pool timeout passes ...
            await asyncio.sleep(0)  # ... unnoticed; its timer runs in the same tick as this step,
            await hold.aclose()  # in which the slot frees and wakes /first: woken, timed out
            with pytest.raises(httpx.PoolTimeout):
                await first
            assert (await second).content == b"ok"  # the wake-up went on, not lost


async def test_closing_expired_idle_connections_wakes_a_waiter() -> None:
    async with Server(echo_forever) as url:
        transport = UpstreamTransport(max_connections=1, keepalive_expiry=0.1)
        async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5, pool=1)) as c:
            await c.get(url + "/a")  # the one connection, now idle; the sweep is due in 0.1 s
            [pool] = transport._pools.values()
            # a waiter while a connection sits idle: the state a lost wake-up leaves (the test
            # above), made here by hand so that only the sweep can free the slot
            conn = pool.idle.pop()
            waiting = asyncio.create_task(c.get(url + "/b"))
            await asyncio.sleep(0.01)
            assert not waiting.done()
            pool.idle.append(conn)
            r = await waiting  # woken by the sweep, not by its 1 s pool timeout
            assert r.status_code == 200 and pool.open == 1


# --- the one retry: only for a request that never left ----------------------------------------


class ThreadServer:
    """A blocking HTTP/1.1 server in a thread: it closes connections while the test blocks the
    client's event loop, so that the close waits in the client's socket, unprocessed, as it does
    when a busy loop reuses a pooled connection. Records every request as (connection, line)."""

    def __init__(self, close_first: str) -> None:
        self.close_first = close_first  # "fin" or "rst": how the first connection ends
        self.requests: list[tuple[int, bytes]] = []
        self.go = threading.Event()  # the test says when the first connection closes
        self.closed = threading.Event()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.go.set()
        self._thread.join(5)
        self._listener.close()

    def _serve(self) -> None:
        index = 0
        while not self._stop.is_set() and index < 2:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            with sock:
                sock.settimeout(0.1)
                if index == 0:
                    self._answer(sock, index)
                    self.go.wait(5)
                    if self.close_first == "rst":
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    sock.close()
                    self.closed.set()
                else:
                    while self._answer(sock, index):
                        pass
            index += 1

    def _answer(self, sock: socket.socket, index: int) -> bool:
        """Read one request (head and whole body), record it and answer "ok"."""
        data = b""
        while not self._stop.is_set():
            head, sep, body = data.partition(b"\r\n\r\n")
            lower = head.lower()
            if sep and (
                (b"chunked" in lower and body.endswith(b"0\r\n\r\n"))
                or (
                    b"content-length" in lower
                    and len(body) >= int(lower.split(b"content-length: ")[1].split(b"\r\n")[0])
                )
            ):
                self.requests.append((index, head.split(b"\r\n", 1)[0]))
                sock.sendall(ok(b"ok"))
                return True
            try:
                part = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return False
            if not part:
                return False
            data += part
        return False

    def close_first_connection(self) -> None:
        """Close it and return once the client's kernel has the FIN or RST, the loop blocked."""
        self.go.set()
        assert self.closed.wait(5)
        time.sleep(0.05)


async def test_a_pooled_connection_the_server_closed_is_not_reused() -> None:
    srv = ThreadServer("fin")
    with srv as url:
        async with client() as c:
            assert (await c.post(url + "/1", content=b"x")).content == b"ok"
            srv.close_first_connection()  # its FIN is in the socket; the loop has not seen it
            assert (await c.post(url + "/2", content=b"x")).content == b"ok"
    assert srv.requests == [(0, b"POST /1 HTTP/1.1"), (1, b"POST /2 HTTP/1.1")]


@pytest.fixture
def unseen_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's close arrives just after the pool's check of an idle connection."""
    monkeypatch.setattr(_Connection, "closed_while_idle", lambda self: False)


@pytest.mark.usefixtures("unseen_close")
async def test_a_request_a_reset_pooled_connection_refused_is_sent_once_more() -> None:
    srv = ThreadServer("rst")
    with srv as url:
        async with client() as c:
            await c.post(url + "/1", content=b"x")
            srv.close_first_connection()  # the socket refuses the next write: nothing leaves

            async def body() -> AsyncIterator[bytes]:
                yield b"streamed, "  # not pulled before the head went out: safe to send again
                yield b"once"

            assert (await c.post(url + "/2", content=body())).content == b"ok"
    assert srv.requests == [(0, b"POST /1 HTTP/1.1"), (1, b"POST /2 HTTP/1.1")]


@pytest.mark.usefixtures("unseen_close")
async def test_a_request_written_to_a_closed_connection_is_never_sent_twice() -> None:
    srv = ThreadServer("fin")
    with srv as url:
        async with client() as c:
            await c.post(url + "/1", content=b"x")
            srv.close_first_connection()  # half-closed: the kernel takes the write, vLLM might
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
                await c.post(url + "/2", content=b"x")
    assert srv.requests == [(0, b"POST /1 HTTP/1.1")]  # no second connection: no retry


async def test_a_fresh_connection_is_not_retried() -> None:
    async def crash(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        reset(w)

    srv = Server(crash)
    async with srv as url, client() as c:
        with pytest.raises(httpx.ReadError):
            await c.post(url + "/", content=b"x")
    assert srv.connections == 1


async def test_a_request_cancelled_at_any_await_gives_its_slot_back() -> None:
    """httpcore 1.0.9, under the test clients' httpx, can keep a pool slot for good when a
    request is cancelled while its connection is being made (encode/httpcore#1093: a CI run's
    soak lost every slot of its client that way). The sidecar's own pool must not: requests on
    a pool of two slots, kept full by two slow ones, are cancelled after 0, 1, 2, ... event-loop
    ticks (waiting for a slot, connecting, sending, reading the head, reading the body), and
    afterwards every slot is free again and two requests at once are served."""
    gate = asyncio.Event()

    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            line, _, _ = await read_request(r)
            if b"/slow" in line:
                await gate.wait()
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
            await w.drain()
            await asyncio.sleep(0)
            w.write(b"cd")
            await w.drain()

    async def cancelled_after(c: httpx.AsyncClient, url: str, ticks: int) -> None:
        task = asyncio.create_task(c.get(url + "/fast"))
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    transport = UpstreamTransport(max_connections=2)
    srv = Server(answer)
    async with srv as url:
        async with httpx.AsyncClient(transport=transport, timeout=5) as c:
            slow = [asyncio.create_task(c.get(url + "/slow")) for _ in range(2)]
            for ticks in range(8):  # every slot taken: cancelled while waiting for one
                await cancelled_after(c, url, ticks)
            gate.set()
            assert [(await t).content for t in slow] == [b"abcd", b"abcd"]
            for ticks in range(40):  # free slots: cancelled connecting, sending, reading
                await cancelled_after(c, url, ticks)
            (pool,) = transport._pools.values()
            assert pool.open == len(pool.idle) <= 2, (pool.open, len(pool.idle))
            quick = httpx.Timeout(5, pool=1.0)
            both = await asyncio.gather(*(c.get(url + "/fast", timeout=quick) for _ in range(2)))
            assert [r.content for r in both] == [b"abcd", b"abcd"]
