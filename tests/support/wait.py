"""One poll-until-true with a deadline, for every test that waits on a process."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(check: Callable[[], bool], what: str, within: float, step: float = 0.01) -> float:
    """Poll ``check`` until true; the seconds it took. Fails the test after ``within`` s."""
    t0 = time.monotonic()
    while not check():
        elapsed = time.monotonic() - t0
        assert elapsed < within, f"not within {within}s: {what}"
        time.sleep(step)
    return time.monotonic() - t0
