"""The prefix's block hashes of counted prompts: whether vLLM reads its prefix cache for a body,
the salt it keys blocks by, and the hashes of the ids vLLM keeps (:mod:`sidecar.kv.prefix`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.counting.plan import PromptTokens, Truncation
from sidecar.counting.request import CountedEndpoint
from sidecar.kv.prefix import BlockHashes, block_hashes

__all__ = ["hash_prompts", "reads_prefix_cache", "salt_value"]


def reads_prefix_cache(endpoint: CountedEndpoint, body: Mapping[str, Any]) -> bool:
    """Whether vLLM looks the request's prompt up in its prefix cache.

    Prompt logprobs make it skip the lookup (``SamplingParams.skip_reading_prefix_cache``):
    the request computes and holds its own blocks. vLLM asks for prompt logprobs when
    ``prompt_logprobs`` is set, and for ``echo`` with logprobs (chat's ``top_logprobs``
    defaults to 0, so a chat ``echo`` always does).
    """
    if body.get("prompt_logprobs") is not None:
        return False
    if body.get("echo"):
        logprobs = (
            body.get("logprobs") if endpoint == "completions" else body.get("top_logprobs", 0)
        )
        return logprobs is None
    return True


def salt_value(value: object) -> str | None:
    """``cache_salt`` as a hashable key (vLLM takes a string; anything else is keyed apart)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def hash_prompts(
    tokens: Sequence[PromptTokens],
    counts: Sequence[int],
    truncation: Truncation,
    max_model_len: int | None,
    block_size: int,
    salt: object,
) -> tuple[BlockHashes, ...] | None:
    """The block hashes of every prompt, truncated as vLLM truncates it; None if any prompt's
    kept ids are unknown or disagree with its count (never a guess)."""
    out: list[BlockHashes] = []
    for prompt, count in zip(tokens, counts, strict=True):
        ids = truncation.apply_ids(prompt, max_model_len)
        if ids is None or len(ids) != count:
            return None
        out.append(block_hashes(ids, block_size=block_size, salt=salt))
    return tuple(out)
