"""The generation path: one request from its body to the release of its reservation.

::

    body -> parse -> count prompt tokens -> project KV -> admit / queue / refuse
         -> relay vLLM's answer (tracking generated tokens) -> release the reservation

Each request is counted once in ``kv_sidecar_requests_total``: at the gate, or where it was
refused before the gate (bad body, prompt too long, engine not ready). What happens after
admission (vLLM unreachable, a timeout, a broken answer) is counted in
``kv_sidecar_upstream_errors_total``, not as a second decision, with one exception: vLLM's own
queue caps (``--max-num-queued-reqs``, ``--max-num-queued-tokens``) refusing an admitted request
with their 503 (:mod:`sidecar.engine.queue_caps`). That request's reservation is released and
its client gets the sidecar's backpressure, 429 ``engine_queue_full`` with Retry-After, counted
as a refusal (``decision="reject"``) besides its admission.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import httpx

from sidecar.admission.ask import Ask
from sidecar.admission.classes import (
    PRIORITY_HEADER,
    TENANT_HEADER,
    api_key_of,
    classify,
)
from sidecar.admission.decisions import Decision, Outcome, Reason
from sidecar.admission.learner import request_class
from sidecar.admission.retry import fingerprint
from sidecar.config import PriorityRule
from sidecar.counting import GenerationRequest, counting_view, parse_generation
from sidecar.engine.queue_caps import (
    ENGINE_QUEUE_RETRY_AFTER,
    MAX_REFUSAL_BYTES,
    queue_cap_reason,
)
from sidecar.errors import BadRequest, CountingBusy, UpstreamError
from sidecar.http import refusals
from sidecar.http.headers import (
    REQUEST_ID_HEADER,
    forward_headers,
    new_request_id,
    request_id_of,
    with_request_id,
)
from sidecar.http.relay import ClientWatch, Relay, read_body, read_small, replay, respond
from sidecar.http.seams import Engine, Gate, MetricsSink
from sidecar.http.stream_usage import (
    EVERY_EVENT,
    UsageStripper,
    ask_every_event,
    ask_usage,
    wants_every_event,
    wants_usage,
)
from sidecar.http.types import Receive, Scope, Send
from sidecar.http.usage import UsageTracker
from sidecar.kv.ledger import Reservation
from sidecar.kv.projection import Projection, project_counts
from sidecar.observability.logs import (
    REQUEST_ID,
    TRACE_IDS,
    RequestRecord,
    clip,
    log_generation,
)

if TYPE_CHECKING:
    from sidecar.observability.tracing import RequestTrace, Tracing

log = logging.getLogger(__name__)

#: seconds a client should wait while the sidecar has not reached vLLM yet
NOT_READY_RETRY_AFTER = 2.0
_DROP_REQUEST_HEADERS = frozenset({b"host", b"content-length"})
#: optional request header naming the class a request's answer length is learned in
CLASS_HEADER = b"x-kv-sidecar-class"
#: vLLM's header that sends a request to one data-parallel engine (chat, completions, messages)
DP_RANK_HEADER = b"x-data-parallel-rank"
#: the endpoints whose handlers read it (``/v1/responses`` does not, in vLLM 0.32)
_PINNABLE = frozenset({"completions", "chat", "messages"})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class GenerationPath:
    """Admission-controlled forwarding of generation requests."""

    def __init__(
        self,
        *,
        gate: Gate,
        engine: Callable[[], Engine | None],
        metrics: MetricsSink,
        relay: Relay,
        max_body_bytes: int,
        access_log: bool = True,
        tracing: Tracing | None = None,
        priority_rules: Sequence[PriorityRule] = (),
        forward_priority: bool = False,
        spill_status: int = 429,
        stream_usage: bytes | None = None,
    ) -> None:
        self.gate = gate
        self.engine = engine
        self.metrics = metrics
        self.relay = relay
        self.max_body_bytes = max_body_bytes
        self.access_log = access_log  # one line per request on the sidecar.access logger
        self.tracing = tracing  # None: no spans
        self.priority_rules = tuple(priority_rules)  # --priority-rules
        self.forward_priority = forward_priority  # --forward-priority
        self.spill_status = spill_status  # --spill-status: a spilled refusal's status
        self.stream_usage = stream_usage  # --stream-usage: what is asked of vLLM (None: nothing)

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, raw_path: bytes, endpoint: str
    ) -> None:
        client_id = request_id_of(scope["headers"])
        record = RequestRecord(
            clip(client_id.decode("latin-1")) if client_id is not None else new_request_id(),
            scope["path"],
            endpoint,
        )
        if client_id is None:
            record.generated_id = True
        else:
            record.id_header = client_id  # echoed as sent, even when the logs clip it
        REQUEST_ID.set(record.request_id)  # this request's task only: every line it logs
        trace = self.tracing.start(scope, record, endpoint) if self.tracing is not None else None
        if trace is not None:
            TRACE_IDS.set(trace.ids())  # every line this request logs names its trace
        try:
            await self._handle(scope, receive, send, raw_path, endpoint, record, trace)
        finally:
            end = time.perf_counter()
            if self.access_log:
                log_generation(record, end - record.start)
            if trace is not None:
                trace.end(end)

    async def _handle(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        raw_path: bytes,
        endpoint: str,
        record: RequestRecord,
        trace: RequestTrace | None,
    ) -> None:
        try:
            raw = await self._read(scope, receive)
            if raw is None:
                return  # the client left before sending its request
            request = parse_generation(endpoint, raw)  # type: ignore[arg-type]
            priority, tenant = classify(
                request.body,
                priority_header=_header(scope, PRIORITY_HEADER),
                tenant_header=_header(scope, TENANT_HEADER),
                api_key=api_key_of(_header(scope, b"authorization"), _header(scope, b"x-api-key")),
                rules=self.priority_rules,
            )
        except BadRequest as exc:
            self.metrics.refused(Reason.BAD_REQUEST)
            _refused(record, Reason.BAD_REQUEST)
            await _respond(send, record, refusals.from_error(exc))
            return
        model = request.body.get("model")
        record.model = clip(model) if isinstance(model, str) else None
        record.stream = request.stream

        engine = self.engine()
        if engine is None:
            self.metrics.refused(Reason.NOT_READY, NOT_READY_RETRY_AFTER)
            _refused(record, Reason.NOT_READY)
            await _respond(
                send,
                record,
                refusals.refusal(
                    Reason.NOT_READY, "the sidecar has not reached vLLM yet", NOT_READY_RETRY_AFTER
                ),
            )
            return

        watch = ClientWatch(receive)
        disconnected = watch.gone
        reservation: Reservation | None = None
        learned: int | None = None  # the answer's length, when it ended naturally
        try:
            t0 = record.count_start = time.perf_counter()
            try:
                count = await engine.counter.count(*counting_view(request))
                record.count_end = time.perf_counter()
                record.prompt_tokens = count.total
                record.count_method = count.method.value
                self.metrics.counted(count)
                t1 = time.perf_counter()
                projection = project_counts(
                    count.prompts,
                    requested_max_tokens=request.requested_max_tokens,
                    n=request.n,
                    max_model_len=engine.config.max_model_len,
                    blocks=engine.config.blocks,
                    max_tokens_param=request.max_tokens_param,
                    exact=count.exact,
                    default_max_tokens=engine.config.default_max_tokens,
                    max_tokens_cap=engine.config.max_tokens_cap,
                    resolved_max_tokens=count.max_tokens,
                    min_tokens=request.min_tokens,
                )
            except CountingBusy as exc:  # too many long prompts being counted: shed
                record.count_end = time.perf_counter()
                self.metrics.refused(Reason.COUNTING_BUSY, exc.retry_after_s)
                _refused(record, Reason.COUNTING_BUSY)
                shed = refusals.refusal(Reason.COUNTING_BUSY, exc.message, exc.retry_after_s)
                await _respond(send, record, shed)
                return
            except BadRequest as exc:
                if record.count_end is None:
                    record.count_end = time.perf_counter()
                too_long = exc.code == "context_length_exceeded"
                reason = Reason.PROMPT_TOO_LONG if too_long else Reason.BAD_REQUEST
                self.metrics.refused(reason)
                _refused(record, reason)
                await _respond(send, record, refusals.from_error(exc))
                return
            record.projected_blocks = projection.peak_blocks
            self.metrics.projected(projection, engine.config.bytes_per_block)
            rank = (_header(scope, DP_RANK_HEADER) or "").strip()
            ask = Ask(
                projection,
                streamed=request.stream,
                klass=request_class(
                    endpoint,
                    request.requested_max_tokens,
                    _header(scope, CLASS_HEADER),
                    ignore_eos=request.ignore_eos,
                ),
                prefix=count.prefix,
                pin=rank if rank.isdigit() else None,
                pinnable=endpoint in _PINNABLE,
                key=fingerprint(raw),  # a retry sends the same body: its slot is its own
                priority=priority,
                tenant=tenant,
            )
            record.admit_start = time.perf_counter()
            decision = self.gate.try_admit(ask)
            if decision is None:  # queue it (with relay workers: ask the owner)
                decision = await self.gate.wait(ask, disconnected)
                self.metrics.queue_waited(decision.waited_seconds)
            record.admit_end = time.perf_counter()
            # projecting and deciding, the owner's round trip included, the queue wait not
            self.metrics.decision_time(record.admit_end - t1 - decision.waited_seconds)
            _decided(record, decision)
            self.metrics.decided(decision)
            if decision.outcome is Outcome.CANCEL:
                return
            if not decision.admitted:
                refused = refusals.from_decision(decision, spill_status=self.spill_status)
                await _respond(send, record, refused)
                return
            reservation = decision.reservation
            assert reservation is not None
            record.reserved_blocks = reservation.reserved_blocks
            if disconnected.is_set():
                return
            log.debug(
                "admitted %s: %d prompt tokens (%s), %d blocks reserved in %.0f us",
                endpoint,
                projection.prompt_total,
                count.method.value,
                reservation.reserved_blocks,
                (time.perf_counter() - t0) * 1e6,
            )
            learned = await self._forward(
                scope,
                send,
                raw_path,
                raw,
                request,
                priority,
                projection,
                reservation,
                watch,
                record,
                trace,
            )
        finally:
            watch.close()
            if reservation is not None:
                self.gate.release(reservation, learned)
                self.metrics.answered(time.perf_counter() - t0)

    async def _read(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name.lower() == b"content-length" and value.isdigit() and int(value) > limit:
                raise BadRequest(
                    f"request body exceeds {limit} bytes", code="body_too_large", status=413
                )
        return await read_body(receive, limit)

    async def _forward(
        self,
        scope: Scope,
        send: Send,
        raw_path: bytes,
        raw: bytes,
        request: GenerationRequest,
        priority: int,
        projection: Projection,
        reservation: Reservation,
        watch: ClientWatch,
        record: RequestRecord,
        trace: RequestTrace | None,
    ) -> int | None:
        """Send the request to vLLM and relay its answer; returns the answer's length in tokens
        when it ended naturally (what the expected-mode learner learns from), else None."""
        headers = forward_headers(scope["headers"], drop=_DROP_REQUEST_HEADERS)
        if record.generated_id:  # vLLM takes it as its request id: its lines match the sidecar's
            headers.append((REQUEST_ID_HEADER, record.request_id.encode()))
        if reservation.engine and not reservation.shadows:
            # data-parallel vLLM: the request goes to the engine whose pool it was admitted in
            headers = [(k, v) for k, v in headers if k.lower() != DP_RANK_HEADER]
            headers.append((DP_RANK_HEADER, reservation.engine.encode()))
        url = self.relay.url(raw_path, scope["query_string"])
        body = request.body  # the body to be sent, as read
        if self.forward_priority and priority and "priority" not in body:
            # vLLM runs --scheduling-policy priority: its scheduler orders as the queue did
            body = {**body, "priority": priority}
            raw = json.dumps(body).encode()
        # vLLM's usage count for a stream whose client asked for none (--stream-usage), taken out
        # of what the client receives (sidecar.http.stream_usage)
        asked, keep_final = None, False
        ask, endpoint, sequences = self.stream_usage, record.endpoint, projection.sequences
        if ask is not None and wants_usage(endpoint, body, sequences):
            asked = ask_usage(raw, ask)
        elif ask == EVERY_EVENT and wants_every_event(endpoint, body, sequences):
            asked = ask_every_event(body)  # it asked for the final count: kept as it comes
            keep_final = True
        if asked is not None:
            raw = asked
        if trace is not None:
            headers = trace.upstream_headers(headers, url)
        # A non-streamed answer's headers come only when vLLM has finished: watch the client
        # meanwhile, and cancel (vLLM then aborts the generation) if it leaves.
        if not request.stream:
            # no sign of its prefill will come, and its answer's head only when vLLM has
            # finished: it runs from now, its progress estimated from vLLM's counters
            self.gate.started(reservation)
        response: httpx.Response | None = None
        with watch.guard():
            try:
                response = await self.relay.send("POST", url, headers, raw)
            except UpstreamError as exc:
                self.metrics.upstream_failed(exc.kind)
                record.upstream_error = exc.kind
                if trace is not None:
                    trace.upstream_answered(None, exc.kind)
                await _respond(send, record, refusals.from_error(exc))
                return None
        if response is None:
            return None  # the client left before vLLM's answer began: the send was cancelled
        if response.status_code == 503:
            answer = await self._engine_refusal(response, send, record, trace)
            if answer is None:
                return None  # answered: vLLM's own queue cap refused it, or its answer broke
            response = answer
        record.status = response.status_code

        gate = self.gate
        tracker = UsageTracker(record.endpoint)
        sequences = max(projection.sequences, 1)
        streamed = request.stream

        def on_chunk(chunk: bytes) -> None:
            tracker.feed(chunk, sse=streamed)
            if streamed:
                gate.started(reservation)  # the first event comes after vLLM's prefill
                gate.progressed(reservation, tracker.progress(sequences=sequences))

        completed = False
        try:
            if response.status_code >= 500:
                self.metrics.upstream_failed("status_5xx")
            completed = await self.relay.relay(
                response,
                send,
                watch,
                on_chunk,
                request_id=record.id_header,
                anthropic=record.endpoint == "messages",
                transform=UsageStripper(keep_final=keep_final) if asked is not None else None,
            )
        except UpstreamError as exc:
            self.metrics.upstream_failed(exc.kind)
            record.upstream_error = exc.kind
        finally:
            await response.aclose()
            if trace is not None:
                trace.upstream_answered(response.status_code, record.upstream_error)
        tokens = tracker.completion_tokens
        if tokens is None and streamed:
            tokens = tracker.events  # no usage chunk asked for: one event per token per sequence
        if tokens is not None:
            record.completion_tokens = tokens
            self.metrics.completed(tokens)
            # only natural ends teach the expected-mode learner how long answers run
            if completed and response.status_code == 200:
                return tokens
        return None

    async def _engine_refusal(
        self,
        response: httpx.Response,
        send: Send,
        record: RequestRecord,
        trace: RequestTrace | None,
    ) -> httpx.Response | None:
        """A 503 from vLLM: when its queue cap refused the request, answer the client with the
        sidecar's 429 and return None; else the answer to relay as it came."""
        try:
            body = await read_small(response, MAX_REFUSAL_BYTES)
        except UpstreamError as exc:
            await response.aclose()
            self.metrics.upstream_failed(exc.kind)
            record.upstream_error = exc.kind
            if trace is not None:
                trace.upstream_answered(response.status_code, exc.kind)
            await _respond(send, record, refusals.from_error(exc))
            return None
        if body is None:
            return response  # not one vLLM's queue caps send: relayed, streamed
        await response.aclose()
        vllm_reason = queue_cap_reason(response.status_code, body)
        if vllm_reason is None:
            return replay(response, body)
        # a refusal after the gate's admission (relay workers carry it to the owner as any)
        self.metrics.refused(Reason.ENGINE_QUEUE_FULL, ENGINE_QUEUE_RETRY_AFTER)
        _refused(record, Reason.ENGINE_QUEUE_FULL)
        if trace is not None:
            trace.upstream_answered(response.status_code, None)
        log.debug("vLLM's queue cap (%s) refused an admitted request", vllm_reason)
        await _respond(send, record, refusals.engine_queue_full(vllm_reason))
        return None


def _refused(record: RequestRecord, reason: Reason) -> None:
    record.decision = Outcome.REJECT.value
    record.reason = reason.value


def _decided(record: RequestRecord, decision: Decision) -> None:
    record.decision = decision.outcome.value
    record.reason = decision.reason.value
    record.queue_wait_s = round(decision.waited_seconds, 6)


async def _respond(send: Send, record: RequestRecord, response: refusals.Response) -> None:
    record.status = response[0]
    if record.endpoint == "messages":  # Anthropic's clients read Anthropic's error shape
        response = refusals.anthropic_shaped(response, record.id_header)
    await respond(send, with_request_id(response, record.id_header))
