"""The relay hands an SSE answer on in whole events, wherever vLLM's bytes were cut on the way
in: a client that parses each chunk it reads on its own (vLLM's benchmark client strips every
chunk before splitting it into events) reads every event, as it does from vLLM directly."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from sidecar.http.relay import MAX_HELD
from tests.support.relaying import relay_into

EVENTS = [
    b"data: " + json.dumps({"id": "cmpl-1", "choices": [{"text": f" w{k}"}]}).encode() + b"\n\n"
    for k in range(6)
] + [b"data: [DONE]\n\n"]


class _Cut(httpx.AsyncByteStream):
    """vLLM's answer as the sidecar's reads may get it: cut at the given offsets."""

    def __init__(self, data: bytes, cuts: list[int]) -> None:
        self.data, self.cuts = data, cuts

    async def __aiter__(self) -> Any:
        start = 0
        for cut in [*self.cuts, len(self.data)]:
            yield self.data[start:cut]
            start = cut


async def relayed(data: bytes, cuts: list[int], sse: bool = True) -> list[bytes]:
    """The bodies the relay sends its client for ``data`` read in the pieces ``cuts`` makes."""
    kind = "text/event-stream" if sse else "application/json"
    response = httpx.Response(200, headers={"content-type": kind}, stream=_Cut(data, cuts))
    sent: list[dict[str, Any]] = []
    assert await relay_into(sent, response)
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    return [m["body"] for m in sent[1:-1]]


def benchmark_client_reads(chunks: list[bytes]) -> list[str]:
    """The events vLLM 0.32's ``vllm bench serve`` reads from these chunks
    (``vllm/benchmarks/lib/endpoint_request_func.py``: each chunk stripped, the buffer split on
    blank lines, every message's ``data: `` prefix removed and the rest parsed as JSON)."""
    buffer, out = "", []
    for raw in chunks:
        chunk = raw.strip()
        if not chunk:
            continue
        buffer += chunk.decode()
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            if message.strip():
                out.append(message.strip())
        if buffer.startswith("data: "):
            rest = buffer.removeprefix("data: ").strip()
            if rest == "[DONE]":
                out.append(buffer.strip())
                buffer = ""
            elif rest:
                try:
                    json.loads(rest)
                except json.JSONDecodeError:
                    continue
                out.append(buffer.strip())
                buffer = ""
    events = [m.removeprefix("data: ") for m in out]
    for event in events:
        if event != "[DONE]":
            json.loads(event)  # what the client does: a cut event fails here
    return events


DATA = b"".join(EVENTS)
AFTER_DATA = [len(EVENTS[0]) + len(b"data: ")]  # cut just after the second event's "data: "


def test_the_benchmark_clients_parser_fails_on_an_event_cut_after_its_prefix() -> None:
    """The premise: read as cut, vLLM's benchmark client cannot parse the second event."""
    pieces = [DATA[: AFTER_DATA[0]], DATA[AFTER_DATA[0] :]]
    with pytest.raises(json.JSONDecodeError):
        benchmark_client_reads(pieces)


@pytest.mark.parametrize(
    "cuts",
    [
        AFTER_DATA,
        [3, 17, 40, 41, 90, 150],  # anywhere, several times in one event
        [len(EVENTS[0]) - 1, len(EVENTS[0]) + 1],  # between the separator's two line ends
        list(range(1, len(DATA))),  # a byte at a time
    ],
)
async def test_an_sse_answer_cut_anywhere_is_relayed_in_whole_events(cuts: list[int]) -> None:
    bodies = await relayed(DATA, cuts)
    assert b"".join(bodies) == DATA
    assert all(body.endswith(b"\n\n") for body in bodies), bodies
    expected = [e.removeprefix(b"data: ").strip().decode() for e in EVENTS]
    assert benchmark_client_reads(bodies) == expected


async def test_an_answer_that_ends_mid_event_is_relayed_whole() -> None:
    data = DATA + b"data: {"
    assert b"".join(await relayed(data, AFTER_DATA)) == data


async def test_a_stream_without_separators_is_not_held_past_the_limit() -> None:
    data = b"x" * (MAX_HELD + 10)
    bodies = await relayed(data, [100, MAX_HELD + 5])
    assert b"".join(bodies) == data and len(bodies) == 2


async def test_a_json_answer_is_relayed_as_it_comes() -> None:
    data = json.dumps({"choices": [{"text": "hi"}]}).encode()
    assert await relayed(data, [5, 9], sse=False) == [data[:5], data[5:9], data[9:]]
