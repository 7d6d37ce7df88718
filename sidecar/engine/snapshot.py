r"""vLLM's Prometheus ``/metrics`` text, read into a typed :class:`EngineSnapshot`.

This module owns the mapping from vLLM's metric names and labels to the engine-neutral fields
the rest of the sidecar uses (KV blocks, usage, running requests, token and preemption counters).
It is pure: no I/O, no clock; the scraper passes the text and the times in.

Tolerance rules, because the exposition changes between vLLM versions:

* only the sample lines of the few metrics read here are parsed: other lines are never looked
  at, so a new or odd metric elsewhere cannot break the scrape;
* names are matched on *sample* names (``vllm:num_preemptions_total``), since prometheus_client
  drops ``_total`` from counter family names; the ``vllm_`` spelling (colon replaced by an
  underscore, as some relabelling pipelines do) is accepted too;
* older names are accepted when the new one is absent (``vllm:gpu_cache_usage_perc`` for
  ``vllm:kv_cache_usage_perc``);
* unknown labels are ignored, missing optional labels and values such as ``"None"`` read as None;
* several engines (data parallel, label ``engine``) each have their own pool: the snapshot
  keeps one :class:`EngineSnapshot` per engine (``per_engine``) besides their sum. vLLM 0.32
  labels every engine's ``cache_config_info`` with the *sum* of the engines' blocks (its
  client adds each engine's ``num_gpu_blocks`` into the one shared cache config,
  ``v1/engine/core_client.py``), so each engine's pool is that figure over the engine count;
  the summed KV usage is weighted by each engine's usable blocks.

Anything unusable raises :class:`MetricsParseError` (a one-line message) and nothing else.
Text that is valid but lacks ``vllm:cache_config_info`` still gives a snapshot, with
``has_cache_config`` False and the block fields None, so that the caller can fall back.

Cost, measured on the development machine (2 cores, Python 3.11, prometheus_client 0.26) with
the under-load fixture (609 lines): prometheus_client on the whole text takes 17-20 ms, which a
scrape every 0.5 s would steal from the event loop. Keeping only the wanted lines (one regex
pass, about 0.15 ms) and memoising the constant ``cache_config_info`` line brings a scrape to a
median of about 0.3 ms with changing values (about 1.1-1.4 ms for the first one).

>>> snap = parse_vllm_metrics(
...     'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="101"} 1.0\n'
...     'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n',
...     taken_at=0.0,
... )
>>> snap.capacity_blocks, snap.used_blocks
(100, 25)
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from sidecar.errors import MetricsParseError, one_line

__all__ = ["EngineSnapshot", "MetricsParseError", "parse_vllm_metrics"]


# Canonical names (without the "vllm:" prefix) of the samples read here. Older spellings map to
# the current one and are used only when the current one is absent from the text.
_CACHE_CONFIG = "cache_config_info"
_RUNNING = "num_requests_running"
_KV_USAGE = "kv_cache_usage_perc"
_PREEMPTIONS = "num_preemptions_total"
_GENERATION_TOKENS = "generation_tokens_total"
_ITL_SUM = "inter_token_latency_seconds_sum"  # vLLM's histogram of the time between tokens
_ITL_COUNT = "inter_token_latency_seconds_count"
#: answers' lengths (a histogram: cumulative counts by upper bound ``le``), what a cold sidecar
#: takes its first expected lengths from
_GENERATION_BUCKET = "request_generation_tokens_bucket"
_GENERATION_SUM = "request_generation_tokens_sum"  # ... and their summed lengths
#: answers by how they ended (``finished_reason``): the share that ran to their max_tokens
_SUCCESS = "request_success_total"
#: finished requests' prefill (from being scheduled to their first token, engine-core time) and
#: prompt lengths, and the prompt tokens vLLM took in and found in its prefix cache: what a
#: prefill, and so a preemption's recompute, costs against a decode step
_PREFILL_SUM = "request_prefill_time_seconds_sum"
_PREFILL_COUNT = "request_prefill_time_seconds_count"
_PROMPT_SUM = "request_prompt_tokens_sum"
_PROMPT_TOKENS = "prompt_tokens_total"
_PROMPT_CACHED = "prompt_tokens_cached_total"
#: engine steps that gave outputs (``vllm:iteration_tokens_total``, one observation a step): with
#: the tokens decoded and the prompt tokens computed, what a step's prompt tokens add to it
_STEPS = "iteration_tokens_total_count"
#: LoRA adapters running and waiting, as labels of a gauge vLLM sets to the time of each update
#: (old label sets stay, with older times): relayed for the llm-d endpoint picker
_LORA_INFO = "lora_requests_info"
#: requests vLLM's own queue caps refused (--max-num-queued-reqs / -tokens), by ``reason``
_ADMISSION_REJECTIONS = "admission_rejections_total"

_OLD_NAMES: dict[str, str] = {
    "gpu_cache_usage_perc": _KV_USAGE,  # vLLM V0 and early V1
    "time_per_output_token_seconds_sum": _ITL_SUM,  # before the rename (about 0.11)
    "time_per_output_token_seconds_count": _ITL_COUNT,
}
_WANTED = frozenset(
    {
        _CACHE_CONFIG,
        _RUNNING,
        _KV_USAGE,
        _PREEMPTIONS,
        _GENERATION_TOKENS,
        _ITL_SUM,
        _ITL_COUNT,
        _GENERATION_BUCKET,
        _GENERATION_SUM,
        _SUCCESS,
        _PREFILL_SUM,
        _PREFILL_COUNT,
        _PROMPT_SUM,
        _PROMPT_TOKENS,
        _PROMPT_CACHED,
        _STEPS,
        _LORA_INFO,
        _ADMISSION_REJECTIONS,
        *_OLD_NAMES,
    }
)

# One C-level pass over the text keeps the sample lines of the wanted metrics: parsing all ~600
# lines with prometheus_client costs ~17 ms, and histograms are most of them. Anchoring on "\n"
# rather than on "^" with re.MULTILINE makes the scan about three times faster.
_WANTED_LINE = re.compile(
    r"\n[ \t]*(vllm[:_](?:"
    + "|".join(sorted((re.escape(n) for n in _WANTED), key=len, reverse=True))
    + r")[ \t{][^\n]*)"
)
_ANY_VLLM_SAMPLE = re.compile(r"\n[ \t]*vllm[:_][A-Za-z_:0-9]*[ \t{]")

#: Label that tells data-parallel engines apart; absent in older versions (one engine).
_ENGINE_LABEL = "engine"
_NO_ENGINE = ""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What vLLM reported at one scrape, summed over its engines (``per_engine`` keeps each
    data-parallel engine's own figures; it is empty when vLLM runs one engine).

    Block counts follow vLLM's allocator: each engine keeps one null block out of its
    ``num_gpu_blocks``, and ``kv_cache_usage_perc = 1 - free / (num_gpu_blocks - 1)``.
    """

    taken_at: float  # time.monotonic() at the end of the scrape
    block_size: int | None
    num_gpu_blocks: int | None  # summed over engines
    engines: int
    kv_cache_usage: float | None  # 0..1, weighted by each engine's usable blocks
    running: int
    preemptions_total: float
    generation_tokens_total: float
    cache_dtype: str | None
    prefix_caching: bool | None
    kv_cache_memory_bytes: int | None  # informational: vLLM's budget, not what the blocks take
    has_cache_config: bool
    inter_token_latency_sum: float = 0.0  # seconds between consecutive tokens of a request,
    inter_token_latency_count: float = 0.0  # summed and counted: a decode step's duration
    #: ``vllm:request_generation_tokens``: (upper bound, cumulative count) per bucket, +Inf last,
    #: summed over engines (the lengths of every answer vLLM finished since it started)
    generation_lengths: tuple[tuple[float, float], ...] = ()
    generation_lengths_sum: float | None = None  # the same histogram's sum (None: not given)
    answers_at_length: float = 0.0  # answers that ran to their max_tokens (finished "length")
    answers_stopped: float = 0.0  # answers that ended on their own (finished "stop")
    prefill_seconds_sum: float = 0.0  # finished requests' prefills (scheduled to first token),
    prefill_count: float = 0.0  # summed and counted
    prompt_tokens_sum: float = 0.0  # finished requests' prompt tokens, summed
    prompt_tokens_total: float = 0.0  # prompt tokens vLLM took in, and of them those its
    prompt_tokens_cached: float = 0.0  # prefix cache held (not computed)
    steps_total: float | None = None  # engine steps that gave outputs (None: not exported)
    #: the newest ``vllm:lora_requests_info`` sample (its labels and value), when vLLM serves LoRA
    lora_info: tuple[tuple[tuple[str, str], ...], float] | None = None
    #: ``vllm:admission_rejections_total`` by reason (``max_num_queued_reqs``,
    #: ``max_num_queued_tokens``), summed over its series; empty when vLLM exports none
    admission_rejections: tuple[tuple[str, float], ...] = ()
    engine: str = ""  # vLLM's ``engine`` label, in a per-engine snapshot
    per_engine: tuple[EngineSnapshot, ...] = ()  # data parallel: one per engine, in rank order
    #: ``cache_config_info``'s ``mamba_cache_mode`` (``none``, ``align``): how a hybrid model's
    #: recurrent-state layers hold blocks (``KVGeometry.build``); None where vLLM does not say
    mamba_cache_mode: str | None = None

    @property
    def state_cache_mode(self) -> str | None:
        """How a hybrid model's state layers hold blocks (``KVGeometry.build``): vLLM's
        ``mamba_cache_mode``; where it does not say, ``align`` under prefix caching (a state
        block more a request: the safe side), else None.

        >>> from dataclasses import replace
        >>> snap = EngineSnapshot(0.0, 16, 100, 1, 0.0, 0, 0.0, 0.0, None, True, None, True)
        >>> snap.state_cache_mode, replace(snap, mamba_cache_mode="none").state_cache_mode
        ('align', 'none')
        """
        if self.mamba_cache_mode is not None:
            return self.mamba_cache_mode
        return "align" if self.prefix_caching else None

    @property
    def pools(self) -> tuple[EngineSnapshot, ...]:
        """One snapshot per KV pool: each engine's, or this one when vLLM runs one engine."""
        return self.per_engine or (self,)

    @property
    def capacity_blocks(self) -> int | None:
        """Blocks vLLM can hand out to requests: the pool less one null block per engine."""
        if self.num_gpu_blocks is None:
            return None
        return max(0, self.num_gpu_blocks - self.engines)

    @property
    def used_blocks(self) -> int | None:
        """Blocks held by requests (and cached prefixes), from the reported usage."""
        capacity = self.capacity_blocks
        if capacity is None or self.kv_cache_usage is None:
            return None
        # usage is free-count based and exact up to float rounding, so round, never floor
        return min(capacity, max(0, round(self.kv_cache_usage * capacity)))

    def age(self, now: float) -> float:
        """Seconds since the scrape, given ``now`` on the same clock as ``taken_at``."""
        return now - self.taken_at


def parse_vllm_metrics(text: str, *, taken_at: float) -> EngineSnapshot:
    """Read vLLM's /metrics text into a snapshot stamped with the given times.

    Raises :class:`MetricsParseError` (and nothing else) when the text holds no vLLM metric
    this module reads, or when one of those lines is malformed.
    """
    try:
        return _parse(text, taken_at=taken_at)
    except MetricsParseError:
        raise
    except Exception as exc:  # the parser's errors are ValueErrors, but promise one type only
        raise MetricsParseError(one_line(f"unreadable vLLM metrics: {exc!r}")) from exc


def _parse(text: str, *, taken_at: float) -> EngineSnapshot:
    if not isinstance(text, str):
        raise MetricsParseError(f"expected str, got {type(text).__name__}")
    text = "\n" + text  # so that the first line matches the "\n" anchor too
    lines: list[str] = _WANTED_LINE.findall(text)
    if not lines:
        if _ANY_VLLM_SAMPLE.search(text):
            raise MetricsParseError("none of the vLLM metrics the sidecar reads is in the text")
        raise MetricsParseError("no vLLM metrics in the text (not vLLM's /metrics?)")

    if any(line.startswith("vllm:") for line in lines):
        # Never add both spellings of one metric: the relabelled one is only a fallback.
        lines = [line for line in lines if line.startswith("vllm:")]

    # canonical name -> engine -> labels of the first sample, and summed value
    by_name: dict[str, dict[str, _Sample]] = {}
    lora: tuple[tuple[tuple[str, str], ...], float] | None = None
    lengths: dict[float, float] = {}  # le -> cumulative count, over engines
    ended: dict[str, float] = {}  # finished_reason -> answers, over engines
    rejections: dict[str, float] = {}  # reason -> requests vLLM's queue caps refused
    old: dict[str, dict[str, _Sample]] = {}
    for line in lines:
        try:
            samples = _parse_line(line)
        except ValueError as exc:
            raise MetricsParseError(one_line(f"malformed line {line[:120]!r}: {exc}")) from exc
        for sample in samples:
            short = sample.name[5:]  # both accepted prefixes are five characters
            if short == _LORA_INFO:
                if math.isfinite(sample.value) and (lora is None or sample.value > lora[1]):
                    lora = (tuple(sorted(sample.labels.items())), sample.value)
            elif short == _ADMISSION_REJECTIONS:
                reason = sample.labels.get("reason", "")
                if math.isfinite(sample.value):
                    rejections[reason] = rejections.get(reason, 0.0) + sample.value
            elif short == _SUCCESS:
                reason = sample.labels.get("finished_reason", "")
                if math.isfinite(sample.value):
                    ended[reason] = ended.get(reason, 0.0) + sample.value
            elif short == _GENERATION_BUCKET:
                le = float(sample.labels.get("le", "nan"))
                if not math.isnan(le) and math.isfinite(sample.value):
                    lengths[le] = lengths.get(le, 0.0) + sample.value
            elif short in _OLD_NAMES:
                _add(old.setdefault(_OLD_NAMES[short], {}), sample.labels, sample.value)
            elif short in _WANTED:
                _add(by_name.setdefault(short, {}), sample.labels, sample.value)
    for name, samples_by_engine in old.items():
        by_name.setdefault(name, samples_by_engine)

    config = by_name.get(_CACHE_CONFIG, {})
    engines = sorted(
        {e for samples in by_name.values() for e in samples} - {_NO_ENGINE}, key=_rank_order
    )
    first_config = next(iter(config.values())).labels if config else {}
    blocks_per_engine = _blocks_per_engine(config, engines)
    per_engine: tuple[EngineSnapshot, ...] = ()
    if len(engines) > 1:
        per_engine = tuple(
            _engine_snapshot(by_name, e, blocks_per_engine, first_config, taken_at) for e in engines
        )
    num_gpu_blocks: int | None = None
    if blocks_per_engine and None not in blocks_per_engine.values():
        num_gpu_blocks = sum(b for b in blocks_per_engine.values() if b is not None)

    return EngineSnapshot(
        taken_at=taken_at,
        block_size=_label_int(first_config, "block_size"),
        num_gpu_blocks=num_gpu_blocks,
        engines=max(1, len(engines)),
        kv_cache_usage=_kv_usage(by_name.get(_KV_USAGE, {}), blocks_per_engine),
        running=round(_total(by_name, _RUNNING)),
        preemptions_total=_total(by_name, _PREEMPTIONS),
        generation_tokens_total=_total(by_name, _GENERATION_TOKENS),
        inter_token_latency_sum=_total(by_name, _ITL_SUM),
        inter_token_latency_count=_total(by_name, _ITL_COUNT),
        generation_lengths=tuple(sorted(lengths.items())),
        generation_lengths_sum=_total(by_name, _GENERATION_SUM)
        if _GENERATION_SUM in by_name
        else None,
        answers_at_length=ended.get("length", 0.0),
        answers_stopped=ended.get("stop", 0.0),
        prefill_seconds_sum=_total(by_name, _PREFILL_SUM),
        prefill_count=_total(by_name, _PREFILL_COUNT),
        prompt_tokens_sum=_total(by_name, _PROMPT_SUM),
        prompt_tokens_total=_total(by_name, _PROMPT_TOKENS),
        prompt_tokens_cached=_total(by_name, _PROMPT_CACHED),
        steps_total=_total(by_name, _STEPS) if _STEPS in by_name else None,
        cache_dtype=_label_str(first_config, "cache_dtype"),
        mamba_cache_mode=_label_str(first_config, "mamba_cache_mode"),
        prefix_caching=_label_bool(first_config, "enable_prefix_caching"),
        kv_cache_memory_bytes=_label_int(first_config, "kv_cache_memory_bytes"),
        has_cache_config=bool(config),
        per_engine=per_engine,
        lora_info=lora,
        admission_rejections=tuple(sorted(rejections.items())),
    )


def _rank_order(engine: str) -> tuple[int, str]:
    return (int(engine), "") if engine.isdigit() else (1 << 30, engine)


def _blocks_per_engine(config: Mapping[str, _Sample], engines: list[str]) -> dict[str, int | None]:
    """Each engine's ``num_gpu_blocks``. With several engines vLLM labels every one with their
    sum (all engines of a server share one cache config, into which its client adds each
    engine's count), so each engine's pool is the sum over the engine count (engines of one
    server have the same pool: same model, same memory settings)."""
    labelled = {e: _label_int(s.labels, "num_gpu_blocks") for e, s in config.items()}
    if len(engines) <= 1 or None in labelled.values() or len(labelled) != len(engines):
        return labelled
    total = max(b for b in labelled.values() if b is not None)
    return dict.fromkeys(labelled, total // len(engines))


def _engine_snapshot(
    by_name: Mapping[str, Mapping[str, _Sample]],
    engine: str,
    blocks_per_engine: Mapping[str, int | None],
    config: Mapping[str, str],
    taken_at: float,
) -> EngineSnapshot:
    def value(name: str) -> float:
        sample = by_name.get(name, {}).get(engine)
        return sample.value if sample is not None else 0.0

    usage = by_name.get(_KV_USAGE, {}).get(engine)
    return EngineSnapshot(
        taken_at=taken_at,
        block_size=_label_int(config, "block_size"),
        num_gpu_blocks=blocks_per_engine.get(engine),
        engines=1,
        kv_cache_usage=_clamp01(usage.value) if usage is not None else None,
        running=round(value(_RUNNING)),
        preemptions_total=value(_PREEMPTIONS),
        generation_tokens_total=value(_GENERATION_TOKENS),
        inter_token_latency_sum=value(_ITL_SUM),
        inter_token_latency_count=value(_ITL_COUNT),
        prefill_seconds_sum=value(_PREFILL_SUM),
        prefill_count=value(_PREFILL_COUNT),
        prompt_tokens_sum=value(_PROMPT_SUM),
        prompt_tokens_total=value(_PROMPT_TOKENS),
        prompt_tokens_cached=value(_PROMPT_CACHED),
        steps_total=value(_STEPS) if _STEPS in by_name else None,
        cache_dtype=_label_str(config, "cache_dtype"),
        mamba_cache_mode=_label_str(config, "mamba_cache_mode"),
        prefix_caching=_label_bool(config, "enable_prefix_caching"),
        kv_cache_memory_bytes=_label_int(config, "kv_cache_memory_bytes"),
        has_cache_config=bool(config),
        engine=engine,
    )


@functools.lru_cache(maxsize=64)
def _parse_line(line: str) -> tuple[Sample, ...]:
    # vllm:cache_config_info is one line of ~40 labels that prometheus_client takes ~0.8 ms to
    # parse, and it never changes while vLLM runs: memoising lines makes it free after the first
    # scrape. The other lines change with their values and simply miss. Callers must not mutate
    # the returned samples' label dicts.
    return tuple(s for family in text_string_to_metric_families(line) for s in family.samples)


@dataclass(slots=True)
class _Sample:
    labels: Mapping[str, str]
    value: float


def _add(per_engine: dict[str, _Sample], labels: Mapping[str, str], value: float) -> None:
    # A NaN or infinite sample carries no usable figure; treat it as absent.
    if not math.isfinite(value):
        return
    engine = labels.get(_ENGINE_LABEL, _NO_ENGINE)
    seen = per_engine.get(engine)
    if seen is None:
        per_engine[engine] = _Sample(labels, value)
    else:
        # Same metric, same engine, other labels (e.g. a future per-model split): add up.
        seen.value += value


def _total(by_name: Mapping[str, Mapping[str, _Sample]], name: str) -> float:
    return sum(s.value for s in by_name.get(name, {}).values())


def _kv_usage(
    usage: Mapping[str, _Sample], blocks_per_engine: Mapping[str, int | None]
) -> float | None:
    if not usage:
        return None
    if len(usage) == 1:
        return _clamp01(next(iter(usage.values())).value)
    # Each engine's fraction is of its own usable blocks (num_gpu_blocks - 1): weight by them so
    # that the result is the fraction of the summed pool. Without block counts, a plain mean.
    weights = [blocks_per_engine.get(e) for e in usage]
    if all(w is not None and w > 1 for w in weights):
        usable = [w - 1 for w in weights if w is not None]
        used = sum(s.value * u for s, u in zip(usage.values(), usable, strict=True))
        return _clamp01(used / sum(usable))
    return _clamp01(sum(s.value for s in usage.values()) / len(usage))


def _clamp01(value: float) -> float:
    return min(1.0, max(0.0, value))


def _label_str(labels: Mapping[str, str], key: str) -> str | None:
    value = labels.get(key)
    if value is None or value.strip() in ("", "None", "null"):
        return None
    return value


def _label_int(labels: Mapping[str, str], key: str) -> int | None:
    value = _label_str(labels, key)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        pass
    try:
        number = float(value)  # some versions render integers as "64.0"
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


def _label_bool(labels: Mapping[str, str], key: str) -> bool | None:
    value = _label_str(labels, key)
    if value is None:
        return None
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    return None
