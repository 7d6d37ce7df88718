"""KV-cache geometry: bytes per token, per block and per request, sized as vLLM sizes them.

This module owns the arithmetic every admission decision rests on. It mirrors vLLM 0.32's
rules (``vllm/v1/kv_cache_interface.py``, ``vllm/v1/core/kv_cache_utils.py``,
``vllm/transformers_utils/model_arch_config_convertor.py``):

* per layer and token, a standard attention layer stores K and V:
  ``kv_heads_per_rank * (head_size + head_size_v) * dtype_bytes``, with
  ``kv_heads_per_rank = max(1, kv_heads // tensor_parallel_size)``;
* an MLA layer (DeepSeek V2/V3 and relatives) stores one latent of
  ``kv_lora_rank + qk_rope_head_dim`` elements, not split by tensor parallelism;
* layers are grouped into KV-cache groups of equal size (the hybrid allocator); one block of
  the shared pool holds one page of every layer of one group, and a request takes blocks from
  every group: full-attention groups ``ceil(tokens / block_size)``, sliding-window groups at most
  ``ceil(min(window - 1 + in_flight_tokens, max_model_len) / block_size) + 1``, where the tokens
  in flight are what one step may schedule for vLLM's pool sizing and admission cap, but for one
  sequence at most its prompt while it prefills and a token a step once it decodes
  (``SlidingWindowManager.remove_skipped_blocks`` frees what falls out of the window);
  recurrent-state groups (Mamba, linear attention: ``sidecar.kv.layers``) a fixed one or two
  blocks a request (``MambaManager``, :meth:`KVGeometry.build`);
* the pool has ``available_memory // bytes_per_block`` blocks; the maximum concurrency is
  ``num_blocks / blocks_per_request(max_model_len)``.

Everything here is pure: no I/O except :func:`load_config`, which reads one JSON file.

>>> kv = ModelKV.from_config({"num_hidden_layers": 28, "num_attention_heads": 28,
...     "num_key_value_heads": 4, "hidden_size": 3584, "torch_dtype": "bfloat16"})
>>> kv.bytes_per_token
57344
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from sidecar.errors import GeometryError
from sidecar.kv.blocks import UniformBlocks as UniformBlocks  # where callers found it first
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


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: ``num_layers`` layers sharing a block table (``sliding_window``:
    None for full attention, ``sidecar.kv.layers.STATE`` for recurrent-state layers, minus the
    chunk for chunked local attention)."""

    sliding_window: int | None
    num_layers: int  # real layers (padding not counted)

    @property
    def state(self) -> bool:
        return self.sliding_window == STATE

    @property
    def chunked(self) -> bool:
        """Chunked local attention (Llama 4): ``sliding_window`` is minus its chunk."""
        return self.sliding_window is not None and self.sliding_window < 0

    @property
    def window(self) -> int:
        """The tokens a sliding or chunked group keeps at most: its window, or its chunk."""
        assert self.sliding_window is not None
        return abs(self.sliding_window)


@dataclass(frozen=True)
class KVGeometry:
    """A model's KV cache at a given block size and context length, in vLLM's pool units.

    A *block* here is one block id of vLLM's shared pool, the unit of ``num_gpu_blocks`` and
    ``vllm:kv_cache_usage_perc``. For a model whose layers all use full attention,
    ``blocks_for_tokens(n) == ceil(n / block_size)``.

    >>> g = KVGeometry.build(ModelKV.from_config({"num_hidden_layers": 2,
    ...     "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
    ...     "torch_dtype": "bfloat16"}), block_size=128, max_model_len=1024)
    >>> g.bytes_per_block, g.blocks_for_tokens(129)
    (131072, 2)
    """

    model: ModelKV
    block_size: int
    max_model_len: int
    groups: tuple[KVGroup, ...]
    layers_per_group: int
    max_in_flight_tokens: int
    #: tokens a decoding sequence has scheduled past what vLLM settled, at most one a concurrent
    #: batch (vLLM frees on the processed-token basis: an unsettled step keeps its window's blocks)
    decode_in_flight_tokens: int = DEFAULT_MAX_CONCURRENT_BATCHES
    #: blocks a recurrent-state group holds for a request at most (a step that crosses a block
    #: boundary: prefill chunks, and decode steps every ``block_size`` tokens); at the other
    #: steps of its decode, one; see :meth:`build`
    state_peak_blocks: int = 1

    @classmethod
    def build(
        cls,
        model: ModelKV,
        *,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_concurrent_batches: int = DEFAULT_MAX_CONCURRENT_BATCHES,
        mamba_cache_mode: str | None = None,
    ) -> KVGeometry:
        """``mamba_cache_mode``: vLLM's (its ``cache_config_info``), for recurrent-state
        layers. Under ``none`` (no prefix caching) a state group holds one block a request;
        under ``align`` (prefix caching on) it holds one once the request decodes, and two at
        a step that crosses a block boundary (``MambaManager.allocate_new_blocks`` keeps the
        block it copies the state from until the next step), which every prefill chunk
        does. What a request holds now counts the one; its reservation, and the future of
        one not started, the two; a decoding sequence's future the one, with the second
        blocks of the sequences that cross together at one step added apart
        (:attr:`crossing_blocks`, ``sidecar.kv.crossing``)."""
        if block_size <= 0:
            raise GeometryError(f"block size must be positive, got {block_size}")
        mml = model.derived_max_model_len if max_model_len is None else max_model_len
        if mml <= 0:
            raise GeometryError(f"max model len must be positive, got {mml}")
        if max_num_batched_tokens <= 0 or max_concurrent_batches <= 0:
            raise GeometryError("max num batched tokens and concurrent batches must be positive")
        # Bucket layers by attention spec, then split buckets into groups of equal size, as
        # vLLM's _get_kv_cache_groups_uniform_page_size does (n:1 patterns group by the "1").
        buckets: dict[int | None, int] = {}
        for w in model.layer_windows:
            buckets[w] = buckets.get(w, 0) + 1
        if not buckets:
            raise GeometryError("the model has no attention layers on this rank")
        if len(buckets) == 1:
            ((window, count),) = buckets.items()
            groups: list[KVGroup] = [KVGroup(window, count)]
        else:
            smallest, largest = min(buckets.values()), max(buckets.values())
            group_size = largest if largest < smallest * 1.5 else smallest
            groups = []
            for window, count in buckets.items():
                n_groups = cdiv(count, group_size)
                for i in range(n_groups):
                    groups.append(KVGroup(window, len(range(i, count, n_groups))))
        return cls(
            model=model,
            block_size=block_size,
            max_model_len=mml,
            groups=tuple(groups),
            layers_per_group=max(g.num_layers for g in groups),
            max_in_flight_tokens=max_num_batched_tokens * max_concurrent_batches,
            decode_in_flight_tokens=max_concurrent_batches,
            state_peak_blocks=2 if mamba_cache_mode == "align" else 1,
        )

    @functools.cached_property
    def crossing_blocks(self) -> int:
        """Blocks a decoding sequence holds beyond its decode count at a step that crosses a
        block boundary: its state groups' second blocks under ``align`` (0 without)."""
        return (self.state_peak_blocks - 1) * sum(1 for g in self.groups if g.state)

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's page: ``block_size`` tokens of one layer."""
        return self.block_size * self.model.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id of the shared pool takes (one page of each layer of a group)."""
        return self.layers_per_group * self.page_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token on this rank, every layer holding every token."""
        return self.model.bytes_per_token

    @functools.cached_property
    def group_caps(self) -> tuple[int | None, ...]:
        """Per KV-cache group, the most blocks one request holds (None: full attention).

        A sliding-window group keeps the window plus what one step may schedule, and one block
        more for the window's misalignment with block boundaries.
        """
        return self._caps(self.max_in_flight_tokens, self.state_peak_blocks)

    @functools.cached_property
    def _decode_caps(self) -> tuple[int | None, ...]:
        """Per group, what a decoding sequence holds at most now (None: no cap)."""
        return self._caps(self.decode_in_flight_tokens, 1, span=True)

    def _caps(self, in_flight: int, state: int, *, span: bool = False) -> tuple[int | None, ...]:
        size, longest = self.block_size, self.max_model_len
        return tuple(
            None
            if g.sliding_window is None
            else state
            if g.state
            else int(_windowed_cap(g, in_flight, size, longest, span=span))
            for g in self.groups
        )

    def blocks_held(self, num_tokens: int, prompt: int, *, started: bool) -> int:
        """Pool blocks a sequence of ``prompt`` prompt tokens holds at ``num_tokens``. A
        sliding-window group holds the window and the tokens in flight: once the sequence has
        started, a decode step's; before, what its prefill holds (its prompt's pages, at most
        the window and a step's chunk), the most it holds in its life. A chunked-local group
        (Llama 4) holds the current chunk's blocks once the sequence decodes (those from the
        chunk its processed tokens reached, the tokens in flight taken as not processed), and
        is bounded as a window of the chunk before.

        >>> g = KVGeometry.build(ModelKV.from_config({"num_hidden_layers": 2,
        ...     "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
        ...     "sliding_window": 256, "torch_dtype": "bfloat16"}), block_size=32,
        ...     max_model_len=4096)
        >>> g.blocks_for_tokens(1200), g.blocks_held(1200, 600, started=False)
        (38, 19)
        >>> g.blocks_held(1200, 600, started=True), g.blocks_held(100, 100, started=False)
        (9, 4)
        """
        if num_tokens <= 0:
            return 0
        pages = cdiv(num_tokens, self.block_size)
        if not self._windowed:
            return len(self.groups) * pages
        decode = self._decode_caps
        if started:
            if self._chunked:  # the current chunk's blocks, as far as vLLM has processed
                done = max(0, num_tokens - self.decode_in_flight_tokens - 1)
                return sum(
                    pages
                    if cap is None
                    else pages - (done // g.window * g.window) // self.block_size
                    if g.chunked
                    else min(pages, cap)
                    for cap, g in zip(decode, self.groups, strict=True)
                )
            caps = decode
        else:
            prompt_pages = cdiv(prompt, self.block_size)
            prefill = self._caps(
                max(1, min(prompt, self.max_in_flight_tokens)), self.state_peak_blocks
            )
            caps = tuple(
                None if d is None or p is None else p if g.state else max(d, min(prompt_pages, p))
                for d, p, g in zip(decode, prefill, self.groups, strict=True)
            )
        return sum(pages if cap is None else min(pages, cap) for cap in caps)

    def window_caps(
        self, prompt: npt.NDArray[np.int64], started: bool | npt.NDArray[np.bool_]
    ) -> tuple[npt.NDArray[np.int64] | None, ...]:
        """Per group, each sequence's cap as :meth:`blocks_held` takes it (None: no cap), for
        its future: a recurrent-state group's at one block for a decoding sequence, at its
        peak for one not started (:meth:`build`; the crossings: :attr:`crossing_blocks`)."""
        size, longest = self.block_size, self.max_model_len
        prompt_pages = (prompt + size - 1) // size
        in_flight = np.maximum(1, np.minimum(prompt, self.max_in_flight_tokens))
        out: list[npt.NDArray[np.int64] | None] = []
        for g in self.groups:
            if g.sliding_window is None:
                out.append(None)
                continue
            if g.state:  # not started: its prefill's chunks cross block boundaries
                out.append(np.where(started, 1, self.state_peak_blocks) + np.zeros_like(prompt))
                continue
            decode = _windowed_cap(g, self.decode_in_flight_tokens, size, longest, span=True)
            prefill = _windowed_cap(g, in_flight, size, longest)
            unstarted = np.maximum(decode, np.minimum(prompt_pages, prefill))
            out.append(np.where(started, decode, unstarted).astype(np.int64))
        return tuple(out)

    @functools.cached_property
    def _chunked(self) -> bool:
        return any(g.chunked for g in self.groups)

    @functools.cached_property
    def _windowed(self) -> bool:
        return any(g.sliding_window is not None for g in self.groups)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Pool blocks a request holds at ``num_tokens`` tokens (prompt + generated)."""
        if num_tokens <= 0:
            return 0
        pages = cdiv(num_tokens, self.block_size)
        return sum(pages if cap is None else min(pages, cap) for cap in self.group_caps)

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks one request at ``max_model_len`` can hold (vLLM's per-request maximum)."""
        return self.blocks_for_tokens(self.max_model_len)

    @property
    def bytes_per_sequence(self) -> int:
        return self.blocks_per_sequence * self.bytes_per_block

    def num_blocks(self, kv_cache_memory_bytes: int) -> int:
        """Blocks vLLM carves out of ``kv_cache_memory_bytes`` on each rank."""
        return max(0, kv_cache_memory_bytes // self.bytes_per_block)

    def max_concurrency(self, num_blocks: int) -> float:
        """Requests of ``max_model_len`` tokens that fit at once (vLLM's startup figure)."""
        return num_blocks / self.blocks_per_sequence

    def token_capacity(self, num_blocks: int) -> int:
        """vLLM's ``kv_cache_size_tokens``: max concurrency times max_model_len."""
        return int(self.max_concurrency(num_blocks) * self.max_model_len)


def _windowed_cap(g: KVGroup, in_flight: Any, size: int, longest: int, span: bool = False) -> Any:
    """The most blocks a sliding or chunked group holds for one sequence with ``in_flight``
    tokens unprocessed, as vLLM caps it (``max_admission_blocks_per_request``): a window's
    ``window - 1`` tokens and those in flight, and a block for the window's misalignment; a
    chunk's tokens and those in flight (and a block more where the chunk is not a multiple of
    the block). ``span``: the blocks a run of the window's tokens spans, ``cdiv(tokens - 1,
    size) + 1``, a block below vLLM's cap where the run is one past a multiple of the block."""
    tokens = g.window + in_flight - (0 if g.chunked else 1)
    if span and not g.chunked:
        return (np.minimum(tokens, longest) - 2) // size + 2
    extra = int(g.window % size != 0) if g.chunked else 1
    return (np.minimum(tokens, longest) + size - 1) // size + extra
