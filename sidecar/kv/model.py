"""A model's KV figures as vLLM 0.32 reads them from a Hugging Face config: bytes per token and
layer (standard attention, MLA, the cache dtypes), each layer's kind (``sidecar.kv.layers``), the
context length vLLM derives, and how pipeline parallelism splits the layers. How those layers
take the blocks of vLLM's pool is :mod:`sidecar.kv.geometry`'s.

Everything here is pure: no I/O except :func:`load_config`, which reads one JSON file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.errors import GeometryError
from sidecar.kv.layers import STATE, layer_windows

GIB = 1 << 30

#: Element size of the model dtypes vLLM accepts (``--dtype``) and that configs name.
MODEL_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
}

#: KV-cache dtypes other than ``auto`` whose layout is a plain element array.
CACHE_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
}

#: DeepSeek's packed FP8 MLA cache: 512 fp8 latent + 4 fp32 scales + 64 bf16 rope = 656 bytes.
FP8_DS_MLA_BYTES_PER_TOKEN = 656

#: model_type values vLLM treats as MLA when ``kv_lora_rank`` is set.
MLA_MODEL_TYPES = frozenset(
    {
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "deepseek_mtp",
        "kimi_k2",
        "kimi_linear",
        "longcat_flash",
        "pangu_ultra_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
    }
)

#: Keys vLLM reads for the model's context length; the smallest present wins
#: (``model_max_length`` wins whenever it is set).
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)

#: RoPE types whose ``factor`` vLLM does not apply to ``max_position_embeddings`` (already scaled,
#: or no factor: ``default``, and ``mrope``, which vLLM reads as ``default``).
_UNSCALED_ROPE = frozenset(
    {
        "default",
        "mrope",
        "su",
        "longrope",
        "llama3",
        "yarn",
        "deepseek_yarn",
        "deepseek_llama_scaling",
    }
)

#: Keys under which multimodal configs nest their language model.
_TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")


#: vLLM's default ``--max-num-batched-tokens`` for the OpenAI server on a GPU.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
#: Batches in flight with async scheduling (vLLM's default): two.
DEFAULT_MAX_CONCURRENT_BATCHES = 2


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as vLLM's ``cdiv``."""
    return -(a // -b)


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a Hugging Face ``config.json`` from a file or a model directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GeometryError(f"model config not found: {p}") from None
    except OSError as exc:
        raise GeometryError(f"cannot read model config {p}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GeometryError(
            f"model config {p} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from None
    if not isinstance(data, dict):
        raise GeometryError(f"model config {p} must be a JSON object")
    return data


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: nested ``text_config`` (multimodal) merged over the top."""
    for key in _TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, Mapping):
            merged = {k: v for k, v in config.items() if k not in _TEXT_CONFIG_KEYS}
            merged.update(nested)
            # The dtype usually lives at the top level of multimodal configs.
            for dtype_key in ("torch_dtype", "dtype"):
                if config.get(dtype_key) is not None:
                    merged[dtype_key] = config[dtype_key]
            return merged
    return dict(config)


def _positive_int(cfg: Mapping[str, Any], key: str, *, required: bool = True) -> int | None:
    value = cfg.get(key)
    if value is None:
        if required:
            raise GeometryError(f"model config is missing '{key}'")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GeometryError(f"'{key}' must be a positive integer, got {value!r}")
    if value <= 0:
        raise GeometryError(f"'{key}' must be a positive integer, got {value}")
    return value


def _model_dtype(cfg: Mapping[str, Any], override: str | None) -> str:
    if override is not None and override != "auto":
        if override not in MODEL_DTYPE_BYTES:
            raise GeometryError(f"unknown dtype '{override}'")
        return override
    raw = cfg.get("torch_dtype", cfg.get("dtype"))
    if raw is None:
        # vLLM downcasts float32 (also transformers' default) to the platform's 16-bit type.
        return "bfloat16"
    name = str(raw).removeprefix("torch.")
    if name not in MODEL_DTYPE_BYTES:
        raise GeometryError(f"unknown model dtype '{raw}'")
    return "bfloat16" if MODEL_DTYPE_BYTES[name] == 4 else name


def derived_max_model_len_and_key(
    cfg: Mapping[str, Any], tokenizer_model_max_length: int | None = None
) -> tuple[int, str | None]:
    """The longest context vLLM lets the model serve, and the config key it comes from.

    vLLM 0.32's ``_get_and_verify_max_len`` and ``derive_max_model_len_and_key``: the smallest
    of the length keys present, ``model_max_length`` instead when the config sets it, no more
    than the tokenizer's ``model_max_length``; 2048 (vLLM warns) when none is present; times the
    RoPE scaling factor except for the types that already scale ``max_position_embeddings``
    (and Gemma 3, whose figure is already scaled). ``--max-model-len`` above it is refused.
    """
    derived: int | None = None
    key: str | None = None
    for k in _MAX_LEN_KEYS:
        v = cfg.get(k)
        if (
            isinstance(v, int)
            and not isinstance(v, bool)
            and v > 0
            and (derived is None or v < derived)
        ):
            derived, key = v, k
    explicit = cfg.get("model_max_length")
    if isinstance(explicit, int) and not isinstance(explicit, bool) and explicit > 0:
        derived, key = explicit, "model_max_length"  # Command-R / Cohere: this key wins
    if tokenizer_model_max_length is not None and derived is not None:
        if tokenizer_model_max_length < derived:
            derived, key = tokenizer_model_max_length, "tokenizer_config.json model_max_length"
    if derived is None:
        derived, key = 2048, None  # vLLM's fallback, with a warning
    factor = 1.0
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if isinstance(rope, Mapping) and "gemma3" not in str(cfg.get("model_type", "")):
        nested = [p for p in rope.values() if isinstance(p, Mapping) and p]
        for params in nested if nested and len(nested) == len(rope) else [rope]:
            rope_type = params.get("rope_type", params.get("type", "default"))
            if rope_type not in _UNSCALED_ROPE and isinstance(params.get("factor"), (int, float)):
                factor = float(params["factor"])
    return int(derived * factor), key


def derived_max_model_len(cfg: Mapping[str, Any]) -> int:
    """The context length vLLM derives from a config when ``--max-model-len`` is not given."""
    return derived_max_model_len_and_key(cfg)[0]


def pp_partition(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Layer ranges per pipeline stage, as vLLM's ``get_pp_indices`` splits them."""
    per = num_layers // pp_size
    parts = [per] * pp_size
    remaining = num_layers % pp_size
    for i in range(2, remaining + 2):
        parts[-i] += 1
    ranges, start = [], 0
    for n in parts:
        ranges.append((start, start + n))
        start += n
    return ranges


@dataclass(frozen=True)
class ModelKV:
    """The KV cache one GPU rank keeps per token: layers, heads and element size.

    Build it with :meth:`from_config`; ``layer_windows`` holds this rank's layers only.
    """

    model_type: str
    architecture: str
    attention: str  # "mha" | "gqa" | "mqa" | "mla"
    total_layers: int
    layer_windows: tuple[int | None, ...]
    kv_heads_total: int
    kv_heads_per_rank: int
    head_size: int
    head_size_v: int
    model_dtype: str
    kv_cache_dtype: str
    derived_max_model_len: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    fixed_bytes_per_token_per_layer: int | None = field(default=None, repr=False)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        kv_cache_dtype: str = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        dtype: str | None = None,
    ) -> ModelKV:
        """Size a model from its (possibly multimodal) Hugging Face config dict."""
        if tensor_parallel_size < 1:
            raise GeometryError("tensor parallel size must be at least 1")
        if pipeline_parallel_size < 1:
            raise GeometryError("pipeline parallel size must be at least 1")
        cfg = text_config(config)
        model_type = str(cfg.get("model_type", ""))
        archs = config.get("architectures") or cfg.get("architectures") or [model_type or "?"]
        architecture = str(archs[0]) if isinstance(archs, list) and archs else str(archs)

        num_layers = _positive_int(cfg, "num_hidden_layers")
        assert num_layers is not None
        if pipeline_parallel_size > num_layers:
            raise GeometryError(
                f"pipeline parallel size {pipeline_parallel_size} exceeds {num_layers} layers"
            )
        model_dtype = _model_dtype(cfg, dtype)

        is_mla = model_type in MLA_MODEL_TYPES and cfg.get("kv_lora_rank") is not None
        fixed: int | None = None
        if is_mla:
            kv_lora_rank = _positive_int(cfg, "kv_lora_rank")
            rope_dim = _positive_int(cfg, "qk_rope_head_dim")
            assert kv_lora_rank is not None and rope_dim is not None
            head_size, head_size_v = kv_lora_rank + rope_dim, 0
            kv_heads_total = kv_heads_rank = 1
            attention = "mla"
            if kv_cache_dtype == "fp8_ds_mla":
                fixed = FP8_DS_MLA_BYTES_PER_TOKEN
        else:
            heads = _positive_int(cfg, "num_attention_heads")
            assert heads is not None
            kv_heads_total = heads
            for key in (
                "n_head_kv",
                "num_kv_heads",
                "num_key_value_heads",
                "multi_query_group_num",
            ):
                if cfg.get(key) is not None:
                    kv_heads_total = _positive_int(cfg, key) or heads
                    break
            head_key = "attention_head_dim" if model_type == "zamba2" else "head_dim"
            explicit_head = cfg.get(head_key)  # Zamba2: its attention's, on twice the hidden
            if explicit_head is not None and not (
                explicit_head == 0 and type(explicit_head) is int
            ):
                head_size = _positive_int(cfg, head_key) or 0
            else:
                hidden = _positive_int(cfg, "hidden_size")
                assert hidden is not None
                if hidden % heads:
                    raise GeometryError(
                        f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; "
                        "set 'head_dim'"
                    )
                head_size = hidden // heads
            head_size_v = head_size
            kv_heads_rank = max(1, kv_heads_total // tensor_parallel_size)
            attention = (
                "mha" if kv_heads_total == heads else "mqa" if kv_heads_total == 1 else "gqa"
            )

        if kv_cache_dtype == "fp8_ds_mla" and not is_mla:
            raise GeometryError("kv cache dtype 'fp8_ds_mla' applies to MLA models only")
        if kv_cache_dtype != "auto" and fixed is None and kv_cache_dtype not in CACHE_DTYPE_BYTES:
            known = ", ".join(["auto", *CACHE_DTYPE_BYTES, "fp8_ds_mla"])
            raise GeometryError(f"unknown kv cache dtype '{kv_cache_dtype}' (known: {known})")

        windows = layer_windows(cfg, num_layers)
        if is_mla:  # MLA models here have no sliding layers
            windows = tuple(w if w == STATE else None for w in windows)
        # This rank holds the largest pipeline stage: it has the fewest blocks, so it binds.
        start, end = max(
            pp_partition(len(windows), pipeline_parallel_size), key=lambda r: r[1] - r[0]
        )
        return cls(
            model_type=model_type,
            architecture=architecture,
            attention=attention,
            total_layers=num_layers,
            layer_windows=windows[start:end],
            kv_heads_total=kv_heads_total,
            kv_heads_per_rank=kv_heads_rank,
            head_size=head_size,
            head_size_v=head_size_v,
            model_dtype=model_dtype,
            kv_cache_dtype=kv_cache_dtype,
            derived_max_model_len=derived_max_model_len(cfg),
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            fixed_bytes_per_token_per_layer=fixed,
        )

    @property
    def dtype_bytes(self) -> int:
        """Bytes per KV element: the model dtype under ``auto``, else the cache dtype's."""
        if self.kv_cache_dtype == "auto":
            return MODEL_DTYPE_BYTES[self.model_dtype]
        return CACHE_DTYPE_BYTES.get(self.kv_cache_dtype, 1)

    @property
    def num_layers(self) -> int:
        """Layers with a cache on this rank (attention and recurrent-state layers)."""
        return len(self.layer_windows)

    @property
    def state_layers(self) -> int:
        """Layers on this rank that keep a recurrent state (Mamba, linear attention)."""
        return sum(1 for w in self.layer_windows if w == STATE)

    @property
    def bytes_per_token_per_layer(self) -> int:
        if self.fixed_bytes_per_token_per_layer is not None:
            return self.fixed_bytes_per_token_per_layer
        return self.kv_heads_per_rank * (self.head_size + self.head_size_v) * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes on this rank across all its layers (no window capping)."""
        return self.bytes_per_token_per_layer * (self.num_layers - self.state_layers)

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        return tuple(sorted({w for w in self.layer_windows if w is not None and w > 0}))

    @property
    def attention_chunks(self) -> tuple[int, ...]:
        """The chunks of chunked local attention layers (Llama 4)."""
        return tuple(sorted({-w for w in self.layer_windows if w is not None and w < 0}))
