"""Spans of a real ``kv-sidecar serve`` process, received by a real OTLP/HTTP receiver.

The receiver (:class:`~tests.support.otlp.OtlpReceiver`) is a small HTTP server that decodes
each protobuf ``ExportTraceServiceRequest`` posted to ``/v1/traces``. The sidecar runs in front of
the fake vLLM, configured by the standard environment only (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``),
with a batch delay of a minute: the spans can only arrive through the flush at SIGTERM. Checked: one
server span per generation request, continuing the client's ``traceparent``, with children for
counting, the admission queue (its wait measured) and the upstream call; vLLM received a
``traceparent`` of the same trace whose parent is the upstream span. Without ``OTEL_*`` the
sidecar makes no spans and the client's ``traceparent`` reaches vLLM unchanged. In front of a
real vLLM exporting its own spans: ``tests/test_tracing_vllm.py``.
"""

from __future__ import annotations

import json
import os
import re
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from harness.fake_vllm import FakeServer, FakeVllm, count_prompt, write_model_dir
from harness.workload import SidecarProcess
from sidecar.errors import ConfigError
from sidecar.observability.tracing import exporter_names, from_env
from tests.support.otlp import CLIENT_SPAN_ID, TRACE_ID, OtlpReceiver, children


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OTEL_* variable of the test's own environment reaches the sidecar."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def chat(words: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": words}],
        "max_tokens": max_tokens,
    }


@pytest.mark.usefixtures("clean_env")
def test_spans_reach_an_otlp_receiver_and_vllm_joins_the_trace(model_dir: Path) -> None:
    fake = FakeVllm(model_root=model_dir)
    # room for one 3-block request at a time (5 blocks of 128 tokens): the second waits in
    # the queue while the first decodes
    fake.num_gpu_blocks = 5
    fake.token_delay = 0.002
    first = chat("one two three", 300)
    second = chat("four five six seven", 300)
    too_long = {"model": "tiny", "prompt": "w " * 2000, "max_tokens": 4}
    with OtlpReceiver() as receiver, FakeServer(fake) as upstream:
        env = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "60000",  # only the flush at shutdown exports
            "OTEL_SERVICE_NAME": "kv-sidecar-under-test",
        }
        sc = SidecarProcess(
            upstream.url,
            "--policy",
            "queue",
            "--scrape-interval",
            "0.1",
            "--log-format",
            "json",
            env=env,
        ).start()
        try:
            traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
            with httpx.Client(base_url=sc.url, timeout=60) as client, ThreadPoolExecutor(2) as pool:
                running = pool.submit(
                    client.post,
                    "/v1/chat/completions",
                    json=first,
                    headers={"traceparent": traceparent, "x-request-id": "first"},
                )
                deadline = time.monotonic() + 10
                while not fake.generations() and time.monotonic() < deadline:
                    time.sleep(0.005)
                if not fake.generations():
                    pytest.fail(f"the first request never reached the fake: {sc.log()}")
                queued = client.post(
                    "/v1/chat/completions", json=second, headers={"x-request-id": "second"}
                )
                assert running.result().status_code == 200
                assert queued.status_code == 200, queued.text
                refused = client.post(
                    "/v1/completions", json=too_long, headers={"x-request-id": "long"}
                )
                assert refused.status_code == 400
            time.sleep(0.3)
            assert receiver.spans == []  # nothing exported before the shutdown's flush
        finally:
            assert sc.stop() == 0
        spans = list(receiver.spans)
        log = sc.log()
    assert receiver.exports >= 1, log

    requests = {
        s.attributes["kv_sidecar.request_id"]: s for s in spans if s.kind == Span.SPAN_KIND_SERVER
    }
    assert set(requests) == {"first", "second", "long"}, [s.name for s in spans]
    assert all(s.resource["service.name"] == "kv-sidecar-under-test" for s in spans)

    # the client's trace continues: same trace id, the client's span as the parent
    root = requests["first"]
    assert (root.trace_id, root.parent_id) == (TRACE_ID, CLIENT_SPAN_ID)
    assert root.name == "chat tiny"  # OpenTelemetry's GenAI conventions: "{operation} {model}"
    assert root.attributes["http.request.method"] == "POST"
    assert root.attributes["url.path"] == "/v1/chat/completions"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.request.model"] == "tiny"
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.usage.input_tokens"] == count_prompt(first)
    assert root.attributes["gen_ai.usage.output_tokens"] == 300
    assert root.attributes["kv_sidecar.decision"] == "admit"
    assert root.attributes["kv_sidecar.reason"] == "fits"
    assert root.attributes["kv_sidecar.projected_blocks"] == 3
    assert root.attributes["kv_sidecar.queue_wait_s"] == 0.0

    # its log lines name its trace and span, as the trace backend shows them
    access = [
        line
        for line in (json.loads(text) for text in log.splitlines() if text.startswith("{"))
        if line.get("logger") == "sidecar.access"
    ]
    first_line = next(line for line in access if line["request_id"] == "first")
    assert (first_line["trace_id"], first_line["span_id"]) == (TRACE_ID, root.span_id)
    assert {line["trace_id"] for line in access} == {s.trace_id for s in requests.values()}

    kids = children(spans, root)
    assert set(kids) == {"count prompt tokens", "admission queue", "POST /v1/chat/completions"}
    upstream_span = kids["POST /v1/chat/completions"]
    assert upstream_span.kind == Span.SPAN_KIND_CLIENT
    assert upstream_span.attributes["http.response.status_code"] == 200
    assert upstream_span.attributes["server.port"] == upstream.port
    assert kids["count prompt tokens"].attributes["gen_ai.usage.input_tokens"] == count_prompt(
        first
    )
    for kid in kids.values():
        assert root.start_ns <= kid.start_ns <= kid.end_ns <= root.end_ns, kid.name
    # in order: counted, then admitted, then sent to vLLM
    assert kids["count prompt tokens"].end_ns <= kids["admission queue"].start_ns
    assert kids["admission queue"].end_ns <= upstream_span.start_ns

    # vLLM got a traceparent of the same trace, whose parent is the upstream span (once: the
    # client's own was replaced, not forwarded beside it)
    by_id = {r.header("x-request-id"): r for r in fake.generations()}
    assert by_id["first"].header("traceparent") == f"00-{TRACE_ID}-{upstream_span.span_id}-01"

    # no traceparent: a new trace, rooted at the sidecar; its queue wait is a span of its own
    queued_root = requests["second"]
    assert queued_root.parent_id == "" and queued_root.trace_id != TRACE_ID
    assert queued_root.attributes["kv_sidecar.reason"] == "queued"
    waited = queued_root.attributes["kv_sidecar.queue_wait_s"]
    assert waited > 0.1
    kids = children(spans, queued_root)
    queue = kids["admission queue"]
    assert queue.attributes["kv_sidecar.queue_wait_s"] == waited
    assert (queue.end_ns - queue.start_ns) / 1e9 >= waited
    upstream_span = kids["POST /v1/chat/completions"]
    version, trace_id, parent_id, flags = str(by_id["second"].header("traceparent")).split("-")
    assert (version, trace_id, parent_id) == ("00", queued_root.trace_id, upstream_span.span_id)
    assert int(flags, 16) & 1  # sampled (the SDK may set W3C level 2's "random" flag too)

    # refused before the gate: counted, never queued nor sent
    long_root = requests["long"]
    assert long_root.attributes["http.response.status_code"] == 400
    assert long_root.attributes["kv_sidecar.reason"] == "prompt_too_long"
    assert long_root.name == f"{long_root.attributes['gen_ai.operation.name']} tiny"
    assert set(children(spans, long_root)) == {"count prompt tokens"}
    assert "long" not in by_id


@pytest.mark.usefixtures("clean_env")
def test_without_otel_env_no_spans_and_traceparent_passes_unchanged(model_dir: Path) -> None:
    fake = FakeVllm(model_root=model_dir)
    with OtlpReceiver() as receiver, FakeServer(fake) as upstream:
        # a receiver is listening, but nothing names it: tracing stays off
        with SidecarProcess(upstream.url) as sc:
            traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
            resp = httpx.post(
                sc.url + "/v1/chat/completions",
                json=chat("hi", 2),
                headers={"traceparent": traceparent, "tracestate": "vendor=1"},
                timeout=30,
            )
            assert resp.status_code == 200
            sc.stop()
        assert receiver.spans == [] and receiver.exports == 0
    (sent,) = fake.generations()
    assert sent.header("traceparent") == traceparent
    assert sent.header("tracestate") == "vendor=1"


def test_environment_turns_tracing_on_as_the_spec_reads() -> None:
    assert exporter_names({}) == []
    assert exporter_names({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ["otlp"]
    assert exporter_names({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/x"}) == ["otlp"]
    assert exporter_names({"OTEL_TRACES_EXPORTER": "otlp,console"}) == ["otlp", "console"]
    # an explicit exporter setting wins over an endpoint; "none" turns it off
    off = {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert exporter_names(off) == []
    assert exporter_names({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"}) == []
    assert from_env({}) is None
    tracing = from_env({"OTEL_TRACES_EXPORTER": "otlp"})
    assert tracing is not None
    tracing.shutdown()
    with pytest.raises(ConfigError, match="unknown exporter 'zipkin'"):
        from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ConfigError, match="'grpc' is not supported"):
        from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})


@pytest.mark.usefixtures("clean_env")
def test_bad_otel_setting_is_a_one_line_error(model_dir: Path) -> None:
    sc = SidecarProcess("http://127.0.0.1:9", env={"OTEL_TRACES_EXPORTER": "zipkin"})
    sc.start(wait_ready=False)
    assert sc.proc is not None and sc.proc.wait(timeout=60) == 2
    log = sc.log()
    assert "kv-sidecar serve: error: OTEL_TRACES_EXPORTER: unknown exporter 'zipkin'" in log
    assert "Traceback" not in log


def test_the_image_lock_carries_the_otlp_exporter() -> None:
    """The image installs requirements.lock only: without the ``otlp`` extra in it, setting
    OTEL_EXPORTER_OTLP_* on the image would stop the sidecar at start."""
    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    wanted = project["project"]["optional-dependencies"]["otlp"]
    names = {re.split(r"[\[<>=!~; ]", spec, maxsplit=1)[0].lower() for spec in wanted}
    pinned = set(
        re.findall(r"^([a-z0-9][a-z0-9._-]*)==", (root / "requirements.lock").read_text(), re.M)
    )
    assert names and names <= pinned, names - pinned
