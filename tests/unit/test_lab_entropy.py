"""PROTOCOL-entropy.md's and PROTOCOL-entropy2.md's decisions (`benchmarks.collapse_lab.entropy`
`decide`, `decide_state`) on hand-made rows."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.collapse_lab.entropy import decide, decide_state, reward_at


def _row(
    onset: int | None, converged: bool, shipped: int | None, cand: int | None
) -> dict[str, Any]:
    return {"collapse_step": onset, "converged": converged, "shipped": shipped, "candidate": cand}


CONVERGED = [_row(None, True, 50, None), _row(None, True, 60, None)]
COLLAPSED = [_row(80, False, 70, 75), _row(90, False, 60, 70), _row(100, False, 95, 95)]


def test_all_three_conditions_ship_the_clause() -> None:
    neither = _row(None, False, 40, 41)  # no collapse, not converged: counts nowhere
    d = decide(CONVERGED + COLLAPSED + [neither])
    assert d["converged"] == 2 and d["collapsed"] == 3 and d["runs"] == 6
    assert d["collapsed_with_shipped"] == 3 and d["of_them_candidate_in_time"] == 3
    assert all(d["conditions"].values()) and d["ship"]


def test_each_condition_can_fail_alone() -> None:
    # 1: the shipped rule fires on fewer than half of the converged runs
    quiet = [_row(None, True, None, None), _row(None, True, None, None), _row(None, True, 5, None)]
    assert list(decide(quiet + COLLAPSED)["conditions"].values()) == [False, True, True]
    # 2: the candidate fires on one converged run
    loud = [_row(None, True, 50, 52), *CONVERGED[1:]]
    assert list(decide(loud + COLLAPSED)["conditions"].values()) == [True, False, True]
    # 3: 11 steps after the shipped rule is late; a silent candidate misses; fewer than 3 hits
    late, silent = _row(100, False, 80, 91), _row(1, False, 0, None)
    unseen = _row(9, False, None, 9)
    for bad in ([*COLLAPSED[:2], late], [*COLLAPSED[:2], silent], [*COLLAPSED[:2], unseen]):
        d = decide(CONVERGED + bad)
        assert list(d["conditions"].values()) == [True, True, False] and not d["ship"]
    # exactly 10 steps late is in time
    assert decide(CONVERGED + [*COLLAPSED[:2], _row(100, False, 80, 90)])["ship"]


def test_reward_at_a_firing_by_hand() -> None:
    # 20 steps at 0.1, then 0.2 for 10, then 0.5 for 10: fired at step 39
    rewards = [0.1] * 20 + [0.2] * 10 + [0.5] * 10
    gain, change = reward_at(rewards, 39)
    assert gain == pytest.approx(5.0)  # 0.5 over the first 20 steps' 0.1
    assert change == pytest.approx(0.4)  # 0.5 against steps 10-19's 0.1
    gain, change = reward_at(rewards, 29)
    assert gain == pytest.approx(2.0) and change == pytest.approx(0.1)


def test_the_state_decision_takes_late_firings_and_needs_three_quarters() -> None:
    late = _row(100, False, 60, 140)  # long after the shipped rule and the onset: still counts
    d = decide_state(CONVERGED + [*COLLAPSED[:2], late])
    assert d["candidate_on_collapsed"] == 3 and d["ship"]
    # 3 of 4 collapses is enough, 2 of 3 is not
    silent = _row(1, False, 0, None)
    assert decide_state(CONVERGED + COLLAPSED + [silent])["ship"]
    d = decide_state(CONVERGED + [*COLLAPSED[:2], silent])
    assert list(d["conditions"].values()) == [True, True, False]
    # fewer than 3 collapses cannot ship; a candidate on a converged run cannot either
    assert not decide_state(CONVERGED + COLLAPSED[:2])["ship"]
    loud = [_row(None, True, 50, 52), *CONVERGED[1:]]
    assert list(decide_state(loud + COLLAPSED)["conditions"].values()) == [True, False, True]
    quiet = [_row(None, True, None, None), _row(None, True, None, None), _row(None, True, 5, None)]
    assert list(decide_state(quiet + COLLAPSED)["conditions"].values()) == [False, True, True]
