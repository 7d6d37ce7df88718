"""The admission benchmark's chart of one workload: KV blocks over time for the sidecar's
configurations (against vLLM direct and its preemptions), then goodput and preemptions for all."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.admission.workload import BLOCK_SIZE, CAPACITY_BLOCKS, NUM_GPU_BLOCKS, Workload


def _preemption_times(direct: dict[str, Any] | None) -> list[float]:
    """When vLLM direct's preemption counter moved, from its samples."""
    preempt_times: list[float] = []
    if direct is not None:
        last = None
        for s in direct["samples"]:
            p = s.get("num_preemptions_total")
            if p is not None and last is not None and p > last:
                preempt_times.append(s["t"])
            last = p if p is not None else last
    return preempt_times


def _direct(ax: Any, direct: dict[str, Any] | None, preempt_times: list[float]) -> None:
    """vLLM direct on the same workload: its used blocks and its preemptions."""
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


def _timeline(
    ax: Any,
    config: str,
    runs: dict[str, dict[str, Any]],
    figs: dict[str, dict[str, Any]],
    preempt_times: list[float],
) -> None:
    """One configuration's KV blocks over time: reserved, future peak, predicted, actual."""
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
    _direct(ax, runs.get("direct"), preempt_times)
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


def _bars(fig: Any, grid: Any, row: int, figs: dict[str, dict[str, Any]]) -> None:
    """Goodput and preemptions of every configuration, with the repetitions' range."""
    names = list(figs)
    palette = {
        "direct": "tab:red",
        "vllm-tuned": "tab:purple",
        "vllm-watermark": "tab:pink",
        "threshold-shedder": "tab:brown",
        "oracle": "tab:green",
    }
    colors = [palette.get(n, "tab:blue") for n in names]
    ax1 = fig.add_subplot(grid[row, 0])

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
    ax2 = fig.add_subplot(grid[row, 1])
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
    preempt_times = _preemption_times(runs.get("direct"))
    for row, config in enumerate(timelines):
        _timeline(fig.add_subplot(grid[row, :]), config, runs, figs, preempt_times)
    _bars(fig, grid, len(timelines), figs)
    fig.suptitle(f"{workload.title} — vLLM CPU, {NUM_GPU_BLOCKS} blocks of {BLOCK_SIZE} tokens")
    fig.savefig(path, dpi=90)
    plt.close(fig)
