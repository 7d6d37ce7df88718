"""The sidecar's own Prometheus metrics (names and meanings: docs/metrics.md).

Figures that come from state (KV blocks, queue depth, snapshot age) are computed at scrape time
by :class:`StateCollector`, never set-and-reset; events (decisions, waits, counts) are counters and
histograms. Everything registers on the registry passed in, so tests use a fresh one.

The series about the model vLLM serves (its KV pool, its requests and the gate's decisions on them,
predictions, learned lengths and costs, the sidecar's view of the engine) carry ``model_name``, the
served model name discovery found, as vLLM's own series do; those of the sidecar process (its CPU,
event loop, the cost of its own counting and deciding, build, settings, readiness) do not
(docs/metrics.md, The model_name label). The label is added at scrape time (:class:`ModelName`,
:func:`with_model_name`), so a series is never exported twice: before the first discovery the
per-model series have no ``model_name``, from then on every one has the name found.

Importing this module turns off prometheus_client's ``_created`` series (one per counter and
histogram child: a quarter of the samples, which no dashboard, alert or query of the sidecar
reads) for the whole process; the relay workers start with ``PROMETHEUS_DISABLE_CREATED_SERIES``
set, so any series made there has none either.
"""

from __future__ import annotations

import math
import platform
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sidecar import __version__
from sidecar.admission.ask import KVState
from sidecar.admission.decisions import DECISION_LABELS, Decision, Outcome, Reason
from sidecar.counting import SELF_CHECKED_SHAPES, PromptShape, TokenCount
from sidecar.engine.discovery import EngineConfig
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.engine.versions import MIRRORED, supported_text
from sidecar.kv.projection import Projection
from sidecar.observability.classes import class_families
from sidecar.observability.cpu import CpuLimitCollector
from sidecar.observability.loop_lag import LAG_BUCKETS
from sidecar.observability.model_name import ModelLabelled, ModelName, with_model_name
from sidecar.observability.process_tree import ProcessTreeCollector

# no `_created` samples on /metrics (see the module docstring)
disable_created_metrics()  # type: ignore[no-untyped-call]

PREFIX = "kv_sidecar"
COUNT_METHODS = ("exact_local", "exact_upstream", "estimate")
UPSTREAM_ERRORS = ("connect", "timeout", "protocol", "status_5xx")
BYTES_BUCKETS = tuple(float(1 << k) for k in range(16, 41, 2))  # 64 KiB .. 1 TiB
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FAST_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0)
TOKENS_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
#: from a short answer to the longest generation that stays under --upstream-read-timeout's pace
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
RELATIVE_ERROR_BUCKETS = (-0.5, -0.2, -0.1, -0.05, -0.02, -0.01, 0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


@dataclass(frozen=True)
class Sources:
    """Where the scrape-time figures come from, besides the admission controller."""

    engine: Callable[[], EngineConfig | None]
    vllm_up: Callable[[], bool]
    ready: Callable[[], bool]
    scrape_errors: Callable[[], int]
    config_labels: dict[str, str]
    clock: Callable[[], float]


class Metrics:
    """Event metrics plus the scrape-time collector, on one registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        admission: AdmissionState,
        *,
        engine: Callable[[], EngineConfig | None],
        vllm_up: Callable[[], bool],
        ready: Callable[[], bool],
        scrape_errors: Callable[[], int],
        config_labels: dict[str, str],
        clock: Callable[[], float] = time.monotonic,
        process_children: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        self.registry = registry
        #: the per-model counters and histograms, exported with ``model_name`` by
        #: :class:`ModelLabelled`; the sidecar process's own register on ``registry``
        per_model = CollectorRegistry()
        self.model_name = ModelName(engine)
        self.event_loop_tasks = Gauge(
            f"{PREFIX}_event_loop_tasks",
            "asyncio tasks alive on the sidecar's event loop (steady at rest; a leak grows it).",
            registry=registry,
        )
        self.event_loop_lag = Histogram(
            f"{PREFIX}_event_loop_lag_seconds",
            "How late the sidecar's event loop ran a timer due every 100 ms (work that blocks "
            "the loop, or more than the CPU gives, delays every request by as much).",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Generation requests by gate decision and reason.",
            ["decision", "reason"],
            registry=per_model,
        )
        self.queue_wait = Histogram(
            f"{PREFIX}_queue_wait_seconds",
            "Time queued requests waited for admission or refusal.",
            buckets=SECONDS_BUCKETS,
            registry=per_model,
        )
        self.retry_after = Histogram(
            f"{PREFIX}_retry_after_seconds",
            "Retry-After given with 429 and 503 refusals.",
            buckets=(1, 2, 3, 5, 10, 15, 20, 30, 45, 60),
            registry=per_model,
        )
        self.projected_bytes = Histogram(
            f"{PREFIX}_request_kv_projected_bytes",
            "Projected peak KV bytes per request.",
            buckets=BYTES_BUCKETS,
            registry=per_model,
        )
        self.max_tokens = Histogram(
            f"{PREFIX}_request_max_tokens",
            "Effective max_tokens per request (after clamping).",
            buckets=TOKENS_BUCKETS,
            registry=per_model,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens",
            "Prompt tokens counted, by counting method.",
            ["method"],
            registry=per_model,
        )
        self.prompt_counts = Counter(
            f"{PREFIX}_prompt_counts",
            "Requests whose prompt was counted, by method.",
            ["method"],
            registry=per_model,
        )
        self.tokenize_seconds = Histogram(
            f"{PREFIX}_tokenize_seconds",
            "Time spent counting prompt tokens.",
            ["method"],
            buckets=FAST_BUCKETS,
            registry=registry,
        )
        self.prompt_checks = Counter(
            f"{PREFIX}_prompt_count_checks",
            "Local prompt counts checked against vLLM's /tokenize, by request shape and result "
            "(match or mismatch); a shape that mismatched is counted by /tokenize from then on.",
            ["shape", "result"],
            registry=per_model,
        )
        self.decision_seconds = Histogram(
            f"{PREFIX}_decision_seconds",
            "Time spent projecting and deciding (no queue wait).",
            buckets=FAST_BUCKETS,
            registry=registry,
        )
        self.request_duration = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Admitted generation requests, end to end through the sidecar: from counting the "
            "prompt to the end of the relayed answer (queue wait and vLLM's work included).",
            buckets=DURATION_BUCKETS,
            registry=per_model,
        )
        self.completion_tokens = Counter(
            f"{PREFIX}_completion_tokens",
            "Completion tokens seen in answers.",
            registry=per_model,
        )
        self.upstream_errors = Counter(
            f"{PREFIX}_upstream_errors",
            "Failures talking to vLLM.",
            ["kind"],
            registry=per_model,
        )
        self.relative_error = Histogram(
            f"{PREFIX}_kv_prediction_relative_error",
            "Per scrape of vLLM: (predicted - actual) KV blocks over capacity.",
            buckets=RELATIVE_ERROR_BUCKETS,
            registry=per_model,
        )
        # export zeros so that rate() and the dashboard work from the start; the children are
        # bound once here (``labels()`` takes a lock and checks its values on every call)
        self._counted = {
            method: (
                self.prompt_tokens.labels(method),
                self.prompt_counts.labels(method),
                self.tokenize_seconds.labels(method),
            )
            for method in COUNT_METHODS
        }
        for shape in SELF_CHECKED_SHAPES:
            for result in ("match", "mismatch"):
                self.prompt_checks.labels(shape, result)
        self._requests: dict[tuple[str, str], Counter] = {
            (decision.value, reason.value): self.requests.labels(decision, reason)
            for decision, reason in DECISION_LABELS
        }
        self._upstream_errors: dict[str, Counter] = {
            kind: self.upstream_errors.labels(kind) for kind in UPSTREAM_ERRORS
        }
        self.collector = StateCollector(
            admission,
            Sources(engine, vllm_up, ready, scrape_errors, config_labels, clock),
            self.model_name,
        )
        registry.register(self.collector)
        registry.register(ModelLabelled(per_model, self.model_name))
        # the sidecar's own CPU (process_cpu_seconds_total, ...) and the CPU it may use; with
        # relay workers (``process_children``), summed over the owner and the workers
        registry.register(ProcessTreeCollector(process_children))
        registry.register(CpuLimitCollector())

    def _request(self, outcome: str, reason: str) -> Counter:
        child = self._requests.get((outcome, reason))
        if child is None:  # every pair is bound at start; a new one still counts
            child = self._requests[(outcome, reason)] = self.requests.labels(outcome, reason)
        return child

    def decided(self, decision: Decision) -> None:
        self._request(decision.outcome.value, decision.reason.value).inc()
        if decision.retry_after is not None:
            self.retry_after.observe(decision.retry_after)

    def refused(self, reason: Reason, retry_after: float | None = None) -> None:
        self._request(Outcome.REJECT.value, reason.value).inc()
        if retry_after is not None:
            self.retry_after.observe(retry_after)

    def decision_time(self, seconds: float) -> None:
        self.decision_seconds.observe(seconds)

    def queue_waited(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def answered(self, seconds: float) -> None:
        """An admitted request is over (answered, failed or abandoned), ``seconds`` after its
        prompt began to be counted."""
        self.request_duration.observe(seconds)

    def upstream_failed(self, kind: str) -> None:
        """A failure talking to vLLM, by ``kind`` (vLLM's own queue cap refusing a request the
        gate had admitted is no failure: a refusal, ``refused(Reason.ENGINE_QUEUE_FULL)``)."""
        child = self._upstream_errors.get(kind)
        if child is None:
            child = self._upstream_errors[kind] = self.upstream_errors.labels(kind)
        child.inc()

    def completed(self, completion_tokens: int) -> None:
        self.completion_tokens.inc(completion_tokens)

    def self_checked(self, shape: PromptShape, matched: bool) -> None:
        """A local prompt count compared with vLLM's /tokenize (the counter's observer)."""
        self.prompt_checks.labels(shape, "match" if matched else "mismatch").inc()

    def counted(self, count: TokenCount) -> None:
        tokens, counts, seconds = self._counted[count.method.value]
        tokens.inc(count.total)
        counts.inc()
        seconds.observe(count.seconds)

    def projected(self, projection: Projection, bytes_per_block: int | None) -> None:
        for m in projection.max_tokens:
            self.max_tokens.observe(m)
        if bytes_per_block is not None:
            self.projected_bytes.observe(projection.peak_blocks * bytes_per_block)

    def on_snapshot(self) -> None:
        """Called after each scrape of vLLM: the prediction error histogram and the trend."""
        self.collector.on_snapshot(self.relative_error)


class AdmissionState(Protocol):
    """What the exporter reads of admission: its :class:`KVState`, and vLLM's last snapshot."""

    def state(self) -> KVState: ...

    def at_snapshot(self) -> tuple[int | None, int | None, int | None]:
        """Of the last scrape of vLLM: the ledger's predicted blocks, vLLM's, the capacity."""
        ...

    @property
    def snapshot(self) -> EngineSnapshot | None: ...


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _kv(name: str, doc: str, blocks: float | None, bytes_per_block: int | None) -> list[Metric]:
    """``kv_sidecar_kv_<name>_blocks`` and, when the block's bytes are known, ``_bytes``."""
    if blocks is None:
        return []
    out: list[Metric] = [_gauge(f"kv_{name}_blocks", f"{doc} (blocks).", blocks)]
    if bytes_per_block is not None:
        out.append(_gauge(f"kv_{name}_bytes", f"{doc} (bytes).", blocks * bytes_per_block))
    return out


def kv_families(state: KVState, bytes_per_block: int | None) -> list[Metric]:
    """The KV figures, in blocks and bytes. Predicted and actual are taken at the same instant,
    the last scrape of vLLM (the live ledger, which counts a streamed request from its first
    token, is in /state)."""
    predicted = state.predicted_at_snapshot_blocks
    error = None
    if state.actual_blocks is not None and predicted is not None:
        error = predicted - state.actual_blocks
    headroom = None
    if state.budget_blocks is not None:
        headroom = max(0, state.budget_blocks - state.committed_blocks)
    figures: tuple[tuple[str, str, float | None], ...] = (
        ("capacity", "KV cache vLLM can hand out", state.capacity_blocks),
        (
            "reserved",
            "KV promised to requests in flight (the sum of their peaks)",
            state.reserved_blocks,
        ),
        (
            "future_peak",
            "Peak over the future of the KV the requests in flight can hold at once (what "
            "admission checks against the budget)",
            state.future_peak_blocks,
        ),
        (
            "prefix_shared",
            "Prompt KV that running requests share and vLLM holds once (counted once)",
            state.shared_blocks,
        ),
        (
            "predicted_used",
            "KV the ledger predicts vLLM held at the last scrape",
            predicted if predicted is not None else state.predicted_blocks,
        ),
        ("actual_used", "KV vLLM reports it holds", state.actual_blocks),
        ("prediction_error", "Predicted minus actual KV at the last scrape", error),
        ("headroom", "KV still promisable", headroom),
    )
    return [m for name, doc, blocks in figures for m in _kv(name, doc, blocks, bytes_per_block)]


def ratio_families(state: KVState, exhaustion_seconds: float) -> list[Metric]:
    """Usage, risk and demand as ratios of the pool (for the endpoint picker, the alerts and the
    autoscalers), and the exhaustion forecast."""
    out: list[Metric] = []
    capacity = state.capacity_blocks
    if capacity:
        used = max(state.committed_blocks, state.actual_blocks or 0)
        out.append(
            _gauge(
                "kv_projected_usage_ratio",
                "Projected KV usage 0..1: max(reserved, actual) over capacity (for the endpoint "
                "picker).",
                min(1.0, used / capacity),
            )
        )
        out.append(
            _gauge(
                "oom_risk_ratio",
                "Projected peak KV of everything vLLM runs or will run (the future peak of the "
                "sidecar's requests in flight, each running to max_tokens, plus what vLLM holds "
                "for others) over capacity; above 1 vLLM preempts if they all run to max_tokens.",
                (state.worst_case_peak_blocks + state.external_blocks) / capacity,
            )
        )
        out.append(
            _gauge(
                "kv_exhaustion_seconds",
                "Seconds until vLLM's free KV blocks run out at the current growth rate.",
                exhaustion_seconds,
            )
        )
    if state.budget_blocks:
        out.append(
            _gauge(
                "kv_demand_ratio",
                "KV demand in units of the admission budget: what admission counts as spoken "
                "for (the future peak of the requests in flight plus what vLLM holds for "
                "others, at least what vLLM holds) plus the projected peak of every request "
                "waiting in the sidecar's queue, over the budget (capacity less headroom); the "
                "autoscaling signal.",
                (state.committed_blocks + state.peak_blocks_queued) / state.budget_blocks,
            )
        )
    if capacity:
        out.append(
            _gauge(
                "queued_demand_ratio",
                "Projected peak KV of the requests waiting in the sidecar's queue over "
                "capacity: demand held back, a scale-out signal.",
                state.peak_blocks_queued / capacity,
            )
        )
    return out


def expected_output_tokens(state: KVState) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        f"{PREFIX}_expected_output_tokens",
        "Output tokens reserved per sequence for each request class in expected and adaptive "
        "modes, for a short prompt (the learned length bound; classes still on the prior are "
        "not listed).",
        labels=["class"],
    )
    for klass, length in state.expected_output_tokens.items():
        family.add_metric([klass], length)
    return family


def cost_families(state: KVState) -> list[Metric]:
    """The engine's costs as admission learned them (``sidecar.admission.costs``)."""
    figures: tuple[tuple[str, str, float | None], ...] = (
        (
            "engine_decode_step_seconds",
            "A decode step of vLLM's running batch, as learned from its inter-token latency.",
            state.decode_step_seconds,
        ),
        (
            "engine_step_seconds_per_token",
            "What each prompt token computed adds to vLLM's step (the mean step's slope on the "
            "prompt tokens computed a step, from vllm:iteration_tokens_total, at most the "
            "finished prefills' whole time a token; until solved, finished requests' prefill "
            "time less a decode step, over their prompt tokens less prefix-cache hits).",
            state.step_seconds_per_token,
        ),
        (
            "engine_step_seconds_per_sequence",
            "What each sequence in the batch adds to vLLM's decode step (the slope of its "
            "mean step on the tokens decoded a step, prompt tokens held; else on its running "
            "requests, where steps are counted in prompt-free intervals; the rest is fixed).",
            state.step_seconds_per_sequence,
        ),
        (
            "engine_prefill_tokens_per_step",
            "Tokens whose recompute (a preemption's prefill) costs one decode step; adaptive "
            "reservations risk less where it is low.",
            state.prefill_tokens_per_step,
        ),
        (
            "engine_step_fixed_share",
            "The share of vLLM's decode step that does not grow with the batch (the decode "
            "line's base over its step at the recent batch): reading the weights, once per step "
            "for all. Until the line is measured, the roofline's at a full pool where the "
            "model's weights and a prompt token's cost are known: weights / (weights + the "
            "pool's KV bytes).",
            state.step_fixed_share,
        ),
        (
            "engine_batch_gain_steps_per_token",
            "Decode steps of vLLM's time one sequence more saves per token it decodes in the "
            "recent batch (fixed share / batch); adaptive reservations risk up to that times a "
            "request's likely answer in recompute.",
            state.batch_gain_steps_per_token,
        ),
        (
            "prefill_backlog_seconds",
            "Seconds of prefill the sidecar has forwarded to vLLM and not yet presumed done (the "
            "prompts sent, at what a prompt's prefill was measured to hold the engine for, "
            "drained by the clock), summed over the engines; requests of a positive priority "
            "wait while it is over --priority-pace (kept only while it is set: 0 otherwise).",
            state.prefill_backlog_seconds,
        ),
        (
            "stream_lag_tokens",
            "The most tokens per sequence a stream's visible progress was behind vLLM's in the "
            "last 5 to 10 s (the largest move of one report, less one), the most over the "
            "engines; worst-case mode counts each started sequence as holding that much more "
            "than laid out.",
            state.stream_lag_tokens,
        ),
    )
    return [_gauge(name, doc, value) for name, doc, value in figures if value is not None]


def vllm_info(info: EngineConfig | None) -> InfoMetricFamily:
    """``kv_sidecar_vllm_info``: the engine behind the sidecar (empty until discovered)."""
    prefix_caching = info.prefix_caching if info is not None else None
    return InfoMetricFamily(
        f"{PREFIX}_vllm",
        "The engine behind the sidecar (version: what vLLM's /version said, empty if nothing).",
        value={
            "model": info.model if info is not None else "",
            "version": (info.vllm_version or "") if info is not None else "",
            "block_size": str(info.block_size if info is not None else 0),
            "num_gpu_blocks": str(info.num_gpu_blocks if info is not None else 0),
            "cache_dtype": info.cache_dtype if info is not None else "",
            "prefix_caching": "" if prefix_caching is None else str(prefix_caching).lower(),
        },
    )


def build_info() -> InfoMetricFamily:
    """``kv_sidecar_build_info``: the sidecar's own version, its Python, and the vLLM whose
    rules it mirrors."""
    return InfoMetricFamily(
        f"{PREFIX}_build",
        "The sidecar's build: its version, its Python, the vLLM release whose rendering, "
        "defaults and metric names it mirrors, and the vLLM versions it supports.",
        value={
            "version": __version__,
            "python_version": platform.python_version(),
            "vllm_mirrored": MIRRORED,
            "vllm_supported": supported_text(),
        },
    )


def vllm_admission_rejections(snap: EngineSnapshot) -> CounterMetricFamily:
    """vLLM's own ``vllm:admission_rejections_total`` by reason, relayed from its last scrape."""
    family = CounterMetricFamily(
        f"{PREFIX}_vllm_admission_rejections",
        "Requests vLLM's own queue caps refused with 503 (--max-num-queued-reqs, "
        "--max-num-queued-tokens), by vLLM's reason: its vllm:admission_rejections_total at the "
        "last scrape, since vLLM started.",
        labels=["reason"],
    )
    for reason, count in snap.admission_rejections:
        family.add_metric([reason], count)
    return family


class StateCollector(Collector):
    """Yields the state gauges at scrape time from admission's :class:`KVState`, the per-model
    ones with ``model_name`` (``model``; none: without)."""

    def __init__(
        self,
        admission: AdmissionState,
        sources: Sources,
        model: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.admission = admission
        self.sources = sources
        self.model = model
        # (time, vLLM used blocks) per scrape, for the growth rate behind the exhaustion forecast
        self._usage: deque[tuple[float, int]] = deque(maxlen=20)

    def on_snapshot(self, relative_error: Histogram) -> None:
        # after every scrape of vLLM: the scrape's figures alone, not the whole state (whose
        # peaks are a pass over the ledger)
        predicted, actual, capacity = self.admission.at_snapshot()
        snap = self.admission.snapshot
        if actual is None or not capacity or snap is None:
            return
        if predicted is not None:
            relative_error.observe((predicted - actual) / capacity)
        self._usage.append((snap.taken_at, actual))

    def exhaustion_seconds(self, capacity: int, used: int) -> float:
        """Seconds until vLLM's free blocks run out at the recent growth rate (inf: not growing)."""
        if len(self._usage) < 2:
            return math.inf
        (t0, u0), (t1, u1) = self._usage[0], self._usage[-1]
        if t1 <= t0 or u1 <= u0:
            return math.inf
        rate = (u1 - u0) / (t1 - t0)
        return max(0.0, (capacity - used) / rate)

    def describe(self) -> Iterable[Metric]:
        return []  # computed at collect time; skip the registration-time collect

    def collect(self) -> Iterable[Metric]:
        # every family at once: they are one moment's, even when the render gives the loop back
        # between families (sidecar.observability.exposition)
        model = self.model()
        return [
            family if family.name in UNLABELLED_STATE_FAMILIES else with_model_name(family, model)
            for family in self._families()
        ]

    def _families(self) -> Iterator[Metric]:
        state = self.admission.state()
        src = self.sources
        info = src.engine()
        exhaustion = self.exhaustion_seconds(state.capacity_blocks or 0, state.actual_blocks or 0)
        age = state.snapshot_age
        yield from kv_families(state, info.bytes_per_block if info is not None else None)
        yield from ratio_families(state, exhaustion)
        yield _gauge(
            "requests_in_flight", "Admitted generation requests not yet finished.", state.in_flight
        )
        yield _gauge("queue_depth", "Requests waiting in the admission queue.", state.queue_depth)
        yield from class_families(state)
        yield expected_output_tokens(state)
        yield from cost_families(state)
        yield _gauge(
            "vllm_metrics_age_seconds",
            "Age of the last good scrape of vLLM's /metrics.",
            math.inf if age is None else age,
        )
        yield _gauge(
            "vllm_up", "1 when the last scrape of vLLM succeeded.", 1.0 if src.vllm_up() else 0.0
        )
        yield _gauge("ready", "1 while /readyz answers 200.", 1.0 if src.ready() else 0.0)
        yield CounterMetricFamily(
            f"{PREFIX}_vllm_scrape_errors",
            "Failed scrapes of vLLM's /metrics.",
            value=src.scrape_errors(),
        )
        yield CounterMetricFamily(
            f"{PREFIX}_vllm_preemptions",
            "Preemptions vLLM reported since the sidecar started.",
            value=state.preemptions_seen,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_spread_admissions",
            "Placements adaptive mode made on the in-flight answers' spread ends where their "
            "laid-out peak refused.",
            value=state.spread_admitted,
        )
        yield vllm_info(info)
        yield build_info()
        yield InfoMetricFamily(
            f"{PREFIX}_config", "The sidecar's admission settings.", value=src.config_labels
        )
        if info is not None:
            yield vllm_cache_config_info(info)
        snap = self.admission.snapshot
        if snap is not None and snap.lora_info is not None:
            yield vllm_lora_requests_info(*snap.lora_info)
        if snap is not None and snap.admission_rejections:
            yield vllm_admission_rejections(snap)


#: vLLM's own name and label names for its KV cache config, which the llm-d endpoint picker's
#: core-metrics-extractor reads (``cacheInfoSpec``: block_size and num_gpu_blocks as labels of an
#: info-style gauge) from the one port it scrapes per pod: the sidecar's metrics port.
VLLM_CACHE_CONFIG_INFO = "vllm:cache_config_info"


VLLM_LORA_REQUESTS_INFO = "vllm:lora_requests_info"

#: The state collector's families that are the sidecar process's, or vLLM's own names relayed with
#: vLLM's labels: exported without ``model_name``.
UNLABELLED_STATE_FAMILIES = frozenset(
    {
        f"{PREFIX}_ready",
        f"{PREFIX}_build",
        f"{PREFIX}_config",
        VLLM_CACHE_CONFIG_INFO,
        VLLM_LORA_REQUESTS_INFO,
    }
)


def vllm_lora_requests_info(labels: tuple[tuple[str, str], ...], value: float) -> GaugeMetricFamily:
    """vLLM's newest ``vllm:lora_requests_info`` sample, relayed as it was (its labels name the
    running and waiting adapters and ``max_lora``; its value is the time vLLM set it), for the
    endpoint picker's ``loraSpec``."""
    family = GaugeMetricFamily(
        VLLM_LORA_REQUESTS_INFO,
        "Running stats on lora requests (vLLM's newest sample, relayed by the kv-sidecar for the "
        "endpoint picker).",
        labels=[k for k, _ in labels],
    )
    family.add_metric([v for _, v in labels], value)
    return family


def vllm_cache_config_info(info: EngineConfig) -> GaugeMetricFamily:
    """``vllm:cache_config_info`` as vLLM exports it (a gauge of 1, the config in labels), built
    from the discovered engine config: the labels the sidecar knows, under vLLM's names."""
    labels = {
        "block_size": str(info.block_size),
        "num_gpu_blocks": str(info.num_gpu_blocks),
        "cache_dtype": info.cache_dtype,
    }
    if info.prefix_caching is not None:
        labels["enable_prefix_caching"] = str(info.prefix_caching)  # vLLM writes True / False
    family = GaugeMetricFamily(
        VLLM_CACHE_CONFIG_INFO,
        "Information of the LLMEngine CacheConfig (vLLM's labels, relayed by the kv-sidecar for "
        "the endpoint picker).",
        labels=list(labels),
    )
    family.add_metric(list(labels.values()), 1.0)
    return family
