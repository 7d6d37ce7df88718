"""What admission did per priority and tenant, counted with bounded labels for the exporter.

Priorities and tenants come from clients (a header, a body field): one label value each would let
a client grow the sidecar's series without bound. The first :data:`MAX_LABELS` priorities and the
first :data:`MAX_LABELS` tenants seen get a label of their own, for as long as the sidecar runs;
every later one is counted under ``other``. First seen, not most seen: a counter's series must
never go down, and a tenant that moved from ``other`` to its own label would take its past
counts out of ``other``. The empty tenant (a request with neither a tenant header nor an API
key) is labelled ``none``.

>>> stats = ClassStats(max_labels=2)  # priority 0 and the empty tenant are labelled from the start
>>> stats.decided(0, "a", "admit"); stats.decided(5, "b", "reject"); stats.decided(7, "", "admit")
>>> sorted(stats.decisions.items())
[(('0', 'a', 'admit'), 1), (('5', 'other', 'reject'), 1), (('other', 'none', 'admit'), 1)]
"""

from __future__ import annotations

#: priorities (and, apart, tenants) that get a label of their own; later ones are "other"
MAX_LABELS = 16
OTHER = "other"
NO_TENANT = "none"


class ClassStats:
    """Decisions and queue waits per (priority, tenant), labels bounded. Runs on the loop."""

    def __init__(self, *, max_labels: int = MAX_LABELS) -> None:
        self._max = max_labels
        self._priorities: dict[int, str] = {}
        self._tenants: dict[str, str] = {}
        #: (priority, tenant, decision) -> requests
        self.decisions: dict[tuple[str, str, str], int] = {}
        #: priority -> (seconds waited in the queue, requests that waited)
        self.waited: dict[str, tuple[float, int]] = {}
        self.priority_label(0)
        self.tenant_label("")

    def priority_label(self, priority: int) -> str:
        label = self._priorities.get(priority)
        if label is None:
            label = str(priority) if len(self._priorities) < self._max else OTHER
            if label != OTHER:
                self._priorities[priority] = label
        return label

    def tenant_label(self, tenant: str) -> str:
        label = self._tenants.get(tenant)
        if label is None:
            label = (tenant or NO_TENANT) if len(self._tenants) < self._max else OTHER
            if label != OTHER:
                self._tenants[tenant] = label
        return label

    def decided(self, priority: int, tenant: str, decision: str) -> None:
        key = (self.priority_label(priority), self.tenant_label(tenant), decision)
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def queue_waited(self, priority: int, seconds: float) -> None:
        label = self.priority_label(priority)
        total, count = self.waited.get(label, (0.0, 0))
        self.waited[label] = (total + seconds, count + 1)
