"""vLLM's usage count for a stream whose client asked for none (``--stream-usage``), taken back
out of what the client receives.

A stream is counted one event a token unless its events carry vLLM's count
(``sidecar.http.usage``), and vLLM merges a stream's tokens into one event when its reader
falls behind (``RequestOutputCollector``): on a busy host a stream of 700 tokens showed 672
events, so counted by its events it looks behind vLLM, its peak later than vLLM's, and what the
learner learns of its length short (RELIABILITY.md, "Merged stream events"). Most clients ask
for no usage: the OpenAI SDKs and frameworks leave ``stream_options`` out.

So for a streamed ``/v1/completions`` or ``/v1/chat/completions`` request of one sequence whose
body has no ``stream_options``, the sidecar sends vLLM ``"stream_options": {"include_usage":
true}`` (:data:`FINAL`: one last event of ``"choices": []`` with the totals before ``[DONE]``),
with ``"continuous_usage_stats": true`` too where it wants the count in flight
(:data:`EVERY_EVENT`: ``"usage": {...}`` in every event as well), spliced in by
:func:`ask_usage`. :class:`UsageStripper` takes it out again, so that the client receives the
bytes vLLM would have sent it: each ``usage`` member removed with its comma, the usage-only event
dropped, and the ``system_fingerprint`` that vLLM, asked for the usage, moves from the last
token's event onto the usage-only event put back. (vLLM's JSON is compact, and its ``usage``
object nests one level at most: ``prompt_tokens_details``.) A ``"usage":`` with its quotes bare
can only be a key: inside a JSON string a quote is escaped. :func:`stream_usage_asked` says
which ask ``--stream-usage`` makes.

A client that asked for ``include_usage`` alone (``vllm bench serve`` does) is asked for every
event's count too where the sidecar wants it (:func:`wants_every_event`, :func:`ask_every_event`:
its ``stream_options`` written anew), and its usage-only event, its own, passes as it is
(``UsageStripper(keep_final=True)``). Left as they are: any other ``stream_options`` (the
client's own choice), n > 1 (a chunk's usage then counts one choice), the Responses and
Anthropic endpoints (vLLM's Anthropic path asks for continuous usage itself). Against a vLLM
started with ``--enable-force-include-usage`` every client gets the usage anyway: run the
sidecar with ``--stream-usage off`` there, or its clients lose it.

>>> ask_usage(b'{"stream": true, "prompt": "hi"}')[:71]
b'{"stream_options":{"include_usage":true,"continuous_usage_stats":true},'
>>> strip_usage(b'data: {"id":"c","choices":[{"text":"a"}],"usage":{"prompt_tokens":1}}\\n\\n')
b'data: {"id":"c","choices":[{"text":"a"}]}\\n\\n'
>>> strip_usage(b'data: {"choices":[],"usage":{"completion_tokens":2}}\\n\\ndata: [DONE]\\n\\n')
b'data: [DONE]\\n\\n'
"""

from __future__ import annotations

import json
import re
from typing import Any

from sidecar.config import ReservationMode, StreamUsage

#: what the sidecar asks vLLM for, spliced in as the body's first member: the usage on every
#: event, or in one usage-only event at the end
EVERY_EVENT = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true},'
FINAL = b'"stream_options":{"include_usage":true},'
#: the endpoints whose streams vLLM counts on every event when asked
_ENDPOINTS = frozenset({"completions", "chat"})
#: a ``usage`` member's key, and its value: an object that nests one level at most
#: (``prompt_tokens_details``), or null
_VALUE = re.compile(rb"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}|null")
_KEY = b'"usage":'
#: the stream's fingerprint, as vLLM writes it in the usage-only event
_FINGERPRINT = re.compile(rb'"system_fingerprint":"[^"\\]*"')
#: vLLM's SSE event separator (it writes ``data: {...}\n\n``)
_SEP = b"\n\n"


def wants_usage(endpoint: str, body: dict[str, Any], sequences: int) -> bool:
    """Whether the sidecar asks vLLM for the usage of this request's stream (``--stream-usage``)."""
    return (
        endpoint in _ENDPOINTS
        and body.get("stream") is True
        and "stream_options" not in body
        and sequences == 1
    )


def wants_every_event(endpoint: str, body: dict[str, Any], sequences: int) -> bool:
    """Whether a stream whose client asked for the final usage count (``include_usage``) and
    not for every event's is asked for every event's too (under ``every-event``)."""
    options = body.get("stream_options")
    return (
        endpoint in _ENDPOINTS
        and body.get("stream") is True
        and sequences == 1
        and isinstance(options, dict)
        and options.get("include_usage") is True
        and not options.get("continuous_usage_stats")
    )


def ask_every_event(body: dict[str, Any]) -> bytes | None:
    """``body``, the request as it is to be sent (already read), written out with
    ``continuous_usage_stats`` added to its ``stream_options`` (the client's own object is
    changed, not spliced into); None, and the body sent as it came, where it has no such
    object."""
    options = body.get("stream_options")
    if not isinstance(options, dict):
        return None
    return json.dumps(
        {**body, "stream_options": {**options, "continuous_usage_stats": True}}
    ).encode()


def stream_usage_asked(mode: StreamUsage, reservation: ReservationMode) -> bytes | None:
    """What ``--stream-usage`` asks vLLM for (None: nothing): ``auto`` asks for the usage on
    every event in worst-case mode, whose promise rests on exact progress, and for the final
    count in the others, which lay out learned ends and need each answer's length."""
    if mode is StreamUsage.auto:
        every = reservation is ReservationMode.worst_case
        mode = StreamUsage.every_event if every else StreamUsage.final
    return {StreamUsage.every_event: EVERY_EVENT, StreamUsage.final: FINAL}.get(mode)


def ask_usage(raw: bytes, ask: bytes = EVERY_EVENT) -> bytes | None:
    """``raw``, a JSON object's bytes, with ``ask`` spliced in as its first member (None when
    it does not start as an object)."""
    start = len(raw) - len(raw.lstrip())
    if raw[start : start + 1] != b"{":
        return None
    return raw[: start + 1] + ask + raw[start + 1 :]


def strip_usage(events: bytes) -> bytes:
    """Whole SSE events without what :func:`ask_usage` added (a stream's every event at once:
    :class:`UsageStripper` for one that arrives in parts)."""
    stripper = UsageStripper()
    return stripper(events) + stripper.flush()


class UsageStripper:
    """What :func:`ask_usage` added taken out of a stream's whole SSE events, as they arrive.

    Asked for the usage, vLLM moves the stream's ``system_fingerprint`` from the event that ends
    the choice (its ``finish_reason`` set) to the usage-only event after it. So that event is
    held until the next one: when that is the usage-only event, the held one gets the
    fingerprint back in place of its ``usage`` (the field that follows it in vLLM's stream
    chunks), as vLLM writes it unasked; :meth:`flush` gives what is held at the stream's end.
    """

    __slots__ = ("_held", "_keep_final")

    def __init__(self, *, keep_final: bool = False) -> None:
        self._held = b""  # the event that ended the choice, with its usage, until the next
        #: the client asked for the final count itself (:func:`ask_every_event`): its
        #: usage-only event, which carries the fingerprint, is its own, and passes as it is
        self._keep_final = keep_final

    def __call__(self, events: bytes) -> bytes:
        if self._keep_final:
            return self._every_event_only(events)
        if not self._held and b'"finish_reason":"' not in events:
            if b'"usage":' not in events:
                return events  # asked for the final count: a read of tokens
            if b'"choices":[]' not in events:
                return _without_usage(events)  # asked for every event's: each event's usage
        *whole, rest = events.split(_SEP)
        out: list[bytes] = []
        for event in whole:
            usage_only = b'"choices":[]' in event and b'"usage":' in event
            if self._held:
                out.append(self._release(event if usage_only else b""))
            if usage_only:
                continue  # include_usage's last event: the totals alone
            if b'"finish_reason":"' in event:
                self._held = event
            elif b'"usage":' in event:
                out.append(_without_usage(event) + _SEP)
            else:
                out.append(event + _SEP)
        return b"".join(out) + rest

    def _every_event_only(self, events: bytes) -> bytes:
        if b'"usage":' not in events:
            return events
        if b'"choices":[]' not in events:
            return _without_usage(events)
        *whole, rest = events.split(_SEP)
        kept = [e + _SEP if b'"choices":[]' in e else _without_usage(e) + _SEP for e in whole]
        return b"".join(kept) + rest

    def flush(self) -> bytes:
        """The event held at the stream's end (it ended without the usage-only event)."""
        return self._release(b"") if self._held else b""

    def _release(self, usage_event: bytes) -> bytes:
        held, self._held = self._held, b""
        found = _FINGERPRINT.search(usage_event)
        if found is None:
            return _without_usage(held) + _SEP
        if _KEY in held:  # in the usage's place: vLLM writes the fingerprint right after it
            return _without_usage(held, found.group(0)) + _SEP
        if held.endswith(b"}"):  # asked for the final count: after the choices, at the end
            return held[:-1] + b"," + found.group(0) + b"}" + _SEP
        return held + _SEP


def _without_usage(data: bytes, fingerprint: bytes = b"") -> bytes:
    """``data`` with each ``usage`` member taken out, its comma with it (``fingerprint``, a
    member, put in its place where given). Found by ``bytes.find`` and matched where found: a
    regular expression searched from every byte costs several times more on the hot path."""
    out: list[bytes] = []
    start = 0
    while (at := data.find(_KEY, start)) >= 0:
        value = _VALUE.match(data, at + len(_KEY))
        if value is None:  # not a value vLLM writes there: left as it is
            out.append(data[start : at + len(_KEY)])
            start = at + len(_KEY)
            continue
        end = value.end()
        if data[at - 1 : at] == b",":  # ...,"usage":{...}
            out.append(data[start : at - 1] + (b"," + fingerprint if fingerprint else b""))
        else:  # {"usage":{...},...
            out.append(data[start:at] + (fingerprint + b"," if fingerprint else b""))
            end += data[end : end + 1] == b","
        start = end
    out.append(data[start:])
    return b"".join(out)
