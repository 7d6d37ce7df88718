"""Hostile input: fuzzed bodies and headers, limits, request-target tricks, secrets.

The sidecar runs in-process (``tests.support.faultkit.ThreadedSidecar``) in front of the fake
vLLM for the fast property tests, and as a real ``kv-sidecar serve`` process where its log file
and its two ports are what is checked. Properties:

- it never answers 5xx of its own making, never crashes, never forwards a body it could not parse,
  and its ledger stays consistent (hypothesis, derandomized: the same examples on every run);
- every limit (body size, header size and count, JSON depth, prompt list length, ``n``, digits in
  a number) is refused with a clear 4xx before anything reaches vLLM;
- no request makes it connect anywhere but its upstream;
- ``Authorization`` reaches vLLM and nothing else: not the log, not the sidecar's own endpoints,
  not another client's request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.fake_vllm import FakeServer
from harness.workload import SidecarProcess
from tests.support.faultkit import ThreadedSidecar, ToughFake, raw_http
from tests.support.wait import wait_for

GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
FUZZ = settings(
    max_examples=300,
    derandomize=True,  # the same examples on every run: CI stays stable
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SIDECAR_CODES = {
    "invalid_json",
    "invalid_request",
    "body_too_large",
    "context_length_exceeded",
    "max_tokens_too_large",
    "kv_budget_exceeded",
    "kv_cache_full",
    "queue_full",
    "queue_timeout",
    "invalid_target",
    "request_header_fields_too_large",
}


@pytest.fixture(scope="module")
def upstream(model_dir: Path) -> Iterator[FakeServer]:
    """The fake vLLM with the reliability knobs (``ToughFake``), one for the module: the module's
    sidecar stays in front of it (``model_dir`` is the shared one, tests/support/fake_upstream)."""
    with FakeServer(ToughFake(model_root=model_dir)) as server:
        yield server


@pytest.fixture(scope="module")
def evil() -> Iterator[FakeServer]:
    """Another server on loopback: nothing sent to the sidecar may ever reach it."""
    with FakeServer(ToughFake(model_root=None)) as server:
        yield server


@pytest.fixture(scope="module")
def sidecar(upstream: FakeServer) -> Iterator[ThreadedSidecar]:
    with ThreadedSidecar(upstream.url, max_queue_wait=2.0) as sc:
        yield sc


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30, trust_env=False) as c:
        yield c


def fake_of(server: FakeServer) -> ToughFake:
    app = server.app
    assert isinstance(app, ToughFake)
    return app


def assert_sidecar_error(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """An OpenAI-shaped refusal of the sidecar's own, with a message a person can act on."""
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and len(error["message"]) > 10, error
    return dict(error)


# --- fuzzing ------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
small_tokens = st.integers(min_value=-3, max_value=24)
prompts = (
    st.text(max_size=60)
    | st.lists(st.text(max_size=20), max_size=4)
    | st.lists(st.integers(min_value=-2, max_value=600), max_size=12)
    | st.lists(st.lists(st.integers(min_value=0, max_value=600), max_size=6), max_size=3)
    | json_values
)
contents = (
    st.text(max_size=60)
    | st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), max_size=3
    )
    | json_values
)
messages = (
    st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "role": st.sampled_from(["user", "system", "assistant", "tool"]) | json_values,
                "content": contents,
                "name": st.text(max_size=8),
            },
        )
        | json_values,
        max_size=4,
    )
    | json_values
)
field_values = {
    "model": st.just("tiny") | st.just("other") | json_values,
    "prompt": prompts,
    "messages": messages,
    "input": st.text(max_size=40) | messages,
    "max_tokens": small_tokens | json_values,
    "max_completion_tokens": small_tokens | json_values,
    "max_output_tokens": small_tokens | json_values,
    "n": st.integers(min_value=-1, max_value=3) | st.just(129) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "truncate_prompt_tokens": st.integers(min_value=-2, max_value=50) | json_values,
    "temperature": json_values,
    "system": st.text(max_size=20) | json_values,
}
bodies = st.fixed_dictionaries(
    {}, optional=field_values | {"x_extra": json_values}
) | json_values.map(lambda v: {"wrapped": v})
header_names = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,15}", fullmatch=True).filter(
    lambda n: (
        n.lower()
        not in {"host", "content-length", "transfer-encoding", "connection", "expect", "upgrade"}
    )
)
header_values = st.from_regex(r"[ -~]{0,40}", fullmatch=True).map(str.strip)
headers = st.dictionaries(header_names, header_values, max_size=6)
content_types = st.sampled_from(
    [
        None,
        "application/json",
        "application/json; charset=utf-16",
        "text/plain",
        "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded",
    ]
)


def encode(body: Any, style: str) -> bytes:
    """The body as JSON, or deliberately broken in one of a few ways."""
    text = json.dumps(body, allow_nan=True)
    if style == "json":
        return text.encode()
    if style == "truncated":
        return text.encode()[: max(1, len(text) // 2)]
    if style == "utf16":
        return text.encode("utf-16")
    if style == "bom":
        return b"\xef\xbb\xbf" + text.encode()
    if style == "latin1-garbage":
        return text.encode() + b"\xff\xfe\x80"
    if style == "trailing":
        return text.encode() + b" {}"
    if style == "nested":
        return b'{"prompt": ' + b"[" * 70 + b"1" + b"]" * 70 + b"}"
    raise AssertionError(style)


class Observed:
    """What one fuzzed request did: at the fake, at the sidecar's ledger, on the wire."""

    def __init__(self, sidecar: ThreadedSidecar, upstream: ToughFake) -> None:
        self.sidecar = sidecar
        self.upstream = upstream
        self.seen = len(self._generating())

    def _generating(self) -> list[Any]:
        return [r for r in list(self.upstream.requests) if r.path in GENERATION]

    def forwarded(self) -> list[bytes]:
        return [r.body for r in self._generating()[self.seen :]]


def check_response(
    sc: ThreadedSidecar, app: ToughFake, obs: Observed, raw: bytes, resp: httpx.Response
) -> None:
    forwarded = obs.forwarded()
    if forwarded:
        # forwarded byte for byte, and only what parses as a JSON object
        assert forwarded == [raw], (forwarded[:1], raw[:200])
        assert isinstance(json.loads(raw), dict)
    else:
        assert resp.status_code < 500, (resp.status_code, resp.text[:300], raw[:200])
        if resp.status_code >= 400:
            body = resp.json()
            error = body["error"]
            if resp.request.url.path == "/v1/messages":  # Anthropic's shape, the code leading
                assert body["type"] == "error" and set(error) == {"type", "message"}, body
                code, _, message = error["message"].partition(": ")
                error = {"code": code, "message": message}
            assert error["code"] in SIDECAR_CODES, error
            assert error["message"], error
    # the ledger: totals equal the sum of reservations, and empty once the answer is over
    figures = sc.ledger_figures()
    assert figures["reserved_blocks"] == figures["resummed_reserved"], figures
    assert figures["predicted_blocks"] == figures["resummed_predicted"], figures
    assert figures["reserved_blocks"] >= 0 and figures["in_flight"] >= 0, figures
    wait_for(sc.ledger_empty, f"ledger empty after {raw[:80]!r}", 10.0)
    assert sc.alive()


@FUZZ
@given(
    path=st.sampled_from(GENERATION),
    body=bodies,
    style=st.sampled_from(
        ["json"] * 6 + ["truncated", "utf16", "bom", "latin1-garbage", "trailing", "nested"]
    ),
    extra=headers,
    content_type=content_types,
)
def test_fuzzed_generation_requests_never_get_5xx_of_the_sidecars_making(
    sidecar: ThreadedSidecar,
    upstream: FakeServer,
    client: httpx.Client,
    path: str,
    body: Any,
    style: str,
    extra: dict[str, str],
    content_type: str | None,
) -> None:
    app = fake_of(upstream)
    raw = encode(body, style)
    sent = dict(extra)
    if content_type is not None:
        sent["Content-Type"] = content_type
    obs = Observed(sidecar, app)
    resp = client.post(sidecar.url + path, content=raw, headers=sent)
    resp.read()
    check_response(sidecar, app, obs, raw, resp)


@FUZZ
@given(
    raw=st.binary(max_size=300)
    | st.text(max_size=200).map(str.encode)
    | st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b'"x"',
            b"1e999",
            b"NaN",
            b'{"prompt": "x", "max_tokens": 1e400}',
            b'{"prompt": "x", "max_tokens": NaN}',
            b'{"prompt": "x", "max_tokens": -Infinity}',
            b'{"prompt": "\\ud800", "max_tokens": 4}',
            b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}',
            b'{"prompt": "x", "max_tokens": 4, "max_tokens": "many"}',
            b'{"prompt": "x", "stream": "yes"}',
            b'{"prompt": [[]]}',
            b'{"prompt": [true]}',
            b'{"prompt": "x", "n": 1.5}',
        ]
    ),
    path=st.sampled_from(GENERATION),
)
def test_fuzzed_raw_bytes_never_get_5xx_of_the_sidecars_making(
    sidecar: ThreadedSidecar, upstream: FakeServer, client: httpx.Client, raw: bytes, path: str
) -> None:
    app = fake_of(upstream)
    obs = Observed(sidecar, app)
    resp = client.post(
        sidecar.url + path, content=raw, headers={"Content-Type": "application/json"}
    )
    check_response(sidecar, app, obs, raw, resp)


# --- limits -------------------------------------------------------------------------------


def test_body_size_limit_is_413_before_anything_is_forwarded(upstream: FakeServer) -> None:
    app = fake_of(upstream)
    limit = 64 * 1024
    with ThreadedSidecar(upstream.url, max_body_bytes=limit) as sc, httpx.Client() as client:
        head = b'{"model": "tiny", "max_tokens": 4, "prompt": "'
        fill = limit - len(head) - 2
        at_limit = head + b"x" * fill + b'"}'
        assert len(at_limit) == limit
        over = at_limit[:-2] + b'x"}'
        before = len(app.generations())
        assert client.post(sc.url + "/v1/completions", content=at_limit).status_code != 413
        assert len(app.generations()) == before + 1
        error = assert_sidecar_error(
            client.post(sc.url + "/v1/completions", content=over), 413, "body_too_large"
        )
        assert str(limit) in error["message"]

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(over), 4096):
                yield over[i : i + 4096]

        assert_sidecar_error(
            client.post(sc.url + "/v1/completions", content=chunks()), 413, "body_too_large"
        )
        # a lying Content-Length larger than the limit is refused before the body is read
        status, answer = raw_http(
            sc.port,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n"
            b"Connection: close\r\n\r\n{",
            timeout=5,
        )
        assert status == 413 and b"body_too_large" in answer
        assert len(app.generations()) == before + 1
        assert sc.ledger_empty()


@pytest.mark.parametrize(
    ("name", "body", "param"),
    [
        (
            "json nesting deeper than 64",
            {"model": "tiny", "prompt": "x", "x": json.loads("[" * 70 + "]" * 70)},
            None,
        ),
        ("more than 1024 prompts", {"model": "tiny", "prompt": ["a"] * 1025}, "prompt"),
        ("n above 128", {"model": "tiny", "prompt": "a", "n": 129}, "n"),
        ("max_tokens below 1", {"model": "tiny", "prompt": "a", "max_tokens": 0}, "max_tokens"),
        (
            "max_tokens beyond the context",
            {"model": "tiny", "prompt": "a", "max_tokens": 5000},
            None,
        ),
    ],
)
def test_structural_limits_are_clear_400s(
    sidecar: ThreadedSidecar,
    upstream: FakeServer,
    client: httpx.Client,
    name: str,
    body: dict[str, Any],
    param: str | None,
) -> None:
    app = fake_of(upstream)
    before = len(app.generations())
    resp = client.post(sidecar.url + "/v1/completions", json=body)
    assert 400 <= resp.status_code < 500, (name, resp.text)
    error = resp.json()["error"]
    assert error["message"], name
    if param is not None:
        assert error["param"] == param, (name, error)
    assert len(app.generations()) == before, name


def test_recursion_bomb_is_a_400(
    sidecar: ThreadedSidecar, upstream: FakeServer, client: httpx.Client
) -> None:
    """100,000 nested arrays: json.loads hits the recursion limit."""
    app = fake_of(upstream)
    before = len(app.generations())
    raw = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_sidecar_error(
        client.post(sidecar.url + "/v1/completions", content=raw), 400, "invalid_json"
    )
    assert len(app.generations()) == before


def test_number_with_5000_digits_is_a_400(
    sidecar: ThreadedSidecar, upstream: FakeServer, client: httpx.Client
) -> None:
    app = fake_of(upstream)
    before = len(app.generations())
    raw = b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    assert_sidecar_error(
        client.post(sidecar.url + "/v1/completions", content=raw), 400, "invalid_json"
    )
    assert len(app.generations()) == before
    assert sidecar.alive()


@pytest.mark.parametrize(
    ("count", "size"), [(1, 256 * 1024), (2000, 8)], ids=["one-256KiB-header", "2000-headers"]
)
def test_oversized_headers_are_refused_with_431(
    sidecar: ThreadedSidecar, upstream: FakeServer, count: int, size: int
) -> None:
    app = fake_of(upstream)
    before = len(app.non_probe_requests())
    lines = "".join(f"X-H{i}: {'v' * size}\r\n" for i in range(count))
    for target in ("/v1/models", "/v1/completions"):
        body = b'{"model": "tiny", "prompt": "x", "max_tokens": 2}'
        request = (
            f"POST {target} HTTP/1.1\r\nHost: x\r\n{lines}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body
        status, answer = raw_http(sidecar.port, request, timeout=30)
        assert status == 431, (target, answer[:300])
        assert b"request_header_fields_too_large" in answer
    assert len(app.non_probe_requests()) == before  # nothing forwarded


#: The worst /healthz latency allowed while 10,000 headers are handled (10 s before F3).
STALL_LIMIT_S = 3.0


def test_many_headers_do_not_stall_the_event_loop(
    sidecar: ThreadedSidecar, client: httpx.Client
) -> None:
    """10,000 tiny headers (about 110 KB) on one pass-through request: the loop stays live."""
    lines = "".join(f"X-H{i}: v\r\n" for i in range(10_000))
    request = f"GET /echo/many HTTP/1.1\r\nHost: x\r\n{lines}Connection: close\r\n\r\n".encode()
    import threading

    def probe() -> float:
        t0 = time.monotonic()
        assert client.get(sidecar.ops_url + "/healthz").status_code == 200
        return time.monotonic() - t0

    usual = max(probe() for _ in range(20))  # the loop's latency on this machine, unloaded
    result: list[tuple[int, bytes]] = []
    sender = threading.Thread(
        target=lambda: result.append(raw_http(sidecar.port, request, timeout=60))
    )
    sender.start()
    worst = 0.0
    deadline = time.monotonic() + 90  # raw_http gives up after 60 s
    while sender.is_alive():
        assert time.monotonic() < deadline, "the 10,000-header request never ended"
        worst = max(worst, probe())
        time.sleep(0.02)
    sender.join()
    # A stall is the whole request's handling on the loop: 10 s before F3. A loaded 2-core
    # machine delays one probe by a second or so on its own, hence the generous bound.
    assert worst < max(STALL_LIMIT_S, 5 * usual), (
        f"/healthz waited {worst:.1f} s while the 10,000-header request was handled (the loop's "
        f"usual latency {usual:.2f} s, limit {STALL_LIMIT_S} s): the event loop stalled"
    )
    assert result and result[0][0] == 431, result[0][1][:200] if result else None


# --- the upstream and nothing else --------------------------------------------------------


def targets(evil_port: int) -> list[str]:
    authority = f"127.0.0.1:{evil_port}"
    return [
        f"http://{authority}/steal",
        f"https://{authority}/steal",
        f"http://{authority}/v1/completions",
        f"//{authority}/steal",
        f"/@{authority}/steal",
        f"/\\\\{authority}/steal",
        f"/%2F%2F{authority}/steal",
        f"/..%2F..%2F{authority}/steal",
        "/echo/../../../../steal",
        "/echo/%2e%2e/%2e%2e/steal",
        "/..;/steal",
        f"/echo?next=http://{authority}/steal",
        f"/redirect?to=http://{authority}/steal",
    ]


def test_request_targets_never_reach_another_host(
    sidecar: ThreadedSidecar, upstream: FakeServer, evil: FakeServer
) -> None:
    app, other = fake_of(upstream), fake_of(evil)
    for target in targets(evil.port):
        for method in ("GET", "POST"):
            body = b'{"model": "tiny", "prompt": "x", "max_tokens": 2}' if method == "POST" else b""
            request = (
                f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{evil.port}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body
            status, answer = raw_http(sidecar.port, request)
            assert status in (200, 307, 400, 404, 405), (target, answer[:200])
            if status == 307:  # relayed to the client, not followed
                assert f"127.0.0.1:{evil.port}".encode() in answer
    assert other.requests == []
    for rec in app.non_probe_requests():  # every forwarded request addressed the upstream
        assert rec.header("host") == f"127.0.0.1:{upstream.port}", rec
        assert rec.raw_path.startswith(b"/"), rec


@pytest.mark.parametrize(
    "request_line",
    ["CONNECT {evil} HTTP/1.1", "OPTIONS * HTTP/1.1", "GET {evil} HTTP/1.1"],
    ids=["connect", "asterisk", "authority-form"],
)
def test_non_path_targets_are_refused(
    sidecar: ThreadedSidecar, upstream: FakeServer, evil: FakeServer, request_line: str
) -> None:
    app, other = fake_of(upstream), fake_of(evil)
    before = len(app.non_probe_requests())
    line = request_line.format(evil=f"127.0.0.1:{evil.port}")
    status, answer = raw_http(
        sidecar.port, f"{line}\r\nHost: 127.0.0.1:{evil.port}\r\nConnection: close\r\n\r\n".encode()
    )
    assert 400 <= status < 500 or status == 0, answer[:200]  # refused (or dropped by uvicorn)
    assert other.requests == []
    assert len(app.non_probe_requests()) == before


@pytest.mark.parametrize(
    "header",
    [
        "X-Forwarded-Host: {evil}",
        "X-Forwarded-For: 10.0.0.1",
        "X-Forwarded-Proto: https",
        "Forwarded: host={evil};proto=http",
        "X-Original-URL: http://{evil}/steal",
        "X-Rewrite-URL: http://{evil}/steal",
        "X-Host: {evil}",
    ],
)
def test_forwarding_headers_do_not_move_the_upstream(
    sidecar: ThreadedSidecar, upstream: FakeServer, evil: FakeServer, header: str
) -> None:
    app, other = fake_of(upstream), fake_of(evil)
    authority = f"127.0.0.1:{evil.port}"
    for target, body in (
        ("/echo/fwd", b""),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 2}'),
    ):
        request = (
            f"POST {target} HTTP/1.1\r\nHost: {authority}\r\n{header.format(evil=authority)}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode() + body
        status, answer = raw_http(sidecar.port, request)
        assert status == 200, (header, target, answer[:200])
        rec = app.requests_to(target)[-1]
        assert rec.header("host") == f"127.0.0.1:{upstream.port}"
    assert other.requests == []


@FUZZ
@given(path=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=60))
def test_any_path_stays_on_the_upstream(
    sidecar: ThreadedSidecar, upstream: FakeServer, evil: FakeServer, path: str
) -> None:
    app, other = fake_of(upstream), fake_of(evil)
    target = "/" + path.replace(" ", "")
    host = f"127.0.0.1:{evil.port}"
    request = f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    status, _ = raw_http(sidecar.port, request.encode())
    assert status == 0 or 200 <= status < 500, (target, status)  # 0: uvicorn refused the line
    assert sidecar.alive()
    assert other.requests == []
    for rec in app.non_probe_requests()[-1:]:
        assert rec.header("host") == f"127.0.0.1:{upstream.port}"


# --- secrets ------------------------------------------------------------------------------

SECRET = "sk-live-7f3a9c0e5b1d4e2a8c6f0b9d3e7a1c5f"
PROXY_SECRET = "cHJveHktc2VjcmV0LTk5ODg="
#: a message's content: private to the client as its credentials are
CONTENT = "xylophone-4711"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_authorization_reaches_vllm_but_no_log_or_metric(model_dir: Path, log_format: str) -> None:
    """A real process at --log-level debug: every path a request can take, with a bearer token;
    in JSON, with an access line for every request, each line one JSON object."""
    app = ToughFake(model_root=model_dir)
    with FakeServer(app) as fake:
        sc = SidecarProcess(
            fake.url,
            "--log-level",
            "debug",
            "--scrape-interval",
            "0.1",
            "--log-format",
            log_format,
            "--access-log",
            "all" if log_format == "json" else "generation",
        ).start()
        try:
            auth = {"Authorization": f"Bearer {SECRET}", "Proxy-Authorization": PROXY_SECRET}
            with httpx.Client(base_url=sc.url, headers=auth, timeout=30) as client:
                chat = {"model": "tiny", "messages": [{"role": "user", "content": CONTENT}]}
                assert client.post("/v1/chat/completions", json=chat | {"max_tokens": 4}).is_success
                streamed = chat | {"max_tokens": 4, "stream": True}
                with client.stream("POST", "/v1/chat/completions", json=streamed) as resp:
                    assert resp.status_code == 200 and b"[DONE]" in resp.read()
                assert client.get("/v1/models").status_code == 200
                assert client.post("/v1/completions", content=b"{bad").status_code == 400
                too_big = {"model": "tiny", "prompt": "x", "max_tokens": 5000}
                assert client.post("/v1/completions", json=too_big).status_code == 400
                app.fail_after = 2  # vLLM crashes mid-answer
                with client.stream("POST", "/v1/chat/completions", json=streamed) as resp:
                    resp.read()
                app.fail_after = None
                fake.stop()  # vLLM down
                assert client.post("/v1/chat/completions", json=chat).status_code == 503
                fake.start()
                wait_for(
                    lambda: httpx.get(sc.metrics_url + "/readyz").status_code == 200,
                    "/readyz 200 once the fake vLLM is back",
                    30,
                )
            own = {
                path: httpx.get(sc.metrics_url + path).text
                for path in ("/metrics", "/state", "/readyz", "/healthz")
            }
        finally:
            sc.stop()
    forwarded = [r for r in app.requests if r.header("authorization")]
    # two answers, one that failed mid-way, one pass-through
    assert len(app.generations()) == 3 and all(r.header("authorization") for r in app.generations())
    assert [r.path for r in forwarded].count("/v1/models") == 1
    assert all(r.header("authorization") == f"Bearer {SECRET}" for r in forwarded)
    assert all(r.header("proxy-authorization") is None for r in app.requests)  # hop-by-hop
    # the sidecar's own calls to vLLM carry no client's credentials
    probes = [r for r in app.requests if r.path in ("/metrics", "/tokenize", "/v1/models")]
    assert len(probes) > len([r for r in forwarded if r.path == "/v1/models"])
    assert all(r.header("authorization") in (None, f"Bearer {SECRET}") for r in probes)
    assert [r for r in probes if r.path != "/v1/models" and r.header("authorization")] == []
    log = sc.log()
    assert "DEBUG" in log and "upstream failed mid-answer" in log  # the log was verbose
    assert "sidecar.access" in log
    if log_format == "json":
        lines = [json.loads(line) for line in log.splitlines() if line.strip()]
        assert all(isinstance(line, dict) and "message" in line for line in lines)
        access = [line for line in lines if line["logger"] == "sidecar.access"]
        assert {line["path"] for line in access} >= {"/v1/chat/completions", "/v1/models"}
        assert any(line.get("upstream_error") for line in access)  # the mid-answer crash
    for secret in (SECRET, SECRET[3:20], PROXY_SECRET, CONTENT):
        assert secret not in log
        for path, text in own.items():
            assert secret not in text, path


def test_own_endpoints_live_only_on_the_metrics_port(model_dir: Path) -> None:
    app = ToughFake(model_root=model_dir)
    with FakeServer(app) as fake, SidecarProcess(fake.url, "--log-level", "warning") as sc:
        for path in ("/metrics", "/healthz", "/readyz", "/state"):
            proxied = httpx.get(sc.url + path)
            own = httpx.get(sc.metrics_url + path)
            assert app.requests_to(path, "GET"), path  # passed through to vLLM
            assert proxied.text != own.text, path
            assert "kv_sidecar" not in proxied.text and '"reserved_blocks"' not in proxied.text
        assert httpx.get(sc.url + "/metrics").text == app.metrics_text()
        assert httpx.get(sc.url + "/healthz").status_code == 404  # vLLM has no /healthz
        # and the metrics port relays nothing to vLLM
        before = len(app.non_probe_requests())
        for path in ("/v1/models", "/v1/completions", "/health"):
            assert httpx.get(sc.metrics_url + path).status_code == 404, path
        assert len(app.non_probe_requests()) == before


def test_one_clients_cookies_never_reach_another_clients_request(
    sidecar: ThreadedSidecar, upstream: FakeServer
) -> None:
    app = fake_of(upstream)
    with httpx.Client(timeout=10) as alice, httpx.Client(timeout=10) as bob:
        resp = alice.get(sidecar.url + "/status/200")
        assert resp.headers.get_list("set-cookie") == ["a=1", "b=2"]  # relayed to Alice
        bob.get(sidecar.url + "/status/201")
        assert app.requests_to("/status/201")[-1].header("cookie") is None
        alice.get(sidecar.url + "/status/202")  # Alice's own cookies come from Alice
        assert app.requests_to("/status/202")[-1].header("cookie") == "a=1; b=2"
    # the proxy sends on its transport (no cookie jar at all); the sidecar's own client keeps none
    assert len(sidecar.sc.own_client.cookies.jar) == 0


API_KEY = "vllm-api-key-0a1b2c3d4e5f"


def _ready(sc: SidecarProcess) -> bool:
    try:
        return httpx.get(sc.metrics_url + "/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_vllm_with_api_key(model_dir: Path) -> None:
    """``vllm serve --api-key K``: the sidecar discovers with its own key, clients bring theirs."""
    app = ToughFake(model_root=model_dir, api_key=API_KEY)
    with FakeServer(app) as fake:
        sc = SidecarProcess(
            fake.url, "--log-level", "debug", env={"KV_SIDECAR_UPSTREAM_API_KEY": API_KEY}
        )
        try:
            sc.start(wait_ready=False)
            deadline = time.monotonic() + 60
            while not _ready(sc):  # fails fast on the first refusal, not at a timeout
                assert "401 Unauthorized" not in sc.log(), "discovery refused by vLLM's guard"
                assert time.monotonic() < deadline, (
                    "the sidecar not ready within 60 s behind a vLLM with --api-key:\n"
                    + sc.log()[-2000:]
                )
                time.sleep(0.1)
            body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
            ok = httpx.post(
                sc.url + "/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {API_KEY}"},
            )
            assert ok.status_code == 200, ok.text
            # a client without the key is refused by vLLM: the sidecar never lends its own
            anon = httpx.post(sc.url + "/v1/completions", json=body)
            assert anon.status_code == 401
            own = (
                httpx.get(sc.metrics_url + "/metrics").text
                + httpx.get(sc.metrics_url + "/state").text
            )
        finally:
            sc.stop()
    client_requests = [r for r in app.generations()]
    assert [r.header("authorization") for r in client_requests] == [f"Bearer {API_KEY}", None]
    assert API_KEY not in sc.log() and API_KEY not in own
