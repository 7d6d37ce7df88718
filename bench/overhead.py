"""Proxy overhead on loopback: what the sidecar adds to every request, against going direct and
against nginx as a plain reverse proxy, all measured in the same run.

    python -m bench.overhead            # about 9 minutes; writes bench/results/overhead.json
    python -m bench.overhead --quick    # fewer, shorter rounds (a smoke run)

Set-up (every part a separate process): the fast fake vLLM (``bench.upstream``) speaking vLLM's
formats; in front of it, the sidecar (``--log-level warning``) counting prompts with the model's
local tokenizer (the realistic set-up: discovered from ``/v1/models`` ``root``), a second sidecar
that counts with the upstream's ``/tokenize`` (no local tokenizer), and Debian's nginx as a plain
reverse proxy (one worker, keep-alive upstream, buffering off), and a plain uvicorn relay
(``bench.proxies``) on three HTTP clients: httpx on its default transport, httpx on the sidecar's
own transport, and aiohttp (the client production-stack's router relays with). Load comes from
``wrk`` (plain JSON requests) and ``bench.sse_client`` (SSE streams), each its own process.

Rounds interleave the paths (the order rotates each round) and the figures are medians over the
rounds, so that the noise of a shared machine hits every path alike; ratios are taken within each
round before the median.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.proxies import BenchProxy
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
from harness.stats import median
from harness.vllm_cpu import ensure_model, free_port
from harness.workload import SidecarProcess, metric_value

#: the reference for what the sidecar's own stack costs: uvicorn + httpx relaying, nothing else
RELAY = "uvicorn+httpx relay"
#: the same relay on the sidecar's transport, and on aiohttp: what the HTTP client alone costs
OWN_RELAY = "uvicorn+httpx relay, sidecar transport"
AIOHTTP_RELAY = "uvicorn+aiohttp relay"
GRANIAN_RELAY = "granian+httpx relay, sidecar transport"
IDS = "sidecar, prompt as token ids"
PROMPT = "Explain in one sentence why a proxy in front of vLLM should count prompt tokens."
SMALL_BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0}

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

WRK_LUA = """\
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{{"requests":%d,"duration_us":%d,"status_errors":%d,"other_errors":%d,'
    .. '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}}\\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max))
end
"""


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a sidecar's relay workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


@dataclass
class Target:
    """One path a request can take to the upstream, and the processes whose cost we measure."""

    name: str
    url: str
    pids: list[int] = field(default_factory=list)
    script: Path | None = None  # another request body than the common one

    def cpu_seconds(self) -> float:
        total = 0.0
        for pid in self.pids:
            with contextlib.suppress(OSError):
                total += ProcStat(pid).cpu_seconds()
        return total


class Upstream:
    def __init__(self, model_root: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.upstream",
                "--port",
                str(self.port),
                "--model-root",
                str(model_root),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError("bench upstream did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Nginx:
    def __init__(self, upstream_port: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = self.dir / "nginx.conf"
        conf.write_text(
            NGINX_CONF.format(
                dir=self.dir,
                port=self.port,
                upstream_port=upstream_port,
                user="user root;\n" if os.geteuid() == 0 else "",
            )
        )
        self.proc = subprocess.Popen(
            ["nginx", "-c", str(conf), "-p", str(self.dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"nginx did not start: {(self.dir / 'error.log').read_text()}")

    def worker_pids(self) -> list[int]:
        return children_pids(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[tuple[Path, str]]:
    """A detached git worktree of ``ref`` in a temporary directory, and the commit it resolved
    to; removed on the way out (``git worktree remove --force``), also when the body fails."""
    rev = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if rev.returncode != 0:
        raise SystemExit(f"--baseline {ref}: not a commit in {ROOT}")
    sha = rev.stdout.strip()
    parent = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    tree = parent / "tree"
    try:
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), sha],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        yield tree, sha
    finally:
        if tree.exists():
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)],
                cwd=ROOT,
                capture_output=True,
            )
        shutil.rmtree(parent, ignore_errors=True)


class BaselineSidecar(SidecarProcess):
    """The sidecar of another revision: the same ``python -m sidecar serve`` command and flags
    as :class:`SidecarProcess`, but run in ``tree`` with ``PYTHONPATH=tree``, so that the
    ``sidecar`` package it imports is the worktree's (``-m`` puts the working directory first on
    ``sys.path``, ahead of the editable install's finder)."""

    def __init__(self, tree: Path, upstream: str, *args: str) -> None:
        super().__init__(upstream, *args, env={"PYTHONPATH": str(tree)}, cwd=tree)
        self.tree = tree

    def verify(self) -> dict[str, Any]:
        """Evidence that the running process is the worktree's code, not this checkout's: its
        cwd and ``PYTHONPATH`` (from /proc), where the same interpreter, cwd and environment
        import ``sidecar.cli`` from, and the source files in the live process's stack
        (``py-spy dump``, where py-spy can attach). Raises when any of them points elsewhere."""
        assert self.proc is not None
        pid = self.proc.pid
        tree = self.tree.resolve()
        cwd = Path(os.readlink(f"/proc/{pid}/cwd")).resolve()
        environ = dict(
            kv.split("=", 1)
            for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
            if "=" in kv
        )
        probe = subprocess.run(
            [sys.executable, "-c", "import sidecar.cli; print(sidecar.cli.__file__)"],
            cwd=self.tree,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        out: dict[str, Any] = {
            "pid": pid,
            "cwd": str(cwd),
            "pythonpath": environ.get("PYTHONPATH"),
            "imports_sidecar_cli_from": probe,
        }
        problems = []
        if cwd != tree:
            problems.append(f"cwd is {cwd}")
        if environ.get("PYTHONPATH") != str(self.tree):
            problems.append(f"PYTHONPATH is {environ.get('PYTHONPATH')!r}")
        if not Path(probe).resolve().is_relative_to(tree):
            problems.append(f"sidecar.cli imports from {probe}")
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            dump = subprocess.run(
                [spy, "dump", "--full-filenames", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if dump.returncode == 0:
                ours = sorted(
                    {
                        line.split("(", 1)[1].split(":", 1)[0]
                        for line in dump.stdout.splitlines()
                        if "/sidecar/" in line and "(" in line
                    }
                )
                out["stack_sidecar_files"] = ours
                if not ours:
                    problems.append("no sidecar frame in py-spy dump")
                elif any(not Path(f).resolve().is_relative_to(tree) for f in ours):
                    problems.append(f"py-spy dump shows sidecar frames outside the tree: {ours}")
        if problems:
            raise RuntimeError(f"baseline sidecar is not the worktree's code: {problems}")
        return out


def wrk(url: str, *, connections: int, seconds: float, script: Path) -> dict[str, Any]:
    """One wrk run (its own process, one thread); the figures its Lua ``done`` prints."""
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{seconds:g}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url + "/v1/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(ln for ln in reversed(out.splitlines()) if ln.startswith("{"))
    data: dict[str, Any] = json.loads(line)
    data["rps"] = data["requests"] / (data["duration_us"] / 1e6)
    return data


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


def rotate(items: list[Target], k: int) -> list[Target]:
    k %= len(items)
    return items[k:] + items[:k]


def warm(target: Target, n: int = 200) -> None:
    with httpx.Client(timeout=60) as client:
        for _ in range(n):
            client.post(target.url + "/v1/completions", json=SMALL_BODY).raise_for_status()
        body = {**SMALL_BODY, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", target.url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            for _ in resp.iter_raw():
                pass


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    info = machine()
    rounds = 2 if args.quick else args.rounds
    seconds = 2.0 if args.quick else args.seconds
    model = ensure_model()
    config_only = Path(tempfile.mkdtemp(prefix="bench-config-only-"))
    shutil.copy(model / "config.json", config_only / "config.json")
    workdir = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    script = workdir / "post.lua"
    script.write_text(WRK_LUA.format(body=json.dumps(json.dumps(SMALL_BODY))))
    # the same request with its prompt as token ids: no tokenizer runs, so the difference to
    # the text prompt is what counting costs inside the sidecar
    ids_script = workdir / "post-ids.lua"
    ids_body = {**SMALL_BODY, "prompt": list(range(1, 21))}
    ids_script.write_text(WRK_LUA.format(body=json.dumps(json.dumps(ids_body))))

    progress("overhead: starting the fast upstream, two sidecars and nginx")
    upstream = Upstream(model)
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
    nginx: Nginx | None = None
    relays: list[BenchProxy] = []
    base: BaselineSidecar | None = None
    trees = contextlib.ExitStack()  # the baseline's worktree: closed after its sidecar stops
    try:
        local.start()
        remote.start()
        if multi is not None:
            multi.start()
        baseline: dict[str, Any] | None = None
        if args.baseline:
            tree, sha = trees.enter_context(worktree(args.baseline))
            progress(f"overhead: baseline sidecar @{args.baseline} ({sha[:12]}) from {tree}")
            base = BaselineSidecar(tree, upstream.url, *local.args).start()
            baseline = {
                "ref": args.baseline,
                "commit": sha,
                "name": f"sidecar @{args.baseline}",
                "ids_name": f"sidecar @{args.baseline}, prompt as token ids",
                "flags": list(local.args),
                "verified": base.verify(),
            }
        nginx = Nginx(upstream.port)
        # no x-bench header: a plain relay
        relay = BenchProxy("shim", upstream.url)
        relays.append(relay)
        own_relay = BenchProxy("shim", upstream.url, "--client", "upstream-transport")
        relays.append(own_relay)
        aiohttp_relay = BenchProxy("shim", upstream.url, "--client", "aiohttp")
        relays.append(aiohttp_relay)
        granian_relay = BenchProxy(
            "shim", upstream.url, "--client", "upstream-transport", "--server", "granian"
        )
        relays.append(granian_relay)
        assert local.proc is not None and remote.proc is not None
        direct = Target("direct", upstream.url, [upstream.proc.pid])
        via_local = Target("sidecar", local.url, [local.proc.pid])
        via_remote = Target("sidecar (/tokenize)", remote.url, [remote.proc.pid])
        via_nginx = Target("nginx", nginx.url, nginx.worker_pids())
        via_relay = Target(RELAY, relay.url, [relay.proc.pid])
        via_own = Target(OWN_RELAY, own_relay.url, [own_relay.proc.pid])
        via_aiohttp = Target(AIOHTTP_RELAY, aiohttp_relay.url, [aiohttp_relay.proc.pid])
        # granian's Rust threads are threads of the one process: its CPU counts them all
        via_granian = Target(GRANIAN_RELAY, granian_relay.url, [granian_relay.proc.pid])
        via_ids = Target(IDS, local.url, [local.proc.pid], script=ids_script)
        via_multi: list[Target] = []
        if multi is not None:
            assert multi.proc is not None
            pids = [multi.proc.pid, *child_pids(multi.proc.pid)]
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
            via_nginx,
            via_relay,
            via_own,
            via_aiohttp,
            via_granian,
        ]
        upstream_stat = ProcStat(upstream.proc.pid)
        for t in targets:
            warm(t)
        time.sleep(3)  # the tokenizer self-check and the first scrapes settle
        for t in targets:
            warm(t, 100)
        counted = {
            "local": metric_value(
                local.metrics(), "kv_sidecar_prompt_counts_total", method="exact_local"
            ),
            "upstream": metric_value(
                remote.metrics(), "kv_sidecar_prompt_counts_total", method="exact_upstream"
            ),
        }
        progress(f"overhead: prompt counts by method after warm-up: {counted}")
        time.sleep(2)
        rss_rest = ProcStat(local.proc.pid).rss_bytes()
        results: dict[str, Any] = {
            "machine": info,
            "counted_by": counted,
            "rounds": rounds,
            "seconds_per_run": seconds,
        }
        if baseline is not None:
            results["baseline"] = baseline

        with RssSampler(local.proc.pid) as rss:
            # 1. latency added to a small non-streamed request: one connection, back to back
            lat: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
            for r in range(rounds):
                for t in rotate(targets, r):
                    progress(f"overhead: latency round {r + 1}/{rounds}: {t.name}")
                    cpu0, up0 = t.cpu_seconds(), upstream_stat.cpu_seconds()
                    res = wrk(t.url, connections=1, seconds=seconds, script=t.script or script)
                    res["cpu_s"] = t.cpu_seconds() - cpu0
                    res["upstream_cpu_s"] = upstream_stat.cpu_seconds() - up0
                    lat[t.name].append(res)
            results["latency"] = lat

            # 2. requests per second at fixed concurrency
            thr: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
            for r in range(rounds):
                for t in rotate(targets, r):
                    progress(
                        f"overhead: throughput round {r + 1}/{rounds} "
                        f"(c={args.concurrency}): {t.name}"
                    )
                    cpu0 = t.cpu_seconds()
                    res = wrk(
                        t.url,
                        connections=args.concurrency,
                        seconds=seconds,
                        script=t.script or script,
                    )
                    res["cpu_s"] = t.cpu_seconds() - cpu0
                    thr[t.name].append(res)
            results["throughput"] = thr

            # 3. SSE events relayed: unpaced (as fast as the upstream writes) and paced
            sse_targets = [
                direct,
                via_local,
                *olds[:1],
                via_nginx,
                via_relay,
                via_own,
                via_aiohttp,
                via_granian,
            ]
            streams: dict[str, dict[str, list[dict[str, Any]]]] = {}
            for mode, interval, conc in (
                ("unpaced", None, args.sse_concurrency),
                ("paced", args.sse_interval_ms, args.sse_paced_concurrency),
            ):
                streams[mode] = {t.name: [] for t in sse_targets}
                for r in range(rounds):
                    for t in rotate(sse_targets, r):
                        progress(
                            f"overhead: SSE {mode} round {r + 1}/{rounds} "
                            f"({conc} streams): {t.name}"
                        )
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
            results["sse"] = streams
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
        sidecar_text = local.metrics()
        results["in_situ"] = in_situ(sidecar_text)

        progress("overhead: component costs (httpx, raw asyncio, tokenizer) in this process")
        results["components"] = components(upstream.url, model)

        # 4. where the sidecar's time goes: a profile under the throughput load (not measured)
        if not args.no_profile:
            progress("overhead: py-spy profile of the sidecar under load")
            raw = workdir / "profile.txt"
            with profile_sidecar(local.proc.pid, raw, seconds=max(seconds, 6)) as prof:
                wrk(local.url, connections=args.concurrency, seconds=max(seconds, 6), script=script)
            if prof.returncode == 0 and raw.exists():
                results["profile"] = summarize_profile(raw)
                name = (
                    "overhead-quick-profile.txt" if args.quick else "overhead-sidecar-profile.txt"
                )
                shutil.copy(raw, RESULTS / name)
            else:
                err = prof.stderr.read().decode() if prof.stderr else ""
                results["profile"] = {"error": err.strip()[-500:]}
        results["load_average_after"] = [round(x, 2) for x in load_average()]
        return results
    finally:
        for sc in (local, remote, base, multi):
            if sc is not None:
                sc.stop()
        trees.close()
        if nginx is not None:
            nginx.stop()
        for proxy in relays:
            proxy.stop()
        upstream.stop()
        shutil.rmtree(config_only, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


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


# --- the report ---------------------------------------------------------------------------------


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds, and ratios taken within each round."""
    lat = results["latency"]
    thr = results["throughput"]
    names = list(lat)
    out: dict[str, Any] = {"latency": {}, "throughput": {}, "sse": {}}
    for name in names:
        runs = lat[name]
        out["latency"][name] = {
            "p50_us": median(r["p50_us"] for r in runs),
            "p99_us": median(r["p99_us"] for r in runs),
            "added_p50_us": None
            if name == "direct"
            else median(
                r["p50_us"] - d["p50_us"] for r, d in zip(runs, lat["direct"], strict=True)
            ),
            "added_p99_us": None
            if name == "direct"
            else median(
                r["p99_us"] - d["p99_us"] for r, d in zip(runs, lat["direct"], strict=True)
            ),
            "p50_ratio_to_direct": median(
                r["p50_us"] / d["p50_us"] for r, d in zip(runs, lat["direct"], strict=True)
            ),
            "cpu_s_per_1000": None
            if name == "direct"
            else median(r["cpu_s"] / r["requests"] * 1000 for r in runs),
        }
        truns = thr[name]
        out["throughput"][name] = {
            "rps": median(r["rps"] for r in truns),
            "p50_us": median(r["p50_us"] for r in truns),
            "p99_us": median(r["p99_us"] for r in truns),
            "ratio_to_nginx": median(
                r["rps"] / n["rps"] for r, n in zip(truns, thr["nginx"], strict=True)
            ),
            "ratio_to_direct": median(
                r["rps"] / n["rps"] for r, n in zip(truns, thr["direct"], strict=True)
            ),
            "cpu_s_per_1000": None
            if name == "direct"
            else median(r["cpu_s"] / r["requests"] * 1000 for r in truns),
            "errors": sum(r["status_errors"] + r["other_errors"] for r in truns),
        }
    for mode, per in results["sse"].items():
        out["sse"][mode] = {}
        for name, runs in per.items():
            out["sse"][mode][name] = {
                "events_per_s": median(r["events_per_second"] for r in runs),
                "events_per_chunk": median(r["events"] / r["chunks"] for r in runs if r["chunks"]),
                "cpu_s_per_1000_events": None
                if name == "direct"
                else median(r["cpu_s"] / r["events"] * 1000 for r in runs if r["events"]),
                "events_per_cpu_s": None
                if name == "direct"
                else median(r["events"] / r["cpu_s"] for r in runs if r["cpu_s"]),
                "ratio_to_nginx": median(
                    r["events_per_second"] / n["events_per_second"]
                    for r, n in zip(runs, per["nginx"], strict=True)
                ),
                "errors": sum(r["errors"] for r in runs),
            }
    if results.get("baseline"):
        out["vs_baseline"] = vs_baseline(results)
    return out


def vs_baseline(results: dict[str, Any]) -> dict[str, Any]:
    """The sidecar's CPU per request (per 1,000 SSE events) against the baseline revision's, test
    by test: both medians over rounds, ``ratio`` the median of the ratios taken within each round
    (the two ran back to back in it), and ``ratio_of_medians`` for reference."""
    base = results["baseline"]
    c = results.get("concurrency", "")
    # (label, runs now, runs at the baseline, what one unit of work is, per how many of them)
    tests: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]], str, float]] = []
    for test, label in (("latency", "latency, c=1"), ("throughput", f"requests/s, c={c}")):
        runs = results[test]
        tests.append((label, runs["sidecar"], runs[base["name"]], "requests", 1.0))
        if base["ids_name"] in runs:
            tests.append(
                (
                    f"{label}, prompt as token ids",
                    runs[IDS],
                    runs[base["ids_name"]],
                    "requests",
                    1.0,
                )
            )
    for mode, per in results["sse"].items():
        if base["name"] in per:
            tests.append((f"SSE {mode}", per["sidecar"], per[base["name"]], "events", 1000.0))
    out: dict[str, Any] = {}
    for label, new, old, count, per_n in tests:
        pairs = [(n, o) for n, o in zip(new, old, strict=True) if n[count] and o[count]]
        if not pairs:
            continue
        # CPU µs per request, or CPU s per 1,000 events
        scale = 1e6 if count == "requests" else per_n
        now = [n["cpu_s"] / n[count] * scale for n, _ in pairs]
        then = [o["cpu_s"] / o[count] * scale for _, o in pairs]
        out[label] = {
            "unit": "CPU µs per request" if count == "requests" else "CPU s per 1,000 events",
            "sidecar": median(now),
            "baseline": median(then),
            "ratio": median(a / b for a, b in zip(now, then, strict=True) if b),
            "ratio_of_medians": median(now) / median(then) if median(then) else None,
            "rounds": len(pairs),
        }
    return out


def report(results: dict[str, Any], fig: dict[str, Any], command: str) -> str:
    lat, thr, sse_f = fig["latency"], fig["throughput"], fig["sse"]
    settings = results["sse_settings"]
    side = "sidecar"
    mib = 2**20
    rss = results["rss"]
    added = lat[side]["added_p50_us"]
    rps_ratio = thr[side]["ratio_to_nginx"]
    best_sse = max(sse_f["unpaced"][side]["events_per_s"], sse_f["paced"][side]["events_per_s"])
    peak_rss = max(rss["under_load_peak_sampled_bytes"], rss["high_water_mark_bytes"])

    def ok(cond: bool) -> str:
        return "met" if cond else "**missed**"

    lines = [
        f"Run: {machine_line(results['machine'], results.get('load_average_after'))}.",
        "",
        f"Command: `{command}` ({results['rounds']} interleaved rounds of "
        f"{results['seconds_per_run']:g} s per path and test; medians over rounds, ratios "
        "taken within each round).",
        "",
        "Prompt counting during the run (requests by method, after warm-up): local tokenizer "
        f"sidecar {fmt(results['counted_by']['local'], 0)} `exact_local`, /tokenize sidecar "
        f"{fmt(results['counted_by']['upstream'], 0)} `exact_upstream`.",
        "",
        "**Targets**",
        "",
        table(
            ["target", "measured", "verdict"],
            [
                [
                    "median latency added to a small non-streamed request < 1 ms",
                    f"{fmt(added / 1000, 3)} ms (p50 {fmt(lat[side]['p50_us'] / 1000, 3)} ms vs "
                    f"direct {fmt(lat['direct']['p50_us'] / 1000, 3)} ms, ratio "
                    f"{fmt(lat[side]['p50_ratio_to_direct'])}x)",
                    ok(added < 1000),
                ],
                [
                    f"requests/s at c={results.get('concurrency', '')} >= 0.5 x nginx",
                    f"{fmt(rps_ratio)} x nginx ({fmt(thr[side]['rps'], 0)} vs "
                    f"{fmt(thr['nginx']['rps'], 0)} req/s)",
                    ok(rps_ratio >= 0.5),
                ],
                [
                    ">= 20,000 SSE events/s relayed by one sidecar process",
                    f"{fmt(best_sse, 0)} events/s",
                    ok(best_sse >= 20000),
                ],
                [
                    "sidecar RSS < 200 MB",
                    f"{fmt(rss['rest_bytes'] / mib, 1)} MiB at rest, "
                    f"{fmt(peak_rss / mib, 1)} MiB peak under load",
                    ok(peak_rss < 200e6),
                ],
            ],
        ),
        "",
        "**Added latency, one connection, small non-streamed completion** (`wrk -t1 -c1`; "
        "prompt of ~20 tokens, `max_tokens` 16)",
        "",
        table(
            [
                "path",
                "p50",
                "p99",
                "added p50",
                "added p99",
                "p50 / direct",
                "proxy CPU s per 1,000 req",
            ],
            [
                [
                    name,
                    fmt(v["p50_us"] / 1000, 3) + " ms",
                    fmt(v["p99_us"] / 1000, 3) + " ms",
                    fmt(None if v["added_p50_us"] is None else v["added_p50_us"] / 1000, 3, " ms"),
                    fmt(None if v["added_p99_us"] is None else v["added_p99_us"] / 1000, 3, " ms"),
                    fmt(v["p50_ratio_to_direct"]) + "x",
                    fmt(v["cpu_s_per_1000"], 3),
                ]
                for name, v in lat.items()
            ],
        ),
        "",
        f"**Requests per second at fixed concurrency** (`wrk -t1 -c{results.get('concurrency')}`)",
        "",
        table(
            [
                "path",
                "req/s",
                "/ nginx",
                "/ direct",
                "p50",
                "p99",
                "proxy CPU s per 1,000 req",
                "errors",
            ],
            [
                [
                    name,
                    fmt(v["rps"], 0),
                    fmt(v["ratio_to_nginx"]),
                    fmt(v["ratio_to_direct"]),
                    fmt(v["p50_us"] / 1000, 2) + " ms",
                    fmt(v["p99_us"] / 1000, 2) + " ms",
                    fmt(v["cpu_s_per_1000"], 3),
                    v["errors"],
                ]
                for name, v in thr.items()
            ],
        ),
        "",
        f"**SSE relay** (`bench.sse_client`, {settings['events_per_stream']} events per stream; "
        f"unpaced: {settings['unpaced_streams']} streams, the upstream writes each event as soon "
        f"as it can; paced: {settings['paced_streams']} streams, one event per stream every "
        f"{settings['paced_interval_ms']:g} ms, like a decoder)",
        "",
        table(
            [
                "mode",
                "path",
                "events/s",
                "/ nginx",
                "events per relayed chunk",
                "proxy CPU s per 1,000 events",
                "events per proxy CPU-second",
                "errors",
            ],
            [
                [
                    mode,
                    name,
                    fmt(v["events_per_s"], 0),
                    fmt(v["ratio_to_nginx"]),
                    fmt(v["events_per_chunk"]),
                    fmt(v["cpu_s_per_1000_events"], 3),
                    fmt(v["events_per_cpu_s"], 0),
                    v["errors"],
                ]
                for mode, per in sse_f.items()
                for name, v in per.items()
            ],
        ),
        "",
        "**Sidecar memory and in-situ timings**",
        "",
        table(
            ["figure", "value"],
            [
                [
                    "RSS at rest (after start-up, tokenizer loaded, warm)",
                    f"{fmt(rss['rest_bytes'] / mib, 1)} MiB",
                ],
                [
                    "RSS peak under load (sampled every 0.2 s)",
                    f"{fmt(rss['under_load_peak_sampled_bytes'] / mib, 1)} MiB",
                ],
                [
                    "RSS high-water mark (VmHWM)",
                    f"{fmt(rss['high_water_mark_bytes'] / mib, 1)} MiB",
                ],
                ["RSS after the load", f"{fmt(rss['after_load_bytes'] / mib, 1)} MiB"],
                [
                    "mean local prompt count (`kv_sidecar_tokenize_seconds`)",
                    fmt(results["in_situ"]["tokenize_local_mean_us"], 1, " µs"),
                ],
                [
                    "mean projection + decision (`kv_sidecar_decision_seconds`)",
                    fmt(results["in_situ"]["decision_mean_us"], 1, " µs"),
                ],
            ],
        ),
    ]
    vs = fig.get("vs_baseline")
    if vs:
        base = results["baseline"]
        lines += [
            "",
            f"**CPU per request against `{base['ref']}`** (commit {base['commit'][:12]}, its "
            "sidecar run from a git worktree with the same flags, in the same interleaved rounds; "
            "ratio: the median of the within-round ratios, below 1 is cheaper now)",
            "",
            table(
                ["test", "unit", "sidecar", base["name"], "sidecar / baseline"],
                [
                    [
                        label,
                        v["unit"],
                        fmt(v["sidecar"], 1 if v["unit"].endswith("request") else 3),
                        fmt(v["baseline"], 1 if v["unit"].endswith("request") else 3),
                        fmt(v["ratio"], 3),
                    ]
                    for label, v in vs.items()
                ],
            ),
        ]
    comp = results.get("components")
    if comp:
        lines += [
            "",
            "**What the pieces cost** (CPU per call, measured one at a time in the bench process "
            "against the same upstream; the sidecar pays the first and third on every request):",
            "",
            table(
                ["piece", "CPU per call"],
                [
                    [
                        "httpx `send(stream=True)` + `aiter_raw` + `aclose`, keep-alive",
                        fmt(comp["httpx_streamed_request_us"], 0, " µs"),
                    ],
                    [
                        "the same exchange on a raw asyncio stream (the HTTP work itself)",
                        fmt(comp["raw_asyncio_request_us"], 0, " µs"),
                    ],
                    [
                        "local prompt count of the ~20-token prompt (`ModelTokenizer.count_text`)",
                        fmt(comp["local_prompt_count_us"], 0, " µs"),
                    ],
                    ["`json.loads` of the request body", fmt(comp["json_parse_body_us"], 1, " µs")],
                ],
            ),
        ]
    prof = results.get("profile")
    if prof and prof.get("samples"):
        lines += [
            "",
            f"**Where the sidecar's CPU goes** under the c={results.get('concurrency')} load "
            f"(py-spy record, {prof['samples']} samples at 200 Hz; raw collapsed stacks in "
            "[bench/results/overhead-sidecar-profile.txt]"
            "(bench/results/overhead-sidecar-profile.txt))",
            "",
            table(
                ["self time by package", "share", "the sidecar's functions (inclusive)", "share"],
                [
                    [
                        a[0] if a else "",
                        f"{a[1]:.0%}" if a else "",
                        b[0] if b else "",
                        f"{b[1]:.0%}" if b else "",
                    ]
                    for a, b in itertools.zip_longest(
                        prof["self_by_package"], prof["sidecar_inclusive"]
                    )
                ],
            ),
            "",
            "Hottest lines (self): "
            + "; ".join(f"`{k}` {v:.0%}" for k, v in prof["hottest_lines"][:6])
            + ".",
        ]
    elif prof:
        lines += ["", f"py-spy failed: `{prof.get('error')}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 s (smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0, help="per path, test and round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sse-events", type=int, default=200)
    parser.add_argument("--sse-concurrency", type=int, default=32)
    parser.add_argument("--sse-paced-concurrency", type=int, default=256)
    parser.add_argument("--sse-interval-ms", type=float, default=10.0)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="also measure a sidecar with this many relay worker processes (--workers N), its "
        "CPU summed over the main process and the workers",
    )
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also measure the sidecar of git revision REF (a worktree of it, removed at the end) "
        "in the same rounds: rows 'sidecar @REF' and its token-ids row, and the CPU-per-request "
        "ratio of the sidecar to it",
    )
    args = parser.parse_args(argv)
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is missing: run scripts/system-deps.sh --bench")
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = run(args)
    results["concurrency"] = args.concurrency
    fig = figures(results)
    results["figures"] = fig
    write_json("overhead-quick" if args.quick else "overhead", results)
    command = "python -m bench.overhead" + (" --quick" if args.quick else "")
    if args.baseline:
        command += f" --baseline {args.baseline}"
    text = report(results, fig, command)
    print(text)
    if not args.no_report and not args.quick:
        update_section(ROOT / "BENCHMARKS.md", "overhead", text)
    progress("overhead: done")
    return results


if __name__ == "__main__":
    main()
