"""Each tenant's use of the KV cache: what the queue's fair share orders by, and its cap.

A tenant's use is the block-seconds its admitted requests have reserved, decayed with a
half-life of :data:`HALF_LIFE_SECONDS` (so that a burst an hour ago does not count against it
now), plus what it holds at this moment over :data:`HOLD_HORIZON_SECONDS` (so that requests
admitted in the same instant count at once). Divided by the tenant's share
(``--tenant-shares``, 1 unless named), the lowest is served first inside a priority. That is
the KV cache's own currency: a tenant with few long requests and one with many short ones are
weighed by the KV they take, not by how many requests they send.

A tenant whose reservations hold ``--tenant-max-share`` of the budget or more is capped: its
requests wait (or are refused under ``--policy reject``) until it frees blocks, while others'
go ahead.

>>> t = [0.0]
>>> usage = TenantUsage(clock=lambda: t[0], shares={"batch": 1.0, "chat": 2.0})
>>> usage.hold("batch", 100); usage.hold("chat", 100)
>>> t[0] = 10.0
>>> round(usage.score("batch")), round(usage.score("chat"))
(1044, 522)
>>> usage.free("batch", 100)
>>> t[0] = 10.0 + HALF_LIFE_SECONDS
>>> round(usage.score("batch"))
472
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from sidecar.admission.ask import Ask

#: the half-life of a tenant's past use, in seconds
HALF_LIFE_SECONDS = 60.0
#: what a tenant holds now counts as held this much longer
HOLD_HORIZON_SECONDS = 1.0
_DECAY = math.log(2) / HALF_LIFE_SECONDS
_PRUNE_EVERY = 1024


class TenantUsage:
    """The tenants' use of the KV cache, in decayed block-seconds. Runs on the event loop."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        shares: Mapping[str, float] | None = None,
        max_share: float = 1.0,
        budget: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._clock = clock
        self.shares = dict(shares or {})
        self.max_share = max_share
        self._budget = budget
        self._held: dict[str, int] = {}
        self._used: dict[str, tuple[float, float]] = {}  # tenant -> (block-seconds, as of)
        self._holds = 0

    def share(self, tenant: str) -> float:
        return self.shares.get(tenant, 1.0)

    def held(self, tenant: str) -> int:
        """The blocks the tenant's admitted requests reserve now."""
        return self._held.get(tenant, 0)

    def _used_now(self, tenant: str, now: float) -> float:
        used, at = self._used.get(tenant, (0.0, now))
        held = self._held.get(tenant, 0)
        dt = max(0.0, now - at)
        if dt == 0:
            return used
        # d(used)/dt = held - k * used, exactly over dt
        decay = math.exp(-_DECAY * dt)
        return used * decay + held * (1.0 - decay) / _DECAY

    def _settle(self, tenant: str) -> None:
        now = self._clock()
        self._used[tenant] = (self._used_now(tenant, now), now)

    def hold(self, tenant: str, blocks: int) -> None:
        """A request of the tenant was admitted with ``blocks`` reserved."""
        self._settle(tenant)
        self._held[tenant] = self._held.get(tenant, 0) + blocks
        self._holds += 1
        if self._holds % _PRUNE_EVERY == 0:
            self._prune()

    def _prune(self) -> None:
        """Forget the tenants that hold nothing and whose past use has decayed away (a client
        that names a new tenant on every request must not grow this without bound)."""
        now = self._clock()
        for tenant in [t for t in self._used if t not in self._held]:
            if self._used_now(tenant, now) < 1.0:
                del self._used[tenant]

    def free(self, tenant: str, blocks: int) -> None:
        """A request of the tenant that reserved ``blocks`` is over."""
        self._settle(tenant)
        left = self._held.get(tenant, 0) - blocks
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)

    def score(self, tenant: str) -> float:
        """The tenant's use against its share: the lowest is served first."""
        used = self._used_now(tenant, self._clock())
        return (used + self._held.get(tenant, 0) * HOLD_HORIZON_SECONDS) / self.share(tenant)

    def cap_blocks(self) -> int | None:
        """The most blocks one tenant may reserve (None: no cap, or no budget known yet)."""
        if self.max_share >= 1.0:
            return None
        budget = self._budget()
        return None if budget is None else max(1, int(budget * self.max_share))

    def capped(self, tenant: str, ask: Ask | None = None) -> bool:
        """Whether the tenant holds its cap or more (its next request waits)."""
        cap = self.cap_blocks()
        return cap is not None and self._held.get(tenant, 0) >= cap

    def tenants(self) -> list[str]:
        """The tenants with a use, held or past."""
        return sorted(set(self._held) | set(self._used))
