"""A fast fake vLLM for the overhead benchmark: vLLM 0.32's wire formats at loopback speed.

A raw asyncio protocol (uvloop + httptools, no framework) so that the upstream costs as little as
possible and the proxy in front of it is what the benchmark sees. It answers, in the shapes a real
vLLM 0.32 (CPU build) answered in ``tests/fixtures/vllm-0.32.0-cpu/``:

- ``GET /v1/models``: one model, ``root`` = ``--model-root``, ``max_model_len``;
- ``GET /metrics``: the captured text with ``num_gpu_blocks`` = ``--num-gpu-blocks`` (so admission
  never blocks) and an empty KV cache;
- ``POST /tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``, counted with the
  model's tokenizer (cached per prompt: the sidecar's self-check must agree with its local count);
- ``POST /v1/completions`` and ``/v1/chat/completions``: a JSON answer, or with ``stream: true`` an
  SSE stream of ``max_tokens`` events (one chunk per event, each its own write, then the usage
  event and ``data: [DONE]``), paced by ``--sse-interval-ms`` when given;
- ``GET /health``: 200.

    python -m bench.upstream --port 8001 --model-root ~/.cache/vllm-kv-sidecar/models/tiny-...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from email.utils import formatdate
from pathlib import Path
from typing import Any

import httptools

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm-0.32.0-cpu"
CREATED = 1795939723
FINGERPRINT = "vllm-0.32.0-3470f119"
_WORDS = [b" the", b" KV", b" cache", b" block", b" 42", b" token", b" of", b" vLLM"]


def metrics_text(num_gpu_blocks: int) -> bytes:
    text = (FIXTURES / "metrics-fresh.txt").read_text()
    text = re.sub(r'num_gpu_blocks="\d+"', f'num_gpu_blocks="{num_gpu_blocks}"', text)
    text = re.sub(
        r'num_gpu_blocks_override="\d+"', f'num_gpu_blocks_override="{num_gpu_blocks}"', text
    )
    return text.encode()


class Upstream:
    """What the protocol instances share: canned answers and the token counter."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.model_root = str(args.model_root)
        self.max_model_len = args.max_model_len
        self.sse_interval = args.sse_interval_ms / 1000.0
        self.metrics = metrics_text(args.num_gpu_blocks)
        self.models = json.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": args.served_name,
                        "object": "model",
                        "created": CREATED,
                        "owned_by": "vllm",
                        "root": self.model_root,
                        "parent": None,
                        "max_model_len": self.max_model_len,
                        "permission": [],
                    }
                ],
            }
        ).encode()
        self._tokenizer: Any = None
        self._counts: dict[str, int] = {}
        self._date = b""
        self._date_at = 0.0

    def date(self) -> bytes:
        now = time.time()
        if now - self._date_at >= 1.0:
            self._date = formatdate(now, usegmt=True).encode()
            self._date_at = now
        return self._date

    def count(self, body: dict[str, Any]) -> int:
        """Prompt tokens as vLLM counts them (the model's tokenizer, chat template applied)."""
        key = json.dumps(body, sort_keys=True)
        if key not in self._counts:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_root)
            tok = self._tokenizer
            if "messages" in body:
                ids = tok.apply_chat_template(
                    body["messages"], add_generation_prompt=body.get("add_generation_prompt", True)
                )
                if hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                n = len(ids)
            else:
                special = body.get("add_special_tokens", True)
                n = len(tok(body["prompt"], add_special_tokens=special)["input_ids"])
            self._counts[key] = n
        return self._counts[key]


class HttpProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive; requests on one connection are answered in order."""

    def __init__(self, up: Upstream) -> None:
        self.up = up
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

    def _respond(self, status: bytes, ctype: bytes, body: bytes, keep_alive: bool) -> None:
        self._write(
            b"HTTP/1.1 "
            + status
            + b"\r\ndate: "
            + self.up.date()
            + b"\r\nserver: uvicorn\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\ncontent-type: "
            + ctype
            + (b"" if keep_alive else b"\r\nconnection: close")
            + b"\r\n\r\n"
            + body
        )
        if not keep_alive:
            self._close()

    async def _serve(self) -> None:
        while not self.closed:
            method, url, body, keep_alive, interval = await self.queue.get()
            path = url.split(b"?", 1)[0]
            try:
                await self._route(method, path, body, keep_alive, interval)
            except (ValueError, KeyError, TypeError) as exc:
                err = {
                    "error": {
                        "message": str(exc),
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                }
                self._respond(
                    b"400 Bad Request", b"application/json", json.dumps(err).encode(), keep_alive
                )

    async def _route(
        self, method: bytes, path: bytes, body: bytes, keep_alive: bool, interval: float | None
    ) -> None:
        up = self.up
        if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
            chat = path == b"/v1/chat/completions"
            await self._generate(chat, json.loads(body), keep_alive, interval)
        elif path == b"/metrics":
            self._respond(
                b"200 OK", b"text/plain; version=0.0.4; charset=utf-8", up.metrics, keep_alive
            )
        elif path == b"/v1/models":
            self._respond(b"200 OK", b"application/json", up.models, keep_alive)
        elif method == b"POST" and path == b"/tokenize":
            request = json.loads(body)
            n = up.count(request)
            answer = {
                "count": n,
                "max_model_len": up.max_model_len,
                "tokens": [0] * n,
                "token_strs": None,
            }
            self._respond(b"200 OK", b"application/json", json.dumps(answer).encode(), keep_alive)
        elif path in (b"/health", b"/ping"):
            self._respond(b"200 OK", b"application/json", b"", keep_alive)
        else:
            self._respond(
                b"404 Not Found", b"application/json", b'{"detail":"Not Found"}', keep_alive
            )

    async def _generate(
        self, chat: bool, request: dict[str, Any], keep_alive: bool, interval: float | None
    ) -> None:
        tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or 16)
        model = request.get("model", "tiny")
        text = b"".join(_WORDS[i % len(_WORDS)] for i in range(tokens)).decode()
        usage = {"prompt_tokens": 0, "total_tokens": tokens, "completion_tokens": tokens}
        if not request.get("stream"):
            if chat:
                answer: dict[str, Any] = {
                    "id": "chatcmpl-bench",
                    "object": "chat.completion",
                    "created": CREATED,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": text,
                                "refusal": None,
                                "annotations": None,
                                "audio": None,
                                "function_call": None,
                                "tool_calls": [],
                                "reasoning_content": None,
                            },
                            "logprobs": None,
                            "finish_reason": "length",
                            "stop_reason": None,
                            "token_ids": None,
                        }
                    ],
                    "service_tier": None,
                    "system_fingerprint": FINGERPRINT,
                    "usage": usage,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "kv_transfer_params": None,
                }
            else:
                answer = {
                    "id": "cmpl-bench",
                    "object": "text_completion",
                    "created": CREATED,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "text": text,
                            "logprobs": None,
                            "finish_reason": "length",
                            "stop_reason": None,
                            "token_ids": None,
                            "prompt_logprobs": None,
                            "prompt_token_ids": None,
                        }
                    ],
                    "service_tier": None,
                    "system_fingerprint": FINGERPRINT,
                    "usage": usage,
                    "kv_transfer_params": None,
                }
            self._respond(b"200 OK", b"application/json", json.dumps(answer).encode(), keep_alive)
            return
        self._write(
            b"HTTP/1.1 200 OK\r\ndate: "
            + self.up.date()
            + b"\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8"
            + b"\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        if chat:
            head = (
                b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":'
                + str(CREATED).encode()
                + b',"model":"'
                + model.encode()
                + b'","choices":[{"index":0,"delta":{"content":"'
            )
            tail = b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            head = (
                b'data: {"id":"cmpl-bench","object":"text_completion","created":'
                + str(CREATED).encode()
                + b',"model":"'
                + model.encode()
                + b'","choices":[{"index":0,"text":"'
            )
            tail = b'","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        if interval is None:
            interval = self.up.sse_interval
        for i in range(tokens):
            event = head + _WORDS[i % len(_WORDS)] + tail
            self._write(b"%x\r\n%s\r\n" % (len(event), event))
            # one event per write, like a decoder that emits one token per step: let the other
            # streams (and the proxy) run between events rather than batching them here
            if interval:
                await asyncio.sleep(interval)
            else:
                await asyncio.sleep(0)
            if self.closed:
                return
        last = (
            b'data: {"id":"x","object":"text_completion","created":'
            + str(CREATED).encode()
            + b',"model":"'
            + model.encode()
            + b'","choices":[],"usage":'
            + json.dumps(usage).encode()
            + b"}\n\n"
            + b"data: [DONE]\n\n"
        )
        self._write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))
        if not keep_alive:
            self._close()


async def _main(args: argparse.Namespace) -> None:
    up = Upstream(args)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: HttpProtocol(up), args.host, args.port, backlog=4096, reuse_address=True
    )
    print(f"upstream listening on {args.host}:{args.port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-root", type=Path, required=True)
    parser.add_argument("--served-name", default="tiny")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-gpu-blocks", type=int, default=1_000_000)
    parser.add_argument("--sse-interval-ms", type=float, default=0.0)
    args = parser.parse_args()
    import uvloop

    uvloop.run(_main(args))


if __name__ == "__main__":
    main()
