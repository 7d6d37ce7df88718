"""The fleet benchmark's charts (a timeline of each replica's KV blocks, a summary of waits,
goodput, preemptions and answers per replica) and its section of BENCHMARKS.md."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.fleet.figures import each, paired_ratio
from bench.fleet.haproxy import WEIGHT_UNIT
from bench.fleet.run import (
    BLOCK_SIZE,
    CONFIGS,
    MAX_ATTEMPTS,
    MAX_MODEL_LEN,
    NGINX_TRIES,
    NUM_GPU_BLOCKS,
    WEIGHTS,
)
from harness.bench_util import RESULTS, ROOT, fmt, machine_line, table

COLORS = {
    "direct": "tab:red",
    "sidecar-queue": "tab:blue",
    "sidecar-reject": "tab:green",
    "sidecar-spill-2": "tab:purple",
    "sidecar-spill-5": "tab:brown",
    "sidecar-spill-15": "tab:olive",
    "sidecar-queue-haproxy": "tab:cyan",
    "sidecar-spill-2-haproxy": "tab:pink",
}


def charts(raw: dict[str, Any], figs: dict[str, dict[str, Any]], suffix: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in CONFIGS if c in figs]
    runs = {c: sorted(raw["runs"][c], key=lambda r: r["repetition"]) for c in configs}
    timeline = _timeline(plt, configs, runs, suffix, _pool(raw))
    summary = _summary(plt, configs, runs, figs, suffix)
    return {
        "timeline": str(timeline.relative_to(ROOT)),
        "summary": str(summary.relative_to(ROOT)),
    }


def _pool(raw: dict[str, Any]) -> tuple[int, int, int]:
    """The replicas' pool: blocks (vLLM's null block included), block size, max-model-len (the
    CPU build's where a raw file from before ``--engine`` does not say)."""
    return (
        int(raw.get("num_gpu_blocks", NUM_GPU_BLOCKS)),
        int(raw.get("block_size", BLOCK_SIZE)),
        int(raw.get("max_model_len", MAX_MODEL_LEN)),
    )


def _timeline(
    plt: Any,
    configs: list[str],
    runs: dict[str, list[dict[str, Any]]],
    suffix: str,
    pool: tuple[int, int, int],
) -> Path:
    """KV blocks, vLLM's queue (and the sidecar's) over time on each replica: the first
    repetition of each configuration."""
    blocks, block_size, _ = pool
    capacity = blocks - 1  # vLLM keeps one null block
    fig, axes = plt.subplots(
        len(configs), 1, figsize=(12, 3.6 * len(configs)), layout="constrained", squeeze=False
    )
    for ax, config in zip(axes[:, 0], configs, strict=True):
        run = runs[config][0]
        for name, style in (("A", "-"), ("B", "--")):
            rows = [s for s in run["samples"] if name in s]
            t = [s["t"] for s in rows]
            used = [s[name]["kv_cache_usage_perc"] * capacity for s in rows]
            waiting = [s[name]["num_requests_waiting"] for s in rows]
            queued = [(s[name].get("sidecar") or {}).get("queue_depth") or 0 for s in rows]
            ax.plot(t, used, style, color="tab:blue", label=f"{name}: KV blocks used (vLLM)")
            ax.plot(
                t,
                [w * 4 for w in waiting],
                style,
                color="tab:orange",
                linewidth=1,
                label=f"{name}: vLLM waiting x4",
            )
            if _queues(config):
                ax.plot(
                    t,
                    [q * 4 for q in queued],
                    style,
                    color="tab:purple",
                    linewidth=1,
                    label=f"{name}: sidecar queue x4",
                )
            last = None
            marked = False
            for s in rows:
                p = s[name]["num_preemptions_total"]
                if last is not None and p > last:
                    ax.axvline(
                        s["t"],
                        color="red",
                        alpha=0.4,
                        linestyle=style,
                        linewidth=1,
                        label=None if marked else f"{name}: preemption",
                    )
                    marked = True
                last = p
        ax.axhline(capacity, color="black", linewidth=0.8, label=f"pool ({capacity} blocks)")
        pre = run["preemptions"]
        ax.set_title(
            f"{config} (repetition 1): preemptions A {pre['A']:.0f}, B {pre['B']:.0f}; "
            f"{run['seconds']:.0f} s"
        )
        ax.set_xlabel("seconds since the burst")
        ax.set_ylabel("KV blocks / requests x4")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7, ncols=3)
    fig.suptitle(
        f"Two vLLM replicas behind nginx or HAProxy (weights A {WEIGHTS['A']} : B "
        f"{WEIGHTS['B']}), "
        f"{blocks} blocks of {block_size} tokens each"
    )
    timeline = RESULTS / f"fleet-timeline{suffix}.png"
    fig.savefig(timeline, dpi=85)
    plt.close(fig)
    return timeline


def _summary(
    plt: Any,
    configs: list[str],
    runs: dict[str, list[dict[str, Any]]],
    figs: dict[str, dict[str, Any]],
    suffix: str,
) -> Path:
    """Every answer's wait, goodput, preemptions and answers per replica."""
    fig, grid = plt.subplots(2, 2, figsize=(12, 8.5), layout="constrained")
    ax = grid[0, 0]
    for config in configs:
        waits = sorted(
            o["ttft"] for r in runs[config] for o in r["outcomes"] if o["ttft"] is not None
        )
        if waits:
            ax.step(
                waits,
                [(i + 1) / len(waits) for i in range(len(waits))],
                where="post",
                color=COLORS[config],
                label=f"{config} ({len(waits)} answers)",
            )
    ax.set_title("wait before the first token, every answer of every repetition")
    ax.set_xlabel("seconds from the client's first attempt")
    ax.set_ylabel("share of answers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    def whisk(values: list[list[float]], mids: list[float]) -> list[list[float]]:
        return [
            [m - min(v) for m, v in zip(mids, values, strict=True)],
            [max(v) - m for m, v in zip(mids, values, strict=True)],
        ]

    ax = grid[0, 1]
    mids = [figs[c]["goodput_tps"] for c in configs]
    vals = [[r["goodput_tps"] for r in figs[c]["each"]] for c in configs]
    ax.bar(configs, mids, color=[COLORS[c] for c in configs], yerr=whisk(vals, mids), capsize=3)
    ax.set_title("goodput, tokens/s (median, min-max of the repetitions)")
    ax.grid(axis="y", alpha=0.3)
    for ax, key, title in (
        (grid[1, 0], "preemptions", "vLLM preemptions per replica (median, min-max)"),
        (grid[1, 1], "served", "answers served per replica (median, min-max)"),
    ):
        x = range(len(configs))
        for k, (name, shift) in enumerate((("A", -0.2), ("B", 0.2))):
            mids = [figs[c]["replicas"][name][key] for c in configs]
            vals = [[r["replicas"][name][key] for r in figs[c]["each"]] for c in configs]
            ax.bar(
                [i + shift for i in x],
                mids,
                width=0.4,
                yerr=whisk(vals, mids),
                capsize=3,
                color=["tab:gray", "tab:olive"][k],
                label=f"replica {name} (weight {WEIGHTS[name]})",
            )
        ax.set_xticks(list(x), configs)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        "Two vLLM replicas behind nginx (HAProxy for *-haproxy): the same skewed burst, "
        "each configuration"
    )
    summary = RESULTS / f"fleet-summary{suffix}.png"
    fig.savefig(summary, dpi=85)
    plt.close(fig)
    return summary


# --- the report ---------------------------------------------------------------------------------


def _intro(raw: dict[str, Any], figs: dict[str, dict[str, Any]]) -> list[str]:
    count, prompt_tokens, max_tokens = raw["size"]
    blocks, block_size, max_model_len = _pool(raw)
    peak = math.ceil((prompt_tokens + max_tokens) / block_size)
    fit = int((blocks - 1) // peak)
    reps = sorted({f["repetitions"] for f in figs.values()})
    command = "python -m bench.fleet" + (" --quick" if raw["quick"] else "")
    if raw.get("engine", "cpu") != "cpu":
        command += f" --engine {raw['engine']}"
    if raw["repeat"] != (1 if raw["quick"] else 3):
        command += f" --repeat {raw['repeat']}"
    rate = raw.get("poisson_rate")
    if rate is not None:
        command += f" --poisson {rate:g} --requests {count}"
    if raw.get("haproxy_layout", "entries") != "entries":
        command += f" --haproxy-layout {raw['haproxy_layout']}"
    sent = (
        "sent at once"
        if rate is None
        else f"sent as a Poisson process of {rate:g} a second (seeded: the same times each run)"
    )
    lines = [
        f"Run: {machine_line(raw['machine'], raw.get('load_average_after'))}.",
        "",
        f"Command: `{command}` ({raw['minutes']:.0f} minutes; each configuration ran "
        f"{' or '.join(str(r) for r in reps)} times, interleaved in a rotating order). "
        f"vLLM {raw['vllm']}, two servers, each `--num-gpu-blocks-override {blocks}` "
        f"(block size {block_size}, {blocks - 1} usable blocks), `--max-model-len "
        f"{max_model_len}`. nginx {raw.get('nginx_version', '?')}, one worker, upstream "
        f"`weight={WEIGHTS['A']}` (A) and `weight={WEIGHTS['B']}` (B), `max_fails=0`, keepalive, "
        "`proxy_buffering off`, `proxy_next_upstream error timeout http_429 http_503 "
        f"non_idempotent; proxy_next_upstream_tries {NGINX_TRIES}` (the same file for every "
        "nginx configuration; the exact file is in the raw JSON). Sidecars: defaults plus "
        "`--max-queue-wait 600 --max-queue-depth 1024` (`sidecar-spill-S`: `--policy spill "
        "--spill-wait S`), fresh for each run. The burst: "
        f"{count} streamed completions {sent}, {prompt_tokens}-token prompts, max_tokens "
        f"{max_tokens} with `ignore_eos` (each reaches {peak} blocks: one pool holds {fit} at "
        f"their peak, the two {2 * fit}). The client retries a 429 or 503 after its "
        f"`retry-after-ms` / `Retry-After`, at most {MAX_ATTEMPTS} attempts per request; "
        "TTFT and E2E count from the first attempt"
        + ("" if rate is None else ", each from its request's own send time")
        + ".",
        "",
        *(
            [
                "`sidecar-queue-haproxy`: HAProxy "
                f"{raw.get('haproxy_version', '?')} instead of nginx, on "
                "`deploy/gateway/haproxy.cfg` as shipped but for its bind address, its stats "
                "socket, a capture of the request id for its log, and its servers: "
                + (
                    "one for each replica's sidecar, of weight "
                    f"{WEIGHT_UNIT * WEIGHTS['A']} (A) and {WEIGHT_UNIT * WEIGHTS['B']} (B), "
                    if raw.get("haproxy_layout") == "weights"
                    else "three (weight 100 each) for replica A's sidecar and one for B's, "
                )
                + "so 3:1 as nginx's until the sidecars' agents (`--agent-port`, asked every "
                "second) lower a weight (`bench/fleet/haproxy.py`; the exact file is in the raw "
                "JSON). "
                "`sidecar-spill-2-haproxy`: the same with the sidecars on `--policy spill "
                "--spill-wait 2 --spill-status 503`, so that HAProxy retries a spilled request "
                "once on another server.",
                "",
            ]
            if any(c.endswith("-haproxy") for c in figs)
            else []
        ),
        "**Per configuration** (median over repetitions, every repetition in brackets; "
        "percentiles are over the answers of one repetition, then the median of those):",
        "",
    ]
    return lines


def _queues(config: str) -> bool:
    """Whether the configuration's sidecars queue (``queue``, and ``spill`` for short waits)."""
    return config.startswith(("sidecar-queue", "sidecar-spill"))


def _per_configuration(figs: dict[str, dict[str, Any]]) -> list[str]:
    d = figs.get("direct")
    lines: list[str] = []
    rows = []
    for c, f in figs.items():
        ev = f["each"]
        rows.append(
            [
                c,
                fmt(f["preemptions"], 0) + each([r["preemptions"] for r in ev], 0),
                f"{fmt(f['completed'], 0)}/{fmt(f['requests'], 0)}",
                fmt(f["goodput_tps"], 1) + each([r["goodput_tps"] for r in ev], 0),
                fmt(paired_ratio(f, d, "goodput_tps") if d else None, 2),
                fmt(f["ttft_p50"], 1),
                fmt(f["ttft_p99"], 1) + each([r["ttft_p99"] for r in ev], 0),
                fmt(f["e2e_p50"], 1),
                fmt(f["e2e_p99"], 1) + each([r["e2e_p99"] for r in ev], 0),
                fmt(f["client_429"], 0) + each([r["client_429"] for r in ev], 0),
                fmt(f["requests_refused_to_client"], 0),
                fmt(f.get("served_by_second_return"), 0),
                fmt(f["nginx_refusals"], 0) + each([r["nginx_refusals"] for r in ev], 0),
                fmt(f["nginx_sent_on"], 0),
                fmt(f["nginx_rescued"], 0) + each([r["nginx_rescued"] for r in ev], 0),
                fmt(f["retry_sleep_mean"], 1),
                f"{fmt(f['retry_after_p50'], 1)} / {fmt(f['retry_after_max'], 1)}",
                fmt(f["first_answer_s"], 1),
                f"{fmt(f.get('retry_after_at_cap'), 0)} / "
                f"{fmt(f.get('retry_after_at_cap_other_room'), 0)}",
                fmt(f["seconds"], 0),
            ]
        )
    lines += [
        table(
            [
                "configuration",
                "preemptions (A+B)",
                "completed",
                "goodput tok/s",
                "/ direct",
                "TTFT p50 s",
                "TTFT p99 s",
                "E2E p50 s",
                "E2E p99 s",
                "429s the client saw",
                "requests that saw one",
                "of those, served on their 1st or 2nd return",
                "refusals nginx got",
                "attempts nginx sent to the other replica",
                "of which the other replica answered",
                "mean client sleep after 429s per request, s",
                "Retry-After slept p50 / max, s",
                "first answer done, s",
                "429s with Retry-After at its cap / of those while the other replica had room",
                "burst to last answer, s",
            ],
            rows,
        ),
        "",
        "`/ direct` is the median of the per-repetition ratios (repetition i of each "
        "configuration ran in the same round). The TTFT columns are the wait before the first "
        "token of each answer, counted from the client's first attempt. Retry-After's cap is "
        "the sidecar's `MAX_RETRY_AFTER`; a replica had room when its sidecar's `budget_blocks` "
        "less `committed_blocks` less `peak_blocks_queued` (its /state, in the sample nearest "
        "the refusal, taken every 0.5 s) held a burst request's peak; `-` where no sidecar "
        "was sampled.",
        "",
        "**Per replica** (median over repetitions; `served`: answers whose 200 came from that "
        "replica, from nginx's access log; `first tries`: attempts nginx sent there first; "
        "`vLLM queue`: vLLM's mean `request_queue_time` over the requests it scheduled; "
        "`sidecar queue`: the sidecar's mean `kv_sidecar_queue_wait_seconds` over the requests it "
        "queued):",
        "",
    ]
    return lines


def _per_replica(figs: dict[str, dict[str, Any]], pngs: dict[str, str]) -> list[str]:
    lines: list[str] = []
    rows = []
    for c, f in figs.items():
        for name in WEIGHTS:
            r = f["replicas"][name]
            ev = [e["replicas"][name] for e in f["each"]]
            rows.append(
                [
                    c,
                    f"{name} (weight {WEIGHTS[name]})",
                    fmt(r["preemptions"], 0) + each([e["preemptions"] for e in ev], 0),
                    fmt(r["first_tries"], 0),
                    fmt(r["served"], 0) + each([e["served"] for e in ev], 0),
                    fmt(r["refusals_to_nginx"], 0),
                    fmt(r["vllm_generation_tokens"], 0),
                    fmt(r["goodput_tps"], 1),
                    fmt(r["ttft_p50"], 1),
                    fmt(r["ttft_p99"], 1),
                    fmt(r["e2e_p50"], 1),
                    fmt(r["e2e_p99"], 1),
                    fmt(r["vllm_queue_mean"], 1),
                    fmt(r["sidecar_queue_mean"], 1) if _queues(c) else "-",
                ]
            )
    lines += [
        table(
            [
                "configuration",
                "replica",
                "preemptions",
                "first tries",
                "served",
                "refusals (429) to nginx",
                "tokens vLLM generated",
                "goodput tok/s",
                "TTFT p50 s",
                "TTFT p99 s",
                "E2E p50 s",
                "E2E p99 s",
                "vLLM queue mean s",
                "sidecar queue mean s",
            ],
            rows,
        ),
        "",
        f"![fleet: per-answer wait, goodput, preemptions, answers per replica]({pngs['summary']})",
        "",
        f"![fleet: KV blocks over time on each replica]({pngs['timeline']})",
    ]
    return lines


def report(raw: dict[str, Any], figs: dict[str, dict[str, Any]], pngs: dict[str, str]) -> str:
    lines = [*_intro(raw, figs), *_per_configuration(figs), *_per_replica(figs, pngs)]
    return "\n".join(lines)
