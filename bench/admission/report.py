"""The admission benchmark's section of BENCHMARKS.md: how the run was made, one part per
workload (outcomes, prediction error, learned lengths), and the targets with their verdicts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.admission.figures import CONTEXTS, UNDER_PREDICTION_BLOCKS, each, paired_ratio
from bench.admission.workload import (
    BASELINES,
    BLOCK_SIZE,
    CAPACITY_BLOCKS,
    CONFIGS,
    KEPT_PER_CLASS,
    MAX_MODEL_LEN,
    NUM_GPU_BLOCKS,
    OPTIMISTIC_PRIOR,
    SIDECAR_CONFIGS,
    TUNED_MAX_NUM_SEQS,
    TUNED_MAX_QUEUED,
    WATERMARK,
)
from harness.bench_util import fmt, machine_line, table


def reps_text(results: dict[str, Any]) -> str:
    counts = sorted({f["repetitions"] for w in results["workloads"] for f in w["figures"].values()})
    return " or ".join(str(c) for c in counts) if counts else "0"


def _intro(results: dict[str, Any], command: str) -> list[str]:
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
    return lines


def _outcomes(wl: dict[str, Any]) -> list[str]:
    """A workload's heading, description and outcomes table."""
    figs = wl["figures"]
    d, o = figs.get("direct"), figs.get("oracle")
    lines: list[str] = []
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
    return lines


def _prediction_error(figs: dict[str, dict[str, Any]]) -> list[str]:
    """The sidecar's prediction error per configuration, with what went on where it was low."""
    lines: list[str] = []
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
    return lines


def _learned(wl: dict[str, Any]) -> list[str]:
    """What expected mode learned per class by the end of each run."""
    lines: list[str] = []
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
                ", ".join(f"{k} {v:.0f}" for k, v in sorted(m.items())) or "none" for m in per_run
            ]
            parts.append(f"{n}: " + "; ".join(cells))
        lines += [
            "Expected mode's learned output tokens per class at the end of each run "
            "(classes with fewer than 32 answers are still on the prior and not listed): "
            + " | ".join(parts)
            + ".",
            "",
        ]
    return lines


def report(results: dict[str, Any], command: str) -> str:
    lines = _intro(results, command)
    for wl in results["workloads"]:
        lines += _outcomes(wl)
        lines += _prediction_error(wl["figures"])
        lines += [f"![{wl['title']}]({wl['chart']})", ""]
        lines += _learned(wl)
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
