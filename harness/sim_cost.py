"""The simulated engine's clock: a roofline cost model of one vLLM step on a named GPU.

Pure: no I/O, standard library only (the simulated executor imports it inside the vLLM venv).

What it owns:

- :class:`ModelShape`: a Hugging Face ``config.json`` read for its parameter count (dense,
  grouped-query, MLA and DeepSeek-style mixture of experts), the bytes its weights take per
  tensor-parallel rank, the KV bytes a token takes per rank, and attention's FLOPs per
  (query, key) pair.
- :func:`step_cost`: the time one engine step takes for the batch the scheduler made. A step is
  one forward pass over every scheduled token, and its kernels fall in two classes, run one
  after the other: the linear layers (GEMMs over all the step's tokens, which stream the
  weights once) and attention (each sequence reads its own KV). Each class is a roofline of
  its own, ``max(bytes / (bandwidth x efficiency), flops / (peak x efficiency))``, and the step
  is their **sum** plus tensor parallel's all-reduces and a fixed per-step overhead. A pure
  decode step then reduces to ``(weights + KV read) / bandwidth``; a pure prefill to
  ``(2 x params x tokens + attention's quadratic term) / compute``; a mixed step (chunked
  prefill) pays the weights once for all its tokens, which is what chunked prefill buys, while
  its attention parts add. Taking the max over the whole step instead would let the decode
  sequences' KV reads hide behind the prefill's GEMMs, which they do not (different kernels).
- :func:`memory_budget`: the KV-cache memory vLLM's GPU worker finds at startup:
  ``ceil(total x utilization) - weights - peak activations - non-torch/CUDA-graph memory``,
  with ``sidecar.kv.memory``'s estimates of the last two (the ones ``kv-sidecar plan --gpu``
  uses) and this model's parameter count for the weights.

- :class:`StepClock`: paces the steps in real time, ``time_scale`` wall seconds per simulated
  second (time dilation, ``KV_SIDECAR_SIM_TIME_SCALE``: a host CPU too slow for the engine's
  pace at hundreds of sequences gets ``time_scale`` times longer per step), hides the engine's
  own CPU time between two steps behind the previous step, and counts what it could not hide
  (``cpu_lag_seconds``). Its only I/O is the clock it is given (``time.monotonic`` and
  ``time.sleep`` unless a test passes others).

Every efficiency is a named constant below with its source; none is calibrated on a GPU yet.

>>> m = ModelShape.from_config({"hidden_size": 4096, "num_hidden_layers": 32,
...     "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
...     "vocab_size": 128256, "torch_dtype": "bfloat16"})
>>> round(m.params_total / 1e9, 2), m.kv_bytes_per_token(tp=1)
(8.03, 131072)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.gpus import GpuSpec
from sidecar.kv import memory as kv_memory
from sidecar.kv.memory import MemoryBudget

# --- efficiencies (fractions of the datasheet peaks) ---------------------------------------

#: Share of peak HBM bandwidth a decode step's weight and KV reads achieve. Databricks' "LLM
#: Inference Performance Engineering: Best Practices" (2023) defines model bandwidth
#: utilisation (MBU) and reports about 55-60% for 7B-70B models at small batch on A100/H100
#: with the serving stacks of the day; streaming microbenchmarks on H100 reach about 90% of
#: peak. 0.7 sits between what a server achieved then and what the memory can give.
HBM_EFFICIENCY = 0.7

#: Share of dense bf16 peak the linear layers' GEMMs achieve when compute-bound (prefill):
#: cuBLAS bf16 GEMMs of LLM shapes run at about 600-750 TFLOPS on an H100 SXM (60-75% of 989),
#: and end-to-end prefill MFU of 50-60% is what serving papers report (e.g. Sarathi-Serve,
#: Agrawal et al., OSDI 2024). 0.6.
LINEAR_FLOPS_EFFICIENCY = 0.6

#: Share of dense bf16 peak attention achieves when compute-bound: FlashAttention-2 reaches
#: 35-50% of peak on H100, FlashAttention-3 (Shah et al., 2024) up to 75% (740 TFLOPS) at
#: long sequences; vLLM uses FA3 or FlashInfer on Hopper, over mixed lengths. 0.5.
ATTENTION_FLOPS_EFFICIENCY = 0.5

#: Share of NVLink bandwidth an all-reduce achieves (NCCL's bus bandwidth on NVSwitch systems
#: is about 80% of the link rate in nccl-tests).
NVLINK_EFFICIENCY = 0.8

#: Latency of one small all-reduce within an NVSwitch node (NCCL, CUDA graphs): about 8 us.
#: A placeholder to be calibrated; it matters at tensor parallel 8 and small batches.
ALLREDUCE_LATENCY_SECONDS = 8e-6

#: Per-step time no roofline sees: sampling, input preparation and launch gaps that CUDA
#: graphs do not hide. A placeholder of 0.5 ms, to be calibrated on a GPU.
STEP_OVERHEAD_SECONDS = 0.0005

# --- memory at startup: sidecar.kv.memory's model (one source with `kv-sidecar plan --gpu`) ---

MODEL_DTYPE_BYTES = {"float32": 2, "float": 2, "float16": 2, "half": 2, "bfloat16": 2}
KV_DTYPE_BYTES = {
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}

#: DeepSeek-style config keys (``model_type`` deepseek_v2/v3) that mark an MLA attention.
_MLA_KEY = "kv_lora_rank"


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"model config: {key!r} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelShape:
    """A transformer's sizes as the cost model needs them (whole model, before any TP split)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    dtype_bytes: int
    # MLA (DeepSeek V2/V3): one latent of kv_lora_rank + rope dims per token and layer
    mla: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    q_lora_rank: int | None = None
    # DeepSeek-style mixture of experts (0 routed experts: dense)
    routed_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate: int = 0
    dense_layers: int = 0  # first_k_dense_replace: the first layers keep a dense MLP

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        cfg: Mapping[str, Any] = config.get("text_config") or config
        dtype = str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))).removeprefix("torch.")
        if dtype not in MODEL_DTYPE_BYTES:
            raise ValueError(f"model config: unknown dtype {dtype!r}")
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        common = dict(
            layers=_int(cfg, "num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            intermediate=_int(cfg, "intermediate_size"),
            vocab=_int(cfg, "vocab_size"),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype_bytes=MODEL_DTYPE_BYTES[dtype],  # vLLM runs float32 configs in bf16
        )
        moe: dict[str, Any] = {}
        if cfg.get("n_routed_experts"):
            moe = dict(
                routed_experts=_int(cfg, "n_routed_experts"),
                experts_per_token=_int(cfg, "num_experts_per_tok"),
                shared_experts=_int(cfg, "n_shared_experts", 0),
                moe_intermediate=_int(cfg, "moe_intermediate_size"),
                dense_layers=_int(cfg, "first_k_dense_replace", 0),
            )
        if cfg.get(_MLA_KEY) is not None:
            nope = _int(cfg, "qk_nope_head_dim")
            rope = _int(cfg, "qk_rope_head_dim")
            q_lora = cfg.get("q_lora_rank")
            return cls(
                **common,
                kv_heads=1,
                qk_head_dim=nope + rope,
                v_head_dim=_int(cfg, "v_head_dim"),
                mla=True,
                kv_lora_rank=_int(cfg, _MLA_KEY),
                qk_rope_head_dim=rope,
                qk_nope_head_dim=nope,
                q_lora_rank=int(q_lora) if q_lora else None,
                **moe,
            )
        head_dim = cfg.get("head_dim") or hidden // heads
        return cls(
            **common,
            kv_heads=_int(cfg, "num_key_value_heads", heads),
            qk_head_dim=int(head_dim),
            v_head_dim=int(head_dim),
            **moe,
        )

    # --- parameters ---

    @property
    def attention_params_per_layer(self) -> int:
        h, n = self.hidden, self.heads
        if self.mla:
            q_out = n * self.qk_head_dim
            q = (
                h * q_out
                if self.q_lora_rank is None
                else h * self.q_lora_rank + (self.q_lora_rank * q_out)
            )
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + n * self.v_head_dim * h
        q = h * n * self.qk_head_dim
        kv = 2 * h * self.kv_heads * self.qk_head_dim
        return q + kv + n * self.v_head_dim * h

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate  # gate, up, down

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.routed_experts else 0

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def _always_read_params(self) -> int:
        """Parameters every token touches: embeddings, attention, dense and shared MLPs."""
        dense_mlps = (self.layers - self.moe_layers) * self.dense_mlp_params
        shared = self.moe_layers * (
            self.shared_experts * self.expert_params + self.hidden * self.routed_experts
        )
        return (
            self.embedding_params
            + self.layers * self.attention_params_per_layer
            + (dense_mlps + shared)
        )

    @property
    def params_total(self) -> int:
        return self._always_read_params + self.moe_layers * self.routed_experts * (
            self.expert_params
        )

    @property
    def params_active(self) -> int:
        """Parameters one token's forward pass multiplies (its routed experts only)."""
        return self._always_read_params + self.moe_layers * self.experts_per_token * (
            self.expert_params
        )

    def weights_bytes(self, tp: int = 1) -> int:
        """Weights one tensor-parallel rank holds (vLLM shards embeddings and experts too)."""
        return math.ceil(self.params_total * self.dtype_bytes / tp)

    def weights_bytes_read(self, tokens: int, tp: int = 1) -> float:
        """Weight bytes one rank streams for a forward pass over ``tokens`` tokens.

        A dense model reads all of them. A mixture of experts reads only the experts some token
        was routed to: with uniform routing of ``k`` of ``E`` experts, a layer touches
        ``E x (1 - (1 - k/E) ** tokens)`` experts in expectation.
        """
        if tokens <= 0:
            return 0.0
        experts = 0.0
        if self.routed_experts:
            e, k = self.routed_experts, self.experts_per_token
            experts = self.moe_layers * e * (1 - (1 - k / e) ** tokens) * self.expert_params
        return (self._always_read_params + experts) * self.dtype_bytes / tp

    # --- KV and attention ---

    def kv_bytes_per_token(self, tp: int = 1, kv_dtype_bytes: int | None = None) -> int:
        """KV bytes one token takes on one rank, all layers (MLA's latent is not TP-split)."""
        elem = self.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        if self.mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * elem
        per_rank = max(1, self.kv_heads // tp)
        return self.layers * per_rank * (self.qk_head_dim + self.v_head_dim) * elem

    def attention_flops_per_pair(self, tp: int = 1) -> float:
        """FLOPs of one (query, key) pair over all layers on one rank: Q.K and P.V."""
        return 2.0 * self.layers * (self.heads / tp) * (self.qk_head_dim + self.v_head_dim)

    def mlp_width(self, tp: int = 1) -> int:
        """The widest MLP activation per token on one rank (gate and up), for the profile."""
        moe = self.experts_per_token * self.moe_intermediate if self.routed_experts else 0
        return math.ceil(2 * max(self.intermediate, moe) / tp)


@dataclass(frozen=True)
class SeqWork:
    """One request's share of a step: tokens it computes now, tokens already in its KV."""

    new_tokens: int
    context_tokens: int


@dataclass(frozen=True)
class StepCost:
    """One step's time and where it goes."""

    linear_seconds: float
    attention_seconds: float
    allreduce_seconds: float
    overhead_seconds: float
    weight_bytes: float
    kv_bytes: float
    linear_flops: float
    attention_flops: float

    @property
    def seconds(self) -> float:
        return (
            self.linear_seconds
            + self.attention_seconds
            + self.allreduce_seconds
            + self.overhead_seconds
        )


def attention_pairs(work: SeqWork) -> int:
    """Causal (query, key) pairs: each new token attends to the context and the new tokens
    before it, itself included."""
    q, c = work.new_tokens, work.context_tokens
    return q * c + q * (q + 1) // 2


def step_cost(
    model: ModelShape,
    gpu: GpuSpec,
    batch: Sequence[SeqWork],
    *,
    tp: int = 1,
    kv_dtype_bytes: int | None = None,
) -> StepCost:
    """The time one engine step takes on ``gpu`` for ``batch`` (see the module docstring)."""
    tokens = sum(w.new_tokens for w in batch if w.new_tokens > 0)
    if tokens == 0:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    bw = gpu.hbm_bytes_per_second * HBM_EFFICIENCY
    weight_bytes = model.weights_bytes_read(tokens, tp)
    linear_flops = 2.0 * model.params_active * tokens / tp
    linear = max(
        weight_bytes / bw,
        linear_flops / (gpu.bf16_dense_flops_per_second * LINEAR_FLOPS_EFFICIENCY),
    )
    per_token = model.kv_bytes_per_token(tp, kv_dtype_bytes)
    # each sequence reads its whole context and writes its new tokens' KV once
    kv_bytes = float(sum((w.context_tokens + w.new_tokens) * per_token for w in batch))
    attention_flops = model.attention_flops_per_pair(tp) * sum(attention_pairs(w) for w in batch)
    attention = max(
        kv_bytes / bw,
        attention_flops / (gpu.bf16_dense_flops_per_second * ATTENTION_FLOPS_EFFICIENCY),
    )
    allreduce = 0.0
    if tp > 1:
        # two all-reduces per layer (after attention, after the MLP) of tokens x hidden;
        # a ring all-reduce moves 2 (tp - 1) / tp of the buffer through each GPU's links
        volume = tokens * model.hidden * model.dtype_bytes * 2 * (tp - 1) / tp
        per_reduce = volume / (gpu.nvlink_bytes_per_second * NVLINK_EFFICIENCY)
        allreduce = 2 * model.layers * (ALLREDUCE_LATENCY_SECONDS + per_reduce)
    return StepCost(
        linear_seconds=linear,
        attention_seconds=attention,
        allreduce_seconds=allreduce,
        overhead_seconds=STEP_OVERHEAD_SECONDS,
        weight_bytes=weight_bytes,
        kv_bytes=kv_bytes,
        linear_flops=linear_flops,
        attention_flops=attention_flops,
    )


def memory_budget(
    model: ModelShape,
    gpu: GpuSpec,
    *,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> MemoryBudget:
    """KV-cache memory per rank as vLLM's ``Worker.determine_available_memory`` finds it.

    ``requested = ceil(total x utilization)`` (vLLM's ``request_memory``), minus the weights,
    the profile run's peak activations (a forward over ``max_num_batched_tokens`` tokens: the
    widest MLP activation and a few hidden-size buffers per token; the sampler's fp32 logits
    for ``max_num_seqs`` rows) and the non-torch / CUDA-graph memory.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization}")
    return kv_memory.memory_budget(
        gpu.memory_bytes,
        gpu_memory_utilization,
        weights_bytes=model.weights_bytes(tp),
        activation_bytes=kv_memory.activation_peak_bytes(
            mlp_width=model.mlp_width(tp),
            hidden=model.hidden,
            vocab=model.vocab,
            dtype_bytes=model.dtype_bytes,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        ),
    )


# --- pacing steps in real time --------------------------------------------------------------

#: The environment variable the simulated executor reads its time scale from.
ENV_TIME_SCALE = "KV_SIDECAR_SIM_TIME_SCALE"


def parse_time_scale(value: str | float | None) -> float:
    """A time scale (wall seconds per simulated second): a positive finite number; empty or
    ``None`` is 1 (real time)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return 1.0
    try:
        scale = float(value)
    except ValueError:
        raise ValueError(f"time scale must be a number, got {value!r}") from None
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"time scale must be positive and finite, got {value!r}")
    return scale


class StepClock:
    """Real time for simulated steps: each step of ``seconds`` simulated seconds ends
    ``seconds x time_scale`` wall seconds after it could start.

    A step "could start" when the previous one ended, as long as the engine's own CPU work in
    between (output processing, scheduling: the time from the previous step's end to this
    step's arrival) fits in the previous step's wall time; vLLM's async scheduling hides it so
    on a GPU, and the CPU platform turns async scheduling off. What does not fit is this
    machine's CPU setting the clock: counted in ``cpu_lag_seconds`` (wall seconds) when the
    engine was busy across the gap (``busy``: some request went on after the previous step).

    With ``time_scale`` X the whole engine runs X times slower than the simulated GPU, so that
    X times more CPU time fits between two steps; a client's wall durations divided by X are
    simulated GPU seconds (``cpu_lag_seconds / X`` is the lag in those terms).
    """

    def __init__(
        self,
        time_scale: float = 1.0,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.time_scale = parse_time_scale(time_scale)
        self._monotonic = monotonic
        self._sleep = sleep
        self.cpu_lag_seconds = 0.0
        self._prev_end = 0.0
        self._prev_wall = 0.0

    def set_time_scale(self, time_scale: float | str) -> None:
        self.time_scale = parse_time_scale(time_scale)

    def pace(self, arrived: float, seconds: float, *, busy: bool) -> float:
        """Sleep until the step that arrived at ``arrived`` (this clock's ``monotonic``) and
        takes ``seconds`` simulated seconds is over; the wall seconds it was given."""
        wall = seconds * self.time_scale
        gap = arrived - self._prev_end
        hidden = min(max(gap, 0.0), self._prev_wall)
        end = arrived - hidden + wall
        now = self._monotonic()
        if end > now:
            self._sleep(end - now)
        actual_end = max(end, now)
        if busy:  # a GPU would have started this step as the previous one ended
            self.cpu_lag_seconds += max(0.0, actual_end - (self._prev_end + wall))
        self._prev_end = actual_end
        self._prev_wall = wall
        return wall


class StepGate:
    """Manual stepping: a step runs only when granted; the test side waits for steps to run.

    ``manual`` off (a free-running mode), ``acquire`` returns at once: switching modes at run
    time releases a step that was waiting for a grant.
    """

    def __init__(self, manual: bool) -> None:
        self._cond = threading.Condition()
        self.manual = manual
        self.granted = 0
        self.steps = 0
        self.waiting = False

    def set_manual(self, manual: bool) -> None:
        with self._cond:
            self.manual = manual
            self.granted = 0
            self._cond.notify_all()

    def acquire(self) -> None:
        with self._cond:
            self.waiting = True
            self._cond.notify_all()
            while self.manual and self.granted == 0:
                self._cond.wait()
            if self.manual:
                self.granted -= 1
            self.waiting = False

    def finished_step(self) -> None:
        with self._cond:
            self.steps += 1
            self._cond.notify_all()

    def grant(self, n: int, timeout: float) -> bool:
        """Let ``n`` more steps run; True once they have (False at the timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self.steps + self.granted + n
            self.granted += n
            self._cond.notify_all()
            while self.steps < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True
