"""KV geometry against published configs and the reference figures of the foundation issue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.kv.geometry import (
    GIB,
    GeometryError,
    KVGeometry,
    ModelKV,
    cdiv,
    load_config,
    pp_partition,
)
from sidecar.kv.memory import kv_cache_memory_bytes

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
KIB = 1024


def model(name: str, **kw: object) -> ModelKV:
    return ModelKV.from_config(load_config(CONFIGS / f"{name}.json"), **kw)  # type: ignore[arg-type]


def synthetic(
    layers: int, kv_heads: int, head_dim: int, heads: int | None = None
) -> dict[str, object]:
    heads = heads or kv_heads
    return {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_size": heads * head_dim,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 32768,
    }


# --- the reference figures ------------------------------------------------------------------


def test_qwen25_7b_is_56_kib_per_token() -> None:
    m = model("qwen2.5-7b-instruct")
    assert m.attention == "gqa"
    assert (m.num_layers, m.kv_heads_per_rank, m.head_size) == (28, 4, 128)
    assert m.bytes_per_token == 57_344 == 56 * KIB


@pytest.mark.parametrize(("tokens", "gib"), [(2048, 0.11), (8192, 0.44), (32768, 1.75)])
def test_qwen25_7b_one_sequence(tokens: int, gib: float) -> None:
    geo = KVGeometry.build(model("qwen2.5-7b-instruct"), block_size=16, max_model_len=tokens)
    assert round(geo.bytes_per_sequence / GIB, 2) == gib
    assert geo.blocks_for_tokens(tokens) * geo.bytes_per_block == tokens * 57_344


def test_qwen25_7b_as_mha_is_7x() -> None:
    cfg = load_config(CONFIGS / "qwen2.5-7b-instruct.json")
    cfg["num_key_value_heads"] = 28
    mha = ModelKV.from_config(cfg)
    assert mha.attention == "mha"
    assert mha.bytes_per_token == 7 * 57_344 == 392 * KIB


def test_32_layers_8_kv_heads_128_head_dim_is_128_kib() -> None:
    m = ModelKV.from_config(synthetic(32, 8, 128, heads=32))
    assert m.bytes_per_token == 131_072 == 128 * KIB
    assert model("llama-3.1-8b-instruct").bytes_per_token == 131_072


def test_24gb_card_with_14gb_weights_holds_22_sequences_of_8k() -> None:
    geo = KVGeometry.build(model("qwen2.5-7b-instruct"), block_size=16, max_model_len=8192)
    memory = kv_cache_memory_bytes(24, 1.0, 14)
    assert memory == 10 * GIB
    assert round(geo.bytes_per_sequence / GIB, 2) == 0.44
    blocks = geo.num_blocks(memory)
    assert int(geo.max_concurrency(blocks)) == 22


def test_fp8_kv_halves_every_figure() -> None:
    for name in ("qwen2.5-7b-instruct", "llama-3.1-8b-instruct", "gemma-3-12b-it", "deepseek-v3"):
        auto = KVGeometry.build(model(name), block_size=16, max_model_len=8192)
        fp8 = KVGeometry.build(model(name, kv_cache_dtype="fp8"), block_size=16, max_model_len=8192)
        assert fp8.bytes_per_token * 2 == auto.bytes_per_token
        assert fp8.bytes_per_block * 2 == auto.bytes_per_block
        assert fp8.bytes_per_sequence * 2 == auto.bytes_per_sequence
        memory = 10 * GIB
        # twice the blocks, up to the floor of the division
        assert fp8.num_blocks(memory) // 2 == auto.num_blocks(memory)


# --- architectures ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "layers", "kv_heads", "head", "bytes_per_token", "attention"),
    [
        ("llama-3.1-8b-instruct", 32, 8, 128, 131_072, "gqa"),
        ("llama-3.3-70b-instruct", 80, 8, 128, 327_680, "gqa"),
        ("qwen3-8b", 36, 8, 128, 147_456, "gqa"),
        ("qwen3-30b-a3b", 48, 4, 128, 98_304, "gqa"),
        ("mistral-7b-v0.1", 32, 8, 128, 131_072, "gqa"),
        ("gemma-2-9b-it", 42, 8, 256, 344_064, "gqa"),
        ("gemma-3-12b-it", 48, 8, 256, 393_216, "gqa"),
        ("gpt-oss-20b", 24, 8, 64, 49_152, "gqa"),
        ("mistral-small-3.1-24b-instruct", 40, 8, 128, 163_840, "gqa"),
        # MLA: one latent of kv_lora_rank + qk_rope_head_dim = 576 elements per token per layer
        ("deepseek-v2-lite-chat", 27, 1, 576, 27 * 576 * 2, "mla"),
        ("deepseek-v3", 61, 1, 576, 61 * 576 * 2, "mla"),
    ],
)
def test_published_configs(
    name: str, layers: int, kv_heads: int, head: int, bytes_per_token: int, attention: str
) -> None:
    m = model(name)
    assert (m.num_layers, m.kv_heads_per_rank, m.head_size) == (layers, kv_heads, head)
    assert m.attention == attention
    assert m.bytes_per_token == bytes_per_token


def test_mla_is_not_split_by_tensor_parallelism() -> None:
    one = model("deepseek-v3")
    eight = model("deepseek-v3", tensor_parallel_size=8)
    assert eight.bytes_per_token == one.bytes_per_token
    assert model("deepseek-v3", kv_cache_dtype="fp8_ds_mla").bytes_per_token == 61 * 656


def test_tensor_parallel_divides_kv_heads_and_replicates_below_one() -> None:
    assert model("llama-3.1-8b-instruct", tensor_parallel_size=2).kv_heads_per_rank == 4
    assert model("llama-3.1-8b-instruct", tensor_parallel_size=8).kv_heads_per_rank == 1
    # 8 KV heads over 16 ranks: each rank still keeps one head (replicated), as vLLM does.
    tp16 = model("llama-3.3-70b-instruct", tensor_parallel_size=16)
    assert tp16.kv_heads_per_rank == 1
    assert tp16.bytes_per_token == 80 * 1 * 256 * 2


def test_pipeline_parallel_splits_layers_like_vllm() -> None:
    assert pp_partition(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    # 30 layers on 4 stages: the remainder goes to the middle stages first: [7, 8, 8, 7].
    assert pp_partition(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    m = model("llama-3.3-70b-instruct", pipeline_parallel_size=3)
    assert m.num_layers == 27  # 80 = 26 + 27 + 27: the largest stage binds
    assert m.bytes_per_token == 27 * 8 * 256 * 2


def test_multimodal_text_config_is_used() -> None:
    m = model("mistral-small-3.1-24b-instruct")
    assert m.model_type == "mistral"
    assert m.model_dtype == "bfloat16"  # from the top-level torch_dtype


def test_qwen_sliding_window_is_off_unless_enabled() -> None:
    assert model("qwen2.5-7b-instruct").sliding_windows == ()
    cfg = load_config(CONFIGS / "qwen2.5-7b-instruct.json")
    cfg.update(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    m = ModelKV.from_config(cfg)
    assert m.layer_windows == (None,) * 20 + (4096,) * 8


def test_mistral_sliding_window_caps_blocks_per_request() -> None:
    m = model("mistral-7b-v0.1")
    assert m.layer_windows == (4096,) * 32
    geo = KVGeometry.build(
        m, block_size=16, max_model_len=32768, max_num_batched_tokens=2048, max_concurrent_batches=1
    )
    assert len(geo.groups) == 1
    assert geo.blocks_for_tokens(1000) == cdiv(1000, 16)
    cap = cdiv(4096 - 1 + 2048, 16) + 1
    assert geo.blocks_for_tokens(20_000) == cap
    assert geo.blocks_per_sequence == cap


def test_gemma2_interleaves_local_and_global_layers() -> None:
    m = model("gemma-2-9b-it")
    assert m.layer_windows[:4] == (4096, None, 4096, None)
    geo = KVGeometry.build(m, block_size=16, max_model_len=8192)
    # 21 sliding + 21 full layers: two groups of 21, one pool block = 21 pages.
    assert [g.num_layers for g in geo.groups] == [21, 21]
    assert geo.bytes_per_block == 21 * 16 * 8 * 512 * 2


def test_gemma3_hybrid_groups_and_window_cap() -> None:
    m = model("gemma-3-12b-it")
    assert m.layer_windows[:6] == (1024,) * 5 + (None,)
    geo = KVGeometry.build(
        m,
        block_size=16,
        max_model_len=131072,
        max_num_batched_tokens=8192,
        max_concurrent_batches=2,
    )
    # 40 sliding : 8 full -> groups of 8 layers: 5 sliding groups + 1 full group.
    assert len(geo.groups) == 6 and geo.layers_per_group == 8
    sliding_cap = cdiv(1024 - 1 + 16384, 16) + 1
    n = 100_000
    assert geo.blocks_for_tokens(n) == cdiv(n, 16) + 5 * min(cdiv(n, 16), sliding_cap)
    assert geo.blocks_for_tokens(100) == 6 * cdiv(100, 16)
    assert geo.bytes_per_block == 8 * 16 * 8 * 512 * 2


def test_gpt_oss_alternates_128_token_windows() -> None:
    m = model("gpt-oss-20b")
    assert m.layer_windows[:2] == (128, None)
    geo = KVGeometry.build(
        m,
        block_size=16,
        max_model_len=131072,
        max_num_batched_tokens=8192,
        max_concurrent_batches=1,
    )
    assert [g.num_layers for g in geo.groups] == [12, 12]
    assert geo.blocks_per_sequence == 131072 // 16 + cdiv(127 + 8192, 16) + 1


def test_full_attention_blocks_are_ceil_of_tokens() -> None:
    geo = KVGeometry.build(
        ModelKV.from_config(synthetic(2, 2, 64, heads=4)), block_size=128, max_model_len=1024
    )
    assert geo.bytes_per_token == 1024
    assert geo.bytes_per_block == 131_072
    assert [geo.blocks_for_tokens(n) for n in (0, 1, 128, 129, 971)] == [0, 1, 1, 2, 8]
    assert geo.num_blocks(GIB) == 8192
    assert geo.max_concurrency(8192) == 1024.0
    assert geo.token_capacity(8192) == 1_048_576


def test_max_model_len_from_config() -> None:
    assert KVGeometry.build(model("llama-3.1-8b-instruct")).max_model_len == 131072
    assert KVGeometry.build(model("gemma-3-12b-it")).max_model_len == 131072  # not x8 again
    cfg = synthetic(2, 2, 64)
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    assert KVGeometry.build(ModelKV.from_config(cfg)).max_model_len == 65536


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c.pop("num_hidden_layers"), "missing 'num_hidden_layers'"),
        (lambda c: c.update(num_hidden_layers=0), "'num_hidden_layers' must be a positive integer"),
        (lambda c: c.update(num_key_value_heads=-2), "'num_key_value_heads' must be a positive"),
        (lambda c: c.update(num_attention_heads="32"), "'num_attention_heads' must be a positive"),
        (lambda c: c.update(torch_dtype="float7"), "unknown model dtype 'float7'"),
        (
            lambda c: c.update(layer_types=["local_attention"] * 28),
            "unsupported attention type 'local_attention'",
        ),
        (lambda c: c.update(hidden_size=3585), "not divisible"),
    ],
)
def test_bad_configs_raise_one_line_errors(mutate, message) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config(CONFIGS / "qwen2.5-7b-instruct.json")
    mutate(cfg)
    with pytest.raises(GeometryError, match=message) as info:
        ModelKV.from_config(cfg)
    assert "\n" not in str(info.value)


def test_bad_kv_cache_dtype() -> None:
    with pytest.raises(GeometryError, match="unknown kv cache dtype 'fp4x'"):
        model("qwen3-8b", kv_cache_dtype="fp4x")


def test_load_config_errors(tmp_path: Path) -> None:
    with pytest.raises(GeometryError, match="not found"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(GeometryError, match="not valid JSON"):
        load_config(bad)
    (tmp_path / "list.json").write_text(json.dumps([1]))
    with pytest.raises(GeometryError, match="JSON object"):
        load_config(tmp_path / "list.json")
    # a model directory works like its config.json
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(synthetic(2, 2, 64)))
    assert load_config(tmp_path / "m")["num_hidden_layers"] == 2


def test_memory_errors() -> None:
    with pytest.raises(GeometryError, match="no memory left"):
        kv_cache_memory_bytes(24, 0.5, 14)
    with pytest.raises(GeometryError, match="utilization"):
        kv_cache_memory_bytes(24, 1.5, 1)
