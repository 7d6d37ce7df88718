"""A hybrid model on the real vLLM: the sidecar against vLLM alone and against an older sidecar.

The tiny model's ``hybrid`` variant (``harness.tiny_model``: Qwen3-Next-shaped, three gated
delta-net linear-attention layers and one full-attention layer) on the CPU build, 80 blocks of
the 256 tokens vLLM aligns its block to. One burst, sent at once: 16 completions of 300-1,200
prompt tokens with 1,000-2,500 tokens to generate each (``ignore_eos``: every answer runs to
its ``max_tokens``), every other one streamed. At their peaks the 16 need about three times the
pool, so vLLM alone admits them by their prompts and preempts as they grow.

Configurations, each repetition in one round, the rounds in rotating order: ``direct`` (vLLM
alone), ``sidecar`` (the defaults, ``--policy queue`` with a 600 s queue wait) and
``sidecar-worst-case``; with ``--baseline REF``, the same two sidecar configurations of that
revision (run from a git worktree, ``bench.common.BaselineSidecar``) as ``REF-sidecar`` and
``REF-sidecar-worst-case``.

    python -m bench.hybrid [--repeat 3] [--baseline 1b2a6b7] [--suffix=-x]

Raw runs into ``bench/results/hybrid{suffix}-raw.json``; a table of medians and every
repetition on stdout. BENCHMARKS.md is written by hand from the raw file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    BaselineSidecar,
    queue_flags,
    read_vllm,
    reset_prefix_cache,
    wait_idle,
    wait_tokenizer,
    warm_up_vllm,
    worktree,
)
from harness.bench_util import RESULTS, load_average, machine, progress, write_json
from harness.vllm_cpu import VllmServer, ensure_model
from harness.workload import (
    Result,
    SidecarProcess,
    make_prompts,
    one_completion,
    summarize,
    vllm_preemptions,
)

POOL = 80
REQUESTS = 16
SEED = 11
SIDECARS = {
    "sidecar": queue_flags("queue"),
    "sidecar-worst-case": queue_flags("queue", "worst-case"),
}


def workload(model_dir: Path) -> list[dict[str, Any]]:
    """The burst's requests: prompt text, max_tokens and whether streamed, the same every run."""
    rng = random.Random(SEED)
    out = []
    for i in range(REQUESTS):
        tokens = rng.randint(300, 1200)
        (prompt,) = make_prompts(model_dir, 1, tokens, seed=SEED + i)
        out.append({"prompt": prompt, "max_tokens": rng.randint(1000, 2500), "stream": i % 2 == 0})
    return out


async def _send(url: str, requests: list[dict[str, Any]]) -> list[Result]:
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits, trust_env=False) as client:
        return list(
            await asyncio.gather(
                *(
                    one_completion(
                        client,
                        url,
                        r["prompt"],
                        max_tokens=r["max_tokens"],
                        stream=r["stream"],
                        model="tiny",
                    )
                    for r in requests
                )
            )
        )


@contextlib.contextmanager
def sampled(url: str, into: list[tuple[float, float, float]]) -> Iterator[None]:
    """vLLM's running count and KV use every 0.5 s while the body runs."""
    stop = threading.Event()

    def loop() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                m = read_vllm(httpx.get(url + "/metrics", timeout=5).text)
                at = round(time.monotonic() - t0, 2)
                into.append((at, m["num_requests_running"], m["kv_cache_usage_perc"]))
            stop.wait(0.5)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def run_one(
    server: VllmServer, config: str, requests: list[dict[str, Any]], tree: Path | None
) -> dict[str, Any]:
    """One run of ``config``: a fresh sidecar where it has one, the burst, vLLM's counters."""
    reset_prefix_cache(server.url)
    wait_idle(server.url)
    before = vllm_preemptions(server.url)
    samples: list[tuple[float, float, float]] = []
    sidecar: SidecarProcess | None = None
    if config != "direct":
        flags = SIDECARS[config.split("-", 1)[1] if tree is not None else config]
        sidecar = (
            BaselineSidecar(tree, server.url, *flags)
            if tree is not None
            else SidecarProcess(server.url, *flags)
        )
        sidecar.start()
        wait_tokenizer(sidecar)
    try:
        front = sidecar.url if sidecar is not None else server.url
        with sampled(server.url, samples):
            t0 = time.monotonic()
            results = asyncio.run(_send(front, requests))
            seconds = time.monotonic() - t0
        log = sidecar.log() if sidecar is not None else ""
    finally:
        if sidecar is not None:
            sidecar.stop()
    after = vllm_preemptions(server.url)
    running = [s[1] for s in samples]
    return {
        "config": config,
        "seconds": round(seconds, 2),
        "preemptions": after - before,
        "mean_running": round(statistics.fmean(running), 2) if running else None,
        "max_kv_use": max((s[2] for s in samples), default=None),
        "summary": summarize(results, seconds),
        "e2e": [round(r.seconds, 3) for r in results],
        "statuses": [r.status for r in results],
        "tokens": [r.completion_tokens for r in results],
        "sidecar_warnings": [line for line in log.splitlines() if "cannot size" in line][:3],
        "samples": samples,
    }


def table(runs: list[dict[str, Any]], configs: list[str], repeat: int) -> str:
    """Medians over repetitions with every repetition in brackets; goodput over direct's of
    the same round."""
    by = {(r["config"], r["round"]): r for r in runs}
    head = (
        "| configuration | goodput tok/s | / direct | preemptions | mean running | "
        "E2E p99 s | completed |\n|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for c in configs:
        reps = [by[(c, i)] for i in range(repeat) if (c, i) in by]

        def col(get: Any, fmt: str = "{:.1f}", reps: list[dict[str, Any]] = reps) -> str:
            vals = [get(r) for r in reps]
            each = ", ".join(fmt.format(v) for v in vals)
            return f"{fmt.format(statistics.median(vals))} ({each})"

        ratio = col(
            lambda r: (
                r["summary"]["goodput_tokens_per_s"]
                / by[("direct", r["round"])]["summary"]["goodput_tokens_per_s"]
            ),
            "{:.2f}",
        )
        done = sum(r["summary"]["completed"] for r in reps)
        rows.append(
            f"| {c} | {col(lambda r: r['summary']['goodput_tokens_per_s'], '{:.0f}')} | {ratio} "
            f"| {col(lambda r: r['preemptions'], '{:.0f}')} | {col(lambda r: r['mean_running'])} "
            f"| {col(lambda r: r['summary']['p99_latency_s'])} | {done}/{REQUESTS * len(reps)} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    cli = argparse.ArgumentParser(prog="python -m bench.hybrid", description=__doc__)
    cli.add_argument("--repeat", type=int, default=3)
    cli.add_argument("--baseline", help="a revision whose sidecar runs beside this one")
    cli.add_argument("--suffix", default="")
    args = cli.parse_args(argv)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between runs
    model_dir = ensure_model(variant="hybrid")
    requests = workload(model_dir)
    raw: dict[str, Any] = {
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_average()],
        "requests": [{k: v for k, v in r.items() if k != "prompt"} for r in requests],
        "runs": [],
    }
    with contextlib.ExitStack() as stack:
        tree = None
        configs = ["direct", *SIDECARS]
        if args.baseline:
            tree, sha = stack.enter_context(worktree(args.baseline))
            raw["baseline"] = sha
            configs += [f"{args.baseline}-{c}" for c in SIDECARS]
        server = stack.enter_context(
            VllmServer(
                num_gpu_blocks=POOL,
                max_model_len=4096,
                model_dir=model_dir,
                served_name="tiny",
            )
        )
        warm_up_vllm(server.url)
        for i in range(args.repeat):
            order = configs[i % len(configs) :] + configs[: i % len(configs)]
            for config in order:
                progress(f"hybrid: round {i + 1}/{args.repeat}, {config}")
                baseline = tree if config.startswith(f"{args.baseline}-") else None
                run = run_one(server, config, requests, baseline)
                run["round"] = i
                raw["runs"].append(run)
                write_json(f"hybrid{args.suffix}-raw", raw)
    raw["load_average_after"] = [round(x, 2) for x in load_average()]
    write_json(f"hybrid{args.suffix}-raw", raw)
    print(table(raw["runs"], configs, args.repeat))
    print(f"raw: {RESULTS / f'hybrid{args.suffix}-raw.json'}")


if __name__ == "__main__":
    main()
