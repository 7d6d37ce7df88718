"""Refusals by reason: since the sidecar started, and in the last minute, for ``/state``.

Read from ``kv_sidecar_requests_total{decision="reject"}`` (the counter every refusal is counted
on, in this process or, with relay workers, by the owner from their reports), never counted twice.
The recent figures are differences of the totals against a sample about a minute old:
:meth:`RecentRefusals.sample` keeps one sample a second for the last 60 s (it is called after
every scrape of vLLM and on every read of ``/state``), so the window reported is 60 s, a little
more when no sample was taken for a while, less in the sidecar's first minute.

>>> from prometheus_client import CollectorRegistry, Counter
>>> requests = Counter("r", "", ["decision", "reason"], registry=CollectorRegistry())
>>> t = [0.0]
>>> recent = RecentRefusals(requests, clock=lambda: t[0])
>>> recent.sample()
>>> requests.labels("reject", "queue_full").inc(3)
>>> requests.labels("admit", "fits").inc()
>>> t[0] = 61.0
>>> recent.sample()
>>> requests.labels("reject", "kv_cache_full").inc()
>>> t[0] = 121.5
>>> recent.totals()
{'kv_cache_full': 1, 'queue_full': 3}
>>> recent.recent()
({'kv_cache_full': 1}, 60.5)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import Counter

#: seconds the recent figures cover
WINDOW = 60.0
#: seconds between two samples kept
EVERY = 1.0


class RecentRefusals:
    """The refusals counted on ``requests`` (``kv_sidecar_requests``), by reason."""

    def __init__(self, requests: Counter, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.requests = requests
        self.clock = clock
        self._samples: deque[tuple[float, dict[str, int]]] = deque()

    def totals(self) -> dict[str, int]:
        """Refusals since the sidecar started, by reason (reasons never refused left out)."""
        out: dict[str, int] = {}
        for family in self.requests.collect():
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("decision") == "reject" and s.value:
                    out[s.labels["reason"]] = out.get(s.labels["reason"], 0) + int(s.value)
        return dict(sorted(out.items()))

    def sample(self) -> None:
        """Keep the totals now, if the last sample kept is a second old; forget the samples
        that a newer one at least :data:`WINDOW` old makes useless."""
        now = self.clock()
        if self._samples and now - self._samples[-1][0] < EVERY:
            return
        self._samples.append((now, self.totals()))
        while len(self._samples) > 1 and now - self._samples[1][0] >= WINDOW:
            self._samples.popleft()

    def recent(self) -> tuple[dict[str, int], float]:
        """Refusals by reason since the oldest sample kept, and the seconds that covers."""
        self.sample()
        now = self.clock()
        totals = self.totals()
        then, before = self._samples[0]
        out = {r: n - before.get(r, 0) for r, n in totals.items() if n > before.get(r, 0)}
        return out, now - then
