"""The autoscaling claim, end to end: a 3x overload of one pod asks for 4 pods at once.

A real sidecar (``--policy queue``) in front of the session's real vLLM takes a closed-loop load
whose requests' projected KV peaks add up to three times the pod's admission budget: about a third
of it runs, the rest waits in the sidecar's queue. A real Prometheus scrapes the sidecar's metrics
port with the labels a pod scrape adds, and the test runs the queries the shipped autoscalers run
(read from ``kubectl kustomize deploy/overlays/autoscaling-keda`` and ``.../autoscaling-hpa``)
through Prometheus's HTTP API, then applies the HPA's formula for their AverageValue targets.

KEDA's Prometheus trigger with ``metricType: AverageValue`` hands the HPA an External metric whose
desired replica count is ``ceil(metric / threshold)``, "regardless of the current replica count"
(KEDA's ScaledObject reference, kedacore/keda-docs content/docs/2.15/reference/scaledobject-spec.md
at 5e415a6, section triggers / metricType; ``Value`` would give ``ceil(current * metric /
threshold)``, the same with the one replica here). The HPA overlay's ``Pods`` metric with an
``averageValue`` target aims for ``ceil(sum over pods / target)``: with one pod, the same number.

deploy/README.md promises: demand of k pods' budgets asks for ``ceil(k / 0.8)`` pods, 4 for k = 3.
The old signal, ``kv_sidecar_oom_risk_ratio``, leaves the queue out and asks for at most 2 here.

KEDA's count (the metric against the clients' demand, and the 4 it asks for) and the HPA
overlay's are asserted on vLLM's own scheduler with a simulated GPU, held still while Prometheus
scrapes (tests/test_admission_sim.py::test_a_three_fold_overload_asks_for_four_pods_at_once):
sampled from this free-running engine, a loaded machine's samples strayed from the demand (the
KEDA median once read 0.36 budgets off it, and a ceiling of such a median is one replica off).
Here, on the real CPU model, the premise (a queue forms, nothing is refused) and the old signal's
bound, which holds whatever the samples.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from harness.vllm_info import VllmInfo
from harness.workload import Result, SidecarProcess, make_prompts, one_completion
from tests.support.autoscalers import Rendered, rendered
from tests.support.prometheus_server import PrometheusServer, Sample, ScrapeJob

pytestmark = pytest.mark.vllm

NAMESPACE = "default"  # what the shipped KEDA queries match
POD = "llm-7d9c5b8f4-x2x7q"  # a Deployment pod's name, which the queries match as llm-.+
CONTAINER = "kv-sidecar"

#: The overload, in units of the pod's admission budget (capacity x (1 - headroom)).
OVERLOAD = 3.0
#: Each request: a short prompt and a long answer, so its peak (8 blocks of 128 tokens with the
#: session's vLLM) is mostly its max_tokens and lasts for seconds of decoding.
PROMPT_TOKENS = 64
MAX_TOKENS = 896
HEADROOM = 0.05
#: Closed loop: each client sends its next request as soon as the last is answered.
LOAD_SECONDS = 20.0
#: Samples from here on: every client has sent its first request and the queue has formed.
SETTLE_SECONDS = 5.0
STEP_SECONDS = 1.0


@dataclass
class Overloaded:
    vllm: VllmInfo
    scalers: Rendered
    peak_blocks: int  # each request's projected peak, from its tokens and vLLM's block size
    budget_blocks: int
    clients: int
    old_signal: list[Sample]  # sum(kv_sidecar_oom_risk_ratio) over the same window
    queue_depth: list[Sample]
    results: list[Result]
    #: (Unix time, +1 sent / -1 answered) of every request, as the clients saw them
    events: list[tuple[float, int]]

    @property
    def offered(self) -> float:
        """The load's demand in pods' budgets: every client's request, running or waiting."""
        return self.clients * self.peak_blocks / self.budget_blocks

    def outstanding(self, at: float) -> int:
        """Requests the clients had sent and not yet seen answered at ``at`` (Unix time)."""
        return sum(delta for t, delta in self.events if t <= at)


async def _closed_loop(
    url: str, prompts: list[str], model: str, stop_at: float, events: list[tuple[float, int]]
) -> list[Result]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as client:

        async def one_client(prompt: str) -> None:
            while time.monotonic() < stop_at:
                events.append((time.time(), +1))
                try:
                    result = await one_completion(
                        client, url, prompt, max_tokens=MAX_TOKENS, stream=False, model=model
                    )
                finally:
                    events.append((time.time(), -1))
                results.append(result)
                if result.status != 200:
                    return

        tasks = [asyncio.ensure_future(one_client(p)) for p in prompts]
        # The load ends at stop_at: what is still running or queued then is abandoned (the
        # sidecar sees the clients leave), so the test does not wait for a backlog to drain.
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results


@pytest.fixture(scope="module")
def overloaded(vllm: VllmInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overloaded]:
    assert vllm.model_dir is not None, "set KV_SIDECAR_TEST_MODEL_DIR to make prompts"
    assert vllm.max_model_len >= PROMPT_TOKENS + MAX_TOKENS
    scalers = rendered()
    # the demand the load offers, computed here from the tokens sent and vLLM's own pool figures
    peak_blocks = math.ceil((PROMPT_TOKENS + MAX_TOKENS) / vllm.block_size)
    capacity = vllm.num_gpu_blocks - 1  # vLLM's null block is never handed out
    budget_blocks = math.floor(capacity * (1 - HEADROOM))
    clients = round(OVERLOAD * budget_blocks / peak_blocks)
    prompts = make_prompts(vllm.model_dir, clients, PROMPT_TOKENS, seed=23)
    args = ["--policy", "queue", "--headroom", str(HEADROOM)]
    args += ["--max-queue-depth", str(4 * clients), "--max-queue-wait", "120"]
    args += ["--tokenizer", str(vllm.model_dir)]
    with SidecarProcess(vllm.url, *args) as sidecar:
        job = ScrapeJob(
            "kv-sidecar",
            f"127.0.0.1:{sidecar.metrics_port}",
            {"namespace": NAMESPACE, "pod": POD, "container": CONTAINER},
        )
        with PrometheusServer(tmp_path_factory.mktemp("prometheus"), [job]) as prometheus:
            prometheus.wait_for_targets_up()
            start = time.time()
            stop_at = time.monotonic() + LOAD_SECONDS
            events: list[tuple[float, int]] = []
            results = asyncio.run(
                _closed_loop(sidecar.url, prompts, vllm.served_name, stop_at, events)
            )
            end = time.time()
            time.sleep(2 * STEP_SECONDS)  # the last scrape of the window is in

            def window(expr: str) -> list[Sample]:
                return prometheus.query_range(expr, start + SETTLE_SECONDS, end, STEP_SECONDS)

            selector = f'{{namespace="{NAMESPACE}", container="{CONTAINER}"}}'
            yield Overloaded(
                vllm=vllm,
                scalers=scalers,
                peak_blocks=peak_blocks,
                budget_blocks=budget_blocks,
                clients=clients,
                old_signal=window(f"sum(kv_sidecar_oom_risk_ratio{selector})"),
                queue_depth=window(f"sum(kv_sidecar_queue_depth{selector})"),
                results=results,
                events=events,
            )


def test_the_load_is_a_three_fold_overload_of_one_pod(overloaded: Overloaded) -> None:
    """The premise: the offered demand is 3 budgets (to within one request), a queue formed
    (most of the requests wait), and nothing was refused or failed."""
    assert abs(overloaded.offered - OVERLOAD) <= overloaded.peak_blocks / overloaded.budget_blocks
    statuses = {r.status for r in overloaded.results}
    assert statuses <= {200}, [(r.status, r.error) for r in overloaded.results if r.status != 200]
    depths = [s.value for s in overloaded.queue_depth]
    assert depths
    assert statistics.median(depths) >= overloaded.clients / 2, depths


def test_the_old_signal_would_have_asked_for_one_step_only(overloaded: Overloaded) -> None:
    """Why the autoscalers moved off kv_sidecar_oom_risk_ratio: it leaves the sidecar's queue out,
    so the same overload reads as one saturated pod."""
    values = [s.value for s in overloaded.old_signal]
    assert values
    desired = [math.ceil(v / overloaded.scalers.keda_threshold) for v in values]
    assert statistics.median(desired) <= 2, (values, desired)
