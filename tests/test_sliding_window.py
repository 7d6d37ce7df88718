"""Sliding-window block math (``KVGeometry.blocks_held``) against vLLM's allocator, replayed.

``vllm_held`` replays ``SlidingWindowManager`` (vllm/v1/core/single_type_kv_cache_manager.py) for
one sequence: before each step ``remove_skipped_blocks`` frees the blocks wholly below the
window of the tokens processed and settled (``get_num_skipped_tokens``: the computed tokens
less the window's ``sliding_window - 1``), then the step's tokens get slots. The sidecar's count
must never be below what vLLM holds (it would admit into a pool vLLM has not got) and, once a
sequence decodes, at most two blocks above it (the tokens in flight it allows for). The
end-to-end check on the real vLLM is tests/test_sliding_window_vllm.py.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.kv.geometry import KVGeometry, ModelKV, cdiv
from sidecar.kv.trajectory import _blocks


def geometry(window: int, block_size: int, batched: int, batches: int, mml: int) -> KVGeometry:
    cfg = {
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "sliding_window": window,
        "max_position_embeddings": mml,
        "torch_dtype": "bfloat16",
    }
    return KVGeometry.build(
        ModelKV.from_config(cfg),
        block_size=block_size,
        max_model_len=mml,
        max_num_batched_tokens=batched,
        max_concurrent_batches=batches,
    )


def vllm_held(
    window: int, size: int, prompt: int, steps: int, batched: int, unsettled: int
) -> tuple[int, list[int]]:
    """The most blocks the sequence holds while it prefills (in chunks of ``batched``), and what
    it holds at each decode step after, with ``unsettled`` tokens of earlier steps in flight."""
    peak, computed, ends = 0, 0, [0]
    while computed < prompt:  # chunked prefill, ``unsettled`` chunks before this one in flight
        chunk = min(batched, prompt - computed)
        settled = ends[max(0, len(ends) - 1 - unsettled)]
        skipped = max(0, settled - (window - 1)) // size
        peak = max(peak, cdiv(computed + chunk, size) - skipped)
        computed += chunk
        ends.append(computed)
    decode = []
    for _ in range(steps):
        settled = max(0, computed - unsettled)
        skipped = max(0, settled - (window - 1)) // size
        decode.append(cdiv(computed + 1, size) - skipped)  # the token this step computes
        computed += 1
    return peak, decode


@settings(max_examples=300, deadline=None)
@given(
    window=st.sampled_from([64, 100, 256, 512, 4096]),
    size=st.sampled_from([16, 32, 128]),
    prompt=st.integers(1, 3000),
    batched=st.sampled_from([64, 512, 2048, 8192]),
    batches=st.sampled_from([1, 2]),
)
def test_the_count_bounds_what_vllm_holds_and_is_within_a_block_of_it(
    window: int, size: int, prompt: int, batched: int, batches: int
) -> None:
    geo = geometry(window, size, batched, batches, mml=8192)
    steps = 600
    # with B concurrent batches (async scheduling: 2), B - 1 steps are in flight unsettled
    prefill, decode = vllm_held(window, size, prompt, steps, batched, unsettled=batches - 1)
    _, settled = vllm_held(window, size, prompt, steps, batched, unsettled=0)
    # before it starts: at least its prefill's peak, at every length it may reach
    assert geo.blocks_held(prompt, prompt, started=False) >= prefill
    for g, (held, low) in enumerate(zip(decode, settled, strict=True), start=1):
        n = prompt + g
        assert geo.blocks_held(n, prompt, started=False) >= held
        ours = geo.blocks_held(n, prompt, started=True)
        # the span of the window's tokens: a block above what the sequence holds settled at
        # an aligned position, never more (vLLM's own cap formula is a block above that again
        # where the window is a multiple of the block)
        assert low <= held <= ours <= low + 1, (g, held, low, ours)
    # the lifetime cap (vLLM's admission cap) bounds both
    assert geo.blocks_held(prompt + steps, prompt, started=False) <= geo.blocks_for_tokens(
        prompt + steps
    )


@settings(max_examples=200, deadline=None)
@given(
    window=st.sampled_from([64, 256, 1000]),
    size=st.sampled_from([16, 32]),
    rows=st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 3000), st.booleans()), min_size=1),
)
def test_the_vectorised_caps_count_as_the_scalar_count(
    window: int, size: int, rows: list[tuple[int, int, bool]]
) -> None:
    geo = geometry(window, size, 2048, 2, mml=8192)
    prompt = np.array([p for p, _, _ in rows], dtype=np.int64)
    tokens = np.array([p + g for p, g, _ in rows], dtype=np.int64)
    started = np.array([s for _, _, s in rows], dtype=bool)
    vectorised = _blocks(tokens, geo, geo.window_caps(prompt, started))
    scalar = [geo.blocks_held(p + g, p, started=s) for p, g, s in rows]
    assert vectorised.tolist() == scalar


def test_a_full_attention_model_counts_every_token() -> None:
    cfg = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "torch_dtype": "bfloat16",
    }
    geo = KVGeometry.build(ModelKV.from_config(cfg), block_size=16, max_model_len=4096)
    assert geo.blocks_held(1000, 600, started=True) == geo.blocks_for_tokens(1000) == 63
    assert geo.window_caps(np.array([600]), True) == (None,)
