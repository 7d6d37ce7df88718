"""The block-math protocol every KV computation takes: what vLLM's allocator does with tokens.

One protocol for the projection, the ledger and the trajectories; :class:`sidecar.kv.geometry.
UniformBlocks` and :class:`sidecar.kv.geometry.KVGeometry` implement it.

>>> from sidecar.kv.geometry import UniformBlocks
>>> blocks: BlockMath = UniformBlocks(16)
>>> blocks.blocks_for_tokens(17), blocks.group_caps
(2, (None,))
"""

from __future__ import annotations

from typing import Protocol


class BlockMath(Protocol):
    """Per KV-cache group, ``ceil(tokens / block_size)`` pages, capped for a sliding-window group
    (``None``: no cap); :meth:`blocks_for_tokens` sums them over the groups."""

    @property
    def block_size(self) -> int: ...

    @property
    def group_caps(self) -> tuple[int | None, ...]: ...

    def blocks_for_tokens(self, num_tokens: int) -> int: ...
