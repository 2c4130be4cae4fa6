"""No alert rule and no dashboard panel reads a per-replica latest-step gauge.

Behind a load balancer the batches of one step land on different replicas, and each replica's
latest-step gauges (`PARTIAL_STEP_GAUGES`) then describe a partial step. Every rule of
alerts/timwatch.rules.yml (recording rules included), every rule of the generated Kubernetes
PrometheusRule and every target of every committed dashboard must read additive series only,
or a gauge of `FLEET_EXACT_GAUGES` under ``max by (run)``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.core import GaugeMetricFamily

from timwatch.dashboards import queries
from timwatch.monitor.service.exporter import (
    FLEET_EXACT_GAUGES,
    PARTIAL_STEP_GAUGES,
    SCALAR_GAUGES,
    TimwatchCollector,
)
from timwatch.monitor.service.runs import RunRegistry

ROOT = Path(__file__).resolve().parents[2]
RULE_FILES = [ROOT / "alerts" / "timwatch.rules.yml"]
K8S_RULES = ROOT / "deploy" / "k8s" / "prometheusrule.yaml"

_NAME = re.compile(r"\btimwatch_[a-z0-9_]+")


def _rule_exprs() -> list[tuple[str, str]]:
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                out.append((f"{path.name}: {rule.get('alert') or rule['record']}", rule["expr"]))
    spec = yaml.safe_load(K8S_RULES.read_text())["spec"]
    for group in spec["groups"]:
        for rule in group["rules"]:
            out.append((f"{K8S_RULES.name}: {rule.get('alert') or rule['record']}", rule["expr"]))
    return out


def _panel_exprs() -> list[tuple[str, str]]:
    return [(f"{uid} / {title}", expr) for uid, title, expr in queries()]


def problems(expr: str) -> list[str]:
    """What in `expr` is not exact fleet-wide: a partial-step gauge, or a fleet-exact gauge
    read otherwise than directly under ``max by (run)``."""
    out = []
    for m in _NAME.finditer(expr):
        name = m.group(0)
        if name in PARTIAL_STEP_GAUGES:
            out.append(f"reads the partial-step gauge {name}")
        elif name in FLEET_EXACT_GAUGES:
            before = re.sub(r"\s+", " ", expr[: m.start()]).rstrip()
            if not before.endswith("max by (run) ("):
                out.append(f"reads {name} without max by (run)")
    return out


def test_every_exported_gauge_is_classified() -> None:
    families = TimwatchCollector(RunRegistry()).families([], {})
    gauges = {f.name for f in families if isinstance(f, GaugeMetricFamily)}
    assert gauges == PARTIAL_STEP_GAUGES | FLEET_EXACT_GAUGES | SCALAR_GAUGES
    assert not PARTIAL_STEP_GAUGES & FLEET_EXACT_GAUGES
    assert not SCALAR_GAUGES & (PARTIAL_STEP_GAUGES | FLEET_EXACT_GAUGES)


def test_the_walk_sees_every_rule_and_panel() -> None:
    rules, panels = _rule_exprs(), _panel_exprs()
    alerts = [w for w, _ in rules if "timwatch.rules.yml" in w and ":" not in w.split(": ")[1]]
    assert len(alerts) == 9 and len(rules) > 2 * len(alerts)
    assert len(panels) >= 25
    assert all(_NAME.search(e) or "timwatch:" in e for _, e in rules + panels)


@pytest.mark.parametrize(
    "expr",
    [
        "max by (run) (timwatch_mismatch_kl) > 0.01",
        'max by (run, policy) (timwatch_mask_ratio{run=~"$run"})',
        "max by (run) (max_over_time(timwatch_version_lag_max[10m])) > 4",
        "time() - timwatch_last_batch_timestamp_seconds > 900",
        "sum by (run) (timwatch_step)",
    ],
)
def test_the_check_catches_partial_and_unaggregated_gauges(expr: str) -> None:
    assert problems(expr)


def test_the_check_passes_additive_series_and_max_of_exact_gauges() -> None:
    assert not problems(
        "sum by (run) (rate(timwatch_token_kl_sum[10m])) / sum by (run) "
        "(rate(timwatch_token_kl_count[10m])) and on (run) time() - max by (run) "
        '(timwatch_last_batch_timestamp_seconds{run=~"$run"}) < 60'
    )


def test_no_rule_reads_a_partial_step_gauge() -> None:
    bad = [f"{where}: {p}" for where, expr in _rule_exprs() for p in problems(expr)]
    assert not bad, "\n".join(bad)


def test_no_panel_reads_a_partial_step_gauge() -> None:
    bad = [f"{where}: {p}" for where, expr in _panel_exprs() for p in problems(expr)]
    assert not bad, "\n".join(bad)
