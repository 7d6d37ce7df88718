"""How late the sidecar's event loop runs: a timer due every ``interval`` seconds, and the lag
of each wake-up past its due time into a histogram (``kv_sidecar_event_loop_lag_seconds``).

Everything the sidecar does (admission decisions, the relay, scrapes, /metrics) runs on one
loop per process; a call that blocks it, or more work per turn than the CPU gives, delays every
request's next step by as much. That shows here first, before it shows as latency.

>>> import asyncio
>>> from prometheus_client import CollectorRegistry, Histogram
>>> h = Histogram("lag_seconds", "lag", registry=CollectorRegistry(), buckets=LAG_BUCKETS)
>>> async def main() -> float:
...     monitor = LoopLagMonitor(h, interval=0.01)
...     monitor.start()
...     await asyncio.sleep(0.05)
...     await monitor.stop()
...     return next(x.value for x in h.collect()[0].samples if x.name == "lag_seconds_count")
>>> asyncio.run(main()) >= 2
True
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import Histogram

#: the histogram's buckets, seconds: resolution where a loop is healthy (a few ms at most)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: seconds between two probes
INTERVAL = 0.1


class LoopLagMonitor:
    """Observes into ``histogram`` how late each of its timers fires."""

    def __init__(self, histogram: Histogram, *, interval: float = INTERVAL) -> None:
        self.histogram = histogram
        self.interval = interval
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

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self.histogram.observe(max(0.0, loop.time() - due))
