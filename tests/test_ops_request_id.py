"""Every answer of the metrics port carries ``X-Request-Id``, as every answer of the proxy port
does (tests/test_conventions.py): the client's as sent, else 32 hex digits made for it, different
for each request. Through the sidecar in front of the fake vLLM: ``/metrics``, ``/healthz``,
``/readyz``, ``/state``, a path it does not serve (404), a method it does not take (405) and the
admin API's refusal while ``--admin`` is off (403).
"""

from __future__ import annotations

import re

import pytest

from harness.fake_vllm import FakeServer
from tests.support.stack import run_sidecar

HEX_ID = re.compile(r"[0-9a-f]{32}")

ANSWERS = [
    ("GET", "/metrics", 200),
    ("GET", "/healthz", 200),
    ("GET", "/readyz", 200),
    ("GET", "/state", 200),
    ("GET", "/no-such-page", 404),
    ("POST", "/metrics", 405),
    ("PATCH", "/admin/settings", 403),
]


@pytest.mark.parametrize(("method", "path", "status"), ANSWERS, ids=[a[1] + a[0] for a in ANSWERS])
async def test_every_metrics_port_answer_carries_a_request_id(
    upstream: FakeServer, method: str, path: str, status: int
) -> None:
    async with run_sidecar(upstream) as stack:
        kwargs = {"json": {"headroom": 0.5}} if method == "PATCH" else {}
        made = [await stack.ops.request(method, path, **kwargs) for _ in range(2)]  # type: ignore[arg-type]
        mine = await stack.ops.request(
            method,
            path,
            headers={"x-request-id": "ops-1"},
            **kwargs,  # type: ignore[arg-type]
        )
    for resp in (*made, mine):
        assert resp.status_code == status, resp.text
        assert len(resp.headers.get_list("x-request-id")) == 1
    assert all(HEX_ID.fullmatch(r.headers["x-request-id"]) for r in made)
    assert made[0].headers["x-request-id"] != made[1].headers["x-request-id"]
    assert mine.headers["x-request-id"] == "ops-1"
