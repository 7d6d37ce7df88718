"""Generated-token progress read out of vLLM's answer as it streams by, without copying it.

>>> t = UsageTracker()
>>> t.feed(b'data: {"x": 1}\\n\\ndata: {"usage": {"completion_tokens": 7}}\\n\\n', sse=True)
>>> t.events, t.completion_tokens
(2, 7)
"""

from __future__ import annotations

import re

_USAGE_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TAIL_BYTES = 4096


class UsageTracker:
    """SSE: one ``data:`` event per decoding step per sequence, and the exact ``usage`` in the
    last event when the client asked for it. JSON: ``usage.completion_tokens`` near the end."""

    __slots__ = ("_tail", "completion_tokens", "events")

    def __init__(self) -> None:
        self.events = 0
        self.completion_tokens: int | None = None
        self._tail = b""

    def feed(self, chunk: bytes, *, sse: bool) -> None:
        if sse:
            self.events += chunk.count(b"data:")
        window = self._tail + chunk
        if b"completion_tokens" in window:
            matches = _USAGE_COMPLETION.findall(window)
            if matches:
                self.completion_tokens = int(matches[-1])
        self._tail = window[-_TAIL_BYTES:]
