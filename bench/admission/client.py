"""The admission benchmark's client: it sends a workload as the openai client would (retrying
429 and 503 after the server's hint), and samples vLLM and the sidecar while the run goes on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.admission.workload import REQUEST_DEADLINE_S, Request, Workload
from bench.common import read_vllm, retry_delay
from harness.workload import SidecarProcess

# --- the client ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    arrived: float  # seconds after the run's start
    status: int = 0
    ttft: float | None = None  # streamed answers only
    e2e: float | None = None
    completion_tokens: int = 0
    attempts: int = 0
    refusals: int = 0
    error: str = ""
    stream: bool = True
    true_tokens: int = 0  # per sequence, what the answer really generates
    # (seconds after the run's start, the delay the client slept) for each refusal
    retries: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Active:
    """A request the client has sent and not yet seen answered (for the samples' context)."""

    kind: str
    stream: bool
    sequences: int
    sent: float  # monotonic, the first attempt
    first_token: float | None = None


class Tracker:
    """The client's view of its requests, for the context of each sample."""

    def __init__(self) -> None:
        self.active: dict[int, Active] = {}
        self.finished: list[float] = []  # monotonic ends
        self._next = 0

    def begin(self, req: Request) -> int:
        self._next += 1
        self.active[self._next] = Active(req.kind, req.stream, req.sequences, time.monotonic())
        return self._next

    def first_token(self, key: int) -> None:
        a = self.active.get(key)
        if a is not None and a.first_token is None:
            a.first_token = time.monotonic()

    def end(self, key: int) -> None:
        if self.active.pop(key, None) is not None:
            self.finished.append(time.monotonic())

    def context(self) -> dict[str, Any]:
        now = time.monotonic()
        active = list(self.active.values())
        kinds: dict[str, int] = {}
        for a in active:
            kinds[a.kind] = kinds.get(a.kind, 0) + 1
        return {
            "active": len(active),
            "not_streamed": sum(1 for a in active if not a.stream),
            "multi_sequence": sum(1 for a in active if a.sequences > 1),
            "streamed_awaiting_first_token": sum(
                1 for a in active if a.stream and a.first_token is None
            ),
            "first_token_last_1s": sum(
                1 for a in active if a.first_token is not None and now - a.first_token < 1.0
            ),
            "sent_last_1s": sum(1 for a in active if now - a.sent < 1.0),
            "finished_last_1s": sum(1 for f in self.finished if now - f < 1.0),
            "kinds": kinds,
        }


def _answer_text(data: dict[str, Any]) -> str:
    """The first choice's text of a non-streamed answer."""
    for choice in data.get("choices") or []:
        piece = (choice.get("message") or {}).get("content") or choice.get("text")
        if piece:
            return str(piece)
    return ""


async def _read_stream(
    resp: httpx.Response, req: Request, out: Outcome, start: float, on_first: Callable[[], None]
) -> str:
    """Read a streamed answer into ``out`` (time to first token, completion tokens); the first
    choice's text."""
    text: list[str] = []
    # the text is needed for a chat's next turn only: other events are not parsed (the client
    # shares 2 cores with vLLM and the proxies)
    need_text = bool(req.turns)
    async for line in resp.aiter_lines():
        if not line.startswith("data: {"):
            continue
        if out.ttft is None:
            out.ttft = time.monotonic() - start
            on_first()
        has_usage = '"usage":{' in line or '"usage": {' in line
        if not (need_text or has_usage):
            continue
        event = json.loads(line[6:])
        usage = event.get("usage")
        if usage:
            out.completion_tokens = int(usage.get("completion_tokens", 0))
        for choice in event.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            piece = (choice.get("delta") or {}).get("content") or choice.get("text")
            if piece:
                text.append(piece)
    return "".join(text)


async def _refused(
    resp: httpx.Response, out: Outcome, t0: float, start: float, rng: random.Random
) -> bool:
    """A 429 or 503: sleep the client's delay and say to try again, or give up at the deadline
    (``out`` says so) and say not to."""
    await resp.aread()
    out.refusals += 1
    delay = retry_delay(resp.headers, out.refusals, rng)
    out.retries.append((round(time.monotonic() - t0, 3), round(delay, 3)))
    if time.monotonic() + delay - start > REQUEST_DEADLINE_S:
        out.status = resp.status_code
        out.error = "deadline"
        return False
    await asyncio.sleep(delay)
    return True


async def one(
    client: httpx.AsyncClient,
    url: str,
    req: Request,
    body: dict[str, Any],
    t0: float,
    arrived: float,
    rng: random.Random,
    tracker: Tracker,
) -> tuple[Outcome, str]:
    """Send one request until it is answered (retrying refusals); the outcome and answer text."""
    out = Outcome(req.kind, arrived, stream=req.stream, true_tokens=req.true_tokens)
    headers = dict(req.headers)
    if req.output_tokens is not None:
        headers["x-bench-output-tokens"] = str(req.output_tokens)
    payload: dict[str, Any] = {"model": "tiny", "temperature": 0.0, "stream": req.stream, **body}
    if req.stream:
        payload["stream_options"] = {"include_usage": True}
    start = t0 + arrived
    key = tracker.begin(req)
    try:
        while True:
            out.attempts += 1
            try:
                async with client.stream(
                    "POST", url + req.endpoint, json=payload, headers=headers
                ) as resp:
                    if resp.status_code in (429, 503):
                        if await _refused(resp, out, t0, start, rng):
                            continue
                        return out, ""
                    if resp.status_code != 200:
                        out.status = resp.status_code
                        out.error = (await resp.aread()).decode(errors="replace")[:300]
                        return out, ""
                    if req.stream:
                        text = await _read_stream(
                            resp, req, out, start, lambda: tracker.first_token(key)
                        )
                    else:
                        data = json.loads(await resp.aread())
                        out.completion_tokens = int(
                            (data.get("usage") or {}).get("completion_tokens", 0)
                        )
                        text = _answer_text(data)
                    out.status = 200
                    out.e2e = time.monotonic() - start
                    return out, text
            except (httpx.HTTPError, ValueError) as exc:
                out.status = 0
                out.error = f"{type(exc).__name__}: {exc}"
                return out, ""
    finally:
        tracker.end(key)


async def drive(
    url: str,
    workload: Workload,
    t0: float,
    on_done: Callable[[int], None],
    tracker: Tracker,
    *,
    oracle: bool = False,
) -> tuple[list[Outcome], float]:
    """Run the workload against ``url`` from ``t0`` (monotonic); the outcomes and the end.

    ``oracle``: every request names its real answer length as ``max_tokens``."""
    rng = random.Random(5)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(REQUEST_DEADLINE_S, connect=10), limits=limits, trust_env=False
    ) as client:

        async def run_request(req: Request) -> None:
            await asyncio.sleep(max(0.0, t0 + req.at - time.monotonic()))
            base = {**req.body, "max_tokens": req.true_tokens} if oracle else req.body
            if not req.turns:
                outcome, _ = await one(client, url, req, base, t0, req.at, rng, tracker)
                outcomes.append(outcome)
                on_done(len(outcomes))
                return
            messages = list(base["messages"])
            for user in req.turns:
                messages.append({"role": "user", "content": user})
                body = {**base, "messages": list(messages)}
                arrived = time.monotonic() - t0
                outcome, answer = await one(client, url, req, body, t0, arrived, rng, tracker)
                outcomes.append(outcome)
                on_done(len(outcomes))
                if outcome.status != 200:
                    return
                messages.append({"role": "assistant", "content": answer})
                await asyncio.sleep(0.5)

        await asyncio.gather(*(run_request(r) for r in workload.requests))
        return outcomes, time.monotonic()


# --- sampling vLLM and the sidecar while a run goes on ------------------------------------------


async def sample(
    vllm_url: str,
    sidecar: SidecarProcess | None,
    t0: float,
    samples: list[dict[str, Any]],
    stop: asyncio.Event,
    tracker: Tracker,
) -> None:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        while not stop.is_set():
            row: dict[str, Any] = {"t": time.monotonic() - t0}
            with contextlib.suppress(httpx.HTTPError):
                row.update(read_vllm((await client.get(vllm_url + "/metrics")).text))
            if sidecar is not None:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    state = (await client.get(sidecar.metrics_url + "/state")).json()
                    row["sidecar"] = {
                        k: state.get(k)
                        for k in (
                            "reserved_blocks",
                            "predicted_blocks",
                            "actual_blocks",
                            "budget_blocks",
                            "predicted_at_snapshot_blocks",
                            "in_flight_at_snapshot",
                            "in_flight",
                            "queue_depth",
                            "committed_blocks",
                            "snapshot_age",
                            # newer sidecars: admission's figure and the shared prefix blocks
                            "future_peak_blocks",
                            "shared_blocks",
                            # and the costs learned, with --priority-pace's backlog
                            "decode_step_seconds",
                            "step_seconds_per_token",
                            "prefill_backlog_seconds",
                            # the decode line's fixed share (what a sequence more saves) and
                            # the placements the spread ends' second opinion allowed
                            "step_fixed_share",
                            "spread_admitted",
                        )
                    }
            row["client"] = tracker.context()
            samples.append(row)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
