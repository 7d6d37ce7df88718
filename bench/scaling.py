"""How the sidecar's CPU per request scales: with connections, with prompt length and with the
requests it holds in flight. The figures size its Kubernetes CPU request (deploy/README.md).

    python -m bench.scaling              # about 8 minutes; bench/results/scaling.json and .png
    python -m bench.scaling --quick      # a smoke run (fewer points, one short round)
    python -m bench.scaling --workers 2  # also a sidecar with 2 relay workers on curve 1

Set-up, every part its own process on one machine: the fast fake vLLM (``bench.upstream``,
``--max-model-len 200000`` so that 128k-token prompts are not refused, a KV pool of 1,000,000
blocks), one ``kv-sidecar serve`` in front of it with its default flags (``--log-level
warning``; one process, counting prompts with the model's local tokenizer, discovered from
``/v1/models`` ``root``), and the load generators. The CPU figures are the sidecar process's
(all its threads: long prompts are tokenized on worker threads with the GIL released) read from
``/proc`` before and after each run, divided by the requests it served; ``direct`` is the same
load sent straight to the fake, for its requests/s and the fake's own CPU per request.

1. **Connections**: small non-streamed completions (``bench.overhead``'s ~20-token prompt,
   ``max_tokens`` 16) from ``wrk -t1`` at 1 to 64 connections.
2. **Prompt length**: completions of about 1k, 8k, 32k and 128k tokens (``bench.counting``'s
   generated texts, four distinct ones per length, sent in turn), ``max_tokens`` 1, at 1 and 4
   connections, from a light closed-loop client (its own process) that finishes every request it
   starts, so that no half-counted prompt is charged to the window. Per request and per prompt
   token (the sidecar's own count, ``kv_sidecar_prompt_tokens_total``).
3. **Requests in flight**: N slow SSE streams held open through the sidecar (a light client
   process; ``max_tokens`` 10,000, paced by the fake at one event per 100 ms; every one admitted,
   checked on ``/state``), first alone (their own cost, N = 0: the idle cost), then with ``wrk``
   sending small requests at 8 connections beside them: the CPU per small request with the
   streams' rate subtracted, and the mean admission decision time over that window
   (``kv_sidecar_decision_seconds`` sum and count deltas).

Rounds interleave the points (their order rotates each round); figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.common import LONG_CONTEXT_LEN as MAX_MODEL_LEN
from bench.common import SMALL_BODY, WRK_LUA, Target, make_texts, rotate, stream_once, warm, wrk
from harness.bench_util import (
    RESULTS,
    ROOT,
    ProcStat,
    children_pids,
    fmt,
    load_average,
    machine,
    machine_line,
    progress,
    table,
    update_section,
    write_json,
)
from harness.fake_vllm_fast import FakeVllmProcess
from harness.stats import median, percentile
from harness.vllm_cpu import ensure_tokenizer_model
from harness.workload import SidecarProcess, metric_value

CONNECTIONS = (1, 2, 4, 8, 16, 32, 64)
LENGTHS = (1_000, 8_000, 32_000, 128_000)
PROMPT_CONNECTIONS = (1, 4)
IN_FLIGHT = (0, 50, 200, 500)
#: wrk's connections beside the held streams
SMALL_CONNECTIONS = 8
STREAM_MAX_TOKENS = 10_000
STREAM_INTERVAL_MS = 100.0
TEXTS_PER_LENGTH = 4
#: the CPU request shipped in deploy/components/kv-sidecar/sidecar-patch.yaml, in millicores
SHIPPED_REQUEST_M = 500
SECTION = "scaling"
#: the worked example in the deploy arithmetic: streams decoding at a pace, plus requests/s
EXAMPLE_STREAMS = 256
EXAMPLE_TOKENS_PER_S = 20
EXAMPLE_RPS = 20


# --- the light clients (their own processes) ---------------------------------------------------


async def send_loop(
    url: str, bodies: Sequence[bytes], connections: int, seconds: float
) -> dict[str, Any]:
    """``connections`` keep-alive connections, each sending non-streamed completions (``bodies``
    in turn) one after another until ``seconds`` have passed; a request under way then is
    finished, never abandoned."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests = [
        (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        + body
        for body in bodies
    ]
    latencies: list[float] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def worker(k: int) -> None:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
        i = k
        try:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                try:
                    await stream_once(reader, writer, requests[i % len(requests)])
                except (RuntimeError, asyncio.IncompleteReadError, ConnectionError) as exc:
                    errors.append(str(exc)[:300])
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
                    continue
                latencies.append(time.perf_counter() - start)
                i += connections
        finally:
            writer.close()

    await asyncio.gather(*(worker(k) for k in range(connections)))
    wall = time.perf_counter() - t0
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "seconds": wall,
        "rps": len(latencies) / wall,
        "p50_us": percentile(latencies, 0.5) * 1e6,
        "p99_us": percentile(latencies, 0.99) * 1e6,
        "last_error": errors[-1] if errors else "",
    }


async def hold_streams(url: str, n: int, max_tokens: int, interval_ms: float) -> dict[str, Any]:
    """Open ``n`` streamed completions at once and read them until stdin closes. Prints one
    ``ready`` line with what opened once every answer's head is in, then the totals."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "hold this stream open",
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"content-type: application/json\r\nx-bench-interval-ms: {interval_ms:g}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    st: dict[str, Any] = {"opened": 0, "refused": 0, "ended": 0, "events": 0, "error": ""}
    writers: list[asyncio.StreamWriter] = []
    all_heads = asyncio.Event()

    def answered(ok: bool, error: str = "") -> None:
        st["opened" if ok else "refused"] += 1
        if error:
            st["error"] = error
        if st["opened"] + st["refused"] >= n:
            all_heads.set()

    async def one() -> None:
        try:
            reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        except OSError as exc:
            answered(False, str(exc))
            return
        writers.append(writer)
        writer.write(request)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            answered(False, str(exc))
            return
        if head.split(b" ", 2)[1] != b"200":
            answered(False, head[:200].decode(errors="replace"))
            return
        answered(True)
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                st["events"] += data.count(b"data:")
        st["ended"] += 1

    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    t0 = time.perf_counter()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(all_heads.wait(), 120)
    st["open_s"] = time.perf_counter() - t0
    print("ready " + json.dumps(st), flush=True)
    events0, t1 = st["events"], time.perf_counter()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    seconds = time.perf_counter() - t1
    st["events_per_s"] = (st["events"] - events0) / seconds if seconds else math.nan
    for task in tasks:
        task.cancel()
    for writer in writers:
        writer.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    return st


class HeldStreams:
    """``hold_streams`` in its own process."""

    def __init__(self, url: str, n: int, max_tokens: int, interval_ms: float) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.scaling",
                "--hold-streams",
                url,
                "--streams",
                str(n),
                "--max-tokens",
                str(max_tokens),
                "--interval-ms",
                str(interval_ms),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.proc.kill()
            raise RuntimeError(f"stream holder failed: {line!r}")
        self.ready: dict[str, Any] = json.loads(line.split(" ", 1)[1])

    def cpu_seconds(self) -> float:
        return ProcStat(self.proc.pid).cpu_seconds()

    def stop(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        out = self.proc.stdout.read()
        self.proc.wait(60)
        return dict(json.loads(out.strip().splitlines()[-1]))


def send(url: str, files: Sequence[Path], connections: int, seconds: float) -> dict[str, Any]:
    """``send_loop`` in its own process (``--send``), run to its end."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.scaling",
            "--send",
            url,
            "--connections",
            str(connections),
            "--seconds",
            str(seconds),
            "--body-files",
            *map(str, files),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bench client failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


# --- the runs ----------------------------------------------------------------------------------


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    rounds = 1 if quick else args.rounds
    seconds = 2 if quick else args.seconds
    connections = (1, 8, 64) if quick else CONNECTIONS
    lengths = (1_000, 32_000) if quick else LENGTHS
    in_flight = (0, 50) if quick else IN_FLIGHT
    model = ensure_tokenizer_model()
    workdir = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    script = workdir / "post.lua"
    script.write_text(WRK_LUA.format(body=json.dumps(json.dumps(SMALL_BODY))))
    progress(f"scaling: {TEXTS_PER_LENGTH} prompts of each of {lengths} tokens")
    files: dict[int, list[Path]] = {}
    largest = 0
    for n in lengths:
        files[n] = []
        for i, text in enumerate(make_texts(model, n, TEXTS_PER_LENGTH, seed=n)):
            body = json.dumps({"model": "tiny", "prompt": text, "max_tokens": 1}).encode()
            largest = max(largest, len(body))
            path = workdir / f"body-{n}-{i}.json"
            path.write_bytes(body)
            files[n].append(path)
    flags = ["--log-level", "warning"]
    # the sidecar's --max-body-bytes default is 8 MiB; raise it only if a body exceeds it
    if largest > 8 * 2**20:
        flags += ["--max-body-bytes", str(2 * largest)]
    results: dict[str, Any] = {
        "machine": machine(),
        # what of the sidecar's own code differs from the commit (the "+dirty" may be elsewhere)
        "sidecar_code_changes": subprocess.run(
            ["git", "status", "--porcelain", "--", "sidecar"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.splitlines(),
        "quick": quick,
        "rounds": rounds,
        "seconds_per_run": seconds,
        "sidecar_flags": flags,
        "largest_body_bytes": largest,
        "max_model_len": MAX_MODEL_LEN,
        "settings": {
            "connections": list(connections),
            "lengths": list(lengths),
            "prompt_connections": list(PROMPT_CONNECTIONS),
            "in_flight": list(in_flight),
            "small_connections": SMALL_CONNECTIONS,
            "stream_max_tokens": STREAM_MAX_TOKENS,
            "stream_interval_ms": args.interval_ms,
            "texts_per_length": TEXTS_PER_LENGTH,
            "workers": args.workers,
        },
    }
    progress("scaling: starting the fast upstream and the sidecar")
    upstream = FakeVllmProcess(model, max_model_len=MAX_MODEL_LEN).start()
    sidecar = SidecarProcess(upstream.url, *flags)
    multi = (
        SidecarProcess(upstream.url, *flags, "--workers", str(args.workers))
        if args.workers > 1
        else None
    )
    try:
        sidecar.start(timeout=120)
        if multi is not None:
            multi.start(timeout=120)
        assert sidecar.proc is not None
        # one process: --workers auto (the default) starts relay workers only under a CPU quota
        workers = children_pids(sidecar.proc.pid)
        if workers:
            raise SystemExit(
                f"the sidecar started {len(workers)} relay workers (--workers auto under a CPU "
                "quota): this benchmark measures one process"
            )
        results["sidecar_processes"] = 1
        direct = Target("direct", upstream.url, [])
        via = Target("sidecar", sidecar.url, [sidecar.proc.pid])
        targets = [direct, via]
        if multi is not None:
            assert multi.proc is not None
            pids = [multi.proc.pid, *children_pids(multi.proc.pid)]
            assert len(pids) == 1 + args.workers, pids
            targets.append(Target(f"sidecar, {args.workers} relay workers", multi.url, pids))
        up = ProcStat(upstream.proc.pid)
        for t in targets:
            warm(t)
        # each length once through the sidecar: the first count of a shape is checked
        # against the upstream's /tokenize (done by the short prompts above)
        with httpx.Client(timeout=120) as client:
            for n in lengths:
                client.post(
                    sidecar.url + "/v1/completions",
                    content=files[n][0].read_bytes(),
                    headers={"content-type": "application/json"},
                ).raise_for_status()
        time.sleep(2)
        state = sidecar.state()
        results["state_at_start"] = state
        results["counted_by"] = sidecar_counters(sidecar)
        progress(f"scaling: budget {state['budget_blocks']} blocks; counts {results['counted_by']}")

        results["load_average"] = {"start": [round(x, 2) for x in load_average()]}
        results["connections"] = curve_connections(
            targets, up, script, connections, rounds, seconds
        )
        results["load_average"]["after_connections"] = [round(x, 2) for x in load_average()]
        results["prompts"] = curve_prompts(
            sidecar, direct, up, files, PROMPT_CONNECTIONS, rounds, seconds
        )
        results["load_average"]["after_prompts"] = [round(x, 2) for x in load_average()]
        results["in_flight"] = curve_in_flight(
            sidecar,
            up,
            script,
            in_flight,
            rounds,
            seconds,
            args.interval_ms,
            STREAM_MAX_TOKENS,
        )
        results["load_average"]["after_in_flight"] = [round(x, 2) for x in load_average()]
        results["load_average_after"] = results["load_average"]["after_in_flight"]
        results["sidecar_rss_bytes"] = ProcStat(sidecar.proc.pid).rss_bytes()
        results["sidecar_peak_rss_bytes"] = ProcStat(sidecar.proc.pid).peak_rss_bytes()
        return results
    finally:
        for sc in (sidecar, multi):
            if sc is not None:
                sc.stop()
        upstream.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# --- figures -----------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of per-round values."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": median(vals), "min": min(vals), "max": max(vals)}


def figures(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"connections": {}, "prompts": {}, "in_flight": {}}
    direct_conn = results["connections"]["direct"]
    for name, per in results["connections"].items():
        out["connections"][name] = {}
        for c, runs in per.items():
            d_runs = direct_conn[c]
            out["connections"][name][c] = {
                "rps": spread([r["rps"] for r in runs]),
                "cpu_us_per_request": spread(
                    [r["cpu_s"] / r["requests"] * 1e6 for r in runs if r["requests"]]
                ),
                "cores": spread([r["cpu_s"] / (r["duration_us"] / 1e6) for r in runs]),
                "upstream_cpu_us_per_request": spread(
                    [r["upstream_cpu_s"] / r["requests"] * 1e6 for r in runs if r["requests"]]
                ),
                "rps_ratio_to_direct": spread(
                    [
                        r["rps"] / d["rps"]
                        for r, d in zip(
                            sorted(runs, key=lambda x: x["round"]),
                            sorted(d_runs, key=lambda x: x["round"]),
                            strict=True,
                        )
                    ]
                ),
                "p50_us": spread([r["p50_us"] for r in runs]),
                "p99_us": spread([r["p99_us"] for r in runs]),
                "errors": sum(r["status_errors"] + r["other_errors"] for r in runs),
                "requests": sum(r["requests"] for r in runs),
            }
    for name, per in results["prompts"].items():
        out["prompts"][name] = {}
        for cell, runs in per.items():
            fig: dict[str, Any] = {
                "rps": spread([r["rps"] for r in runs]),
                "cpu_ms_per_request": spread(
                    [r["cpu_s"] / r["requests"] * 1e3 for r in runs if r["requests"]]
                ),
                "cores": spread([r["cpu_s"] / r["seconds"] for r in runs]),
                "upstream_cpu_ms_per_request": spread(
                    [r["upstream_cpu_s"] / r["requests"] * 1e3 for r in runs if r["requests"]]
                ),
                "p50_ms": spread([r["p50_us"] / 1e3 for r in runs]),
                "errors": sum(r["errors"] for r in runs),
                "requests": sum(r["requests"] for r in runs),
                "last_error": next((r["last_error"] for r in runs if r["last_error"]), ""),
            }
            if name == "sidecar":
                per_count = [
                    r["sidecar_counters"]["prompt_tokens"] / r["sidecar_counters"]["prompt_counts"]
                    for r in runs
                    if r["sidecar_counters"]["prompt_counts"]
                ]
                fig["prompt_tokens_per_request"] = spread(per_count)
                fig["cpu_us_per_prompt_token"] = spread(
                    [
                        r["cpu_s"] / r["sidecar_counters"]["prompt_tokens"] * 1e6
                        for r in runs
                        if r["sidecar_counters"]["prompt_tokens"]
                    ]
                )
                fig["counted_local"] = sum(r["sidecar_counters"]["local_counts"] for r in runs)
                fig["counted"] = sum(r["sidecar_counters"]["prompt_counts"] for r in runs)
            out["prompts"][name][cell] = fig
    for n, runs in results["in_flight"].items():
        small = []
        for r in runs:
            streams_cost = r["alone_cpu_per_s"] * r["load_window_s"]
            small.append((r["load_cpu_s"] - streams_cost) / r["requests"] * 1e6)
        c = [r["sidecar_counters"] for r in runs]
        out["in_flight"][n] = {
            "in_flight_seen_min": min(r["state_before"]["in_flight"] for r in runs),
            "in_flight_after_min": min(r["in_flight_after"] for r in runs),
            "reserved_blocks": spread([r["state_before"]["reserved_blocks"] for r in runs]),
            "alone_cpu_ms_per_s": spread([r["alone_cpu_per_s"] * 1e3 for r in runs]),
            "alone_upstream_cpu_ms_per_s": spread(
                [r["alone_upstream_cpu_per_s"] * 1e3 for r in runs]
            ),
            "holder_cpu_ms_per_s": spread([r["alone_holder_cpu_per_s"] * 1e3 for r in runs]),
            "events_per_s": spread([r["holder"].get("events_per_s", 0.0) for r in runs]),
            "load_cpu_ms_per_s": spread([r["load_cpu_per_s"] * 1e3 for r in runs]),
            "rps": spread([r["rps"] for r in runs]),
            "cpu_us_per_small_request": spread(small),
            "cpu_us_per_small_request_unsubtracted": spread(
                [r["load_cpu_s"] / r["requests"] * 1e6 for r in runs if r["requests"]]
            ),
            "decision_mean_us": spread(
                [x["decision_sum"] / x["decision_count"] * 1e6 for x in c if x["decision_count"]]
            ),
            "p50_us": spread([r["p50_us"] for r in runs]),
            "p99_us": spread([r["p99_us"] for r in runs]),
            "errors": sum(r["status_errors"] + r["other_errors"] for r in runs),
            "streams_refused": sum(r["holder"].get("refused", 0) for r in runs),
            "streams_ended_early": sum(r["holder"].get("ended", 0) for r in runs),
        }
    out["deploy"] = deploy_arithmetic(results, out)
    return out


def deploy_arithmetic(results: dict[str, Any], fig: dict[str, Any]) -> dict[str, Any]:
    """The figures the CPU request is computed from, and the rates the shipped request covers."""
    inf = fig["in_flight"]
    idle = inf["0"]["alone_cpu_ms_per_s"]["median"] if "0" in inf else math.nan
    largest = max((int(n) for n in inf if n != "0"), default=0)
    per_stream = (
        (inf[str(largest)]["alone_cpu_ms_per_s"]["median"] - idle) / largest
        if largest
        else math.nan
    )
    conn = fig["connections"]["sidecar"]
    per_request = {c: v["cpu_us_per_request"]["median"] for c, v in conn.items()}
    peak_rps = max(v["rps"]["median"] for v in conn.values())
    budget = SHIPPED_REQUEST_M - idle  # millicores left for requests
    covers = {c: budget / (us / 1e3) for c, us in per_request.items()}  # req/s
    prompts = fig["prompts"]["sidecar"]
    covers_prompts = {
        cell: budget / v["cpu_ms_per_request"]["median"] for cell, v in prompts.items()
    }
    slopes = {
        n: (v["alone_cpu_ms_per_s"]["median"] - idle) / int(n) for n, v in inf.items() if n != "0"
    }
    events_per_stream = 1000 / results["settings"]["stream_interval_ms"]
    # the example: EXAMPLE_STREAMS decoding at EXAMPLE_TOKENS_PER_S each, plus
    # EXAMPLE_RPS requests of ~1k-token prompts at 4 connections
    cell = f"1000x{max(results['settings']['prompt_connections'])}"
    example: dict[str, Any] = {}
    if cell in prompts and largest:
        per_event_ms = per_stream / events_per_stream
        events = EXAMPLE_STREAMS * EXAMPLE_TOKENS_PER_S
        example = {
            "streams": EXAMPLE_STREAMS,
            "tokens_per_s_each": EXAMPLE_TOKENS_PER_S,
            "events_per_s": events,
            "rps": EXAMPLE_RPS,
            "prompt_cell": cell,
            "cpu_ms_per_request": prompts[cell]["cpu_ms_per_request"]["median"],
            "streams_millicores": events * per_event_ms,
            "requests_millicores": EXAMPLE_RPS * prompts[cell]["cpu_ms_per_request"]["median"],
        }
        example["total_millicores"] = (
            idle + example["streams_millicores"] + example["requests_millicores"]
        )
    streams_for = {}
    for n in (100, 200, 500):
        left = budget - n * per_stream
        streams_for[str(n)] = {c: left / (us / 1e3) for c, us in per_request.items()}
    return {
        "shipped_request_millicores": SHIPPED_REQUEST_M,
        "idle_millicores": idle,
        "per_stream_millicores": per_stream,
        "per_stream_from_n": largest,
        "streams_alone_at_n_millicores": inf[str(largest)]["alone_cpu_ms_per_s"]["median"]
        if largest
        else math.nan,
        "stream_events_per_s": events_per_stream,
        "per_stream_millicores_by_n": slopes,
        "per_event_us": per_stream / events_per_stream * 1e3,
        "example": example,
        "cpu_us_per_small_request": per_request,
        "peak_rps_one_process": peak_rps,
        "rps_at_1": conn[min(conn, key=int)]["rps"]["median"],
        "covers_small_rps": covers,
        "covers_prompt_rps": covers_prompts,
        "covers_small_rps_with_streams": streams_for,
    }


# --- chart and report --------------------------------------------------------------------------


def _err(points: Sequence[dict[str, float]], scale: float = 1.0) -> list[list[float]]:
    return [
        [(p["median"] - p["min"]) * scale for p in points],
        [(p["max"] - p["median"]) * scale for p in points],
    ]


def _twin_legend(ax: Any, twin: Any) -> None:
    """One legend under the panel for the lines of both y axes."""
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    ax.legend(
        lines + more,
        labels + more_labels,
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.14),
        ncol=2,
    )


def chart(results: dict[str, Any], fig: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 5), layout="constrained")
    # 1. connections
    rps_ax = ax1.twinx()
    for i, (name, per) in enumerate(fig["connections"].items()):
        cs = [int(c) for c in per]
        pts = list(per.values())
        if name != "direct":
            cpu = [p["cpu_us_per_request"] for p in pts]
            ax1.errorbar(
                cs,
                [p["median"] for p in cpu],
                yerr=_err(cpu),
                marker="o",
                capsize=3,
                color=f"C{i}",
                label=f"{name}: CPU per request",
            )
        rps = [p["rps"] for p in pts]
        rps_ax.errorbar(
            cs,
            [p["median"] for p in rps],
            yerr=_err(rps),
            marker="s",
            linestyle="--",
            capsize=3,
            color=f"C{i}",
            alpha=0.6,
            label=f"{name}: requests/s",
        )
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(results["settings"]["connections"], map(str, results["settings"]["connections"]))
    ax1.set_xlabel("wrk connections (small non-streamed completions)")
    ax1.set_ylabel("sidecar CPU per request (µs)")
    ax1.set_ylim(bottom=0)
    rps_ax.set_yscale("log")
    rps_ax.set_ylabel("requests/s (dashed)")
    _twin_legend(ax1, rps_ax)
    ax1.set_title("CPU per request against connections")
    # 2. prompt length
    per = fig["prompts"]["sidecar"]
    dper = fig["prompts"]["direct"]
    lengths = results["settings"]["lengths"]
    for i, c in enumerate(results["settings"]["prompt_connections"]):
        pts = [per[f"{n}x{c}"]["cpu_ms_per_request"] for n in lengths]
        ax2.errorbar(
            lengths,
            [p["median"] for p in pts],
            yerr=_err(pts),
            marker="o",
            capsize=3,
            color=f"C{i}",
            label=f"sidecar, {c} connection{'s' if c > 1 else ''}",
        )
        ups = [dper[f"{n}x{c}"]["upstream_cpu_ms_per_request"]["median"] for n in lengths]
        ax2.plot(
            lengths,
            ups,
            ":",
            marker=".",
            color=f"C{i}",
            label=f"fake vLLM's own CPU, direct, {c} conn.",
        )
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("prompt tokens (completions, max_tokens 1)")
    ax2.set_ylabel("CPU per request (ms)")
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax2.set_title("CPU per request against prompt length")
    # 3. in flight
    inf = fig["in_flight"]
    ns = [int(n) for n in inf]
    pts = [inf[str(n)]["cpu_us_per_small_request"] for n in ns]
    ax3.errorbar(
        ns,
        [p["median"] for p in pts],
        yerr=_err(pts),
        marker="o",
        capsize=3,
        color="C0",
        label=f"CPU per small request (c={SMALL_CONNECTIONS}), streams' cost subtracted",
    )
    raw = [inf[str(n)]["cpu_us_per_small_request_unsubtracted"]["median"] for n in ns]
    ax3.plot(
        ns,
        raw,
        "--",
        marker=".",
        color="C0",
        alpha=0.5,
        label="CPU per small request, streams' cost not subtracted",
    )
    dec = [inf[str(n)]["decision_mean_us"] for n in ns]
    ax3.errorbar(
        ns,
        [p["median"] for p in dec],
        yerr=_err(dec),
        marker="s",
        capsize=3,
        color="C3",
        label="mean admission decision (µs, the sidecar's wall-clock timer)",
    )
    pace = results["settings"]["stream_interval_ms"]
    ax3.set_xlabel(f"SSE streams held in flight (one event per {pace:g} ms)")
    ax3.set_xticks(ns)
    ax3.set_ylabel("µs")
    ax3.set_ylim(bottom=0)
    cost_ax = ax3.twinx()
    alone = [inf[str(n)]["alone_cpu_ms_per_s"] for n in ns]
    cost_ax.errorbar(
        ns,
        [p["median"] for p in alone],
        yerr=_err(alone),
        marker="^",
        linestyle=":",
        capsize=3,
        color="C2",
        label="streams alone: sidecar CPU (ms per s)",
    )
    cost_ax.set_ylabel("sidecar CPU with the streams alone (ms per second)")
    cost_ax.set_ylim(bottom=0)
    _twin_legend(ax3, cost_ax)
    ax3.set_title("CPU per request against requests in flight")
    figure.suptitle(
        "kv-sidecar (one process) in front of a fast fake vLLM; medians over "
        f"{results['rounds']} rounds, bars min-max; shared 2-core VM (load generator, fake and "
        "sidecar on the same cores)",
        fontsize=9,
    )
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _m(p: dict[str, float], digits: int = 0, unit: str = "") -> str:
    """A median with its min-max range."""
    return f"{fmt(p['median'], digits, unit)} ({fmt(p['min'], digits)}-{fmt(p['max'], digits)})"


def report(results: dict[str, Any], fig: dict[str, Any], command: str, png: str) -> str:
    s = results["settings"]
    rounds = results["rounds"]
    la = results["load_average"]
    run_line = machine_line(results["machine"], results.get("load_average_after"))
    secs = results["seconds_per_run"]
    lines = [
        f"Command: `{command}`; {run_line}. The machine is a shared 2-core VM: the load "
        "generator (wrk or the bench's client), the fake vLLM and the sidecar run on the same "
        "two cores, so a sidecar that could use a whole core rarely gets one, and the requests/s "
        "below are the machine's, not the sidecar's alone. "
        f"Load average (1, 5, 15 min): start {' '.join(map(str, la['start']))}, after curve 1 "
        f"{' '.join(map(str, la['after_connections']))}, after curve 2 "
        f"{' '.join(map(str, la['after_prompts']))}, after curve 3 "
        f"{' '.join(map(str, la['after_in_flight']))}.",
        "",
        "Sidecar code: "
        + (
            "as committed (`git status` shows no change under `sidecar/`)"
            if not results.get("sidecar_code_changes", ["?"])
            else f"changed from the commit: {results.get('sidecar_code_changes', 'not recorded')}"
        )
        + ".",
        "",
        f"One sidecar process, default flags (`{' '.join(results['sidecar_flags'])}`; "
        "`--workers auto`, which is one process where no CPU quota is set, as here), counting "
        f"with the local tokenizer ({fmt(results['counted_by']['local_counts'], 0)} of "
        f"{fmt(results['counted_by']['prompt_counts'], 0)} warm-up counts `exact_local`). CPU: the "
        "sidecar process's user + system time (all threads) over the run, divided by the "
        f"requests it served. Every figure is the **median over {rounds} interleaved rounds**, "
        "with the min-max of the rounds in brackets.",
        "",
        f"**1. Against connections** (`wrk -t1 -cN`, {results['seconds_per_run']:g} s per run; "
        "small non-streamed completion, ~20-token prompt, `max_tokens` 16)",
        "",
    ]
    rows = []
    for name, per in fig["connections"].items():
        for c, v in per.items():
            sidecar_row = name != "direct"
            rows.append(
                [
                    name,
                    c,
                    _m(v["rps"]),
                    fmt(v["rps_ratio_to_direct"]["median"], 3) if sidecar_row else "1",
                    _m(v["cpu_us_per_request"]) if sidecar_row else "-",
                    fmt(v["cores"]["median"], 2) if sidecar_row else "-",
                    fmt(v["upstream_cpu_us_per_request"]["median"], 0),
                    fmt(v["p50_us"]["median"] / 1e3, 2),
                    fmt(v["p99_us"]["median"] / 1e3, 2),
                    v["errors"],
                ]
            )
    lines.append(
        table(
            [
                "path",
                "connections",
                "req/s",
                "/ direct",
                "sidecar CPU µs per request",
                "sidecar cores busy",
                "fake vLLM CPU µs per request",
                "p50 ms",
                "p99 ms",
                "errors",
            ],
            rows,
        )
    )
    lines += [
        "",
        "**2. Against prompt length** (completions of about "
        f"{', '.join(f'{n:,}' for n in s['lengths'])} tokens, {s['texts_per_length']} distinct "
        "texts each, `max_tokens` 1; a closed-loop client that finishes every request it "
        f"starts; {secs:g} s per run, twice "
        "that through the sidecar for 32k tokens and more; tokens per request: the sidecar's own "
        "count)",
        "",
    ]
    rows = []
    sc, dr = fig["prompts"]["sidecar"], fig["prompts"]["direct"]
    for cell, v in sc.items():
        n, c = cell.split("x")
        d = dr[cell]
        rows.append(
            [
                f"{int(n):,}",
                fmt(v["prompt_tokens_per_request"]["median"], 0),
                c,
                _m(v["rps"], 1),
                _m(v["cpu_ms_per_request"], 2),
                fmt(v["cpu_us_per_prompt_token"]["median"], 2),
                fmt(v["cores"]["median"], 2),
                fmt(v["p50_ms"]["median"], 1),
                fmt(d["rps"]["median"], 1),
                fmt(d["upstream_cpu_ms_per_request"]["median"], 2),
                f"{v['errors']} / {d['errors']}",
            ]
        )
    lines.append(
        table(
            [
                "prompt tokens",
                "counted per request",
                "connections",
                "sidecar req/s",
                "sidecar CPU ms per request",
                "sidecar CPU µs per prompt token",
                "sidecar cores busy",
                "sidecar p50 ms",
                "direct req/s",
                "fake vLLM CPU ms per request (direct)",
                "errors sidecar / direct",
            ],
            rows,
        )
    )
    lines += [
        "",
        f"**3. Against requests in flight** (N streamed completions held open through the "
        f"sidecar, `max_tokens` {s['stream_max_tokens']:,}, one event per "
        f"{s['stream_interval_ms']:g} ms each, read by a light client process; every one "
        "admitted: `/state` `in_flight` = N before each window. First "
        f"{secs:g} s with the streams alone, then {secs:g} s of "
        f"`wrk -t1 -c{s['small_connections']}` small requests beside them. CPU per small "
        "request: the sidecar's CPU over the wrk window less the streams-alone rate times the "
        "window, divided by the requests; decision: `kv_sidecar_decision_seconds` sum / count "
        "over the wrk window)",
        "",
    ]
    rows = []
    for n, v in fig["in_flight"].items():
        rows.append(
            [
                n,
                f"{v['in_flight_seen_min']} / {v['in_flight_after_min']}",
                _m(v["alone_cpu_ms_per_s"], 1),
                fmt(v["events_per_s"]["median"], 0),
                fmt(v["holder_cpu_ms_per_s"]["median"], 0),
                _m(v["rps"]),
                fmt(v["load_cpu_ms_per_s"]["median"], 0),
                _m(v["cpu_us_per_small_request"]),
                fmt(v["cpu_us_per_small_request_unsubtracted"]["median"], 0),
                _m(v["decision_mean_us"], 1),
                fmt(v["p50_us"]["median"] / 1e3, 2),
                fmt(v["p99_us"]["median"] / 1e3, 2),
                f"{v['errors']} / {v['streams_refused']} / {v['streams_ended_early']}",
            ]
        )
    lines.append(
        table(
            [
                "streams N",
                "in_flight before / after (min)",
                "streams alone: sidecar CPU ms per s",
                "events/s relayed",
                "stream client CPU ms per s",
                "small req/s",
                "sidecar CPU ms per s (with wrk)",
                "CPU µs per small request (streams subtracted)",
                "not subtracted",
                "decision mean µs",
                "p50 ms",
                "p99 ms",
                "errors / streams refused / ended early",
            ],
            rows,
        )
    )
    lines += [
        "",
        f"CPU times come from `/proc` in 10 ms ticks: over a {secs:g} s window a figure in ms "
        f"per second moves in steps of {10 / secs:.1f} ms/s. Where the sidecar is at one core "
        "with wrk beside the streams (the loop's ceiling; the 'with wrk' column), the streams "
        "likely relay more events per turn of the loop than alone and so cost less than their "
        "alone rate: the subtracted figure then leans low and the unsubtracted one is the upper "
        "bound.",
        "",
        f"![scaling: CPU per request]({png})",
        "",
        *deploy_text(fig),
    ]
    return "\n".join(lines)


def deploy_text(fig: dict[str, Any]) -> list[str]:
    d = fig["deploy"]
    idle, per_stream = d["idle_millicores"], d["per_stream_millicores"]
    per_req = d["cpu_us_per_small_request"]
    budget = d["shipped_request_millicores"] - idle
    cs = list(per_req)
    lines = [
        "**The CPU request, from these figures** (all medians above; millicores = ms of CPU per "
        "second):",
        "",
        "    CPU request = idle + R x (CPU per request at the expected concurrency and prompt "
        "length) + S x (CPU per held stream)",
        "",
        f"- idle (the scrape loop, nothing in flight): {fmt(idle, 1)} m (curve 3, N = 0);",
        f"- one held stream at {d['stream_events_per_s']:g} events/s: "
        f"({fmt(d['streams_alone_at_n_millicores'], 1)} - {fmt(idle, 1)}) / "
        f"{d['per_stream_from_n']} = {fmt(per_stream, 3)} m (curve 3, N = "
        f"{d['per_stream_from_n']}), {fmt(d['per_event_us'], 1)} µs per relayed event; the "
        "same slope from the smaller N: "
        + ", ".join(f"{fmt(v, 3)} m at N = {n}" for n, v in d["per_stream_millicores_by_n"].items())
        + " (the more streams, the more events share a turn of the loop);",
        "- a small non-streamed request: "
        + ", ".join(
            f"{fmt(per_req[c], 0)} µs at {c} connection{'s' if c != '1' else ''}" for c in cs
        )
        + " (curve 1);",
        f"- one process served at most {fmt(d['peak_rps_one_process'], 0)} small requests/s here "
        "(curve 1's best median; the loop is one core, shared with wrk and the fake).",
        "",
        "Curve 1's figures include the idle cost spread over the requests (at 1 connection "
        f"{fmt(idle, 1)} m / {fmt(d['rps_at_1'], 0)} req/s = {fmt(idle / d['rps_at_1'] * 1e3, 1)}"
        " µs per request), so adding the idle term counts it twice, on the safe side.",
        "",
        f"The shipped request of {d['shipped_request_millicores']}m leaves {fmt(budget, 1)} m "
        "after the idle cost, which covers "
        + ", ".join(
            f"{fmt(budget / (per_req[c] / 1e3), 0)} small requests/s at {c} connection"
            f"{'s' if c != '1' else ''}"
            for c in cs
        )
        + "; "
        + "; ".join(_with_streams(d, n, per_stream) for n in ("100", "200", "500"))
        + ". Long prompts: "
        + ", ".join(
            f"{fmt(v, 2)} req/s of {int(cell.split('x')[0]):,} tokens at {cell.split('x')[1]} "
            f"connection{'s' if cell.split('x')[1] != '1' else ''}"
            for cell, v in d["covers_prompt_rps"].items()
        )
        + ".",
    ]
    ex = d.get("example")
    if ex:
        n, c = ex["prompt_cell"].split("x")
        lines += [
            "",
            f"A worked example: {ex['streams']} streams decoding at {ex['tokens_per_s_each']} "
            f"tokens/s each ({fmt(ex['events_per_s'], 0)} events/s, near the "
            f"{fmt(fig['in_flight'][str(d['per_stream_from_n'])]['events_per_s']['median'], 0)} "
            f"relayed at N = {d['per_stream_from_n']}) cost {fmt(ex['events_per_s'], 0)} x "
            f"{fmt(d['per_event_us'], 1)} µs = {fmt(ex['streams_millicores'], 0)} m; "
            f"{ex['rps']} requests/s of {int(n):,}-token prompts (at {c} connections: "
            f"{fmt(ex['cpu_ms_per_request'], 2)} ms each) cost "
            f"{fmt(ex['requests_millicores'], 0)} m; with the idle "
            f"{fmt(idle, 1)} m, {fmt(ex['total_millicores'], 0)} m in all.",
        ]
    return lines


def _with_streams(d: dict[str, Any], n: str, per_stream: float) -> str:
    covers = d["covers_small_rps_with_streams"][n]
    streams = int(n) * per_stream
    head = f"with {n} streams held ({fmt(streams, 0)} m of their own)"
    if all(v <= 0 for v in covers.values()):
        return f"{head} it covers no small requests at all"
    return (
        f"{head} it covers "
        + ", ".join(f"{fmt(max(v, 0.0), 0)} at {c}" for c, v in covers.items())
        + " connections"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer points, 1 round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--seconds", type=int, default=3, help="per run (load window; wrk takes whole seconds)"
    )
    parser.add_argument(
        "--interval-ms",
        type=float,
        default=STREAM_INTERVAL_MS,
        help="pace of the held streams' events (curve 3)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="also measure a sidecar with this many relay workers on curve 1 (CPU summed over "
        "its process tree)",
    )
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="redo the figures, chart and section from bench/results/scaling.json (or "
        "scaling-quick.json with --quick) without measuring",
    )
    # the light clients' own processes
    parser.add_argument("--hold-streams", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=STREAM_MAX_TOKENS, help=argparse.SUPPRESS)
    parser.add_argument("--send", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--body-files", nargs="+", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hold_streams or args.send:
        import uvloop

        if args.hold_streams:
            out = uvloop.run(
                hold_streams(args.hold_streams, args.streams, args.max_tokens, args.interval_ms)
            )
        else:
            bodies = [p.read_bytes() for p in args.body_files]
            out = uvloop.run(send_loop(args.send, bodies, args.connections, args.seconds))
        print(json.dumps(out), flush=True)
        return out
    name = "scaling-quick" if args.quick else "scaling"
    if args.report_only:
        results = dict(json.loads((RESULTS / f"{name}.json").read_text()))
        # a run without the field was made with the defaults
        command = results.setdefault(
            "command", "python -m bench.scaling" + (" --quick" if args.quick else "")
        )
    else:
        if shutil.which("wrk") is None:
            sys.exit("wrk is missing: run scripts/system-deps.sh --bench")
        RESULTS.mkdir(parents=True, exist_ok=True)
        results = run(args)
        command = "python -m bench.scaling" + (" --quick" if args.quick else "")
        for flag, value, default in (
            ("--rounds", args.rounds, 3),
            ("--seconds", args.seconds, 3),
            ("--interval-ms", args.interval_ms, STREAM_INTERVAL_MS),
        ):
            if value != default and not args.quick:
                command += f" {flag} {value:g}"
        if args.workers > 1:
            command += f" --workers {args.workers}"
        results["command"] = command
    fig = figures(results)
    results["figures"] = fig
    chart(results, fig, RESULTS / f"{name}.png")
    text = report(results, fig, command, f"bench/results/{name}.png")
    results["report"] = text
    write_json(name, results)
    print(text)
    if not args.no_report and not args.quick:
        update_section(ROOT / "BENCHMARKS.md", SECTION, text)
    progress("scaling: done")
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
