"""The collapse lab's pipeline, not its science: a 40-step miniature (fp8-rounded bf16 engine,
4 prompts × 4 samples) trains through the Tap into a real `timwatch serve` subprocess, its
exported series are read back from /metrics and replayed through the shipped rules by promtool.
Bounded: one subprocess (about 15 s of training on an idle machine; the 300 s limit leaves
room for a loaded one).
The lead-time table itself is docs/early-warning.md."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.collapse_lab.configs import CONFIGS
from benchmarks.collapse_lab.replay import first_firings
from tests.helpers.procs import REPO


def test_miniature_runs_tap_to_serve_to_promtool(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.collapse_lab", "--config", "mini", "--seed", "3",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    cfg = CONFIGS["mini"]
    run = tmp_path / "mini-s3"
    steps = [json.loads(line) for line in (run / "steps.jsonl").open()]
    assert [s["step"] for s in steps] == list(range(cfg.steps))
    # a step whose groups all score alike has zero advantages and a zero gradient
    assert all(0 <= s["reward"] <= 1 and s["grad_norm"] >= 0 and s["entropy"] >= 0 for s in steps)
    assert any(s["grad_norm"] > 0 for s in steps)
    # every token of every step reached the service and its exported counters
    series = [json.loads(line) for line in (run / "series.jsonl").open()]
    per_step = cfg.prompts * cfg.group * cfg.prompt_len
    kl_count = [s['timwatch_token_kl_count{run="mini-s3"}'] for s in series]
    assert kl_count == [per_step * (i + 1) for i in range(cfg.steps)]
    # the trainer's scalars reached the service as the same run's, step for step
    for name, key in (
        ("reward_mean", "reward"),
        ("grad_norm", "grad_norm"),
        ("entropy", "entropy"),
    ):
        got = [s[f'timwatch_scalar_{name}{{run="mini-s3",source=""}}'] for s in series]
        assert got == [s[key] for s in steps], name
    # the service stored every step in its history
    with sqlite3.connect(tmp_path / "history.db") as db:
        (n,) = db.execute("SELECT count(*) FROM steps").fetchone()
    assert n == cfg.steps
    result = json.loads((run / "result.json").read_text())
    assert result["config"] == "mini" and result["steps"] == cfg.steps
    for f in result["firings"]:
        assert f["alert"].startswith("Timwatch") and 0 < f["step"] < cfg.steps


def test_replay_reports_when_a_shipped_alert_first_fires() -> None:
    """A hand-made series through the real rules: k3 KL 0.05 per token from step 0 makes
    TimwatchMismatchKLHigh (10 min mean > 0.02 for 15 min) fire at step 16 of a 1-min clock
    (the first 10-min rate exists at 1 min, pending from there, firing 15 min later); a KL of
    0.001 fires nothing."""
    run = 'run="r"'

    def series(kl: float, steps: int = 40) -> list[dict[str, float]]:
        return [
            {f"timwatch_token_kl_sum{{{run}}}": kl * 100 * (i + 1),
             f"timwatch_token_kl_count{{{run}}}": 100.0 * (i + 1)}
            for i in range(steps)
        ]  # fmt: skip

    fired = first_firings(series(0.05))
    assert [(f["alert"], f["severity"], f["step"]) for f in fired] == [
        ("TimwatchMismatchKLHigh", "warning", 16)
    ]
    assert first_firings(series(0.001)) == []


def test_forecast_candidate_fires_before_the_kl_page_on_exponential_growth(tmp_path: Path) -> None:
    """One forecasting candidate of the lab's grid, evaluated by promtool with the shipped
    rules: k3 KL 1e-3 for 60 steps, then growing 10 % a step (a straight line in log10).
    The 10-min log-slope projects the page level (twice the hour-before mean) within 30 min
    long before TimwatchMismatchKLRising (which needs its 30-min mean doubled, for 15 min)
    fires; a flat KL projects nothing and fires nothing."""
    import yaml

    from benchmarks.collapse_lab.forecast import candidate_rules, name

    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(candidate_rules([(10, 30, 5)]), sort_keys=False))
    run = 'run="r"'

    def series(growth: float, steps: int = 120) -> list[dict[str, float]]:
        kl = [1e-3 * (growth ** max(0, i - 60)) for i in range(steps)]
        out, total = [], 0.0
        for i in range(steps):
            total += kl[i] * 100
            out.append(
                {f"timwatch_token_kl_sum{{{run}}}": total,
                 f"timwatch_token_kl_count{{{run}}}": 100.0 * (i + 1)}
            )  # fmt: skip
        return out

    fired = {f["alert"]: f["step"] for f in first_firings(series(1.1), rules=rules)}
    forecast = fired[name(10, 30, 5)]
    assert forecast < fired["TimwatchMismatchKLRising"]
    assert 60 < forecast
    assert first_firings(series(1.0), rules=rules) == []


def test_level_grid_reads_each_threshold_and_the_rules_before_the_lab() -> None:
    """The level-warning grid through promtool: a flat k3 KL of 0.05 per token crosses the KL
    thresholds 0.01 and 0.02 (firing at step 16, as the shipped alert) and none from 0.05 up;
    the combination of the thresholds before the lab warns at 16, one with the KL part at 0.1
    and the mask parts removed never does."""
    from benchmarks.collapse_lab.levels import BEFORE, alert_name, first_warning, level_firings

    run = 'run="r"'
    series = [
        {f"timwatch_token_kl_sum{{{run}}}": 0.05 * 100 * (i + 1),
         f"timwatch_token_kl_count{{{run}}}": 100.0 * (i + 1)}
        for i in range(40)
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        levels = level_firings(Path(tmp), series)
        assert (Path(tmp) / "levels.json").exists()
    assert levels[alert_name("kl", 0.01)] == levels[alert_name("kl", 0.02)] == 16
    assert all(levels[alert_name("kl", t)] is None for t in (0.05, 0.1, 0.2, 0.3, 0.5, 1.0))
    assert all(v is None for k, v in levels.items() if not k.startswith("Level_kl_"))
    assert first_warning(levels, dict(BEFORE)) == 16
    assert first_warning(levels, {"kl": 0.1, "tok": None, "seq": None, "geo": None}) is None


def test_guard_stops_a_lab_run_at_the_step_boundary_after_its_page(tmp_path: Path) -> None:
    """fp8-none seed 2 pages (TimwatchMismatchKLRising) at step 46 of the shipped rules
    (benchmarks/collapse_lab/results/runs.jsonl). With ``--guard`` the lab notifies
    `timwatch serve` the way Alertmanager would, and the run's ``Tap(on_page="raise")`` stops it
    at the next step boundary: 48 steps trained (0-47), not 60, every one stored. About 10 s of
    training on an idle machine."""
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.collapse_lab", "--config", "fp8-none", "--seed", "2",
         "--steps", "60", "--guard", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    run = tmp_path / "fp8-none-s2"
    result = json.loads((run / "result.json").read_text())
    guard = result["guard"]
    assert guard["alerts"] == ["TimwatchMismatchKLRising"]
    assert guard["paged_step"] is not None and guard["stopped_step"] == guard["paged_step"] + 1
    steps = [json.loads(line) for line in (run / "steps.jsonl").open()]
    assert [s["step"] for s in steps] == list(range(guard["stopped_step"] + 1))
    # the stored series, replayed whole, agree on the step the page first fired
    series = [json.loads(line) for line in (run / "series.jsonl").open()]
    pages = [f["step"] for f in first_firings(series) if f["severity"] == "page"]
    assert min(pages) == guard["paged_step"]
    with sqlite3.connect(tmp_path / "history.db") as db:
        (n,) = db.execute("SELECT count(*) FROM steps").fetchone()
    assert n == len(steps)
