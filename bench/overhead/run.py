"""The overhead benchmark's run: the paths a request can take, started, and the rounds measured
over them (latency at one connection, requests/s at a fixed concurrency, SSE events relayed),
then the sidecar's memory, its own timings, what the pieces cost and where its CPU goes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    PROMPT,
    SMALL_BODY,
    BaselineSidecar,
    Nginx,
    Target,
    nginx_user,
    rotate,
    warm,
    worktree,
    wrk,
    wrk_script,
)
from bench.proxies import BenchProxy
from harness.bench_util import (
    RESULTS,
    ROOT,
    ProcStat,
    children_pids,
    load_average,
    machine,
    progress,
)
from harness.exposition import metric_value
from harness.fake_vllm_fast import FakeVllmProcess
from harness.vllm_cpu import ensure_model
from harness.workload import SidecarProcess

#: the reference for what the sidecar's own stack costs: uvicorn + httpx relaying, nothing else
RELAY = "uvicorn+httpx relay"
#: the same relay on the sidecar's transport, and on aiohttp: what the HTTP client alone costs
OWN_RELAY = "uvicorn+httpx relay, sidecar transport"
AIOHTTP_RELAY = "uvicorn+aiohttp relay"
GRANIAN_RELAY = "granian+httpx relay, sidecar transport"
IDS = "sidecar, prompt as token ids"

NGINX_CONF = """\
{user}worker_processes 1;
daemon off;
master_process on;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream vllm {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://vllm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def sse(
    url: str, *, concurrency: int, events: int, seconds: float, interval_ms: float | None
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "bench.sse_client",
        url,
        "--concurrency",
        str(concurrency),
        "--events",
        str(events),
        "--duration",
        str(seconds),
    ]
    if interval_ms is not None:
        cmd += ["--interval-ms", str(interval_ms)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


class RssSampler:
    """Samples a process's RSS every 0.2 s in a thread; ``peak`` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.stat = ProcStat(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, self.stat.rss_bytes())
            self._stop.wait(0.2)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def profile_sidecar(pid: int, out: Path, seconds: float) -> Iterator[subprocess.Popen[bytes]]:
    """py-spy record of the sidecar while the body of the ``with`` runs load against it."""
    proc = subprocess.Popen(
        [
            shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(seconds)),
            "--rate",
            "200",
            "--format",
            "raw",
            "--output",
            str(out),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        proc.wait(seconds + 30)


def summarize_profile(raw: Path, top: int = 14) -> dict[str, Any]:
    """From py-spy's collapsed stacks: self time by package, inclusive time of the sidecar's own
    functions, and the hottest lines."""
    total = 0
    packages: dict[str, int] = {}
    ours: dict[str, int] = {}
    lines: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_s)
        frames = stack.split(";")
        total += count
        leaf_path, leaf_name, leaf_line = _frame(frames[-1])
        package = leaf_path.split("/", 1)[0].removesuffix(".py") or "?"
        packages[package] = packages.get(package, 0) + count
        where = f"{leaf_name} ({leaf_path}:{leaf_line})"
        lines[where] = lines.get(where, 0) + count
        seen = set()
        for f in frames:
            path, name, _ = _frame(f)
            if path.startswith("sidecar/") and (path, name) not in seen:
                seen.add((path, name))
                key = f"{name} ({path})"
                ours[key] = ours.get(key, 0) + count
    if not total:
        return {"samples": 0}

    def ranked(d: dict[str, int], n: int = top) -> list[tuple[str, float]]:
        return [(k, v / total) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]

    return {
        "samples": total,
        "self_by_package": ranked(packages, 12),
        "sidecar_inclusive": ranked(ours),
        "hottest_lines": ranked(lines, 10),
    }


def _frame(frame: str) -> tuple[str, str, str]:
    """(path relative to site-packages or the repo, function, line) of a py-spy raw frame,
    which looks like ``function (path/to/file.py:123)``."""
    name, _, where = frame.partition(" (")
    path, _, line = where.rstrip(")").rpartition(":")
    for marker in ("site-packages/", "lib/python3.11/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return path, name, line


# --- the paths ----------------------------------------------------------------------------------


@dataclass
class Paths:
    """The processes a request can go through, started, and the targets over them."""

    upstream: FakeVllmProcess
    local: SidecarProcess  # counts with the model's local tokenizer
    remote: SidecarProcess  # counts with the upstream's /tokenize
    targets: list[Target]  # latency and throughput, in this order
    sse_targets: list[Target]
    baseline: dict[str, Any] | None


def start_baseline(
    args: argparse.Namespace,
    upstream: FakeVllmProcess,
    local: SidecarProcess,
    stack: contextlib.ExitStack,
) -> tuple[BaselineSidecar, dict[str, Any]]:
    """The sidecar of ``--baseline`` from a worktree, removed after its sidecar stops."""
    tree, sha = stack.enter_context(worktree(args.baseline))
    progress(f"overhead: baseline sidecar @{args.baseline} ({sha[:12]}) from {tree}")
    base = BaselineSidecar(tree, upstream.url, *local.args)
    stack.callback(base.stop)
    base.start()
    return base, {
        "ref": args.baseline,
        "commit": sha,
        "name": f"sidecar @{args.baseline}",
        "ids_name": f"sidecar @{args.baseline}, prompt as token ids",
        "flags": list(local.args),
        "verified": base.verify(),
    }


def start_relays(upstream: FakeVllmProcess, stack: contextlib.ExitStack) -> list[Target]:
    """nginx and the plain relays (no x-bench header: the shim relays as is), each a target."""

    def conf(directory: Path, port: int) -> str:
        return NGINX_CONF.format(
            dir=directory, port=port, upstream_port=upstream.port, user=nginx_user()
        )

    nginx = stack.enter_context(Nginx(conf, ready_path="/health"))
    targets = [Target("nginx", nginx.url, nginx.worker_pids())]
    for name, extra in (
        (RELAY, ()),
        (OWN_RELAY, ("--client", "upstream-transport")),
        (AIOHTTP_RELAY, ("--client", "aiohttp")),
        # granian's Rust threads are threads of the one process: its CPU counts them all
        (GRANIAN_RELAY, ("--client", "upstream-transport", "--server", "granian")),
    ):
        relay = BenchProxy("shim", upstream.url, *extra)
        stack.callback(relay.stop)
        targets.append(Target(name, relay.url, [relay.proc.pid]))
    return targets


def start_paths(
    args: argparse.Namespace,
    model: Path,
    config_only: Path,
    ids_script: Path,
    stack: contextlib.ExitStack,
) -> Paths:
    """Every path started (each stopped by ``stack``), in the order the rounds rotate."""
    progress("overhead: starting the fast upstream, two sidecars and nginx")
    upstream = stack.enter_context(FakeVllmProcess(model))
    local = SidecarProcess(upstream.url, "--log-level", "warning")
    remote = SidecarProcess(
        upstream.url, "--log-level", "warning", "--model-config", str(config_only)
    )
    # --workers N: the same sidecar with N relay worker processes, measured over all of them
    multi = (
        SidecarProcess(upstream.url, "--log-level", "warning", "--workers", str(args.workers))
        if args.workers > 1
        else None
    )
    for sidecar in (local, remote, multi):
        if sidecar is not None:
            stack.callback(sidecar.stop)
            sidecar.start()
    base, baseline = start_baseline(args, upstream, local, stack) if args.baseline else (None, None)
    nginx, relay, own, aiohttp, granian = start_relays(upstream, stack)
    assert local.proc is not None and remote.proc is not None
    direct = Target("direct", upstream.url, [upstream.pid])
    via_local = Target("sidecar", local.url, [local.proc.pid])
    via_ids = Target(IDS, local.url, [local.proc.pid], script=ids_script)
    via_remote = Target("sidecar (/tokenize)", remote.url, [remote.proc.pid])
    via_multi: list[Target] = []
    if multi is not None:
        assert multi.proc is not None
        pids = [multi.proc.pid, *children_pids(multi.proc.pid)]
        assert len(pids) == 1 + args.workers, pids
        via_multi = [Target(f"sidecar, {args.workers} relay workers", multi.url, pids)]
    # the baseline revision's sidecar (--baseline), with and without counting
    olds: list[Target] = []
    if base is not None and baseline is not None:
        assert base.proc is not None
        olds = [
            Target(baseline["name"], base.url, [base.proc.pid]),
            Target(baseline["ids_name"], base.url, [base.proc.pid], script=ids_script),
        ]
    targets = [
        direct,
        via_local,
        *via_multi,
        *olds[:1],
        via_ids,
        *olds[1:],
        via_remote,
        nginx,
        relay,
        own,
        aiohttp,
        granian,
    ]
    sse_targets = [direct, via_local, *olds[:1], nginx, relay, own, aiohttp, granian]
    return Paths(upstream, local, remote, targets, sse_targets, baseline)


# --- the rounds ---------------------------------------------------------------------------------


def latency_rounds(
    paths: Paths, script: Path, rounds: int, seconds: float
) -> dict[str, list[dict[str, Any]]]:
    """1. Latency added to a small non-streamed request: one connection, back to back."""
    upstream_stat = ProcStat(paths.upstream.pid)
    lat: dict[str, list[dict[str, Any]]] = {t.name: [] for t in paths.targets}
    for r in range(rounds):
        for t in rotate(paths.targets, r):
            progress(f"overhead: latency round {r + 1}/{rounds}: {t.name}")
            cpu0, up0 = t.cpu_seconds(), upstream_stat.cpu_seconds()
            res = wrk(t.url, connections=1, seconds=seconds, script=t.script or script)
            res["cpu_s"] = t.cpu_seconds() - cpu0
            res["upstream_cpu_s"] = upstream_stat.cpu_seconds() - up0
            lat[t.name].append(res)
    return lat


def throughput_rounds(
    paths: Paths, script: Path, rounds: int, seconds: float, concurrency: int
) -> dict[str, list[dict[str, Any]]]:
    """2. Requests per second at a fixed concurrency."""
    thr: dict[str, list[dict[str, Any]]] = {t.name: [] for t in paths.targets}
    for r in range(rounds):
        for t in rotate(paths.targets, r):
            progress(f"overhead: throughput round {r + 1}/{rounds} (c={concurrency}): {t.name}")
            cpu0 = t.cpu_seconds()
            res = wrk(t.url, connections=concurrency, seconds=seconds, script=t.script or script)
            res["cpu_s"] = t.cpu_seconds() - cpu0
            thr[t.name].append(res)
    return thr


def sse_rounds(
    paths: Paths, args: argparse.Namespace, rounds: int, seconds: float
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """3. SSE events relayed: unpaced (as fast as the upstream writes) and paced."""
    streams: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for mode, interval, conc in (
        ("unpaced", None, args.sse_concurrency),
        ("paced", args.sse_interval_ms, args.sse_paced_concurrency),
    ):
        streams[mode] = {t.name: [] for t in paths.sse_targets}
        for r in range(rounds):
            for t in rotate(paths.sse_targets, r):
                progress(f"overhead: SSE {mode} round {r + 1}/{rounds} ({conc} streams): {t.name}")
                cpu0 = t.cpu_seconds()
                res = sse(
                    t.url,
                    concurrency=conc,
                    events=args.sse_events,
                    seconds=seconds,
                    interval_ms=interval,
                )
                res["cpu_s"] = t.cpu_seconds() - cpu0
                streams[mode][t.name].append(res)
    return streams


def warm_up(paths: Paths) -> dict[str, float | None]:
    """Every path warmed; the prompt counts by method after it (the two sidecars' own)."""
    for t in paths.targets:
        warm(t)
    time.sleep(3)  # the tokenizer self-check and the first scrapes settle
    for t in paths.targets:
        warm(t, 100)
    counted = {
        "local": metric_value(
            paths.local.metrics(), "kv_sidecar_prompt_counts_total", method="exact_local"
        ),
        "upstream": metric_value(
            paths.remote.metrics(), "kv_sidecar_prompt_counts_total", method="exact_upstream"
        ),
    }
    progress(f"overhead: prompt counts by method after warm-up: {counted}")
    return counted


def profile(
    paths: Paths, args: argparse.Namespace, workdir: Path, script: Path, seconds: float
) -> dict[str, Any]:
    """4. Where the sidecar's time goes: a profile under the throughput load (not measured)."""
    progress("overhead: py-spy profile of the sidecar under load")
    local = paths.local
    assert local.proc is not None
    raw = workdir / "profile.txt"
    with profile_sidecar(local.proc.pid, raw, seconds=max(seconds, 6)) as prof:
        wrk(local.url, connections=args.concurrency, seconds=max(seconds, 6), script=script)
    if prof.returncode == 0 and raw.exists():
        name = "overhead-quick-profile.txt" if args.quick else "overhead-sidecar-profile.txt"
        shutil.copy(raw, RESULTS / name)
        return summarize_profile(raw)
    err = prof.stderr.read().decode() if prof.stderr else ""
    return {"error": err.strip()[-500:]}


def measure(
    args: argparse.Namespace, paths: Paths, workdir: Path, script: Path, rounds: int, seconds: float
) -> dict[str, Any]:
    """The rounds over started paths, and what is read from the sidecar after them."""
    local = paths.local
    assert local.proc is not None
    results: dict[str, Any] = {"counted_by": warm_up(paths)}
    time.sleep(2)
    rss_rest = ProcStat(local.proc.pid).rss_bytes()
    results |= {"rounds": rounds, "seconds_per_run": seconds}
    if paths.baseline is not None:
        results["baseline"] = paths.baseline
    with RssSampler(local.proc.pid) as rss:
        results["latency"] = latency_rounds(paths, script, rounds, seconds)
        results["throughput"] = throughput_rounds(paths, script, rounds, seconds, args.concurrency)
        results["sse"] = sse_rounds(paths, args, rounds, seconds)
        results["sse_settings"] = {
            "events_per_stream": args.sse_events,
            "unpaced_streams": args.sse_concurrency,
            "paced_streams": args.sse_paced_concurrency,
            "paced_interval_ms": args.sse_interval_ms,
        }
    results["rss"] = {
        "rest_bytes": rss_rest,
        "under_load_peak_sampled_bytes": rss.peak,
        "high_water_mark_bytes": ProcStat(local.proc.pid).peak_rss_bytes(),
        "after_load_bytes": ProcStat(local.proc.pid).rss_bytes(),
    }
    results["in_situ"] = in_situ(local.metrics())
    progress("overhead: component costs (httpx, raw asyncio, tokenizer) in this process")
    results["components"] = components(paths.upstream.url, Path(paths.upstream.model_root))
    if not args.no_profile:
        results["profile"] = profile(paths, args, workdir, script, seconds)
    results["load_average_after"] = [round(x, 2) for x in load_average()]
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run: the paths started, every round measured, everything stopped again."""
    info = machine()
    rounds = 2 if args.quick else args.rounds
    seconds = 2.0 if args.quick else args.seconds
    model = ensure_model()
    with contextlib.ExitStack() as stack:
        config_only = Path(tempfile.mkdtemp(prefix="bench-config-only-"))
        stack.callback(shutil.rmtree, config_only, ignore_errors=True)
        shutil.copy(model / "config.json", config_only / "config.json")
        workdir = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        script = wrk_script(workdir / "post.lua", SMALL_BODY)
        # the same request with its prompt as token ids: no tokenizer runs, so the difference to
        # the text prompt is what counting costs inside the sidecar
        ids_body = {**SMALL_BODY, "prompt": list(range(1, 21))}
        ids_script = wrk_script(workdir / "post-ids.lua", ids_body)
        paths = start_paths(args, model, config_only, ids_script, stack)
        return {"machine": info} | measure(args, paths, workdir, script, rounds, seconds)


def components(upstream_url: str, model: Path, n: int = 1000) -> dict[str, float]:
    """CPU microseconds per call of the pieces a proxied request is made of, measured one at a
    time in this process against the fast upstream: what the profile's shares mean in time."""
    import uvloop

    from sidecar.counting import ModelTokenizer

    payload = json.dumps(SMALL_BODY).encode()
    url = upstream_url + "/v1/completions"
    out: dict[str, float] = {}

    async def measure() -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(100):
                await client.post(url, content=payload)
            t = time.process_time()
            for _ in range(n):
                request = client.build_request("POST", url, content=payload)
                response = await client.send(request, stream=True)
                async for _chunk in response.aiter_raw():
                    pass
                await response.aclose()
            out["httpx_streamed_request_us"] = (time.process_time() - t) / n * 1e6
        host, port = upstream_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        raw = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-length: {len(payload)}"
            "\r\n\r\n"
        ).encode() + payload
        t = time.process_time()
        for _ in range(n):
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        out["raw_asyncio_request_us"] = (time.process_time() - t) / n * 1e6
        writer.close()

    uvloop.run(measure())
    tokenizer = ModelTokenizer.load(model)
    t = time.process_time()
    for _ in range(n):
        tokenizer.count_text(PROMPT, add_special_tokens=True)
    out["local_prompt_count_us"] = (time.process_time() - t) / n * 1e6
    t = time.process_time()
    for _ in range(n * 10):
        json.loads(payload)
    out["json_parse_body_us"] = (time.process_time() - t) / n / 10 * 1e6
    return out


def in_situ(text: str) -> dict[str, float | None]:
    """Mean per-request time the sidecar itself measured for counting and deciding."""
    out: dict[str, float | None] = {}
    for key, name, labels in (
        ("tokenize_local_mean_us", "kv_sidecar_tokenize_seconds", {"method": "exact_local"}),
        ("decision_mean_us", "kv_sidecar_decision_seconds", {}),
    ):
        total = metric_value(text, name + "_sum", **labels)
        count = metric_value(text, name + "_count", **labels)
        out[key] = total / count * 1e6 if total is not None and count else None
    return out
