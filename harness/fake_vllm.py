"""A fake vLLM for fast tests: vLLM 0.32's wire formats, plus knobs and a request log.

The formats and rules are :mod:`harness.vllm_formats`' (copied from a real vLLM 0.32, CPU build,
in ``tests/fixtures/vllm-0.32.0-cpu/``): ``/v1/models``, ``/metrics`` (the captured text with the
values the sidecar reads swapped in, plus ``vllm:lora_requests_info`` as vLLM's source writes it
when LoRA is on: ``max_loras``, :meth:`FakeVllm.record_lora`), ``/tokenize``, the render
endpoints (403 unless ``scale_out``, vLLM's ``--enable-scale-out``), and completions and chat
completions, plain JSON or SSE. Token counts are a deterministic function of the text
(:func:`count_prompt`, the ``prompt_counter`` knob), not a real tokenizer. Extra routes exercise
the proxy's pass-through: ``/echo/...``, ``/slow``, ``/status/{code}`` and ``/gzip``. ``/version``
answers as vLLM 0.32 does (the ``version_answer`` knob: another version, garbage, or none at all),
and ``max_num_queued_reqs`` refuses generations as vLLM's ``--max-num-queued-reqs`` does (503,
counted in ``vllm:admission_rejections_total``).

It is a pure ASGI app (:class:`FakeVllm`) served by uvicorn on a loopback port in a thread
(:class:`FakeServer`), so both sync and async tests can use it and can stop it under a running
sidecar. Knobs are plain attributes, read on each request; the log and counters are written by the
server thread only. The benchmarks serve the same :class:`FakeVllm` at loopback speed, in its own
process: :mod:`harness.fake_vllm_fast`.

Usage (``tmp_path`` is pytest's)::

    fake = FakeVllm(model_root=write_model_dir(tmp_path / "tiny"))
    with FakeServer(fake) as server:
        fake.kv_cache_usage = 0.9
        httpx.get(server.url + "/metrics").text  # the fixture text, with usage 0.9
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs

import uvicorn
from prometheus_client.utils import floatToGoString

from harness.vllm_formats import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    GENERATION_PATHS,
    METRICS_CONTENT_TYPE,
    METRICS_TEXT,
    RENDER_DISABLED_ERROR,
    RENDER_PATHS,
    SSE_DONE,
    completion_answer,
    count_prompt,
    dumps,
    generation_default,
    max_tokens_for,
    models_list,
    render,
    sse_event,
    stream_head,
    stream_opening,
    stream_token,
    stream_usage,
    token_text,
    token_usage,
    tokenize_answer,
    vllm_error,
    write_model_dir,
)

__all__ = [
    "GZIP_BODY",
    "FakeServer",
    "FakeVllm",
    "Generation",
    "Message",
    "Receive",
    "Recorded",
    "Refusal",
    "Scope",
    "Send",
    "bound_socket",
    "count_prompt",
    "respond",
    "write_model_dir",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: vLLM 0.32's answer when --max-num-queued-reqs is reached (QueueOverflowError, a
#: GracefulHTTPError, through create_error_response: the status's phrase as the type)
QUEUE_FULL_ERROR = vllm_error(
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.",
    503,
    "Service Unavailable",
)

#: What ``GET /gzip`` answers, with ``Content-Encoding: gzip``.
GZIP_BODY = gzip.compress(b"vLLM says hello, compressed. " * 64, mtime=0)

MetricsMode = Literal["ok", "error", "garbage", "hang", "no_cache_config"]


@dataclass
class Recorded:
    """One request the fake received."""

    method: str
    path: str
    raw_path: bytes
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    complete: bool = True  # False: the client went away before the end of the body
    at: float = field(default_factory=time.monotonic)

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        values = [v.decode("latin-1") for k, v in self.headers if k == key]
        return ", ".join(values) if values else None

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Generation:
    """A generation request the fake accepted: what it will answer, as vLLM would."""

    chat: bool
    rid: str
    tokens: int  # per sequence
    n: int
    usage: dict[str, int]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a usage event before [DONE]
    continuous: bool = False  # and continuous_usage_stats: the usage in every event


@dataclass(frozen=True)
class Refusal:
    """A generation request the fake refused, as vLLM would: the status and the error body."""

    status: int
    body: bytes


class FakeVllm:
    """The ASGI app, its knobs and what it saw."""

    def __init__(
        self,
        *,
        model_root: Path | None,
        served_name: str = "tiny",
        max_model_len: int = 1024,
    ) -> None:
        self.model_root = model_root
        self.served_name = served_name
        self.max_model_len = max_model_len
        # knobs
        self.kv_cache_usage = 0.0
        self.running = 0
        self.waiting = 0
        self.preemptions_total = 0.0
        self.generation_tokens_total = 0.0
        self.num_gpu_blocks = 64
        self.block_size = 128
        self.metrics_mode: MetricsMode = "ok"
        self.token_delay = 0.0  # seconds per generated token
        # vLLM's generation config: the default max_tokens of a chat request that names none
        # (read from model_root as --generation-config auto does), and --override-generation-
        # config's max_new_tokens, which caps every request (vLLM's override_max_tokens)
        self.default_max_tokens: int | None = generation_default(model_root)
        self.max_tokens_cap: int | None = None
        self.fail_after: int | None = None  # generations crash after this many tokens
        #: prompt tokens of a request body, for /tokenize, max_tokens and usage (the benchmarks'
        #: fast server counts with the model's own tokenizer instead)
        self.prompt_counter: Callable[[dict[str, Any]], int] = count_prompt
        # vLLM's --enable-lora --max-loras N: with it set, /metrics has vllm:lora_requests_info
        # (see record_lora); None (the default) serves vLLM without LoRA, which exports no such
        # family at all
        self.max_loras: int | None = None
        #: vllm:lora_requests_info's series: (running, waiting) adapters -> the time vLLM set it
        self.lora_series: dict[tuple[str, str], float] = {}
        #: ``GET /version``'s status and body (vLLM 0.32's by default); None: a vLLM without it
        self.version_answer: tuple[int, bytes] | None = (200, dumps({"version": "0.32.0"}))
        #: vLLM's --max-num-queued-reqs: a generation that would make the requests in flight
        #: (n sequences counting n) exceed it is refused with vLLM's 503 (None: no cap)
        self.max_num_queued_reqs: int | None = None
        #: vllm:admission_rejections_total by reason (what the cap refused)
        self.admission_rejections: dict[str, float] = {
            "max_num_queued_reqs": 0.0,
            "max_num_queued_tokens": 0.0,
        }
        self.queued_sequences = 0  # sequences of the generations in flight (the cap's count)
        #: vLLM's --enable-scale-out: the render endpoints answer (else 403, vLLM's default)
        self.scale_out = False
        # what it saw
        self.requests: list[Recorded] = []
        self.in_flight = 0  # generations (and /slow streams) running now
        self.aborted = 0  # requests and generations ended by the client going away
        self.completed = 0
        self.first_body_chunk_at: float | None = None  # of the latest /echo upload
        self.closing = False

    # --- what tests read ------------------------------------------------------------------

    def requests_to(self, path: str, method: str | None = None) -> list[Recorded]:
        return [
            r
            for r in list(self.requests)
            if r.path == path and (method is None or r.method == method)
        ]

    def generations(self) -> list[Recorded]:
        return [r for r in list(self.requests) if r.path in GENERATION_PATHS]

    def non_probe_requests(self) -> list[Recorded]:
        """Requests other than the sidecar's own scrapes, discovery and token counting."""
        probes = ("/metrics", "/v1/models", "/tokenize", "/version", *RENDER_PATHS)

        def probe(r: Recorded) -> bool:
            # the sidecar's /health checks carry no user-agent (it sends no default headers)
            own_health = r.path == "/health" and not any(k == b"user-agent" for k, _ in r.headers)
            return r.path in probes or own_health

        return [r for r in list(self.requests) if not probe(r)]

    def record_lora(self, running: Sequence[str] = (), waiting: Sequence[str] = ()) -> None:
        """What vLLM 0.32's PrometheusStatLogger.record does with LoRA on, at each step it logs:
        ``vllm:lora_requests_info`` under the adapters running and waiting now (names joined with
        commas) is set to the current time; the series of earlier adapter sets stay, with their
        older times (vllm/v1/metrics/loggers.py)."""
        self.lora_series[(",".join(running), ",".join(waiting))] = time.time()

    # --- rendering ----------------------------------------------------------------------

    def lora_text(self) -> str:
        """``vllm:lora_requests_info`` as vLLM 0.32 exports it when LoRA is on: a gauge with
        labels max_lora, running_lora_adapters and waiting_lora_adapters (no engine label), one
        series per adapter set, each valued at the time it was last set; prometheus_client prints
        the labels sorted, and only HELP and TYPE before the first record."""
        lines = [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
        ]
        for (running, waiting), at in list(self.lora_series.items()):
            labels = (
                f'max_lora="{self.max_loras}",running_lora_adapters="{running}",'
                f'waiting_lora_adapters="{waiting}"'
            )
            lines.append(f"vllm:lora_requests_info{{{labels}}} {floatToGoString(at)}")
        return "\n".join(lines) + "\n"

    def metrics_text(self) -> str:
        text = METRICS_TEXT
        for name, value in (
            ("vllm:kv_cache_usage_perc", self.kv_cache_usage),
            ("vllm:num_requests_running", float(self.running)),
            ("vllm:num_requests_waiting", float(self.waiting)),
            ("vllm:num_preemptions_total", float(self.preemptions_total)),
            ("vllm:generation_tokens_total", float(self.generation_tokens_total)),
        ):
            pattern = rf"^({re.escape(name)}\{{[^}}]*\}}) \S+$"
            text = re.sub(pattern, rf"\g<1> {value!r}", text, flags=re.M)
        text = re.sub(
            r'(?<=[{,])num_gpu_blocks="\d+"', f'num_gpu_blocks="{self.num_gpu_blocks}"', text
        )
        text = re.sub(r'(?<=[{,])block_size="\d+"', f'block_size="{self.block_size}"', text)
        for reason, count in self.admission_rejections.items():
            pattern = rf'^(vllm:admission_rejections_total\{{[^}}]*reason="{reason}"[^}}]*\}}) \S+$'
            text = re.sub(pattern, rf"\g<1> {count!r}", text, flags=re.M)
        if self.max_loras is not None:
            # registered just before vllm:cache_config_info (PrometheusStatLogger.__init__)
            at = text.index("# HELP vllm:cache_config_info ")
            text = text[:at] + self.lora_text() + text[at:]
        if self.metrics_mode == "no_cache_config":
            text = "".join(
                line for line in text.splitlines(True) if "vllm:cache_config_info" not in line
            )
        return text

    def models(self) -> dict[str, Any]:
        return models_list(self.served_name, self.model_root, self.max_model_len)

    # --- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        body, complete = await self._read_body(receive, record_first_chunk=path.startswith("/echo"))
        rec = Recorded(
            scope["method"],
            path,
            scope.get("raw_path") or path.encode(),
            scope["query_string"],
            list(scope["headers"]),
            body,
            complete,
        )
        self.requests.append(rec)
        if not complete:  # a server never acts on half a request
            self.aborted += 1
            return
        query = {k: v[-1] for k, v in parse_qs(rec.query.decode("latin-1")).items()}
        method = rec.method
        if path == "/metrics" and method == "GET":
            await self._metrics(send)
        elif path == "/v1/models" and method == "GET":
            await respond(send, 200, dumps(self.models()))
        elif path == "/health" and method == "GET":
            await respond(send, 200, b"", content_type=None)
        elif path == "/version" and method == "GET" and self.version_answer is not None:
            await respond(send, *self.version_answer)
        elif path == "/tokenize" and method == "POST":
            await self._tokenize(send, rec)
        elif path in RENDER_PATHS and method == "POST":
            await respond(send, *self.render(path, rec.body))
        elif path in GENERATION_PATHS and method == "POST":
            await self._generate(receive, send, rec)
        elif path.startswith("/echo"):
            await self._echo(send, rec)
        elif path == "/slow":
            await self._slow(receive, send, query)
        elif path.startswith("/status/"):
            await self._status(send, int(path.rsplit("/", 1)[1]), method)
        elif path == "/gzip":
            await self._gzip(send)
        else:
            await respond(send, 404, dumps({"detail": "Not Found"}))

    async def _read_body(self, receive: Receive, *, record_first_chunk: bool) -> tuple[bytes, bool]:
        """The request body, and whether it arrived whole."""
        chunks: list[bytes] = []
        first = True
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), False
            chunk = message.get("body", b"")
            if chunk and first and record_first_chunk:
                self.first_body_chunk_at = time.monotonic()
                first = False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True

    async def _metrics(self, send: Send) -> None:
        mode = self.metrics_mode
        if mode == "error":
            await respond(send, 500, b"Internal Server Error", content_type=b"text/plain")
            return
        if mode == "garbage":
            await respond(send, 200, b"<html>not metrics</html>\x00{{", content_type=b"text/html")
            return
        # polled: the knob is set from the test's thread, which cannot set an asyncio.Event here
        while self.metrics_mode == "hang" and not self.closing:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        await respond(send, 200, self.metrics_text().encode(), content_type=METRICS_CONTENT_TYPE)

    def tokenize(self, raw: bytes) -> tuple[int, bytes]:
        """``POST /tokenize`` of the body ``raw``: the status and the answer."""
        try:
            count = self.prompt_counter(json.loads(raw))
        except (ValueError, TypeError, AttributeError) as exc:
            return 400, vllm_error(f"bad /tokenize body: {exc}")
        return 200, dumps(tokenize_answer(count, self.max_model_len))

    def render(self, path: str, raw: bytes) -> tuple[int, bytes]:
        """``POST`` of ``raw`` to a render endpoint (:func:`~harness.vllm_formats.render`):
        403 unless :attr:`scale_out`, as vLLM without ``--enable-scale-out``."""
        if not self.scale_out:
            return 403, RENDER_DISABLED_ERROR
        return render(
            path,
            raw,
            served_name=self.served_name,
            max_model_len=self.max_model_len,
            prompt_counter=self.prompt_counter,
            max_tokens_for=self.max_tokens_for,
        )

    async def _tokenize(self, send: Send, rec: Recorded) -> None:
        status, body = self.tokenize(rec.body)
        await respond(send, status, body)

    async def _echo(self, send: Send, rec: Recorded) -> None:
        answer = {
            "method": rec.method,
            "path": rec.path,
            "raw_path": rec.raw_path.decode("latin-1"),
            "query": rec.query.decode("latin-1"),
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in rec.headers],
            "body": rec.body.decode("latin-1") if len(rec.body) <= 65536 else None,
            "body_len": len(rec.body),
            "body_sha256": hashlib.sha256(rec.body).hexdigest(),
        }
        await respond(send, 200, dumps(answer))

    async def _status(self, send: Send, status: int, method: str) -> None:
        headers = [
            (b"x-end-to-end", b"kept"),
            (b"set-cookie", b"a=1"),
            (b"set-cookie", b"b=2"),
            (b"connection", b"x-custom"),
            (b"x-custom", b"hop-by-hop, named by Connection"),
            (b"keep-alive", b"timeout=5, max=100"),
            (b"proxy-authenticate", b"Basic"),
            (b"trailer", b"x-checksum"),
            (b"upgrade", b"h2c"),
        ]
        if status in (301, 302, 307, 308):
            headers.append((b"location", b"http://elsewhere.invalid/moved"))
        body = b"" if status in (204, 304) or method == "HEAD" else f"status {status}\n".encode()
        await respond(send, status, body, content_type=b"text/plain", headers=headers)

    async def _gzip(self, send: Send) -> None:
        await respond(
            send,
            200,
            GZIP_BODY,
            content_type=b"text/plain",
            headers=[(b"content-encoding", b"gzip"), (b"vary", b"Accept-Encoding")],
        )

    async def _slow(self, receive: Receive, send: Send, query: dict[str, str]) -> None:
        chunks = int(query.get("chunks", "5"))
        delay = float(query.get("delay", "0.1"))
        size = int(query.get("size", "1024"))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/octet-stream")],
            }
        )

        async def body() -> None:
            for i in range(chunks):
                if i:
                    await asyncio.sleep(delay)
                piece = bytes([65 + i % 26]) * size
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self._run_watched(receive, body())

    async def _run_watched(self, receive: Receive, work: Awaitable[None]) -> None:
        """Run ``work`` until it ends or the client disconnects (counted in ``aborted``):
        uvicorn's ``send`` ignores writes after a disconnect, so only ``receive`` tells."""

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        self.in_flight += 1
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()
                self.completed += 1
            else:
                self.aborted += 1
        finally:
            for t in (task, watch):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            self.in_flight -= 1

    # --- generation ---------------------------------------------------------------------

    def plan_generation(self, path: str, raw: bytes) -> Generation | Refusal:
        """What vLLM does with a generation request to ``path`` of body ``raw``: the answer it
        will give, or the error it refuses with (in vLLM's order of checks)."""
        chat = path == "/v1/chat/completions"
        try:
            body = json.loads(raw)
            prompt_tokens = self.prompt_counter(body)
            param = "max_tokens"
            if chat:
                # vLLM: max_completion_tokens if not None, else max_tokens (None: no default)
                if body.get("max_completion_tokens") is not None:
                    param = "max_completion_tokens"
                max_tokens = body.get(param)
            else:
                # CompletionRequest.max_tokens = 16, and normalize_null_max_tokens makes an
                # explicit null the same 16
                max_tokens = body.get("max_tokens")
                if max_tokens is None:
                    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        except (ValueError, TypeError, AttributeError) as exc:
            return Refusal(400, vllm_error(f"bad request: {exc}"))
        model = body.get("model")
        if model is not None and model != self.served_name:
            message = f"The model `{model}` does not exist."
            return Refusal(404, vllm_error(message, 404, "NotFoundError"))
        if max_tokens is not None and max_tokens > self.max_model_len:
            message = (
                f"{param}={max_tokens} cannot be greater than max_model_len="
                f"{self.max_model_len}. Please request fewer output tokens."
            )
            return Refusal(400, vllm_error(message))
        tokens = self.max_tokens_for(prompt_tokens, max_tokens)
        if not chat and body.get("echo") is True and max_tokens == 0:
            tokens = 1  # vLLM's echo_without_generation runs with max_tokens=1
        if tokens < 1:  # SamplingParams._verify_args
            return Refusal(400, vllm_error(f"max_tokens must be at least 1, got {tokens}."))
        if isinstance(body.get("fake_len"), int):
            tokens = min(tokens, body["fake_len"])
        n = int(body.get("n") or 1)
        rid = ("chatcmpl-" if chat else "cmpl-") + hashlib.sha256(raw).hexdigest()[:16]
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + n * tokens,
            "completion_tokens": n * tokens,
        }
        stream = bool(body.get("stream"))
        options = (body.get("stream_options") or {}) if stream else {}
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        return Generation(chat, rid, tokens, n, usage, stream, include_usage, continuous)

    async def _generate(self, receive: Receive, send: Send, rec: Recorded) -> None:
        planned = self.plan_generation(rec.path, rec.body)
        if isinstance(planned, Refusal):
            await respond(send, planned.status, planned.body)
            return
        cap = self.max_num_queued_reqs
        if cap is not None and self.queued_sequences + planned.n > cap:
            # AsyncLLM.check_admission, from each handler's _preflight: before a stream starts
            self.admission_rejections["max_num_queued_reqs"] += 1
            await respond(send, 503, QUEUE_FULL_ERROR)
            return
        work = self._stream(send, planned) if planned.stream else self._answer(send, planned)
        self.queued_sequences += planned.n
        try:
            await self._run_watched(receive, work)
        finally:
            self.queued_sequences -= planned.n

    def max_tokens_for(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """vLLM's ``get_max_tokens`` with this fake's generation config and override cap."""
        return max_tokens_for(
            self.max_model_len,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            default=self.default_max_tokens,
            cap=self.max_tokens_cap,
        )

    async def _decode(self, step: int) -> str:
        if self.token_delay:
            await asyncio.sleep(self.token_delay)
        if step == self.fail_after:
            # uvicorn drops the connection of an app that raises, as a crashed vLLM would
            raise RuntimeError("injected engine failure")
        self.generation_tokens_total += 1
        return token_text(step)

    async def _answer(self, send: Send, g: Generation) -> None:
        text = "".join([await self._decode(i) for i in range(g.tokens)])
        answer = completion_answer(g.chat, g.rid, self.served_name, text, g.n, g.usage)
        await respond(send, 200, dumps(answer))

    async def _stream(self, send: Send, g: Generation) -> None:
        head = stream_head(g.chat, g.rid, self.served_name)
        sse = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": sse})

        async def event(payload: dict[str, Any]) -> None:
            body = sse_event(payload)
            await send({"type": "http.response.body", "body": body, "more_body": True})

        prompt, counts = g.usage["prompt_tokens"], g.continuous  # the usage in every event
        if g.chat:  # vLLM opens a chat stream with the role, before any token
            for i in range(g.n):
                usage = token_usage(True, prompt, 0) if counts else None
                await event(stream_opening(head, i, usage))
        for step in range(g.tokens):
            text, last = await self._decode(step), step == g.tokens - 1
            usage = token_usage(g.chat, prompt, step + 1) if counts else None
            mark = last and not g.include_usage  # the fingerprint: no usage event to take it
            for i in range(g.n):
                t = stream_token(head, g.chat, i, text, last=last, usage=usage, fingerprint=mark)
                await event(t)
        if g.include_usage:
            await event(stream_usage(head, g.usage))
        await send({"type": "http.response.body", "body": SSE_DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def respond(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: bytes | None = b"application/json",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    all_headers = [(b"content-type", content_type)] if content_type is not None else []
    all_headers += headers or []
    if status not in (204, 304):
        all_headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def bound_socket(port: int = 0) -> socket.socket:
    """A listening-ready TCP socket on loopback (``port`` 0: a free one)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


class FakeServer:
    """Serves a :class:`FakeVllm` with uvicorn in a thread; restartable on the same port.

    ``app`` may be replaced while it runs (a fresh fake per test on a server kept for several):
    new requests go to the new one, those in progress finish with the old one.
    """

    def __init__(self, app: FakeVllm, port: int = 0) -> None:
        self.app = app
        self._sock: socket.socket | None = bound_socket(port)
        self.port: int = self._sock.getsockname()[1]
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> FakeServer:
        if self._server is not None:
            return self
        if self._sock is None:
            self._sock = bound_socket(self.port)
        config = uvicorn.Config(
            self._dispatch,
            interface="asgi3",
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        sock = self._sock
        self.app.closing = False
        self._thread = threading.Thread(
            target=server.run,
            kwargs={"sockets": [sock]},
            name=f"fake-vllm-{self.port}",
            daemon=True,
        )
        self._server = server
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the fake vLLM did not start")
            time.sleep(0.005)
        return self

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None or thread is None:
            return
        self.app.closing = True
        server.should_exit = True
        thread.join(10)
        with contextlib.suppress(OSError):
            if self._sock is not None:
                self._sock.close()
        self._sock = None  # a later start binds the same port again

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
