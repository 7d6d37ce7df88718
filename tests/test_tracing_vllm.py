"""The sidecar's spans and a real vLLM's in one trace, at one real OTLP/HTTP receiver.

A real vLLM (CPU build) runs with ``--otlp-traces-endpoint`` (OTLP over HTTP/protobuf:
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``; vLLM's default is gRPC) and a real
``kv-sidecar serve`` in front of it with ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, both exporting to
the same :class:`~tests.support.otlp.OtlpReceiver`. One chat request with a client
``traceparent``: the sidecar's server span continues the client's trace, and vLLM's
``llm_request`` span, made from the ``traceparent`` vLLM received, is in the same trace under the
sidecar's upstream-call span, after the sidecar's admission queue.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from harness.vllm_cpu import VllmServer
from harness.workload import SidecarProcess
from tests.support.otlp import CLIENT_SPAN_ID, TRACE_ID, OtlpReceiver, ReceivedSpan, children

pytestmark = pytest.mark.vllm

#: Clock slack between the two processes' span times (both wall clock, one machine).
SLACK_NS = 50_000_000


def _vllm_span(receiver: OtlpReceiver, timeout: float) -> ReceivedSpan | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [s for s in list(receiver.spans) if s.name == "llm_request"]
        if found:
            return found[0]
        time.sleep(0.1)
    return None


def test_vllm_span_is_a_child_of_the_sidecar_upstream_span(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if os.environ.get("KV_SIDECAR_TEST_VLLM_URL"):
        pytest.skip("starts its own vLLM with --otlp-traces-endpoint")
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    with OtlpReceiver() as receiver:
        # read by vLLM (its exporter: gRPC unless told) and by both processes' batch processors
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        server = VllmServer(extra_args=["--otlp-traces-endpoint", receiver.endpoint]).start()
        try:
            env = {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
                "OTEL_SERVICE_NAME": "kv-sidecar-under-test",
            }
            sc = SidecarProcess(server.url, env=env).start()
            try:
                answer = httpx.post(
                    sc.url + "/v1/chat/completions",
                    json={
                        "model": server.served_name,
                        "messages": [{"role": "user", "content": "one two three"}],
                        "max_tokens": 4,
                        "ignore_eos": True,
                    },
                    headers={
                        "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01",
                        "x-request-id": "traced",
                    },
                    timeout=120,
                )
                assert answer.status_code == 200, answer.text
                llm_request = _vllm_span(receiver, timeout=30)
            finally:
                assert sc.stop() == 0
            assert llm_request is not None, (
                f"no llm_request span from vLLM: {[s.name for s in receiver.spans]}\n"
                f"{server.log_tail()}"
            )
        finally:
            server.stop()
        spans = list(receiver.spans)

    [root] = [
        s
        for s in spans
        if s.kind == Span.SPAN_KIND_SERVER and s.attributes.get("kv_sidecar.request_id") == "traced"
    ]
    # the sidecar continues the client's trace
    assert (root.trace_id, root.parent_id) == (TRACE_ID, CLIENT_SPAN_ID)
    assert root.resource["service.name"] == "kv-sidecar-under-test"
    kids = children(spans, root)
    assert set(kids) == {"count prompt tokens", "admission queue", "POST /v1/chat/completions"}
    upstream_span = kids["POST /v1/chat/completions"]
    assert upstream_span.kind == Span.SPAN_KIND_CLIENT

    # vLLM's span is in the same trace, its parent the sidecar's call to vLLM: the traceparent
    # vLLM received was the sidecar's
    assert llm_request.trace_id == TRACE_ID
    assert llm_request.parent_id == upstream_span.span_id
    assert llm_request.resource["service.name"] != "kv-sidecar-under-test"
    assert llm_request.attributes["gen_ai.usage.completion_tokens"] == 4
    # the prompt the sidecar counted is the one vLLM ran
    assert (
        llm_request.attributes["gen_ai.usage.prompt_tokens"]
        == root.attributes["gen_ai.usage.input_tokens"]
    )
    # in time: the sidecar's queue, then vLLM's work inside the sidecar's call to it
    assert kids["admission queue"].end_ns <= llm_request.start_ns + SLACK_NS
    assert upstream_span.start_ns <= llm_request.start_ns + SLACK_NS
    assert llm_request.end_ns <= upstream_span.end_ns + SLACK_NS
