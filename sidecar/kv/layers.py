"""Each layer's KV-cache kind, read from a Hugging Face config as vLLM 0.32 reads it.

A layer is one of three kinds here, as ``sidecar.kv.geometry`` counts its blocks:

* full attention (``None``): a page for every ``block_size`` tokens;
* sliding-window attention (its window, a positive int): the window's pages; Llama 4's
  chunked local attention (minus its chunk, a negative int) the current chunk's (:func:`_chunk`);
* a recurrent state (:data:`STATE`): Mamba, Mamba 2, gated delta-net linear attention
  (Qwen3-Next, Qwen3.5), Kimi delta attention (Kimi Linear), short convolutions (LFM2):
  vLLM's ``MambaSpec``, a fixed number of blocks a request whatever its length
  (``MambaManager``).

Layers that keep nothing (NemotronH's MLP and MoE layers) are left out. A decoder layer that
keeps both (Falcon-H1's, Zamba2's hybrid layers: an attention branch and a Mamba 2 one) gives
two entries, a state and a full-attention one (:func:`_two_branch`). A layout this module
cannot read raises :class:`GeometryError`, so that the sidecar says so rather than counting a
hybrid model as full attention.

>>> layer_windows({"layer_types": ["linear_attention"] * 3 + ["full_attention"]}, 4)
(0, 0, 0, None)
>>> layer_windows({"hybrid_override_pattern": "M-M*-"}, 5)
(0, 0, None)
>>> layer_windows({"layer_types": ["chunked_attention"], "attention_chunk_size": 8192}, 1)
(-8192,)
>>> layer_windows({"model_type": "zamba2", "layers_block_type": ["mamba", "hybrid"]}, 2)
(0, 0, None)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.errors import GeometryError

#: The kind of a layer that keeps a recurrent state, not per-token KV (``layer_windows``).
STATE = 0

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"

_FULL_NAMES = frozenset({FULL_ATTENTION, "attention"})
_STATE_NAMES = frozenset({"linear_attention", "mamba", "mamba2", "conv"})

#: NemotronH's ``hybrid_override_pattern``: ``M`` Mamba 2, ``*`` attention, ``-`` MLP, ``E`` MoE.
_PATTERN = {"M": STATE, "*": None, "-": "skip", "E": "skip"}

#: Families whose layers keep a recurrent state but whose layout this module does not read (vLLM
#: 0.32 serves none of them; Zamba 1, not Zamba2, whose layout :func:`_two_branch` reads).
_UNREAD_STATE_TYPES = ("zamba", "plamo2", "minimax_text_01", "minimax_m1")


def _window(cfg: Mapping[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        # Qwen2/Qwen3 ship a sliding_window value that is off unless use_sliding_window is set.
        window = None
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise GeometryError(f"'sliding_window' must be a positive integer, got {window!r}")
    return window


def _chunk(cfg: Mapping[str, Any]) -> int:
    """A chunked-local layer's kind: minus its chunk. vLLM keeps the blocks of a sequence's
    current chunk (``ChunkedLocalAttentionManager``); its future is bounded as a sliding
    window of the chunk's length would be."""
    chunk = cfg.get("attention_chunk_size")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise GeometryError(f"'attention_chunk_size' must be a positive integer, got {chunk!r}")
    return -chunk


def _named_types(cfg: Mapping[str, Any], num_layers: int, window: int | None) -> list[str]:
    """The layer types of a config without ``layer_types``, from its model family's rule."""
    model_type = str(cfg.get("model_type", ""))
    pattern = cfg.get("sliding_window_pattern")
    interval = cfg.get("full_attention_interval")
    linear = any(str(k).startswith("linear_") for k in cfg)  # Qwen3-Next, Qwen3.5
    if linear and isinstance(interval, int) and not isinstance(interval, bool) and interval > 0:
        return [
            FULL_ATTENTION if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    if model_type.startswith("llama4") and cfg.get("attention_chunk_size") is not None:
        # Llama 4: its RoPE layers attend within their chunk, the others (NoPE) to everything
        nope = cfg.get("no_rope_layers")
        if not isinstance(nope, list) or not nope:
            every = cfg.get("no_rope_layer_interval", 4)
            nope = [int((i + 1) % every != 0) for i in range(num_layers)]
        return [CHUNKED_ATTENTION if nope[i] else FULL_ATTENTION for i in range(num_layers)]
    kimi = cfg.get("linear_attn_config")  # Kimi Linear: KDA layers, counted from 1
    if isinstance(kimi, Mapping) and isinstance(kimi.get("kda_layers"), list):
        kda = set(kimi["kda_layers"])
        return ["linear_attention" if i + 1 in kda else FULL_ATTENTION for i in range(num_layers)]
    indices = cfg.get("attn_layer_indices")  # Bamba
    if isinstance(indices, list) and indices:
        return [FULL_ATTENTION if i in indices else "mamba" for i in range(num_layers)]
    period, offset = cfg.get("attn_layer_period"), cfg.get("attn_layer_offset")  # Jamba
    if isinstance(period, int) and period > 0 and isinstance(offset, int):
        return [FULL_ATTENTION if i % period == offset else "mamba" for i in range(num_layers)]
    if model_type in ("mamba", "mamba2", "falcon_mamba"):  # every layer a state, no attention
        return ["mamba"] * num_layers
    if model_type.startswith(_UNREAD_STATE_TYPES):
        raise GeometryError(f"cannot read the layer layout of a {model_type!r} model")
    if window is None:
        return [FULL_ATTENTION] * num_layers
    if model_type.startswith("gemma2"):
        return [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers)]
    if isinstance(pattern, int) and pattern > 0:  # Gemma 3: (pattern - 1) local : 1 global
        return [
            SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
        ]
    if model_type.startswith("gpt_oss"):
        return [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]
    if "max_window_layers" in cfg and model_type.startswith("qwen"):
        first = int(cfg["max_window_layers"])
        return [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
    return [SLIDING_ATTENTION] * num_layers  # Mistral style: every layer slides


def _two_branch(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...] | None:
    """The layers of a model whose decoder layers run an attention branch beside a Mamba 2 one
    (None for any other model), each such layer a state and a full-attention entry, as vLLM
    0.32 builds them: Falcon-H1 (``FalconH1ParallelHybrid``: every layer both, its Mamba
    branch's cache named as layer ``num_hidden_layers + i``), Zamba2 (every layer a Mamba 2
    mixer; those ``layers_block_type`` calls ``hybrid`` also the shared transformer, whose
    attention has a cache of its own at each such layer, ``Zamba2Attention.dpa_list``)."""
    model_type = str(cfg.get("model_type", ""))
    if model_type == "falcon_h1":
        return (STATE, None) * num_layers
    if model_type != "zamba2":
        return None
    kinds = cfg.get("layers_block_type")
    if (
        not isinstance(kinds, Sequence)
        or isinstance(kinds, str)
        or len(kinds) < num_layers
        or not all(isinstance(k, str) for k in kinds[:num_layers])
    ):
        raise GeometryError(
            f"'layers_block_type' must name the block type of each of the {num_layers} layers"
        )
    # as vLLM reads it: a hybrid layer, else a Mamba 2 one (transformers 5 writes those
    # linear_attention)
    return tuple(
        w for k in kinds[:num_layers] for w in ((STATE, None) if k == "hybrid" else (STATE,))
    )


def layer_windows(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's kind, following the model's config: None (full attention), a sliding
    window, or :data:`STATE`; layers that keep nothing are left out."""
    branches = _two_branch(cfg, num_layers)
    if branches is not None:
        return branches
    window = _window(cfg)
    hybrid = cfg.get("hybrid_override_pattern")
    if isinstance(hybrid, str) and hybrid:
        if len(hybrid) < num_layers or any(c not in _PATTERN for c in hybrid):
            raise GeometryError(
                f"'hybrid_override_pattern' must give one of M, *, -, E for each of the "
                f"{num_layers} layers, got {hybrid!r}"
            )
        kinds = [_PATTERN[c] for c in hybrid[:num_layers]]
        return tuple(k for k in kinds if k != "skip")  # type: ignore[misc]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        layer_types = _named_types(cfg, num_layers, window)
    if not isinstance(layer_types, Sequence) or isinstance(layer_types, str):
        raise GeometryError("'layer_types' must be a list of attention types")
    if len(layer_types) < num_layers:
        raise GeometryError(
            f"'layer_types' lists {len(layer_types)} layers, the model has {num_layers}"
        )
    windows: list[int | None] = []
    for kind in layer_types[:num_layers]:
        if kind in _FULL_NAMES:
            windows.append(None)
        elif kind == SLIDING_ATTENTION:
            if window is None:
                raise GeometryError("'layer_types' has sliding layers but no 'sliding_window'")
            windows.append(window)
        elif kind in _STATE_NAMES:
            windows.append(STATE)
        elif kind == CHUNKED_ATTENTION:
            windows.append(_chunk(cfg))
        else:
            known = ", ".join(
                sorted({*_FULL_NAMES, SLIDING_ATTENTION, CHUNKED_ATTENTION, *_STATE_NAMES})
            )
            raise GeometryError(
                f"unsupported attention type {kind!r} in 'layer_types' (supported: {known})"
            )
    return tuple(windows)
