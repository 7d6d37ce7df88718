"""``python -m bench.simgpu``: the command line; one simulated server per (engine, workload),
the configurations rotated between repetitions on it, the figures and the report made from the
raw runs (``--report-only`` starts there)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import httpx

import bench.simgpu
from bench.common import rotate
from bench.simgpu.figures import aggregate, figures
from bench.simgpu.report import report
from bench.simgpu.run import run_config
from bench.simgpu.workload import (
    CONFIGS,
    ENGINES,
    EXTRA_CONFIGS,
    LONG_PREFILL_THRESHOLD,
    LONG_QUEUE_WAIT,
    LPT_CONFIGS,
    LPT_SUFFIX,
    MAX_MODEL_LEN,
    PRIORITY_CONFIGS,
    WORKLOADS,
    SimWorkload,
    build,
    server_flags,
)
from harness.bench_util import (
    RESULTS,
    ROOT,
    load_average,
    machine,
    progress,
    update_section,
    write_json,
)
from harness.exposition import cache_config_labels
from harness.sim_server import SimServer

DEFAULT_PLAN = "8b:chat,8b:burst,8b:thrash,8b:poisson,70b:thrash"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.simgpu",
        description=bench.simgpu.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    p.add_argument(
        "--plan",
        default=DEFAULT_PLAN,
        help=f"ENGINE:WORKLOAD pairs, in order (default {DEFAULT_PLAN}); engines "
        f"{', '.join(ENGINES)}, workloads {', '.join(WORKLOADS)}",
    )
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"of {', '.join(CONFIGS)} (default: all three); side experiments: "
        f"{', '.join(EXTRA_CONFIGS)} (--max-queue-wait {LONG_QUEUE_WAIT:g}); for the priority "
        f"workload: {', '.join(PRIORITY_CONFIGS)}, each with {LPT_SUFFIX} appended (on a vLLM "
        f"started with --long-prefill-token-threshold {LONG_PREFILL_THRESHOLD}; -lpt256: 256)",
    )
    p.add_argument(
        "--repeat", type=int, default=None, help="runs of each configuration (3; --quick: 1)"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="every workload at this time scale (default: each workload's own, see "
        "bench/simgpu/workload.py TIME_SCALES)",
    )
    p.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    p.add_argument(
        "--suffix", default="", help="results under bench/results/simgpu{SUFFIX}*, report untouched"
    )
    p.add_argument(
        "--report-only", action="store_true", help="redo figures and report from the raw file"
    )
    return p


def _plan(cli: argparse.ArgumentParser, text: str) -> list[tuple[str, str]]:
    plan = []
    for item in filter(None, text.split(",")):
        engine, _, workload = item.partition(":")
        if engine not in ENGINES or workload not in WORKLOADS:
            cli.error(f"--plan: {item!r} is not ENGINE:WORKLOAD")
        plan.append((engine, workload))
    return plan


def warm_up(sim: SimServer) -> None:
    """Two short answers ending at EOS: the server's first requests pay its lazy setup."""
    for n in (8, 16):
        httpx.post(
            sim.url + "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "warm up the server",
                "max_tokens": 64,
                "vllm_xargs": {"sim_output_tokens": n},
            },
            timeout=120,
        ).raise_for_status()


def sidecar_defaults() -> dict[str, Any]:
    """The sidecar's defaults the runs used (recorded with the raw runs)."""
    from sidecar.config import Settings

    fields = Settings.model_fields
    keys = (
        "reservation",
        "policy",
        "headroom",
        "risk_steps",
        "max_queue_wait",
        "max_queue_depth",
        "scrape_interval",
        "metrics_stale_after",
    )
    return {k: getattr(fields[k].default, "value", fields[k].default) for k in keys if k in fields}


def run_part(
    engine_name: str, wl: SimWorkload, configs: list[str], repeat: int, raw: dict[str, Any]
) -> None:
    engine = ENGINES[engine_name]
    key = f"{engine_name}:{wl.name}"
    part: dict[str, Any] = {
        "engine": engine_name,
        "engine_title": engine.title,
        "workload": wl.name,
        "title": wl.workload.title,
        "description": wl.workload.description,
        "time_scale": wl.time_scale,
        "facts": wl.facts,
        "runs": {},
    }
    raw["parts"][key] = part
    # configurations that need other vLLM flags (server_flags) run on a server of their own,
    # after the others
    flavours: dict[tuple[str, ...], list[str]] = {}
    for config in configs:
        flavours.setdefault(tuple(server_flags(config)), []).append(config)
    for flags, group in flavours.items():
        _run_group(engine_name, wl, group, list(flags), repeat, raw, part)


def _run_group(
    engine_name: str,
    wl: SimWorkload,
    configs: list[str],
    flags: list[str],
    repeat: int,
    raw: dict[str, Any],
    part: dict[str, Any],
) -> None:
    engine = ENGINES[engine_name]
    key = f"{engine_name}:{wl.name}"
    sim = SimServer(
        model=engine.model,
        gpu=engine.gpu,
        max_model_len=MAX_MODEL_LEN,
        extra_args=engine.args(wl.num_gpu_blocks, wl.time_scale) + flags,
    )
    if flags:
        part.setdefault("other_server_args", {})[" ".join(flags)] = sim.command()[3:]
    else:
        part["server_args"] = sim.command()[3:]
    progress(f"simgpu: starting the simulated {engine.title} for {wl.name} {' '.join(flags)}")
    with sim:
        labels = cache_config_labels(httpx.get(sim.url + "/metrics", timeout=10).text)
        part["num_gpu_blocks"] = int(labels["num_gpu_blocks"])
        part["startup_seconds"] = sim.startup_seconds
        warm_up(sim)
        for rep in range(repeat):
            for config in rotate(configs, rep):
                raw["done"] += 1
                progress(
                    f"simgpu: run {raw['done']}/{raw['total']}: {key} / {config} (load "
                    f"{' '.join(f'{x:.1f}' for x in load_average())})"
                )
                load = [round(x, 2) for x in load_average()]
                try:
                    run = run_config(config, wl, sim)
                except Exception as exc:  # one broken run must not end the benchmark
                    progress(f"simgpu: {key} / {config} FAILED: {exc!r}")
                    continue
                run["repetition"] = rep
                run["load_average_before"] = load
                f = figures(run)
                progress(
                    f"simgpu: {key} / {config}: {f['completed']}/{f['requests']} completed, "
                    f"goodput {f['goodput_tps']:.0f} tok/s, {f['preemptions']:.0f} preemptions, "
                    f"running {f['running_mean'] or 0:.1f}, E2E p99 {f['e2e_p99'] or 0:.1f} s, "
                    f"CPU lag {f['cpu_lag_seconds']:.2f} of {f['gpu_busy_seconds']:.1f} s, "
                    f"recompute {f['recompute_seconds'] or 0:.2f} s "
                    f"({f['recomputed_tokens'] or 0:.0f} tokens), {run['seconds']:.0f} s wall"
                )
                part["runs"].setdefault(config, []).append(run)
                raw["minutes"] = (time.monotonic() - raw["_started"]) / 60
                write_json(raw["_name"], {k: v for k, v in raw.items() if not k.startswith("_")})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cli = parser()
    args = cli.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS + EXTRA_CONFIGS + PRIORITY_CONFIGS + LPT_CONFIGS:
            known = CONFIGS + EXTRA_CONFIGS + PRIORITY_CONFIGS + LPT_CONFIGS
            cli.error(f"unknown configuration {c}; one of {', '.join(known)}")
    name = "simgpu" + ("-quick" if args.quick else "") + args.suffix
    if args.report_only:
        return finish(json.loads((RESULTS / f"{name}-raw.json").read_text()), args)
    plan = _plan(cli, args.plan)
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    # /reset_prefix_cache (between runs) is served in vLLM's dev mode only
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    raw: dict[str, Any] = {
        "machine": machine(),
        "quick": args.quick,
        "suffix": args.suffix,
        "plan": args.plan,
        "configs": configs,
        "repeat": args.repeat,
        "time_scale": args.time_scale,
        "sidecar_defaults": sidecar_defaults(),
        "parts": {},
        "minutes": 0.0,
        "done": 0,
        "total": len(plan) * len(configs) * args.repeat,
        "_started": time.monotonic(),
        "_name": f"{name}-raw",
    }
    for engine, workload in plan:
        wl = build(workload, args.quick, args.time_scale)
        run_part(engine, wl, configs, args.repeat, raw)
    raw["load_average_after"] = [round(x, 2) for x in load_average()]
    raw["minutes"] = (time.monotonic() - raw["_started"]) / 60
    clean = {k: v for k, v in raw.items() if not k.startswith("_")}
    write_json(f"{name}-raw", clean)
    return finish(clean, args)


def command_line(raw: dict[str, Any]) -> str:
    command = "python -m bench.simgpu" + (" --quick" if raw["quick"] else "")
    if raw.get("plan") != DEFAULT_PLAN:
        command += f" --plan {raw['plan']}"
    if raw.get("configs") != CONFIGS:
        command += f" --configs {','.join(raw['configs'])}"
    if raw.get("repeat", 3) != (1 if raw["quick"] else 3):
        command += f" --repeat {raw['repeat']}"
    if raw.get("time_scale") is not None:
        command += f" --time-scale {raw['time_scale']:g}"
    if raw.get("suffix"):
        command += f" --suffix={raw['suffix']}"
    return command


def finish(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Figures and the report from the raw runs (``--report-only`` starts here)."""
    parts = []
    for part in raw["parts"].values():
        runs = {
            c: sorted(part["runs"][c], key=lambda r: r.get("repetition", 0))
            for c in CONFIGS + EXTRA_CONFIGS + PRIORITY_CONFIGS + LPT_CONFIGS
            if part["runs"].get(c)
        }
        if not runs:
            continue
        figs = {c: aggregate([figures(r) for r in reps]) for c, reps in runs.items()}
        parts.append(
            {
                **{k: v for k, v in part.items() if k != "runs"},
                "figures": figs,
                "runs": {
                    c: [{"sidecar_metrics": r.get("sidecar_metrics")} for r in reps]
                    for c, reps in runs.items()
                },
            }
        )
    results = {
        "machine": raw["machine"],
        "quick": raw["quick"],
        "minutes": raw["minutes"],
        "repeat": raw["repeat"],
        "load_average_after": raw.get("load_average_after"),
        "sidecar_defaults": raw.get("sidecar_defaults"),
        "command": command_line(raw),
        "parts": parts,
    }
    name = "simgpu" + ("-quick" if raw["quick"] else "") + raw.get("suffix", "")
    write_json(name, results)
    text = report(results, results["command"])
    print(text)
    if not args.no_report and not raw["quick"] and not raw.get("suffix"):
        update_section(ROOT / "BENCHMARKS.md", "simgpu", text)
    progress(f"simgpu: done ({results['minutes']:.1f} minutes)")
    return results
