"""A streamed answer's progress as the relay reads it (sidecar/http/usage.py): one event a token
a sequence, or the exact usage count where vLLM's continuous usage stats put one in an event.

vLLM merges a stream's tokens into one event when its reader falls behind (its
``RequestOutputCollector``), so events alone can run behind the tokens made."""

from __future__ import annotations

import json

from sidecar.http.usage import UsageTracker


def event(text: str, usage: int | None = None, index: int = 0) -> bytes:
    body: dict[str, object] = {"choices": [{"index": index, "text": text}]}
    if usage is not None:
        body["usage"] = {
            "prompt_tokens": 100,
            "total_tokens": 100 + usage,
            "completion_tokens": usage,
        }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def test_merged_events_count_the_tokens_their_usage_says() -> None:
    t = UsageTracker()
    t.feed(event("a", usage=1), sse=True)
    t.feed(event("bcd", usage=4), sse=True)  # three tokens merged into one event
    assert t.events == 2
    assert t.progress(sequences=1) == 4
    t.feed(event("e", usage=5) + event("fg", usage=7), sse=True)
    assert t.progress(sequences=1) == 7


def test_without_usage_each_event_is_a_token() -> None:
    t = UsageTracker()
    for text in ("a", "bcd", "e"):
        t.feed(event(text), sse=True)
    assert t.progress(sequences=1) == 3


def test_with_several_choices_events_are_the_count() -> None:
    """A chunk's continuous usage counts one choice's tokens, and the last usage chunk the
    total of all: neither is a per-sequence count where n > 1."""
    t = UsageTracker()
    for step in (1, 2, 3):
        t.feed(event("x", usage=step, index=0) + event("y", usage=step, index=1), sse=True)
    assert t.progress(sequences=2) == 3
    t.feed(b'data: {"choices": [], "usage": {"completion_tokens": 6}}\n\n', sse=True)
    assert t.progress(sequences=2) == 3.5  # the usage event is an event; never the total of 6


def test_text_that_spells_usage_is_not_a_count() -> None:
    t = UsageTracker()
    t.feed(event('"completion_tokens": 900'), sse=True)
    assert t.completion_tokens is None and t.progress(sequences=1) == 1


def test_a_count_cut_anywhere_across_chunks_is_read_whole() -> None:
    """The answer fed one byte at a time, then cut at every point into two chunks: the count
    is read as vLLM wrote it, whatever the cut."""
    answer = (
        event("a" * 600, usage=1)
        + b'data: {"choices": [], "usage": {"completion_tokens": 12345}}\n\n'
    )
    for cut in [*range(len(answer) - 80, len(answer)), 1]:
        t = UsageTracker()
        t.feed(answer[:cut], sse=True)
        t.feed(answer[cut:], sse=True)
        assert t.completion_tokens == 12345, cut
    t = UsageTracker()
    for i in range(len(answer)):
        t.feed(answer[i : i + 1], sse=False)
    assert t.completion_tokens == 12345


def test_responses_and_messages_count_their_output_tokens() -> None:
    """Their usage names the answer's length ``output_tokens``: the Messages stream's first
    event says 1 and its ``message_delta`` the whole answer; a chat's tracker reads only
    ``completion_tokens``."""
    start = (
        b"event: message_start\n"
        b'data: {"message": {"usage": {"input_tokens": 9, "output_tokens": 1}}}\n\n'
    )
    delta = b'event: message_delta\ndata: {"delta": {}, "usage": {"output_tokens": 12}}\n\n'
    t = UsageTracker("messages")
    t.feed(start, sse=True)
    assert t.completion_tokens == 1
    t.feed(delta, sse=True)
    assert t.completion_tokens == 12 and t.progress(sequences=1) == 12
    other = UsageTracker("chat")
    other.feed(start + delta, sse=True)
    assert other.completion_tokens is None
    responses = UsageTracker("responses")
    responses.feed(b'{"usage": {"output_tokens": 7, "output_tokens_details": {"x": 1}}}', sse=False)
    assert responses.completion_tokens == 7
