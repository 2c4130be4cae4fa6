"""Alert rules: promtool check + unit tests, the exposition and alert contract, and the test
override.

promtool (Debian `prometheus`) is a hard requirement here: these tests fail, never skip, when it
is missing, because CI must run the rule tests.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.names import EXPORTED_SERIES
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "timwatch.rules.yml"
RULE_TESTS = sorted((ROOT / "alerts" / "tests").glob("*.test.yml"))
RUNBOOK = ROOT / "docs" / "runbook.md"

SHIPPED_ALERTS = {
    "TimwatchMismatchKLHigh",
    "TimwatchMismatchKLRising",
    "TimwatchMaskRatioHigh",
    "TimwatchISRatioStdHigh",
    "TimwatchEntropyCollapse",
    "TimwatchTokenIdDrift",
    "TimwatchStalenessHigh",
    "TimwatchIngestStalled",
    "TimwatchBadInput",
}
# labels the exporter sets (docs/reference/prometheus.md) plus the target labels Prometheus
# adds to every series
ALLOWED_LABELS = {"run", "policy", "reason", "instance", "job", "le"}


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian package `prometheus`"
    return path


def _run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def _load_override() -> ModuleType:
    return load_script(ROOT / "alerts" / "override.py", "timwatch_alerts_override")


override = _load_override()


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in _rules() if "alert" in rule}


# ---- promtool ----------------------------------------------------------------------------


def test_promtool_check_rules_is_clean() -> None:
    proc = _run(_promtool(), "check", "rules", RULES)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "SUCCESS" in out and "FAILED" not in out and "WARNING" not in out.upper(), out


def test_promtool_unit_tests_pass() -> None:
    assert len(RULE_TESTS) >= 5
    proc = _run(_promtool(), "test", "rules", *RULE_TESTS)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("SUCCESS") == len(RULE_TESTS), out


# ---- contract ----------------------------------------------------------------------------


def test_alert_names_are_exactly_spec_section_5() -> None:
    alerts = [rule["alert"] for rule in _rules() if "alert" in rule]
    assert sorted(alerts) == sorted(SHIPPED_ALERTS)


@pytest.mark.parametrize("name", sorted(SHIPPED_ALERTS))
def test_alert_has_for_severity_and_annotations(name: str) -> None:
    rule = _alerts()[name]
    assert override.parse_duration(rule["for"]) > 0
    assert rule["labels"]["severity"] in {"warning", "page"}
    ann = rule["annotations"]
    assert set(ann) == {"summary", "description", "runbook_url"}
    assert ann["summary"].strip() and len(ann["description"]) > 80
    assert ann["runbook_url"].endswith("/docs/runbook.md#" + name.lower())


def test_token_id_drift_pages_at_any_non_zero_value() -> None:
    rule = _alerts()["TimwatchTokenIdDrift"]
    assert rule["labels"]["severity"] == "page"
    assert re.fullmatch(r"timwatch:token_id_mismatch_ratio:rate\w+ > 0\s*", rule["expr"])


def test_runbook_has_a_section_per_alert() -> None:
    text = RUNBOOK.read_text()
    headings = re.findall(r"^## (\w+)\s*$", text, flags=re.M)
    assert SHIPPED_ALERTS <= set(headings), SHIPPED_ALERTS - set(headings)
    for name in SHIPPED_ALERTS:
        section = text.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("What it means", "Confirm", "What to do"):
            assert f"**{part}" in section, (name, part)
        assert "timwatch — " in section, f"{name}: no dashboard named"


def _exprs() -> list[str]:
    return [str(rule["expr"]) for rule in _rules()]


def test_rules_use_only_spec_metric_names() -> None:
    used = {m for expr in _exprs() for m in re.findall(r"\btimwatch_[a-z0-9_]+", expr)}
    assert used, "no timwatch_ series found"
    assert used <= EXPORTED_SERIES, used - EXPORTED_SERIES
    # the additive series carry the mismatch alerts, not the last-batch gauge
    assert "timwatch_token_kl_sum" in used and "timwatch_mismatch_kl" not in used


def test_rules_use_only_spec_label_names() -> None:
    labels: set[str] = set()
    for expr in _exprs():
        for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
            labels |= {x.strip() for x in group.split(",") if x.strip()}
        labels |= set(re.findall(r"[{,]\s*([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", expr))
    assert labels and labels <= ALLOWED_LABELS, labels - ALLOWED_LABELS


def test_recorded_names_follow_level_metric_operation() -> None:
    for rule in _rules():
        if "record" in rule:
            assert re.fullmatch(r"timwatch:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]


def _series_labels(series: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', series))


def _matches(alert_labels: dict[str, str], series_labels: dict[str, str]) -> bool:
    common = (set(alert_labels) - {"severity"}) & set(series_labels)
    return all(alert_labels[k] == series_labels[k] for k in common)


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    """Each alert has an evaluation where it fires, and one where some input series (a healthy,
    spiking or ended run) is present but matched by no firing alert."""
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        for group in yaml.safe_load(path.read_text())["tests"]:
            inputs = [_series_labels(s["series"]) for s in group["input_series"]]
            for case in group.get("alert_rule_test", []):
                expected = [
                    {k: str(v) for k, v in a["exp_labels"].items()}
                    for a in case.get("exp_alerts") or []
                ]
                if expected:
                    firing.add(case["alertname"])
                if any(not any(_matches(e, lab) for e in expected) for lab in inputs):
                    quiet.add(case["alertname"])
    assert firing >= SHIPPED_ALERTS, SHIPPED_ALERTS - firing
    assert quiet >= SHIPPED_ALERTS, SHIPPED_ALERTS - quiet


# ---- test override (alerts/override.py) ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ms"),
    [("500ms", 500), ("15s", 15_000), ("10m", 600_000), ("1h30m", 5_400_000), ("1d", 86_400_000)],
)
def test_parse_duration(text: str, ms: int) -> None:
    assert override.parse_duration(text) == ms


@pytest.mark.parametrize("bad", ["", "10", "1.5m", "m", "-5m", "10 m"])
def test_parse_duration_refuses_non_durations(bad: str) -> None:
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        override.parse_duration(bad)


@given(st.integers(min_value=0, max_value=10**12))
def test_format_then_parse_round_trips(ms: int) -> None:
    assert override.parse_duration(override.format_duration(ms)) == ms


def test_scale_expr_scales_ranges_subqueries_and_offsets() -> None:
    expr = 'rate(x{a="[1m]"}[1h] offset 30m) / deriv(ln(y)[2h:1m]) + max_over_time(z[15m:])'
    got = override.scale_expr(expr, 1 / 60)
    # the label value "[1m]" is a string, but it is also a valid range literal: the override
    # has no PromQL parser, which the docs state; rule authors keep durations out of strings
    assert got == 'rate(x{a="[1s]"}[1m] offset 30s) / deriv(ln(y)[2m:1s]) + max_over_time(z[15s:])'
    assert override.scale_expr("rate(x[5m])", 1 / 600, min_range_ms=4000) == "rate(x[4s])"
    assert override.scale_expr("rate(x[5m] offset -1h)", 0.5) == "rate(x[2m30s] offset -30m)"


def test_scale_rules_changes_durations_only(tmp_path: Path) -> None:
    doc = yaml.safe_load(RULES.read_text())
    scaled = override.scale_rules(doc, 1 / 60)
    assert doc == yaml.safe_load(RULES.read_text()), "input was modified"
    pairs = zip(
        (r for g in doc["groups"] for r in g["rules"]),
        (r for g in scaled["groups"] for r in g["rules"]),
        strict=True,
    )
    dur = r"\d+(?:ms|[smhdwy])"
    n_durations = 0
    for old, new in pairs:
        assert {k: v for k, v in old.items() if k not in ("expr", "for")} == {
            k: v for k, v in new.items() if k not in ("expr", "for")
        }
        if "for" in old:
            assert override.parse_duration(new["for"]) * 60 == override.parse_duration(old["for"])
        old_d = [
            override.parse_duration(d)
            for d in re.findall(rf"(?:\[|offset )((?:{dur})+)", old["expr"])
        ]
        new_d = [
            override.parse_duration(d)
            for d in re.findall(rf"(?:\[|offset )((?:{dur})+)", new["expr"])
        ]
        assert [d * 60 for d in new_d] == old_d, (old["expr"], new["expr"])
        n_durations += len(old_d)
        # everything but the durations is unchanged
        assert re.sub(rf"(?:{dur})+", "D", old["expr"]) == re.sub(rf"(?:{dur})+", "D", new["expr"])
    assert n_durations >= 20
    fixed = override.scale_rules(doc, 1.0, for_="5s")
    assert {r["for"] for g in fixed["groups"] for r in g["rules"] if "alert" in r} == {"5s"}
    with pytest.raises(ValueError):
        override.scale_rules(doc, 0.0)


def test_override_cli_output_passes_promtool(tmp_path: Path) -> None:
    out = tmp_path / "scaled.rules.yml"
    proc = _run(
        sys.executable,
        ROOT / "alerts" / "override.py",
        "--factor",
        "0.0166667",
        "--min-range",
        "4s",
        RULES,
        out,
    )
    assert proc.returncode == 0, proc.stderr
    check = _run(_promtool(), "check", "rules", out)
    assert check.returncode == 0, check.stdout + check.stderr
    alerts = {
        r["alert"]: r
        for g in yaml.safe_load(out.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    assert alerts["TimwatchMismatchKLHigh"]["for"] == "15s"
    assert "[1m] offset 30s" in yaml.safe_dump(yaml.safe_load(out.read_text()))


def _scale_test_file(doc: dict[str, Any], factor: float) -> dict[str, Any]:
    """A promtool test file on a clock `1 / factor` times faster (sample values unchanged)."""
    scale = lambda d: override.scale_duration(str(d), factor)  # noqa: E731
    out = dict(doc, rule_files=["timwatch.rules.yml"])
    out["evaluation_interval"] = scale(doc.get("evaluation_interval", "1m"))
    tests = []
    for group in doc["tests"]:
        g = dict(group, interval=scale(group.get("interval", "1m")))
        g["alert_rule_test"] = [
            dict(c, eval_time=scale(c["eval_time"])) for c in group.get("alert_rule_test", [])
        ]
        g["promql_expr_test"] = [
            dict(c, eval_time=scale(c["eval_time"])) for c in group.get("promql_expr_test", [])
        ]
        tests.append(g)
    out["tests"] = tests
    return out


def test_scaled_rules_behave_like_the_originals_on_a_scaled_clock(tmp_path: Path) -> None:
    """The override keeps the rules' meaning: every unit test, with its clock sped up 60x,
    still passes against the scaled rules. Groups that feed wall-clock timestamps
    (timwatch_last_batch_timestamp_seconds) are left out: their sample values are seconds."""
    factor = 1 / 60
    override.write_scaled_rules(RULES, tmp_path / "timwatch.rules.yml", factor)
    files = []
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        doc["tests"] = [
            g
            for g in doc["tests"]
            if not any("timestamp_seconds" in s["series"] for s in g["input_series"])
        ]
        if doc["tests"]:
            dst = tmp_path / path.name
            dst.write_text(yaml.safe_dump(_scale_test_file(doc, factor), sort_keys=False))
            files.append(dst)
    assert len(files) == len(RULE_TESTS)
    proc = _run(_promtool(), "test", "rules", *files, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- report links ------------------------------------------------------------------------


def test_report_links_go_to_every_run_labelled_alert() -> None:
    doc = yaml.safe_load(RULES.read_text())
    linked = override.link_reports(doc, "https://tw.example:8000/")
    assert doc == yaml.safe_load(RULES.read_text()), "input was modified"
    urls = {
        r["alert"]: r["annotations"].get("report_url")
        for g in linked["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    want = "https://tw.example:8000/v1/runs/{{ $labels.run }}/report.html"
    # every alert but BadInput (its `run` label is optional: refused batches may name no run)
    assert {a for a, u in urls.items() if u == want} == SHIPPED_ALERTS - {"TimwatchBadInput"}
    assert urls["TimwatchBadInput"] is None
    for bad in ("tw.example", "https://tw.example/{{ x }}", "ftp://tw.example"):
        with pytest.raises(ValueError, match="report base URL"):
            override.link_reports(doc, bad)


def test_report_links_render_with_the_run_in_promtool(tmp_path: Path) -> None:
    """Every promtool unit test passes against the linked rules once each expected alert of a
    linked rule also expects ``report_url`` with its own run in it."""
    base = "https://tw.example"
    proc = _run(
        sys.executable, ROOT / "alerts" / "override.py", "--report-base-url", base, RULES,
        tmp_path / "timwatch.rules.yml",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    linked = {
        r["alert"]
        for g in yaml.safe_load((tmp_path / "timwatch.rules.yml").read_text())["groups"]
        for r in g["rules"]
        if "report_url" in r.get("annotations", {})
    }
    expected = 0
    files = []
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        doc["rule_files"] = ["timwatch.rules.yml"]
        for group in doc["tests"]:
            for case in group.get("alert_rule_test", []):
                if case["alertname"] not in linked:
                    continue
                for alert in case.get("exp_alerts") or []:
                    if "exp_annotations" in alert:
                        run = alert["exp_labels"]["run"]
                        alert["exp_annotations"]["report_url"] = f"{base}/v1/runs/{run}/report.html"
                        expected += 1
        dst = tmp_path / path.name
        dst.write_text(yaml.safe_dump(doc, sort_keys=False))
        files.append(dst)
    assert expected >= 10
    proc = _run(_promtool(), "test", "rules", *files, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
