"""A lean HTTP/1.1 transport for the shared ``httpx.AsyncClient`` that talks to vLLM.

The sidecar keeps httpx's client API (requests, responses, timeouts, exceptions) but not its
default transport (httpcore), whose CPU per relayed request was several times what the proxy does
itself (BENCHMARKS.md, "Proxy overhead"). This transport does the one thing the sidecar needs,
plain HTTP/1.1 to one upstream on a loopback or pod network, on an asyncio ``Protocol`` with
``httptools``' C parser (the one uvicorn uses):

* a pool of keep-alive connections per origin, capped at ``max_connections``, idle ones closed
  after ``keepalive_expiry`` (shorter than the server's keep-alive, so a reuse does not race its
  close) or as soon as the server is seen to have closed them;
* one retry, on a new connection, of a request whose pooled connection turned out closed before a
  byte of it was sent (never once a byte is out: vLLM may be running it);
* request bodies sent as given (``Content-Length``) or chunked (a streamed body);
* response bodies handed over chunk by chunk, with backpressure: reading from the socket pauses
  while ``max_buffered_bytes`` wait for the consumer, so a slow client slows vLLM's socket, not the
  sidecar's memory;
* httpx's timeouts (connect, read, write, pool) and exceptions as httpcore raises them
  (``ConnectError``, ``ReadError`` for a reset, ``RemoteProtocolError`` for a close mid-answer,
  ``ReadTimeout``, ...), so callers cannot tell the difference.

>>> client = httpx.AsyncClient(transport=UpstreamTransport(max_connections=64))
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import ssl
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator
from typing import cast

import httptools
import httpx

Origin = tuple[str, str, int]
_ResponseHead = tuple[int, list[tuple[bytes, bytes]]]

_CRLF = b"\r\n"


def _timeout(request: httpx.Request, kind: str) -> float | None:
    timeouts = request.extensions.get("timeout") or {}
    value = timeouts.get(kind)
    return None if value is None else float(value)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; one request at a time."""

    def __init__(self, pool: _Pool, max_buffered_bytes: int) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        #: whether any byte of the current request went out (the retry's test)
        self.request_sent = False
        self._max_buffered = max_buffered_bytes
        self._parser: httptools.HttpResponseParser | None = None
        self._head: asyncio.Future[_ResponseHead] | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._writing = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._head_only = False
        self._keep_alive = True

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # bytes while idle: the server broke the protocol
            self._fail(httpx.RemoteProtocolError("unexpected data from the upstream while idle"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid response from the upstream: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self._parser is not None and not self._complete:
            self._fail(self._lost(exc))
        self._can_write.set()

    def _lost(self, exc: Exception | None) -> httpx.TransportError:
        """What the exchange in progress raises when the connection went away, as httpcore would:
        a socket error (a reset) fails the read or write at hand; a clean close is the server
        ending the exchange early."""
        if exc is not None:
            kind = httpx.WriteError if self._writing else httpx.ReadError
            return kind(f"the connection to the upstream failed: {exc!r}")
        if self._head is not None and not self._head.done():
            return httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.RemoteProtocolError(
            "peer closed connection without sending complete message body"
        )

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # --- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self._parser is not None and self._head is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self._headers = []
            return
        self._keep_alive = bool(self._parser.should_keep_alive())
        if not self._head.done():
            self._head.set_result((status, self._headers))
        if self._head_only:
            self._finish()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered >= self._max_buffered and not self._reading_paused:
            assert self.transport is not None
            self.transport.pause_reading()  # backpressure: the consumer is slower than vLLM
            self._reading_paused = True
        self._wake()

    def on_message_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return
        self._finish()

    # --- state -------------------------------------------------------------------------------

    def _finish(self) -> None:
        self._complete = True
        self._parser = None
        self._wake()

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()
        self.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def closed_while_idle(self) -> bool:
        """Whether the server closed (or wrote to) this idle connection, as far as the kernel
        knows: its FIN may wait unprocessed in the socket while the loop is busy. A request
        written there would reach a closed socket and could not be retried."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return True
        sock = self.transport.get_extra_info("socket")
        if sock is None:  # not a socket transport: only connection_lost can tell
            return False
        fd = sock.fileno()
        if fd < 0:
            return True
        poller = select.poll()  # not select.select(): descriptors past 1024 are common here
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))

    # --- one exchange ------------------------------------------------------------------------

    async def send(self, request: httpx.Request) -> _ResponseHead:
        """Write the request and wait for the response head."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        head_future: asyncio.Future[_ResponseHead] = loop.create_future()
        self._head = head_future
        self._headers = []
        self._chunks.clear()
        self._buffered = 0
        self._complete = False
        self._error = None
        self._head_only = request.method == "HEAD"
        self.request_sent = False

        target = request.url.raw_path
        head = [request.method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
        chunked = False
        for name, value in request.headers.raw:
            if name.lower() == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            head += [name, b": ", value, _CRLF]
        head.append(_CRLF)

        self._writing = True
        try:
            async with asyncio.timeout(_timeout(request, "write")):
                await self._send_body(request, head, chunked)
        except BaseException as exc:
            # nobody will await the head now: mark a failure set on it as seen
            if head_future.done():
                if not head_future.cancelled():
                    head_future.exception()
            else:
                head_future.cancel()
            if isinstance(exc, TimeoutError):
                raise httpx.WriteTimeout("timed out sending the request to the upstream") from None
            raise
        finally:
            self._writing = False
        try:
            async with asyncio.timeout(_timeout(request, "read")):
                return await head_future
        except TimeoutError:
            raise httpx.ReadTimeout("vLLM did not answer in time") from None

    async def _send_body(self, request: httpx.Request, head: list[bytes], chunked: bool) -> None:
        stream = request.stream
        if isinstance(stream, httpx.ByteStream):  # a body in memory: one write with the head
            self._write(b"".join([*head, *stream]))
        else:
            # the head goes out before the body's first part is pulled: a retry (which needs
            # request_sent False) never finds a streamed body partly consumed
            self._write(b"".join(head))
            assert isinstance(stream, AsyncIterable)
            async for part in stream:
                if not part:
                    continue
                self._write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                await self._drain()
            if chunked:
                self._write(b"0\r\n\r\n")
        await self._drain()

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            raise self._error or httpx.WriteError("the connection to the upstream is closed")
        transport.write(data)
        # A socket that refuses a write (a reset already received) closes the transport at once
        # with nothing buffered: not one byte of this write went out. Any other outcome may have
        # put bytes on the wire.
        if transport.is_closing() and not transport.get_write_buffer_size():
            raise httpx.WriteError("the upstream closed the connection")
        self.request_sent = True

    async def _drain(self) -> None:
        if not self._can_write.is_set():
            await self._can_write.wait()
        if self._error is not None:
            raise self._error

    async def body(self, read_timeout: float | None) -> AsyncIterator[bytes]:
        """The response body as it arrives: what came while the consumer was busy comes as one
        chunk (as aiohttp's ``iter_any`` does), so a busy relay makes fewer, larger writes."""
        loop = asyncio.get_running_loop()
        while True:
            if self._chunks:
                chunks = self._chunks
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered -= len(chunk)
                if self._reading_paused and self._buffered < self._max_buffered // 2:
                    assert self.transport is not None
                    self._reading_paused = False
                    self.transport.resume_reading()
                yield chunk
                continue
            if self._complete:
                return
            if self._error is not None:
                raise self._error
            self._waiter = loop.create_future()
            try:
                async with asyncio.timeout(read_timeout):
                    await self._waiter
            finally:
                self._waiter = None

    @property
    def reusable(self) -> bool:
        return (
            self._complete
            and self._keep_alive
            and not self.closed
            and self._error is None
            and not self._reading_paused
        )


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, conn: _Connection, read_timeout: float | None) -> None:
        self._conn = conn
        self._read_timeout = read_timeout
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._conn.body(self._read_timeout):
                yield chunk
        except TimeoutError:
            raise httpx.ReadTimeout("timed out reading vLLM's answer") from None

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        # a body not read to its end leaves the connection mid-message: it cannot be reused
        self._conn.pool.release(self._conn)


class _Pool:
    """Connections to one origin: idle ones to reuse, and a cap on how many are open.

    ``open`` counts slots: a connection holds one from the moment it is being opened until it is
    closed. Whatever frees a slot wakes one waiter, and a waiter that leaves (timed out, cancelled)
    after it was woken passes the wake-up on, so no free slot goes unnoticed.
    """

    def __init__(self, origin: Origin, settings: UpstreamTransport) -> None:
        self.origin = origin
        self.settings = settings
        self.idle: deque[_Connection] = deque()
        self.open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweep: asyncio.TimerHandle | None = None

    def forget(self, conn: _Connection) -> None:
        """The connection closed. An idle one is nobody's to release: count it out here."""
        if conn in self.idle:
            self.idle.remove(conn)
            self._free_slot()

    def release(self, conn: _Connection) -> None:
        if conn.reusable and (self._waiters or len(self.idle) < self.settings.max_keepalive):
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
            self._schedule_sweep()
            self._wake_one()
        else:
            conn.close()
            self._free_slot()

    def _free_slot(self) -> None:
        self.open -= 1
        self._wake_one()

    def _schedule_sweep(self) -> None:
        if self._sweep is None:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(self.settings.keepalive_expiry, self._close_expired)

    def _close_expired(self) -> None:
        """Close idle connections past their expiry (oldest at the left), even with no traffic."""
        self._sweep = None
        deadline = time.monotonic() - self.settings.keepalive_expiry
        while self.idle and self.idle[0].idle_since <= deadline:
            self.idle.popleft().close()
            self._free_slot()
        if self.idle:
            self._schedule_sweep()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()  # the most recently used is the least likely to be closing
            if now - conn.idle_since > self.settings.keepalive_expiry or conn.closed_while_idle():
                conn.close()
                self._free_slot()
                continue
            return conn
        return None

    async def acquire(self, request: httpx.Request) -> tuple[_Connection, bool]:
        """A connection for ``request``, and whether it is a reused (pooled) one."""
        try:
            async with asyncio.timeout(_timeout(request, "pool")):
                while True:
                    conn = self._take_idle()
                    if conn is not None:
                        return conn, True
                    if self.open < self.settings.max_connections:
                        break
                    await self._wait()
        except TimeoutError:
            raise httpx.PoolTimeout("no free connection to the upstream") from None
        self.open += 1
        return await self._connect_in_slot(request), False

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                # woken, but leaving in the same tick (a timeout, a cancel): the slot it was
                # woken for is someone else's
                self._wake_one()
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    async def replace(self, stale: _Connection, request: httpx.Request) -> _Connection:
        """A new connection in the slot of one the server had closed."""
        stale.close()
        return await self._connect_in_slot(request)

    async def _connect_in_slot(self, request: httpx.Request) -> _Connection:
        try:
            return await self._connect(request)
        except BaseException:
            self._free_slot()
            raise

    async def _connect(self, request: httpx.Request) -> _Connection:
        scheme, host, port = self.origin
        loop = asyncio.get_running_loop()
        context = self.settings.ssl_context if scheme == "https" else None
        try:
            async with asyncio.timeout(_timeout(request, "connect")):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, self.settings.max_buffered_bytes),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context is not None else None,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        return conn

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        while self.idle:
            self.idle.pop().close()


class UpstreamTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 to the upstream for ``httpx.AsyncClient(transport=...)``.

    >>> transport = UpstreamTransport(max_connections=64, keepalive_expiry=2.0)
    >>> client = httpx.AsyncClient(transport=transport)  # or transport.handle_async_request()
    """

    def __init__(
        self,
        *,
        max_connections: int = 1024,
        max_keepalive: int = 256,
        keepalive_expiry: float = 2.0,
        max_buffered_bytes: int = 256 * 1024,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.max_keepalive = max_keepalive
        self.keepalive_expiry = keepalive_expiry
        self.max_buffered_bytes = max_buffered_bytes
        self._ssl = ssl_context
        self._pools: dict[Origin, _Pool] = {}

    @property
    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` and return its response once the head is in; the body streams.

        A request whose pooled connection the server had closed, found out before a byte of
        the request went out, is sent once more on a new connection; in every other failure the
        error is raised (a request that may have reached vLLM is never sent twice).
        """
        url = request.url
        scheme = url.scheme
        if scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"unsupported scheme {scheme!r}")
        port = url.port or (443 if scheme == "https" else 80)
        origin = (scheme, url.host, port)
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _Pool(origin, self)
        conn, reused = await pool.acquire(request)
        while True:
            try:
                status, headers = await conn.send(request)
                break
            except httpx.TransportError:
                if reused and not conn.request_sent:
                    reused = False  # once: the new connection is not retried
                    conn = await pool.replace(conn, request)
                    continue
                pool.release(conn)  # not reusable: closed by release
                raise
            except BaseException:
                pool.release(conn)
                raise
        stream = _ResponseStream(conn, _timeout(request, "read"))
        return httpx.Response(
            status, headers=headers, stream=stream, extensions={"http_version": b"HTTP/1.1"}
        )

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
