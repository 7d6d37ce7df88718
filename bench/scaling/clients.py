"""The scaling benchmark's light clients, each run in its own process so that its CPU is not
the sidecar's: a closed-loop sender of non-streamed completions and a holder of open streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.common import stream_once
from harness.bench_util import ROOT, ProcStat
from harness.stats import percentile


async def send_loop(
    url: str, bodies: Sequence[bytes], connections: int, seconds: float
) -> dict[str, Any]:
    """``connections`` keep-alive connections, each sending non-streamed completions (``bodies``
    in turn) one after another until ``seconds`` have passed; a request under way then is
    finished, never abandoned."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests = [
        (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        + body
        for body in bodies
    ]
    latencies: list[float] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def worker(k: int) -> None:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
        i = k
        try:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                try:
                    await stream_once(reader, writer, requests[i % len(requests)])
                except (RuntimeError, asyncio.IncompleteReadError, ConnectionError) as exc:
                    errors.append(str(exc)[:300])
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
                    continue
                latencies.append(time.perf_counter() - start)
                i += connections
        finally:
            writer.close()

    await asyncio.gather(*(worker(k) for k in range(connections)))
    wall = time.perf_counter() - t0
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "seconds": wall,
        "rps": len(latencies) / wall,
        "p50_us": percentile(latencies, 0.5) * 1e6,
        "p99_us": percentile(latencies, 0.99) * 1e6,
        "last_error": errors[-1] if errors else "",
    }


async def hold_streams(url: str, n: int, max_tokens: int, interval_ms: float) -> dict[str, Any]:
    """Open ``n`` streamed completions at once and read them until stdin closes. Prints one
    ``ready`` line with what opened once every answer's head is in, then the totals."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "hold this stream open",
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"content-type: application/json\r\nx-bench-interval-ms: {interval_ms:g}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    st: dict[str, Any] = {"opened": 0, "refused": 0, "ended": 0, "events": 0, "error": ""}
    writers: list[asyncio.StreamWriter] = []
    all_heads = asyncio.Event()

    def answered(ok: bool, error: str = "") -> None:
        st["opened" if ok else "refused"] += 1
        if error:
            st["error"] = error
        if st["opened"] + st["refused"] >= n:
            all_heads.set()

    async def one() -> None:
        try:
            reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        except OSError as exc:
            answered(False, str(exc))
            return
        writers.append(writer)
        writer.write(request)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            answered(False, str(exc))
            return
        if head.split(b" ", 2)[1] != b"200":
            answered(False, head[:200].decode(errors="replace"))
            return
        answered(True)
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                st["events"] += data.count(b"data:")
        st["ended"] += 1

    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    t0 = time.perf_counter()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(all_heads.wait(), 120)
    st["open_s"] = time.perf_counter() - t0
    print("ready " + json.dumps(st), flush=True)
    events0, t1 = st["events"], time.perf_counter()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    seconds = time.perf_counter() - t1
    st["events_per_s"] = (st["events"] - events0) / seconds if seconds else math.nan
    for task in tasks:
        task.cancel()
    for writer in writers:
        writer.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    return st


class HeldStreams:
    """``hold_streams`` in its own process."""

    def __init__(self, url: str, n: int, max_tokens: int, interval_ms: float) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.scaling",
                "--hold-streams",
                url,
                "--streams",
                str(n),
                "--max-tokens",
                str(max_tokens),
                "--interval-ms",
                str(interval_ms),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.proc.kill()
            raise RuntimeError(f"stream holder failed: {line!r}")
        self.ready: dict[str, Any] = json.loads(line.split(" ", 1)[1])

    def cpu_seconds(self) -> float:
        return ProcStat(self.proc.pid).cpu_seconds()

    def stop(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        out = self.proc.stdout.read()
        self.proc.wait(60)
        return dict(json.loads(out.strip().splitlines()[-1]))


def send(url: str, files: Sequence[Path], connections: int, seconds: float) -> dict[str, Any]:
    """``send_loop`` in its own process (``--send``), run to its end."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.scaling",
            "--send",
            url,
            "--connections",
            str(connections),
            "--seconds",
            str(seconds),
            "--body-files",
            *map(str, files),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bench client failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
