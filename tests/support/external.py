"""Skips that are right on every machine: a test sized for the harness's own vLLM may skip only
when the run targets an external one (``KV_SIDECAR_TEST_VLLM_URL``); with the harness's vLLM a
missing piece is a failure, never a silent skip."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

EXTERNAL = os.environ.get("KV_SIDECAR_TEST_VLLM_URL")


def unless_external(reason: str) -> NoReturn:
    """Skip with an external vLLM; fail with the harness's own, which must have what is missing."""
    if EXTERNAL:
        pytest.skip(reason)
    pytest.fail(f"the harness's own vLLM should not lack this: {reason}")
