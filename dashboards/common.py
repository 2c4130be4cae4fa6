"""Shared building blocks for the timwatch dashboards.

Every panel goes through :func:`timeseries`, :func:`bar_gauge`, :func:`stat` or
:func:`heatmap_panel` so that the invariants the tests check (a datasource, a unit, a
"Healthy: ..." description, PromQL targets with legends) hold by construction rather than by
review.  PromQL is written with the helpers below so that the additive forms of
docs/reference/prometheus.md — ``sum by (run)`` over ``rate()`` of the exported sums and counts —
stay exact across sidecars.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import count

from grafana_foundation_sdk.builders import bargauge as bargauge_b
from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import heatmap as heatmap_b
from grafana_foundation_sdk.builders import prometheus as prometheus_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dashboard_m
from grafana_foundation_sdk.models import heatmap as heatmap_m
from grafana_foundation_sdk.models import prometheus as prometheus_m

__all__ = [
    "DATASOURCE",
    "DATASOURCE_UID",
    "RUN",
    "Target",
    "IdAllocator",
    "bar_gauge",
    "base_dashboard",
    "heatmap_panel",
    "mask_ratio_window",
    "query_targets",
    "rate_sum",
    "ratio_of_rates",
    "stat",
    "timeseries",
]

#: uid of the Prometheus datasource that deploy/grafana provisions; the ``datasource`` template
#: variable defaults to it, so provisioned dashboards work without picking a datasource first.
DATASOURCE_UID = "prometheus"
DATASOURCE = dashboard_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
#: Label matcher every query carries; ``$run`` is a multi-value variable rendered as a regex.
RUN = 'run=~"$run"'
RATE = "[$__rate_interval]"

# (expr, legend) or (expr, legend, instant)
Target = tuple[str, str] | tuple[str, str, bool]


class IdAllocator:
    """Hands out panel ids in order; Grafana needs them unique within a dashboard."""

    def __init__(self) -> None:
        self._ids: Iterator[int] = count(1)

    def next(self) -> int:
        return next(self._ids)


def rate_sum(metric: str, by: str = "run", matchers: str = "") -> str:
    """``sum by (<by>) (rate(metric{run=~"$run",...}[$__rate_interval]))``."""
    sel = RUN + (f", {matchers}" if matchers else "")
    return f"sum by ({by}) (rate({metric}{{{sel}}}{RATE}))"


def ratio_of_rates(num: str, den: str) -> str:
    """Window mean Σx/N from additive ``_sum``/``_count`` (or counter) series, per run."""
    return f"{rate_sum(num)} / {rate_sum(den)}"


def mask_ratio_window(policies: str | None = None) -> str:
    """Share of masked tokens each policy rejects over the window, per run and policy."""
    matchers = f'policy=~"{policies}"' if policies else ""
    masked = rate_sum("timwatch_masked_tokens_total", by="run, policy", matchers=matchers)
    return f"{masked} / on (run) group_left {rate_sum('timwatch_tokens_total')}"


def base_dashboard(title: str, uid: str, description: str) -> dashboard_b.Dashboard:
    """A dashboard with the ``datasource`` and ``run`` variables every timwatch board uses."""
    return (
        dashboard_b.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["timwatch"])
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .tooltip(dashboard_m.DashboardCursorSync.CROSSHAIR)
        .link(
            dashboard_b.DashboardLink("timwatch dashboards")
            .type(dashboard_m.DashboardLinkType.DASHBOARDS)
            .tags(["timwatch"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .with_variable(
            dashboard_b.DatasourceVariable("datasource")
            .label("Data source")
            .type("prometheus")
            .current(
                dashboard_m.VariableOption(text="Prometheus", value=DATASOURCE_UID, selected=True)
            )
        )
        .with_variable(
            dashboard_b.QueryVariable("run")
            .label("Run")
            .description("timwatch run id (the `run` label)")
            .datasource(DATASOURCE)
            .query("label_values(timwatch_tokens_total, run)")
            .refresh(dashboard_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dashboard_m.VariableSort.ALPHABETICAL_CASE_INSENSITIVE_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(dashboard_m.VariableOption(text=["All"], value=["$__all"], selected=True))
        )
    )


def query_targets(
    targets: Sequence[Target], fmt: prometheus_m.PromQueryFormat | None = None
) -> list:
    built = []
    for i, target in enumerate(targets):
        expr, legend = target[0], target[1]
        instant = len(target) > 2 and bool(target[2])
        q = (
            prometheus_b.Dataquery()
            .ref_id(chr(ord("A") + i))
            .datasource(DATASOURCE)
            .expr(expr)
            .legend_format(legend)
        )
        q = q.instant() if instant else q.range()
        if fmt is not None:
            q = q.format(fmt)
        built.append(q)
    return built


def timeseries(
    ids: IdAllocator,
    title: str,
    description: str,
    unit: str,
    targets: Sequence[Target],
    *,
    width: int = 12,
    height: int = 8,
    log_scale: bool = False,
    min_val: float | None = None,
) -> timeseries_b.Panel:
    """A line chart with a table legend showing last and max, the values people compare."""
    panel = (
        timeseries_b.Panel()
        .id(ids.next())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .targets(query_targets(targets))
        .line_width(1)
        .fill_opacity(5)
        .legend(
            common_b.VizLegendOptions()
            .display_mode(common_m.LegendDisplayMode.TABLE)
            .placement(common_m.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
            .sort_by("Last *")
            .sort_desc(True)
        )
        .tooltip(
            common_b.VizTooltipOptions()
            .mode(common_m.TooltipDisplayMode.MULTI)
            .sort(common_m.SortOrder.DESCENDING)
        )
    )
    if log_scale:
        panel = panel.scale_distribution(
            common_b.ScaleDistributionConfig().type(common_m.ScaleDistribution.LOG).log(10)
        )
    if min_val is not None:
        panel = panel.min(min_val)
    return panel


def bar_gauge(
    ids: IdAllocator,
    title: str,
    description: str,
    unit: str,
    targets: Sequence[Target],
    *,
    width: int = 12,
    height: int = 8,
    max_val: float | None = None,
) -> bargauge_b.Panel:
    """Horizontal bars, one per series, in query order (queries use ``sort_desc``)."""
    panel = (
        bargauge_b.Panel()
        .id(ids.next())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .targets(query_targets(targets))
        .orientation(common_m.VizOrientation.HORIZONTAL)
        .display_mode(common_m.BarGaugeDisplayMode.GRADIENT)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .min(0)
    )
    if max_val is not None:
        panel = panel.max(max_val)
    return panel


def stat(
    ids: IdAllocator,
    title: str,
    description: str,
    unit: str,
    targets: Sequence[Target],
    *,
    width: int = 6,
    height: int = 4,
) -> stat_b.Panel:
    """A single big number with a sparkline."""
    return (
        stat_b.Panel()
        .id(ids.next())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .targets(query_targets(targets))
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(common_m.BigValueGraphMode.AREA)
    )


def heatmap_panel(
    ids: IdAllocator,
    title: str,
    description: str,
    unit: str,
    expr: str,
    *,
    width: int = 24,
    height: int = 10,
) -> heatmap_b.Panel:
    """A heatmap of a Prometheus histogram's buckets (Grafana de-cumulates ``le`` buckets)."""
    return (
        heatmap_b.Panel()
        .id(ids.next())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .targets(query_targets([(expr, "{{le}}")], fmt=prometheus_m.PromQueryFormat.HEATMAP))
        .calculate(False)
        .rows_frame(heatmap_b.RowsHeatmapOptions().layout(common_m.HeatmapCellLayout.LE))
        .y_axis(heatmap_b.YAxisConfig().unit(unit).decimals(3))
        .cell_values(heatmap_b.CellValues().unit("short"))
        .color(
            heatmap_b.HeatmapColorOptions()
            .mode(heatmap_m.HeatmapColorMode.SCHEME)
            .scheme("Oranges")
            .scale(heatmap_m.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .steps(64)
            .fill("dark-orange")
        )
        .show_value(common_m.VisibilityMode.NEVER)
        .mode(common_m.TooltipDisplayMode.SINGLE)
        .show_y_histogram()
    )
