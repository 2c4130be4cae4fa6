"""Lab v2's evaluation (benchmarks/collapse_lab/v2/evaluate.py) on hand-made runs: the Wilson
interval against published values, "in time" at its boundary, the scores of a detector, and
rlwatch's tuning choosing by J, then fewer false pages, then closeness to its defaults."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.collapse_lab.v2 import evaluate as ev


def test_wilson_matches_hand_computed_intervals() -> None:
    # 5/10: centre (0.5 + 1.92/10) / 1.384 = 0.5, half 1.96 sqrt(0.025 + 0.0096) / 1.384
    lo, hi = ev.wilson(5, 10)  # type: ignore[misc]
    assert (lo, hi) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    lo, hi = ev.wilson(0, 10)  # type: ignore[misc]
    assert lo == 0.0 and hi == pytest.approx(3.8415 / 13.8415, abs=1e-4)
    assert ev.wilson(0, 0) is None


def test_in_time_is_ten_percent_of_the_run_before_onset() -> None:
    assert ev.in_time(85, 100, 150)  # ceil(15.0) = 15 steps before onset
    assert not ev.in_time(86, 100, 150)
    assert ev.in_time(89, 100, 101)  # ceil(10.1) = 11
    assert not ev.in_time(90, 100, 101)
    assert not ev.in_time(None, 100, 150)


def _run(config: str, seed: int, collapse: int | None, crit: dict[str, int | None]) -> dict:
    grid = {",".join(map(str, c)): {"first_critical": crit.get(",".join(map(str, c)))}
            for c in ev.GRID}  # fmt: skip
    return {
        "config": config, "seed": seed, "steps": 150, "collapse_step": collapse, "firings": [],
        "rlwatch": {"defaults": {"first_critical": crit.get("defaults")}, "grid": grid},
    }  # fmt: skip


def test_score_counts_timely_pages_leads_and_false_pages() -> None:
    runs: list[dict[str, Any]] = [
        _run("a", 0, 100, {"defaults": 80}),  # in time, lead 20
        _run("a", 1, 100, {"defaults": 90}),  # late
        _run("a", 2, None, {"defaults": 5}),  # false page
        _run("a", 3, None, {}),
    ]
    s = ev._score(runs, ev._rl(None))
    assert (s["collapsed"], s["paged_in_time"], s["median_lead"]) == (2, 1, 20)
    assert (s["healthy"], s["false_pages"]) == (2, 1)
    assert s["j"] == pytest.approx(0.5 - 0.5)


def test_rlwatch_tuning_prefers_j_then_fewer_false_pages_then_the_defaults() -> None:
    best, also, near = "3.0,12.0,12.0", "2.0,12.0,12.0", "1.0,3.0,5.0"
    runs = [
        _run("a", 0, 100, {best: 50, also: 50, near: 50}),
        _run("a", 1, None, {also: 3}),  # `also` false-pages: same TPR, lower J
        _run("a", 2, None, {}),
    ]
    # best and near tie on J (1.0) and false pages (0): the one closer to (1, 3, 3) wins
    assert ev.tune_rlwatch(runs) == (1.0, 3.0, 5.0)
    runs[0]["rlwatch"]["grid"][near]["first_critical"] = 95  # now late: only `best` keeps J 1
    assert ev.tune_rlwatch(runs) == (3.0, 12.0, 12.0)
