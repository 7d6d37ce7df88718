"""The committed Grafana dashboard (``grafana/build.py`` writes it) and its queries.

``dashboard_queries`` gives every panel's PromQL with the template variables substituted, for the
static checks (tests/test_grafana.py) and for the live test that evaluates every panel against a
real Prometheus (tests/test_prometheus_live.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from grafana import build

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(text: str, substitutions: dict[str, str]) -> str:
    """Replace Grafana variables (``$name`` or ``${name}``) whose name is in ``substitutions``.

    Keys may be spelt ``$name``, ``${name}`` or ``name``; unknown variables are left as they are.

    >>> substitute('x{pod=~"$pod"}[${__rate_interval}]', {"$pod": "p", "__rate_interval": "1m"})
    'x{pod=~"p"}[1m]'
    """
    values = {key.strip("${}"): value for key, value in substitutions.items()}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, match.group(0))

    return _VARIABLE.sub(replace, text)


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels (collapsed rows) included; rows themselves excluded."""
    for panel in panels:
        if panel.get("type") == "row":
            yield from iter_panels(panel.get("panels", []))
        else:
            yield panel


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(build.DASHBOARD_JSON.read_text(encoding="utf-8"))
    return dashboard


def dashboard_queries(substitutions: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of the committed dashboard, variables substituted.

    >>> dashboard_queries({"$pod": "p"})[0][0]
    'vLLM preemptions /s'
    """
    return [
        (panel["title"], substitute(target["expr"], substitutions))
        for panel in iter_panels(load_dashboard()["panels"])
        for target in panel.get("targets", [])
    ]
