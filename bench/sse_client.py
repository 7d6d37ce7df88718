"""A lean SSE load generator: ``--concurrency`` keep-alive connections, each asking for one
streamed completion after another for ``--duration`` seconds, counting the events it receives.

Raw asyncio (uvloop), HTTP/1.1 with chunked decoding, so that the client costs little CPU next to
the proxy it measures. Prints one JSON object::

    python -m bench.sse_client http://127.0.0.1:8080 --concurrency 32 --events 200 --duration 5
    {"events": 412000, "streams": 2060, "seconds": 5.01, "errors": 0, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from urllib.parse import urlsplit

from bench.common import stream_once


async def _worker(
    host: str,
    port: int,
    request: bytes,
    deadline: float,
    totals: dict[str, float],
    errors: list[str],
) -> None:
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        while time.perf_counter() < deadline:
            try:
                events, chunks, ttfe = await stream_once(reader, writer, request)
            except (RuntimeError, asyncio.IncompleteReadError, ConnectionError) as exc:
                totals["errors"] += 1
                errors.append(str(exc))
                writer.close()
                reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
                continue
            totals["events"] += events
            totals["chunks"] += chunks
            totals["streams"] += 1
            totals["ttfe_sum"] += ttfe
    finally:
        writer.close()


async def run(
    url: str,
    *,
    concurrency: int,
    events: int,
    duration: float,
    chat: bool,
    interval_ms: float | None = None,
    usage: bool = True,
) -> dict[str, float | str]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    if chat:
        body: dict[str, object] = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "stream me some tokens please"}],
        }
    else:
        body = {"model": "tiny", "prompt": "stream me some tokens please"}
    body.update(max_tokens=events, stream=True)
    if usage:  # else no stream_options, as most clients send it
        body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    pacing = "" if interval_ms is None else f"x-bench-interval-ms: {interval_ms}\r\n"
    request = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"{pacing}content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    totals: dict[str, float] = {
        "events": 0,
        "chunks": 0,
        "streams": 0,
        "errors": 0,
        "ttfe_sum": 0.0,
    }
    errors: list[str] = []
    t0 = time.perf_counter()
    deadline = t0 + duration
    await asyncio.gather(
        *(_worker(host, port, request, deadline, totals, errors) for _ in range(concurrency))
    )
    seconds = time.perf_counter() - t0
    streams = totals["streams"]
    return {
        "events": totals["events"],
        "chunks": totals["chunks"],
        "streams": streams,
        "errors": totals["errors"],
        "seconds": seconds,
        "events_per_second": totals["events"] / seconds,
        "mean_time_to_first_event_s": totals["ttfe_sum"] / streams if streams else float("nan"),
        "last_error": errors[-1] if errors else "",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sse_client", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("url")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--events", type=int, default=200, help="max_tokens: events per stream")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--chat", action="store_true", help="/v1/chat/completions")
    parser.add_argument(
        "--interval-ms",
        type=float,
        default=None,
        help="ask the fast fake vLLM to pace events (x-bench-interval-ms)",
    )
    parser.add_argument(
        "--no-usage",
        action="store_true",
        help="send no stream_options (the default asks for the usage chunk)",
    )
    args = parser.parse_args(argv)
    import uvloop

    result = uvloop.run(
        run(
            args.url,
            concurrency=args.concurrency,
            events=args.events,
            duration=args.duration,
            chat=args.chat,
            interval_ms=args.interval_ms,
            usage=not args.no_usage,
        )
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
