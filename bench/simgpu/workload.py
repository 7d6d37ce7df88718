"""The simulated-GPU benchmark's engines and workloads.

Workloads are built in simulated (GPU) seconds and tokens; :func:`dilated` stretches their
arrival times by the engine's time scale before they are sent. Each request is a
:class:`bench.admission.workload.Request`, so the admission benchmark's client sends it
(retrying 429 and 503 as the openai client does). Where an answer ends at EOS, its length rides
in ``vllm_xargs.sim_output_tokens``, which the simulated executor reads and the sidecar never
does (the CPU benchmark's early-end shim plays that part there); where it runs to
``max_tokens`` (``ignore_eos``), nothing else is needed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from bench.admission.workload import (
    BATCH_PRIORITY,
    BATCH_TENANT,
    INTERACTIVE_TENANT,
    PRIORITY_RULES,
    TENANT_HEADER,
    Request,
    Workload,
)
from harness.tiny_model import WORDS

#: vLLM's KV pool keeps one null block out of use
NULL_BLOCKS = 1
BLOCK_SIZE = 16
MAX_MODEL_LEN = 32768
MAX_NUM_SEQS = 256
GPU_MEMORY_UTILIZATION = 0.9
#: tokens the tiny tokenizer spends on a prompt's unique head (a number) and BOS, beyond one
#: token per word
HEAD_TOKENS = 8
CONFIGS = ["direct", "sidecar-adaptive", "sidecar-worst-case"]
#: side experiments, run only when named in --configs: the same sidecars with a queue wait
#: long enough that no request times out in the queue (the CPU benchmark's --max-queue-wait 600)
#: and the default restarted into its --lengths-file (each repetition's file the next one's)
EXTRA_CONFIGS = [
    "sidecar-adaptive-long-wait",
    "sidecar-worst-case-long-wait",
    "sidecar-adaptive-warm",
]
LONG_QUEUE_WAIT = 600.0
#: the priority workload's configurations (issue 23, on this engine): the interactive stream
#: alone through the default sidecar, vLLM alone (first come, first served), the default
#: sidecar with one tenant (its plain FIFO queue) and with the classes (the batch tenant at
#: priority BATCH_PRIORITY under --priority-rules; not paced, the default, named once more as
#: ``sidecar-classes-unpaced``), and the same with --priority-pace 0.1 (the batch's prompts
#: paced to vLLM's prefill: ``sidecar-classes-paced``);
#: priority (lower first) under --priority-rules; and on a vLLM of their own started with
#: --scheduling-policy priority, vLLM alone with each request's priority in its body
#: (``vllm-priority``) and the classes forwarded to it (``sidecar-classes-vllm-priority``;
#: paced as well: ``sidecar-classes-paced-vllm-priority``); and the classes paced at 0.02 s
#: (``sidecar-classes-paced-tight``), 0.01 s (``-paced-10ms``) and 0.005 s (``-paced-5ms``)
PRIORITY_CONFIGS = [
    "sidecar-alone",
    "direct",
    "sidecar-one-tenant",
    "sidecar-classes",
    "sidecar-classes-paced",
    "sidecar-classes-unpaced",
    "vllm-priority",
    "sidecar-classes-vllm-priority",
    "sidecar-classes-paced-vllm-priority",
    "sidecar-classes-paced-tight",
    "sidecar-classes-paced-10ms",
    "sidecar-classes-paced-5ms",
]
#: each priority configuration's sidecar flags besides the defaults
PRIORITY_SIDECARS: dict[str, list[str]] = {
    "sidecar-alone": [],
    "sidecar-one-tenant": [],
    "sidecar-classes": ["--priority-rules", PRIORITY_RULES],
    "sidecar-classes-paced": ["--priority-rules", PRIORITY_RULES, "--priority-pace", "0.1"],
    "sidecar-classes-unpaced": ["--priority-rules", PRIORITY_RULES, "--priority-pace", "0"],
    "sidecar-classes-vllm-priority": ["--priority-rules", PRIORITY_RULES, "--forward-priority"],
    "sidecar-classes-paced-tight": ["--priority-rules", PRIORITY_RULES, "--priority-pace", "0.02"],
    "sidecar-classes-paced-10ms": ["--priority-rules", PRIORITY_RULES, "--priority-pace", "0.01"],
    "sidecar-classes-paced-5ms": ["--priority-rules", PRIORITY_RULES, "--priority-pace", "0.005"],
    "sidecar-classes-paced-vllm-priority": [
        "--priority-rules",
        PRIORITY_RULES,
        "--forward-priority",
        "--priority-pace",
        "0.1",
    ],
}
#: vLLM's flags for the configurations that run on a vLLM of their own (by suffix)
VLLM_PRIORITY_ARGS = ["--scheduling-policy", "priority"]
#: side experiments on the priority workload, run only when named in --configs: a priority
#: configuration with ``-lpt`` appended (``sidecar-alone-lpt``, ``sidecar-classes-paced-lpt``...)
#: runs on a vLLM of its own whose scheduler gives one request's prefill at most this many tokens
#: a step (vLLM's --long-prefill-token-threshold; its scheduler floors it at the step's budget
#: over the requests it holds), so that a batch prompt's chunks leave room in each step for an
#: interactive request's prefill
LONG_PREFILL_THRESHOLD = 512
LPT_SUFFIX = "-lpt"
#: ... and with ``-lpt256`` appended, on a vLLM whose threshold is 256
LPT_THRESHOLDS = {"-lpt256": 256, LPT_SUFFIX: LONG_PREFILL_THRESHOLD}
LPT_CONFIGS = [c + suffix for suffix in LPT_THRESHOLDS for c in PRIORITY_CONFIGS]


def _lpt_suffix(config: str) -> str:
    return next((s for s in LPT_THRESHOLDS if config.endswith(s)), "")


def base_config(config: str) -> str:
    """``config`` without an ``-lpt`` suffix: what it runs, on whichever vLLM."""
    suffix = _lpt_suffix(config)
    return config.removesuffix(suffix) if suffix else config


def server_flags(config: str) -> list[str]:
    """The vLLM flags ``config`` needs beyond the engine's (configurations that need the same
    flags share a server)."""
    flags = list(VLLM_PRIORITY_ARGS) if base_config(config).endswith("vllm-priority") else []
    if suffix := _lpt_suffix(config):
        flags += ["--long-prefill-token-threshold", str(LPT_THRESHOLDS[suffix])]
    return flags


WORKLOADS = ["chat", "burst", "thrash", "thrash-long", "poisson", "priority"]
#: the sidecar's time-valued defaults (seconds), multiplied by the engine's time scale so that
#: they mean the same span of simulated time (its 0.5 s scrape is 0.5 simulated seconds)
SIDECAR_TIMES = {"--scrape-interval": 0.5, "--metrics-stale-after": 5.0, "--max-queue-wait": 300.0}


@dataclass(frozen=True)
class Engine:
    """One simulated GPU deployment: a model config, a GPU, tensor parallelism."""

    name: str
    title: str
    model: str  # harness/models/NAME.json
    gpu: str = "h100-80gb"
    tp: int = 1

    def args(self, num_gpu_blocks: int | None, time_scale: float) -> list[str]:
        """vLLM's flags (and the simulation's) for a server of this engine."""
        args = [
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--gpu-memory-utilization",
            str(GPU_MEMORY_UTILIZATION),
            "--served-model-name",
            "tiny",  # what bench.admission's client names
            "--sim-time-scale",
            f"{time_scale:g}",
        ]
        if self.tp > 1:
            args += ["--tensor-parallel-size", str(self.tp)]
        if num_gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
        return args


ENGINES = {
    "8b": Engine("8b", "Llama-3.1-8B-Instruct on one H100 80 GB", "llama-3.1-8b-instruct"),
    "70b": Engine(
        "70b", "Llama-3.1-70B-Instruct on 8 H100 80 GB (TP 8)", "llama-3.1-70b-instruct", tp=8
    ),
    # every layer slides over the last 4,096 tokens: vLLM frees what leaves the window
    "mistral": Engine("mistral", "Mistral-7B-v0.1 on one H100 80 GB", "mistral-7b-v0.1"),
}


@dataclass
class SimWorkload:
    """A workload in simulated time, with what its engine runs it at."""

    workload: Workload
    time_scale: float
    #: the pool to pin (``--num-gpu-blocks-override``), None: vLLM sizes it at 0.9
    num_gpu_blocks: int | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.workload.name


def dilated(workload: Workload, scale: float) -> Workload:
    """``workload`` with every arrival ``scale`` times later (rates divided by the scale)."""
    return replace(workload, requests=[replace(r, at=r.at * scale) for r in workload.requests])


class Prompts:
    """Distinct texts of about a given number of tokens of the tiny tokenizer (one per word,
    plus :data:`HEAD_TOKENS` for a unique head: vLLM's prefix cache shares no block between
    two of them)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def text(self, tokens: int) -> str:
        words = max(1, tokens - HEAD_TOKENS)
        head = str(self.rng.randint(10**8, 10**9))
        return head + " " + " ".join(self.rng.choice(WORDS) for _ in range(words))


def _xargs(length: int) -> dict[str, Any]:
    return {"vllm_xargs": {"sim_output_tokens": length}}


def chat_request(at: float, p: Prompts, rng: random.Random, *, stream: bool) -> Request:
    """A chat without max_tokens: a 200-2,000-token message, an answer of 30-600 tokens at EOS."""
    prompt, answer = rng.randint(200, 2000), rng.randint(30, 600)
    body = {"messages": [{"role": "user", "content": p.text(prompt)}], **_xargs(answer)}
    # the client asks for the usage chunk of a streamed answer itself
    return Request(
        at, "/v1/chat/completions", body, output_tokens=answer, kind="chat:none", stream=stream
    )


def random_request(at: float, p: Prompts, rng: random.Random) -> Request:
    """``vllm bench serve --dataset-name random``-like: 256-2,048 tokens in, 128-1,024 out, the
    answer running to its max_tokens (``ignore_eos``); not streamed."""
    prompt, answer = rng.randint(256, 2048), rng.randint(128, 1024)
    body = {"prompt": p.text(prompt), "max_tokens": answer, "ignore_eos": True}
    return Request(at, "/v1/completions", body, kind="random", stream=False)


def chat_workload(count: int, rate: float, seed: int = 101) -> Workload:
    rng, p = random.Random(seed), Prompts(seed + 1)
    reqs, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        reqs.append(chat_request(t, p, rng, stream=True))
    return Workload(
        "chat",
        "Chat without max_tokens, streamed",
        f"{count} chats arriving as a Poisson process at {rate:g}/s (simulated), none naming "
        "max_tokens (vLLM lets each run to the end of the 32k context): a 200-2,000-token "
        "user message (uniform), an answer of 30-600 tokens (uniform) ending at EOS; streamed "
        "token by token with `stream_options.include_usage`.",
        reqs,
    )


def burst_workload(count: int, seed: int = 202) -> Workload:
    rng, p = random.Random(seed), Prompts(seed + 1)
    reqs = [random_request(0.0, p, rng) for _ in range(count)]
    return Workload(
        "burst",
        "`vllm bench serve`-like random burst",
        f"{count} completions sent at once (`--request-rate inf`), 256-2,048 prompt tokens "
        "and 128-1,024 output tokens (uniform), `max_tokens` the output length with "
        "`ignore_eos` (fixed lengths: worst case is exact), not streamed.",
        reqs,
    )


#: the thrash workload's max_tokens: a cap above every answer (they end at EOS before it)
THRASH_MAX_TOKENS = 2560


def thrash_workload(
    count: int,
    answers: tuple[int, int] = (1500, 2500),
    seed: int = 303,
    prompts: tuple[int, int] = (2000, 4000),
    name: str = "thrash",
    max_tokens: int = THRASH_MAX_TOKENS,
) -> Workload:
    rng, p = random.Random(seed), Prompts(seed + 1)
    reqs = []
    for _ in range(count):
        prompt, answer = rng.randint(*prompts), rng.randint(*answers)
        body = {"prompt": p.text(prompt), "max_tokens": max_tokens, **_xargs(answer)}
        reqs.append(
            Request(0.0, "/v1/completions", body, output_tokens=answer, kind="long", stream=False)
        )
    return Workload(
        name,
        "Thrash: long prompts, long answers, a pool for half the burst",
        f"{count} completions sent at once, {prompts[0]:,}-{prompts[1]:,} prompt tokens and "
        f"answers of {answers[0]:,}-{answers[1]:,} tokens (uniform) ending at EOS under "
        f"`max_tokens` {max_tokens}, "
        "not streamed; the pool (`--num-gpu-blocks-override`) holds about half of the burst "
        "at its peak. vLLM admits by the prompt, runs dry mid-decode and preempts, and each "
        "preemption recomputes thousands of tokens.",
        reqs,
    )


#: each thrash workload's (prompt tokens, answer tokens, max_tokens). ``thrash-long``: prompts
#: whose recompute costs a third of a second or more of prefill on the 8B, and answers half as
#: long as them, so that a sequence grows by half once vLLM has admitted it by its prompt (with
#: answers a tenth of their prompts, 16,000-24,000 and 1,500-2,500, vLLM preempted twice in a
#: run: bench/results/simgpu-thrashlong-16k.log)
THRASH_SHAPES: dict[str, tuple[tuple[int, int], tuple[int, int], int]] = {
    "thrash": ((2000, 4000), (1500, 2500), THRASH_MAX_TOKENS),
    "thrash-long": ((8000, 12000), (4000, 6000), 6144),
}


def poisson_workload(count: int, rate: float, seed: int = 404) -> Workload:
    rng, p = random.Random(seed), Prompts(seed + 1)
    reqs, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        if rng.random() < 0.5:
            reqs.append(chat_request(t, p, rng, stream=True))
        else:
            reqs.append(random_request(t, p, rng))
    return Workload(
        "poisson",
        "Poisson mix of chats and random completions",
        f"{count} requests arriving as a Poisson process at {rate:g}/s (simulated), half "
        "chats as in `chat` (streamed, no max_tokens, EOS at 30-600 tokens), half "
        "completions as in `burst` (not streamed, fixed lengths).",
        reqs,
    )


#: the priority workload's interactive stream lasts this long (simulated seconds): about as long
#: as the batch burst takes on the 8B's pinned pool
PRIORITY_STREAM_S = 40.0
#: ... and its pool: a quarter of the batch burst at its peak (the batch queues deep, in the
#: sidecar or in vLLM)
PRIORITY_POOL_BLOCKS = 8000


def priority_workload(count: int, rate: float, seed: int = 505) -> Workload:
    """Issue 23's workload on this engine: a batch tenant's burst with an interactive tenant's
    Poisson stream beside it (bench.admission's ``priority``, at GPU sizes)."""
    rng, p = random.Random(seed), Prompts(seed + 1)
    reqs = []
    for _ in range(count):
        prompt, answer = rng.randint(1000, 2000), rng.randint(512, 1024)
        body = {"prompt": p.text(prompt), "max_tokens": answer, "ignore_eos": True}
        reqs.append(
            Request(
                0.0,
                "/v1/completions",
                body,
                kind="batch",
                stream=False,
                headers={TENANT_HEADER: BATCH_TENANT},
                priority=BATCH_PRIORITY,
            )
        )
    t = rng.expovariate(rate)
    while t < PRIORITY_STREAM_S:
        prompt, answer = rng.randint(200, 800), rng.randint(64, 256)
        body = {
            "messages": [{"role": "user", "content": p.text(prompt)}],
            "max_tokens": 512,
            **_xargs(answer),
        }
        reqs.append(
            Request(
                t,
                "/v1/chat/completions",
                body,
                output_tokens=answer,
                kind="interactive",
                headers={TENANT_HEADER: INTERACTIVE_TENANT},
                priority=0,
            )
        )
        t += rng.expovariate(rate)
    chats = len(reqs) - count
    return Workload(
        "priority",
        "A batch tenant's burst beside an interactive tenant's stream",
        f"{count} completions of tenant `{BATCH_TENANT}` sent at once (1,000-2,000 prompt "
        "tokens, max_tokens 512-1,024 with `ignore_eos`: every answer runs to it; not "
        f"streamed) on a pool pinned to {PRIORITY_POOL_BLOCKS:,} blocks, and beside them "
        f"{chats} chats of tenant `{INTERACTIVE_TENANT}` arriving as a Poisson process at "
        f"{rate:g}/s over {PRIORITY_STREAM_S:g} simulated seconds (a 200-800-token message, "
        "an answer of 64-256 tokens at EOS under max_tokens 512, streamed); every request "
        f"names its tenant in `{TENANT_HEADER}`.",
        reqs,
    )


def prompt_tokens(req: Request) -> int:
    """The request's prompt tokens as built (one per word plus the head; a chat's template
    adds a few more)."""
    text = req.body.get("prompt") or req.body["messages"][-1]["content"]
    return len(str(text).split()) - 1 + HEAD_TOKENS


def peak_blocks(workload: Workload) -> int:
    """The burst's peak: every request holding its prompt and whole answer at once."""
    return sum(
        math.ceil((prompt_tokens(r) + r.true_tokens) / BLOCK_SIZE) for r in workload.requests
    )


def thrash_pool(workload: Workload) -> int:
    """A pool that holds about half of ``workload``'s burst at its peak (plus the null block),
    and never less than one whole context (vLLM refuses to start on less)."""
    half = math.ceil(peak_blocks(workload) / 2)
    return max(half, math.ceil(MAX_MODEL_LEN / BLOCK_SIZE)) + NULL_BLOCKS


#: (count, rate) per workload: the full run, and --quick
SIZES: dict[str, dict[str, tuple[int, float]]] = {
    "full": {
        "chat": (150, 60.0),
        "burst": (256, 0.0),
        "thrash": (64, 0.0),
        "thrash-long": (24, 0.0),
        "poisson": (160, 20.0),
        "priority": (200, 2.0),
    },
    "quick": {
        "chat": (48, 30.0),
        "burst": (48, 0.0),
        "thrash": (24, 0.0),
        "thrash-long": (12, 0.0),
        "poisson": (48, 20.0),
        "priority": (40, 2.0),
    },
}
#: --quick's thrash answers: a smoke run of the same shape in a few seconds of simulated time
QUICK_THRASH_ANSWERS = (300, 500)
#: the time scale each workload runs at: streamed workloads need more CPU per step
TIME_SCALES = {
    "chat": 2.0,
    "burst": 1.0,
    "thrash": 1.0,
    "thrash-long": 1.0,
    "poisson": 2.0,
    "priority": 2.0,
}


def build(name: str, quick: bool, scale: float | None = None) -> SimWorkload:
    count, rate = SIZES["quick" if quick else "full"][name]
    time_scale = TIME_SCALES[name] if scale is None else scale
    if name == "chat":
        return SimWorkload(chat_workload(count, rate), time_scale)
    if name == "burst":
        return SimWorkload(burst_workload(count), time_scale)
    if name == "poisson":
        return SimWorkload(poisson_workload(count, rate), time_scale)
    if name in THRASH_SHAPES:
        prompts, answers, max_tokens = THRASH_SHAPES[name]
        answers = QUICK_THRASH_ANSWERS if quick else answers
        wl = thrash_workload(count, answers, prompts=prompts, name=name, max_tokens=max_tokens)
        pool = thrash_pool(wl)
        facts = {"peak_blocks": peak_blocks(wl), "pool_blocks": pool}
        return SimWorkload(wl, time_scale, num_gpu_blocks=pool, facts=facts)
    if name == "priority":
        wl = priority_workload(count, rate)
        pool = PRIORITY_POOL_BLOCKS + NULL_BLOCKS
        return SimWorkload(wl, time_scale, num_gpu_blocks=pool, facts={"pool_blocks": pool})
    raise KeyError(name)
