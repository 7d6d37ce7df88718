"""The admission settings that may change while the sidecar serves, and what a change does.

Five settings are read afresh at every decision and hold no state that a new value would
invalidate: ``headroom``, ``max_queue_depth``, ``max_queue_wait``, ``spill_wait`` and ``policy``
(:data:`RUNTIME`). :func:`validate` checks a change by the same constraints as the flags
(``sidecar.config.Settings``), all of it or none; :func:`apply` sets the new values on the
controller and re-judges the requests already queued where that is what the setting means:

- ``headroom``: the head of the queue is tried again (a smaller headroom may let it in now);
- ``max_queue_depth`` lowered below the queue: the requests beyond it leave with 429
  ``queue_full``, the first to shed first (``WaitQueue.shed_order``: the worst priority, the
  tenant most over its share, the newest);
- ``max_queue_wait``: every queued request's wait ends at its arrival plus the new value (at once
  for one that has waited longer, with 429 ``queue_timeout``);
- ``policy`` ``reject``: the queued requests leave with 429 ``kv_cache_full``, as a request that
  does not fit does under it; ``observe``: they are forwarded at once; ``queue`` and ``spill``:
  they keep waiting; under ``spill``, with a new ``spill_wait`` too, the queued requests but the
  next to be admitted are judged again when the queue is tried (at the end of :func:`apply`
  too), and one whose expected wait is over half again ``spill_wait`` leaves with 429 (or
  ``--spill-status``) ``spilled`` (``sidecar.admission.spill.hand_back``).

>>> validate({"headroom": "0.1", "policy": "reject"})
{'headroom': 0.1, 'policy': <Policy.reject: 'reject'>}
>>> validate({"headroom": 1.5})
Traceback (most recent call last):
...
sidecar.admission.tuning.SettingError: headroom (--headroom): Input should be less than 1, got 1.5
>>> validate({"port": 1}).keys()
Traceback (most recent call last):
...
sidecar.admission.tuning.SettingError: port (--port) cannot change at runtime: restart the sidecar
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from sidecar.admission.controller import AdmissionController
from sidecar.admission.decisions import Reason
from sidecar.config import Policy, Settings, names_of

#: the settings a running sidecar takes, in the order /state and the CLI show them
RUNTIME = ("headroom", "max_queue_depth", "max_queue_wait", "spill_wait", "policy")

Value = float | int | Policy


class SettingError(ValueError):
    """A change that cannot be made: the setting it names, and why (one line)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message


@dataclass(frozen=True, slots=True)
class Change:
    """One setting changed: its value before and after."""

    name: str
    old: Value
    new: Value


@cache
def _adapter(name: str) -> TypeAdapter[Any]:
    info = Settings.model_fields[name]
    # the field's own constraints (ge, lt, ...) ride on its FieldInfo
    return TypeAdapter(Annotated[info.annotation, info])  # type: ignore[arg-type]


def _said(name: str) -> str:
    return f"{name} ({names_of(name)[0]})"


def validate(changes: Mapping[str, object], *, every: bool = False) -> dict[str, Value]:
    """The new values, checked as the flags are; ``every``: each of :data:`RUNTIME` must be
    given (a PUT). Raises :class:`SettingError` on the first that cannot be taken."""
    if not changes:
        raise SettingError("", f"no setting given: the runtime settings are {', '.join(RUNTIME)}")
    out: dict[str, Value] = {}
    for name, value in changes.items():
        if name not in RUNTIME:
            if name in Settings.model_fields:
                raise SettingError(
                    name, f"{_said(name)} cannot change at runtime: restart the sidecar"
                )
            raise SettingError(
                name, f"no such setting {name!r}: the runtime settings are {', '.join(RUNTIME)}"
            )
        if name != "policy" and (
            isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value))
        ):
            raise SettingError(
                name, f"{_said(name)}: Input should be a finite number, got {value!r}"
            )
        try:
            out[name] = _adapter(name).validate_python(value)
        except ValidationError as exc:
            said = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
            raise SettingError(name, f"{_said(name)}: {said}, got {value!r}") from None
    missing = [name for name in RUNTIME if name not in out]
    if every and missing:
        raise SettingError(
            missing[0], f"a PUT names every runtime setting; missing: {', '.join(missing)}"
        )
    return out


def current(admission: AdmissionController) -> dict[str, Value]:
    """The values the controller decides by now."""
    return {name: getattr(admission, name) for name in RUNTIME}


def apply(admission: AdmissionController, values: Mapping[str, Value]) -> list[Change]:
    """Set ``values`` (from :func:`validate`) and re-judge the queue; the changes made (a value
    equal to the current one is no change). Runs on the controller's event loop."""
    before = current(admission)
    changes = [Change(n, before[n], v) for n, v in values.items() if before[n] != v]
    for change in changes:
        setattr(admission, change.name, change.new)
    changed = {change.name for change in changes}
    queue = admission.queue
    if "max_queue_depth" in changed:
        depth = admission.max_queue_depth
        shed_first = queue.shed_order()
        for waiter in shed_first[: max(0, len(shed_first) - depth)]:
            queue.shed(
                waiter,
                Reason.QUEUE_FULL,
                f"the admission queue was shortened to {depth} (--max-queue-depth changed at "
                "runtime); retry later",
            )
    waiting = queue.waiting()
    if "max_queue_wait" in changed:
        loop, now = asyncio.get_running_loop(), admission._clock()
        for waiter in waiting:
            waiter.timer.cancel()
            left = max(0.0, waiter.enqueued_at + admission.max_queue_wait - now)
            waiter.timer = loop.call_later(left, waiter.future.cancel)
    if "policy" in changed and admission.policy is Policy.reject:
        for waiter in waiting:
            queue.shed(
                waiter,
                Reason.KV_CACHE_FULL,
                "the KV cache is full and the policy is now reject (changed at runtime); "
                "retry later",
            )
    elif "policy" in changed and admission.policy is Policy.observe:
        for waiter in waiting:  # a dry run gates nothing: what waits goes now
            decision = admission.try_admit(waiter.ask)
            if decision is not None and decision.reservation is not None:
                waiter.future.set_result(decision.reservation)
    admission.pump()
    return changes


def oldest_wait(admission: AdmissionController) -> float | None:
    """Seconds the longest-waiting queued request has waited (None: the queue is empty)."""
    oldest = admission.queue.oldest()
    return admission._clock() - oldest.enqueued_at if oldest is not None else None
