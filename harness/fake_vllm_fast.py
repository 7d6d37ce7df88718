"""The fake vLLM at loopback speed, for the benchmarks: :class:`~harness.fake_vllm.FakeVllm`
served by a raw asyncio protocol (uvloop + httptools, no framework, no request log), so that the
upstream costs as little as possible and the proxy in front of it is what a benchmark measures.

The same fake, so the same formats and rules (:mod:`harness.vllm_formats`): ``GET /v1/models``
(``root`` = ``--model-root``), ``GET /metrics`` (the fixture's text, ``num_gpu_blocks`` =
``--num-gpu-blocks`` so that admission never blocks, an empty KV cache), ``POST /tokenize``,
``POST /v1/completions`` and ``/v1/chat/completions`` (JSON, or SSE with ``stream: true``) and
``GET /health``; the tests' extra routes for the proxy's pass-through are not served. What the
benchmarks need besides, all outside vLLM's formats:

- prompts are counted with the model's own tokenizer and chat template (:class:`TokenizerCount`,
  cached per prompt), not the tests' word count: the sidecar checks its local count against
  ``/tokenize``;
- a stream writes each event as its own chunk and yields to the loop between events, like a
  decoder that emits one token per step; an ``x-bench-interval-ms`` request header (else
  ``--sse-interval-ms``) paces them.

    python -m harness.fake_vllm_fast --port 8001 --model-root ~/.cache/vllm-kv-sidecar/models/...

    with FakeVllmProcess(model_root, max_model_len=200_000) as upstream:
        httpx.get(upstream.url + "/v1/models")
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from email.utils import formatdate
from http import HTTPStatus
from pathlib import Path
from typing import Any

import httptools
import httpx

from harness.fake_vllm import FakeVllm, Generation, Refusal
from harness.local import ROOT, free_port
from harness.vllm_formats import (
    METRICS_CONTENT_TYPE,
    SSE_DONE,
    completion_answer,
    dumps,
    sse_event,
    stream_head,
    stream_opening,
    stream_token,
    stream_usage,
    token_text,
    token_usage,
)

_JSON = b"application/json"
_PLACEHOLDER = "\x00token\x00"  # where an event template takes its token's text
_COUNTS_KEPT = 10_000


class TokenizerCount:
    """Prompt tokens as vLLM counts them: the model's tokenizer, with its chat template for
    messages; cached per prompt (the benchmarks send the same few prompts many times)."""

    def __init__(self, model_root: Path) -> None:
        self.model_root = model_root
        self._tokenizer: Any = None
        self._counts: dict[tuple[str, str, bool], int] = {}

    def _tok(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_root))
        return self._tokenizer

    def __call__(self, body: dict[str, Any]) -> int:
        if "messages" in body:
            flag = bool(body.get("add_generation_prompt", True))
            key = ("chat", json.dumps(body["messages"], sort_keys=True), flag)
        else:
            prompt = body.get("prompt", "")
            flag = bool(body.get("add_special_tokens", True))
            key = ("prompt", prompt if isinstance(prompt, str) else json.dumps(prompt), flag)
        if key not in self._counts:
            if len(self._counts) >= _COUNTS_KEPT:
                self._counts.clear()
            self._counts[key] = self._count(body, key[2])
        return self._counts[key]

    def _count(self, body: dict[str, Any], flag: bool) -> int:
        tok = self._tok()
        if "messages" in body:
            ids = tok.apply_chat_template(body["messages"], add_generation_prompt=flag)
            if hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return len(ids)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)  # token ids count as given
        prompts = prompt if isinstance(prompt, list) else [prompt]
        return sum(len(tok(str(p), add_special_tokens=flag)["input_ids"]) for p in prompts)


class _Clock:
    """The ``date`` header, formatted at most once a second."""

    def __init__(self) -> None:
        self._date = b""
        self._at = 0.0

    def date(self) -> bytes:
        now = time.time()
        if now - self._at >= 1.0:
            self._date = formatdate(now, usegmt=True).encode()
            self._at = now
        return self._date


class FastProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive; requests on one connection are answered in order."""

    def __init__(self, fake: FakeVllm, clock: _Clock, sse_interval: float) -> None:
        self.fake = fake
        self.clock = clock
        self.sse_interval = sse_interval
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.interval: float | None = None
        self.queue: asyncio.Queue[tuple[bytes, bytes, bytes, bool, float | None]] = asyncio.Queue()
        self.worker: asyncio.Task[None] | None = None
        self.closed = False

    # --- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.worker = asyncio.get_running_loop().create_task(self._serve())

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.worker is not None:
            self.worker.cancel()

    # --- httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []
        self.interval = None

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-bench-interval-ms":
            self.interval = float(value) / 1000.0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        self.queue.put_nowait(
            (method, self.url, b"".join(self.body), self.parser.should_keep_alive(), self.interval)
        )

    # --- answering ------------------------------------------------------------------------------

    def _close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
            self.closed = True

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _respond(self, status: int, ctype: bytes | None, body: bytes, keep_alive: bool) -> None:
        self._write(
            b"HTTP/1.1 %d %s\r\ndate: %s\r\nserver: uvicorn\r\n"
            % (status, HTTPStatus(status).phrase.encode(), self.clock.date())
            + (b"" if ctype is None else b"content-type: " + ctype + b"\r\n")
            + b"content-length: %d\r\n" % len(body)
            + (b"" if keep_alive else b"connection: close\r\n")
            + b"\r\n"
            + body
        )
        if not keep_alive:
            self._close()

    async def _serve(self) -> None:
        while not self.closed:
            method, url, body, keep_alive, interval = await self.queue.get()
            path = url.split(b"?", 1)[0].decode("latin-1")
            try:
                await self._route(method.decode("latin-1"), path, body, keep_alive, interval)
            except (ValueError, TypeError, KeyError) as exc:  # as a server that raised: a 500
                message = dumps({"detail": f"{type(exc).__name__}: {exc}"})
                self._respond(500, _JSON, message, keep_alive=False)

    async def _route(
        self, method: str, path: str, body: bytes, keep_alive: bool, interval: float | None
    ) -> None:
        fake = self.fake
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            planned = fake.plan_generation(path, body)
            if isinstance(planned, Refusal):
                self._respond(planned.status, _JSON, planned.body, keep_alive)
            elif planned.stream:
                await self._stream(planned, keep_alive, interval)
            else:
                self._answer(planned, keep_alive)
        elif method == "GET" and path == "/metrics":
            text = fake.metrics_text().encode()
            self._respond(200, METRICS_CONTENT_TYPE, text, keep_alive)
        elif method == "GET" and path == "/v1/models":
            self._respond(200, _JSON, dumps(fake.models()), keep_alive)
        elif method == "POST" and path == "/tokenize":
            status, answer = fake.tokenize(body)
            self._respond(status, _JSON, answer, keep_alive)
        elif method == "GET" and path == "/health":
            self._respond(200, None, b"", keep_alive)
        else:
            self._respond(404, _JSON, dumps({"detail": "Not Found"}), keep_alive)

    def _answer(self, g: Generation, keep_alive: bool) -> None:
        text = "".join(token_text(i) for i in range(g.tokens))
        self.fake.generation_tokens_total += g.tokens
        answer = completion_answer(g.chat, g.rid, self.fake.served_name, text, g.n, g.usage)
        self._respond(200, _JSON, dumps(answer), keep_alive)

    def _chunk(self, data: bytes) -> None:
        self._write(b"%x\r\n%s\r\n" % (len(data), data))

    async def _stream(self, g: Generation, keep_alive: bool, interval: float | None) -> None:
        head = stream_head(g.chat, g.rid, self.fake.served_name)
        self._write(
            b"HTTP/1.1 200 OK\r\ndate: "
            + self.clock.date()
            + b"\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8"
            + b"\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        prompt = g.usage["prompt_tokens"]
        if g.chat:  # vLLM opens a chat stream with the role, before any token
            for i in range(g.n):
                usage = token_usage(True, prompt, 0) if g.continuous else None
                self._chunk(sse_event(stream_opening(head, i, usage)))
        # each choice's event rendered once with placeholders for its text and its counts: the
        # same bytes as sse_event(stream_token(...)), without a JSON encoding per token
        sample = None
        if g.continuous:
            counts = {"total_tokens": _TOTAL, "completion_tokens": _COMPLETION}
            sample = token_usage(g.chat, prompt, 0) | counts
        templates = [
            _template(
                sse_event(stream_token(head, g.chat, i, _PLACEHOLDER, last=False, usage=sample))
            )
            for i in range(g.n)
        ]
        pace = self.sse_interval if interval is None else interval
        for step in range(g.tokens):
            text = token_text(step)
            last = step == g.tokens - 1
            for i, parts in enumerate(templates):
                if last:
                    usage = token_usage(g.chat, prompt, step + 1) if g.continuous else None
                    event = stream_token(
                        head,
                        g.chat,
                        i,
                        text,
                        last=True,
                        usage=usage,
                        fingerprint=not g.include_usage,
                    )
                    self._chunk(sse_event(event))
                else:
                    self._chunk(_fill(parts, dumps(text)[1:-1], prompt + step + 1, step + 1))
            self.fake.generation_tokens_total += 1
            # one event per write, like a decoder that emits one token per step: let the other
            # streams (and the proxy) run between events rather than batching them here
            await asyncio.sleep(pace)
            if self.closed:
                return
        end = (sse_event(stream_usage(head, g.usage)) if g.include_usage else b"") + SSE_DONE
        self._write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(end), end))
        if not keep_alive:
            self._close()


#: placeholders for an event's total and completion token counts in a template (``_fill``)
_TOTAL, _COMPLETION = 918273645, 546372819


def _template(event: bytes) -> list[bytes]:
    """``event`` cut at its text's placeholder and, where it has them, its counts' placeholders
    (its total, then its completion tokens, in vLLM's order)."""
    before, after = event.split(dumps(_PLACEHOLDER)[1:-1])
    if b"%d" % _TOTAL not in after:
        return [before, after]
    middle, rest = after.split(b"%d" % _TOTAL)
    between, end = rest.split(b"%d" % _COMPLETION)
    return [before, middle, between, end]


def _fill(parts: list[bytes], text: bytes, total: int, completion: int) -> bytes:
    if len(parts) == 2:
        return parts[0] + text + parts[1]
    return b"%s%s%s%d%s%d%s" % (parts[0], text, parts[1], total, parts[2], completion, parts[3])


async def serve(fake: FakeVllm, host: str, port: int, *, sse_interval: float = 0.0) -> None:
    """Serve ``fake`` on ``host:port`` until cancelled."""
    clock = _Clock()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FastProtocol(fake, clock, sse_interval),
        host,
        port,
        backlog=4096,
        reuse_address=True,
    )
    print(f"fake vLLM listening on {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


class FakeVllmProcess:
    """``python -m harness.fake_vllm_fast`` on a free loopback port, its own process.

    ``num_gpu_blocks`` is the pool its /metrics reports (a million by default: admission never
    waits); ``max_model_len`` the context its /v1/models reports.
    """

    def __init__(
        self,
        model_root: Path,
        *,
        max_model_len: int = 1024,
        num_gpu_blocks: int = 1_000_000,
        served_name: str = "tiny",
    ) -> None:
        self.model_root = model_root
        self.max_model_len = max_model_len
        self.num_gpu_blocks = num_gpu_blocks
        self.served_name = served_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "harness.fake_vllm_fast",
            "--port",
            str(self.port),
            "--model-root",
            str(self.model_root),
            "--max-model-len",
            str(self.max_model_len),
            "--num-gpu-blocks",
            str(self.num_gpu_blocks),
            "--served-name",
            self.served_name,
        ]

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> FakeVllmProcess:
        self.proc = subprocess.Popen(
            self.command(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"the fast fake vLLM did not start: {' '.join(self.command())}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def __enter__(self) -> FakeVllmProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harness.fake_vllm_fast", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-root", type=Path, required=True)
    parser.add_argument("--served-name", default="tiny")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-gpu-blocks", type=int, default=1_000_000)
    parser.add_argument("--sse-interval-ms", type=float, default=0.0, help="pace of SSE events")
    args = parser.parse_args(argv)
    fake = FakeVllm(
        model_root=args.model_root, served_name=args.served_name, max_model_len=args.max_model_len
    )
    fake.num_gpu_blocks = args.num_gpu_blocks
    fake.prompt_counter = TokenizerCount(args.model_root)
    import uvloop

    uvloop.run(serve(fake, args.host, args.port, sse_interval=args.sse_interval_ms / 1000.0))


if __name__ == "__main__":
    main()
