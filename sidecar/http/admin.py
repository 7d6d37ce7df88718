"""The admin API on the metrics port: read and change the runtime settings while serving.

``GET /admin/settings`` answers the values admission decides by; ``PATCH /admin/settings`` takes
a JSON object of any of them (``{"headroom": 0.1, "policy": "reject"}``), ``PUT /admin/settings``
one that names all five (``sidecar.admission.tuning.RUNTIME``). Off unless the sidecar runs with
``--admin`` (``KV_SIDECAR_ADMIN=true``): until then every admin request is answered 403
``admin_disabled``. With ``KV_SIDECAR_ADMIN_TOKEN`` set, a request must also carry
``Authorization: Bearer <token>`` (401 ``invalid_admin_token`` otherwise).

A change is checked whole by the flags' own constraints before any of it is made (400
``invalid_setting`` naming the setting and its flag, nothing changed), then made on the
controller at once: the next decision uses it, and the queued requests are re-judged where that
is what the setting means (``sidecar.admission.tuning``). Each setting changed is logged at
warning level (logger ``sidecar.admin``: the setting, the old and new values, the client's
address and user agent), counted in ``kv_sidecar_setting_changes_total{setting}``, and shown by
``kv_sidecar_setting{setting}``, ``kv_sidecar_config_info`` and ``/state``.

With relay workers (``--workers`` above 1) the metrics port is the owner's, where the one
admission controller is: a change applies once, for the whole pod.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import SecretStr

from sidecar.admission import tuning
from sidecar.admission.controller import AdmissionController
from sidecar.config import Policy
from sidecar.http.refusals import error_body
from sidecar.observability.refusals import RecentRefusals

log = logging.getLogger("sidecar.admin")

PATH = "/admin/settings"


def _plain(value: tuning.Value) -> float | int | str:
    return value.value if isinstance(value, Policy) else value


def _error(status: int, type_: str, code: str, message: str, param: str | None = None) -> Response:
    return Response(
        error_body(message, type_=type_, code=code, param=param),
        status_code=status,
        media_type="application/json",
    )


class Admin:
    """The runtime settings of one admission controller: their routes, log lines, metrics and
    their part of ``/state``."""

    def __init__(
        self,
        admission: AdmissionController,
        *,
        enabled: bool,
        token: SecretStr | None,
        config_labels: dict[str, str],
        refusals: RecentRefusals,
    ) -> None:
        self.admission = admission
        self.enabled = enabled
        self._token = token.get_secret_value().encode() if token is not None else None
        self.config_labels = config_labels  # kv_sidecar_config_info's labels, kept current
        self.refusals = refusals
        self.changes_total = dict.fromkeys(tuning.RUNTIME, 0)

    def settings(self) -> dict[str, float | int | str]:
        return {name: _plain(value) for name, value in tuning.current(self.admission).items()}

    def state(self) -> dict[str, Any]:
        """The fields ``/state`` adds: the settings, the queue's oldest wait, the refusals."""
        recent, seconds = self.refusals.recent()
        return {
            "settings": self.settings(),
            "admin_enabled": self.enabled,
            "queue_oldest_wait_seconds": tuning.oldest_wait(self.admission),
            "refusals_total": self.refusals.totals(),
            "refusals_recent": recent,
            "refusals_recent_seconds": round(seconds, 3),
        }

    # --- HTTP -----------------------------------------------------------------------------

    def add_routes(self, app: FastAPI) -> None:
        @app.get(PATH, tags=["admin"])
        async def get_settings(request: Request) -> Response:
            """The runtime settings admission decides by (403 unless ``--admin``)."""
            refused = self._refused(request)
            return refused or JSONResponse({"settings": self.settings()})

        @app.patch(PATH, tags=["admin"])
        async def patch_settings(request: Request) -> Response:
            """Change any of the runtime settings: a JSON object of new values."""
            return await self._change(request, every=False)

        @app.put(PATH, tags=["admin"])
        async def put_settings(request: Request) -> Response:
            """Set every runtime setting: a JSON object naming all five."""
            return await self._change(request, every=True)

    def _refused(self, request: Request) -> Response | None:
        if not self.enabled:
            return _error(
                403,
                "permission_error",
                "admin_disabled",
                "the admin API is off: start the sidecar with --admin (KV_SIDECAR_ADMIN=true) "
                "to change settings at runtime",
            )
        if self._token is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), self._token
            ):
                return _error(
                    401,
                    "authentication_error",
                    "invalid_admin_token",
                    "the admin API needs Authorization: Bearer <KV_SIDECAR_ADMIN_TOKEN>",
                )
        return None

    async def _change(self, request: Request, *, every: bool) -> Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return _error(400, "invalid_request_error", "invalid_json", f"not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(
                400,
                "invalid_request_error",
                "invalid_setting",
                'the body must be a JSON object of settings, e.g. {"headroom": 0.1}',
            )
        try:
            values = tuning.validate(body, every=every)
        except tuning.SettingError as exc:
            return _error(
                400, "invalid_request_error", "invalid_setting", exc.message, exc.name or None
            )
        changes = tuning.apply(self.admission, values)
        who = request.client.host if request.client is not None else "?"
        agent = request.headers.get("user-agent", "")[:200]
        for change in changes:
            old, new = _plain(change.old), _plain(change.new)
            self.changes_total[change.name] += 1
            if change.name in ("policy", "headroom"):
                self.config_labels[change.name] = str(new)
            log.warning(
                "setting %s changed at runtime: %s -> %s (by %s)",
                change.name,
                old,
                new,
                who,
                extra={
                    "fields": {
                        "setting": change.name,
                        "old": old,
                        "new": new,
                        "client": who,
                        "user_agent": agent,
                    }
                },
            )
        return JSONResponse(
            {
                "settings": self.settings(),
                "changed": [
                    {"name": c.name, "old": _plain(c.old), "new": _plain(c.new)} for c in changes
                ],
            }
        )


class SettingsCollector(Collector):
    """``kv_sidecar_setting{setting}`` (the numeric runtime settings now) and
    ``kv_sidecar_setting_changes_total{setting}``, at scrape time."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        values = GaugeMetricFamily(
            "kv_sidecar_setting",
            "The numeric runtime settings admission decides by now (headroom a share, the queue "
            "depth in requests, the waits in seconds); the policy is kv_sidecar_config_info's.",
            labels=["setting"],
        )
        for name, value in tuning.current(self.admin.admission).items():
            if not isinstance(value, Policy):
                values.add_metric([name], float(value))
        yield values
        changes = CounterMetricFamily(
            "kv_sidecar_setting_changes",
            "Runtime settings changed through the admin API (--admin), by setting.",
            labels=["setting"],
        )
        for name, count in self.admin.changes_total.items():
            changes.add_metric([name], count)
        yield changes
