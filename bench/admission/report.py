"""The admission benchmark's sections of BENCHMARKS.md: how the run was made, one part per
workload (outcomes, prediction error, learned lengths), and the targets with their verdicts; the
priority workload's section apart (:func:`priority_report`)."""

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
    PRIORITY_RULES,
    SIDECAR_CONFIGS,
    TENANT_MAX_SHARE,
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
    names = [n for n in SIDECAR_CONFIGS if n in figs and not n.endswith("-observe")]
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


# --- the priority workload ----------------------------------------------------------------------

#: what each configuration of the priority workload is, for the report
PRIORITY_TEXT = {
    "sidecar-alone": "the interactive stream alone, no batch, through the sidecar (defaults): "
    "the baseline TTFT",
    "direct": "both tenants straight to vLLM (its default FCFS scheduling), no priority field",
    "vllm-priority": "both tenants straight to a second vLLM started with `--scheduling-policy "
    "priority`, each request's body carrying vLLM's own `priority` (interactive 0, batch 10)",
    "sidecar-one-tenant": "both through the sidecar (defaults) without the tenant header: one "
    "tenant and one priority, the plain FIFO",
    "sidecar-tenants": "both through the sidecar (defaults) with their tenant header, no "
    "classes: both priority 0, the fair share between the two tenants applies",
    "sidecar-classes": f"the same with `--priority-rules {PRIORITY_RULES}` (adaptive "
    "reservation, the default)",
    "sidecar-classes-worst-case": f"the same with `--priority-rules {PRIORITY_RULES} "
    "--reservation worst-case`",
    "sidecar-classes-capped": f"`--priority-rules {PRIORITY_RULES} --tenant-max-share "
    f"{TENANT_MAX_SHARE:g}` (adaptive): what one tenant may reserve capped, so that the batch "
    "tenant never holds the whole budget",
    "sidecar-classes-unpaced": f"`--priority-rules {PRIORITY_RULES} --priority-pace 0` "
    "(adaptive): the batch's prompts not paced into vLLM",
    "sidecar-classes-paced": f"`--priority-rules {PRIORITY_RULES} --priority-pace 0.1` "
    "(adaptive): the batch's prompts paced into vLLM",
}


def _reps(f: dict[str, Any], key: str) -> list[float | None]:
    return [r.get(key) for r in f.get("each", [])]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratio_text(f: dict[str, Any], base: dict[str, Any], key: str) -> tuple[float | None, str]:
    """The ratio of the medians, and the text: it, then each repetition's value against the
    base's median in brackets."""
    ratio = _ratio(f[key], base[key])
    per = [_ratio(v, base[key]) for v in _reps(f, key)]
    cells = ", ".join(fmt(v, 2) for v in per)
    return ratio, f"{fmt(ratio, 2)} x ({cells})"


def priority_targets(figs: dict[str, dict[str, Any]]) -> str:
    rows = []
    alone, without = figs.get("sidecar-alone"), figs.get("sidecar-tenants")
    for name in ("sidecar-classes", "sidecar-classes-worst-case", "sidecar-classes-capped"):
        f = figs.get(name)
        if f is None:
            continue
        if alone is not None:
            ratio, text = _ratio_text(f, alone, "interactive_ttft_p99")
            rows.append(
                [
                    name,
                    "interactive TTFT p99 <= 1.5 x its p99 alone (`sidecar-alone`, median "
                    f"{fmt(alone['interactive_ttft_p99'], 2)} s)",
                    f"{fmt(f['interactive_ttft_p99'], 2)} s: {text}",
                    verdict(None if ratio is None else ratio <= 1.5),
                ]
            )
        if without is not None:
            ratio, text = _ratio_text(f, without, "batch_goodput_tps")
            rows.append(
                [
                    name,
                    "batch goodput >= 0.9 x without classes (`sidecar-tenants`, median "
                    f"{fmt(without['batch_goodput_tps'], 1)} tok/s)",
                    f"{fmt(f['batch_goodput_tps'], 1)} tok/s: {text}",
                    verdict(None if ratio is None else ratio >= 0.9),
                ]
            )
    f = figs.get("sidecar-classes-worst-case")
    if f is not None:
        worst = max(p for p in _reps(f, "preemptions") if p is not None)
        rows.append(
            [
                "sidecar-classes-worst-case",
                "zero preemptions (every repetition)",
                fmt(f["preemptions"], 0) + each(f, "preemptions", 0),
                verdict(worst == 0),
            ]
        )
    return table(
        [
            "configuration",
            "target",
            "measured (median: ratio of medians, each repetition against the base's median)",
            "verdict",
        ],
        rows,
    )


def priority_report(results: dict[str, Any], command: str) -> str:
    """The priority workload's section: how it ran, its figures per class, the targets."""
    figs: dict[str, dict[str, Any]] = results["figures"]
    wl = results["workload"]
    reps = sorted({f["repetitions"] for f in figs.values()})
    lines = [
        f"Run: {machine_line(results['machine'], results.get('load_average_after'))}.",
        "",
        f"Command: `{command}` ({results['minutes']:.0f} minutes; each configuration ran "
        f"{' or '.join(str(r) for r in reps)} times, interleaved in a rotating order on the "
        "first server, `vllm-priority` after them on its own; the tables give the median and, "
        f"in brackets, every repetition in order). vLLM {results['vllm']}: "
        f"`--num-gpu-blocks-override {NUM_GPU_BLOCKS}` (block size {BLOCK_SIZE}, "
        f"{CAPACITY_BLOCKS} usable blocks), `--max-model-len {MAX_MODEL_LEN}`, prefix caching on "
        "(reset between runs). Sidecars run with defaults "
        f"({defaults_text(results)}, `--policy queue`, `--reservation adaptive`) plus "
        "`--max-queue-wait 600 --max-queue-depth 1024`, a fresh sidecar for each run.",
        "",
        f"`{wl['name']}`: {wl['description']}",
        "",
        "Configurations:",
        "",
        *[f"- `{c}`: {PRIORITY_TEXT[c]}." for c in figs if c in PRIORITY_TEXT],
        "",
        "Figures, per run: TTFT p50 and p99 are nearest-rank percentiles over the class's "
        "completed streams, from the request's first attempt (queueing in the sidecar or vLLM "
        "and waits between retries included); goodput is the class's completed output tokens "
        "over the seconds from its first arrival to its last answer; preemptions are the delta "
        "of vLLM's `vllm:num_preemptions_total` over the run (read once vLLM is idle again); "
        "refused counts the 429 and 503 answers the clients got (each retried after its "
        "Retry-After, as the openai client does). The table gives each figure's median over the "
        "repetitions, then every repetition in brackets.",
        "",
    ]
    rows = []
    for name, f in figs.items():
        rows.append(
            [
                name,
                fmt(f["interactive_ttft_p50"], 2) + each(f, "interactive_ttft_p50", 2),
                fmt(f["interactive_ttft_p99"], 2) + each(f, "interactive_ttft_p99", 2),
                fmt(f["interactive_goodput_tps"], 1) + each(f, "interactive_goodput_tps", 1),
                f"{fmt(f['interactive_completed'], 0)}/{fmt(f['interactive_requests'], 0)}",
                fmt(f["batch_goodput_tps"], 1) + each(f, "batch_goodput_tps", 1),
                f"{fmt(f['batch_completed'], 0)}/{fmt(f['batch_requests'], 0)}",
                fmt(f["batch_e2e_p99"], 1) + each(f, "batch_e2e_p99", 1),
                fmt(f["preemptions"], 0) + each(f, "preemptions", 0),
                fmt(f["refusals"], 0) + each(f, "refusals", 0),
                fmt(f["seconds"], 0) + each(f, "seconds", 0),
            ]
        )
    lines += [
        table(
            [
                "configuration",
                "interactive TTFT p50 s",
                "interactive TTFT p99 s",
                "interactive goodput tok/s",
                "interactive completed",
                "batch goodput tok/s",
                "batch completed",
                "batch E2E p99 s",
                "preemptions",
                "refused (429/503 answers)",
                "run s",
            ],
            rows,
        ),
        "",
        "**Targets**",
        "",
        priority_targets(figs),
    ]
    return "\n".join(lines)
