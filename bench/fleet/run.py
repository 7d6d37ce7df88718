"""The fleet benchmark's run: two vLLM servers, a sidecar in front of each (or none), one nginx
over them, and a burst of streamed completions from a client that retries as openai's does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import (
    Nginx,
    nginx_user,
    queue_flags,
    read_vllm,
    reset_prefix_cache,
    retry_delay,
    wait_idle,
    wait_tokenizer,
)
from bench.fleet.haproxy import HAProxy, configured_weights
from harness.bench_util import progress
from harness.exposition import cache_config_labels, metric_value
from harness.local import free_port
from harness.sim_server import SimServer, model_config
from harness.sim_vllm import model_dir
from harness.vllm_cpu import VllmServer, ensure_model
from harness.workload import SidecarProcess, make_prompts, vllm_preemptions

NUM_GPU_BLOCKS = 32
BLOCK_SIZE = 128  # the CPU backend's (checked against vllm:cache_config_info at start)
MAX_MODEL_LEN = 1024
CAPACITY_BLOCKS = NUM_GPU_BLOCKS - 1  # vLLM keeps one null block
WEIGHTS = {"A": 3, "B": 1}  # nginx upstream weights: arrivals 3:1
NGINX_TRIES = 2
MAX_ATTEMPTS = 30  # the client's attempts per request (a 429 or 503 after the last: it gives up)
REQUEST_DEADLINE_S = 900.0
#: ``sidecar-spill-S``: ``--policy spill --spill-wait S`` (S seconds)
SPILL_WAITS = ("2", "5", "15")
CONFIGS = [
    "direct",
    "sidecar-queue",
    "sidecar-reject",
    *(f"sidecar-spill-{s}" for s in SPILL_WAITS),
    "sidecar-queue-haproxy",
    "sidecar-spill-2-haproxy",
]
#: configurations whose gateway is HAProxy on deploy/gateway/haproxy.cfg (bench.fleet.haproxy),
#: their sidecars with the agent on; the others are behind nginx
HAPROXY_CONFIGS = ("sidecar-queue-haproxy", "sidecar-spill-2-haproxy")
#: the state fields the sampler keeps of each sidecar's /state
STATE_FIELDS = (
    "queue_depth",
    "in_flight",
    "reserved_blocks",
    "budget_blocks",
    "committed_blocks",
    "peak_blocks_queued",
)
FULL_SIZE = (24, 271, 700)  # requests, prompt tokens, max_tokens (ignore_eos)
QUICK_SIZE = (10, 271, 400)


class Replica(Protocol):
    """A running vLLM (the CPU build's or the simulated GPU's) as the fleet uses it."""

    @property
    def url(self) -> str: ...

    @property
    def port(self) -> int: ...

    def start(self) -> Any: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class FleetEngine:
    """What each replica runs on: the CPU build (both replicas share this machine's cores, so
    work one replica sheds is work the other's threads take from it), or a simulated GPU
    (``harness.sim_vllm``: vLLM's own scheduler on the simulated clock of a GPU of its own, so
    a replica with room runs what the other sheds at no cost to it). ``time_scale``: wall
    seconds a simulated second lasts (the sidecars' time-valued flags and ``--spill-wait``
    stretched by it, so that they mean as many simulated seconds as they name)."""

    name: str
    block_size: int
    num_gpu_blocks: int
    max_model_len: int
    full_size: tuple[int, int, int]  # requests, prompt tokens, max_tokens (ignore_eos)
    quick_size: tuple[int, int, int]
    time_scale: float = 1.0
    model: str = ""  # the simulated engine's model (harness/models/NAME.json)

    @property
    def simulated(self) -> bool:
        return bool(self.model)

    def server(self) -> Replica:
        if not self.simulated:
            return VllmServer(num_gpu_blocks=self.num_gpu_blocks, max_model_len=self.max_model_len)
        # as bench.simgpu's engines run: its flags, its served name (what the client names)
        return SimServer(
            model=self.model,
            max_model_len=self.max_model_len,
            extra_args=[
                "--max-num-seqs",
                "256",
                "--gpu-memory-utilization",
                "0.9",
                "--served-model-name",
                "tiny",
                "--sim-time-scale",
                f"{self.time_scale:g}",
                "--num-gpu-blocks-override",
                str(self.num_gpu_blocks),
            ],
        )

    def prompts(self, count: int, tokens: int, seed: int) -> list[str]:
        """``count`` distinct prompts of exactly ``tokens`` tokens, by the tokenizer the
        replicas serve with (the CPU build's generated model, or the simulated engine's)."""
        if not self.simulated:
            return make_prompts(ensure_model(), count, tokens, seed=seed)
        return make_prompts(model_dir(model_config(self.model)), count, tokens, seed=seed)


#: the simulated 8B's fleet: 48 requests of 2,000 prompt tokens and 600 output tokens, 163 blocks
#: of 16 each at their end, on pools of 3,000 blocks (18 at their peak): replica A's 36 (3:1)
#: overfill it by half, B's 12 take two thirds of it
SIM_POOL_BLOCKS = 3000 + 1
ENGINES: dict[str, FleetEngine] = {
    "cpu": FleetEngine("cpu", BLOCK_SIZE, NUM_GPU_BLOCKS, MAX_MODEL_LEN, FULL_SIZE, QUICK_SIZE),
    "sim-8b": FleetEngine(
        "sim-8b",
        16,
        SIM_POOL_BLOCKS,
        4096,
        (48, 2000, 600),
        (16, 2000, 300),
        time_scale=4.0,
        model="llama-3.1-8b-instruct",
    ),
}

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
        "@USER@": nginx_user(),
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


def start_nginx(port_a: int, port_b: int) -> Nginx:
    """nginx over replica A's port and B's, with the fleet's configuration."""
    return Nginx(
        lambda d, port: nginx_conf(d, port, port_a, port_b), ready_path="/v1/models"
    ).start()


# --- the client ---------------------------------------------------------------------------------


async def one(
    client: httpx.AsyncClient,
    url: str,
    index: int,
    prompt: str,
    max_tokens: int,
    t0: float,
    rng: random.Random,
    arrival: float = 0.0,
) -> dict[str, Any]:
    """One streamed completion through nginx, retried after 429/503 as the openai client does
    (its ``retry-after-ms`` / ``Retry-After``), at most ``MAX_ATTEMPTS`` attempts; sent
    ``arrival`` seconds after ``t0``, and timed from then."""
    if arrival > 0:
        await asyncio.sleep(max(0.0, t0 + arrival - time.monotonic()))
        t0 += arrival
    out: dict[str, Any] = {
        "id": index,
        "arrival": round(arrival, 3),
        "status": 0,
        "ttft": None,
        "e2e": None,
        "completion_tokens": 0,
        "attempts": 0,
        "client_429": 0,
        "client_503": 0,
        "retry_sleep": 0.0,
        "retry_after": [],  # the delay the client slept after each refusal
        # each 429/503 as it came: monotonic time, status, the raw Retry-After headers
        "refusals": [],
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
                    out["refusals"].append(
                        {
                            "m": time.monotonic(),
                            "status": resp.status_code,
                            "retry_after": resp.headers.get("retry-after"),
                            "retry_after_ms": resp.headers.get("retry-after-ms"),
                        }
                    )
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


def arrivals(count: int, rate: float | None) -> list[float]:
    """Each request's send time in seconds from the start: all at once (``rate`` None, the
    burst), or a Poisson process of ``rate`` requests a second (seeded: the same times in every
    run)."""
    if rate is None:
        return [0.0] * count
    rng = random.Random(11)
    times, t = [], 0.0
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def burst(
    url: str, prompts: list[str], max_tokens: int, rate: float | None = None
) -> tuple[list[dict[str, Any]], float]:
    """Every prompt sent through ``url`` at once or as a Poisson stream of ``rate`` a second;
    the outcomes and the seconds from the first send to the last answer."""
    rng = random.Random(5)
    sends = arrivals(len(prompts), rate)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(REQUEST_DEADLINE_S, connect=10), limits=limits, trust_env=False
    ) as client:
        t0 = time.monotonic()
        outcomes = await asyncio.gather(
            *(one(client, url, i, p, max_tokens, t0, rng, sends[i]) for i, p in enumerate(prompts))
        )
        return list(outcomes), time.monotonic() - t0


# --- sampling and counters ----------------------------------------------------------------------


def sampler(
    replicas: dict[str, str],
    sidecars: dict[str, SidecarProcess],
    samples: list[dict[str, Any]],
    stop: threading.Event,
    haproxy: HAProxy | None = None,
) -> None:
    """Every 0.5 s: each vLLM's KV use, running, waiting, preemptions; each sidecar's queue and
    KV figures (``STATE_FIELDS``); HAProxy's servers' weights (its ``show stat``). ``m``: the
    monotonic clock, to match the client's refusals with the nearest sample."""
    t0 = time.monotonic()
    with httpx.Client(timeout=5, trust_env=False) as client:
        while not stop.is_set():
            now = time.monotonic()
            row: dict[str, Any] = {"t": round(now - t0, 2), "m": round(now, 3)}
            for name, url in replicas.items():
                with contextlib.suppress(httpx.HTTPError):
                    row[name] = read_vllm(client.get(url + "/metrics").text)
                sc = sidecars.get(name)
                if sc is not None and name in row:
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        state = client.get(sc.metrics_url + "/state").json()
                        row[name]["sidecar"] = {k: state.get(k) for k in STATE_FIELDS}
            if haproxy is not None:
                with contextlib.suppress(OSError, KeyError, ValueError):
                    row["haproxy"] = haproxy.sample()
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


# --- one run ------------------------------------------------------------------------------------


#: the sidecar's time-valued defaults that a simulated engine's time scale stretches
SCALED_DEFAULTS = {"--scrape-interval": 0.5, "--metrics-stale-after": 5.0}


def sidecar_flags(config: str, time_scale: float = 1.0) -> list[str]:
    """The flags of a ``sidecar-*`` configuration's sidecars (``sidecar-spill-S``: ``--policy
    spill --spill-wait S``; behind HAProxy, which retries a 503 but not a 429, ``--spill-status
    503`` too); on a simulated engine run ``time_scale`` times slower than its GPU, the scrape,
    the staleness and the spill wait stretched as much (S simulated seconds)."""
    policy = config.removeprefix("sidecar-").removesuffix("-haproxy")
    scaled = (
        []
        if time_scale == 1
        else [x for f, v in SCALED_DEFAULTS.items() for x in (f, f"{v * time_scale:g}")]
    )
    if policy.startswith("spill-"):
        wait = float(policy.removeprefix("spill-")) * time_scale
        flags = [*queue_flags("spill"), *scaled, "--spill-wait", f"{wait:g}"]
        return flags + (["--spill-status", "503"] if config in HAPROXY_CONFIGS else [])
    return [*queue_flags(policy), *scaled]


def run_config(
    config: str,
    vllms: dict[str, Replica],
    prompts: list[str],
    max_tokens: int,
    rate: float | None = None,
    engine: FleetEngine = ENGINES["cpu"],
    haproxy_layout: str = "entries",
) -> dict[str, Any]:
    urls = {name: v.url for name, v in vllms.items()}
    wait_idle(*urls.values(), timeout=180.0)
    for url in urls.values():
        reset_prefix_cache(url)
    preempt_before = {n: vllm_preemptions(u) for n, u in urls.items()}
    before = {n: vllm_counters(u) for n, u in urls.items()}
    clocks_before = {n: sim_clock(v) for n, v in vllms.items()}
    sidecars: dict[str, SidecarProcess] = {}
    agent_ports: dict[str, int] = {}
    nginx: Nginx | None = None
    haproxy: HAProxy | None = None
    gateway_conf = ""
    log: list[dict[str, str]] = []
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    thread: threading.Thread | None = None
    try:
        if config.startswith("sidecar-"):
            for name, url in urls.items():
                flags = sidecar_flags(config, engine.time_scale)
                if config in HAPROXY_CONFIGS:
                    agent_ports[name] = free_port()
                    flags += ["--agent-port", str(agent_ports[name])]
                sidecars[name] = SidecarProcess(url, *flags).start()
            for sc in sidecars.values():
                wait_tokenizer(sc)
            backends = {n: sc.port for n, sc in sidecars.items()}
        else:
            backends = {n: v.port for n, v in vllms.items()}
        if config in HAPROXY_CONFIGS:
            haproxy = HAProxy(
                {n: (sc.port, sc.metrics_port, agent_ports[n]) for n, sc in sidecars.items()},
                WEIGHTS,
                haproxy_layout,
            ).start()
            gateway_url = haproxy.url
            port_to_replica = dict(haproxy.servers)
        else:
            nginx = start_nginx(backends["A"], backends["B"])
            gateway_url = nginx.url
            port_to_replica = {f"127.0.0.1:{p}": n for n, p in backends.items()}
        thread = threading.Thread(
            target=sampler, args=(urls, sidecars, samples, stop, haproxy), daemon=True
        )
        thread.start()
        outcomes, seconds = asyncio.run(burst(gateway_url, prompts, max_tokens, rate))
        stop.set()
        thread.join()
        time.sleep(0.5)  # nginx and HAProxy write a log line when the answer ends
        sidecar_figs = {n: sidecar_counters(sc) for n, sc in sidecars.items()}
        if haproxy is not None:
            log = haproxy.access_log()
            gateway_conf = haproxy.conf.read_text()
        elif nginx is not None:
            log = nginx.access_log()
            gateway_conf = nginx.conf.read_text()
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        if nginx is not None:
            nginx.stop()
        if haproxy is not None:
            haproxy.stop()
        for sc in sidecars.values():
            sc.stop()
    preempt_after = {n: vllm_preemptions(u) for n, u in urls.items()}
    after = {n: vllm_counters(u) for n, u in urls.items()}
    clocks_after = {n: sim_clock(v) for n, v in vllms.items()}
    return {
        "config": config,
        "seconds": seconds,
        "poisson_rate": rate,
        "outcomes": outcomes,
        "gateway": "haproxy" if haproxy is not None else "nginx",
        # the gateway's log, one dict per request (HAProxy's parsed into nginx's fields, and its
        # line as logged), and its configuration file
        f"{'haproxy' if haproxy is not None else 'nginx'}_log": log,
        f"{'haproxy' if haproxy is not None else 'nginx'}_conf": gateway_conf,
        "port_to_replica": port_to_replica,
        # HAProxy's servers: their layout (bench.fleet.haproxy.LAYOUTS) and each replica's
        # configured weight, summed over its servers (what its agent's 100% gives it)
        **(
            {
                "haproxy_layout": haproxy_layout,
                "haproxy_configured_weights": configured_weights(WEIGHTS, haproxy_layout),
            }
            if haproxy is not None
            else {}
        ),
        "samples": samples,
        "preemptions": {n: preempt_after[n] - preempt_before[n] for n in urls},
        "vllm_counters": {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in urls},
        "sidecars": sidecar_figs,
        # a simulated replica's clock over the run (steps, simulated seconds, and the seconds
        # its steps ran late on this machine's CPU: the run is valid only where that is small)
        "sim_clock": {
            n: {k: clocks_after[n][k] - clocks_before[n][k] for k in clocks_after[n]}
            for n in urls
            if clocks_before[n] is not None and clocks_after[n] is not None
        },
    }


#: the simulated engine's clock figures a run keeps (``SimServer.state``)
SIM_CLOCK = ("steps", "simulated_seconds", "cpu_lag_seconds", "recomputed_tokens")


def sim_clock(replica: Replica) -> dict[str, float] | None:
    """A simulated replica's clock figures now; None for the CPU build."""
    if not isinstance(replica, SimServer):
        return None
    state = replica.state()
    return {k: float(state[k]) for k in SIM_CLOCK}


def start_vllms(engine: FleetEngine = ENGINES["cpu"]) -> dict[str, Replica]:
    """Both servers, started one after the other (two at once on two cores is slower to fail)."""
    vllms: dict[str, Replica] = {}
    try:
        for name in WEIGHTS:
            progress(f"fleet: starting vLLM replica {name} on {engine.name} (a minute or two)")
            server = engine.server()
            vllms[name] = server
            server.start()
    except BaseException:
        for v in vllms.values():
            v.stop()
        raise
    return vllms


def block_size(url: str) -> int | None:
    """The block size a running vLLM reports (``vllm:cache_config_info``), None if it does not."""
    labels = cache_config_labels(httpx.get(url + "/metrics", timeout=10).text)
    return int(labels["block_size"]) if "block_size" in labels else None
