"""What ``vllm serve`` refuses at startup, checked before anything is deployed, and the flags a
plan assumed.

Each check follows vLLM 0.32's own and says which rule it is:

- :func:`check_tensor_parallel`: ``ModelConfig.verify_with_parallel_config``
  (``vllm/config/model.py``): the attention heads must divide by the tensor parallel size; and
  the attention layers' own rule (``LlamaAttention``, ``Qwen2Attention`` and the others in
  ``vllm/model_executor/models/``): KV heads at least as many as the ranks divide evenly among
  them, fewer are replicated, so the ranks must then be a multiple of them. MLA models (one
  latent, no KV heads) have the first rule only.
- :func:`resolve_max_model_len`: ``_get_and_verify_max_len``: ``--max-model-len`` above the
  length derived from the config (``max_position_embeddings`` and its relatives, RoPE scaling)
  is refused unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``.
- :func:`check_one_sequence_fits`: ``check_enough_kv_cache_memory``
  (``vllm/v1/core/kv_cache_utils.py``): the KV memory, less the one block the pool holds back,
  must hold one request of ``max_model_len`` tokens in every layer, else vLLM refuses to start
  with its estimate of the longest length that would fit.

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.errors import GeometryError
from sidecar.kv.geometry import (
    GIB,
    KVGeometry,
    cdiv,
    derived_max_model_len_and_key,
    text_config,
)

_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num")


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _tp_ok(tp: int, heads: int, kv_heads: int | None) -> bool:
    if heads % tp:
        return False
    if kv_heads is None:
        return True
    return kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0


def check_tensor_parallel(config: Mapping[str, Any], tensor_parallel_size: int) -> None:
    """Refuse a tensor parallel size vLLM refuses for this model (see the module docstring)."""
    cfg = text_config(config)
    heads = cfg.get("num_attention_heads")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
        return  # ModelKV.from_config says what is wrong with it
    tp = tensor_parallel_size
    kv_heads: int | None = None
    if cfg.get("kv_lora_rank") is None:  # MLA has no KV heads to split
        kv_heads = next((int(cfg[k]) for k in _KV_HEAD_KEYS if cfg.get(k) is not None), heads)
    if _tp_ok(tp, heads, kv_heads):
        return
    valid = [n for n in range(1, min(heads, 64) + 1) if _tp_ok(n, heads, kv_heads)]
    hint = f"; sizes that work: {', '.join(map(str, valid))}"
    if heads % tp:
        raise GeometryError(
            f"tensor parallel size {tp} does not divide the model's {heads} attention heads; "
            f"vLLM refuses it (Total number of attention heads ({heads}) must be divisible by "
            f"tensor parallel size ({tp})){hint}"
        )
    assert kv_heads is not None
    rule = (
        f"{kv_heads} KV heads do not split evenly over {tp} ranks"
        if kv_heads >= tp
        else f"{tp} ranks are not a multiple of the {kv_heads} KV heads they replicate"
    )
    raise GeometryError(
        f"tensor parallel size {tp}: {rule}; vLLM's attention layers refuse it{hint}"
    )


def resolve_max_model_len(
    config: Mapping[str, Any],
    max_model_len: int | None,
    *,
    tokenizer_model_max_length: int | None = None,
    allow_long: bool = False,
) -> int:
    """The max model length vLLM would run with: the derived one when none is given (for
    LongRoPE models, ``original_max_position_embeddings``, as vLLM defaults them), the given one
    when the model allows it; a given one above the derived length is refused unless
    ``allow_long`` (vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``)."""
    cfg = text_config(config)
    derived, key = derived_max_model_len_and_key(cfg, tokenizer_model_max_length)
    if max_model_len is None or max_model_len == -1:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        if isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type")) == "longrope":
            original = cfg.get("original_max_position_embeddings")
            if isinstance(original, int) and original > 0:
                return original
        return derived
    if max_model_len <= 0:
        raise GeometryError(f"max model len must be positive, got {max_model_len}")
    if max_model_len > derived and not allow_long:
        said = f"{key}={derived:,}" if key else f"{derived:,}, vLLM's default without one"
        raise GeometryError(
            f"--max-model-len {max_model_len:,} is above what the model allows ({said} in its "
            f"config, RoPE scaling included); vLLM refuses it unless "
            f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (positions past it give NaN or out-of-bounds errors)"
        )
    return max_model_len


def needed_bytes(geo: KVGeometry) -> int:
    """KV bytes one request of ``geo.max_model_len`` tokens takes across this rank's layers
    (vLLM's ``max_memory_usage_bytes``: each layer's blocks at that length, window-capped)."""
    pages = cdiv(geo.max_model_len, geo.block_size)
    return sum(
        (pages if cap is None else min(pages, cap)) * geo.page_bytes * group.num_layers
        for group, cap in zip(geo.groups, geo.group_caps, strict=True)
    )


def _rebuilt(geo: KVGeometry, max_model_len: int) -> KVGeometry:
    return dataclasses.replace(geo, max_model_len=max_model_len)


def estimate_max_model_len(geo: KVGeometry, available_bytes: int) -> int:
    """The longest max model length whose one request fits ``available_bytes`` (vLLM's
    ``estimate_max_model_len``: a binary search up to the configured length); 0 if none."""
    lo, hi = 1, geo.max_model_len
    if needed_bytes(_rebuilt(geo, lo)) > available_bytes:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if needed_bytes(_rebuilt(geo, mid)) <= available_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_one_sequence_fits(geo: KVGeometry, kv_cache_bytes: int) -> None:
    """Refuse a pool too small for one request of ``max_model_len`` tokens, as vLLM does."""
    usable = kv_cache_bytes - geo.bytes_per_block  # the null block the pool holds back
    if usable <= 0:
        raise GeometryError(
            f"no memory left for the KV cache: {_gib(kv_cache_bytes)} per rank is not more "
            f"than one block ({geo.bytes_per_block:,} B); vLLM refuses to start (No available "
            "memory for the cache blocks)"
        )
    needed = needed_bytes(geo)
    if needed <= usable:
        return
    longest = estimate_max_model_len(geo, usable)
    fits = f"; the longest that fits is {longest:,}" if longest else ""
    raise GeometryError(
        f"the KV cache cannot hold one request of --max-model-len {geo.max_model_len:,}: it "
        f"needs {_gib(needed)}, {_gib(usable)} is available per rank; vLLM refuses to start "
        f"(To serve at least one request with the model's max seq len ({geo.max_model_len}), "
        f"... KV cache is needed, which is larger than the available KV cache memory){fits}; "
        "lower --max-model-len, raise --gpu-memory-utilization, add GPUs (-tp) or use "
        "--kv-cache-dtype fp8"
    )


def serve_args(
    *,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    max_model_len: int,
    block_size: int,
    kv_cache_dtype: str,
    dtype: str,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_concurrent_batches: int,
    gpu_memory_utilization: float | None,
    kv_cache_memory_bytes: int | None,
) -> list[str]:
    """The ``vllm serve`` flags a plan's figures assume, in vLLM's spelling."""
    args = ["--tensor-parallel-size", str(tensor_parallel_size)]
    if pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(pipeline_parallel_size)]
    args += ["--max-model-len", str(max_model_len), "--block-size", str(block_size)]
    args += ["--kv-cache-dtype", kv_cache_dtype]
    if dtype != "auto":
        args += ["--dtype", dtype]
    if kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    elif gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", repr(gpu_memory_utilization)]
    args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    args += ["--max-num-seqs", str(max_num_seqs)]
    if max_concurrent_batches == 1:
        args.append("--no-async-scheduling")
    return args


def shell_line(model: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """``[ENV=1 ]vllm serve MODEL ARGS...`` on one line, quoted where a shell needs it."""
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    return prefix + " ".join(shlex.quote(a) for a in ["vllm", "serve", model, *args])
