"""Generated-token progress read out of vLLM's answer as it streams by, without copying it.

>>> t = UsageTracker()
>>> t.feed(b'data: {"x": 1}\\n\\ndata: {"usage": {"completion_tokens": 7}}\\n\\n', sse=True)
>>> t.events, t.completion_tokens
(2, 7)
>>> t.progress(sequences=1)  # the usage count, where there is one, is exact
7.0

The Responses and Anthropic Messages endpoints count the answer as ``usage.output_tokens``
(``response.completed``'s and ``message_delta``'s usage when streamed):

>>> t = UsageTracker(endpoint="responses")
>>> t.feed(b'{"usage": {"input_tokens": 4, "output_tokens": 9, "total_tokens": 13}}', sse=False)
>>> t.completion_tokens
9
"""

from __future__ import annotations

import re

#: the answer's length as each endpoint's usage names it: ``completion_tokens`` for completions
#: and chat, ``output_tokens`` for these (Responses, Anthropic Messages)
_OUTPUT_TOKENS_ENDPOINTS = frozenset({"responses", "messages"})
_COUNTS = {
    key: re.compile(re.escape(key) + rb"\s*:\s*(\d+)")
    for key in (b'"completion_tokens"', b'"output_tokens"')
}
#: the bytes of one chunk kept to read the next with: longer than any match (the key, a space,
#: the digits), so a count cut across two chunks is read whole; not more, since every chunk is
#: searched with them (a stream's every event carries a count under vLLM's continuous usage)
_TAIL_BYTES = 256


class UsageTracker:
    """SSE: one ``data:`` event per decoding step per sequence, and the exact ``usage`` in the
    last event when the client asked for it. JSON: ``usage.completion_tokens`` near the end."""

    __slots__ = ("_count", "_key", "_tail", "completion_tokens", "events")

    def __init__(self, endpoint: str = "completions") -> None:
        self.events = 0
        self.completion_tokens: int | None = None
        self._tail = b""
        self._key = (
            b'"output_tokens"' if endpoint in _OUTPUT_TOKENS_ENDPOINTS else b'"completion_tokens"'
        )
        self._count = _COUNTS[self._key]

    def feed(self, chunk: bytes, *, sse: bool) -> None:
        if sse:
            self.events += chunk.count(b"data:")
        window = self._tail + chunk
        at = window.rfind(self._key)
        while at >= 0:  # the last count in the window (a text that spells the key is no count)
            found = self._count.match(window, at)
            if found:
                self.completion_tokens = int(found[1])
                break
            at = window.rfind(self._key, 0, at)
        self._tail = window[-_TAIL_BYTES:]

    def progress(self, *, sequences: int) -> float:
        """Tokens generated per sequence so far, as far as the answer shows: one event a token
        a sequence, or, for one sequence, the ``usage`` count where an event carries it (vLLM's
        continuous usage stats, which a client asks for with ``stream_options.
        continuous_usage_stats``, or every stream under ``--enable-force-include-usage``).

        Events alone fall behind: vLLM merges a stream's tokens into one event when its reader
        falls behind (its ``RequestOutputCollector``; ``--stream-interval`` does so on purpose),
        and a burst through two relay workers on a busy 2-core machine saw 672 events for 700
        tokens. With n > 1 a chunk's usage counts one choice's tokens (the last one the total),
        so events are the count there."""
        events = self.events / max(sequences, 1)
        if sequences == 1 and self.completion_tokens is not None:
            return max(events, float(self.completion_tokens))
        return events
