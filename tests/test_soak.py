"""A bounded soak against the real vLLM: mixed traffic with random disconnects and timeouts.

Six clients loop for ``KV_SIDECAR_SOAK_SECONDS`` (default 120) through one ``kv-sidecar serve``
process, each drawing from a seeded mix: streamed and non-streamed answers read to the end,
streams dropped after a few events, non-streamed requests abandoned or timed out mid-generation,
bodies that are not JSON, and pass-through reads. The KV budget is a quarter of the pool
(``--headroom 0.75``) so that some requests wait in the sidecar's queue, and some of those are
abandoned there too.

Afterwards: the ledger holds exactly zero, vLLM runs nothing, and the sidecar's file descriptors,
threads, asyncio tasks (``event_loop_tasks`` in ``/state``) and resident memory are back where
they were after a warm-up of the same traffic (RSS growth under 10%).

File descriptors are compared at rest, not in one sample each: an idle sidecar's count moves by
one or two on its own (18:50 UTC here, sampled every 0.25 s: its connections to vLLM went 2, 1,
2, 1 and a socket came and went, its periodic scrapes and health checks opening connections that
an idle pool closes up to twice its 2 s keep-alive later), so the baseline is the fewest open
over :data:`REST_SAMPLE_SECONDS` after the warm-up, and after the soak the count must come back
to it, exactly. A leak stays; a connection closing late does not. (One sample 3 s after the
traffic, within 8 of the baseline, was the check before: fresh-clone CI runs saw 4 and 5 more.)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from harness.workload import SidecarProcess, make_prompts, metric_value
from tests.conftest import VllmInfo
from tests.support.faultkit import ProcStats, proc_stats

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SOAK_SECONDS = float(os.environ.get("KV_SIDECAR_SOAK_SECONDS", "120"))
WARMUP_SECONDS = 20.0
#: the baseline's file descriptors: the fewest open over this many seconds at rest
REST_SAMPLE_SECONDS = 6.0
#: after the soak, the sidecar's file descriptors come back to the baseline within this (a
#: deadline for a loaded machine; idle connections close within 4 s)
FDS_BACK_WITHIN = 30.0
CLIENTS = 6
ACTIONS = {
    "stream": 30,
    "plain": 22,
    "stream_drop": 15,
    "plain_abandon": 10,
    "plain_timeout": 8,
    "bad_json": 5,
    "passthrough": 10,
}


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)


async def abandoning(url: str, body: dict[str, Any], after: float) -> httpx.Response | None:
    """A non-streamed request whose client gives up after ``after`` s (None then), on a client
    of its own: httpcore 1.0.9 can hold a pool slot for good when a request is cancelled while
    its connection is being made (encode/httpcore#1093). A CI run's soak on one shared client
    had all six workers fail with PoolTimeout, a 120 s wait for one of 12 slots where at most
    six requests were live at once."""
    async with httpx.AsyncClient(timeout=120, trust_env=False) as own:
        try:
            return await asyncio.wait_for(own.post(url + "/v1/completions", json=body), after)
        except TimeoutError:
            return None


async def one_action(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    rng: random.Random,
    prompts: list[str],
    tally: Tally,
) -> None:
    action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
    max_tokens = rng.choice([8, 16, 32, 64, 128])
    body: dict[str, Any] = {
        "model": model,
        "prompt": rng.choice(prompts),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    tally.outcomes[action] += 1
    try:
        if action in ("stream", "stream_drop"):
            stop_after = rng.randint(1, 20) if action == "stream_drop" else None
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                tally.statuses[resp.status_code] += 1
                if resp.status_code != 200:
                    await resp.aread()
                    return
                events = 0
                async for line in resp.aiter_lines():
                    events += line.startswith("data: {")
                    if stop_after is not None and events >= stop_after:
                        return  # drop the stream: the block closes the connection
            return
        if action in ("plain", "plain_abandon"):
            if action == "plain":
                resp = await client.post(url + "/v1/completions", json=body)
            else:
                answer = await abandoning(url, body, rng.uniform(0.05, 1.5))
                if answer is None:
                    return
                resp = answer
            tally.statuses[resp.status_code] += 1
            if resp.status_code == 200:
                usage = resp.json()["usage"]["completion_tokens"]
                if usage != max_tokens:
                    tally.unexpected.append(f"{usage} of {max_tokens} tokens")
            return
        if action == "plain_timeout":
            timeout = httpx.Timeout(60, read=rng.uniform(0.1, 1.0))
            try:
                resp = await client.post(url + "/v1/completions", json=body, timeout=timeout)
                tally.statuses[resp.status_code] += 1
            except httpx.ReadTimeout:
                tally.outcomes["read_timeouts"] += 1
            return
        if action == "bad_json":
            resp = await client.post(url + "/v1/completions", content=b'{"prompt": [1, 2')
            tally.statuses[resp.status_code] += 1
            if resp.status_code != 400:
                tally.unexpected.append(f"bad json got {resp.status_code}")
            return
        resp = await client.get(url + rng.choice(["/v1/models", "/metrics", "/health"]))
        tally.statuses[resp.status_code] += 1
    except httpx.HTTPError as exc:
        tally.unexpected.append(f"{action}: {type(exc).__name__}: {exc}")


async def traffic(url: str, model: str, prompts: list[str], seconds: float, seed: int) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=CLIENTS * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 100 + i)
            while time.monotonic() < deadline:
                await one_action(client, url, model, rng, prompts, tally)

        await asyncio.gather(*(worker(i) for i in range(CLIENTS)))
    return tally


#: Clients that timed out or left may have left vLLM finishing their answers: up to 128 tokens.
SETTLE_WITHIN = 120.0


async def settle(sc: SidecarProcess, vllm: VllmInfo) -> dict[str, Any]:
    """Wait until nothing is in flight anywhere; the sidecar's /state then."""
    deadline = time.monotonic() + SETTLE_WITHIN
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        while True:
            state = (await client.get(sc.metrics_url + "/state")).json()
            text = (await client.get(vllm.url + "/metrics")).text
            busy = (metric_value(text, "vllm:num_requests_running") or 0) + (
                metric_value(text, "vllm:num_requests_waiting") or 0
            )
            if not busy and not state["in_flight"] and not state["queue_depth"]:
                break
            assert time.monotonic() < deadline, (
                f"not idle {SETTLE_WITHIN:.0f} s after the traffic stopped: vLLM running + "
                f"waiting {busy}, sidecar /state {state}"
            )
            await asyncio.sleep(0.5)
    await asyncio.sleep(3)  # pooled upstream connections expire (2 s keep-alive)
    return dict(state)


def fd_targets(pid: int) -> list[str]:
    """What each of the process's file descriptors is (sockets and pipes by kind, files by path)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed while listed
            continue
        out.append(target.split(":[")[0] + ":" if ":[" in target else target)
    return sorted(out)


def fewest_fds(pid: int, seconds: float) -> list[str]:
    """The process's file descriptors at the sample with the fewest, over ``seconds`` s."""
    fewest = fd_targets(pid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = fd_targets(pid)
        if len(now) < len(fewest):
            fewest = now
    return fewest


def fds_back_to(pid: int, baseline: list[str], within: float) -> list[str]:
    """The process's file descriptors once no more than ``baseline``'s (or, after ``within`` s,
    the fewest seen meanwhile)."""
    fewest = fd_targets(pid)
    deadline = time.monotonic() + within
    while len(fewest) > len(baseline) and time.monotonic() < deadline:
        time.sleep(0.1)
        now = fd_targets(pid)
        if len(now) < len(fewest):
            fewest = now
    return fewest


def figures(stats: ProcStats) -> dict[str, float]:
    return {
        "rss_mib": round(stats.rss_bytes / 2**20, 1),
        "threads": stats.threads,
        "fds": stats.fds,
    }


async def test_soak_leaves_nothing_behind(vllm: VllmInfo, record_property: Any) -> None:
    assert vllm.model_dir is not None, "set KV_SIDECAR_TEST_MODEL_DIR for an external vLLM"
    prompts = [
        p
        for tokens, seed in ((24, 1), (120, 2), (400, 3))
        for p in make_prompts(vllm.model_dir, 6, tokens, seed=40 + seed)
    ]
    args = ("--policy", "queue", "--headroom", "0.75", "--max-queue-wait", "20")
    sc = SidecarProcess(vllm.url, *args).start(timeout=120)
    try:
        assert sc.proc is not None
        pid = sc.proc.pid
        warm = await traffic(sc.url, vllm.served_name, prompts, WARMUP_SECONDS, seed=1)
        assert not warm.unexpected, warm.unexpected[:5]
        warm_state = await settle(sc, vllm)
        baseline = proc_stats(pid)
        baseline_fds = await asyncio.to_thread(fewest_fds, pid, REST_SAMPLE_SECONDS)

        t0 = time.monotonic()
        tally = await traffic(sc.url, vllm.served_name, prompts, SOAK_SECONDS, seed=2)
        elapsed = time.monotonic() - t0
        state = await settle(sc, vllm)
        after = proc_stats(pid)
        after_fds = await asyncio.to_thread(fds_back_to, pid, baseline_fds, FDS_BACK_WITHIN)
        ops = sc.metrics()
        log = sc.log()
        assert sc.proc.poll() is None
    finally:
        sc.stop()

    requests = sum(tally.outcomes[a] for a in ACTIONS)
    decisions = {
        f"{s.labels['decision']}/{s.labels['reason']}": int(s.value)
        for s in _samples(ops, "kv_sidecar_requests_total")
        if s.value
    }
    result = {
        "seconds": round(elapsed, 1),
        "requests": requests,
        "actions": dict(tally.outcomes),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "decisions": decisions,
        "ledger_after": {
            k: state[k] for k in ("reserved_blocks", "predicted_blocks", "in_flight", "queue_depth")
        },
        "sidecar_before": figures(baseline),
        "sidecar_after": figures(after),
        "fds_at_rest_before": len(baseline_fds),
        "fds_at_rest_after": len(after_fds),
        "event_loop_tasks_before": warm_state["event_loop_tasks"],
        "event_loop_tasks_after": state["event_loop_tasks"],
        "rss_growth_pct": round(
            100 * (after.rss_bytes - baseline.rss_bytes) / baseline.rss_bytes, 2
        ),
    }
    print(f"\n[figures] soak: {json.dumps(result, sort_keys=True)}")
    record_property("soak", json.dumps(result, sort_keys=True))

    assert not tally.unexpected, tally.unexpected[:10]
    assert set(tally.statuses) <= {200, 400, 429}, tally.statuses  # never a 5xx
    assert tally.statuses[200] > requests // 2
    assert decisions.get("admit/queued", 0) > 0  # the queue was exercised
    assert state["reserved_blocks"] == 0 and state["predicted_blocks"] == 0, state
    assert state["in_flight"] == 0 and state["queue_depth"] == 0, state
    # at rest, exactly as many as before: a leak stays, a connection closing late does not
    assert len(after_fds) <= len(baseline_fds), (
        f"{len(after_fds)} file descriptors at rest after the soak, {len(baseline_fds)} before "
        f"(still more {FDS_BACK_WITHIN:.0f} s after it settled): "
        f"{sorted((Counter(after_fds) - Counter(baseline_fds)).items())} more"
    )
    # thread pools (asyncio's default executor, the tokenizer's) start threads lazily up to a
    # fixed bound: one or two more after the soak is a pool filling, a leak grows with requests
    assert after.threads <= baseline.threads + 2, (baseline, after)
    # a leaked task per abandoned request would add tens; allow for idle-connection bookkeeping
    assert state["event_loop_tasks"] <= warm_state["event_loop_tasks"] + 2, (warm_state, state)
    assert after.rss_bytes < baseline.rss_bytes * 1.10, (baseline, after)
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def _samples(text: str, name: str) -> list[Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
