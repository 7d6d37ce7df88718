"""The admission benchmark's workloads (six, each sent unchanged to every configuration; and
``priority``, with its own configurations) and the engine and configurations they run on."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from harness.tiny_model import WORDS
from harness.workload import make_prompts

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
    "sidecar-adaptive-queue",
    "sidecar-adaptive-reject",
    #: the sidecar relaying and accounting, gating nothing (``--policy observe``): against direct,
    #: what the relay alone costs; against adaptive, what admission costs
    "sidecar-adaptive-observe",
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

#: the priority workload (``--workloads priority``, not in the default run): a batch tenant's
#: burst beside an interactive tenant's Poisson stream, on its own configurations. Full-run
#: sizes: batch requests, their prompt tokens and max_tokens; interactive arrivals per second,
#: the stream's seconds, its max_tokens
PRIORITY_SIZE = (200, 128, 256, 1.0, 60.0, 48)
PRIORITY_QUICK_SIZE = (40, 128, 160, 1.0, 15.0, 48)
BATCH_TENANT, INTERACTIVE_TENANT = "batch", "chat"
BATCH_PRIORITY = 10  # the batch tenant's class under --priority-rules (the interactive one: 0)
PRIORITY_RULES = f"tenant:{BATCH_TENANT}={BATCH_PRIORITY}"
TENANT_HEADER = "x-kv-sidecar-tenant"
#: the priority workload's configurations, and each sidecar's flags besides queue_flags("queue",
#: its reservation) (``direct`` and ``vllm-priority`` have no sidecar; ``vllm-priority`` is a
#: vLLM of its own, started with --scheduling-policy priority)
PRIORITY_CONFIGS = [
    "sidecar-alone",
    "direct",
    "vllm-priority",
    "sidecar-one-tenant",
    "sidecar-tenants",
    "sidecar-classes",
    "sidecar-classes-worst-case",
]
#: run only when named in --configs: batch capped at TENANT_MAX_SHARE of the budget (what one
#: tenant may reserve), so that the interactive class finds room without waiting for a batch
#: answer; the classes with the batch's prompts not paced into vLLM (--priority-pace 0, the
#: default since it was measured here), and paced (--priority-pace 0.1)
PRIORITY_EXTRA_CONFIGS = [
    "sidecar-classes-capped",
    "sidecar-classes-unpaced",
    "sidecar-classes-paced",
]
TENANT_MAX_SHARE = 0.8
PRIORITY_SIDECARS: dict[str, tuple[str | None, list[str]]] = {
    "sidecar-alone": (None, []),
    "sidecar-one-tenant": (None, []),
    "sidecar-tenants": (None, []),
    "sidecar-classes": (None, ["--priority-rules", PRIORITY_RULES]),
    "sidecar-classes-worst-case": ("worst-case", ["--priority-rules", PRIORITY_RULES]),
    "sidecar-classes-capped": (
        None,
        ["--priority-rules", PRIORITY_RULES, "--tenant-max-share", str(TENANT_MAX_SHARE)],
    ),
    "sidecar-classes-unpaced": (None, ["--priority-rules", PRIORITY_RULES, "--priority-pace", "0"]),
    "sidecar-classes-paced": (
        None,
        ["--priority-rules", PRIORITY_RULES, "--priority-pace", "0.1"],
    ),
}


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
    headers: dict[str, str] = field(default_factory=dict)  # sent with every attempt
    #: the body's ``priority`` under ``vllm-priority`` (vLLM's own field: lower first)
    priority: int | None = None

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
                {"prompt": prompt, "max_tokens": max_tokens},
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
                    {"messages": [{"role": "user", "content": user}]},
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
                    {"prompt": prompt},
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
        f"{COMPLETIONS_DEFAULT_MAX_TOKENS}, is their real length). No request sets `ignore_eos`: "
        "the shim ends each chat at a real end of sequence. Worst case reserves the whole context "
        "for every chat.",
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
            }
            req = Request(t, "/v1/chat/completions", body, rng.randint(8, 64), kind="chat:64")
        elif u < 0.55:  # long completion
            body = {"prompt": long[i], "max_tokens": 600}
            real = math.ceil(rng.uniform(0.3, 1.0) * 600)
            req = Request(t, "/v1/completions", body, real, kind="completions:600")
        elif u < 0.75:  # chat without max_tokens
            body = {
                "messages": [{"role": "user", "content": _words(rng, tok, rng.randint(100, 200))}],
            }
            req = Request(t, "/v1/chat/completions", body, rng.randint(32, 300), kind="chat:none")
        elif u < 0.85:  # completion without max_tokens (vLLM: 16)
            body = {"prompt": short[i]}
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


def priority_workload(model: Path, quick: bool) -> Workload:
    count, prompt_tokens, max_tokens, rate, stream_s, chat_tokens = (
        PRIORITY_QUICK_SIZE if quick else PRIORITY_SIZE
    )
    rng = random.Random(89)
    tok = _tokenizer(model)
    reqs = [
        Request(
            0.0,
            "/v1/completions",
            {"prompt": p, "max_tokens": max_tokens, "ignore_eos": True},
            kind="batch",
            headers={TENANT_HEADER: BATCH_TENANT},
            priority=BATCH_PRIORITY,
        )
        for p in make_prompts(model, count, prompt_tokens, seed=97)
    ]
    t = rng.expovariate(rate)
    while t < stream_s:
        body = {
            "messages": [{"role": "user", "content": _words(rng, tok, rng.randint(30, 80))}],
            "max_tokens": chat_tokens,
            "ignore_eos": True,
        }
        reqs.append(
            Request(
                t,
                "/v1/chat/completions",
                body,
                kind="interactive",
                headers={TENANT_HEADER: INTERACTIVE_TENANT},
                priority=0,
            )
        )
        t += rng.expovariate(rate)
    chats = len(reqs) - count
    peak = math.ceil((prompt_tokens + max_tokens) / BLOCK_SIZE)
    return Workload(
        "priority",
        "A batch tenant's burst beside an interactive tenant's stream",
        f"{count} completions of tenant `{BATCH_TENANT}` sent at once ({prompt_tokens}-token "
        f"prompts, max_tokens {max_tokens}, `ignore_eos`: every answer runs to max_tokens; "
        f"{count} x {peak} = {count * peak} blocks at peak on a pool of {CAPACITY_BLOCKS}, "
        f"{count * peak / CAPACITY_BLOCKS:.1f} times over), and beside them {chats} chats of "
        f"tenant `{INTERACTIVE_TENANT}` arriving as a Poisson process at {rate:g}/s over "
        f"{stream_s:g} s (a 30-80-token user message, max_tokens {chat_tokens}, `ignore_eos`); "
        f"every request names its tenant in `{TENANT_HEADER}`, all streamed.",
        reqs,
    )


def priority_variant(config: str, workload: Workload) -> Workload:
    """What configuration ``config`` of the priority workload sends: the interactive stream
    alone (``sidecar-alone``), no tenant header (``sidecar-one-tenant``: one tenant, the plain
    FIFO), each request's ``priority`` in its body (``vllm-priority``), else the workload as
    built."""
    reqs = workload.requests
    if config == "sidecar-alone":
        reqs = [r for r in reqs if r.kind == "interactive"]
    elif config == "sidecar-one-tenant":
        reqs = [replace(r, headers={}) for r in reqs]
    elif config == "vllm-priority":
        reqs = [replace(r, body={**r.body, "priority": r.priority}) for r in reqs]
    return replace(workload, requests=reqs)


BUILDERS: dict[str, Callable[[Path, bool], Workload]] = {
    "burst": burst_workload,
    "poisson": poisson_workload,
    "chat": chat_workload,
    "no-max-tokens": no_max_tokens_workload,
    "staggered": staggered_workload,
    "mixed": mixed_workload,
    "priority": priority_workload,
}
