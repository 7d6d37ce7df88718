"""The run: the fake vLLM, a sidecar with relay workers in front of it, the clients' processes,
and the readings around the measured window (the owner's lag histogram, ``/state``, ``/proc``).

Timeline, from the clients' common start: a rest window before it (the owner's loop with
nothing to relay, for reference), the ramp (the rate rising linearly), the measured window (the
rate held), then the drain (no new arrivals; the answers under way finish).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import httpx

from bench.common import Target, warm
from bench.owner_loop.client import Plan
from bench.owner_loop.lag import delta, read_histogram, summarize
from bench.owner_loop.settings import Settings
from harness.bench_util import ROOT, ProcStat, children_pids, load_average, machine, progress
from harness.fake_vllm_fast import FakeVllmProcess
from harness.vllm_cpu import ensure_tokenizer_model
from harness.workload import SidecarProcess

_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: seconds between two samples of /state and the processes' CPU during the window (a /state
#: costs the owner's loop about as much as a decision's round trip: not more often)
SAMPLE_EVERY_S = 1.0
#: the lag histogram is also read every this many samples (15 s, a common Prometheus scrape
#: interval: a /metrics render holds the owner's loop some 10 ms at 2,000 in flight, so reading
#: it more often would add the probes over 5 ms it measures): the window in parts
LAG_EVERY = 15
#: seconds the clients' processes are given to start before the rest window
CLIENT_BOOT_S = 3.0
#: the sidecar's counters whose change over the window is recorded
COUNTERS = (
    "kv_sidecar_requests_total",
    "kv_sidecar_relay_worker_requests_total",
    "kv_sidecar_upstream_errors_total",
    "kv_sidecar_decision_seconds_sum",
    "kv_sidecar_decision_seconds_count",
)


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += ProcStat(pid).cpu_seconds()
    return total


def machine_cpu() -> dict[str, float]:
    """The machine's CPU seconds so far, every core together, from /proc/stat: busy (every
    process's, the kernel's included) and steal (taken by the hypervisor)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return {
        "busy_s": (user + nice + system + irq + softirq) / _CLK_TCK,
        "steal_s": steal / _CLK_TCK,
    }


def sidecar_counters(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


class Processes:
    """The processes whose CPU is read: the owner, each worker, the fake, the clients, this."""

    def __init__(self, owner: int, workers: list[int], fake: int, clients: list[int]) -> None:
        self.groups: dict[str, list[int]] = {
            "owner": [owner],
            **{f"worker {i + 1}": [pid] for i, pid in enumerate(workers)},
            "fake vLLM": [fake],
            "client": clients,
            "bench (this process)": [os.getpid()],
        }

    def read(self) -> dict[str, float]:
        out = {name: cpu_seconds(pids) for name, pids in self.groups.items()}
        out.update({f"machine {k}": v for k, v in machine_cpu().items()})
        return out

    def waits(self) -> dict[str, float]:
        """Seconds each process's main thread (an event loop's) has waited for a core so far,
        runnable but not running (the run-queue delay of /proc/PID/schedstat)."""
        return {name: run_queue_seconds(pids) for name, pids in self.groups.items()}


def run_queue_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{pid}/schedstat") as fh:
                total += int(fh.read().split()[1]) / 1e9
    return total


def sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))


def start_clients(settings: Settings, url: str, start: float) -> list[subprocess.Popen[str]]:
    procs = []
    for i in range(settings.clients):
        plan = Plan(
            url=url,
            rate=settings.rate / settings.clients,
            stream_share=settings.stream_share,
            stream_events=settings.stream_events,
            interval_ms=settings.interval_ms(),
            start=start,
            ramp_s=settings.ramp_s,
            window_s=settings.seconds,
            seed=1000 + i,
            drain_s=settings.stream_duration() * 3 + 30,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "bench.owner_loop", "--client", plan.dumps()],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def kill_all(procs: list[subprocess.Popen[str]]) -> None:
    """The clients still running on the way out (after a failure)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def collect_clients(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict[str, Any]]:
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"a client exited {proc.returncode}")
        outs.append(dict(json.loads(out.strip().splitlines()[-1])))
    return outs


def window_samples(sidecar: SidecarProcess, procs: Processes, until: float) -> list[dict[str, Any]]:
    """``/state``'s in flight and queue, and every process's CPU, every ``SAMPLE_EVERY_S``."""
    samples: list[dict[str, Any]] = []
    with httpx.Client(timeout=5) as http:
        tick = time.monotonic()
        while tick < until - SAMPLE_EVERY_S / 2:
            sleep_until(tick)
            row: dict[str, Any] = {"t": time.monotonic()}
            try:
                state = http.get(sidecar.metrics_url + "/state").json()
                row.update(in_flight=state["in_flight"], queue_depth=state["queue_depth"])
            except httpx.HTTPError as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            row["state_read_s"] = time.monotonic() - row["t"]
            row["cpu"], row["wait"] = procs.read(), procs.waits()
            if len(samples) % LAG_EVERY == 0 and samples:
                with contextlib.suppress(httpx.HTTPError, LookupError):
                    asked = time.monotonic()
                    text = http.get(sidecar.metrics_url + "/metrics").text
                    row["metrics_read_s"] = time.monotonic() - asked
                    row["lag"] = read_histogram(text)
            samples.append(row)
            tick += SAMPLE_EVERY_S
    return samples


Mark = tuple[float, dict[str, Any], dict[str, float], dict[str, float]]


def sub_windows(first: Mark, samples: list[dict[str, Any]], last: Mark) -> list[dict[str, Any]]:
    """The window cut where the lag histogram was read: each part's probes and every
    process's cores, the machine's and others' (what is not this run's) included, and the
    share of the part each process waited for a core."""
    marks = [first, *((r["t"], r["lag"], r["cpu"], r["wait"]) for r in samples if "lag" in r), last]
    out = []
    for (t0, h0, c0, w0), (t1, h1, c1, w1) in itertools.pairwise(marks):
        secs = t1 - t0
        cores = {k: (c1[k] - c0[k]) / secs for k in c0}
        ours = sum(v for k, v in cores.items() if not k.startswith("machine"))
        cores["others"] = cores["machine busy_s"] - ours
        out.append(
            {
                "from_s": t0 - first[0],
                "to_s": t1 - first[0],
                "lag": summarize(delta(h1, h0)),
                "cores": cores,
                "waiting": {k: (w1[k] - w0[k]) / secs for k in w0},
            }
        )
    return out


def start_stack(
    settings: Settings, stack: contextlib.ExitStack
) -> tuple[FakeVllmProcess, SidecarProcess, list[str]]:
    model = ensure_tokenizer_model()
    progress("owner_loop: starting the fast fake vLLM and the sidecar")
    upstream = stack.enter_context(FakeVllmProcess(model))
    flags = [
        *("--workers", str(settings.workers)),
        *("--log-level", "warning"),
        # the pool to vLLM is shared out among the workers: one connection per stream at least
        *("--upstream-max-connections", str(max(1024, 4 * settings.in_flight))),
    ]
    sidecar = SidecarProcess(upstream.url, *flags)
    stack.callback(sidecar.stop)
    sidecar.start(timeout=120)
    return upstream, sidecar, flags


def run(settings: Settings) -> dict[str, Any]:
    """The whole run; everything it started is stopped on the way out."""
    results: dict[str, Any] = {
        "machine": machine(),
        "settings": {
            **asdict(settings),
            "stream_duration_s": settings.stream_duration(),
            "stream_interval_ms": settings.interval_ms(),
            "expected_in_flight": settings.expected_in_flight(),
        },
        "sidecar_code_changes": subprocess.run(
            ["git", "status", "--porcelain", "--", "sidecar"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.splitlines(),
    }
    with contextlib.ExitStack() as stack:
        upstream, sidecar, flags = start_stack(settings, stack)
        results["sidecar_flags"] = flags
        assert sidecar.proc is not None
        owner = sidecar.proc.pid
        workers = children_pids(owner)
        if len(workers) != settings.workers:
            raise RuntimeError(f"{len(workers)} relay workers, {settings.workers} asked")
        warm(Target("sidecar", sidecar.url, []), n=100)
        time.sleep(1.0)
        lag: Callable[[], dict[str, Any]] = lambda: read_histogram(sidecar.metrics())  # noqa: E731
        # the clients' processes start (imports: a second of CPU) before the rest window
        booted = time.monotonic() + CLIENT_BOOT_S
        start = booted + settings.rest_s
        clients = start_clients(settings, sidecar.url, start)
        stack.callback(kill_all, clients)
        procs = Processes(owner, workers, upstream.pid, [p.pid for p in clients])
        results["load_average"] = {"start": [round(x, 2) for x in load_average()]}
        sleep_until(booted)
        marks: dict[str, Any] = {"rest": lag()}
        sleep_until(start)
        marks["ramp"] = lag()
        progress(f"owner_loop: ramp to {settings.rate:g}/s over {settings.ramp_s:g} s")
        sleep_until(start + settings.ramp_s)
        text = sidecar.metrics()
        marks["window"], cpu0, t0 = read_histogram(text), procs.read(), time.monotonic()
        wait0 = procs.waits()
        counters0 = sidecar_counters(text)
        results["load_average"]["window_start"] = [round(x, 2) for x in load_average()]
        progress(f"owner_loop: measuring {settings.seconds:g} s")
        end = start + settings.ramp_s + settings.seconds
        samples = window_samples(sidecar, procs, end)
        sleep_until(end)
        text = sidecar.metrics()
        marks["drain"], cpu1, t1 = read_histogram(text), procs.read(), time.monotonic()
        wait1 = procs.waits()
        counters1 = sidecar_counters(text)
        results["load_average"]["window_end"] = [round(x, 2) for x in load_average()]
        if children_pids(owner) != workers:
            results["workers_replaced"] = children_pids(owner)
        progress("owner_loop: draining (no new arrivals)")
        outs = collect_clients(clients, timeout=settings.stream_duration() * 4 + 120)
        marks["end"] = lag()
        results["state_after"] = sidecar.state()
        results["load_average"]["end"] = [round(x, 2) for x in load_average()]
    phases = list(marks)
    results["lag"] = {
        phase: summarize(delta(marks[later], marks[phase]))
        for phase, later in itertools.pairwise(phases)
    }
    results["window"] = {
        "seconds": t1 - t0,
        "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0},
        "run_queue_wait_s": {k: wait1[k] - wait0[k] for k in wait0},
        "sidecar_counters": {k: v - counters0.get(k, 0.0) for k, v in counters1.items()},
    }
    results["sub_windows"] = sub_windows(
        (t0, marks["window"], cpu0, wait0), samples, (t1, marks["drain"], cpu1, wait1)
    )
    results["samples"] = [{**s, "t": s["t"] - start} for s in samples]
    results["clients"] = [{k: v for k, v in o.items() if k != "records"} for o in outs]
    results["requests"] = requests_summary(settings, [r for o in outs for r in o["records"]])
    return results


def _pct(values: list[float], q: float) -> float | None:
    from harness.stats import percentile

    return percentile(values, q) if values else None


def requests_summary(settings: Settings, records: list[list[float]]) -> dict[str, Any]:
    """What the clients saw of the window: arrivals, answers, latencies, their own lateness.
    A record is ``[streamed, scheduled, sent, head, done, status, gap]``, seconds from the
    start (``gap``: a chunked answer's longest wait between two reads after its head; the fake
    paces a stream's events ``interval_ms`` apart, so what exceeds that is the relay's delay
    of one event, the inter-token latency added)."""
    lo, hi = settings.ramp_s, settings.ramp_s + settings.seconds
    arrivals = [r for r in records if lo <= r[1] < hi]
    statuses: dict[str, int] = {}
    for r in arrivals:
        statuses[str(int(r[5]))] = statuses.get(str(int(r[5])), 0) + 1
    out: dict[str, Any] = {
        "records": len(records),
        "arrivals": len(arrivals),
        "arrivals_per_s": len(arrivals) / settings.seconds,
        "sent_per_s": sum(1 for r in records if lo <= r[2] < hi) / settings.seconds,
        "streamed": sum(1 for r in arrivals if r[0]),
        "statuses": statuses,
        "completed_in_window": sum(1 for r in records if r[5] == 200 and lo <= r[4] < hi),
        "refused_429": statuses.get("429", 0),
        "errors": sum(n for s, n in statuses.items() if s not in ("200", "429")),
    }
    out["completed_per_s"] = out["completed_in_window"] / settings.seconds
    late = [r[2] - r[1] for r in arrivals]
    out["dispatch_lateness_s"] = {
        "p50": _pct(late, 0.5),
        "p99": _pct(late, 0.99),
        "max": max(late, default=None),
    }
    pace = settings.interval_ms() / 1000.0
    excess = [r[6] - pace for r in arrivals if r[0] and r[5] == 200 and len(r) > 6]
    out["stream_gap_excess_s"] = {
        "pace_s": pace,
        "n": len(excess),
        "p50": _pct(excess, 0.5),
        "p99": _pct(excess, 0.99),
        "max": max(excess, default=None),
    }
    for name, streamed in (("streamed", 1), ("plain", 0)):
        ok = [r for r in arrivals if r[0] == streamed and r[5] == 200]
        total = [r[4] - r[2] for r in ok]
        head = [r[3] - r[2] for r in ok]
        out[f"{name}_latency_s"] = {
            "n": len(ok),
            "p50": _pct(total, 0.5),
            "p99": _pct(total, 0.99),
            "max": max(total, default=None),
            "head_p50": _pct(head, 0.5),
            "head_p99": _pct(head, 0.99),
        }
    return out
