"""``promtool`` (Debian's ``prometheus`` package, ``scripts/system-deps.sh``), run on rules files.

The test that needs it fails (never skips) when it is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def promtool() -> str:
    """Path of ``promtool``; the test fails (never skips) when it is missing."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run scripts/system-deps.sh (Debian package prometheus)")
    return path


def run_promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )
