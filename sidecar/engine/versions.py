"""Which vLLM the sidecar mirrors, and a check of the version a running vLLM reports.

The sidecar repeats vLLM's own rules: its prompt rendering (``sidecar.counting.render``), its
``max_tokens`` defaults, its KV block arithmetic and the names and labels of its metrics. Those
rules are read from vLLM :data:`MIRRORED` (and tested against its CPU build); a vLLM of another
minor version may differ in any of them. vLLM answers ``GET /version`` with ``{"version": "..."}``
(``vllm/entrypoints/serve/instrumentator/basic.py``); :func:`parse_version_answer` reads that
answer tolerantly and :func:`version_problem` says, in one line, what differs from the
supported range (:data:`SUPPORTED`: the minor versions whose rules are those of :data:`MIRRORED`).
Nothing here fails because of a version: the caller logs the line and carries on.

>>> version_problem("0.32.1+cpu") is None
True
>>> version_problem("0.33.0").endswith("minor version 0.33, not 0.32")
True
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

#: the vLLM release whose rules the sidecar mirrors, and which its tests run against (CPU build)
MIRRORED = "0.32.0"
#: (major, minor) versions whose rules are those of :data:`MIRRORED`
SUPPORTED: tuple[tuple[int, int], ...] = ((0, 32),)

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")
#: a reported version is clipped to this many characters (it becomes a metric label)
MAX_VERSION_CHARS = 64


def supported_text() -> str:
    return ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED)


@dataclass(frozen=True, slots=True)
class ReportedVersion:
    """What ``GET /version`` said: the version string, or why there is none."""

    version: str | None
    problem: str | None = None  # why the version is unknown (no /version, not JSON, ...)


def parse_version_answer(status: int, body: bytes) -> ReportedVersion:
    """vLLM's answer to ``GET /version``, read without trusting it.

    >>> parse_version_answer(200, b'{"version": "0.32.0"}')
    ReportedVersion(version='0.32.0', problem=None)
    >>> parse_version_answer(404, b'{"detail": "Not Found"}').problem
    'GET /version answered 404'
    """
    if status != 200:
        return ReportedVersion(None, f"GET /version answered {status}")
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ReportedVersion(None, "GET /version did not answer JSON")
    version = answer.get("version") if isinstance(answer, dict) else None
    if not isinstance(version, str) or not version.strip():
        return ReportedVersion(None, "GET /version named no version")
    clean = "".join(c for c in version.strip() if c.isprintable())[:MAX_VERSION_CHARS]
    return ReportedVersion(clean)


def minor_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as ``0.32.0``, ``0.32.1rc2+cpu`` or ``v0.33``."""
    match = _VERSION.match(version.strip())
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def version_problem(version: str | None, *, unknown: str | None = None) -> str | None:
    """One line saying how ``version`` differs from what the sidecar supports; None when it is
    supported. ``unknown``: why there is no version (then the line says so)."""
    mirrored = (
        f"{supported_text()}; its prompt rendering, max_tokens defaults and metric names mirror "
        f"vLLM {MIRRORED}"
    )
    if version is None:
        why = unknown or "no answer"
        return f"cannot tell vLLM's version ({why}); the sidecar supports {mirrored}"
    minor = minor_version(version)
    if minor is None:
        return (
            f"vLLM reports version {version!r}, not a version the sidecar can read; it supports "
            f"{mirrored}"
        )
    if minor in SUPPORTED:
        return None
    wanted = " or ".join(f"{major}.{m}" for major, m in SUPPORTED)
    return (
        f"vLLM reports version {version}, outside the versions the sidecar supports ({mirrored}): "
        f"minor version {minor[0]}.{minor[1]}, not {wanted}"
    )


class VersionCheck:
    """Says each problem once: :meth:`problem` returns the line the first time a version (or
    the lack of one) is seen, and None after (a vLLM restarted at the same version, a second
    discovery)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: set[str | None] = set()

    def problem(self, reported: ReportedVersion) -> str | None:
        key = reported.version
        if key in self._seen:
            return None
        self._seen.add(key)
        return version_problem(reported.version, unknown=reported.problem)
