"""``kv-sidecar status URL``: a running sidecar's state, for a person at a terminal.

:func:`fetch` reads ``/state`` and ``/readyz`` from the metrics port at ``URL``; :func:`render`
writes what they say in a few lines: readiness, the KV pool (capacity, the admission budget,
what vLLM holds, what the ledger predicts, what is committed and what is still free to promise),
the requests in flight, the queue (depth, oldest wait, its limits), the settings, the learned
answer lengths per request class, the decisions and the queue per priority and per tenant (once
a request has had a priority other than 0 or a tenant) and the refusals by reason (the last
minute, and since start).
A sidecar that cannot be reached, or that answers something other than JSON, is a
:class:`StatusError` (one line).

>>> state = {"capacity_blocks": 1000, "budget_blocks": 950, "actual_blocks": 400,
...          "predicted_blocks": 410, "committed_blocks": 600, "reserved_blocks": 700,
...          "in_flight": 4, "queue_depth": 0, "refusals_recent": {"queue_full": 2},
...          "refusals_recent_seconds": 60.0, "refusals_total": {"queue_full": 5}}
>>> print(render(state, {"ready": True}, "http://sc:9091"))  # doctest: +NORMALIZE_WHITESPACE
kv-sidecar at http://sc:9091: ready
pool      1,000 blocks; budget 950: 600 committed, 350 free to promise; vLLM holds 400, the
          ledger predicts 410
in flight 4 requests, 700 blocks reserved at their peaks
queue     empty
refused   in the last 60 s: queue_full 2; since start: queue_full 5

With priorities or tenants, the decisions and the queue of each:

>>> state = {**state, "class_decisions": {"0,chat,admit": 40, "10,batch,admit": 12,
...          "10,batch,reject": 3}, "class_queued": {"10,batch": 5},
...          "class_oldest_wait": {"10": 4.25}, "class_waited": {"10": [30.0, 12]}}
>>> print(render(state, {"ready": True}, "http://sc:9091"))
... # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
kv-sidecar at http://sc:9091: ready
...
priority  0: 40 admitted; 10: 12 admitted, 3 refused, 5 queued now (the oldest for 4.2 s),
          mean queue wait 2.5 s
tenants   chat: 40 admitted; batch: 12 admitted, 3 refused, 5 queued now
refused   in the last 60 s: queue_full 2; since start: queue_full 5
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class StatusError(Exception):
    """The sidecar could not be asked (one line)."""


def base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.startswith(("http://", "https://")):
        return url
    if not url or "://" in url:
        raise StatusError(f"URL must be the metrics port's http:// or https:// URL, got {url!r}")
    return "http://" + url


def fetch(url: str, *, timeout: float = 5.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """``/state`` and ``/readyz`` of the metrics port at ``url`` (``host:port`` is taken as
    ``http://host:port``)."""
    import httpx

    base = base_url(url)
    out: list[dict[str, Any]] = []
    with httpx.Client(timeout=timeout) as client:
        for path in ("/state", "/readyz"):
            try:
                resp = client.get(base + path)
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise StatusError(
                    f"cannot reach {base}{path}: {exc or type(exc).__name__}"
                ) from None
            if path == "/state" and resp.status_code != 200:
                raise StatusError(f"{base}{path} answered {resp.status_code}, not the state")
            try:
                body = resp.json()
            except ValueError:
                raise StatusError(
                    f"{base}{path} did not answer JSON (status {resp.status_code}): is {base} "
                    "the sidecar's metrics port (--metrics-port)?"
                ) from None
            if not isinstance(body, dict):
                raise StatusError(f"{base}{path} answered JSON that is not an object")
            out.append(body)
    return out[0], out[1]


def _n(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int | float) else "?"


def _by_reason(counts: Mapping[str, int]) -> str:
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{reason} {count:,}" for reason, count in ranked) or "none"


def _seconds(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, int | float) else "?"


def _split(key: str, parts: int) -> list[str] | None:
    """A class key of /state (``priority,tenant[,decision]``: a tenant has no comma); None
    when it is not one."""
    out = key.split(",")
    return out if len(out) == parts else None


def _class_rows(state: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Per priority (admitted, refused, queued now with the oldest wait, the mean queue wait)
    and per tenant (admitted, refused, queued now): shown once a request has had a priority
    other than 0 or a tenant."""
    decisions: Mapping[str, int] = state.get("class_decisions") or {}
    queued: Mapping[str, int] = state.get("class_queued") or {}
    oldest: Mapping[str, float] = state.get("class_oldest_wait") or {}
    waited: Mapping[str, Any] = state.get("class_waited") or {}
    by_priority: dict[str, dict[str, int]] = {}
    by_tenant: dict[str, dict[str, int]] = {}
    for key, count in decisions.items():
        split = _split(key, 3)
        if split is None:
            continue
        priority, tenant, decision = split
        for table, name in ((by_priority, priority), (by_tenant, tenant)):
            row = table.setdefault(name, {})
            row[decision] = row.get(decision, 0) + count
    for key, count in queued.items():
        split = _split(key, 2)
        if split is None:
            continue
        for table, name in ((by_priority, split[0]), (by_tenant, split[1])):
            row = table.setdefault(name, {})
            row["queued"] = row.get("queued", 0) + count
    if set(by_priority) <= {"0"} and set(by_tenant) <= {"none"}:
        return []

    def said(row: Mapping[str, int]) -> list[str]:
        parts = [f"{_n(row.get('admit', 0))} admitted"]
        if row.get("reject"):
            parts.append(f"{_n(row['reject'])} refused")
        if row.get("cancel"):
            parts.append(f"{_n(row['cancel'])} cancelled")
        if row.get("queued"):
            parts.append(f"{_n(row['queued'])} queued now")
        return parts

    def order(name: str) -> tuple[int, float, str]:
        try:
            return (0, float(name), name)
        except ValueError:
            return (1, 0.0, name)  # "other" after the numbers

    priorities = []
    for name in sorted(by_priority, key=order):
        parts = said(by_priority[name])
        if name in oldest and by_priority[name].get("queued"):
            parts[-1] += f" (the oldest for {_seconds(oldest[name])})"
        total_count = waited.get(name)
        if isinstance(total_count, list | tuple) and len(total_count) == 2 and total_count[1]:
            parts.append(f"mean queue wait {_seconds(total_count[0] / total_count[1])}")
        priorities.append(f"{name}: " + ", ".join(parts))
    tenants = [
        f"{name}: " + ", ".join(said(row))
        for name, row in sorted(by_tenant.items(), key=lambda kv: -kv[1].get("admit", 0))
    ]
    return [("priority", "; ".join(priorities)), ("tenants", "; ".join(tenants))]


def render(state: Mapping[str, Any], ready: Mapping[str, Any], url: str) -> str:
    """The state in lines of ``label  text``."""
    rows: list[tuple[str, str]] = []
    why = "ready" if ready.get("ready") else "NOT READY"
    if not ready.get("ready"):
        reasons = [k for k in ("draining",) if ready.get(k)]
        reasons += [k for k in ("discovered", "vllm_up", "vllm_healthy") if ready.get(k) is False]
        why += f" ({', '.join(f'not {r}' if r != 'draining' else r for r in reasons)})"
        if ready.get("last_error"):
            why += f": {ready['last_error']}"
    head = f"kv-sidecar at {url}: {why}"
    capacity, budget = state.get("capacity_blocks"), state.get("budget_blocks")
    committed = state.get("committed_blocks")
    if capacity is None:
        pool = "not known yet (vLLM not discovered or not scraped)"
    else:
        pool = f"{_n(capacity)} blocks"
        if isinstance(budget, int) and isinstance(committed, int):
            free = max(0, budget - committed)
            pool += f"; budget {_n(budget)}: {_n(committed)} committed, {_n(free)} free to promise"
        actual = state.get("actual_blocks")
        pool += f"; vLLM holds {_n(actual)}" if actual is not None else ""
        pool += f", the ledger predicts {_n(state.get('predicted_blocks'))}"
    rows.append(("pool", pool))
    rows.append(
        (
            "in flight",
            f"{_n(state.get('in_flight'))} requests, {_n(state.get('reserved_blocks'))} blocks "
            "reserved at their peaks",
        )
    )
    depth = state.get("queue_depth") or 0
    settings: Mapping[str, Any] = state.get("settings") or {}
    queue = "empty" if not depth else f"{_n(depth)} waiting"
    if depth and state.get("queue_oldest_wait_seconds") is not None:
        queue += f", the oldest for {_seconds(state['queue_oldest_wait_seconds'])}"
    if depth:
        queue += f", {_n(state.get('peak_blocks_queued'))} blocks at their peaks"
    if settings:
        queue += (
            f" (limits: {_n(settings.get('max_queue_depth'))} requests, "
            f"{_seconds(settings.get('max_queue_wait'))})"
        )
    rows.append(("queue", queue))
    if settings:
        said = ", ".join(f"{k} {v}" for k, v in settings.items() if k != "max_queue_depth")
        admin = "on" if state.get("admin_enabled") else "off"
        rows.append(("settings", f"{said}; admin API {admin}"))
    lengths: Mapping[str, int] = state.get("expected_output_tokens") or {}
    if lengths:
        listed = ", ".join(f"{k} {_n(v)}" for k, v in sorted(lengths.items()))
        rows.append(("lengths", f"output tokens reserved per sequence: {listed}"))
    rows.extend(_class_rows(state))
    if "refusals_total" in state:
        seconds = state.get("refusals_recent_seconds") or 0
        rows.append(
            (
                "refused",
                f"in the last {seconds:.0f} s: {_by_reason(state.get('refusals_recent') or {})}; "
                f"since start: {_by_reason(state['refusals_total'])}",
            )
        )
    width = max(len(label) for label, _ in rows)
    return "\n".join([head, *(f"{label:<{width}} {text}" for label, text in rows)])
