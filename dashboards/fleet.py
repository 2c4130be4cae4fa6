"""*timwatch — Fleet*: all runs side by side, worst mismatch first.

The table merges one instant query per column on the ``run`` label, so every column must be
aggregated ``by (run)`` only; the bar gauges rely on ``sort_desc`` for their order.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import table as table_b
from grafana_foundation_sdk.models import dashboard as dashboard_m
from grafana_foundation_sdk.models import prometheus as prometheus_m

from .common import (
    DATASOURCE,
    RUN,
    IdAllocator,
    bar_gauge,
    base_dashboard,
    query_targets,
    rate_sum,
    stat,
    timeseries,
)
from .run_overview import (
    IS_STD_WINDOW,
    KL_WINDOW,
    LAG_MAX_WINDOW,
    TOKEN_ID_DRIFT_WINDOW,
)

__all__ = ["UID", "build"]

UID = "timwatch-fleet"

_MASKED = rate_sum("timwatch_masked_tokens_total", matchers='policy=~"$policy"')
MASK_WINDOW = f"{_MASKED} / {rate_sum('timwatch_tokens_total')}"
TOKENS_RATE = rate_sum("timwatch_tokens_total")

# (column name, expr, unit) — the order is the table's column order.
COLUMNS: list[tuple[str, str, str]] = [
    ("Mismatch KL", KL_WINDOW, "sci"),
    ("Mask ratio", MASK_WINDOW, "percentunit"),
    ("IS-ratio std", IS_STD_WINDOW, "none"),
    ("Version lag max", LAG_MAX_WINDOW, "short"),
    ("Token-id drift", TOKEN_ID_DRIFT_WINDOW, "percentunit"),
    ("Tokens/s", TOKENS_RATE, "ops"),
    ("Step", f"max by (run) (timwatch_step{{{RUN}}})", "none"),
    (
        "Since last batch",
        f"time() - max by (run) (timwatch_last_batch_timestamp_seconds{{{RUN}}})",
        "s",
    ),
]


def _policy_variable() -> dashboard_b.QueryVariable:
    return (
        dashboard_b.QueryVariable("policy")
        .label("Mask policy")
        .description("policy whose mask ratio the fleet panels compare")
        .datasource(DATASOURCE)
        .query("label_values(timwatch_masked_tokens_total, policy)")
        .refresh(dashboard_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_m.VariableSort.ALPHABETICAL_ASC)
        .current(dashboard_m.VariableOption(text="estr", value="estr", selected=True))
    )


def _kl_cell_overrides() -> list[dashboard_m.DynamicConfigValue]:
    steps = [
        {"color": "green", "value": None},
        {"color": "orange", "value": 1e-3},
        {"color": "red", "value": 2e-2},
    ]
    return [
        dashboard_m.DynamicConfigValue("thresholds", {"mode": "absolute", "steps": steps}),
        dashboard_m.DynamicConfigValue("custom.cellOptions", {"type": "color-background"}),
    ]


def _fleet_table(ids: IdAllocator) -> table_b.Panel:
    targets = [(expr, name, True) for name, expr, _ in COLUMNS]
    rename = {f"Value #{chr(ord('A') + i)}": name for i, (name, _, _) in enumerate(COLUMNS)}
    panel = (
        table_b.Panel()
        .id(ids.next())
        .title("Runs, worst mismatch first")
        .description(
            "One row per run, sorted by window mismatch KL. Healthy: every KL cell green "
            "(< 1e-3), mask ratio < 1%, token-id drift 0, last batch seconds ago."
        )
        .datasource(DATASOURCE)
        .unit("none")
        .span(24)
        .height(10)
        .targets(query_targets(targets, fmt=prometheus_m.PromQueryFormat.TABLE))
        .with_transformation(dashboard_m.DataTransformerConfig("merge", options={}))
        .with_transformation(
            dashboard_m.DataTransformerConfig(
                "organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": rename,
                    "indexByName": {"run": 0} | {key: i + 1 for i, key in enumerate(rename)},
                },
            )
        )
        .with_transformation(
            dashboard_m.DataTransformerConfig(
                "sortBy", options={"sort": [{"field": "Mismatch KL", "desc": True}]}
            )
        )
        .sort_by([common_b.TableSortByFieldState().display_name("Mismatch KL").desc(True)])
        .show_header(True)
    )
    for name, _, unit in COLUMNS:
        props = [dashboard_m.DynamicConfigValue("unit", unit)]
        if "KL" in name:
            props += _kl_cell_overrides()
        panel = panel.override_by_name(name, props)
    return panel


def build() -> dashboard_b.Dashboard:
    ids = IdAllocator()
    return (
        base_dashboard(
            "timwatch — Fleet",
            UID,
            "All runs side by side, worst train–inference mismatch first.",
        )
        .with_variable(_policy_variable())
        .with_panel(
            stat(
                ids,
                "Runs reporting",
                "Runs with a live exposition (idle runs leave after the TTL). Healthy: equals "
                "the number of RL runs you expect to be training.",
                "short",
                [(f"count(max by (run) (timwatch_step{{{RUN}}}))", "runs")],
                width=6,
                height=8,
            )
        )
        .with_panel(
            bar_gauge(
                ids,
                "Mismatch KL by run (worst first)",
                "Window mean k3 KL per run, largest first. Healthy: every bar < 1e-3 for bf16; "
                "a run above 2e-2 is off-policy (TimwatchMismatchKLHigh).",
                "sci",
                [(f"sort_desc({KL_WINDOW})", "{{run}}", True)],
                width=9,
            )
        )
        .with_panel(
            bar_gauge(
                ids,
                "Mask ratio by run (worst first)",
                "Window share of tokens the selected policy rejects, per run, largest first. "
                "Healthy: < 1% for estr and icepop.",
                "percentunit",
                [(f"sort_desc({MASK_WINDOW})", "{{run}}", True)],
                width=9,
                max_val=1,
            )
        )
        .with_panel(_fleet_table(ids))
        .with_panel(
            timeseries(
                ids,
                "Mismatch KL, all runs",
                "Window mean k3 KL per run over time. Healthy: flat lines < 1e-3; a line "
                "bending upward is the collapse precursor the alerts watch for.",
                "sci",
                [(KL_WINDOW, "{{run}}")],
                width=24,
                log_scale=True,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Mask ratio per run ($policy)",
                "Window share of tokens the selected policy rejects, per run. Healthy: < 1% "
                "and flat; a rise mirrors growing mismatch.",
                "percentunit",
                [(MASK_WINDOW, "{{run}}")],
                min_val=0,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Ingest per run (tokens/s)",
                "Masked tokens accepted per second per run. Healthy: steady while a run trains; "
                "0 for a training run means its sidecar stopped reporting.",
                "ops",
                [(TOKENS_RATE, "{{run}}")],
                min_val=0,
            )
        )
    )
