"""OpenTelemetry spans for generation requests, off unless the ``OTEL_*`` environment asks.

One span per generation request (kind server, named as OpenTelemetry's GenAI conventions name an
inference: ``{gen_ai.operation.name} {gen_ai.request.model}``, ``chat tiny``; the operation alone
while the model is not known), continuing the client's W3C ``traceparent``, with three
children: ``count prompt tokens``, ``admission queue`` (the gate's decision and any wait for
room) and the upstream call to vLLM (kind client, ``POST <path>`` as HTTP client spans are
named), whose context goes to vLLM as a new ``traceparent``, so that vLLM's own spans
(``--otlp-traces-endpoint``) join the trace. While a request runs, its log lines carry the
request span's ``trace_id`` and ``span_id`` (``sidecar.observability.logs.TRACE_IDS``).

:func:`from_env` reads the environment as the OpenTelemetry SDK does, with one difference: the
SDK's default exporter is ``otlp``, the sidecar's is none. Tracing is on when
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``, comma-separated), or, with it
unset, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set;
``OTEL_SDK_DISABLED=true`` turns it off. The exporter, sampler (``OTEL_TRACES_SAMPLER``), batch
processor (``OTEL_BSP_*``), propagators (``OTEL_PROPAGATORS``) and resource
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``) read their own variables. When off,
:func:`from_env` returns None and the request path creates no span objects.

The counting and queue spans are written when the request ends, from the times its
:class:`~sidecar.observability.logs.RequestRecord` holds (the API takes explicit start and end
times); only the request span and the upstream span are open while the request runs.

>>> from_env({}) is None, from_env({"OTEL_TRACES_EXPORTER": "none"}) is None
(True, True)
>>> exporter_names({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
['otlp']
>>> exporter_names({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"})
[]
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter, TextMapPropagator
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import SpanKind, Status, StatusCode

from sidecar import __version__
from sidecar.errors import ConfigError
from sidecar.observability.logs import RequestRecord

__all__ = ["RequestTrace", "Tracing", "exporter_names", "from_env"]

SCOPE = "kv_sidecar"
#: gen_ai.operation.name of each generation endpoint (OpenTelemetry's GenAI conventions)
_OPERATIONS = {
    "completions": "text_completion",
    "chat": "chat",
    "responses": "chat",
    "messages": "chat",
}


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the environment asks for (empty: tracing off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    configured = environ.get("OTEL_TRACES_EXPORTER")
    if configured is None:
        endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        return ["otlp"] if any(environ.get(name, "").strip() for name in endpoints) else []
    names = [n.strip().lower() for n in configured.split(",") if n.strip()]
    return [] if "none" in names else names


def _exporter(name: str, environ: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ConfigError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console, none)")
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol != "http/protobuf":
        raise ConfigError(
            f"OTLP protocol {protocol!r} is not supported: the sidecar exports http/protobuf"
        )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ConfigError(
            "the OTLP span exporter is not installed: pip install 'vllm-kv-sidecar[otlp]' "
            "(or opentelemetry-exporter-otlp-proto-http)"
        ) from exc
    return OTLPSpanExporter()  # endpoint, headers, timeout, compression: from OTEL_EXPORTER_OTLP_*


def from_env(environ: Mapping[str, str]) -> Tracing | None:
    """Tracing as the environment configures it, or None when it asks for none."""
    names = exporter_names(environ)
    if not names:
        return None
    processors: list[SpanProcessor] = []
    for name in dict.fromkeys(names):
        exporter = _exporter(name, environ)
        # the console exporter (a debugging aid) prints each span as it ends; OTLP in batches
        processors.append(
            SimpleSpanProcessor(exporter) if name == "console" else BatchSpanProcessor(exporter)
        )
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over the sidecar's defaults
    resource = Resource.create({"service.name": "kv-sidecar", "service.version": __version__})
    resource = resource.merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for processor in processors:
        provider.add_span_processor(processor)
    return Tracing(provider, propagate.get_global_textmap())


class _HeaderGetter(Getter[list[tuple[bytes, bytes]]]):
    """Reads an ASGI scope's header list (lower-case names, as ASGI servers give them)."""

    def get(self, carrier: list[tuple[bytes, bytes]], key: str) -> list[str] | None:
        name = key.encode("latin-1")
        values = [v.decode("latin-1") for k, v in carrier if k == name]
        return values or None

    def keys(self, carrier: list[tuple[bytes, bytes]]) -> list[str]:
        return [k.decode("latin-1") for k, _ in carrier]


_GETTER = _HeaderGetter()


class Tracing:
    """The tracer provider and propagator of a process that traces."""

    def __init__(self, provider: TracerProvider, propagator: TextMapPropagator) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(SCOPE, __version__)
        self.propagator = propagator
        #: headers the propagator writes: the client's are replaced on the upstream request
        self.fields = frozenset(f.encode("latin-1") for f in propagator.fields)
        self._upstream_attributes: dict[bytes, dict[str, Any]] = {}

    def upstream_attributes(self, url: Any) -> dict[str, Any]:
        """The upstream span's attributes for an ``httpx.URL`` (cached: copying a URL costs as
        much as the rest of a span)."""
        key: bytes = url.raw_path
        attributes = self._upstream_attributes.get(key)
        if attributes is None:
            attributes = {
                "http.request.method": "POST",
                "server.address": url.host,
                "url.full": str(url.copy_with(query=None)),
            }
            if url.port is not None:
                attributes["server.port"] = url.port
            if len(self._upstream_attributes) >= 1024:
                self._upstream_attributes.clear()  # arbitrary query strings: bounded
            self._upstream_attributes[key] = attributes
        return attributes

    def start(self, scope: Mapping[str, Any], record: RequestRecord, endpoint: str) -> RequestTrace:
        """The span of one generation request, started now, as a child of the client's
        ``traceparent`` when it sent one."""
        parent = self.propagator.extract(scope["headers"], getter=_GETTER)
        path: str = scope["path"]
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "http.route": path,
            "url.path": path,
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"),
            "gen_ai.operation.name": _OPERATIONS.get(endpoint, "chat"),
            "kv_sidecar.request_id": record.request_id,
        }
        # one clock for all the request's spans: the record's perf_counter() readings, mapped
        # onto the wall clock at the request's start
        wall_ns = time.time_ns()
        span = self.tracer.start_span(
            attributes["gen_ai.operation.name"],  # "chat {model}" once the body names it (end)
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=wall_ns,
        )
        return RequestTrace(self, span, record, wall_ns)

    def shutdown(self) -> None:
        """Export what has ended and stop (bounded by the exporters' timeouts)."""
        self.provider.shutdown()


class RequestTrace:
    """The spans of one generation request."""

    __slots__ = ("_record", "_tracing", "_wall_ns", "span", "upstream")

    def __init__(
        self, tracing: Tracing, span: trace.Span, record: RequestRecord, wall_ns: int
    ) -> None:
        self._tracing = tracing
        self._record = record
        self._wall_ns = wall_ns  # the wall clock at record.start
        self.span = span
        self.upstream: trace.Span | None = None

    def ids(self) -> tuple[str, str] | None:
        """The request span's trace and span ids in W3C hex (None when not valid)."""
        context = self.span.get_span_context()
        if not context.is_valid:
            return None
        return format(context.trace_id, "032x"), format(context.span_id, "016x")

    def _ns(self, perf: float) -> int:
        return self._wall_ns + int((perf - self._record.start) * 1e9)

    def upstream_headers(
        self, headers: list[tuple[bytes, bytes]], url: Any
    ) -> list[tuple[bytes, bytes]]:
        """Start the upstream span; ``headers`` minus the client's trace context, plus the
        upstream span's."""
        tracing = self._tracing
        context = trace.set_span_in_context(self.span)
        self.upstream = span = tracing.tracer.start_span(
            f"POST {self._record.path}",
            context=context,
            kind=SpanKind.CLIENT,
            attributes=tracing.upstream_attributes(url),
            start_time=self._ns(time.perf_counter()),
        )
        carrier: dict[str, str] = {}
        tracing.propagator.inject(carrier, context=trace.set_span_in_context(span, context))
        kept = [(k, v) for k, v in headers if k.lower() not in tracing.fields]
        kept.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items())
        return kept

    def upstream_answered(self, status: int | None, error: str | None = None) -> None:
        """vLLM's answer has ended (or never came: ``status`` None)."""
        span = self.upstream
        if span is None:
            return
        self.upstream = None
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None or (status is not None and status >= 400):
            span.set_attribute("error.type", error or str(status))
            span.set_status(Status(StatusCode.ERROR))
        span.end(self._ns(time.perf_counter()))

    def end(self, end: float) -> None:
        """Write the counting and queue spans and end the request's span at ``end``."""
        record = self._record
        span = self.span
        if self.upstream is not None:  # cut short (a client gone, a drain)
            self.upstream_answered(None, "cancelled")
        if not span.is_recording():
            span.end()
            return
        tracer = self._tracing.tracer
        context = trace.set_span_in_context(span)
        if record.count_start is not None:
            counted = tracer.start_span(
                "count prompt tokens", context=context, start_time=self._ns(record.count_start)
            )
            if record.prompt_tokens is not None:
                counted.set_attribute("gen_ai.usage.input_tokens", record.prompt_tokens)
            if record.count_method is not None:
                counted.set_attribute("kv_sidecar.count_method", record.count_method)
            counted.end(self._ns(record.count_end if record.count_end is not None else end))
        if record.admit_start is not None:
            queue = tracer.start_span(
                "admission queue", context=context, start_time=self._ns(record.admit_start)
            )
            queue.set_attributes(_decision_attributes(record))
            queue.end(self._ns(record.admit_end if record.admit_end is not None else end))
        span.set_attributes(_decision_attributes(record))
        attributes: Iterable[tuple[str, Any]] = (
            ("gen_ai.request.model", record.model),
            ("gen_ai.usage.input_tokens", record.prompt_tokens),
            ("gen_ai.usage.output_tokens", record.completion_tokens),
            ("kv_sidecar.projected_blocks", record.projected_blocks),
            ("kv_sidecar.reserved_blocks", record.reserved_blocks),
            ("http.response.status_code", record.status),
        )
        span.set_attributes({k: v for k, v in attributes if v is not None})
        if record.model is not None:  # the GenAI conventions' name: "{operation} {model}"
            span.update_name(f"{_OPERATIONS.get(record.endpoint, 'chat')} {record.model}")
        if record.status >= 500 or record.upstream_error is not None:
            span.set_attribute("error.type", record.upstream_error or str(record.status))
            span.set_status(Status(StatusCode.ERROR))
        span.end(self._ns(end))


def _decision_attributes(record: RequestRecord) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    if record.decision is not None:
        attributes["kv_sidecar.decision"] = record.decision
    if record.reason is not None:
        attributes["kv_sidecar.reason"] = record.reason
    if record.queue_wait_s is not None:
        attributes["kv_sidecar.queue_wait_s"] = record.queue_wait_s
    return attributes
