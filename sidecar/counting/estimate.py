"""The upper-bound estimate of a prompt's tokens, for when nothing can count it exactly.

It bounds, rather than guesses at the mean: one token per UTF-8 byte of text (no byte-level BPE
or byte-fallback tokenizer produces more), plus a fixed allowance for the template's markup and
for every non-text part. It is several times too high for ordinary prose, so a caller should
not refuse a request as "never fits" on an estimate alone.

>>> estimate_text("héllo")
6
>>> estimate_completion_prompt([1, 2, 3]), estimate_completion_prompt("hi")
(3, 6)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.counting.render import MEDIA_PART_KEYS

# Allowances (tokens). Generous on purpose: the estimate must not undercount.
_EST_PER_PROMPT = 4
_EST_PER_CHAT = 32
_EST_PER_MESSAGE = 8
_EST_PER_TOOL = 16
_EST_PER_NON_TEXT_PART = 2048


def estimate_text(text: str) -> int:
    """Tokens ``text`` can take at most."""
    # One token per UTF-8 byte bounds every byte-level BPE and byte-fallback tokenizer.
    return len(text.encode("utf-8", errors="replace"))


def estimate_completion_prompt(prompt: str | list[int]) -> int:
    """Tokens one completions prompt (text or token ids) can take at most."""
    if isinstance(prompt, list):
        return len(prompt)
    return estimate_text(prompt) + _EST_PER_PROMPT


def estimate_anything(value: object) -> int:
    """Every string leaf, every non-text part, some markup per object."""
    if isinstance(value, str):
        return estimate_text(value)
    if isinstance(value, Mapping):
        media = _EST_PER_NON_TEXT_PART if any(k in value for k in MEDIA_PART_KEYS) else 0
        return media + _EST_PER_MESSAGE + sum(estimate_anything(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(estimate_anything(v) for v in value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return len(str(value))
    return 0


def estimate_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, Any],
) -> int:
    """Tokens a rendered chat can take at most: its messages, tools and template kwargs."""
    total = _EST_PER_CHAT
    for message in messages:
        total += estimate_anything(message)
    for tool in tools or []:
        total += _EST_PER_TOOL + estimate_text(json.dumps(tool, ensure_ascii=False))
    if template_kwargs:
        # Documents, tools given as kwargs, anything else the template may print.
        total += estimate_text(json.dumps(template_kwargs, ensure_ascii=False, default=str))
    return total
