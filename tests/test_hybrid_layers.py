"""Hybrid models' recurrent-state layers (Mamba, gated delta-net linear attention) in the KV
geometry: which layers keep a state, the groups vLLM makes of them, and the blocks a request
holds in each (``sidecar.kv.layers``, ``KVGeometry``; vLLM 0.32's ``MambaSpec`` and
``MambaManager``). The end-to-end check on the real vLLM is the ``hybrid`` case of
tests/test_sliding_window_vllm.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sidecar.kv.geometry import GeometryError, KVGeometry, ModelKV, cdiv
from sidecar.kv.layers import STATE, layer_windows

S, F = STATE, None


@pytest.mark.parametrize(
    ("cfg", "layers", "kinds"),
    [
        # Qwen3-Next as transformers writes it, and as its published config says it (no list)
        (
            {"layer_types": ["linear_attention"] * 3 + ["full_attention"]},
            4,
            (S, S, S, F),
        ),
        (
            {"model_type": "qwen3_next", "full_attention_interval": 4, "linear_num_key_heads": 16},
            8,
            (S, S, S, F, S, S, S, F),
        ),
        # Qwen3.5's text config: the same rule
        (
            {"model_type": "qwen3_5_text", "full_attention_interval": 2, "linear_key_head_dim": 8},
            4,
            (S, F, S, F),
        ),
        # Granite 4.0 hybrid
        ({"layer_types": ["mamba", "mamba", "attention", "mamba"]}, 4, (S, S, F, S)),
        # LFM2: short convolutions
        ({"layer_types": ["conv", "full_attention", "conv"]}, 3, (S, F, S)),
        # NemotronH: MLP and MoE layers keep nothing and are left out
        ({"hybrid_override_pattern": "MEM*EM-"}, 7, (S, S, F, S)),
        # Jamba: attention every `period` layers from `offset`
        ({"attn_layer_period": 4, "attn_layer_offset": 2}, 8, (S, S, F, S, S, S, F, S)),
        # Kimi Linear: its KDA layers counted from 1
        (
            {"linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3]}},
            4,
            (S, S, F, S),
        ),
        # Bamba
        ({"attn_layer_indices": [1, 3]}, 4, (S, F, S, F)),
        # a pure Mamba 2 model
        ({"model_type": "mamba2"}, 3, (S, S, S)),
        # a full-attention model is unchanged
        ({"model_type": "llama"}, 2, (F, F)),
    ],
)
def test_layer_kinds_are_read_from_each_family_s_config(
    cfg: dict[str, Any], layers: int, kinds: tuple[int | None, ...]
) -> None:
    assert layer_windows(cfg, layers) == kinds


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"model_type": "falcon_h1"}, "cannot read the layer layout of a 'falcon_h1' model"),
        ({"hybrid_override_pattern": "M*X"}, "'hybrid_override_pattern' must give one of"),
        ({"hybrid_override_pattern": "M*"}, "'hybrid_override_pattern' must give one of"),
        (
            {"layer_types": ["chunked_attention"] * 3},
            "unsupported attention type 'chunked_attention'",
        ),
    ],
)
def test_a_layout_it_cannot_read_is_a_clear_error(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(GeometryError, match=message):
        layer_windows(cfg, 3)


#: Qwen3-Next-80B-A3B's attention shape (48 layers, one in four full attention, 2 KV heads of
#: 256): only the fields the geometry reads
QWEN3_NEXT_80B = {
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_size": 2048,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}


def geometry(mode: str | None, *, block: int = 544, context: int = 32768) -> KVGeometry:
    return KVGeometry.build(
        ModelKV.from_config(QWEN3_NEXT_80B),
        block_size=block,
        max_model_len=context,
        mamba_cache_mode=mode,
    )


def test_vllm_groups_a_hybrid_model_by_its_n_to_1_pattern() -> None:
    """36 linear and 12 full layers: groups of 12 (vLLM's ``_get_kv_cache_groups_uniform_
    page_size``), three of state and one of full attention; a block holds a page of 12 layers
    and only the full layers keep KV per token."""
    g = geometry("align")
    assert sorted((grp.state, grp.num_layers) for grp in g.groups) == [
        (False, 12),
        (True, 12),
        (True, 12),
        (True, 12),
    ]
    assert g.model.state_layers == 36 and g.model.sliding_windows == ()
    assert g.bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert g.bytes_per_block == 12 * 544 * 2 * 2 * 256 * 2


@pytest.mark.parametrize(("mode", "state"), [("align", 2), ("none", 1), (None, 1)])
def test_vllm_s_per_request_maximum_counts_each_state_group_at_its_peak(
    mode: str | None, state: int
) -> None:
    """vLLM's ``MambaSpec.max_memory_usage_bytes``: two pages a group under ``align`` (prefix
    caching), one otherwise; its startup concurrency is the pool over that."""
    g = geometry(mode)
    per_request = cdiv(32768, 544) + 3 * state
    assert g.blocks_per_sequence == per_request
    assert g.max_concurrency(10_000) == 10_000 / per_request


def test_kimi_linear_keeps_its_state_layers_beside_its_mla_ones() -> None:
    """An MLA model's layers are full attention (no sliding window), its KDA layers a state."""
    kv = ModelKV.from_config(
        {
            "model_type": "kimi_linear",
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "hidden_size": 1024,
            "torch_dtype": "bfloat16",
            "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4]},
        }
    )
    assert kv.attention == "mla" and kv.layer_windows == (S, S, S, F)


def test_a_request_holds_one_state_block_a_group_while_it_decodes_and_its_future_two() -> None:
    """Now: a decoding sequence holds its pages and one block a state group, a prefilling one
    two a group once its prompt crosses a block (one for a prompt within a block). Its future
    (reservations, the pool's peak): two a group, as soon as it will cross a block boundary."""
    g = geometry("align", block=256, context=4096)
    assert g.blocks_held(695, 600, started=True) == 3 + 3
    assert g.blocks_held(1637, 600, started=True) == 7 + 3
    assert g.blocks_held(600, 600, started=False) == 3 + 3 * 2
    assert g.blocks_held(100, 100, started=False) == 1 + 3
    # a one-block prompt reserved to a long answer: it crosses blocks as it decodes
    assert g.blocks_held(2000, 100, started=False) == 8 + 3 * 2
    prompts = np.array([100, 600, 3000], dtype=np.int64)
    for started in (np.array([False, False, True]), True, False):
        caps = g.window_caps(prompts, started)
        assert [c is None for c in caps].count(True) == 1
        assert all((c == 2).all() for c in caps if c is not None)
    # without prefix caching a state group holds one block, now and later
    flat = geometry("none", block=256, context=4096)
    assert flat.blocks_held(2000, 100, started=False) == 8 + 3
    assert flat.blocks_held(1637, 600, started=True) == 7 + 3
