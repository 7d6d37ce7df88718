"""Workloads against a real vLLM or the sidecar: prompts of exact token length, bursts, figures.

Shared by the tests, the demo and the benchmarks so all three send the same traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# metric_value is imported from here by the tests and the benchmarks too
from harness.exposition import metric_value
from harness.local import CACHE, ROOT, free_port
from harness.stats import percentile
from harness.tiny_model import WORDS


def make_prompts(model_dir: Path, count: int, tokens: int, *, seed: int = 0) -> list[str]:
    """``count`` distinct prompts of exactly ``tokens`` tokens (BOS included) for /v1/completions.

    Each starts with its own words so vLLM's prefix cache shares nothing between them.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    prompts: list[str] = []
    tries = 0
    while len(prompts) < count:
        tries += 1
        if tries > 100 * count:  # a round trip fails now and then, not every time
            raise RuntimeError(f"{model_dir}'s tokenizer: no {tokens}-token prompt round-trips")
        # every word is at least one token: `tokens` words always reach the length, then cut
        words = [str(rng.randint(0, 10**9)), *(rng.choice(WORDS) for _ in range(tokens))]
        ids = tok(" ".join(words))["input_ids"][:tokens]
        text = tok.decode(ids, skip_special_tokens=True)
        if len(tok(text)["input_ids"]) == tokens:  # a cut inside a word may not round-trip
            prompts.append(text)
    return prompts


_MODEL_NAMES: dict[str, str] = {}


async def model_name(client: httpx.AsyncClient, url: str) -> str:
    """The model ``url`` serves (``/v1/models``, relayed by a sidecar too), asked once per URL."""
    if url not in _MODEL_NAMES:
        resp = await client.get(url + "/v1/models")
        resp.raise_for_status()
        _MODEL_NAMES[url] = str(resp.json()["data"][0]["id"])
    return _MODEL_NAMES[url]


@dataclass
class Result:
    status: int
    seconds: float
    ttft: float | None = None
    completion_tokens: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None


async def one_completion(
    client: httpx.AsyncClient,
    url: str,
    prompt: str,
    *,
    max_tokens: int,
    stream: bool,
    ignore_eos: bool = True,
    model: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Result:
    """One completion; ``model`` defaults to the name ``url`` serves (see :func:`model_name`)."""
    body: dict[str, Any] = {
        "model": model or await model_name(client, url),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "temperature": 0.0,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra or {})
    t0 = time.perf_counter()
    try:
        if not stream:
            resp = await client.post(url + "/v1/completions", json=body)
            data = resp.json() if resp.status_code == 200 else {}
            tokens = int(data.get("usage", {}).get("completion_tokens", 0))
            return Result(
                resp.status_code, time.perf_counter() - t0, None, tokens, dict(resp.headers)
            )
        ttft: float | None = None
        tokens = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Result(
                    resp.status_code, time.perf_counter() - t0, None, 0, dict(resp.headers)
                )
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and ttft is None:
                    ttft = time.perf_counter() - t0
                if '"usage"' in line and '"completion_tokens"' in line:
                    import json

                    usage = json.loads(line[6:]).get("usage") or {}
                    tokens = int(usage.get("completion_tokens", tokens))
        return Result(200, time.perf_counter() - t0, ttft, tokens, dict(resp.headers))
    except httpx.HTTPError as exc:
        return Result(0, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}")


async def burst(
    url: str,
    prompts: Sequence[str],
    *,
    max_tokens: int,
    stream: bool = True,
    ignore_eos: bool = True,
    request_timeout: float = 600.0,
    model: str | None = None,
    extra: dict[str, Any] | None = None,
) -> list[Result]:
    """Send every prompt at once and wait for all the answers (``model``: as served, default;
    ``extra``: fields every body gets, over the defaults)."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=request_timeout, limits=limits) as client:
        model = model or await model_name(client, url)
        return list(
            await asyncio.gather(
                *(
                    one_completion(
                        client,
                        url,
                        p,
                        max_tokens=max_tokens,
                        stream=stream,
                        ignore_eos=ignore_eos,
                        model=model,
                        extra=extra,
                    )
                    for p in prompts
                )
            )
        )


def vllm_preemptions(url: str, *, settle_seconds: float = 30.0) -> float:
    """vLLM's preemption counter once it is idle and the counter has stopped moving.

    vLLM publishes some counters a little after the step that changed them, so a reading taken
    right after a burst can still move.
    """
    deadline = time.monotonic() + settle_seconds
    last: float | None = None
    while True:
        text = httpx.get(url + "/metrics", timeout=5).text
        value = metric_value(text, "vllm:num_preemptions_total") or 0.0
        busy = (metric_value(text, "vllm:num_requests_running") or 0) + (
            metric_value(text, "vllm:num_requests_waiting") or 0
        )
        if (value == last and not busy) or time.monotonic() > deadline:
            return value
        last = value
        time.sleep(0.5)


def summarize(results: Sequence[Result], seconds: float) -> dict[str, float]:
    ok = [r for r in results if r.status == 200]
    latencies = sorted(r.seconds for r in ok)
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    return {
        "completed": len(ok),
        "refused": sum(1 for r in results if r.status == 429),
        "failed": sum(1 for r in results if r.status not in (200, 429)),
        "goodput_tokens_per_s": sum(r.completion_tokens for r in ok) / seconds if seconds else 0,
        "p50_latency_s": percentile(latencies, 0.5),
        "p99_latency_s": percentile(latencies, 0.99),
        "p50_ttft_s": percentile(ttfts, 0.5),
        "p99_ttft_s": percentile(ttfts, 0.99),
    }


class SidecarProcess:
    """``kv-sidecar serve`` as a real process on free loopback ports."""

    def __init__(
        self,
        upstream: str,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> None:
        self.upstream = upstream
        self.args = list(args)
        self.port = free_port()
        self.metrics_port = free_port()
        self.env = env or {}
        self.cwd = cwd  # where `python -m sidecar` runs (and so which package it imports)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = CACHE / "logs" / f"sidecar-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def start(self, *, wait_ready: bool = True, timeout: float = 60.0) -> SidecarProcess:
        if self.proc is not None and self.proc.poll() is None:
            # already running (``with sc.start():`` enters after starting it): a second
            # process would find its ports taken and exit, and the first one would outlive
            # the test unstopped
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--upstream",
            self.upstream,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            *self.args,
        ]
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env={**os.environ, **self.env},
            )
        if wait_ready:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop()  # never leave a process behind a failed start
                raise
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.metrics_url + "/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"sidecar not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def state(self) -> dict[str, Any]:
        return dict(httpx.get(self.metrics_url + "/state", timeout=5).json())

    def metrics(self) -> str:
        return httpx.get(self.metrics_url + "/metrics", timeout=5).text

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
