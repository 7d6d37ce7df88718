"""The simulated-GPU benchmark's section of BENCHMARKS.md: how the run was made, one table per
engine and workload (every figure a median with each repetition in brackets), and the thrash
workload's targets."""

from __future__ import annotations

from typing import Any

from bench.admission.figures import paired_ratio
from harness.bench_util import fmt, machine_line, table

#: the thrash workload's targets for the sidecar's default against direct
GOODPUT_TARGET = 1.2
E2E_P99_TARGET = 0.7
DEFAULT = "sidecar-adaptive"


def cell(f: dict[str, Any], key: str, digits: int, scale: float = 1.0) -> str:
    """The median and, in brackets, every repetition."""
    value = f.get(key)
    text = fmt(value * scale if value is not None else None, digits)
    values = [r.get(key) for r in f.get("each", [])]
    if len(values) > 1:
        text += " (" + ", ".join(fmt(v * scale if v is not None else None, digits) for v in values)
        text += ")"
    return text


def _rows(figs: dict[str, dict[str, Any]]) -> list[list[str]]:
    d = figs.get("direct")
    rows = []
    for name, f in figs.items():
        rows.append(
            [
                f"`{name}`",
                cell(f, "completed", 0) + f"/{fmt(f['requests'], 0)}",
                cell(f, "goodput_tps", 0),
                fmt(paired_ratio(f, d, "goodput_tps"), 2) if name != "direct" else "1",
                cell(f, "preemptions", 0),
                cell(f, "running_mean", 1),
                cell(f, "ttft_p50", 2),
                cell(f, "ttft_p99", 2),
                cell(f, "tpot_p99", 1, 1000.0),
                cell(f, "e2e_p99", 1),
                fmt(paired_ratio(f, d, "e2e_p99"), 2) if name != "direct" else "1",
                cell(f, "kv_util_mean", 2),
                cell(f, "refusals", 0),
                cell(f, "cpu_lag_seconds", 2) + " / " + fmt(f.get("gpu_busy_seconds"), 1),
                cell(f, "seconds", 1),
            ]
        )
    return rows


HEADER = [
    "configuration",
    "completed",
    "goodput tok/s",
    "/ direct",
    "preemptions",
    "mean running",
    "TTFT p50 s",
    "TTFT p99 s",
    "TPOT p99 ms",
    "E2E p99 s",
    "/ direct",
    "KV use mean",
    "429/503",
    "CPU lag s / GPU busy s",
    "duration s",
]


def _part(part: dict[str, Any]) -> list[str]:
    facts = part.get("facts") or {}
    pool = part.get("num_gpu_blocks")
    pool_text = (
        f"{pool:,} blocks of 16 (`--num-gpu-blocks-override`, the burst peaks at "
        f"{facts.get('peak_blocks', 0):,})"
        if facts.get("pool_blocks")
        else f"{pool:,} blocks of 16, as vLLM sizes it at `--gpu-memory-utilization 0.9`"
    )
    lines = [
        f"#### {part['engine_title']}: {part['title']}",
        "",
        f"`{part['workload']}`: {part['description']} Pool: {pool_text}. Time scale "
        f"{part['time_scale']:g}x (every step slept {part['time_scale']:g} times its cost).",
        "",
        table(HEADER, _rows(part["figures"])),
        "",
    ]
    if part["workload"] == "priority":
        lines += [table(CLASS_HEADER, _class_rows(part["figures"])), ""]
    reserved = _reserved(part)
    if reserved:
        lines += [reserved, ""]
    return lines


CLASS_HEADER = [
    "configuration",
    "interactive TTFT p50 s",
    "interactive TTFT p99 s",
    "/ alone",
    "interactive E2E p99 s",
    "batch goodput tok/s",
    "batch E2E p99 s",
]


def _class_rows(figs: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The priority workload's classes: the interactive stream's TTFT against its TTFT alone
    (``sidecar-alone``: the median of the per-repetition ratios to its median), the batch's."""
    alone = (figs.get("sidecar-alone") or {}).get("interactive_ttft_p99")
    rows = []
    for name, f in figs.items():
        each = [r.get("interactive_ttft_p99") for r in f.get("each", [f])]
        ratios = sorted(v / alone for v in each if v is not None and alone)
        ratio = ratios[len(ratios) // 2] if len(ratios) % 2 else None
        if ratios and ratio is None:
            ratio = (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2
        rows.append(
            [
                f"`{name}`",
                cell(f, "interactive_ttft_p50", 2),
                cell(f, "interactive_ttft_p99", 2),
                fmt(ratio, 1) if name != "sidecar-alone" else "1",
                cell(f, "interactive_e2e_p99", 1),
                cell(f, "batch_goodput_tps", 0),
                cell(f, "batch_e2e_p99", 1),
            ]
        )
    return rows


def _reserved(part: dict[str, Any]) -> str:
    """What the adaptive sidecar reserved per class at the end of each run."""
    runs = part.get("runs", {}).get(DEFAULT, [])
    cells = []
    for r in runs:
        m = (r.get("sidecar_metrics") or {}).get("reserved_output_tokens") or {}
        cells.append(", ".join(f"{k} {v:.0f}" for k, v in sorted(m.items())) or "none")
    if not cells:
        return ""
    return (
        f"`{DEFAULT}` reserved per class at the end of each run (output tokens per sequence "
        "for a short prompt; classes that reserve their whole max_tokens are not listed): "
        + "; ".join(cells)
        + "."
    )


def targets(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for part in results["parts"]:
        if not part["workload"].startswith("thrash"):
            continue
        figs = part["figures"]
        d, s = figs.get("direct"), figs.get(DEFAULT)
        if d is None or s is None:
            continue
        g = paired_ratio(s, d, "goodput_tps")
        e = paired_ratio(s, d, "e2e_p99")
        rows.append(
            [
                f"{part['engine_title']}, {part['workload']}",
                f"goodput >= {GOODPUT_TARGET}x direct",
                f"{fmt(g, 2)}x",
                verdict(None if g is None else g >= GOODPUT_TARGET),
            ]
        )
        rows.append(
            [
                f"{part['engine_title']}, {part['workload']}",
                f"E2E p99 <= {E2E_P99_TARGET}x direct",
                f"{fmt(e, 2)}x",
                verdict(None if e is None else e <= E2E_P99_TARGET),
            ]
        )
    return rows


def defaults_text(results: dict[str, Any]) -> str:
    d = results.get("sidecar_defaults") or {}
    return ", ".join(f"`--{k.replace('_', '-')} {v}`" for k, v in d.items())


def load_range(results: dict[str, Any]) -> str:
    loads = [
        r["load_before"]
        for part in results["parts"]
        for f in part["figures"].values()
        for r in f.get("each", [])
        if r.get("load_before") is not None
    ]
    return f"{min(loads):.2f}-{max(loads):.2f}" if loads else "not recorded"


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else "met" if ok else "**missed**"


def report(results: dict[str, Any], command: str) -> str:
    m = results["machine"]
    lines = [
        "**Simulated, not measured on a GPU.** vLLM 0.32's own server, scheduler and KV-cache "
        "manager on its CPU build, with the simulated executor (docs/simulated-engine.md): no "
        "model runs, and every step sleeps an **uncalibrated roofline** cost for its batch. "
        "Read the ratios between configurations on the same engine; the absolute figures are "
        "the cost model's.",
        "",
        f"Run: {machine_line(m, results.get('load_average_after'))}; 1-minute load average "
        f"before each run {load_range(results)}.",
        "",
        f"Command: `{command}` ({results['minutes']:.0f} minutes of wall time). Each "
        "(engine, workload) pair ran on a fresh simulated server; the configurations ran "
        f"{results['repeat']} times each on it, interleaved in a rotating order. `direct` is "
        "vLLM alone; `sidecar-adaptive` the sidecar with its defaults "
        f"({defaults_text(results)}); `sidecar-worst-case` the same with `--reservation "
        "worst-case`; a fresh sidecar per run. vLLM: "
        "`--max-model-len 32768 --max-num-seqs 256 --gpu-memory-utilization 0.9` "
        "(`--max-num-batched-tokens 8192`, the H100 default; prefix caching on, reset between "
        "runs).",
        "",
        "**Time dilation.** This machine's two cores run vLLM's API server and engine core, the "
        "sidecar and the clients; where hundreds of sequences stream, they cannot keep a GPU's "
        "pace. So each engine ran at a time scale X (`--sim-time-scale X`: every step sleeps X "
        "times its simulated cost), its arrival times were stretched by X, and the sidecar's "
        "time-valued settings too (`--scrape-interval 0.5X --metrics-stale-after 5X "
        "--max-queue-wait 30X`, where X > 1). **Every duration and rate below is in simulated "
        "GPU seconds: the wall figure divided by X.** Goodput is the output tokens of completed "
        "requests over the run's span (first arrival to last answer); TTFT and TPOT come from "
        "streamed answers only (TPOT: (E2E - TTFT) / (tokens - 1) per answer); mean running is "
        "vLLM's `vllm:num_requests_running` sampled every 0.5 s of wall time, KV use its "
        "`vllm:kv_cache_usage_perc` at the same samples while it ran requests; 429/503 counts the "
        "refusals clients received (each retried after Retry-After, as the openai client does). "
        "`CPU lag` is the simulated engine's `cpu_lag_seconds` (`GET /state`) over the run, "
        "divided by X: the time the engine core's CPU work, not the cost model, added to the "
        "clock (the API server's lag is not in it), beside the GPU seconds the steps cost. Each "
        "cell is the median with every repetition in brackets; `/ direct` is the median of the "
        "per-repetition ratios.",
        "",
    ]
    for part in results["parts"]:
        lines += _part(part)
    rows = targets(results)
    if rows:
        lines += [
            "**Targets** (thrash, the sidecar's default against direct):",
            "",
            table(["engine", "target", "measured", "verdict"], rows),
            "",
        ]
    return "\n".join(lines)
