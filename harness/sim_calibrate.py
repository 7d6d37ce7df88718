"""Calibrate the simulated engine: one workload against a real vLLM and the simulation, ratios.

    python -m harness.sim_calibrate --real-url http://gpu-host:8000 --gpu h100-80gb \\
        --model-config harness/models/llama-3.1-8b-instruct.json [--tp 1] \\
        [--concurrency 1,4,16,64] [--input-len 1024] [--output-len 128] [--requests 8]

It starts the simulation for the same config and GPU (``harness.sim_server``; or uses
``--sim-url``), then at each concurrency runs the same closed loop against both: that many
clients, each sending ``--requests`` streamed completions of exactly ``--input-len`` prompt
tokens (token ids, so both tokenizers see the same length) and ``--output-len`` output tokens
(``ignore_eos``). It prints, per level, the real and simulated figures and their ratio:

- per step, as vLLM itself measures them (its histograms, differences over the level):
  ``vllm:inter_token_latency_seconds`` (one decode step per token) and
  ``vllm:request_prefill_time_seconds`` (the prefill steps of a request);
- end to end, as the client sees them: time to first token, time per output token after the
  first, request latency, output tokens per second.

A ratio above 1 means the simulation is slower than the real engine. Run it on the GPU
machine's host or anywhere that reaches both servers; the prompts use token ids below 500, which
every tokenizer has. ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.gpus import gpu
from harness.sim_cost import ModelShape, SeqWork

#: vLLM histograms read as per-step figures (mean over the level: sum / count differences)
STEP_HISTOGRAMS = {
    "itl_step_s": "vllm:inter_token_latency_seconds",
    "prefill_s": "vllm:request_prefill_time_seconds",
}


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float
    tpot_s: float | None
    latency_s: float
    output_tokens: int


def histogram_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """``name -> (sum, count)`` of every histogram, summed over label sets (engines)."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.type != "histogram":
            continue
        acc = out.setdefault(family.name, [0.0, 0.0])
        for s in family.samples:
            if s.name == family.name + "_sum":
                acc[0] += s.value
            elif s.name == family.name + "_count":
                acc[1] += s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def step_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float | None]:
    """Mean of each step histogram over what happened between two scrapes."""
    means: dict[str, float | None] = {}
    for key, name in STEP_HISTOGRAMS.items():
        s0, c0 = before.get(name, (0.0, 0.0))
        s1, c1 = after.get(name, (0.0, 0.0))
        means[key] = (s1 - s0) / (c1 - c0) if c1 > c0 else None
    return means


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int
) -> RequestTiming:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            elif chunk.get("choices") and first is None:
                first = time.monotonic()
    ended = time.monotonic()
    ttft = (first or ended) - started
    tpot = (ended - (first or ended)) / (tokens - 1) if tokens > 1 else None
    return RequestTiming(ttft, tpot, ended - started, tokens)


async def run_level(
    url: str, model: str, concurrency: int, requests: int, input_len: int, output_len: int
) -> dict[str, float | None]:
    """One closed-loop level against one server: client timings and vLLM's step means."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        before = histogram_totals((await client.get(url + "/metrics")).text)
        started = time.monotonic()

        async def worker(w: int) -> list[RequestTiming]:
            out = []
            for r in range(requests):
                # distinct prompts, across levels too (no prefix-cache hits): ids 10..499
                seed = concurrency * 100_003 + w * requests + r
                prompt = [10 + (seed * 7919 + i * 31) % 490 for i in range(input_len)]
                out.append(await one_request(client, url, model, prompt, output_len))
            return out

        timings = [t for ts in await asyncio.gather(*map(worker, range(concurrency))) for t in ts]
        wall = time.monotonic() - started
        after = histogram_totals((await client.get(url + "/metrics")).text)
    tpots = [t.tpot_s for t in timings if t.tpot_s is not None]
    return {
        **step_means(before, after),
        "ttft_s": statistics.median(t.ttft_s for t in timings),
        "tpot_s": statistics.median(tpots) if tpots else None,
        "latency_s": statistics.median(t.latency_s for t in timings),
        "output_tok_per_s": sum(t.output_tokens for t in timings) / wall,
    }


def served_model(url: str) -> tuple[str, int]:
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return str(models[0]["id"]), int(models[0].get("max_model_len") or 0)


def ratio_rows(
    levels: list[int], real: list[dict[str, float | None]], sim: list[dict[str, float | None]]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for level, r, s in zip(levels, real, sim, strict=True):
        for key in r:
            rv, sv = r[key], s[key]
            ratio = sv / rv if rv and sv is not None else None
            if key == "output_tok_per_s" and ratio:
                ratio = 1 / ratio  # slower simulation: ratio above 1 throughout
            rows.append(
                {"concurrency": level, "figure": key, "real": rv, "sim": sv, "sim_slower": ratio}
            )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    def f(v: float | None, digits: int = 4) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    lines = [f"{'conc':>5} {'figure':<18} {'real':>10} {'sim':>10} {'sim/real':>9}"]
    for row in rows:
        lines.append(
            f"{row['concurrency']:>5} {row['figure']:<18} {f(row['real']):>10} "
            f"{f(row['sim']):>10} {f(row['sim_slower'], 3):>9}"
        )
    return "\n".join(lines)


def probe_batch(case: dict[str, Any]) -> list[SeqWork]:
    """The batch a :mod:`harness.gpu_probe` case timed, as the cost model takes it."""
    kind = case["kind"]
    if kind == "decode":
        return [SeqWork(1, int(case["context"]) - 1)] * int(case["batch"])
    if kind == "prefill":
        return [SeqWork(int(case["tokens"]), 0)] * int(case["sequences"])
    if kind == "chunk":
        return [SeqWork(int(case["tokens"]), int(case["context"]))]
    if kind == "mixed":
        decode = [SeqWork(1, int(case["context"]) - 1)] * int(case["batch"])
        return [*decode, SeqWork(int(case["tokens"]), 0)]
    raise ValueError(f"unknown probe case kind {kind!r}")


def probe_rows(probe: dict[str, Any], gpu_name: str, model_config: str) -> list[dict[str, Any]]:
    """Each measured case of a probe against ``step_cost`` for the same batch.

    The probe times one tensor-parallel rank without its all-reduces, so the simulated figure
    compared is the step's linear, attention and overhead parts (its all-reduce is shown apart).
    """
    from harness.sim_cost import step_cost
    from harness.sim_server import model_config as config_path

    model = ModelShape.from_config(json.loads(config_path(model_config).read_text()))
    spec = gpu(gpu_name)
    tp = int(probe.get("tp", 1))
    rows = []
    for case in probe["cases"]:
        if "seconds" not in case:
            continue
        batch = probe_batch(case)
        cost = step_cost(model, spec, batch, tp=tp)
        sim = cost.seconds - cost.allreduce_seconds
        real = float(case["seconds"])
        rows.append(
            {
                "case": " ".join(
                    f"{k}={v}" for k, v in case.items() if k not in ("seconds", "samples_s")
                ),
                "tokens": sum(w.new_tokens for w in batch),
                "real_s": real,
                "sim_s": sim,
                "sim_over_real": sim / real,
                "allreduce_s": cost.allreduce_seconds,
                "bytes_per_s": (cost.weight_bytes + cost.kv_bytes) / real,
                "flops_per_s": (cost.linear_flops + cost.attention_flops) / real,
            }
        )
    return rows


def format_probe(probe: dict[str, Any], gpu_name: str, rows: list[dict[str, Any]]) -> str:
    spec = gpu(gpu_name)
    head = (
        f"{probe.get('device')} ({probe.get('model_config')}, tp {probe.get('tp', 1)}, "
        f"torch {probe.get('torch')}): copy {probe['copy_bytes_per_second'] / 1e12:.2f} TB/s "
        f"({probe['copy_bytes_per_second'] / spec.hbm_bytes_per_second:.0%} of {spec.name}'s "
        f"{spec.hbm_bytes_per_second / 1e12:.2f}), bf16 GEMM "
        f"{probe['bf16_gemm_flops_per_second'] / 1e12:.0f} TFLOP/s "
        f"({probe['bf16_gemm_flops_per_second'] / spec.bf16_dense_flops_per_second:.0%} of "
        f"{spec.bf16_dense_flops_per_second / 1e12:.0f})"
    )
    lines = [
        head,
        f"{'case':<44} {'real ms':>9} {'sim ms':>9} {'sim/real':>8} {'TB/s':>6} {'TFLOP/s':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r['case']:<44} {r['real_s'] * 1e3:>9.2f} {r['sim_s'] * 1e3:>9.2f} "
            f"{r['sim_over_real']:>8.2f} {r['bytes_per_s'] / 1e12:>6.2f} "
            f"{r['flops_per_s'] / 1e12:>8.0f}"
        )
    return "\n".join(lines)


@contextmanager
def simulation(args: argparse.Namespace, max_model_len: int) -> Iterator[str]:
    if args.sim_url:
        yield args.sim_url
        return
    from harness.sim_server import SimServer

    extra = ["-tp", str(args.tp)] if args.tp > 1 else []
    with SimServer(
        model=args.model_config,
        gpu=args.gpu,
        max_model_len=max_model_len or None,
        extra_args=extra,
    ) as sim:
        yield sim.url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.sim_calibrate", description=__doc__)
    p.add_argument("--real-url", default="", help="a real (GPU) vLLM serving the model")
    p.add_argument(
        "--probe",
        default="",
        help="instead of a real vLLM: a harness.gpu_probe JSON, printed against step_cost",
    )
    p.add_argument("--sim-url", default="", help="a simulation already running (else started)")
    p.add_argument("--gpu", default="h100-80gb")
    p.add_argument("--model-config", default="llama-3.1-8b-instruct")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests", type=int, default=8, help="requests per client per level")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.probe:
        try:
            probe = json.loads(Path(args.probe).read_text())
            rows = probe_rows(probe, args.gpu, args.model_config)
        except (OSError, ValueError, KeyError) as exc:
            print(f"sim_calibrate: {args.probe}: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(rows) if args.json else format_probe(probe, args.gpu, rows))
        return 0
    if not args.real_url:
        print("sim_calibrate: give --real-url or --probe", file=sys.stderr)
        return 2
    levels = [int(c) for c in args.concurrency.split(",") if c]
    real_model, max_model_len = served_model(args.real_url)
    with simulation(args, max_model_len) as sim_url:
        sim_model, _ = served_model(sim_url)
        real, sim = [], []
        for level in levels:
            for url, model, out in ((args.real_url, real_model, real), (sim_url, sim_model, sim)):
                out.append(
                    asyncio.run(
                        run_level(url, model, level, args.requests, args.input_len, args.output_len)
                    )
                )
    rows = ratio_rows(levels, real, sim)
    print(json.dumps(rows) if args.json else format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
