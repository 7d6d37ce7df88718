"""The KV-cache memory one GPU rank gets, as vLLM's GPU worker finds it at startup.

vLLM 0.32 (``Worker.determine_available_memory`` in ``vllm/v1/worker/gpu_worker.py``,
``request_memory`` in ``vllm/v1/worker/utils.py``, ``memory_profiling`` in
``vllm/utils/mem_utils.py``) computes, per rank::

    requested = ceil(total x gpu_memory_utilization)
    KV cache  = requested - non_kv_cache_memory - cudagraph_memory_estimate
    non_kv_cache_memory = total_consumed (weights, non-torch memory: CUDA context, cuBLAS and
                          NCCL workspaces, persistent buffers) + the profile run's transient
                          torch peak (activations of one forward over max_num_batched_tokens
                          tokens, and the sampler's logits for max_num_seqs rows)

vLLM measures all of it on the GPU; :func:`memory_budget` models it:

- ``total``: the driver's figure for the GPU (``sidecar.kv.gpus``), or what the caller says;
  ``requested`` follows exactly.
- weights: the checkpoint's tensor bytes (``model.safetensors.index.json``'s
  ``metadata.total_size``, else the ``*.safetensors`` files' sizes), or a parameter count from
  ``config.json`` (:class:`ModelSize`) times the dtype's bytes; divided by tensor (and pipeline)
  parallelism. vLLM's own figure is the memory the loaded model takes; the checkpoint's bytes
  are close to it in the same dtype, the config's count ignores norms and biases.
- activation peak: an estimate (:func:`activation_peak_bytes`), not a profile.
- non-torch and CUDA-graph memory: a constant (:data:`NON_TORCH_AND_CUDA_GRAPH_BYTES`).

The simulated engine (``harness.sim_cost.memory_budget``) sizes its pool with these same
functions, so its pool and ``kv-sidecar plan --gpu`` agree by construction; a real GPU's
startup log ("Available KV cache memory") is the figure to check them against.

Standard library only: the simulated executor imports this inside vLLM's venv.

>>> m = ModelSize.from_config({"hidden_size": 4096, "num_hidden_layers": 32,
...     "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
...     "vocab_size": 128256})
>>> round(m.params_total / 1e9, 2)
8.03
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.errors import GeometryError
from sidecar.kv.geometry import GIB, MODEL_DTYPE_BYTES, text_config

#: Memory vLLM's profile counts besides weights and activations: the non-torch increase
#: (cuBLAS/NCCL workspaces) and the CUDA-graph estimate it subtracts since v0.21
#: (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, on by default). Both are typically a few
#: hundred MiB in published startup logs; 1 GiB together is a rounded guess.
NON_TORCH_AND_CUDA_GRAPH_BYTES = 1 * GIB

#: The sampler's profile run holds fp32 logits for ``max_num_seqs`` rows over the vocabulary,
#: and a second copy of them (log-probs / the sorted copy of top-p).
LOGITS_COPIES = 2

INDEX_FILE = "model.safetensors.index.json"


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise GeometryError(f"cannot estimate the model's size: its config is missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GeometryError(f"{key!r} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelSize:
    """A transformer's parameter count from its config: embeddings, attention (GQA, MHA, MQA or
    DeepSeek's MLA), dense MLPs and mixtures of experts (DeepSeek's ``n_routed_experts``,
    Qwen's ``num_experts``, Mixtral's and GPT-OSS's ``num_local_experts``). Norms and biases are
    left out (well under 0.1% of a 7B model)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    # MLA (DeepSeek V2/V3): q (optionally through a LoRA rank), a shared KV latent, its up-proj
    mla: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    q_lora_rank: int | None = None
    # mixture of experts (0 routed experts: dense)
    routed_experts: int = 0
    experts_per_token: int = 0
    shared_intermediate: int = 0  # the shared experts' MLP width together
    moe_intermediate: int = 0
    moe_layers: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelSize:
        cfg = text_config(config)
        layers = _int(cfg, "num_hidden_layers")
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        if heads == 0:
            raise GeometryError("'num_attention_heads' must be a positive integer, got 0")
        common: dict[str, Any] = dict(
            layers=layers,
            hidden=hidden,
            heads=heads,
            # a mixture of experts may have no dense MLP width at all
            intermediate=_int(cfg, "intermediate_size", 0 if _is_moe(cfg) else None),
            vocab=_int(cfg, "vocab_size"),
            tied_embeddings=_tied(cfg),
            **_moe(cfg, layers),
        )
        if cfg.get("kv_lora_rank") is not None:
            nope = _int(cfg, "qk_nope_head_dim")
            rope = _int(cfg, "qk_rope_head_dim")
            q_lora = cfg.get("q_lora_rank")
            return cls(
                **common,
                kv_heads=1,
                qk_head_dim=nope + rope,
                v_head_dim=_int(cfg, "v_head_dim"),
                mla=True,
                kv_lora_rank=_int(cfg, "kv_lora_rank"),
                qk_rope_head_dim=rope,
                qk_nope_head_dim=nope,
                q_lora_rank=int(q_lora) if q_lora else None,
            )
        head_dim = cfg.get("head_dim") or hidden // heads
        kv_heads = next(
            (
                cfg[k]
                for k in ("n_head_kv", "num_kv_heads", "num_key_value_heads")
                if cfg.get(k) is not None
            ),
            heads,
        )
        return cls(
            **common, kv_heads=int(kv_heads), qk_head_dim=int(head_dim), v_head_dim=int(head_dim)
        )

    @property
    def attention_params_per_layer(self) -> int:
        h, n = self.hidden, self.heads
        if self.mla:
            q_out = n * self.qk_head_dim
            q = h * q_out if self.q_lora_rank is None else (h + q_out) * self.q_lora_rank
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + n * self.v_head_dim * h
        q = h * n * self.qk_head_dim
        kv = 2 * h * self.kv_heads * self.qk_head_dim
        return q + kv + n * self.v_head_dim * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params_total(self) -> int:
        """Every parameter: embeddings (and the LM head unless tied), attention, MLPs, experts."""
        mlp = 3 * self.hidden  # gate, up and down per unit of MLP width
        dense = (self.layers - self.moe_layers) * mlp * self.intermediate
        moe = self.moe_layers * (
            mlp * self.shared_intermediate
            + self.hidden * self.routed_experts  # the router
            + self.routed_experts * mlp * self.moe_intermediate
        )
        return self.embedding_params + self.layers * self.attention_params_per_layer + dense + moe

    def mlp_width(self, tp: int = 1) -> int:
        """The widest MLP activation per token on one rank (gate and up), for the profile."""
        moe = self.experts_per_token * self.moe_intermediate if self.routed_experts else 0
        return math.ceil(2 * max(self.intermediate, moe) / tp)


def _tied(cfg: Mapping[str, Any]) -> bool:
    """Whether the LM head reuses the embedding matrix; when the config does not say, as the
    model's transformers config class defaults it (Gemma's tied, Llama's, Qwen's, Mistral's
    and most others' not)."""
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        return str(cfg.get("model_type", "")).startswith("gemma")
    return bool(tied)


def _is_moe(cfg: Mapping[str, Any]) -> bool:
    return any(cfg.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts"))


def _moe(cfg: Mapping[str, Any], layers: int) -> dict[str, int]:
    if cfg.get("n_routed_experts"):  # DeepSeek V2/V3 and relatives
        moe_inter = _int(cfg, "moe_intermediate_size")
        dense = _int(cfg, "first_k_dense_replace", 0)
        return dict(
            routed_experts=_int(cfg, "n_routed_experts"),
            experts_per_token=_int(cfg, "num_experts_per_tok"),
            shared_intermediate=_int(cfg, "n_shared_experts", 0) * moe_inter,
            moe_intermediate=moe_inter,
            moe_layers=layers - min(dense, layers),
        )
    if cfg.get("num_experts"):  # Qwen2-MoE, Qwen3-MoE
        step = _int(cfg, "decoder_sparse_step", 1) or 1
        dense_only = set(cfg.get("mlp_only_layers") or [])
        sparse = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        return dict(
            routed_experts=_int(cfg, "num_experts"),
            experts_per_token=_int(cfg, "num_experts_per_tok"),
            shared_intermediate=_int(cfg, "shared_expert_intermediate_size", 0),
            moe_intermediate=_int(cfg, "moe_intermediate_size"),
            moe_layers=sparse,
        )
    if cfg.get("num_local_experts"):  # Mixtral, GPT-OSS: every layer, experts of intermediate_size
        return dict(
            routed_experts=_int(cfg, "num_local_experts"),
            experts_per_token=_int(cfg, "num_experts_per_tok", cfg.get("experts_per_token")),
            moe_intermediate=_int(cfg, "intermediate_size"),
            moe_layers=layers,
        )
    return {}


@dataclass(frozen=True)
class Weights:
    """The whole model's weight bytes as vLLM would load them, and where the figure came from."""

    total_bytes: int
    source: str

    def per_rank(self, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> int:
        """One rank's share: an even split across tensor and pipeline parallelism (vLLM shards
        the embeddings and the experts too; norms, and KV heads replicated when the tensor
        parallel size exceeds them, are not counted twice here)."""
        return math.ceil(self.total_bytes / (tensor_parallel_size * pipeline_parallel_size))


def _checkpoint_bytes(model_dir: Path) -> tuple[int, str] | None:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            total = json.loads(index.read_text(encoding="utf-8"))["metadata"]["total_size"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise GeometryError(f"cannot read metadata.total_size from {index}: {exc}") from None
        if isinstance(total, bool) or not isinstance(total, (int, float)) or total <= 0:
            raise GeometryError(f"{index}: metadata.total_size must be positive, got {total!r}")
        return int(total), f"{INDEX_FILE} metadata.total_size"
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        # each file's size includes its JSON header (kilobytes): a slight overcount
        return sum(f.stat().st_size for f in files), f"{len(files)} *.safetensors file(s)"
    return None


def model_weights(
    config: Mapping[str, Any], model_dtype: str, model_dir: Path | None = None
) -> Weights:
    """The model's weight bytes: the checkpoint's in ``model_dir`` if it has one, else the
    parameter count from ``config`` times ``model_dtype``'s bytes.

    A float32 checkpoint that vLLM loads in 16 bits counts half its bytes (and so on for any
    other change of dtype); a quantized checkpoint (``quantization_config``) counts its files as
    they are, and its config estimate is flagged as the unquantized size.
    """
    cfg = text_config(config)
    element = MODEL_DTYPE_BYTES[model_dtype]
    quantized = config.get("quantization_config") or cfg.get("quantization_config")
    found = _checkpoint_bytes(model_dir) if model_dir is not None else None
    if found is not None:
        total, source = found
        raw = str(cfg.get("torch_dtype", cfg.get("dtype")) or "").removeprefix("torch.")
        stored = MODEL_DTYPE_BYTES.get(raw)
        if not quantized and stored is not None and stored != element:
            total = total * element // stored
            source += f" ({raw} checkpoint loaded as {model_dtype})"
        return Weights(total, source)
    size = ModelSize.from_config(config)
    source = f"estimated from config.json: {size.params_total / 1e9:,.2f}B parameters x {element} B"
    if quantized:
        source += " (unquantized: the config has a quantization_config; pass --weights-gib)"
    return Weights(size.params_total * element, source)


def activation_peak_bytes(
    *,
    mlp_width: int,
    hidden: int,
    vocab: int,
    dtype_bytes: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> int:
    """The profile run's transient peak on one rank, estimated: a forward over
    ``max_num_batched_tokens`` tokens holds the widest MLP activation on the rank (gate and up:
    ``mlp_width``, :meth:`ModelSize.mlp_width`) and four hidden-size buffers per token; the
    sampler holds fp32 logits for ``max_num_seqs`` rows (:data:`LOGITS_COPIES` copies)."""
    per_token = (mlp_width + 4 * hidden) * dtype_bytes
    logits = LOGITS_COPIES * max_num_seqs * vocab * 4
    return max_num_batched_tokens * per_token + logits


def requested_memory(total_bytes: int, gpu_memory_utilization: float) -> int:
    """vLLM's ``request_memory``: ``ceil(total x gpu_memory_utilization)``."""
    if total_bytes <= 0:
        raise GeometryError(f"GPU memory must be positive, got {total_bytes} bytes")
    if not 0 < gpu_memory_utilization <= 1:
        raise GeometryError(
            f"GPU memory utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    return math.ceil(total_bytes * gpu_memory_utilization)


@dataclass(frozen=True)
class MemoryBudget:
    """What vLLM's GPU worker finds at startup, per rank, in bytes."""

    total_bytes: int
    requested_bytes: int
    weights_bytes: int
    activation_bytes: int
    other_bytes: int

    @property
    def non_kv_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.other_bytes

    @property
    def kv_cache_bytes(self) -> int:
        return self.requested_bytes - self.non_kv_bytes


def memory_budget(
    total_bytes: int,
    gpu_memory_utilization: float,
    *,
    weights_bytes: int,
    activation_bytes: int,
    other_bytes: int = NON_TORCH_AND_CUDA_GRAPH_BYTES,
) -> MemoryBudget:
    """One rank's budget: ``ceil(total x utilization)`` less weights, activations and the rest
    (the KV share may come out negative: the caller says what vLLM would)."""
    for name, value in (
        ("weights", weights_bytes),
        ("activation", activation_bytes),
        ("other", other_bytes),
    ):
        if value < 0:
            raise GeometryError(f"{name} memory must not be negative, got {value} bytes")
    return MemoryBudget(
        total_bytes=total_bytes,
        requested_bytes=requested_memory(total_bytes, gpu_memory_utilization),
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        other_bytes=other_bytes,
    )


def kv_cache_memory_bytes(
    gpu_memory_gib: float, gpu_memory_utilization: float, weights_gib: float
) -> int:
    """Memory left for the KV cache: total x utilization - weights (and other fixed memory)."""
    if gpu_memory_gib <= 0:
        raise GeometryError(f"GPU memory must be positive, got {gpu_memory_gib}")
    if not 0 < gpu_memory_utilization <= 1:
        raise GeometryError(
            f"GPU memory utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    if weights_gib < 0:
        raise GeometryError(f"weights size must not be negative, got {weights_gib}")
    available = gpu_memory_gib * gpu_memory_utilization - weights_gib
    if available <= 0:
        raise GeometryError(
            f"no memory left for the KV cache: {gpu_memory_gib} GiB x {gpu_memory_utilization}"
            f" - {weights_gib} GiB of weights = {available:.2f} GiB"
        )
    return math.floor(available * GIB)
