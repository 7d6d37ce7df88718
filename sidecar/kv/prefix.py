"""Prompt blocks as vLLM's prefix cache sees them: a chain of hashes of full token blocks.

vLLM (with prefix caching, the default) keys each *full* block of a prompt by a hash of its
parent block's hash and its own token ids (plus extra keys: LoRA, multimodal inputs,
``cache_salt``), and holds a block that several running requests share once, ref-counted. The
sidecar keys blocks the same way with its own hash (as llm-d's KV-cache indexer and Dynamo's
router do; vLLM's seed need not match, since the keys are only compared with each other), so
that two requests in flight whose prompts start with the same full blocks are charged for
those blocks once.

>>> a = block_hashes(list(range(40)), block_size=16)
>>> b = block_hashes(list(range(32)) + [7] * 8, block_size=16)
>>> len(a), a[:2] == b[:2], block_hashes(list(range(40)), block_size=16, salt="x")[0] == a[0]
(2, True, False)
"""

from __future__ import annotations

from collections.abc import Sequence

BlockHashes = tuple[int, ...]

_ROOT = hash(("vllm-kv-sidecar", "prefix-root"))


def block_hashes(token_ids: Sequence[int], *, block_size: int, salt: object = None) -> BlockHashes:
    """The chain hash of every shareable ``block_size`` block of ``token_ids``: the full blocks
    of all tokens but the last (a partial block is never shared, and vLLM caps a prefix-cache
    hit at ``len - 1`` tokens, since it recomputes the last one: a prompt of exactly k blocks
    shares k - 1). ``salt`` separates what vLLM keeps apart (model or LoRA, cache_salt).

    >>> [len(block_hashes([0] * n, block_size=16)) for n in (31, 32, 33)]
    [1, 1, 2]
    """
    parent = hash((_ROOT, salt)) if salt is not None else _ROOT
    out: list[int] = []
    shareable = (len(token_ids) - 1) // block_size * block_size
    for start in range(0, shareable, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        out.append(parent)
    return tuple(out)
