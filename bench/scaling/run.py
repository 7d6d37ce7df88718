"""The scaling benchmark's run: the fake vLLM and the sidecar started, then the three curves
measured in interleaved rounds (connections, prompt length, requests held in flight)."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.common import LONG_CONTEXT_LEN as MAX_MODEL_LEN
from bench.common import SMALL_BODY, Target, make_texts, rotate, warm, wrk, wrk_script
from bench.scaling.clients import HeldStreams, send
from harness.bench_util import ROOT, ProcStat, children_pids, load_average, machine, progress
from harness.exposition import metric_value
from harness.fake_vllm_fast import FakeVllmProcess
from harness.vllm_cpu import ensure_tokenizer_model
from harness.workload import SidecarProcess

CONNECTIONS = (1, 2, 4, 8, 16, 32, 64)
LENGTHS = (1_000, 8_000, 32_000, 128_000)
PROMPT_CONNECTIONS = (1, 4)
IN_FLIGHT = (0, 50, 200, 500)
#: wrk's connections beside the held streams
SMALL_CONNECTIONS = 8
STREAM_MAX_TOKENS = 10_000
STREAM_INTERVAL_MS = 100.0
TEXTS_PER_LENGTH = 4
SECTION = "scaling"


def sidecar_counters(sidecar: SidecarProcess) -> dict[str, float]:
    """The sidecar's counters a run takes deltas of (read outside the CPU windows)."""
    text = sidecar.metrics()
    return {
        "prompt_tokens": metric_value(text, "kv_sidecar_prompt_tokens_total") or 0.0,
        "prompt_counts": metric_value(text, "kv_sidecar_prompt_counts_total") or 0.0,
        "local_counts": metric_value(text, "kv_sidecar_prompt_counts_total", method="exact_local")
        or 0.0,
        "decision_sum": metric_value(text, "kv_sidecar_decision_seconds_sum") or 0.0,
        "decision_count": metric_value(text, "kv_sidecar_decision_seconds_count") or 0.0,
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def wait_in_flight(sidecar: SidecarProcess, n: int, timeout: float = 90.0) -> dict[str, Any]:
    """/state once its ``in_flight`` is ``n`` (raises after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        state = sidecar.state()
        if state["in_flight"] == n and state["queue_depth"] == 0:
            return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"sidecar in_flight is not {n} after {timeout:g} s: {state}")
        time.sleep(0.2)


def curve_connections(
    targets: Sequence[Target],
    upstream: ProcStat,
    script: Path,
    connections: Sequence[int],
    rounds: int,
    seconds: float,
) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        t.name: {str(c): [] for c in connections} for t in targets
    }
    for r in range(rounds):
        for k in range(len(connections)):
            c = connections[(k + r) % len(connections)]
            for t in rotate(list(targets), r + k):
                progress(f"scaling: connections round {r + 1}/{rounds}, c={c}: {t.name}")
                cpu0, up0 = t.cpu_seconds(), upstream.cpu_seconds()
                res = wrk(t.url, connections=c, seconds=seconds, script=script)
                res["cpu_s"] = t.cpu_seconds() - cpu0
                res["upstream_cpu_s"] = upstream.cpu_seconds() - up0
                res["round"] = r
                runs[t.name][str(c)].append(res)
    return runs


def curve_prompts(
    sidecar: SidecarProcess,
    direct: Target,
    upstream: ProcStat,
    files: dict[int, list[Path]],
    connections: Sequence[int],
    rounds: int,
    seconds: float,
) -> dict[str, Any]:
    assert sidecar.proc is not None
    via = Target("sidecar", sidecar.url, [sidecar.proc.pid])
    cells = [(n, c) for n in files for c in connections]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        t.name: {f"{n}x{c}": [] for n, c in cells} for t in (via, direct)
    }
    for r in range(rounds):
        for k in range(len(cells)):
            n, c = cells[(k + r) % len(cells)]
            for t in rotate([via, direct], r + k):
                # long prompts take the sidecar ~0.5 s of CPU each: a longer window for them
                secs = seconds * (2 if n >= 32_000 and t is via else 1)
                progress(f"scaling: prompts round {r + 1}/{rounds}, {n:,} tokens x{c}: {t.name}")
                m0 = sidecar_counters(sidecar)
                cpu0, up0 = t.cpu_seconds(), upstream.cpu_seconds()
                res = send(t.url, files[n], c, secs)
                res["cpu_s"] = t.cpu_seconds() - cpu0
                res["upstream_cpu_s"] = upstream.cpu_seconds() - up0
                res["sidecar_counters"] = delta(sidecar_counters(sidecar), m0)
                res["round"] = r
                runs[t.name][f"{n}x{c}"].append(res)
    return runs


def curve_in_flight(
    sidecar: SidecarProcess,
    upstream: ProcStat,
    script: Path,
    in_flight: Sequence[int],
    rounds: int,
    seconds: float,
    interval_ms: float,
    max_tokens: int,
) -> dict[str, Any]:
    assert sidecar.proc is not None
    stat = ProcStat(sidecar.proc.pid)
    runs: dict[str, list[dict[str, Any]]] = {str(n): [] for n in in_flight}
    for r in range(rounds):
        for k in range(len(in_flight)):
            n = in_flight[(k + r) % len(in_flight)]
            progress(f"scaling: in flight round {r + 1}/{rounds}, {n} streams held")
            wait_in_flight(sidecar, 0)
            held = HeldStreams(sidecar.url, n, max_tokens, interval_ms) if n else None
            try:
                if held is not None and held.ready["opened"] != n:
                    raise RuntimeError(f"{n} streams asked, {held.ready}")
                state = wait_in_flight(sidecar, n)
                time.sleep(1.0)  # the streams in their stride
                # the streams alone (n = 0: the sidecar at rest)
                c0, u0, h0, t0 = (
                    stat.cpu_seconds(),
                    upstream.cpu_seconds(),
                    held.cpu_seconds() if held else 0.0,
                    time.monotonic(),
                )
                time.sleep(seconds)
                c1, u1, h1, t1 = (
                    stat.cpu_seconds(),
                    upstream.cpu_seconds(),
                    held.cpu_seconds() if held else 0.0,
                    time.monotonic(),
                )
                # small requests beside them
                m0 = sidecar_counters(sidecar)
                c2, t2 = stat.cpu_seconds(), time.monotonic()
                res = wrk(
                    sidecar.url, connections=SMALL_CONNECTIONS, seconds=seconds, script=script
                )
                c3, t3 = stat.cpu_seconds(), time.monotonic()
                counters = delta(sidecar_counters(sidecar), m0)
                after = wait_in_flight(sidecar, n, timeout=15)  # the streams still held
            finally:
                streams = held.stop() if held is not None else {}
            alone_rate = (c1 - c0) / (t1 - t0)
            res.update(
                {
                    "round": r,
                    "streams": n,
                    "state_before": state,
                    "in_flight_after": after["in_flight"],
                    "holder": {**(held.ready if held else {}), **streams},
                    "alone_window_s": t1 - t0,
                    "alone_cpu_per_s": alone_rate,
                    "alone_upstream_cpu_per_s": (u1 - u0) / (t1 - t0),
                    "alone_holder_cpu_per_s": (h1 - h0) / (t1 - t0),
                    "load_window_s": t3 - t2,
                    "load_cpu_s": c3 - c2,
                    "load_cpu_per_s": (c3 - c2) / (t3 - t2),
                    "sidecar_counters": counters,
                }
            )
            runs[str(n)].append(res)
    return runs


def write_bodies(model: Path, lengths: Sequence[int], workdir: Path) -> dict[int, list[Path]]:
    """Curve 2's request bodies, ``TEXTS_PER_LENGTH`` distinct ones per length, as files."""
    progress(f"scaling: {TEXTS_PER_LENGTH} prompts of each of {lengths} tokens")
    files: dict[int, list[Path]] = {}
    for n in lengths:
        files[n] = []
        for i, text in enumerate(make_texts(model, n, TEXTS_PER_LENGTH, seed=n)):
            body = json.dumps({"model": "tiny", "prompt": text, "max_tokens": 1}).encode()
            path = workdir / f"body-{n}-{i}.json"
            path.write_bytes(body)
            files[n].append(path)
    return files


def record(args: argparse.Namespace, flags: list[str], largest: int) -> dict[str, Any]:
    """What the run is, before it measures anything: machine, code, settings."""
    quick = args.quick
    return {
        "machine": machine(),
        # what of the sidecar's own code differs from the commit (the "+dirty" may be elsewhere)
        "sidecar_code_changes": subprocess.run(
            ["git", "status", "--porcelain", "--", "sidecar"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.splitlines(),
        "quick": quick,
        "rounds": 1 if quick else args.rounds,
        "seconds_per_run": 2 if quick else args.seconds,
        "sidecar_flags": flags,
        "largest_body_bytes": largest,
        "max_model_len": MAX_MODEL_LEN,
        "settings": {
            "connections": list((1, 8, 64) if quick else CONNECTIONS),
            "lengths": list((1_000, 32_000) if quick else LENGTHS),
            "prompt_connections": list(PROMPT_CONNECTIONS),
            "in_flight": list((0, 50) if quick else IN_FLIGHT),
            "small_connections": SMALL_CONNECTIONS,
            "stream_max_tokens": STREAM_MAX_TOKENS,
            "stream_interval_ms": args.interval_ms,
            "texts_per_length": TEXTS_PER_LENGTH,
            "workers": args.workers,
        },
    }


def start(
    args: argparse.Namespace, model: Path, flags: list[str], stack: contextlib.ExitStack
) -> tuple[FakeVllmProcess, SidecarProcess, list[Target]]:
    """The fake vLLM, the sidecar (one process) and, with ``--workers N``, a second sidecar
    with N relay workers; the targets of curve 1 over them."""
    progress("scaling: starting the fast upstream and the sidecar")
    upstream = stack.enter_context(FakeVllmProcess(model, max_model_len=MAX_MODEL_LEN))
    sidecar = SidecarProcess(upstream.url, *flags)
    stack.callback(sidecar.stop)
    sidecar.start(timeout=120)
    assert sidecar.proc is not None
    targets = [
        Target("direct", upstream.url, []),
        Target("sidecar", sidecar.url, [sidecar.proc.pid]),
    ]
    if args.workers > 1:
        multi = SidecarProcess(upstream.url, *flags, "--workers", str(args.workers))
        stack.callback(multi.stop)
        multi.start(timeout=120)
        assert multi.proc is not None
        pids = [multi.proc.pid, *children_pids(multi.proc.pid)]
        assert len(pids) == 1 + args.workers, pids
        targets.append(Target(f"sidecar, {args.workers} relay workers", multi.url, pids))
    # one process: --workers auto (the default) starts relay workers only under a CPU quota
    workers = children_pids(sidecar.proc.pid)
    if workers:
        raise SystemExit(
            f"the sidecar started {len(workers)} relay workers (--workers auto under a CPU "
            "quota): this benchmark measures one process"
        )
    return upstream, sidecar, targets


def warm_all(
    targets: Sequence[Target], sidecar: SidecarProcess, files: dict[int, list[Path]]
) -> None:
    for t in targets:
        warm(t)
    # each length once through the sidecar: the first count of a shape is checked
    # against the upstream's /tokenize (done by the short prompts above)
    with httpx.Client(timeout=120) as client:
        for n in files:
            client.post(
                sidecar.url + "/v1/completions",
                content=files[n][0].read_bytes(),
                headers={"content-type": "application/json"},
            ).raise_for_status()
    time.sleep(2)


def curves(
    results: dict[str, Any],
    args: argparse.Namespace,
    started: tuple[FakeVllmProcess, SidecarProcess, list[Target]],
    files: dict[int, list[Path]],
    script: Path,
) -> None:
    """The three curves, into ``results``, with the load average after each."""
    upstream, sidecar, targets = started
    rounds, seconds, s = results["rounds"], results["seconds_per_run"], results["settings"]
    up = ProcStat(upstream.pid)
    results["load_average"] = {"start": [round(x, 2) for x in load_average()]}
    results["connections"] = curve_connections(
        targets, up, script, s["connections"], rounds, seconds
    )
    results["load_average"]["after_connections"] = [round(x, 2) for x in load_average()]
    results["prompts"] = curve_prompts(
        sidecar, targets[0], up, files, PROMPT_CONNECTIONS, rounds, seconds
    )
    results["load_average"]["after_prompts"] = [round(x, 2) for x in load_average()]
    results["in_flight"] = curve_in_flight(
        sidecar, up, script, s["in_flight"], rounds, seconds, args.interval_ms, STREAM_MAX_TOKENS
    )
    results["load_average"]["after_in_flight"] = [round(x, 2) for x in load_average()]
    results["load_average_after"] = results["load_average"]["after_in_flight"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run: set up, warm, the three curves, the sidecar's memory; everything stopped."""
    model = ensure_tokenizer_model()
    lengths = (1_000, 32_000) if args.quick else LENGTHS
    with contextlib.ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        script = wrk_script(workdir / "post.lua", SMALL_BODY)
        files = write_bodies(model, lengths, workdir)
        largest = max(p.stat().st_size for paths in files.values() for p in paths)
        flags = ["--log-level", "warning"]
        # the sidecar's --max-body-bytes default is 8 MiB; raise it only if a body exceeds it
        if largest > 8 * 2**20:
            flags += ["--max-body-bytes", str(2 * largest)]
        results = record(args, flags, largest)
        started = start(args, model, flags, stack)
        _, sidecar, targets = started
        warm_all(targets, sidecar, files)
        state = sidecar.state()
        results["sidecar_processes"] = 1
        results["state_at_start"] = state
        results["counted_by"] = sidecar_counters(sidecar)
        progress(f"scaling: budget {state['budget_blocks']} blocks; counts {results['counted_by']}")
        curves(results, args, started, files, script)
        assert sidecar.proc is not None
        results["sidecar_rss_bytes"] = ProcStat(sidecar.proc.pid).rss_bytes()
        results["sidecar_peak_rss_bytes"] = ProcStat(sidecar.proc.pid).peak_rss_bytes()
        return results
