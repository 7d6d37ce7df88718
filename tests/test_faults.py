"""Faults a production pod sees, each with real processes, and the figures they give.

- vLLM SIGKILLed in the middle of streamed answers, then restarted on the same port (real vLLM);
- vLLM's /metrics slow, failing, garbage or without ``cache_config_info`` (fake upstream);
- clients that leave while queued, mid-prefill and mid-stream (real vLLM);
- clients that read a fast stream slowly (fake upstream, the sidecar as a real process);
- 1,000 concurrent connections and 1 MB request bodies (fake upstream, real process);
- SIGTERM with only pass-through requests in flight (fake upstream, real process).

SIGTERM under load with generation in flight is ``tests/test_lifecycle.py``. Figures are printed
(``pytest -s``) and recorded as junit properties; RELIABILITY.md quotes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.fake_vllm import FakeServer, write_model_dir
from harness.vllm_cpu import VllmServer
from harness.workload import SidecarProcess, make_prompts, metric_value
from sidecar.config import ReservationMode, StreamUsage
from sidecar.http.stream_usage import stream_usage_asked
from tests.conftest import VllmInfo
from tests.support.fake_process import FakeProcess
from tests.support.faultkit import ThreadedSidecar, ToughFake, proc_stats
from tests.support.stepped import frozen_engine
from tests.support.wait import wait_for

Record = Any  # pytest's record_property fixture


def figures(record_property: Record, name: str, values: dict[str, Any]) -> None:
    """Print the figures a scenario measured and keep them in the junit report."""
    print(f"\n[figures] {name}: {json.dumps(values, sort_keys=True)}")
    record_property(name, json.dumps(values, sort_keys=True))


def state(sc: SidecarProcess) -> dict[str, Any]:
    return sc.state()


def ledger_empty(sc: SidecarProcess) -> bool:
    s = sc.state()
    return bool(s["in_flight"] == 0 and s["reserved_blocks"] == 0 and s["queue_depth"] == 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny")


# --- vLLM killed mid-stream, then back on the same port ---------------------------------------


@dataclass
class Stream:
    """What one streamed client saw."""

    events: int = 0
    done: bool = False
    error_event: dict[str, Any] | None = None
    transport_error: str | None = None
    status: int = 0
    ended_at: float | None = None
    completion_tokens: int | None = None  # from the usage event


async def read_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Stream
) -> None:
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            out.status = resp.status_code
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    out.done = True
                elif line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        out.error_event = obj["error"]
                    else:
                        out.events += 1
                        if obj.get("usage"):
                            out.completion_tokens = obj["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        out.transport_error = type(exc).__name__
    out.ended_at = time.monotonic()


def completion_body(prompt: str, max_tokens: int, *, stream: bool, model: str) -> dict[str, Any]:
    """A completion of exactly ``max_tokens`` tokens for the real vLLM serving ``model``."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def assert_503_retry(resp: httpx.Response, code: str) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == code, resp.text
    assert int(resp.headers["retry-after"]) >= 1
    assert int(resp.headers["retry-after-ms"]) >= 1


@pytest.mark.vllm
@pytest.mark.timeout(1200)
async def test_vllm_killed_mid_stream_then_back_on_the_same_port(
    record_property: Record,
) -> None:
    if os.environ.get("KV_SIDECAR_TEST_VLLM_URL"):
        pytest.skip("kills and restarts its own vLLM: not with an external one")
    server = await asyncio.to_thread(VllmServer(num_gpu_blocks=64).start)
    restarted: VllmServer | None = None
    sc: SidecarProcess | None = None
    try:
        assert server.model_dir is not None and server.proc is not None
        model = server.info().served_name
        prompts = make_prompts(server.model_dir, 6, 100, seed=23)
        sc = SidecarProcess(
            server.url, "--scrape-interval", "0.2", "--metrics-stale-after", "2"
        ).start(timeout=120)
        pid = sc.proc.pid if sc.proc else 0
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:
            streams = [Stream() for _ in range(4)]
            tasks = [
                asyncio.ensure_future(
                    read_stream(
                        client, sc.url, completion_body(p, 900, stream=True, model=model), s
                    )
                )
                for p, s in zip(prompts, streams, strict=False)
            ]
            plain = asyncio.ensure_future(
                client.post(
                    sc.url + "/v1/completions",
                    json=completion_body(prompts[4], 900, stream=False, model=model),
                )
            )
            # All five in flight at the sidecar, every stream's headers relayed (vLLM accepted
            # it), and none can end before the kill, however fast vLLM decodes and however far
            # behind this client reads (vLLM merges a slow consumer's tokens into fewer events:
            # counting events proves nothing). vLLM's engine core and worker are frozen from the
            # start until the kill (SIGSTOP to its process group, SIGCONT to the API server
            # alone, the group's leader): the API server renders the prompts and answers with its
            # headers without the engine, and no token is made, so no answer can have ended at
            # the kill. (20 ms pulses of the engine between checks were not enough: a
            # fresh-clone CI run finished a 900-token answer before the client saw the five
            # requests' headers; a pulse a second still let the engine run for as long as the
            # checks took on a busy host. None is given now: headers that needed the engine
            # would fail this wait, never let an answer end first.)
            os.killpg(server.proc.pid, signal.SIGSTOP)
            os.kill(server.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 120
            while True:
                before = await asyncio.to_thread(state, sc)
                if before["in_flight"] == 5 and all(s.status == 200 for s in streams):
                    break
                assert time.monotonic() < deadline, (
                    f"the five requests not all in flight with their headers relayed within "
                    f"120 s: {before}, {streams}"
                )
                assert not any(t.done() for t in tasks), (before, streams, sc.log()[-3000:])
                await asyncio.sleep(0.05)
            os.killpg(server.proc.pid, signal.SIGSTOP)  # the API server too: nothing relayed
            before = await asyncio.to_thread(state, sc)
            assert before["in_flight"] == 5 and before["reserved_blocks"] > 0, (before, streams)

            killed_at = time.monotonic()
            os.killpg(server.proc.pid, signal.SIGKILL)  # a stopped process dies all the same
            await asyncio.to_thread(server.proc.wait, 30)

            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            answer = await asyncio.wait_for(plain, 30)
            for s in streams:  # terminated: never a clean [DONE], an error event or a broken stream
                assert not s.done, s
                assert s.error_event is not None or s.transport_error is not None, s
                if s.error_event is not None:
                    assert s.error_event["code"] == "upstream_failed", s
            assert_503_retry(answer, "upstream_unavailable")
            stream_end_s = max(s.ended_at or 0 for s in streams) - killed_at

            await asyncio.to_thread(
                wait_for, lambda: ledger_empty(sc), "reservations released after the kill", 30, 0.02
            )
            released_s = time.monotonic() - killed_at
            await asyncio.to_thread(
                wait_for,
                lambda: httpx.get(sc.metrics_url + "/readyz", timeout=5).status_code == 503,
                "/readyz 503 after the kill",
                30.0,
                0.02,
            )
            unready_s = time.monotonic() - killed_at

            # while vLLM is down: 503 + Retry-After for generation (streamed or not), pass-through
            for stream in (False, True):
                resp = await client.post(
                    sc.url + "/v1/completions",
                    json=completion_body(prompts[5], 16, stream=stream, model=model),
                )
                assert_503_retry(resp, "upstream_unavailable")
            assert_503_retry(await client.get(sc.url + "/v1/models"), "upstream_unavailable")
            # /readyz may turn 503 on vLLM's /health before a scrape has failed: a scrape sent
            # to the stopped API server can wait out its timeout (2 s) first (a fresh-clone CI run
            # read vllm_up true here, ready false)
            await asyncio.to_thread(
                wait_for,
                lambda: httpx.get(sc.metrics_url + "/readyz", timeout=5).json()["vllm_up"] is False,
                "a failed scrape after the kill",
                SETTLES_WITHIN,
                0.02,
            )
            readyz = (await client.get(sc.metrics_url + "/readyz")).json()
            assert readyz["ready"] is False and readyz["vllm_up"] is False, readyz
            down_metrics = (await client.get(sc.metrics_url + "/metrics")).text
            assert metric_value(down_metrics, "kv_sidecar_vllm_up") == 0.0
            assert metric_value(down_metrics, "kv_sidecar_ready") == 0.0
            assert ledger_empty(sc)

            # vLLM back on the same port: the same sidecar process recovers by itself
            restarted = VllmServer(num_gpu_blocks=64, port=server.port, model_dir=server.model_dir)
            t_restart = time.monotonic()
            await asyncio.to_thread(restarted.start)
            vllm_back_s = time.monotonic() - t_restart
            ready_again_s = await asyncio.to_thread(
                wait_for,
                lambda: httpx.get(sc.metrics_url + "/readyz", timeout=5).status_code == 200,
                "/readyz 200 once vLLM is healthy again",
                60.0,
                0.05,
            )
            assert sc.proc is not None and sc.proc.poll() is None and sc.proc.pid == pid
            ok = Stream()
            await read_stream(
                client, sc.url, completion_body(prompts[5], 40, stream=True, model=model), ok
            )
            # every token, by vLLM's own count (it may merge tokens into fewer events)
            assert ok.status == 200 and ok.done and ok.completion_tokens == 40, ok
            resp = await client.post(
                sc.url + "/v1/completions",
                json=completion_body(prompts[0], 40, stream=False, model=model),
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 40
            await asyncio.to_thread(
                wait_for, lambda: ledger_empty(sc), "ledger empty after the last answer", 30
            )
        log = sc.log()
        assert "vLLM metrics scrape failing" in log
        assert "vLLM metrics back after" in log
        assert "Traceback" not in log
        figures(
            record_property,
            "vllm_killed",
            {
                "streams_cut": len(streams),
                "stream_ends_after_kill_s": round(stream_end_s, 3),
                "error_events": sum(s.error_event is not None for s in streams),
                "transport_errors": sum(s.transport_error is not None for s in streams),
                "reservations_released_after_kill_s": round(released_s, 3),
                "readyz_false_after_kill_s": round(unready_s, 3),
                "vllm_restart_s": round(vllm_back_s, 1),
                "sidecar_ready_after_vllm_healthy_s": round(ready_again_s, 3),
            },
        )
    finally:
        if sc is not None:
            sc.stop()
        for vllm_server in (server, restarted):
            if vllm_server is not None:
                vllm_server.stop()


# --- vLLM's /metrics slow, failing, garbage, or without cache_config_info ---------------------

FAULT_MODES = ["hang", "error", "garbage", "no_cache_config"]
STALE_AFTER = 0.5
#: The name the fake vLLM serves (``harness/fake_vllm.py``); the real-vLLM tests ask the server.
FAKE_MODEL = "tiny"
# 7 sequences of 10 + 1000 tokens: 56 blocks of 128, of a budget of floor(63 x 0.95) = 59
HOG = {
    "model": FAKE_MODEL,
    "prompt": "a b c d e f g h i",
    "max_tokens": 1000,
    "n": 7,
    "stream": True,
}
SMALL = {"model": FAKE_MODEL, "prompt": "the quick brown fox", "max_tokens": 16}
EIGHT_BLOCKS = {"model": FAKE_MODEL, "prompt": "the quick brown fox", "max_tokens": 1000}
#: Deadline for a wait on the fake's or the sidecar's next scrape or release: generous for a
#: loaded 2-core machine (each is expected in well under a second; the figures say how long).
SETTLES_WITHIN = 10.0


@pytest.fixture
def fake(model_dir: Path) -> Iterator[FakeServer]:
    with FakeServer(ToughFake(model_root=model_dir)) as server:
        yield server


def _error_code(resp: httpx.Response) -> str:
    return str(resp.json()["error"]["code"])


@contextlib.contextmanager
def hog(url: str) -> Iterator[None]:
    """A streamed request holding 56 blocks of the ledger while the block runs."""
    ready = threading.Event()
    stop = threading.Event()

    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=HOG, timeout=30) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_raw():
                ready.set()
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert ready.wait(10), "the hog never started"
        yield
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.parametrize("mode", FAULT_MODES)
def test_vllm_metrics_fault_falls_back_to_the_ledger_and_recovers(
    fake: FakeServer, mode: str, caplog: pytest.LogCaptureFixture, record_property: Record
) -> None:
    """Stale engine data: admit on the ledger alone (``--stale-policy open``), say so, recover."""
    caplog.set_level(logging.INFO, logger="sidecar")
    app: ToughFake = fake.app  # type: ignore[assignment]
    app.token_delay = 0.02
    with ThreadedSidecar(fake.url, policy="reject", metrics_stale_after=STALE_AFTER) as sc:
        client = httpx.Client(timeout=30, trust_env=False)
        # fresh engine data: vLLM says its cache is full, so the gate refuses
        app.kv_cache_usage = 0.99
        wait_for(
            lambda: sc.call(lambda: sc.sc.admission.committed_blocks()) >= 60,
            "vLLM's full cache (usage 0.99) scraped into the sidecar's committed blocks",
            SETTLES_WITHIN,
        )
        resp = client.post(sc.url + "/v1/completions", json=SMALL)
        assert resp.status_code == 429 and _error_code(resp) == "kv_cache_full"

        app.metrics_mode = mode  # type: ignore[assignment]
        t0 = time.monotonic()
        stale_s = wait_for(
            lambda: sc.call(sc.sc.admission.is_stale), "engine data stale", SETTLES_WITHIN
        )
        unready_s = wait_for(
            lambda: client.get(sc.ops_url + "/readyz").status_code == 503,
            "/readyz 503 on stale data",
            SETTLES_WITHIN,
        )
        unready_s = time.monotonic() - t0
        # the ledger alone: vLLM's last word (full) no longer counts ...
        resp = client.post(sc.url + "/v1/completions", json=SMALL)
        assert resp.status_code == 200, resp.text
        assert sc.sample("kv_sidecar_requests_total", decision="admit", reason="stale_open") == 1
        # ... but the ledger's own reservations still do
        with hog(sc.url):
            resp = client.post(sc.url + "/v1/completions", json=EIGHT_BLOCKS)
            assert resp.status_code == 429 and _error_code(resp) == "kv_cache_full", resp.text
        wait_for(sc.ledger_empty, "the hog's reservation released", SETTLES_WITHIN)

        # says so: in metrics ...
        wait_for(lambda: sc.sample("kv_sidecar_vllm_up") == 0.0, "vllm_up 0", SETTLES_WITHIN)
        ops = client.get(sc.ops_url + "/metrics").text
        age = metric_value(ops, "kv_sidecar_vllm_metrics_age_seconds")
        assert age is not None and age > STALE_AFTER
        assert metric_value(ops, "kv_sidecar_ready") == 0.0
        assert (metric_value(ops, "kv_sidecar_vllm_scrape_errors_total") or 0) >= 1
        readyz = client.get(sc.ops_url + "/readyz").json()
        assert readyz["vllm_up"] is False and readyz["last_error"], readyz
        # ... and in logs
        wait_for(
            lambda: any("scrape failing" in r.getMessage() for r in caplog.records),
            "a 'scrape failing' log line",
            SETTLES_WITHIN,
        )

        # recovery
        app.metrics_mode = "ok"
        app.kv_cache_usage = 0.0
        t1 = time.monotonic()
        wait_for(
            lambda: client.get(sc.ops_url + "/readyz").status_code == 200,
            "/readyz 200 once /metrics answers again",
            SETTLES_WITHIN,
        )
        ready_again_s = time.monotonic() - t1
        assert not sc.call(sc.sc.admission.is_stale)
        resp = client.post(sc.url + "/v1/completions", json=SMALL)
        assert resp.status_code == 200
        assert sc.sample("kv_sidecar_requests_total", decision="admit", reason="fits") >= 1
        assert sc.sample("kv_sidecar_vllm_up") == 1.0
        assert any("metrics back after" in r.getMessage() for r in caplog.records)
        # engine data counts again: vLLM full -> refused
        app.kv_cache_usage = 0.99
        wait_for(
            lambda: sc.call(lambda: sc.sc.admission.committed_blocks()) >= 60,
            "vLLM's full cache counted again after the recovery",
            SETTLES_WITHIN,
        )
        resp = client.post(sc.url + "/v1/completions", json=SMALL)
        assert resp.status_code == 429
        assert sc.ledger_empty()
        figures(
            record_property,
            f"metrics_{mode}",
            {
                "stale_after_s": round(stale_s, 3),
                "readyz_false_after_s": round(unready_s, 3),
                "ready_again_after_s": round(ready_again_s, 3),
                "age_seconds_exported": round(age, 3),
            },
        )


def test_stale_policy_closed_refuses_with_503_and_recovers(
    fake: FakeServer, record_property: Record
) -> None:
    """``--stale-policy closed`` on a real process: stale engine data means 503, not a guess."""
    app: ToughFake = fake.app  # type: ignore[assignment]
    args = ("--stale-policy", "closed", "--metrics-stale-after", "0.5", "--scrape-interval", "0.1")
    with SidecarProcess(fake.url, *args) as sc:
        client = httpx.Client(timeout=30, trust_env=False)
        assert client.post(sc.url + "/v1/completions", json=SMALL).status_code == 200
        app.metrics_mode = "error"
        t0 = time.monotonic()
        wait_for(
            lambda: client.get(sc.metrics_url + "/readyz").status_code == 503,
            "/readyz 503 once /metrics fails",
            SETTLES_WITHIN,
        )
        wait_for(
            lambda: state(sc)["snapshot_age"] > 0.5, "the snapshot older than 0.5 s", SETTLES_WITHIN
        )
        resp = client.post(sc.url + "/v1/completions", json=SMALL)
        refused_s = time.monotonic() - t0
        assert_503_retry(resp, "engine_metrics_stale")
        ops = sc.metrics()
        assert metric_value(ops, "kv_sidecar_requests_total", reason="stale_closed") == 1
        assert metric_value(ops, "kv_sidecar_vllm_up") == 0.0
        assert (metric_value(ops, "kv_sidecar_vllm_metrics_age_seconds") or 0) > 0.5
        assert 'stale_policy="closed"' in ops
        app.metrics_mode = "ok"
        t1 = time.monotonic()
        wait_for(
            lambda: client.get(sc.metrics_url + "/readyz").status_code == 200,
            "/readyz 200 once /metrics answers again",
            SETTLES_WITHIN,
        )
        assert client.post(sc.url + "/v1/completions", json=SMALL).status_code == 200
        back_s = time.monotonic() - t1
        wait_for(lambda: ledger_empty(sc), "ledger empty", SETTLES_WITHIN)
    log = sc.log()
    assert "vLLM metrics scrape failing" in log and "HTTP 500" in log
    assert "vLLM metrics back after" in log
    figures(
        record_property,
        "stale_closed",
        {
            "refused_503_after_fault_s": round(refused_s, 3),
            "admitting_after_recovery_s": round(back_s, 3),
        },
    )


# --- clients that go away: queued, mid-prefill, mid-stream, mid-generation (real vLLM) ---------

#: The sidecar's part: the reservation is back within this (and the queue slot, for a queued one).
#: The release runs as soon as the sidecar sees the client gone (measured 0.01 to 0.24 s, the
#: figures report it); the deadline is generous so that a loaded 2-core machine, where one
#: /state read can take a second, does not fail a release that happened.
RELEASE_WITHIN = 5.0
#: vLLM's part: its running gauge reaches 0. vLLM publishes it from its engine loop and serves
#: /metrics from its busy API loop (on a loaded 2-core machine a read alone took up to 3 s, and
#: the gauge lagged up to 5.5 s behind an abort), so the proof that the generation was cut
#: short is the count of tokens vLLM generated, not this figure.
VLLM_STOP_WITHIN = 10.0
#: Tries at a scenario whose premise a busy host can spoil before the client leaves (vLLM
#: decoding a whole answer before the test could pause it): each try is counted in the figures.
ATTEMPTS = 3
#: A stream cut short must have this many tokens left to decode as its client leaves: the steps
#: vLLM's engine may run, once let go, before its input thread hands it the abort.
MARGIN = 100


class VllmWatch:
    """vLLM's own view: the requests it runs and holds waiting, the tokens it generated.

    (vLLM 0.32 does not count a client's abort in ``request_success_total{finished_reason=
    "abort"}``; the running count and the generated tokens show the generation was stopped.)
    """

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client = client
        self.url = url

    async def read(self) -> dict[str, float]:
        text = (await self.client.get(self.url + "/metrics")).text
        return {
            "running": metric_value(text, "vllm:num_requests_running") or 0.0,
            "waiting": metric_value(text, "vllm:num_requests_waiting") or 0.0,
            "generated": metric_value(text, "vllm:generation_tokens_total") or 0.0,
            "prompt": metric_value(text, "vllm:prompt_tokens_total") or 0.0,
            # completions whose HTTP handler returned, answered or cut off by their client
            "completions": metric_value(text, "http_requests_total", handler="/v1/completions")
            or 0.0,
        }

    async def until(
        self, what: str, check: Any, within: float, since: float | None = None
    ) -> float:
        """Seconds from ``since`` (default: now) until ``check`` holds; fails after ``within``."""
        t0 = time.monotonic() if since is None else since
        while True:
            now = await self.read()
            if check(now):
                return time.monotonic() - t0
            assert time.monotonic() - t0 < within, f"vLLM not {what} within {within}s: {now}"
            await asyncio.sleep(0.02)

    async def steady(self) -> dict[str, float]:
        """Counters that stopped moving, idle or not (with the engine stopped: what vLLM's API
        server had of its outputs)."""
        last = await self.read()
        deadline = time.monotonic() + 60
        while True:
            await asyncio.sleep(0.3)
            now = await self.read()
            if now == last:
                return now
            assert time.monotonic() < deadline, f"vLLM's counters still moving: {now}"
            last = now

    async def settled(self) -> dict[str, float]:
        """Idle, with counters that stopped moving (vLLM publishes some a step late)."""
        last: dict[str, float] | None = None
        deadline = time.monotonic() + 60
        while True:
            now = await self.read()
            if now["running"] == 0 and now["waiting"] == 0 and now == last:
                return now
            assert time.monotonic() < deadline, f"vLLM not idle: {now}"
            last = now
            await asyncio.sleep(0.3)


async def sidecar_until(
    client: httpx.AsyncClient,
    sc: SidecarProcess,
    what: str,
    check: Any,
    within: float,
    since: float | None = None,
) -> float:
    """Seconds from ``since`` (default: now) until /state passes ``check``."""
    t0 = time.monotonic() if since is None else since
    while True:
        now = (await client.get(sc.metrics_url + "/state")).json()
        if check(now):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within, f"sidecar not {what} within {within}s: {now}"
        await asyncio.sleep(0.005)


def raw_post(body: dict[str, Any]) -> bytes:
    """A /v1/completions request as bytes, for a client that is a bare socket."""
    data = json.dumps(body)
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n{data}"
    ).encode()


async def _queue_and_leave(
    client: httpx.AsyncClient, sc: SidecarProcess, body: dict[str, Any], out: dict[str, Any]
) -> None:
    """B, sent while H holds the budget and vLLM is paused: it queues, and its client leaves
    while it waits; the queue is empty again within ``RELEASE_WITHIN``."""
    task_b = asyncio.ensure_future(client.post(sc.url + "/v1/completions", json=body))
    await sidecar_until(client, sc, "queueing B", lambda s: s["queue_depth"] == 1, 30)
    task_b.cancel()  # B leaves while queued
    t0 = time.monotonic()
    await asyncio.gather(task_b, return_exceptions=True)
    out["queued_left_queue_s"] = await sidecar_until(
        client, sc, "B out", lambda s: s["queue_depth"] == 0, RELEASE_WITHIN, since=t0
    )


#: the figures' prefix of each client that leaves while vLLM generates
_LEFT = {"A": "mid_stream", "D": "non_streamed"}


async def _released_and_ended(
    engine: VllmWatch,
    sc: SidecarProcess,
    name: str,
    before: dict[str, float],
    t0: float,
    out: dict[str, Any],
) -> dict[str, float]:
    """Inside ``frozen_engine``, ``name``'s client gone at ``t0``: the sidecar releases it and
    vLLM's API server ends its request (its handler returns, having sent the engine the abort);
    vLLM's counters then, the engine still stopped."""
    key = _LEFT[name]
    out[f"{key}_released_s"] = await sidecar_until(
        engine.client, sc, f"{name} released", _empty, RELEASE_WITHIN, since=t0
    )
    out[f"{key}_vllm_ended_s"] = await engine.until(
        f"ending {name}'s request",
        lambda v: v["completions"] > before["completions"],
        VLLM_STOP_WITHIN,
        since=t0,
    )
    return await engine.steady()


async def _run_on(
    engine: VllmWatch, name: str, before: dict[str, float], left: dict[str, float], out: Any
) -> dict[str, float]:
    """The engine let run again after ``_released_and_ended``: what ``name`` had generated as
    its client left, and vLLM's counters once it is idle."""
    key = _LEFT[name]
    out[f"{key}_generated_at_leave"] = left["generated"] - before["generated"]
    out[f"{key}_vllm_running_0_s"] = await engine.until(
        f"running 0 after {name}", lambda v: v["running"] == 0, VLLM_STOP_WITHIN
    )
    return await engine.settled()


def _empty(s: dict[str, Any]) -> bool:
    return bool(s["in_flight"] == 0 and s["reserved_blocks"] == 0 and s["queue_depth"] == 0)


def read_until(sock: socket.socket, marker: bytes, timeout: float) -> bytes:
    """Read from ``sock`` until ``marker`` has arrived, within ``timeout`` s; what was read."""
    deadline = time.monotonic() + timeout
    data = b""
    while marker not in data:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} within {timeout} s: {data[-300:]!r}"
        sock.settimeout(left)
        chunk = sock.recv(4096)
        assert chunk, f"closed before {marker!r}: {data[-300:]!r}"
        data += chunk
    return data


@contextlib.contextmanager
def paused(server: VllmServer | None) -> Iterator[None]:
    """vLLM's whole process group stopped (SIGSTOP) for the block, then continued."""
    assert server is not None and server.proc is not None
    os.killpg(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)


def _stop_engine(vllm: VllmInfo) -> None:
    """vLLM's engine core and worker stopped, its API server running (``frozen_engine``)."""
    assert vllm.server is not None and vllm.server.proc is not None
    os.killpg(vllm.server.proc.pid, signal.SIGSTOP)
    os.kill(vllm.server.proc.pid, signal.SIGCONT)


#: The pulses' timer, in a process of its own at a real-time priority where the host allows it
#: (root, as CI): the engine's SIGSTOP must come on time however busy the host is. Timed from
#: the test's own event loop, a busy host's pulses of 20 ms ran long enough for vLLM to decode
#: a whole 900-token answer in a second of them (a stress run beside two CPU-burning processes).
#: It leaves the engine stopped (``_stop_engine``) when told to end (SIGTERM).
_PULSER = """
import os, signal, sys, time
pid, on, off = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
except OSError:
    pass  # an ordinary process: as timely as the host makes it
ending = []
signal.signal(signal.SIGTERM, lambda *_: ending.append(1))
while not ending:
    time.sleep(off)
    if ending:
        break
    os.killpg(pid, signal.SIGCONT)
    time.sleep(on)
    os.killpg(pid, signal.SIGSTOP)
    os.kill(pid, signal.SIGCONT)
"""


async def _pulse_engine(vllm: VllmInfo) -> None:
    """Inside ``frozen_engine``: the engine let run 20 ms every 200 ms, until cancelled (then
    stopped again)."""
    assert vllm.server is not None and vllm.server.proc is not None
    pid = str(vllm.server.proc.pid)
    pulser = await asyncio.create_subprocess_exec(sys.executable, "-c", _PULSER, pid, "0.02", "0.2")
    try:
        code = await pulser.wait()  # until cancelled
        raise AssertionError(f"the pulser exited {code}")
    finally:
        if pulser.returncode is None:
            pulser.terminate()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(pulser.wait())
        _stop_engine(vllm)


@pytest.mark.vllm
async def test_client_disconnects_abort_upstream_and_release_the_reservation(
    vllm: VllmInfo, record_property: Record
) -> None:
    assert vllm.model_dir is not None
    if vllm.server is None:
        pytest.skip("pauses its vLLM with SIGSTOP: not an external one")
    model = vllm.served_name
    prompt_tokens = 100
    max_tokens = min(900, vllm.max_model_len - prompt_tokens - 1)
    blocks_each = vllm.blocks_for(prompt_tokens + max_tokens)
    # room in the budget for one such request, not two: the second one queues
    headroom = 1 - (1.5 * blocks_each) / (vllm.num_gpu_blocks - 1)
    short = make_prompts(vllm.model_dir, 5, prompt_tokens, seed=31)
    long_prompt = make_prompts(vllm.model_dir, 1, 900, seed=32)[0]
    args = ("--policy", "queue", "--headroom", f"{headroom:.4f}", "--max-queue-wait", "60")
    sc = SidecarProcess(vllm.url, *args, "--scrape-interval", "0.1").start(timeout=120)
    out: dict[str, Any] = {}
    try:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(timeout=60, limits=limits, trust_env=False) as client:
            engine = VllmWatch(client, vllm.url)
            base = await engine.settled()

            # H, a client that stops reading after its first event. Kernel socket buffers can
            # absorb H's whole answer (about 200 KB), so H would end as fast as vLLM decodes:
            # H is sent with vLLM's engine stopped, the engine runs in pulses until H's first
            # event is out, and vLLM is then paused (SIGSTOP), which holds H's reservation for
            # as long as B needs to queue behind it and leave. (With the engine free-running, a
            # busy host's vLLM decoded all of H's answer before the pause, in three tries in a
            # row: a stress run.) Should a pulse overrun that far, H is no longer in flight,
            # there is nothing for B to queue behind, and H is sent again.
            body_b = completion_body(short[1], max_tokens, stream=True, model=model)
            body_h = completion_body(short[0], max_tokens, stream=True, model=model)
            for attempt in range(1, ATTEMPTS + 1):
                base = await engine.settled()
                holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                holder.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                holder.connect(("127.0.0.1", sc.port))
                with frozen_engine(vllm):
                    pulsing = asyncio.ensure_future(_pulse_engine(vllm))
                    try:
                        holder.sendall(raw_post(body_h))
                        await asyncio.to_thread(read_until, holder, b"data: {", 120)
                    finally:
                        pulsing.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await pulsing
                        _stop_engine(vllm)
                    with paused(vllm.server):
                        s = (await client.get(sc.metrics_url + "/state")).json()
                        held = s["in_flight"] == 1
                        if held:
                            await _queue_and_leave(client, sc, body_b, out)
                            s = (await client.get(sc.metrics_url + "/state")).json()
                            assert s["in_flight"] == 1 and s["reserved_blocks"] == blocks_each, s
                        holder.close()  # H leaves too, while the sidecar waits to write to it
                        t0 = time.monotonic()
                        out["stalled_reader_released_s"] = await sidecar_until(
                            client, sc, "H released", _empty, RELEASE_WITHIN, since=t0
                        )
                if held:
                    break
                assert attempt < ATTEMPTS, (
                    f"H's whole answer was decoded before the pause {ATTEMPTS} times: {s}"
                )
            out["held_attempts"] = attempt
            after_b = await engine.settled()
            ops = sc.metrics()
            assert metric_value(ops, "kv_sidecar_requests_total", decision="cancel") == 1
            assert metric_value(ops, "kv_sidecar_requests_total", decision="admit") == attempt
            # vLLM saw H's prompt only: B never reached it
            assert after_b["prompt"] - base["prompt"] == prompt_tokens, (base, after_b)

            # A leaves mid-stream, after a few events. Its engine runs only in pulses of 20 ms
            # until the client has read 5 events, and is stopped as the client leaves (on the
            # free-running engine a busy host's client read its fifth event after vLLM had
            # finished all 900 tokens: a fresh-clone CI run). vLLM's API server, still running,
            # must see the connection the sidecar closed and end A's request (its HTTP handler
            # returns: ``http_requests_total`` counts it), which aborts A in the engine; only
            # then does the engine run again, freely, and it must stop A short of its end.
            # A pulse can overrun on a busy host (the test's own process descheduled), and vLLM
            # merges the tokens its API server is slow to send into fewer events: when A is
            # within MARGIN tokens of its end as its client leaves, there is no cut to see, and
            # A is sent again.
            for attempt in range(1, ATTEMPTS + 1):
                before_a = await engine.settled()
                a = Stream()
                body_a = completion_body(short[2], max_tokens, stream=True, model=model)
                with frozen_engine(vllm):
                    pulsing = asyncio.ensure_future(_pulse_engine(vllm))
                    try:
                        async with client.stream(
                            "POST", sc.url + "/v1/completions", json=body_a
                        ) as resp:
                            async for line in resp.aiter_lines():
                                a.events += line.startswith("data: {")
                                if a.events >= 5:
                                    pulsing.cancel()
                                    break  # leaving the block closes the connection mid-stream
                    finally:
                        pulsing.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await pulsing
                        _stop_engine(vllm)  # however the pulse ended: no step from here
                    t0 = time.monotonic()
                    assert a.events == 5
                    left = await _released_and_ended(engine, sc, "A", before_a, t0, out)
                after_a = await _run_on(engine, "A", before_a, left, out)
                if out["mid_stream_generated_at_leave"] < max_tokens - MARGIN:
                    break
                assert attempt < ATTEMPTS, f"A near its end as its client left {ATTEMPTS} times"
            out["mid_stream_attempts"] = attempt
            # vLLM cut A's answer short
            out["mid_stream_vllm_generated"] = after_a["generated"] - before_a["generated"]
            assert out["mid_stream_vllm_generated"] < max_tokens, (before_a, left, after_a)

            # C leaves during its prefill: admitted and forwarded, no token back yet. That window
            # is one prefill long (tens of ms) on the free-running engine, and catching it took a
            # few tries on a busy host; so C is sent with vLLM's engine stopped (frozen_engine:
            # the API server takes C and answers with its headers, no step runs), which holds the
            # sidecar in that window for as long as the test needs, on any host.
            c_max_tokens = vllm.max_model_len - 901
            request = raw_post(completion_body(long_prompt, c_max_tokens, stream=True, model=model))
            before = await engine.settled()
            with frozen_engine(vllm):
                sock = socket.create_connection(("127.0.0.1", sc.port))
                sock.sendall(request)
                # vLLM's headers relayed: C was admitted and forwarded, and vLLM took it
                head = await asyncio.to_thread(read_until, sock, b"\r\n\r\n", 60)
                assert head.startswith(b"HTTP/1.1 200"), head[:300]
                s = (await client.get(sc.metrics_url + "/state")).json()
                # one in flight, and no token has reached the sidecar
                assert s["in_flight"] == 1 and s["predicted_blocks"] == 0, s
                assert b"data: {" not in head, head[-300:]
                sock.close()
                t0 = time.monotonic()
                out["mid_prefill_released_s"] = await sidecar_until(
                    client, sc, "C released", _empty, RELEASE_WITHIN, since=t0
                )
            out["mid_prefill_vllm_running_0_s"] = await engine.until(
                "running 0 after C",
                lambda v: v["running"] == 0 and v["waiting"] == 0,
                VLLM_STOP_WITHIN,
                since=t0,
            )
            after_c = await engine.settled()
            out["mid_prefill_vllm_generated"] = after_c["generated"] - before["generated"]
            assert out["mid_prefill_vllm_generated"] < c_max_tokens, (before, after_c)

            # D leaves while vLLM generates its (non-streamed) answer: D is sent with vLLM's
            # engine stopped (its API server running: frozen_engine), so that however fast the
            # host decodes, D cannot be answered before the sidecar is seen holding it (on the
            # free-running engine a fresh-clone CI's D was admitted and answered between two
            # reads of /state); the engine then runs in pulses for a second (D decodes, a few
            # dozen tokens at most) and is stopped, and the client leaves. As for A, vLLM's API
            # server must end D's request with the engine stopped (a busy host's engine, let run
            # free, once decoded all 900 tokens before its API server saw the client gone), and
            # D is sent again when the pulses overran to within MARGIN tokens of its end.
            body_d = completion_body(short[3], max_tokens, stream=False, model=model)
            for attempt in range(1, ATTEMPTS + 1):
                before = await engine.settled()
                with frozen_engine(vllm):
                    task_d = asyncio.ensure_future(
                        client.post(sc.url + "/v1/completions", json=body_d)
                    )
                    await sidecar_until(client, sc, "D admitted", lambda s: s["in_flight"] == 1, 30)
                    await asyncio.sleep(0.1)  # the sidecar forwards D, vLLM's API server takes it
                    pulsing = asyncio.ensure_future(_pulse_engine(vllm))
                    try:
                        await asyncio.sleep(1.0)
                    finally:
                        pulsing.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await pulsing
                        _stop_engine(vllm)
                    out["non_streamed_left_after_s"] = 1.1
                    task_d.cancel()
                    t0 = time.monotonic()
                    await asyncio.gather(task_d, return_exceptions=True)
                    left = await _released_and_ended(engine, sc, "D", before, t0, out)
                after_d = await _run_on(engine, "D", before, left, out)
                if out["non_streamed_generated_at_leave"] < max_tokens - MARGIN:
                    break
                assert attempt < ATTEMPTS, f"D near its end as its client left {ATTEMPTS} times"
            out["non_streamed_attempts"] = attempt
            out["non_streamed_vllm_generated"] = after_d["generated"] - before["generated"]
            assert out["non_streamed_vllm_generated"] < max_tokens, (before, left, after_d)

            # still serving: a whole answer goes through
            resp = await client.post(
                sc.url + "/v1/completions",
                json=completion_body(short[4], 20, stream=False, model=model),
            )
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 20
            await sidecar_until(client, sc, "empty after the last answer", _empty, RELEASE_WITHIN)
        assert "Traceback" not in sc.log()
    finally:
        sc.stop()
    figures(record_property, "disconnects", {k: _round(v) for k, v in out.items()})


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


# --- slow readers: backpressure, not buffering ----------------------------------------------

FIREHOSE_CHUNKS = 8192  # x 64 KiB = 512 MiB: far more than any buffer on the way
FIREHOSE_SIZE = 65536
SLOW_READ_SECONDS = 6.0


@pytest.fixture(scope="module")
def firehose_fake(model_dir: Path) -> Iterator[FakeServer]:
    with FakeServer(ToughFake(model_root=model_dir)) as server:
        yield server


@pytest.fixture(scope="module")
def firehose_sidecar(firehose_fake: FakeServer) -> Iterator[SidecarProcess]:
    sc = SidecarProcess(firehose_fake.url, "--log-level", "warning")
    try:
        yield sc.start()
    finally:
        sc.stop()


def slow_read(
    port: int, request: bytes, seconds: float, app: ToughFake, pid: int
) -> dict[str, Any]:
    """Read an answer through a 4 KiB receive window at ~200 KiB/s; sample RSS and the upstream."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(5)
    sock.sendall(request)
    received = 0
    rss: list[int] = []
    sent: list[tuple[float, int, int]] = []  # (t, upstream bytes sent, client bytes received)
    t0 = time.monotonic()
    next_sample = t0
    try:
        while (now := time.monotonic()) - t0 < seconds:
            data = sock.recv(4096)
            assert data, "the stream ended early"
            received += len(data)
            if now >= next_sample:
                rss.append(proc_stats(pid).rss_bytes)
                sent.append((now - t0, app.firehose_sent, received))
                next_sample = now + 0.25
            time.sleep(0.02)
    finally:
        sock.close()
    return {"received": received, "rss": rss, "sent": sent}


@pytest.mark.parametrize("route", ["passthrough", "generation"])
def test_slow_reader_memory_stays_flat_and_upstream_is_throttled(
    firehose_fake: FakeServer,
    firehose_sidecar: SidecarProcess,
    route: str,
    record_property: Record,
) -> None:
    app: ToughFake = firehose_fake.app  # type: ignore[assignment]
    sc = firehose_sidecar
    assert sc.proc is not None
    pid = sc.proc.pid
    if route == "passthrough":
        target = f"/firehose?chunks={FIREHOSE_CHUNKS}&size={FIREHOSE_SIZE}"
        request = f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        warm = f"/firehose?chunks=64&size={FIREHOSE_SIZE}"
        assert len(httpx.get(sc.url + warm, timeout=30).content) > 64 * (FIREHOSE_SIZE - 16)
    else:
        body = json.dumps(
            {
                "model": FAKE_MODEL,
                "prompt": "a slow reader",
                "max_tokens": 16,
                "stream": True,
                "firehose": FIREHOSE_CHUNKS,
                "firehose_size": FIREHOSE_SIZE,
            }
        )
        request = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
        warm_body = json.loads(body) | {"firehose": 64}
        resp = httpx.post(sc.url + "/v1/completions", json=warm_body, timeout=30)
        assert resp.status_code == 200 and len(resp.content) > 64 * (FIREHOSE_SIZE - 16)
    aborted = app.aborted
    baseline = proc_stats(pid).rss_bytes
    out = slow_read(sc.port, request, SLOW_READ_SECONDS, app, pid)
    total = FIREHOSE_CHUNKS * FIREHOSE_SIZE
    rss_growth = max(out["rss"]) - baseline
    late_rss = [r for (t, _, _), r in zip(out["sent"], out["rss"], strict=True) if t >= 1.0]
    rss_drift = max(late_rss) - min(late_rss)  # flat once the buffers on the way are full
    # second half: once the buffers on the way are full, the upstream moves at the client's pace
    half = [s for s in out["sent"] if s[0] >= SLOW_READ_SECONDS / 2]
    upstream_rate = (half[-1][1] - half[0][1]) / (half[-1][0] - half[0][0])
    client_rate = (half[-1][2] - half[0][2]) / (half[-1][0] - half[0][0])
    in_transit = app.firehose_sent - out["received"]
    # the client went away: the upstream stream is cancelled, nothing stays held
    wait_for(
        lambda: app.aborted == aborted + 1 and app.in_flight == 0,
        "the upstream stream cancelled after the client left",
        SETTLES_WITHIN,
    )
    assert not app.firehose_done
    assert app.firehose_sent < total / 8, app.firehose_sent  # throttled, not drained
    # what the upstream got rid of sits in kernel socket buffers (tcp_rmem/tcp_wmem bound them,
    # autotuned up to tens of MiB), not in the sidecar's memory
    assert in_transit < 48 * 2**20, in_transit
    assert rss_growth < 16 * 2**20, rss_growth
    assert rss_drift < 4 * 2**20, out["rss"]
    if route == "generation":
        wait_for(lambda: ledger_empty(sc), "reservation released", SETTLES_WITHIN)
    figures(
        record_property,
        f"slow_reader_{route}",
        {
            "upstream_could_send_mib": total >> 20,
            "upstream_sent_mib": round(app.firehose_sent / 2**20, 1),
            "client_read_mib": round(out["received"] / 2**20, 2),
            "in_transit_mib": round(in_transit / 2**20, 1),
            "upstream_rate_kib_s_steady": round(upstream_rate / 1024, 1),
            "client_rate_kib_s_steady": round(client_rate / 1024, 1),
            "sidecar_rss_baseline_mib": round(baseline / 2**20, 1),
            "sidecar_rss_growth_mib": round(rss_growth / 2**20, 2),
            "sidecar_rss_drift_after_1s_mib": round(rss_drift / 2**20, 2),
        },
    )


# --- 1,000 concurrent connections, and bodies up to the limit ---------------------------------

CONNECTIONS = 1000
BODY_LIMIT = 1 << 20
BIG_BODIES = 16  # of the 1,000, bodies of exactly BODY_LIMIT bytes
OVER_LIMIT = 4  # more, one byte over the limit (half with Content-Length, half chunked)


def raise_fd_limit(needed: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    # a failure, not a skip: a machine that cannot hold 1,000 connections must say so
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= needed, (
        f"needs {needed} file descriptors; the hard limit is {hard} (raise it: ulimit -Hn)"
    )


def body_of_size(size: int, *, stream: bool) -> bytes:
    """A completion body of exactly ``size`` bytes: a prompt of 64-byte words."""
    word = "abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz0"
    head = {"model": FAKE_MODEL, "max_tokens": 16, "stream": stream, "prompt": ""}
    empty = len(json.dumps(head).encode())
    words, rest = divmod(size - empty, len(word) + 1)
    prompt = (word + " ") * words + "x" * rest
    raw = json.dumps(head | {"prompt": prompt}).encode()
    assert len(raw) == size, (len(raw), size)
    return raw


@dataclass
class Peaks:
    in_flight: int = 0
    fds: int = 0
    rss: int = 0
    unready_samples: int = 0
    samples: int = 0


@pytest.mark.timeout(300)
async def test_thousand_concurrent_connections_and_1mb_bodies(
    model_dir: Path, record_property: Record
) -> None:
    raise_fd_limit(3 * CONNECTIONS + 512)
    # KV room for all of them (this is about connections); 16 tokens: about 5 s each, so that
    # all the connections are open at once
    knobs = {"max_model_len": 32768, "num_gpu_blocks": 200_000, "token_delay": 0.3}
    with FakeProcess(model_dir, **knobs) as fake:
        sc = SidecarProcess(
            fake.url,
            "--max-body-bytes",
            str(BODY_LIMIT),
            "--max-queue-depth",
            "4096",
            "--log-level",
            "warning",
        ).start()
        try:
            assert sc.proc is not None
            pid = sc.proc.pid
            baseline = proc_stats(pid)
            peaks = Peaks()
            sampling = True

            def sample() -> None:
                while sampling:
                    with contextlib.suppress(httpx.HTTPError):
                        peaks.in_flight = max(peaks.in_flight, state(sc)["in_flight"])
                        ready = httpx.get(sc.metrics_url + "/readyz", timeout=10).status_code
                        peaks.samples += 1
                        peaks.unready_samples += ready != 200
                    stats = proc_stats(pid)
                    peaks.fds = max(peaks.fds, stats.fds)
                    peaks.rss = max(peaks.rss, stats.rss_bytes)
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            limits = httpx.Limits(max_connections=CONNECTIONS + 64, max_keepalive_connections=0)
            timeout = httpx.Timeout(120, pool=120)
            async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:

                async def one(i: int) -> tuple[str, int, str]:
                    kind = ("stream", "plain", "chat", "passthrough")[i % 4]
                    try:
                        if i < BIG_BODIES:
                            kind = "big"
                            raw = body_of_size(BODY_LIMIT, stream=i % 2 == 0)
                            resp = await client.post(sc.url + "/v1/completions", content=raw)
                        elif kind == "stream":
                            body = {"model": FAKE_MODEL, "prompt": f"req {i}", "max_tokens": 16}
                            async with client.stream(
                                "POST", sc.url + "/v1/completions", json=body | {"stream": True}
                            ) as resp:
                                text = (await resp.aread()).decode()
                            done = resp.status_code != 200 or text.endswith("data: [DONE]\n\n")
                            return kind, resp.status_code, "" if done else "no [DONE]"
                        elif kind == "plain":
                            body = {"model": FAKE_MODEL, "prompt": f"req {i}", "max_tokens": 16}
                            resp = await client.post(sc.url + "/v1/completions", json=body)
                        elif kind == "chat":
                            messages = [{"role": "user", "content": f"req {i}"}]
                            body = {"model": FAKE_MODEL, "messages": messages, "max_tokens": 16}
                            resp = await client.post(sc.url + "/v1/chat/completions", json=body)
                        else:
                            resp = await client.get(sc.url + "/slow?chunks=20&delay=0.25&size=256")
                        return kind, resp.status_code, ""
                    except httpx.HTTPError as exc:
                        return kind, 0, f"{type(exc).__name__}: {exc}"

                async def over(i: int) -> tuple[str, int, str]:
                    raw = body_of_size(BODY_LIMIT + 1, stream=False)

                    async def chunks() -> Any:
                        for k in range(0, len(raw), 65536):
                            yield raw[k : k + 65536]

                    content: Any = raw if i % 2 else chunks()
                    try:
                        resp = await client.post(sc.url + "/v1/completions", content=content)
                    except httpx.HTTPError as exc:
                        return "over", 0, f"{type(exc).__name__}: {exc}"
                    code = resp.json()["error"]["code"] if resp.status_code == 413 else resp.text
                    return "over", resp.status_code, "" if code == "body_too_large" else code

                t0 = time.monotonic()
                results = await asyncio.gather(
                    *(one(i) for i in range(CONNECTIONS)), *(over(i) for i in range(OVER_LIMIT))
                )
                elapsed = time.monotonic() - t0
            sampling = False
            sampler.join(5)
            await asyncio.to_thread(
                wait_for, lambda: ledger_empty(sc), "ledger empty after the burst", 30
            )
            # pooled upstream connections expire (2 s keep-alive) and close at the next use
            await asyncio.to_thread(
                wait_for, lambda: proc_stats(pid).fds <= baseline.fds + 8, "sockets closed", 20, 0.2
            )
            after = proc_stats(pid)
            assert sc.proc.poll() is None
            upstream = fake.stats()
        finally:
            sc.stop()
    log = sc.log()
    statuses: dict[str, dict[int, int]] = {}
    for kind, status, _ in results:
        statuses.setdefault(kind, {}).setdefault(status, 0)
        statuses[kind][status] += 1
    failures = [r for r in results if r[2] or (r[1] != 200 and r[0] != "over")]
    assert not failures, (statuses, failures[:5])
    assert statuses["over"] == {413: OVER_LIMIT}, statuses
    assert statuses["big"] == {200: BIG_BODIES}, statuses
    # forwarded whole: the streamed half with the sidecar's ask for the usage spliced in
    # (sidecar.http.stream_usage: their clients sent no stream_options; what it asks for
    # depends on the reservation mode, the suite's from the environment: tests/conftest.py)
    mode = ReservationMode(os.environ.get("KV_SIDECAR_RESERVATION", "adaptive"))
    grown = len(stream_usage_asked(StreamUsage.auto, mode) or b"")
    sizes = upstream["generation_body_sizes"]
    assert sizes.count(BODY_LIMIT) == BIG_BODIES // 2, sorted(sizes)[-BIG_BODIES:]
    assert sizes.count(BODY_LIMIT + grown) == BIG_BODIES // 2, [n for n in sizes if n > 1000]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    # really concurrent: a socket per client connection, and most generations admitted at once
    assert peaks.fds >= baseline.fds + CONNECTIONS, peaks
    assert peaks.in_flight >= CONNECTIONS // 2, peaks
    assert after.fds <= baseline.fds + 8, (baseline, after)
    figures(
        record_property,
        "thousand_connections",
        {
            "connections": CONNECTIONS + OVER_LIMIT,
            "statuses": {k: {str(s): n for s, n in v.items()} for k, v in statuses.items()},
            "seconds": round(elapsed, 1),
            "peak_in_flight_at_sidecar": peaks.in_flight,
            "readyz_503_samples": f"{peaks.unready_samples}/{peaks.samples}",
            "peak_concurrent_at_upstream": upstream["peak_in_flight"],
            "sidecar_fds_baseline_peak_after": [baseline.fds, peaks.fds, after.fds],
            "sidecar_rss_mib_baseline_peak_after": [
                round(baseline.rss_bytes / 2**20, 1),
                round(peaks.rss / 2**20, 1),
                round(after.rss_bytes / 2**20, 1),
            ],
        },
    )


# --- SIGTERM: the gap next to tests/test_lifecycle.py -----------------------------------------


def test_sigterm_lets_pass_through_requests_finish(fake: FakeServer) -> None:
    """test_lifecycle.py drains generation; the other paths vLLM serves must not be cut either."""
    with SidecarProcess(fake.url, "--drain-timeout", "30") as sc:
        assert sc.proc is not None
        outcome: list[Any] = []

        def slow_read() -> None:  # 12 chunks, 0.5 s apart: about 6 s
            try:
                resp = httpx.get(sc.url + "/slow?chunks=12&delay=0.5&size=100", timeout=30)
                outcome.append((resp.status_code, len(resp.content)))
            except httpx.HTTPError as exc:
                outcome.append(f"{type(exc).__name__}: {exc}")

        reader = threading.Thread(target=slow_read)
        reader.start()
        wait_for(lambda: fake.app.in_flight == 1, "the pass-through started", SETTLES_WITHIN)
        sc.proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert outcome == [(200, 1200)], outcome
        assert sc.proc.wait(30) == 0
