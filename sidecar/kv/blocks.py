"""The block-math protocol every KV computation takes: what vLLM's allocator does with tokens.

One protocol for the projection, the ledger and the trajectories; :class:`sidecar.kv.geometry.
UniformBlocks` and :class:`sidecar.kv.geometry.KVGeometry` implement it.

A sliding-window group holds, besides the window, the tokens in flight (scheduled and not yet
settled: vLLM frees blocks below the window on the processed-token basis). vLLM sizes its pool and
caps its admission by the most a step may schedule (``group_caps``); a sequence holds that much
only while it prefills a prompt that long, and once it decodes, the window plus a token a step in
flight. So the block math takes the sequence's prompt and whether vLLM runs it yet:
:meth:`BlockMath.blocks_held` (:meth:`BlockMath.window_caps` for arrays of sequences).

>>> from sidecar.kv.blocks import UniformBlocks
>>> blocks: BlockMath = UniformBlocks(16)
>>> blocks.blocks_for_tokens(17), blocks.group_caps, blocks.blocks_held(17, 16, started=True)
(2, (None,), 2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


class BlockMath(Protocol):
    """Per KV-cache group, ``ceil(tokens / block_size)`` pages, capped for a sliding-window group
    (``None``: no cap); :meth:`blocks_for_tokens` sums them over the groups."""

    @property
    def block_size(self) -> int: ...

    @property
    def group_caps(self) -> tuple[int | None, ...]:
        """Per group, the most blocks one sequence ever holds (vLLM's admission cap)."""
        ...

    @property
    def crossing_blocks(self) -> int:
        """Blocks a decoding sequence holds beyond :meth:`window_caps` at a step that crosses a
        block boundary (recurrent-state groups under prefix caching; ``sidecar.kv.crossing``)."""
        ...

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks at ``num_tokens`` tokens under :attr:`group_caps` (a sequence at its worst)."""
        ...

    def blocks_held(self, num_tokens: int, prompt: int, *, started: bool) -> int:
        """Blocks a sequence of ``prompt`` prompt tokens holds at ``num_tokens``: not started,
        as its prefill may hold them (and at most that from then on); started, as it decodes."""
        ...

    def window_caps(
        self, prompt: IntArray, started: bool | npt.NDArray[np.bool_]
    ) -> tuple[IntArray | None, ...]:
        """Per group, each sequence's cap as :meth:`blocks_held` takes it (None: no cap)."""
        ...


@dataclass(frozen=True)
class UniformBlocks:
    """Block math without a model config: every layer holds every token (full attention).

    Exact in block units for any full-attention model, since vLLM's pool block is then one
    page of every layer; ``bytes_per_block`` comes from elsewhere (vLLM's reported KV memory over
    its block count) and may be unknown.
    """

    block_size: int
    bytes_per_block: int | None = None

    @property
    def group_caps(self) -> tuple[int | None, ...]:
        return (None,)

    @property
    def crossing_blocks(self) -> int:
        return 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        # ceil, inlined (called several times per admission decision)
        return -(-num_tokens // self.block_size) if num_tokens > 0 else 0

    def blocks_held(self, num_tokens: int, prompt: int, *, started: bool) -> int:
        return -(-num_tokens // self.block_size) if num_tokens > 0 else 0

    def window_caps(
        self, prompt: IntArray, started: bool | npt.NDArray[np.bool_]
    ) -> tuple[IntArray | None, ...]:
        return (None,)
