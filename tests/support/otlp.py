"""A real OTLP/HTTP trace receiver on loopback, and what the tests read of the spans it got.

:class:`OtlpReceiver` is a small HTTP server that decodes each protobuf
``ExportTraceServiceRequest`` posted to ``/v1/traces`` (uncompressed or gzip) into
:class:`ReceivedSpan` objects; :data:`TRACE_ID` and :data:`CLIENT_SPAN_ID` make a client's
``traceparent``; :func:`children` names a span's children.

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint}
        ...
        (root,) = [s for s in receiver.spans if s.parent_id == CLIENT_SPAN_ID]
        children(receiver.spans, root)
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None


class ReceivedSpan:
    """One decoded span, with its resource's attributes."""

    def __init__(self, span: Span, resource: dict[str, Any]) -> None:
        self.name = span.name
        self.kind = span.kind
        self.trace_id = span.trace_id.hex()
        self.span_id = span.span_id.hex()
        self.parent_id = span.parent_span_id.hex()
        self.start_ns = span.start_time_unix_nano
        self.end_ns = span.end_time_unix_nano
        self.status_code = span.status.code
        self.attributes = {a.key: _value(a.value) for a in span.attributes}
        self.resource = resource


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on a loopback port (protobuf, uncompressed or gzip)."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = (
                    self.path == "/v1/traces"
                    and self.headers.get("Content-Type") == "application/x-protobuf"
                )
                if ok:
                    request = ExportTraceServiceRequest.FromString(body)
                    for resource_spans in request.resource_spans:
                        resource = {
                            a.key: _value(a.value) for a in resource_spans.resource.attributes
                        }
                        for scope_spans in resource_spans.scope_spans:
                            for span in scope_spans.spans:
                                receiver.spans.append(ReceivedSpan(span, resource))
                    receiver.exports += 1
                answer = ExportTraceServiceResponse().SerializeToString() if ok else b""
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    found = [s for s in spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id]
    named = {s.name: s for s in found}
    assert len(named) == len(found), [s.name for s in found]
    return named
