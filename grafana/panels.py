"""Panel builders for the dashboard: a time series, a single number, a dial.

Thin wrappers over grafana-foundation-sdk's typed builders that give every panel of the dashboard
the same data source, legend, tooltip and look, so that ``dashboard.py`` only says what each
panel shows. A panel that is empty for a known reason says so (``no_data``) instead of Grafana's
"No data"; single numbers also map NaN (a ratio of nothing to nothing, a quantile of no
observations) to that text.

>>> panel = stat_panel("x", "d", "s", [Query("up")], [Step(None, "green")], no_data=NO_TRAFFIC)
>>> built = panel.build()
>>> built.field_config.defaults.no_value, built.field_config.defaults.mappings[0].options.match
('No traffic', <SpecialValueMatch.NA_N: 'nan'>)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import gauge, prometheus, stat, timeseries
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models

DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
REF_IDS = "ABCDEFGH"
#: What a panel over traffic-driven figures (rates, quantiles, ratios) shows without traffic.
NO_TRAFFIC = "No traffic"

PanelBuilder = timeseries.Panel | stat.Panel | gauge.Panel


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a panel and how its series are named in the legend."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Step:
    """A threshold: from ``value`` upwards (None: from -Inf) the colour is ``color``."""

    value: float | None
    color: str


def _targets(queries: Sequence[Query]) -> list[Builder[variants.Dataquery]]:
    if not 1 <= len(queries) <= len(REF_IDS):
        raise ValueError(f"a panel has 1 to {len(REF_IDS)} queries, not {len(queries)}")
    targets: list[Builder[variants.Dataquery]] = []
    for ref_id, query in zip(REF_IDS, queries, strict=False):
        target = (
            prometheus.Dataquery()
            .ref_id(ref_id)
            .datasource(DATASOURCE)
            .expr(query.expr)
            .legend_format(query.legend or "__auto")
        )
        targets.append(target.range())
    return targets


def _thresholds(steps: Sequence[Step]) -> dashboard_builders.ThresholdsConfig:
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
        .steps([dashboard_models.Threshold(value=s.value, color=s.color) for s in steps])
    )


def _nan_as(text: str) -> list[dashboard_models.ValueMapping]:
    """A value mapping showing ``text`` where the value is NaN."""
    return [
        dashboard_models.SpecialValueMap(
            options=dashboard_models.DashboardSpecialValueMapOptions(
                match=dashboard_models.SpecialValueMatch.NA_N,
                result=dashboard_models.ValueMappingResult(text=text, index=0),
            )
        )
    ]


def _fixed_color(color: str) -> list[dashboard_models.DynamicConfigValue]:
    return [
        dashboard_models.DynamicConfigValue(
            id_val="color", value={"mode": "fixed", "fixedColor": color}
        )
    ]


def timeseries_panel(
    title: str,
    description: str,
    unit: str,
    queries: Sequence[Query],
    *,
    width: int = 8,
    height: int = 8,
    stacked: bool = False,
    threshold_line: float | None = None,
    min_value: float | None = None,
    max_value: float | None = None,
    dashed: str | None = None,
    colors: Mapping[str, str] | None = None,
    no_data: str | None = None,
) -> timeseries.Panel:
    """A time series panel; ``dashed`` is a regex of series names drawn dashed (limits),
    ``colors`` fixes the colour of the series whose names match each regex; ``no_data``
    replaces Grafana's "No data" where an empty panel has a known reason."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_targets(queries))
        .unit(unit)
        .span(width)
        .height(height)
        .line_width(1)
        .fill_opacity(25 if stacked else 0)
        .show_points(common.VisibilityMode.NEVER)
        .legend(
            common_builders.VizLegendOptions()
            .show_legend(True)
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
        )
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
    )
    if stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
    if threshold_line is not None:
        panel = panel.thresholds(
            _thresholds([Step(None, "transparent"), Step(threshold_line, "red")])
        ).thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(
                common.GraphThresholdsStyleMode.DASHED
            )
        )
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    if dashed is not None:
        panel = panel.override_by_regexp(
            dashed,
            [
                dashboard_models.DynamicConfigValue(
                    id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}
                )
            ],
        )
    for regexp, color in (colors or {}).items():
        panel = panel.override_by_regexp(regexp, _fixed_color(color))
    if no_data is not None:
        panel = panel.no_value(no_data)
    return panel


def stat_panel(
    title: str,
    description: str,
    unit: str,
    queries: Sequence[Query],
    steps: Sequence[Step],
    *,
    decimals: int = 2,
    width: int = 4,
    height: int = 5,
    colors: Mapping[str, str] | None = None,
    no_data: str | None = None,
) -> stat.Panel:
    """Single numbers coloured by ``steps`` (one per series), with their recent trend behind;
    ``colors`` fixes the colour of the series whose names match each regex instead; with
    ``no_data``, an empty panel and a NaN value read as that text."""
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_targets(queries))
        .unit(unit)
        .decimals(decimals)
        .span(width)
        .height(height)
        .thresholds(_thresholds(steps))
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.AREA)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
    )
    for regexp, color in (colors or {}).items():
        panel = panel.override_by_regexp(regexp, _fixed_color(color))
    if no_data is not None:
        panel = panel.no_value(no_data).mappings(_nan_as(no_data))
    return panel


def gauge_panel(
    title: str,
    description: str,
    unit: str,
    query: Query,
    steps: Sequence[Step],
    *,
    min_value: float,
    max_value: float,
    no_data: str | None = None,
) -> gauge.Panel:
    """A dial for a figure whose distance from zero matters in both directions."""
    panel = (
        gauge.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_targets([query]))
        .unit(unit)
        .decimals(1)
        .min(min_value)
        .max(max_value)
        .span(4)
        .height(5)
        .thresholds(_thresholds(steps))
        .show_threshold_markers(True)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
    )
    if no_data is not None:
        panel = panel.no_value(no_data).mappings(_nan_as(no_data))
    return panel
