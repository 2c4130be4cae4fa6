"""Lab v2's candidate rules (benchmarks/collapse_lab/v2/candidate.rules.yml) on hand-built
series, replayed with the shipped rules by the real promtool (one step per minute, as the lab
replays a run): the collapse-risk page needs both an off-policy mismatch and a turning trainer,
and the candidate entropy alert tells a converged run (reward held at its best) from a falling
one, as the shipped entropy warning now does too (with PROTOCOL-entropy3.md's clause)."""

from __future__ import annotations

import shutil

import pytest

from benchmarks.collapse_lab.replay import RULES, first_firings
from benchmarks.collapse_lab.v2.__main__ import CANDIDATE, lead_summary

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool")

RUN = 'run="r"'
STEPS = 150
TOKENS = 1000  # tokens per step


def _series(
    kl: list[float],
    entropy: list[float],
    grad: list[float] | None = None,
    reward: list[float] | None = None,
) -> list[dict[str, float]]:
    """Snapshots as the lab takes them after each step: the counters' cumulative sums of
    ``TOKENS`` tokens a step at the given per-step means, and the scalars' latest values."""
    out, kl_sum, h_sum = [], 0.0, 0.0
    for s in range(len(kl)):
        kl_sum += kl[s] * TOKENS
        h_sum += entropy[s] * TOKENS
        snap = {
            f"timwatch_token_kl_sum{{{RUN}}}": kl_sum,
            f"timwatch_token_kl_count{{{RUN}}}": float(TOKENS * (s + 1)),
            f"timwatch_token_entropy_sum{{{RUN}}}": h_sum,
            f"timwatch_token_entropy_count{{{RUN}}}": float(TOKENS * (s + 1)),
            f"timwatch_tokens_total{{{RUN}}}": float(TOKENS * (s + 1)),
        }
        if grad is not None:
            snap[f'timwatch_scalar_grad_norm{{{RUN},source=""}}'] = grad[s]
        if reward is not None:
            snap[f'timwatch_scalar_reward_mean{{{RUN},source=""}}'] = reward[s]
        out.append(snap)
    return out


def _fired(series: list[dict[str, float]]) -> dict[str, int]:
    return {f["alert"]: f["step"] for f in first_firings(series, rules=(RULES, CANDIDATE))}


def _wiggle(level: float, s: int) -> float:
    """A level with a deterministic ±2 % step-to-step wobble (a stddev that is not 0)."""
    return level * (1.0 + 0.02 * ((s * 7) % 5 - 2) / 2)


def test_page_needs_an_off_policy_mismatch_and_a_turning_trainer() -> None:
    # KL steady at 1e-3 for 100 steps, then 5e-3 (5x its own baseline, over 2e-3); the gradient
    # norm steady at 1, then 4 from step 110: page once both hold for 5 min
    kl = [1e-3 if s < 100 else 5e-3 for s in range(STEPS)]
    grad = [_wiggle(1.0, s) if s < 110 else 4.0 for s in range(STEPS)]
    reward = [_wiggle(0.5, s) for s in range(STEPS)]
    fired = _fired(_series(kl, [3.0] * STEPS, grad, reward))
    assert 110 <= fired["TimwatchCollapseRiskCandidate"] <= 120
    assert "TimwatchEntropyCollapseCandidate" not in fired


def test_no_page_when_only_the_mismatch_rises() -> None:
    kl = [1e-3 if s < 100 else 5e-3 for s in range(STEPS)]
    grad = [_wiggle(1.0, s) for s in range(STEPS)]
    reward = [_wiggle(0.5, s) for s in range(STEPS)]
    fired = _fired(_series(kl, [3.0] * STEPS, grad, reward))
    assert "TimwatchCollapseRiskCandidate" not in fired
    assert "TimwatchMismatchKLRising" in fired  # the shipped page reads the mismatch alone


def test_no_page_when_only_the_trainer_turns() -> None:
    # the reward falls far below its best, but the mismatch stays at a matched engine's level
    kl = [1e-4] * STEPS
    grad = [_wiggle(1.0, s) for s in range(STEPS)]
    reward = [_wiggle(0.6, s) if s < 100 else 0.1 for s in range(STEPS)]
    assert "TimwatchCollapseRiskCandidate" not in _fired(_series(kl, [3.0] * STEPS, grad, reward))


def test_page_on_a_falling_reward_at_an_off_policy_level() -> None:
    # int4-like: the KL is over the warning level from the start (not rising); the reward
    # climbs to 0.6, then drops to 0.2 at step 100. By hand: with k of the last 10 samples at
    # 0.2 the 10 min mean is 0.04 k under the best (0.6), and the hour's std is about
    # 0.4 sqrt(p (1 - p)), p = k / 60, plus the ramp's share: k = 7 (step 106) is the first with
    # 0.28 > 2 σ ≈ 0.26; then `for: 5m`
    kl = [0.05] * STEPS
    grad = [_wiggle(1.0, s) for s in range(STEPS)]
    reward = [min(0.6, 0.3 + 0.005 * s) if s < 100 else 0.2 for s in range(STEPS)]
    fired = _fired(_series(kl, [3.0] * STEPS, grad, reward))
    assert 110 <= fired["TimwatchCollapseRiskCandidate"] <= 112


def test_entropy_candidate_tells_convergence_from_a_falling_run() -> None:
    entropy = [3.0 if s < 60 else 0.01 for s in range(STEPS)]
    kl = [1e-4] * STEPS
    grad = [_wiggle(1.0, s) for s in range(STEPS)]
    converged = [min(0.9, 0.3 + 0.01 * s) for s in range(STEPS)]  # reward holds at its best
    fired = _fired(_series(kl, entropy, grad, converged))
    # nor does the shipped warning since PROTOCOL-entropy3.md (it reads the reward too)
    assert "TimwatchEntropyCollapse" not in fired
    assert "TimwatchEntropyCollapseCandidate" not in fired
    falling = [0.6 if s < 60 else 0.1 for s in range(STEPS)]
    fired = _fired(_series(kl, entropy, grad, falling))
    assert "TimwatchEntropyCollapseCandidate" in fired


def test_entropy_candidate_without_reward_scalars_is_the_shipped_rule() -> None:
    entropy = [3.0 if s < 60 else 0.01 for s in range(STEPS)]
    fired = _fired(_series([1e-4] * STEPS, entropy))
    # the same expression; the candidate's group reads the shipped group's recording of the same
    # evaluation or, when promtool evaluates the groups the other way round, of the one before
    assert 0 <= fired["TimwatchEntropyCollapseCandidate"] - fired["TimwatchEntropyCollapse"] <= 1


def test_lead_summary_keeps_shipped_and_candidate_apart() -> None:
    firings = [
        {"alert": "TimwatchMismatchKLRising", "severity": "page", "step": 50},
        {"alert": "TimwatchCollapseRiskCandidate", "severity": "page", "step": 40},
        {"alert": "TimwatchMismatchKLHigh", "severity": "warning", "step": 20},
    ]
    got = lead_summary(100, firings)
    assert (got["first_page"], got["lead_page"]) == (50, 50)
    assert (got["candidate_first_page"], got["candidate_lead_page"]) == (40, 60)
    assert (got["first_warning"], got["candidate_first_warning"]) == (20, None)
    assert lead_summary(None, firings)["candidate_lead_page"] is None
