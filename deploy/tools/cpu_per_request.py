"""Measure the kv-sidecar's CPU per request, the figure its CPU request and limit are sized on.

Runs a real sidecar (``python -m sidecar serve``, counting prompts with the tiny model's local
tokenizer as the base's shared model directory lets it) in front of bench/upstream.py, a fake vLLM
at loopback speed, drives ``--requests`` requests of each shape through it at ``--concurrency``,
and reads the sidecar's own ``process_cpu_seconds_total`` from its metrics port before and after.
The idle cost (the 0.5 s scrape loop) is measured first, over ``--idle-seconds``, and subtracted.
Prints, per shape: requests, wall seconds, CPU seconds, CPU milliseconds per request (idle cost
subtracted) and the cores the sidecar used at that rate.

    .venv/bin/python deploy/tools/cpu_per_request.py --requests 1000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.vllm_cpu import ensure_tokenizer_model, free_port  # noqa: E402
from harness.workload import SidecarProcess, metric_value  # noqa: E402

PROMPT = " ".join(["the KV cache holds the keys and values of every token"] * 20)  # ~200 tokens


def cpu_seconds(sidecar: SidecarProcess) -> float:
    text = httpx.get(sidecar.metrics_url + "/metrics", timeout=10).text
    value = metric_value(text, "process_cpu_seconds_total")
    if value is None:
        raise SystemExit("the sidecar exports no process_cpu_seconds_total")
    return value


def body(shape: str, max_tokens: int) -> tuple[str, dict[str, object]]:
    if shape == "chat-stream":
        return "/v1/chat/completions", {
            "model": "tiny",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    return "/v1/completions", {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": shape == "completions-stream",
    }


async def drive(url: str, shape: str, requests: int, concurrency: int, max_tokens: int) -> int:
    path, payload = body(shape, max_tokens)
    left = requests
    failed = 0
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def worker() -> None:
            nonlocal left, failed
            while left > 0:
                left -= 1
                async with client.stream("POST", path, json=payload) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
                    failed += resp.status_code != 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    args = parser.parse_args()
    model = ensure_tokenizer_model()
    port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "bench.upstream", "--port", str(port), "--model-root", str(model)],
        cwd=ROOT,
    )
    try:
        time.sleep(1.0)
        flags = ("--tokenizer", str(model), "--model-config", str(model), "--policy", "queue")
        with SidecarProcess(f"http://127.0.0.1:{port}", *flags) as sidecar:
            c0, t0 = cpu_seconds(sidecar), time.monotonic()
            time.sleep(args.idle_seconds)
            idle = (cpu_seconds(sidecar) - c0) / (time.monotonic() - t0)
            print(f"idle: {idle * 1000:.1f} ms CPU per second (scrape loop)")
            print("shape, requests, wall s, CPU s, CPU ms/request (idle subtracted), cores")
            for shape in ("completions", "completions-stream", "chat-stream"):
                c0, t0 = cpu_seconds(sidecar), time.monotonic()
                failed = asyncio.run(
                    drive(sidecar.url, shape, args.requests, args.concurrency, args.max_tokens)
                )
                wall, cpu = time.monotonic() - t0, cpu_seconds(sidecar) - c0
                per = (cpu - idle * wall) / args.requests
                print(
                    f"{shape}, {args.requests} ({failed} failed), {wall:.1f}, {cpu:.2f}, "
                    f"{per * 1000:.2f}, {cpu / wall:.2f}"
                )
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)


if __name__ == "__main__":
    main()
