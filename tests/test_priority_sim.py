"""The sidecar's priority reaches vLLM's own priority scheduler (``--forward-priority``), on the
simulated GPU engine stepped by hand: vLLM's real scheduler started with ``--scheduling-policy
priority`` and ``--max-num-seqs 1`` runs one request at a time, so the order the answers end in
is the order vLLM scheduled them.

Request A (priority 10 by its ``x-kv-sidecar-priority`` header) runs; C (priority 10) reaches
vLLM's waiting queue, then B (priority 0). The sidecar admits all three at once (its budget holds
them), so what orders B and C is vLLM alone: with ``--forward-priority`` the sidecar writes each
header's priority into the body and vLLM runs B before C, which came first; without it vLLM sees
priority 0 for all three and runs them first come first served (A, C, B). Each arrival is
confirmed in vLLM's own ``vllm:num_requests_waiting`` before the next is sent, and the engine
steps only when the test grants a step, so nothing depends on timing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from harness.sim_server import SimServer
from harness.workload import SidecarProcess
from tests.support.sim import metrics
from tests.support.stepped import held
from tests.support.wait import wait_for

pytestmark = pytest.mark.vllm

WITHIN = 30.0
MAX_TOKENS = 8
RUNNING_TOKENS = 120  # A's: far more steps than C's and B's arrivals take


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    server = SimServer(
        model="llama-3.1-8b-instruct",
        gpu="h100-80gb",
        max_model_len=4096,
        extra_args=[
            "--num-gpu-blocks-override",
            "1032",
            "--scheduling-policy",
            "priority",
            "--max-num-seqs",
            "1",
        ],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Sent:
    """Non-streamed completions sent from threads; the order their answers ended in."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.ended: list[str] = []
        self.statuses: dict[str, int] = {}
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def send(self, name: str, priority: int, max_tokens: int = MAX_TOKENS) -> None:
        def run() -> None:
            resp = httpx.post(
                self.url + "/v1/completions",
                json={
                    "model": self.model,
                    "prompt": f"{name}: " + "tell me about the sea " * 8,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                },
                headers={"x-kv-sidecar-priority": str(priority)},
                timeout=120,
            )
            with self.lock:
                self.statuses[name] = resp.status_code
                self.ended.append(name)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)


def waiting_in_vllm(sim: SimServer) -> float:
    return metrics(sim).get("vllm:num_requests_waiting", 0.0)


def step_until(sim: SimServer, done: object, what: str) -> None:
    """Grant steps one at a time until ``done()`` holds."""
    for _ in range(300):
        if done():  # type: ignore[operator]
            return
        try:
            sim.wait_waiting(timeout=0.5)
        except TimeoutError:
            continue  # no batch scheduled yet (a request on its way in)
        sim.step(1)
    raise AssertionError(f"{what}: not within 300 tries")


@pytest.mark.parametrize(("forward", "order"), [(True, ["A", "B", "C"]), (False, ["A", "C", "B"])])
def test_the_sidecars_priority_orders_vllms_own_scheduler(
    sim: SimServer, forward: bool, order: list[str]
) -> None:
    args = ["--headroom", "0", "--scrape-interval", "0.1"]
    if forward:
        args.append("--forward-priority")
    with SidecarProcess(sim.url, *args) as sc, held(sim):
        sent = Sent(sc.url, sim.served_name)
        sent.send("A", 10, max_tokens=RUNNING_TOKENS)  # runs while C and B arrive
        sim.wait_waiting(timeout=WITHIN)  # A's prefill, held for its grant
        sim.step(1)
        sent.send("C", 10)
        step_until(sim, lambda: waiting_in_vllm(sim) >= 1, "C waiting in vLLM")
        sent.send("B", 0)
        step_until(sim, lambda: waiting_in_vllm(sim) >= 2, "B waiting in vLLM")
        step_until(sim, lambda: len(sent.ended) == 3, "every answer")
        for thread in sent.threads:
            thread.join(WITHIN)
        wait_for(lambda: sc.state()["in_flight"] == 0, "the ledger empty", within=WITHIN)
    assert sent.statuses == {"A": 200, "B": 200, "C": 200}
    assert sent.ended == order
