"""Polls until true with a deadline: :func:`wait_for` for every test that waits on a process
(:func:`until` where the test wants the value that came true), :func:`eventually` for the tests
that wait inside their own event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], bool], what: str, within: float, step: float = 0.01) -> float:
    """Poll ``check`` until true; the seconds it took. Fails the test after ``within`` s."""
    t0 = time.monotonic()
    while not check():
        elapsed = time.monotonic() - t0
        assert elapsed < within, f"not within {within}s: {what}"
        time.sleep(step)
    return time.monotonic() - t0


def until(check: Callable[[], T], what: str, within: float = 20.0, step: float = 0.05) -> T:
    """Poll ``check`` until it returns something true; that value. Fails the test after
    ``within`` s."""
    t0 = time.monotonic()
    while not (value := check()):
        assert time.monotonic() - t0 < within, f"not within {within}s: {what}"
        time.sleep(step)
    return value


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], what: str, within: float = 10.0
) -> None:
    """Await ``check`` (a plain or an async predicate) every 10 ms until true; fails the test
    after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if result if isinstance(result, bool) else await result:
            return
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        await asyncio.sleep(0.01)
