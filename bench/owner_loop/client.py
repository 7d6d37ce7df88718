"""The benchmark's client: an open-loop Poisson stream of completions, raw HTTP/1.1 on uvloop, run
in a process of its own (``python -m bench.owner_loop --client PLAN``).

Arrivals do not wait for answers (open loop): each is sent when its time comes, on an idle
kept-alive connection when there is one (the most recently used first), else on a new one. The
rate rises linearly over the ramp, then holds for the window. A streamed answer is read in raw
reads until its terminal chunk (no per-event parsing: the client's CPU is the point); a
non-streamed one by its ``content-length``. The process prints one JSON line: one record per
request, ``[streamed, scheduled, sent, head, done, status]`` in seconds from the plan's start
(status 0: the connection failed, ``errors`` counts why; -1: still under way when the drain
ended), and the connections it opened.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from bench.common import PROMPT

#: distinct prompts sent in turn (the counters' caches see a few shapes, as in production)
PROMPTS = 32
#: tokens of a non-streamed answer (the fake answers it at once)
PLAIN_MAX_TOKENS = 16
#: an idle connection older than this is closed rather than reused (the sidecar keeps 30 s)
IDLE_MAX_S = 20.0
_TERMINAL = b"\r\n0\r\n\r\n"


@dataclass
class Plan:
    """What one client process sends: ``rate`` per second after a linear ramp of ``ramp_s``
    from ``start`` (``time.monotonic()``, the same clock in every process), for ``window_s``;
    a share ``stream_share`` of them streamed, ``stream_events`` tokens at ``interval_ms``."""

    url: str
    rate: float
    stream_share: float
    stream_events: int
    interval_ms: float
    start: float
    ramp_s: float
    window_s: float
    seed: int
    drain_s: float

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: str) -> Plan:
        return cls(**json.loads(text))


def requests(plan: Plan) -> tuple[list[bytes], list[bytes]]:
    """The raw requests, streamed and plain, one per prompt."""
    parts = urlsplit(plan.url)
    host = f"{parts.hostname}:{parts.port}"
    streamed: list[bytes] = []
    plain: list[bytes] = []
    for i in range(PROMPTS):
        prompt = f"{PROMPT} (variant {i})"
        for out, body, extra in (
            (
                streamed,
                {"prompt": prompt, "max_tokens": plan.stream_events, "stream": True},
                f"x-bench-interval-ms: {plan.interval_ms:g}\r\n",
            ),
            (plain, {"prompt": prompt, "max_tokens": PLAIN_MAX_TOKENS}, ""),
        ):
            payload = json.dumps({"model": "tiny", "temperature": 0.0, **body}).encode()
            out.append(
                (
                    f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n"
                    f"content-type: application/json\r\n{extra}"
                    f"content-length: {len(payload)}\r\n\r\n"
                ).encode()
                + payload
            )
    return streamed, plain


class Pool:
    """Kept-alive connections to one host, the most recently used first."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []
        self.opened = 0

    async def get(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        now = time.monotonic()
        while self.idle:
            reader, writer, since = self.idle.pop()
            if now - since < IDLE_MAX_S and not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        self.opened += 1
        return reader, writer

    def put(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.idle.append((reader, writer, time.monotonic()))

    def close(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()
        self.idle.clear()


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, float, bool, float]:
    """Send ``request``, read its whole answer: (status, the head's arrival, keep-alive, and
    for a chunked answer the longest wait between two reads of it after the head)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    at = time.monotonic()
    status = int(head[9:12])
    lower = head.lower()
    gap = 0.0
    if b"transfer-encoding: chunked" in lower:
        tail = b"\r\n"
        last = at
        while True:
            data = await reader.read(65536)
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            if not data:
                raise ConnectionError("closed inside a chunked answer")
            tail = (tail + data[-7:])[-7:]
            if tail == _TERMINAL:
                break
    else:
        length = int(lower.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        await reader.readexactly(length)
    return status, at, b"connection: close" not in lower, gap


async def drive(plan: Plan) -> dict[str, Any]:
    """Send the plan's arrivals and wait (up to ``drain_s``) for their answers."""
    parts = urlsplit(plan.url)
    pool = Pool(parts.hostname or "127.0.0.1", parts.port or 80)
    streamed, plain = requests(plan)
    records: list[list[float]] = []
    errors: dict[str, int] = {}
    last_error: dict[str, str] = {}
    t0 = plan.start

    async def one(stream: bool, scheduled: float, request: bytes) -> None:
        sent = time.monotonic()
        head = done = gap = 0.0
        status = 0
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await pool.get()
            status, head_at, keep, gap = await exchange(reader, writer, request)
            head, done = head_at - t0, time.monotonic() - t0
            if keep:
                pool.put(reader, writer)
            else:
                writer.close()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            kind = type(e).__name__
            errors[kind] = errors.get(kind, 0) + 1
            last_error[kind] = str(e)[:300]
            done = time.monotonic() - t0
            if writer is not None:
                writer.close()
        except asyncio.CancelledError:  # still under way when the drain ended: status -1
            records.append([int(stream), scheduled - t0, sent - t0, 0.0, -1.0, -1, 0.0])
            raise
        records.append([int(stream), scheduled - t0, sent - t0, head, done, status, gap])

    rng = random.Random(plan.seed)
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    end = t0 + plan.ramp_s + plan.window_s
    t, k = t0, 0
    if t0 > time.monotonic():
        await asyncio.sleep(t0 - time.monotonic())
    while True:
        ramp = min(1.0, max(0.02, (t - t0) / plan.ramp_s)) if plan.ramp_s > 0 else 1.0
        t += rng.expovariate(plan.rate * ramp)
        if t >= end:
            break
        now = time.monotonic()
        if t > now:
            await asyncio.sleep(t - now)
        stream = rng.random() < plan.stream_share
        request = (streamed if stream else plain)[k % PROMPTS]
        k += 1
        task = loop.create_task(one(stream, t, request))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    unfinished = 0
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=plan.drain_s)
        unfinished = len(pending)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    pool.close()
    return {
        "records": [[round(x, 5) for x in r] for r in records],
        "errors": errors,
        "last_error": last_error,
        "unfinished": unfinished,
        "connections_opened": pool.opened,
    }


def client_main(plan_json: str) -> None:
    import uvloop

    out = uvloop.run(drive(Plan.loads(plan_json)))
    print(json.dumps(out, separators=(",", ":")), flush=True)
