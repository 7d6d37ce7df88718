"""Clients on a loop of their own and an engine stepped by hand: what the tests on the simulated
vLLM (``harness.sim_server``, manual mode) share. :class:`Clients` sends requests from a thread,
so that a test can grant engine steps while they wait; :class:`Stepper` grants steps and waits
until vLLM, the clients and the sidecar's scrape all show them; :func:`held` holds the engine;
:func:`admitted` waits until the sidecar has decided a number of requests. For the real CPU vLLM
(the session server), :func:`frozen_engine` stops its engine so that a test can read the
sidecar's decisions on a burst before a single token is made, however fast the host decodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from harness.sim_server import SimServer
from harness.vllm_info import Server, VllmInfo
from harness.workload import SidecarProcess
from tests.support.external import unless_external
from tests.support.sim import cache_config, metrics
from tests.support.wait import wait_for

#: seconds any one condition here may take
WITHIN = 30.0


# --- clients on a loop of their own -----------------------------------------------------------


@dataclass
class Answer:
    tokens: int = 0  # completion tokens received so far (vLLM's continuous usage, or the body's)
    status: int | None = None
    done: bool = False
    finish_reason: str | None = None


@dataclass
class Clients:
    """Requests sent from a thread with its own event loop, so that the test can step the engine
    while they wait; streamed ones carry vLLM's continuous usage, so the test knows how many
    tokens each client has received."""

    url: str
    path: str
    bodies: list[dict[str, Any]]
    answers: list[Answer] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def send(self, body: dict[str, Any]) -> Answer:
        """One more request, once started."""
        answer = Answer()
        self.answers.append(answer)
        self.bodies.append(body)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._spawn, body, answer)
        return answer

    def start(self) -> Clients:
        ready = threading.Event()
        self.answers = [Answer() for _ in self.bodies]

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._client = httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=200))
            for body, answer in zip(self.bodies, self.answers, strict=True):
                self._spawn(body, answer)
            ready.set()
            while True:  # until stop(): requests added later join the loop
                await asyncio.sleep(0.05)
                if self._stopping and all(t.done() for t in self._tasks):
                    break
            await self._client.aclose()

        self._stopping = False
        self._thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        self._thread.start()
        assert ready.wait(30)
        return self

    def _spawn(self, body: dict[str, Any], answer: Answer) -> None:
        self._tasks.append(asyncio.ensure_future(self._one(body, answer)))

    async def _one(self, body: dict[str, Any], answer: Answer) -> None:
        try:
            if not body.get("stream"):
                resp = await self._client.post(self.url + self.path, json=body)
                answer.status = resp.status_code
                if resp.status_code == 200:
                    data = resp.json()
                    answer.tokens = data["usage"]["completion_tokens"]
                    answer.finish_reason = data["choices"][0]["finish_reason"]
                return
            async with self._client.stream("POST", self.url + self.path, json=body) as resp:
                answer.status = resp.status_code
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage")
                    if usage:
                        answer.tokens = max(answer.tokens, usage["completion_tokens"])
                    for choice in chunk.get("choices") or []:
                        answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)
        finally:
            answer.done = True

    def stop(self, timeout: float = 120.0) -> None:
        """Wait for every answer (``cancel``: leave them instead), then end the loop."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join(timeout)
            assert not self._thread.is_alive(), "the clients did not finish"

    def cancel(self) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(lambda: [t.cancel() for t in self._tasks])
        self.stop()

    @property
    def received(self) -> int:
        return sum(a.tokens for a in self.answers)

    @property
    def open(self) -> int:
        return sum(not a.done for a in self.answers)


def streamed(body: dict[str, Any]) -> dict[str, Any]:
    return {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


# --- the engine held, stepped one step at a time ------------------------------------------------


class Stepper:
    """Grants steps and waits until vLLM, the clients and the sidecar's scrape all show them."""

    def __init__(self, sim: SimServer, sc: SidecarProcess, clients: Clients) -> None:
        self.sim = sim
        self.sc = sc
        self.clients = clients
        # vLLM's pool less the null block, as the sidecar counts it
        self.usable_blocks = int(cache_config(sim)["num_gpu_blocks"]) - 1
        self.base_generated = metrics(sim).get("vllm:generation_tokens_total", 0)
        self.sampled = 0  # tokens the granted steps sampled

    def step(self, n: int = 1, *, count_clients: bool = True) -> dict[str, Any]:
        """``n`` steps; then the sidecar's /state from a scrape taken after they are seen
        everywhere, with vLLM's own figures at that instant (``vllm_blocks``, ``vllm_running``)."""
        for _ in range(n):
            # a batch waits for its grant, unless every answer has ended (or vLLM has none
            # until the sidecar forwards the requests it admits as others end)
            wait_for(
                lambda: self.clients.open == 0 or self.sim.state()["waiting"],
                "a batch waiting for its step",
                within=WITHIN,
            )
            if not self.sim.state()["waiting"]:
                break
            last = self.sim.step(1)["last_step"]
            self.sampled += last["sampled"] if last else 0
            if count_clients:  # one token per event: vLLM coalesces tokens a client lags on
                self._relayed()
        return self.sample(count_clients=count_clients)

    def _relayed(self) -> None:
        wait_for(
            lambda: self.clients.received == self.sampled,
            f"clients received {self.sampled} tokens ({self.clients.received})",
            within=WITHIN,
        )

    def sample(self, *, count_clients: bool = True) -> dict[str, Any]:
        total = self.base_generated + self.sampled
        wait_for(
            lambda: metrics(self.sim).get("vllm:generation_tokens_total", 0) >= total,
            f"vLLM's generation counter at {total}",
            within=WITHIN,
        )
        if count_clients:  # streamed answers: every token relayed through the sidecar
            self._relayed()

        def settled() -> bool:
            state = self.sc.state()
            return bool(state["in_flight"] + state["queue_depth"] == self.clients.open)

        wait_for(settled, "the sidecar's ledger holds the open requests", within=WITHIN)
        ready = time.monotonic()
        while True:
            sent = time.monotonic()
            state = self.sc.state()
            age = state["snapshot_age"]
            # the sidecar read its clock after ``sent``: its snapshot was taken at least this late
            if age is not None and sent - age >= ready:
                break
            assert time.monotonic() < ready + 30, f"no scrape after the step: {state}"
            time.sleep(0.01)
        m = metrics(self.sim)
        assert m["vllm:generation_tokens_total"] == total  # the engine is held: nothing moved
        return {
            **state,
            "vllm_blocks": round(m["vllm:kv_cache_usage_perc"] * self.usable_blocks),
            "vllm_running": m.get("vllm:num_requests_running", 0),
        }


@contextlib.contextmanager
def held(sim: SimServer) -> Iterator[None]:
    """The engine in manual mode: it runs a step only when the test grants one."""
    sim.set_mode("manual")
    try:
        yield
    finally:
        sim.set_mode("roofline")


def admitted(sc: SidecarProcess, count: int) -> dict[str, Any]:
    state: dict[str, Any] = {}

    def decided() -> bool:
        nonlocal state
        state = sc.state()
        return bool(state["in_flight"] + state["queue_depth"] >= count)

    wait_for(decided, f"{count} requests decided", within=60)
    return state


# --- the real vLLM's engine stopped -----------------------------------------------------------


@contextlib.contextmanager
def frozen_engine(vllm: VllmInfo | Server) -> Iterator[None]:
    """The harness's real vLLM with its engine core and worker stopped for the block (SIGSTOP to
    its process group, then SIGCONT to the API server alone, the group's leader; SIGCONT to the
    group at the end): the API server takes requests, renders their prompts and answers
    ``/metrics``, and no step runs, so no request vLLM was sent can start or end until the block
    ends. What a sidecar decides on a burst sent meanwhile is what it decides on the burst
    arriving at once, on any host. The test must not wait inside the block on anything that
    needs a token."""
    server = vllm.server if isinstance(vllm, VllmInfo) else vllm
    proc = server.proc if server is not None else None
    if proc is None:
        unless_external("stops its vLLM's engine with SIGSTOP: not an external vLLM")
    os.killpg(proc.pid, signal.SIGSTOP)
    os.kill(proc.pid, signal.SIGCONT)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGCONT)


def assert_predicted_at_every_step(samples: list[dict[str, Any]]) -> None:
    """At every step the sidecar read vLLM's usage as vLLM reported it, and its ledger at that
    scrape predicted it to within a block per request in flight, never below it (the ledger
    counts the token just sampled, whose KV vLLM writes at the next step: a block more when that
    token opens one), and exactly at most steps."""
    assert samples
    assert [s["actual_blocks"] for s in samples] == [s["vllm_blocks"] for s in samples]
    errors = [s["predicted_at_snapshot_blocks"] - s["actual_blocks"] for s in samples]
    table = [
        (s["in_flight_at_snapshot"], s["predicted_at_snapshot_blocks"], s["actual_blocks"])
        for s in samples
    ]
    assert all(
        0 <= e <= s["in_flight_at_snapshot"] for e, s in zip(errors, samples, strict=True)
    ), table
    assert statistics.median(errors) == 0, table
    assert any(s["actual_blocks"] != samples[0]["actual_blocks"] for s in samples), table
