"""Assertions on the sidecar's refusals: an OpenAI-shaped error body and agreeing retry headers."""

from __future__ import annotations

import math
from typing import Any

import httpx


def openai_error(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Assert an OpenAI-shaped error answer; return its ``error`` object."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def retry_after(resp: httpx.Response) -> float:
    """Assert both retry headers agree; return the seconds."""
    seconds = int(resp.headers["retry-after"])
    millis = int(resp.headers["retry-after-ms"])
    assert seconds >= 1 and millis >= 1
    assert seconds == max(1, math.ceil(millis / 1000)), resp.headers
    return millis / 1000
