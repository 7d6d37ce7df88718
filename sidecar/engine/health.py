"""vLLM's ``/health``, asked every scrape interval: its API can serve ``/metrics`` while its
engine is dead (``/health`` then answers 503), so readiness asks both.

One late answer is more often the sidecar's own loop lagging under a burst than vLLM failing:
only a second timeout in a row marks vLLM not healthy. A refused or reset connection, or any
status but 200, does at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

log = logging.getLogger(__name__)


class HealthMonitor:
    """Polls ``url`` (vLLM's ``/health``) every ``interval`` seconds; ``healthy`` is the verdict."""

    def __init__(self, client: httpx.AsyncClient, url: str, *, interval: float) -> None:
        self.client = client
        self.url = url
        self.interval = interval
        self.healthy = False
        self._timeouts = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def check(self) -> bool:
        """Ask once; update and return ``healthy``."""
        try:
            async with asyncio.timeout(max(2.0, self.interval)):
                resp = await self.client.get(self.url)
            healthy = resp.status_code == 200
            self._timeouts = 0
        except (TimeoutError, httpx.TimeoutException):
            self._timeouts += 1
            healthy = self.healthy and self._timeouts < 2
        except httpx.HTTPError:
            healthy = False  # refused or reset: vLLM is not there
            self._timeouts = 0
        if healthy != self.healthy:
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "vLLM /health: %s",
                "healthy" if healthy else "not healthy",
            )
        self.healthy = healthy
        return healthy

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval)
