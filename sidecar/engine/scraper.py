"""The vLLM ``/metrics`` scraper: one asyncio task that keeps the latest :class:`EngineSnapshot`.

This module owns the polling loop and its health state (``up``, ``last_error``, counters); the
parsing lives in :mod:`sidecar.engine.snapshot`. The loop never raises: a failed scrape keeps the
last good snapshot, whose growing :meth:`Scraper.age` is what callers treat as staleness.

Timing: a scrape starts every ``interval`` seconds on a fixed schedule (so sleep jitter does not
accumulate into drift). Scrapes never overlap: when one runs past its slot, the next starts right
after it and the schedule restarts from there, rather than firing a burst to catch up.

Timeout: by default ``max(interval, 2.0)`` seconds per scrape, one deadline over connect, send
and the whole body (an anyio cancel scope: httpx's own timeouts bound each phase separately).
vLLM serves /metrics from the same event loop as its API, which stalls for a while during large
prefills; a timeout as short as the interval would report vLLM down exactly when it is busiest.
A scrape that waits is not blind: the snapshot's age keeps growing meanwhile, and admission sees
it.

In the app's lifespan::

    scraper = Scraper(client, "http://127.0.0.1:8000/metrics", interval=0.5)
    scraper.start()
    ...
    await scraper.stop()
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import anyio
import httpx

from sidecar.engine.snapshot import EngineSnapshot, parse_vllm_metrics
from sidecar.errors import MetricsParseError, one_line

__all__ = ["DEFAULT_MIN_TIMEOUT_SECONDS", "Scraper", "SnapshotListener", "next_scrape_start"]

SnapshotListener = Callable[[EngineSnapshot], None]

#: Floor of the default per-scrape timeout (see the module docstring).
DEFAULT_MIN_TIMEOUT_SECONDS = 2.0

# Ask for the classic text format explicitly: a shared client's default Accept must not get us
# OpenMetrics, which prometheus_client's text parser does not read.
_ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"

logger = logging.getLogger("sidecar.engine.scraper")


class Scraper:
    """Polls vLLM's /metrics and keeps the latest good snapshot.

    ``clock`` stamps snapshots (``taken_at``) and measures :meth:`age`; it must be the clock the
    consumers compare against (``time.monotonic`` by default). The loop's own schedule runs on
    the event loop's clock, which is what ``asyncio.sleep`` honours.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        metrics_url: str,
        *,
        interval: float,
        timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._client = client
        self.metrics_url = metrics_url
        self.interval = interval
        self.timeout = (
            timeout if timeout is not None else max(interval, DEFAULT_MIN_TIMEOUT_SECONDS)
        )
        self._clock = clock

        self.latest: EngineSnapshot | None = None
        self.up = False
        self.last_error: str | None = None
        self.errors_total = 0
        self.scrapes_total = 0  # attempts, good or not

        self._listeners: list[SnapshotListener] = []
        self._failing_listeners: set[int] = set()  # ids, so each failure streak logs once
        self._task: asyncio.Task[None] | None = None
        # Serialises scrape_once calls so that `latest` never steps back in time when a caller
        # scrapes by hand while the loop runs.
        self._lock = asyncio.Lock()
        self._state_logged: bool | None = None  # the `up` value last logged; None: nothing yet
        self._down_since: float | None = None

    def add_listener(self, fn: SnapshotListener) -> None:
        """Call ``fn(snapshot)`` synchronously after each good scrape; it must not block."""
        self._listeners.append(fn)

    def age(self) -> float:
        """Seconds since the latest good snapshot was taken; ``math.inf`` before the first."""
        if self.latest is None:
            return math.inf
        return self.latest.age(self._clock())

    async def scrape_once(self) -> EngineSnapshot | None:
        """Scrape now; return the snapshot, or None when the scrape failed. Never raises."""
        async with self._lock:
            self.scrapes_total += 1
            try:
                # Not asyncio.wait_for: its extra task, cancelled in the middle of httpx's
                # connect (anyio 4.16, Python 3.11), can hang for good or leak tasks. A cancel
                # scope in this same task is what httpx itself is built for.
                with anyio.fail_after(self.timeout):
                    snapshot = await self._fetch()
            except TimeoutError:
                self._failed(f"timeout after {self.timeout:g} s")
                return None
            except _ScrapeFailed as exc:
                self._failed(str(exc))
                return None
            except Exception as exc:  # a bug here must not kill the loop: report it as a failure
                if self._state_logged is not False:  # a traceback once per failure streak
                    logger.exception("unexpected scrape failure")
                self._failed(one_line(f"unexpected error: {type(exc).__name__}: {exc}"))
                return None
            self._succeeded(snapshot)
            return snapshot

    def start(self) -> None:
        """Start the polling task in the running event loop; a no-op when already running."""
        if self._task is not None and not self._task.done():
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sidecar.scraper")

    async def stop(self) -> None:
        """Cancel the polling task and wait for it to end; safe to call any number of times."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # asyncio.wait never raises the task's CancelledError, yet still lets our own caller's
        # cancellation through.
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            logger.error("scraper task had failed", exc_info=task.exception())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scheduled = loop.time()
        while True:
            try:
                await self.scrape_once()
            except Exception:  # scrape_once does not raise; this is the last line of defence
                logger.exception("scraper iteration failed")
            now = loop.time()
            scheduled = next_scrape_start(scheduled, self.interval, now)
            await asyncio.sleep(scheduled - now)

    async def _fetch(self) -> EngineSnapshot:
        try:
            response = await self._client.get(
                self.metrics_url,
                headers={"Accept": _ACCEPT},
                timeout=self.timeout,
            )
        except httpx.TimeoutException as exc:
            raise TimeoutError from exc
        except httpx.ConnectError as exc:
            raise _ScrapeFailed(f"connect error: {_describe(exc)}") from exc
        except httpx.HTTPError as exc:
            raise _ScrapeFailed(f"http error: {_describe(exc)}") from exc
        if not response.is_success:
            raise _ScrapeFailed(f"HTTP {response.status_code}")
        # Prometheus text is UTF-8 by specification; do not let a missing charset guess.
        text = response.content.decode("utf-8", errors="replace")
        try:
            snapshot = parse_vllm_metrics(text, taken_at=self._clock())
        except MetricsParseError as exc:
            raise _ScrapeFailed(f"parse error: {exc}") from exc
        if not snapshot.has_cache_config:
            # Without it the pool size is unknown and kv_cache_usage_perc cannot be turned into
            # blocks: a snapshot that cannot bound admission is not a fresh one.
            raise _ScrapeFailed("no vllm:cache_config_info in the metrics: the KV pool is unknown")
        return snapshot

    def _succeeded(self, snapshot: EngineSnapshot) -> None:
        self.latest = snapshot
        self.up = True
        self.last_error = None
        if self._state_logged is not True:
            if self._down_since is None:
                logger.info("scraping vLLM metrics at %s", self.metrics_url)
            else:
                logger.info(
                    "vLLM metrics back after %.1f s down (%s)",
                    self._clock() - self._down_since,
                    self.metrics_url,
                )
            self._state_logged = True
            self._down_since = None
        for listener in list(self._listeners):
            self._notify(listener, snapshot)

    def _failed(self, error: str) -> None:
        self.up = False
        self.last_error = error
        self.errors_total += 1
        if self._state_logged is not False:
            logger.warning("vLLM metrics scrape failing (%s): %s", self.metrics_url, error)
            self._state_logged = False
            self._down_since = self._clock()
        else:
            logger.debug("vLLM metrics scrape failed again: %s", error)

    def _notify(self, listener: SnapshotListener, snapshot: EngineSnapshot) -> None:
        key = id(listener)
        try:
            listener(snapshot)
        except Exception:
            # One traceback per failure streak: a listener broken for good would otherwise log
            # twice a second.
            if key not in self._failing_listeners:
                self._failing_listeners.add(key)
                logger.exception("snapshot listener %r raised", listener)
            return
        if key in self._failing_listeners:
            self._failing_listeners.discard(key)
            logger.info("snapshot listener %r works again", listener)


def next_scrape_start(scheduled: float, interval: float, now: float) -> float:
    """When the scrape after the one ``scheduled`` to start then should start, at ``now``.

    On the grid ``scheduled + interval`` (a late wake-up does not push later scrapes), or right
    away when that is already past: an overrun restarts the grid instead of firing a burst.

    >>> next_scrape_start(10.0, 0.5, now=10.12), next_scrape_start(10.0, 0.5, now=10.9)
    (10.5, 10.9)
    """
    return max(scheduled + interval, now)


class _ScrapeFailed(Exception):
    """A scrape failed in an expected way; the message is the one-line ``last_error``."""


def _describe(exc: BaseException) -> str:
    return one_line(str(exc) or type(exc).__name__)
