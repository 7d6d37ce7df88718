"""The HTTP/1.1 transport under the shared httpx client: pooling, framing, backpressure, errors.

A raw asyncio server plays vLLM here, so each test controls the bytes on the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from sidecar.upstream import UpstreamTransport

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
            await it.__anext__()
            await asyncio.sleep(0.5)  # a client that does not read
            # kernel socket buffers hold a few MiB at most; without backpressure it would be 25
            assert sent < 12 * 1024 * 1024
            total = 65536
            async for chunk in it:
                total += len(chunk)
        assert total == 400 * 65536


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
