"""One configuration of the simulated-GPU benchmark on one workload: a sidecar started in front
of the simulated vLLM (or none), the workload sent at the engine's time scale and sampled, the
engine's own clock (``GET /state`` of its control channel) read before and after."""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.admission.client import Outcome, Tracker, drive, sample
from bench.admission.workload import priority_variant
from bench.common import reset_prefix_cache, wait_idle, wait_tokenizer
from bench.simgpu.workload import (
    LONG_QUEUE_WAIT,
    PRIORITY_SIDECARS,
    SIDECAR_TIMES,
    SimWorkload,
    base_config,
    dilated,
)
from harness.bench_util import progress
from harness.sim_server import SimServer
from harness.workload import SidecarProcess, vllm_preemptions


def sidecar_args(config: str, time_scale: float, lengths_file: Path | None = None) -> list[str]:
    """The sidecar's flags for ``config``: its defaults (``sidecar-adaptive`` names no
    ``--reservation``: adaptive is the default), ``--reservation worst-case`` for
    ``sidecar-worst-case``; ``-warm``: ``--lengths-file lengths_file`` (kept from one repetition
    to the next: a pod restarted into what it had learned); the time-valued defaults and
    ``--priority-pace`` stretched by the time scale (so that the pace holds as many simulated
    seconds of prefill as it names); the info log that says the tokenizer is loaded."""
    args: list[str] = []
    config = base_config(config)  # -lpt: another vLLM, the same sidecar
    if config in PRIORITY_SIDECARS:  # the priority workload's: the default and its flags
        flags = list(PRIORITY_SIDECARS[config])
        for i, flag in enumerate(flags[:-1]):
            if flag == "--priority-pace":
                flags[i + 1] = f"{float(flags[i + 1]) * time_scale:g}"
        args += flags
        config = "sidecar-adaptive"
    reservation = config.removeprefix("sidecar-")
    if reservation.endswith("-warm"):
        reservation = reservation.removesuffix("-warm")
        if lengths_file is not None:
            args += ["--lengths-file", str(lengths_file)]
    times = dict(SIDECAR_TIMES)
    if reservation.endswith("-long-wait"):
        reservation = reservation.removesuffix("-long-wait")
        times["--max-queue-wait"] = LONG_QUEUE_WAIT
    if reservation != "adaptive":
        args += ["--reservation", reservation]
    for flag, seconds in times.items():
        if time_scale != 1 or seconds != SIDECAR_TIMES[flag]:
            args += [flag, f"{seconds * time_scale:g}"]
    return [*args, "--log-level", "info"]


#: where ``-warm`` configurations keep their lengths files between repetitions (one per engine
#: and workload; a new benchmark run starts them afresh)
WARM_LENGTHS = Path(tempfile.mkdtemp(prefix="kv-sidecar-simgpu-lengths-"))


def _sidecar_figures(text: str) -> dict[str, Any]:
    families = list(text_string_to_metric_families(text))

    def by(name: str, *labels: str) -> dict[str, float]:
        return {
            "/".join(s.labels.get(k, "") for k in labels): s.value
            for f in families
            for s in f.samples
            if s.name == name
        }

    return {
        "requests_by_reason": by("kv_sidecar_requests_total", "decision", "reason"),
        # adaptive mode: what each class seen reserves for a short prompt at the end of the run
        "reserved_output_tokens": by("kv_sidecar_expected_output_tokens", "class"),
        # adaptive mode: placements the spread ends' second opinion allowed past the laid-out peak
        "spread_admissions": sum(by("kv_sidecar_spread_admissions_total").values()),
    }


def run_config(config: str, wl: SimWorkload, sim: SimServer) -> dict[str, Any]:
    """One configuration on one workload, on the running ``sim``."""
    scale = wl.time_scale
    wait_idle(sim.url)
    reset_prefix_cache(sim.url)
    before = vllm_preemptions(sim.url)
    state0 = sim.state()
    sidecar: SidecarProcess | None = None
    args: list[str] = []
    if config.startswith("sidecar-"):
        args = sidecar_args(config, scale, WARM_LENGTHS / f"{sim.served_name}-{wl.name}.json")
        sidecar = SidecarProcess(sim.url, *args).start()
        wait_tokenizer(sidecar)
    url = sidecar.url if sidecar is not None else sim.url
    workload = dilated(wl.workload, scale)
    if wl.name == "priority":  # what the configuration sends (the stream alone, no tenants...)
        workload = priority_variant(base_config(config), workload)
    total = len(workload.requests)
    last = [time.monotonic()]

    def on_done(n: int) -> None:
        if time.monotonic() - last[0] > 20 or n == total:
            last[0] = time.monotonic()
            progress(f"simgpu: {wl.name} / {config}: {n}/{total} requests done")

    async def go() -> tuple[list[Outcome], float, float, list[dict[str, Any]]]:
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()
        tracker = Tracker()
        t0 = time.monotonic()
        sampler = asyncio.ensure_future(sample(sim.url, sidecar, t0, samples, stop, tracker))
        outcomes, t1 = await drive(url, workload, t0, on_done, tracker)
        stop.set()
        await sampler
        return outcomes, t0, t1, samples

    sidecar_figures: dict[str, Any] | None = None
    try:
        outcomes, t0, t1, samples = asyncio.run(go())
        state1 = sim.state()
        if sidecar is not None:
            try:
                sidecar_figures = _sidecar_figures(sidecar.metrics())
            except (httpx.HTTPError, ValueError) as exc:
                sidecar_figures = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        if sidecar is not None:
            sidecar.stop()
    after = vllm_preemptions(sim.url)
    return {
        "config": config,
        "workload": wl.name,
        "time_scale": scale,
        "sidecar_args": args,
        "preemptions": after - before,
        "seconds": t1 - t0,
        "engine": {
            k: state1[k] - state0[k]
            for k in (
                "steps",
                "simulated_seconds",
                "cpu_lag_seconds",
                "recomputed_tokens",
                "recompute_seconds",
            )
        },
        "outcomes": [asdict(o) for o in outcomes],
        "samples": samples,
        "sidecar_metrics": sidecar_figures,
        "errors": sorted({o.error[:200] for o in outcomes if o.error})[:5],
    }
