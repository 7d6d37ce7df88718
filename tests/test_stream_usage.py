"""The usage count the sidecar asks vLLM for on a stream whose client asked for none, and takes
back out of what the client receives (sidecar/http/stream_usage.py, ``--stream-usage``).

The streams are built with the harness's vLLM 0.32 formats (harness/vllm_formats.py, checked
against the real server in tests/test_stream_usage_vllm.py): asked for the usage, every event
carries it and a usage-only event ends the stream, with the fingerprint moved onto it; stripped,
the client must get the bytes of the stream it asked for, however the events are cut into reads.
"""

from __future__ import annotations

import json

import pytest

from harness.vllm_formats import (
    SSE_DONE,
    sse_event,
    stream_head,
    stream_opening,
    stream_token,
    stream_usage,
    token_usage,
)
from sidecar.config import ReservationMode, StreamUsage
from sidecar.http.stream_usage import (
    EVERY_EVENT,
    FINAL,
    UsageStripper,
    ask_every_event,
    ask_usage,
    stream_usage_asked,
    strip_usage,
    wants_every_event,
    wants_usage,
)
from sidecar.http.usage import UsageTracker

PROMPT = 12


def stream(chat: bool, tokens: int, *, asked: bool, n: int = 1, every: bool = True) -> bytes:
    """A vLLM stream of ``tokens`` tokens a choice: as sent unasked, or asked for the usage
    (``include_usage``), on every event too where ``every`` (``continuous_usage_stats``)."""
    head = stream_head(chat, "cmpl-1", "tiny")
    out = b""
    counts = asked and every
    if chat:
        for i in range(n):
            out += sse_event(
                stream_opening(head, i, token_usage(True, PROMPT, 0) if counts else None)
            )
    for step in range(tokens):
        last = step == tokens - 1
        usage = token_usage(chat, PROMPT, step + 1) if counts else None
        for i in range(n):
            event = stream_token(
                head, chat, i, f" w{step}", last=last, usage=usage, fingerprint=last and not asked
            )
            out += sse_event(event)
    if asked:
        total = {
            "prompt_tokens": PROMPT,
            "total_tokens": PROMPT + tokens,
            "completion_tokens": tokens,
        }
        out += sse_event(stream_usage(head, total))
    return out + SSE_DONE


def relayed(asked: bytes, cuts: list[int], *, keep_final: bool = False) -> bytes:
    """``asked`` cut into reads at ``cuts`` and then at whole events, as the relay does, through
    one stripper."""
    stripper = UsageStripper(keep_final=keep_final)
    out = b""
    held = b""
    for a, b in zip([0, *cuts], [*cuts, len(asked)], strict=True):
        data = held + asked[a:b]
        cut = data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0
        out += stripper(data[:cut]) if cut else b""
        held = data[cut:]
    return out + stripper.flush() + held


@pytest.mark.parametrize("every", [True, False], ids=["every-event", "final"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_stripped_the_stream_is_the_one_the_client_asked_for(
    chat: bool, tokens: int, every: bool
) -> None:
    asked = stream(chat, tokens, asked=True, every=every)
    unasked = stream(chat, tokens, asked=False)
    assert b'"usage":' in asked and b'"usage":' not in unasked
    assert b"system_fingerprint" not in asked.split(b"\n\n")[-4]  # moved to the usage event
    assert b'"system_fingerprint"' in unasked.split(b"\n\n")[-3]  # on the last token's event
    assert strip_usage(asked) == unasked
    # however the reads fall: every single cut, and every event on its own
    for cut in range(1, len(asked)):
        assert relayed(asked, [cut]) == unasked, cut
    ends = [i + 2 for i in range(len(asked)) if asked[i : i + 2] == b"\n\n"][:-1]
    assert relayed(asked, ends) == unasked


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_a_client_that_asked_for_the_final_count_gets_it_and_not_every_events(
    chat: bool, tokens: int
) -> None:
    """Under ``every-event``, a client that asked for ``include_usage`` alone is asked for
    every event's count too (:func:`ask_every_event`); its stream keeps the usage-only event,
    fingerprint and all, and loses the count on the others."""
    asked = stream(chat, tokens, asked=True, every=True)
    own = stream(chat, tokens, asked=True, every=False)
    for cut in range(1, len(asked)):
        assert relayed(asked, [cut], keep_final=True) == own, cut


def test_the_client_s_final_ask_is_extended_and_nothing_else_changes() -> None:
    sent = {"model": "m", "stream": True, "priority": 3, "stream_options": {"include_usage": True}}
    extended = ask_every_event(sent)
    assert extended is not None and ask_every_event({"stream_options": 1}) is None
    assert sent["stream_options"] == {"include_usage": True}  # the client's own object kept
    body = json.loads(extended)
    assert body.pop("stream_options") == {"include_usage": True, "continuous_usage_stats": True}
    assert body == {"model": "m", "stream": True, "priority": 3}


@pytest.mark.parametrize(
    ("endpoint", "body", "sequences", "asks"),
    [
        ("chat", {"stream": True, "stream_options": {"include_usage": True}}, 1, True),
        ("completions", {"stream": True, "stream_options": {"include_usage": True}}, 1, True),
        ("chat", {"stream": True, "stream_options": {"include_usage": False}}, 1, False),
        ("chat", {"stream": True, "stream_options": None}, 1, False),
        (
            "chat",
            {
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            1,
            False,  # it has every event's already
        ),
        ("chat", {"stream": True, "stream_options": {"include_usage": True}, "n": 2}, 2, False),
        ("responses", {"stream": True, "stream_options": {"include_usage": True}}, 1, False),
    ],
)
def test_which_final_asks_are_extended_to_every_event(
    endpoint: str, body: dict[str, object], sequences: int, asks: bool
) -> None:
    assert wants_every_event(endpoint, body, sequences) is asks


def test_the_tracker_reads_the_exact_count_before_the_strip() -> None:
    """The relay feeds the tracker vLLM's bytes, and the client the stripped ones: merged events
    (here three tokens in one) are counted by vLLM's count, where events alone say 3."""
    asked = stream(False, 5, asked=True)
    events = asked.split(b"\n\n")
    merged = b"\n\n".join([events[0], *events[3:]])  # the 2nd and 3rd tokens' events merged away
    tracker = UsageTracker()
    tracker.feed(merged, sse=True)
    assert tracker.progress(sequences=1) == 5 and tracker.completion_tokens == 5
    assert b'"usage"' not in strip_usage(merged)


def test_a_stream_that_breaks_off_after_its_last_token_keeps_it() -> None:
    """The event that ends the choice is held for the usage-only event; a stream that ends
    without one gets it at the flush, without its usage."""
    asked = stream(False, 3, asked=True)
    events = asked.split(b"\n\n")
    cut = b"\n\n".join(events[:3]) + b"\n\n"  # the three tokens' events, nothing after
    stripper = UsageStripper()
    out = stripper(cut)
    assert out.count(b"data: ") == 2  # the last one held
    tail = stripper.flush()
    assert tail.count(b"data: ") == 1 and b'"finish_reason":"length"' in tail
    assert b'"usage"' not in out + tail and b"fingerprint" not in tail
    assert stripper.flush() == b""


def test_text_that_spells_usage_and_choices_is_left_alone() -> None:
    head = stream_head(False, "cmpl-1", "tiny")
    text = '"usage":{"prompt_tokens":1},"choices":[] and "finish_reason":"x"'
    plain = sse_event(stream_token(head, False, 0, text, last=False))
    assert strip_usage(plain) == plain
    asked = sse_event(
        stream_token(head, False, 0, text, last=False, usage=token_usage(False, PROMPT, 1))
    )
    assert strip_usage(asked) == plain


def test_nested_and_null_usage_members_are_taken_out_wherever_they_stand() -> None:
    nested = b'{"usage":{"prompt_tokens":1,"prompt_tokens_details":{"cached_tokens":0}},"id":"x"}'
    assert strip_usage(b"data: " + nested + b"\n\n") == b'data: {"id":"x"}\n\n'
    middle = b'{"id":"x","usage":null,"choices":[{"text":"a"}]}'
    assert (
        strip_usage(b"data: " + middle + b"\n\n")
        == b'data: {"id":"x","choices":[{"text":"a"}]}\n\n'
    )


@pytest.mark.parametrize(
    ("ask", "options"),
    [
        (EVERY_EVENT, {"include_usage": True, "continuous_usage_stats": True}),
        (FINAL, {"include_usage": True}),
    ],
)
def test_the_ask_is_spliced_into_the_body_and_nothing_else_changes(
    ask: bytes, options: dict[str, bool]
) -> None:
    raw = b' \n{"model": "m", "prompt": "hi", "stream": true, "max_tokens": 5}'
    spliced = ask_usage(raw, ask)
    assert spliced is not None
    body = json.loads(spliced)
    assert body.pop("stream_options") == options
    assert body == json.loads(raw)
    assert ask_usage(b'["not", "an", "object"]', ask) is None


@pytest.mark.parametrize(
    ("mode", "reservation", "ask"),
    [
        ("auto", "worst-case", EVERY_EVENT),  # its promise rests on exact progress
        ("auto", "adaptive", FINAL),
        ("auto", "expected", FINAL),
        ("every-event", "adaptive", EVERY_EVENT),
        ("final", "worst-case", FINAL),
        ("off", "worst-case", None),
    ],
)
def test_auto_asks_for_every_event_in_worst_case_mode_only(
    mode: str, reservation: str, ask: bytes | None
) -> None:
    assert stream_usage_asked(StreamUsage(mode), ReservationMode(reservation)) == ask


@pytest.mark.parametrize(
    ("endpoint", "body", "sequences", "asks"),
    [
        ("completions", {"stream": True}, 1, True),
        ("chat", {"stream": True}, 1, True),
        ("chat", {"stream": False}, 1, False),  # the answer's usage is in its JSON already
        ("chat", {}, 1, False),
        ("chat", {"stream": True, "stream_options": {"include_usage": True}}, 1, False),
        ("chat", {"stream": True, "stream_options": None}, 1, False),  # the client's choice
        ("completions", {"stream": True, "n": 2}, 2, False),  # a chunk's usage: one choice's
        ("responses", {"stream": True}, 1, False),
        ("messages", {"stream": True}, 1, False),  # vLLM asks for it itself
    ],
)
def test_which_requests_are_asked_for(
    endpoint: str, body: dict[str, object], sequences: int, asks: bool
) -> None:
    assert wants_usage(endpoint, body, sequences) is asks
