"""One configuration of the admission benchmark on one workload: the proxy in front of vLLM
started (a sidecar, the shedder, or none), the workload driven and sampled, the proxy stopped."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.admission.client import Outcome, Tracker, drive, sample
from bench.admission.workload import (
    KEPT_PER_CLASS,
    OPTIMISTIC_PRIOR,
    PRIORITY_SIDECARS,
    Workload,
    priority_variant,
)
from bench.common import queue_flags, reset_prefix_cache, wait_idle, wait_tokenizer
from bench.proxies import BenchProxy
from harness.bench_util import RESULTS, group_cpu_seconds, progress
from harness.exposition import metric_value
from harness.vllm_cpu import SERVED_NAME
from harness.workload import SidecarProcess, vllm_preemptions


def sidecar_args(config: str) -> list[str]:
    """The flags of the sidecar of configuration ``config`` (``sidecar-RESERVATION-POLICY``,
    ``oracle``, or one of the priority workload's, :data:`PRIORITY_SIDECARS`)."""
    if config in PRIORITY_SIDECARS:
        reservation, flags = PRIORITY_SIDECARS[config]
        return [*flags, *queue_flags("queue", reservation)]
    if config == "oracle":  # worst case, with every client naming its real length as max_tokens
        config = "sidecar-worst-case-queue"
    reservation, _, policy = config.removeprefix("sidecar-").rpartition("-")
    extra: list[str] = []
    if reservation == "expected-optimistic":
        reservation, extra = "expected", ["--expected-prior", str(OPTIMISTIC_PRIOR)]
    elif reservation == "expected-warm":
        reservation = "expected"  # run_config adds the --lengths-file
    return [*extra, *queue_flags(policy, reservation)]


def kept_lengths(workload: Workload) -> Path:
    """A --lengths-file holding the true answer length of every request of ``workload`` (each
    turn of a chat), in the class the sidecar learns it in: what a sidecar that had served this
    traffic before its restart would have kept."""
    from sidecar.admission import lengths_file
    from sidecar.admission.learner import LengthLearner, request_class

    seen: dict[str, list[int]] = {}
    for req in workload.requests:
        endpoint = "chat" if req.endpoint == "/v1/chat/completions" else "completions"
        klass = request_class(endpoint, req.body.get("max_tokens"))
        seen.setdefault(klass, []).extend([req.true_tokens] * max(1, len(req.turns)))
    # hours of this traffic: each class's lengths over again up to KEPT_PER_CLASS (one run has
    # fewer answers per class than the learner needs before it trusts a class)
    learner = LengthLearner()
    for klass, lengths in seen.items():
        for i in range(max(len(lengths), KEPT_PER_CLASS)):
            learner.observe(klass, lengths[i % len(lengths)])
    path = RESULTS / f".lengths-{workload.name}.json"
    lengths_file.save(path, learner, model=SERVED_NAME)
    return path


def run_config(
    config: str, workload: Workload, vllm_url: str, front_url: str, vllm_pgid: int
) -> dict[str, Any]:
    """One configuration on one workload. ``front_url`` is where a proxy forwards (vLLM itself,
    or the early-end shim in front of it); ``vllm_pgid`` is vLLM's process group, whose CPU time
    is measured."""
    if workload.name == "priority":
        workload = priority_variant(config, workload)
    wait_idle(vllm_url)
    reset_prefix_cache(vllm_url)
    before = vllm_preemptions(vllm_url)
    sidecar: SidecarProcess | None = None
    shedder: BenchProxy | None = None
    if config.startswith("sidecar-") or config == "oracle":
        args = sidecar_args(config)
        if config == "sidecar-expected-warm-queue":
            args += ["--lengths-file", str(kept_lengths(workload))]
        sidecar = SidecarProcess(front_url, *args).start()
        wait_tokenizer(sidecar)
        url = sidecar.url
    elif config == "threshold-shedder":
        shedder = BenchProxy("shedder", front_url)
        url = shedder.url
    else:
        url = front_url
    total = sum(max(1, len(r.turns)) for r in workload.requests)
    last_report = [time.monotonic()]

    def on_done(n: int) -> None:
        if time.monotonic() - last_report[0] > 15 or n == total:
            last_report[0] = time.monotonic()
            progress(f"admission: {workload.name} / {config}: {n}/{total} requests done")

    async def go() -> tuple[list[Outcome], float, float, list[dict[str, Any]]]:
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()
        tracker = Tracker()
        t0 = time.monotonic()
        sampler = asyncio.ensure_future(sample(vllm_url, sidecar, t0, samples, stop, tracker))
        outcomes, t1 = await drive(url, workload, t0, on_done, tracker, oracle=config == "oracle")
        stop.set()
        await sampler
        return outcomes, t0, t1, samples

    cpu0 = group_cpu_seconds(vllm_pgid)
    try:
        outcomes, t0, t1, samples = asyncio.run(go())
        vllm_cpu = group_cpu_seconds(vllm_pgid) - cpu0
        sidecar_figures: dict[str, Any] | None = None
        if sidecar is not None:
            try:
                sidecar_figures = _sidecar_figures(sidecar.metrics())
            except (httpx.HTTPError, ValueError) as exc:  # a failing /metrics: note it, go on
                sidecar_figures = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                progress(f"admission: the sidecar's /metrics failed: {exc!r}")
        shedder_state = httpx.get(shedder.url + "/bench/shedder").json() if shedder else None
    finally:
        if sidecar is not None:
            sidecar.stop()
        if shedder is not None:
            shedder.stop()
    after = vllm_preemptions(vllm_url)
    return {
        "config": config,
        "workload": workload.name,
        "preemptions": after - before,
        "seconds": t1 - t0,
        "vllm_cpu_seconds": vllm_cpu,
        "outcomes": [asdict(o) for o in outcomes],
        "samples": samples,
        "sidecar_metrics": sidecar_figures,
        "shedder": shedder_state,
        "errors": sorted({o.error[:200] for o in outcomes if o.error})[:5],
    }


def _sidecar_figures(text: str) -> dict[str, Any]:
    by_reason = {
        f"{s.labels['decision']}/{s.labels['reason']}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kv_sidecar_requests_total"
    }
    learned = {
        s.labels.get("class", ""): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kv_sidecar_expected_output_tokens"
    }
    by_class = {
        f"{s.labels.get('priority')}/{s.labels.get('tenant')}/{s.labels.get('decision')}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kv_sidecar_class_requests_total" and s.value
    }
    return {
        # per priority/tenant/decision, the requests the sidecar decided (the priority workload)
        "class_requests": by_class,
        # per request class, the output tokens expected mode reserves (classes still on the
        # prior are not listed)
        "learned_output_tokens": learned,
        "preemptions_seen": metric_value(text, "kv_sidecar_vllm_preemptions_total"),
        "requests_by_reason": by_reason,
    }
