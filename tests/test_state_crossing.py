"""A hybrid model's recurrent-state groups under prefix caching: a decoding sequence holds one
block a group, and a second only at the step at which its tokens cross a block boundary
(vLLM's ``MambaManager``, ``mamba_cache_mode`` ``align``). The pool's future peak counts the
second blocks of the sequences that cross together (``sidecar.kv.crossing``), checked here
against a step-by-step replay of what vLLM holds, and never above the count that gave every
sequence its second blocks at once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.kv.crossing import CROSSING_SLACK_TOKENS, crossing_sequences, tolerance_tokens
from sidecar.kv.geometry import KVGeometry, ModelKV, cdiv
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import project_counts

#: a Qwen3-Next-shaped config: three linear-attention layers to one full one
HYBRID = {
    "model_type": "qwen3_next",
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_size": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "torch_dtype": "bfloat16",
}
STATE_GROUPS = 3


def geometry(mode: str, block: int) -> KVGeometry:
    return KVGeometry.build(
        ModelKV.from_config(HYBRID), block_size=block, max_model_len=8192, mamba_cache_mode=mode
    )


@pytest.mark.parametrize(
    ("tokens", "weight", "unknown", "tolerance", "expected"),
    [
        ([], [], 0, 5, 0),
        ([], [], 3, 5, 3),
        ([10, 266, 522], [1, 1, 1], 0, 1, 3),  # one residue class: they cross together
        ([10, 100, 200], [1, 1, 1], 0, 5, 1),  # three classes far apart
        ([10, 100, 200], [2, 1, 1], 0, 5, 2),  # n = 2: two sequences of one request
        ([10, 14, 200], [1, 1, 1], 0, 5, 2),  # within the window: as if together
        ([10, 15, 200], [1, 1, 1], 0, 5, 1),  # six apart: a window of five does not hold both
        ([254, 2], [1, 1], 0, 5, 2),  # the window wraps around the block
        ([10, 100, 200], [1, 1, 1], 4, 5, 5),  # unseen progress crosses with every class
        ([10, 100, 200], [1, 1, 1], 0, 1000, 3),  # a window past the block holds them all
    ],
)
def test_the_sequences_that_cross_together(
    tokens: list[int], weight: list[int], unknown: int, tolerance: int, expected: int
) -> None:
    assert (
        crossing_sequences(
            np.array(tokens, dtype=np.int64),
            np.array(weight, dtype=np.int64),
            unknown,
            block_size=256,
            tolerance=tolerance,
        )
        == expected
    )


def test_the_window_grows_with_the_streams_lag() -> None:
    assert tolerance_tokens(0.0) == 1 + CROSSING_SLACK_TOKENS
    assert tolerance_tokens(27.5) == 28 + 1 + CROSSING_SLACK_TOKENS


@settings(max_examples=300, deadline=None)
@given(
    block=st.sampled_from([16, 64, 256]),
    seen=st.lists(st.integers(1, 5000), min_size=1, max_size=12),
    behind=st.data(),
)
def test_no_step_has_more_crossings_than_counted(
    block: int, seen: list[int], behind: st.DataObject
) -> None:
    """Each stream is seen up to ``lag`` tokens behind vLLM (different for each): at no step do
    more sequences cross a block boundary than :func:`crossing_sequences` counts from what
    was seen, with the window :func:`tolerance_tokens` gives that lag."""
    lag = behind.draw(st.integers(0, 40))
    true = [t + behind.draw(st.integers(0, lag)) for t in seen]
    counted = crossing_sequences(
        np.array(seen, dtype=np.int64),
        np.ones(len(seen), dtype=np.int64),
        0,
        block_size=block,
        tolerance=tolerance_tokens(lag),
    )
    # a token a step each: sequence i crosses at the steps where its count reaches a new block
    most = max(sum(1 for a in true if (a + t) % block == 1 % block) for t in range(block))
    assert most <= counted


def vllm_peak(started: list[tuple[int, int]], g: KVGeometry) -> int:
    """What vLLM holds at its fullest step for decoding sequences ``(tokens now, steps left)``:
    each full group a page per ``block_size`` tokens, each state group one block, and two at
    the step its tokens enter a new block."""
    size = g.block_size
    most = 0
    for t in range(max(left for _, left in started) + 1):
        held = 0
        for tokens, left in started:
            if t > left:
                continue
            now = tokens + t
            crossed = t > 0 and cdiv(now, size) > cdiv(now - 1, size)
            held += cdiv(now, size) + STATE_GROUPS * (1 + crossed)
        most = max(most, held)
    return most


@settings(max_examples=150, deadline=None)
@given(
    block=st.sampled_from([16, 64, 256]),
    requests=st.lists(
        st.tuples(st.integers(1, 3000), st.integers(0, 1500), st.integers(1, 1500)),
        min_size=1,
        max_size=8,
    ),
)
def test_the_pool_s_peak_is_never_below_vllm_s_nor_above_every_second_block_at_once(
    block: int, requests: list[tuple[int, int, int]]
) -> None:
    """Streamed requests decoding (prompt, generated, still to generate): the ledger's future
    peak is at least what vLLM holds at its fullest step, and at most the count that gave each
    sequence its state groups' second blocks for all its future."""
    g = geometry("align", block)
    assert g.crossing_blocks == STATE_GROUPS
    ledger = Ledger(g, share_prefixes=False)
    started = []
    for prompt, generated, more in requests:
        ask = project_counts(
            (prompt,), requested_max_tokens=generated + more, n=1, max_model_len=8192, blocks=g
        )
        res = ledger.reserve(ask, streamed=True)
        ledger.start(res)
        ledger.advance(res, generated)
        started.append((prompt + generated, more))
    peak = ledger.peak_with()
    assert peak >= vllm_peak(started, g)
    every_second_block = max(
        sum(cdiv(tokens + t, block) + 2 * STATE_GROUPS for tokens, left in started if t <= left)
        for t in range(max(left for _, left in started) + 1)
    )
    assert peak <= every_second_block


def test_sequences_in_step_count_every_second_block_and_apart_one_request_s() -> None:
    """Four requests decoding at 100 tokens, 3,000 to go, blocks of 256: in step they all cross
    at once (the old count's figure); with their prompts 64 tokens apart, one at a time."""
    g = geometry("align", 256)

    def peak(prompts: list[int], streamed: bool = True) -> int:
        ledger = Ledger(g, share_prefixes=False)
        for prompt in prompts:
            ask = project_counts(
                (prompt,), requested_max_tokens=3100, n=1, max_model_len=8192, blocks=g
            )
            res = ledger.reserve(ask, streamed=streamed)
            ledger.start(res)
            ledger.advance(res, 100)
        return ledger.peak_with()

    pages = sum(cdiv(p + 3100, 256) for p in (300, 364, 428, 492))
    assert peak([300, 300, 300, 300]) == 4 * cdiv(3400, 256) + 4 * 2 * STATE_GROUPS
    assert peak([300, 364, 428, 492]) == pages + 4 * STATE_GROUPS + STATE_GROUPS
    # answers not streamed: their progress is estimated, so their phase is unknown
    assert peak([300, 364, 428, 492], streamed=False) == pages + 4 * 2 * STATE_GROUPS
    # without prefix caching a state group never holds a second block
    assert geometry("none", 256).crossing_blocks == 0


def test_a_request_not_started_keeps_its_second_blocks_in_its_future() -> None:
    """Its prefill's chunks cross block boundaries, and its phase is unknown until it runs."""
    g = geometry("align", 256)
    ledger = Ledger(g, share_prefixes=False)
    ask = project_counts((300,), requested_max_tokens=3100, n=1, max_model_len=8192, blocks=g)
    ledger.reserve(ask, streamed=True)
    assert ledger.peak_with() == cdiv(3400, 256) + 2 * STATE_GROUPS
    assert ledger.crossing_blocks() == 0
