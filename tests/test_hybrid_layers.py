"""Hybrid models' recurrent-state layers (Mamba, gated delta-net linear attention) in the KV
geometry: which layers keep a state, the groups vLLM makes of them, and the blocks a request
holds in each (``sidecar.kv.layers``, ``KVGeometry``; vLLM 0.32's ``MambaSpec`` and
``MambaManager``). The end-to-end check on the real vLLM is the ``hybrid`` case of
tests/test_sliding_window_vllm.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
        # Llama 4: RoPE layers chunked (minus the chunk), every fourth (NoPE) full
        (
            {
                "model_type": "llama4_text",
                "attention_chunk_size": 8192,
                "no_rope_layers": [1, 1, 1, 0],
            },
            4,
            (-8192, -8192, -8192, F),
        ),
        ({"model_type": "llama4_text", "attention_chunk_size": 64}, 4, (-64, -64, -64, F)),
        (
            {"layer_types": ["chunked_attention", "full_attention"], "attention_chunk_size": 32},
            2,
            (-32, F),
        ),
        # Falcon-H1: every decoder layer an attention branch beside a Mamba 2 one
        ({"model_type": "falcon_h1"}, 2, (S, F, S, F)),
        # Zamba2: every layer a Mamba 2 mixer, the hybrid ones the shared attention too (the
        # others are mamba as published, linear_attention as transformers 5 writes them)
        (
            {"model_type": "zamba2", "layers_block_type": ["mamba", "hybrid", "mamba"]},
            3,
            (S, S, F, S),
        ),
        (
            {"model_type": "zamba2", "layers_block_type": ["linear_attention", "hybrid"]},
            2,
            (S, S, F),
        ),
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
        ({"model_type": "plamo2"}, "cannot read the layer layout of a 'plamo2' model"),
        ({"model_type": "zamba"}, "cannot read the layer layout of a 'zamba' model"),
        ({"model_type": "zamba2"}, "'layers_block_type' must name the block type of each"),
        (
            {"model_type": "zamba2", "layers_block_type": ["mamba", "hybrid"]},
            "'layers_block_type' must name the block type of each of the 3 layers",
        ),
        ({"hybrid_override_pattern": "M*X"}, "'hybrid_override_pattern' must give one of"),
        ({"hybrid_override_pattern": "M*"}, "'hybrid_override_pattern' must give one of"),
        ({"layer_types": ["chunked_attention"] * 3}, "'attention_chunk_size' must be a positive"),
        ({"layer_types": ["local_attention"] * 3}, "unsupported attention type 'local_"),
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
    two a group once its prompt crosses a block (one for a prompt within a block). Its
    reservation, and the future of one not started: two a group, as soon as it will cross a
    block boundary. A decoding sequence's future: one a group, its crossings counted apart
    (tests/test_state_crossing.py)."""
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
        want = np.where(started, 1, 2) + np.zeros(3, dtype=np.int64)
        assert all((c == want).all() for c in caps if c is not None), (started, caps)
    assert g.crossing_blocks == 3
    assert g.blocks_for_tokens(3000) == cdiv(3000, 256) + 3 * 2  # a reservation: two a group
    # without prefix caching a state group holds one block, now and later
    flat = geometry("none", block=256, context=4096)
    assert flat.blocks_held(2000, 100, started=False) == 8 + 3
    assert flat.blocks_held(1637, 600, started=True) == 7 + 3


@settings(max_examples=300, deadline=None)
@given(
    block=st.sampled_from([16, 32, 128]),
    chunk=st.sampled_from([256, 2048, 8192]),
    prompt=st.integers(1, 40_000),
    generated=st.integers(0, 40_000),
    unsettled=st.integers(0, 2),
)
def test_a_chunked_local_layer_is_never_counted_below_what_vllm_keeps(
    block: int, chunk: int, prompt: int, generated: int, unsettled: int
) -> None:
    """vLLM keeps a chunked-local layer's blocks from the start of the chunk its processed
    tokens reached (``ChunkedLocalAttentionManager.remove_skipped_blocks``; ``unsettled``
    tokens of a decode step, or the prefill step before, not yet processed); the sidecar
    counts the layer as a window of the chunk, never below that (a sequence not started: the
    most its prefill keeps), and a prompt that one step prefills at exactly its pages."""
    g = KVGeometry.build(
        ModelKV.from_config(
            {
                "model_type": "llama4_text",
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "attention_chunk_size": chunk,
                "no_rope_layers": [1, 1, 1, 1],
                "torch_dtype": "bfloat16",
            }
        ),
        block_size=block,
        max_model_len=100_000,
    )
    tokens = prompt + generated
    started = generated > 0

    def kept(allocated: int, processed: int) -> int:
        start = (max(0, processed - 1) // chunk) * chunk
        return cdiv(allocated, block) - start // block

    if started:
        most = kept(tokens, max(0, tokens - unsettled))
    else:  # its prefill, 8,192 tokens a step, the step before not yet processed
        step = 8192
        most = max(
            kept(min(prompt, (k + 1) * step), max(0, (k - 1) * step))
            for k in range(cdiv(prompt, step))
        )
    counted = g.blocks_held(tokens if started else prompt, prompt, started=started)
    assert counted >= most
    if not started and prompt <= 8192:
        assert counted == cdiv(prompt, block)


def test_llama_4_s_long_requests_are_counted_at_their_chunk_not_their_length() -> None:
    """Llama 4 Scout's shape (48 layers, every fourth NoPE full attention, chunks of 8,192):
    vLLM groups 36 chunked and 12 full layers as three groups and one; a request decoding at
    100,000 tokens holds its 6,250 pages in the full group and its current chunk's 106 in each
    chunked one: 6,568 blocks of 16 (read as full attention, every layer in one group, it was
    counted at 6,250, below what vLLM holds); its future is bounded at a window of the chunk
    in each (514 blocks)."""
    g = KVGeometry.build(
        ModelKV.from_config(
            {
                "model_type": "llama4",
                "text_config": {
                    "model_type": "llama4_text",
                    "num_hidden_layers": 48,
                    "num_attention_heads": 40,
                    "num_key_value_heads": 8,
                    "head_dim": 128,
                    "attention_chunk_size": 8192,
                    "torch_dtype": "bfloat16",
                },
            }
        ),
        block_size=16,
        max_model_len=1_000_000,
    )
    assert sorted((grp.chunked, grp.num_layers) for grp in g.groups) == [
        (False, 12),
        (True, 12),
        (True, 12),
        (True, 12),
    ]
    assert g.model.attention_chunks == (8192,) and g.model.sliding_windows == ()
    assert g.blocks_held(100_000, 1_000, started=True) == 6250 + 3 * 106 == 6568
    window = cdiv(8192 + 3, 16)  # the chunk and the tokens in flight, from a block boundary
    caps = g.window_caps(np.array([1_000]), True)
    assert sorted(int(c[0]) for c in caps if c is not None) == [window] * 3 == [513] * 3
    # vLLM's per-request cap (ChunkedLocalAttentionSpec.max_admission_blocks_per_request): the
    # chunk and a step's tokens in flight, no block for an offset
    chunked = [cap for cap, grp in zip(g.group_caps, g.groups, strict=True) if grp.chunked]
    assert chunked == [cdiv(8192 + g.max_in_flight_tokens, 16)] * 3


#: Falcon-H1-7B-shaped (44 parallel-hybrid layers, 2 KV heads of 128) and Zamba2-7B-shaped (81
#: Mamba 2 layers, 13 of them hybrid; the shared attention's 32 heads of 224, on twice the
#: hidden size): only the fields the geometry reads
FALCON_H1 = {
    "model_type": "falcon_h1",
    "num_hidden_layers": 44,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "hidden_size": 3072,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}
ZAMBA2 = {
    "model_type": "zamba2",
    "num_hidden_layers": 81,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "attention_head_dim": 224,
    "hidden_size": 3584,
    "layers_block_type": ["hybrid" if i % 6 == 5 else "mamba" for i in range(81)],
    "max_position_embeddings": 16384,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("cfg", "groups", "bytes_per_layer"),
    [
        # vLLM's grouping: 44 attention and 44 state layers, one group of each
        (FALCON_H1, [(S, 44), (F, 44)], 2 * (128 + 128) * 2),
        # 81 state layers and 13 attention ones: groups of 13 (81 > 1.5 x 13), so
        # cdiv(81, 13) = 7 state groups and one of attention
        (ZAMBA2, [(S, 12)] * 4 + [(S, 11)] * 3 + [(F, 13)], 32 * (224 + 224) * 2),
    ],
)
def test_two_branch_hybrids_are_grouped_as_vllm_groups_them(
    cfg: dict[str, Any], groups: list[tuple[int | None, int]], bytes_per_layer: int
) -> None:
    """Falcon-H1 and Zamba2, once counted as full attention in one group (their pages once, no
    state block): each decoding request now holds its pages in the attention group and a block
    in each state group, two at a step that crosses a block boundary under ``align``."""
    kv = ModelKV.from_config(cfg)
    assert kv.bytes_per_token_per_layer == bytes_per_layer
    geo = KVGeometry.build(kv, block_size=1024, max_model_len=16384, mamba_cache_mode="align")
    assert [(g.sliding_window, g.num_layers) for g in geo.groups] == groups
    states = sum(1 for g in geo.groups if g.sliding_window == STATE)
    assert geo.blocks_held(3000, 2000, started=True) == cdiv(3000, 1024) + states
    assert geo.blocks_held(3000, 2000, started=False) == cdiv(3000, 1024) + 2 * states
    assert geo.crossing_blocks == states
