"""Admission against vLLM's own scheduler on the simulated GPU, stepped by hand: the prediction
set against vLLM's KV usage at every step (streamed answers sharing a prefix, non-streamed
answers, a queued burst over the pool), answers at different stages admitted by their future
peak, and the autoscaling signal of a 3x overload read by a real Prometheus while the engine is
held.

These were sampled from the free-running CPU vLLM (tests/test_admission_vllm.py; the burst
also runs there in tests/test_proxy_vllm.py; the overload ran in tests/test_autoscaling.py, removed
once the held overload here asserted all it did), where a loaded machine left too few samples, or
samples taken while an answer ended between vLLM's step and the sidecar's release. Here the
engine runs a step only when the test grants it (``harness.sim_server``, manual mode): after
each step the test waits until vLLM's /metrics show it, the clients have received what it
produced and the sidecar has taken a scrape after that; the engine is still, so the sidecar's
/state then sets its ledger against vLLM's usage at one instant, exactly.

One simulated server per module: Llama-3.1-8B's config on an H100 80 GB, 512 blocks of 16 tokens
(``--num-gpu-blocks-override``), a 2,048-token context, prefix caching on. Answers' lengths ride
in ``vllm_xargs`` (``sim_output_tokens``), which the sidecar never reads; every sidecar runs in
worst-case mode (tests/conftest.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.sim_server import SimServer
from harness.workload import SidecarProcess, make_prompts
from tests.support.autoscalers import keda_desired, rendered
from tests.support.prometheus_server import PrometheusServer, ScrapeJob
from tests.support.sim import cache_config, metrics, sim_8b, wait_idle
from tests.support.stepped import (
    Clients,
    Stepper,
    admitted,
    assert_predicted_at_every_step,
    held,
    streamed,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.vllm

BLOCKS = 512
MAX_MODEL_LEN = 2048
HEADROOM = 0.05
#: how often every sidecar here scrapes vLLM: a scrape after each step comes quickly
SCRAPE_INTERVAL = "0.05"
#: seconds any one wait may take (a step is seen everywhere in well under a second): a deadline
#: for a loaded machine, not a measurement
WITHIN = 30.0


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with sim_8b(MAX_MODEL_LEN, BLOCKS, "--enable-prefix-caching") as server:
        yield server


# --- vLLM's side ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def block(sim: SimServer) -> int:
    labels = cache_config(sim)
    assert labels["num_gpu_blocks"] == str(BLOCKS)
    return int(labels["block_size"])


def preemptions(sim: SimServer) -> float:
    return metrics(sim).get("vllm:num_preemptions_total", 0)


def queue_sidecar(sim: SimServer, *args: str) -> SidecarProcess:
    return SidecarProcess(
        sim.url,
        "--policy",
        "queue",
        "--scrape-interval",
        SCRAPE_INTERVAL,
        "--headroom",
        str(HEADROOM),
        "--model-config",
        str(sim.model_dir),
        *args,
    )


# --- prediction at every step -----------------------------------------------------------------


def common_prefix_tokens(sim: SimServer, a: list[dict[str, str]], b: list[dict[str, str]]) -> int:
    def ids(messages: list[dict[str, str]]) -> list[int]:
        body = {"model": sim.served_name, "messages": messages}
        return list(httpx.post(sim.url + "/tokenize", json=body, timeout=10).json()["tokens"])

    n = 0
    for x, y in zip(ids(a), ids(b), strict=False):
        if x != y:
            break
        n += 1
    return n


def test_a_shared_prefix_is_counted_once_and_predicted_at_every_step(
    sim: SimServer, block: int
) -> None:
    """Six streamed chats with one 700-token system prompt and their own question, 40 tokens
    each. vLLM holds the prefix's full blocks once (its prefix cache), and so does the sidecar:
    at every one of the 40 steps its prediction is vLLM's usage to within a block per request
    in flight, and the reservations' future peak is below their sum of peaks by the shared
    blocks of the five other chats."""
    (system,) = make_prompts(sim.model_dir, 1, 700, seed=3)
    questions = make_prompts(sim.model_dir, 6, 20, seed=5)
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions
    ]
    shared = common_prefix_tokens(sim, conversations[0], conversations[1]) // block
    assert shared >= 40, shared  # the premise: most of the prompt is one prefix
    length = 40
    bodies = [
        streamed(
            {
                "model": sim.served_name,
                "messages": c,
                "max_tokens": 280,
                "vllm_xargs": {"sim_output_tokens": length},
            }
        )
        for c in conversations
    ]
    # vLLM's prefix cache holds the system prompt first, as after earlier traffic
    warm = Clients(
        sim.url,
        "/v1/chat/completions",
        [dict(b, vllm_xargs={"sim_output_tokens": 1}) for b in bodies],
    ).start()
    warm.stop()
    assert [a.status for a in warm.answers] == [200] * 6, warm.errors
    wait_idle(sim)
    before = preemptions(sim)
    samples: list[dict[str, Any]] = []
    with queue_sidecar(sim) as sc, held(sim):
        clients = Clients(sc.url, "/v1/chat/completions", bodies)
        stepper = Stepper(sim, sc, clients)
        clients.start()
        admitted(sc, 6)
        sim.wait_waiting()
        while clients.open:
            # the first request may reach vLLM a step before the others
            assert len(samples) < 2 * length, [a.tokens for a in clients.answers]
            samples.append(stepper.step())
        clients.stop()
        assert sc.state()["reserved_blocks"] == 0
    assert not clients.errors, clients.errors
    assert [(a.status, a.tokens) for a in clients.answers] == [(200, length)] * 6
    assert preemptions(sim) == before
    assert_predicted_at_every_step(samples)
    running = [s for s in samples if s["vllm_running"] == 6]
    assert running  # the six ran together
    # vLLM holds the prefix once: less than twice its blocks while six chats run
    assert max(s["vllm_blocks"] for s in running) < 2 * shared
    # and so does the ledger: the future peak is below the sum of peaks by the prefix's full
    # blocks of each of the five chats that do not hold it
    assert all(s["reserved_blocks"] - s["future_peak_blocks"] >= 5 * shared for s in running), [
        (s["reserved_blocks"], s["future_peak_blocks"], s["shared_blocks"]) for s in running
    ]


def test_non_streamed_answers_are_predicted_at_every_step(sim: SimServer, block: int) -> None:
    """Non-streamed answers show nothing until they end: the sidecar estimates their progress
    from vLLM's generation counter. Six completions of 150 prompt tokens and 48 output tokens
    (max_tokens 450): at every step its prediction is vLLM's usage to within a block per
    request, as for streamed answers."""
    prompts = make_prompts(sim.model_dir, 6, 150, seed=21)
    length = 48
    bodies = [
        {
            "model": sim.served_name,
            "prompt": p,
            "max_tokens": 450,
            "vllm_xargs": {"sim_output_tokens": length},
        }
        for p in prompts
    ]
    before = preemptions(sim)
    samples: list[dict[str, Any]] = []
    with queue_sidecar(sim) as sc, held(sim):
        clients = Clients(sc.url, "/v1/completions", bodies)
        stepper = Stepper(sim, sc, clients)
        clients.start()
        admitted(sc, 6)
        sim.wait_waiting()
        while clients.open:
            assert len(samples) < 2 * length, [a.tokens for a in clients.answers]
            samples.append(stepper.step(count_clients=False))
        clients.stop()
        assert sc.state()["reserved_blocks"] == 0
    assert not clients.errors, clients.errors
    assert [(a.status, a.tokens) for a in clients.answers] == [(200, length)] * 6
    assert preemptions(sim) == before
    # the premise: vLLM's usage grew while the answers ran (the prompt alone is 10 blocks each)
    assert len({s["vllm_blocks"] for s in samples if s["vllm_running"] == 6}) >= 3
    assert_predicted_at_every_step(samples)


# --- admission by the future peak -------------------------------------------------------------


def test_long_answers_at_different_stages_are_admitted_by_their_future_peak(
    sim: SimServer, block: int
) -> None:
    """Eight running answers of 100 prompt tokens and 900, 900, 800, 800, 700, 700, 600, 600
    output tokens and a ninth of 100 + 900, through --policy reject: the sum of their peaks is
    over the budget, their future peak is not, since they do not all peak at once. The ninth is
    admitted, and vLLM never preempts while all nine run to their ends."""
    prompts = make_prompts(sim.model_dir, 9, 100, seed=11)
    lengths = [900, 900, 800, 800, 700, 700, 600, 600, 900]

    def body(prompt: str, max_tokens: int) -> dict[str, Any]:
        return streamed(
            {
                "model": sim.served_name,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,  # the simulation then runs it to max_tokens
            }
        )

    peaks = [math.ceil((100 + n) / block) for n in lengths]
    budget = math.floor((BLOCKS - 1) * (1 - HEADROOM))
    assert sum(peaks[:8]) <= budget < sum(peaks)  # the premise: only the future peak admits it
    before = preemptions(sim)
    args = ["--policy", "reject", "--headroom", str(HEADROOM), "--model-config", str(sim.model_dir)]
    with SidecarProcess(sim.url, *args, "--scrape-interval", SCRAPE_INTERVAL) as sc:
        clients = Clients(
            sc.url,
            "/v1/completions",
            [body(p, n) for p, n in zip(prompts[:8], lengths[:8], strict=True)],
        )
        with held(sim):
            stepper = Stepper(sim, sc, clients)
            clients.start()
            admitted(sc, 8)
            # every one of the eight past its prefill, early in its answer
            while any(a.tokens == 0 for a in clients.answers):
                assert stepper.sampled < 100, [a.tokens for a in clients.answers]
                stepper.step()
            ninth = clients.send(body(prompts[8], lengths[8]))
            state = admitted(sc, 9)
            assert ninth.status in (None, 200), ninth.status  # not refused
            assert state["budget_blocks"] == budget
            assert state["reserved_blocks"] == sum(peaks) > budget, state
            assert state["future_peak_blocks"] <= budget, state
        sim.set_mode("0.001")  # the rest at a fixed 1 ms a step: ~900 steps take seconds
        try:
            clients.stop(timeout=300)
        finally:
            sim.set_mode("roofline")
    assert not clients.errors, clients.errors
    assert [(a.status, a.tokens) for a in clients.answers] == [(200, n) for n in lengths], (
        clients.answers
    )
    assert preemptions(sim) == before


# --- the autoscaling signal -------------------------------------------------------------------

NAMESPACE = "default"  # what the shipped KEDA queries match
POD = "llm-7d9c5b8f4-x2x7q"  # a Deployment pod's name, which the queries match as llm-.+
CONTAINER = "kv-sidecar"
#: the overload, in units of the pod's admission budget (capacity x (1 - headroom))
OVERLOAD = 3.0


def test_a_three_fold_overload_asks_for_four_pods_at_once(
    sim: SimServer, block: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Requests whose projected peaks add up to three times the pod's admission budget, sent
    through a queue sidecar with the engine held: a third of them run, the rest wait. A real
    Prometheus scrapes the sidecar with a pod's labels and runs the shipped autoscalers'
    queries (read from the rendered overlays). Before the first step and after 20 steps (the
    running answers started and growing), KEDA's metric is the offered demand in budgets,
    exactly, and asks for ceil(3 / 0.8) = 4 replicas from one; the HPA overlay's per-pod metric
    and target ask for the same 4; the old kv_sidecar_oom_risk_ratio, which leaves the queue
    out, asks for at most 2."""
    scalers = rendered()
    prompt_tokens, max_tokens = 64, 896
    peak = math.ceil((prompt_tokens + max_tokens) / block)
    budget = math.floor((BLOCKS - 1) * (1 - HEADROOM))
    clients_count = round(OVERLOAD * budget / peak)
    offered = clients_count * peak / budget
    assert abs(offered - OVERLOAD) <= peak / budget  # to within one request
    promised = math.ceil(OVERLOAD / scalers.keda_threshold)
    assert promised == 4 <= scalers.keda_max
    prompts = make_prompts(sim.model_dir, clients_count, prompt_tokens, seed=23)
    bodies = [
        {"model": sim.served_name, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True}
        for p in prompts
    ]
    selector = f'{{namespace="{NAMESPACE}", container="{CONTAINER}"}}'
    queue = ["--max-queue-depth", str(4 * clients_count), "--max-queue-wait", "120"]
    with queue_sidecar(sim, *queue) as sc:
        job = ScrapeJob(
            "kv-sidecar",
            f"127.0.0.1:{sc.metrics_port}",
            {"namespace": NAMESPACE, "pod": POD, "container": CONTAINER},
        )
        with PrometheusServer(tmp_path_factory.mktemp("prometheus"), [job]) as prometheus:
            prometheus.wait_for_targets_up()
            clients = Clients(sc.url, "/v1/completions", bodies)
            with held(sim):
                stepper = Stepper(sim, sc, clients)
                clients.start()
                admitted(sc, clients_count)
                sim.wait_waiting()
                seen = []
                for steps in (0, 20):
                    state = (
                        stepper.step(steps, count_clients=False)
                        if steps
                        else stepper.sample(count_clients=False)
                    )
                    ready = time.time()

                    def scraped_after(ready: float = ready) -> bool:
                        expr = f"timestamp(kv_sidecar_kv_demand_ratio{selector})"
                        return any(s.value >= ready for s in prometheus.query(expr))

                    wait_for(scraped_after, "a Prometheus scrape after the step", within=WITHIN)
                    keda = [s.value for s in prometheus.query(scalers.keda_query)]
                    hpa = [
                        s.value
                        for s in prometheus.query(f"max({scalers.hpa_metric}{selector}) by (pod)")
                    ]
                    old = [
                        s.value
                        for s in prometheus.query(f"sum(kv_sidecar_oom_risk_ratio{selector})")
                    ]
                    seen.append((steps, state, keda, hpa, old))
                clients.cancel()  # the clients leave; vLLM aborts what it holds
            wait_for(lambda: sc.state()["reserved_blocks"] == 0, "the ledger emptied", within=60)
    wait_idle(sim)
    for steps, state, keda, hpa, old in seen:
        # a third runs (as many as the budget holds), the rest waits in the sidecar's queue
        assert state["in_flight"] == budget // peak, (steps, state)
        assert state["queue_depth"] == clients_count - budget // peak, (steps, state)
        # the metric is the demand: every client's request, running or waiting
        assert keda == [pytest.approx(offered)], (steps, keda, state)
        desired = keda_desired(keda[0], scalers.keda_threshold, scalers.keda_metric_type, 1)
        assert desired == promised, (steps, keda)
        (per_pod,) = hpa
        assert math.ceil(per_pod / scalers.hpa_target) == math.ceil(OVERLOAD / scalers.hpa_target)
        assert math.ceil(OVERLOAD / scalers.hpa_target) == 4
        (old_value,) = old
        assert math.ceil(old_value / scalers.keda_threshold) <= 2, (steps, old)
    assert seen[1][1]["vllm_blocks"] > 0  # after 20 steps the running answers hold their KV


# --- the queue policy under a burst over the pool -----------------------------------------------

#: the burst's demand over vLLM's pool: enough that vLLM alone preempts
OVERSUBSCRIBED = 2.5
#: the burst is sampled every this many steps (each one asserted): ~90 samples of ~900 steps
SAMPLE_EVERY = 10


def test_queue_policy_burst_has_no_preemptions(sim: SimServer, block: int) -> None:
    """2.5 pools' worth of KV at once (36 x (271 + 300) tokens on 511 blocks of 16) makes vLLM
    preempt when sent directly. Through --policy queue nothing is preempted, every answer
    completes, and every tenth step the sidecar's prediction is vLLM's usage to within a block
    per request in flight, with the future peak of what it admitted within the budget. Each
    step waits until its tokens reached the clients, so every event carries one token (vLLM
    merges the tokens of a stream whose reader lags into one event, which the sidecar counts
    as one: not what this test measures)."""
    prompt_tokens, max_tokens = 271, 300
    peak = math.ceil((prompt_tokens + max_tokens) / block)
    count = math.ceil(OVERSUBSCRIBED * (BLOCKS - 1) / peak)
    budget = math.floor((BLOCKS - 1) * (1 - HEADROOM))
    prompts = make_prompts(sim.model_dir, count, prompt_tokens, seed=7)
    bodies = [
        streamed(
            {"model": sim.served_name, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True}
        )
        for p in prompts
    ]

    # the premise: straight to vLLM, held until all are inside it, then at 1 ms a step
    before = preemptions(sim)
    direct = Clients(sim.url, "/v1/completions", list(bodies))
    with held(sim):
        direct.start()

        def inside() -> bool:
            m = metrics(sim)
            if sim.state()["waiting"]:
                sim.step(1)  # the engine takes in what arrived, one step at a time
            in_engine = m.get("vllm:num_requests_running", 0) + m.get(
                "vllm:num_requests_waiting", 0
            )
            return bool(in_engine >= count)

        wait_for(inside, f"{count} requests inside vLLM", within=60)
        sim.set_mode("0.001")
        direct.stop(timeout=300)
    assert [(a.status, a.tokens) for a in direct.answers] == [(200, max_tokens)] * count
    assert preemptions(sim) > before

    wait_idle(sim)
    before = preemptions(sim)
    samples: list[dict[str, Any]] = []
    with queue_sidecar(sim, "--max-queue-wait", "600") as sc, held(sim):
        clients = Clients(sc.url, "/v1/completions", list(bodies))
        stepper = Stepper(sim, sc, clients)
        clients.start()
        admitted(sc, count)
        sim.wait_waiting()
        while clients.open:
            assert stepper.sampled <= count * max_tokens, [a.tokens for a in clients.answers]
            samples.append(stepper.step(SAMPLE_EVERY))
        clients.stop()
        assert sc.state()["reserved_blocks"] == 0
    assert not clients.errors, clients.errors
    assert [(a.status, a.tokens) for a in clients.answers] == [(200, max_tokens)] * count
    assert preemptions(sim) == before
    assert_predicted_at_every_step(samples)
    assert all(s["future_peak_blocks"] <= budget for s in samples), [
        s["future_peak_blocks"] for s in samples
    ]
    # the burst did fill the budget, and queued: more than one wave ran
    assert max(s["actual_blocks"] for s in samples) > budget // 2
    assert max(s["queue_depth"] for s in samples) > 0
    assert len(samples) * SAMPLE_EVERY >= 2 * max_tokens
