"""Projection: vLLM's clamp of max_tokens, its 400s, n, several prompts, and hybrid geometry."""

from __future__ import annotations

import inspect

import pytest

from sidecar.errors import BadRequest
from sidecar.kv.geometry import KVGeometry, ModelKV, UniformBlocks
from sidecar.kv.projection import project_counts

B128 = UniformBlocks(128)


def test_clamped_to_the_rest_of_the_context() -> None:
    # measured on the real vLLM: prompt 449, max_tokens 600, max_model_len 1024 -> 575 tokens
    p = project_counts((449,), requested_max_tokens=600, n=1, max_model_len=1024, blocks=B128)
    assert p.max_tokens == (575,)
    assert p.peak_blocks == 8 and p.prompt_blocks == 4


def test_absent_max_tokens_means_the_rest_of_the_context() -> None:
    p = project_counts((100,), requested_max_tokens=None, n=1, max_model_len=1024, blocks=B128)
    assert p.max_tokens == (924,) and p.peak_tokens == 1024


def test_n_and_several_prompts_multiply() -> None:
    p = project_counts((271, 10), requested_max_tokens=700, n=3, max_model_len=1024, blocks=B128)
    assert p.sequences == 6
    assert p.peak_blocks == 3 * (8 + 6)
    assert p.blocks_at(200, B128) == 3 * (4 + 2)


def test_vllm_400s() -> None:
    with pytest.raises(
        BadRequest, match=r"max_tokens=5000 cannot be greater than max_model_len=1024"
    ):
        project_counts((10,), requested_max_tokens=5000, n=1, max_model_len=1024, blocks=B128)
    with pytest.raises(BadRequest, match="maximum context length is 1024 tokens") as info:
        project_counts((2000,), requested_max_tokens=5, n=1, max_model_len=1024, blocks=B128)
    assert info.value.code == "context_length_exceeded"


def test_counts_arrive_truncated_and_are_not_truncated_again() -> None:
    # The prompt counter applies truncate_prompt_tokens (tests/test_tokens.py), the only place;
    # the projection has no way to truncate a second time.
    assert "truncate_prompt_tokens" not in inspect.signature(project_counts).parameters
    p = project_counts((1000,), requested_max_tokens=10, n=1, max_model_len=1024, blocks=B128)
    assert p.prompt_tokens == (1000,)


def test_sliding_window_model_projects_capped_blocks() -> None:
    cfg = {
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "sliding_window": 256,
        "max_position_embeddings": 8192,
    }
    geo = KVGeometry.build(
        ModelKV.from_config(cfg),
        block_size=16,
        max_model_len=8192,
        max_num_batched_tokens=64,
        max_concurrent_batches=1,
    )
    # a short prompt: its most is what it holds as it decodes, the blocks its window and the
    # token it schedules span (one step at a time: no unsettled step's token), 256 tokens
    # across 17 blocks where the window does not start on a block boundary
    p = project_counts((100,), requested_max_tokens=5000, n=1, max_model_len=8192, blocks=geo)
    assert p.peak_blocks == -(-(256 - 1) // 16) + 1 == 17
    assert p.prompt_blocks == -(-100 // 16) == 7
    # a long prompt, prefilled in chunks of 64: the window and one chunk, vLLM's own cap
    p = project_counts((1000,), requested_max_tokens=5000, n=1, max_model_len=8192, blocks=geo)
    assert p.peak_blocks == p.prompt_blocks == -(-(256 - 1 + 64) // 16) + 1 == 21
    assert p.blocks_at(10, geo) == 17  # once it decodes, the decode step's


def test_estimated_counts_are_capped_not_refused() -> None:
    # an upper-bound estimate of 5000 tokens: only vLLM can say whether it is too long
    p = project_counts(
        (5000,), requested_max_tokens=100, n=1, max_model_len=1024, blocks=B128, exact=False
    )
    assert p.prompt_tokens == (1023,) and p.max_tokens == (1,) and not p.exact


# --- vLLM's defaults (entrypoints/serve/utils/api_utils.py get_max_tokens) ---------------------


def test_generation_config_default_applies_only_without_max_tokens() -> None:
    # a chat request naming no max_tokens: the generation config's max_new_tokens
    p = project_counts(
        (100,),
        requested_max_tokens=None,
        n=1,
        max_model_len=1024,
        blocks=B128,
        default_max_tokens=256,
    )
    assert p.max_tokens == (256,) and p.peak_blocks == 3
    # a request's own max_tokens wins over the default, larger or smaller
    for asked in (10, 500):
        p = project_counts(
            (100,),
            requested_max_tokens=asked,
            n=1,
            max_model_len=1024,
            blocks=B128,
            default_max_tokens=256,
        )
        assert p.max_tokens == (asked,)


def test_default_is_clamped_to_the_rest_of_the_context_never_refused() -> None:
    # vLLM checks only the request's own value against max_model_len
    p = project_counts(
        (900,),
        requested_max_tokens=None,
        n=1,
        max_model_len=1024,
        blocks=B128,
        default_max_tokens=5000,
    )
    assert p.max_tokens == (124,)


def test_cap_bounds_every_request_even_an_explicit_one() -> None:
    for asked, default in ((600, None), (None, None), (None, 256), (10, None)):
        p = project_counts(
            (100,),
            requested_max_tokens=asked,
            n=1,
            max_model_len=1024,
            blocks=B128,
            default_max_tokens=default,
            max_tokens_cap=64,
        )
        assert p.max_tokens == (min(64, asked or 64),), (asked, default)
    # the cap never lifts the context clamp, and never turns the 400 off
    p = project_counts(
        (1000,),
        requested_max_tokens=None,
        n=1,
        max_model_len=1024,
        blocks=B128,
        max_tokens_cap=64,
    )
    assert p.max_tokens == (24,)
    with pytest.raises(BadRequest, match="max_tokens=2000 cannot be greater"):
        project_counts(
            (10,),
            requested_max_tokens=2000,
            n=1,
            max_model_len=1024,
            blocks=B128,
            max_tokens_cap=64,
        )


def test_defaults_apply_per_prompt_and_per_sequence() -> None:
    p = project_counts(
        (1000, 10),
        requested_max_tokens=None,
        n=2,
        max_model_len=1024,
        blocks=B128,
        default_max_tokens=100,
    )
    assert p.max_tokens == (24, 100)
    assert p.peak_tokens == 2 * (1024 + 110)


def test_completions_default_of_16_projects_as_a_request_for_16() -> None:
    from sidecar.counting.request import parse_generation

    for raw in (b'{"prompt": "x"}', b'{"prompt": "x", "max_tokens": null}'):
        request = parse_generation("completions", raw)
        p = project_counts(
            (5,),
            requested_max_tokens=request.requested_max_tokens,
            n=1,
            max_model_len=1024,
            blocks=B128,
            default_max_tokens=256,  # never used for completions
        )
        assert p.max_tokens == (16,)
    # ... so a context under 16 refuses it as vLLM does
    with pytest.raises(BadRequest, match=r"max_tokens=16 cannot be greater than max_model_len=8"):
        project_counts((2,), requested_max_tokens=16, n=1, max_model_len=8, blocks=B128)
