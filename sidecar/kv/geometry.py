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

Everything here is pure: no I/O (``sidecar.kv.model.load_config``, re-exported here, reads one
JSON file).

>>> kv = ModelKV.from_config({"num_hidden_layers": 28, "num_attention_heads": 28,
...     "num_key_value_heads": 4, "hidden_size": 3584, "torch_dtype": "bfloat16"})
>>> kv.bytes_per_token
57344
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from sidecar.errors import GeometryError
from sidecar.kv.blocks import UniformBlocks
from sidecar.kv.layers import STATE

# the model's figures, read from its config (sidecar.kv.model), lived here first
from sidecar.kv.model import (
    CACHE_DTYPE_BYTES,
    DEFAULT_MAX_CONCURRENT_BATCHES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GIB,
    MODEL_DTYPE_BYTES,
    ModelKV,
    cdiv,
    derived_max_model_len,
    derived_max_model_len_and_key,
    load_config,
    pp_partition,
    text_config,
)

#: what callers import from here (the model's figures were here first)
__all__ = [
    "CACHE_DTYPE_BYTES",
    "DEFAULT_MAX_CONCURRENT_BATCHES",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "GIB",
    "MODEL_DTYPE_BYTES",
    "GeometryError",
    "KVGeometry",
    "KVGroup",
    "ModelKV",
    "UniformBlocks",
    "cdiv",
    "derived_max_model_len",
    "derived_max_model_len_and_key",
    "load_config",
    "pp_partition",
    "text_config",
]


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
