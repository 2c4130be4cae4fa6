"""The demo's per-step verdict on hand-made rows: each rule, its thresholds at their edges, the
lag-1 staleness spike the default demo really shows at step 2, the worst step and the advice."""

from __future__ import annotations

from typing import Any

import pytest

from timwatch.sidecar.demo.verdict import (
    KL_HEALTHY,
    KL_OFF_POLICY,
    MASK_HIGH,
    Level,
    Verdict,
    advice,
    judge,
    num,
    worst_step,
)


def row(**kw: Any) -> dict[str, Any]:
    """A healthy bf16 step without lag (the demo's ``--lag 0`` numbers), overridden by ``kw``."""
    base: dict[str, Any] = {
        "step": 0,
        "mismatch_kl": 5.5e-4,
        "discrepancy_kl": 5.5e-4,
        "staleness_kl": 0.0,
        "version_lag_max": 0,
        "mask_ratio_estr": 0.0,
        "entropy_mean": 3.2,
        "token_id_mismatch_ratio": 0.0,
    }
    return {**base, **kw}


def test_bf16_engine_without_lag_is_healthy_and_named_bf16() -> None:
    v = judge(row())
    assert v == Verdict(Level.HEALTHY, "healthy (k3 5.5e-4, engine at bf16 level)")


@pytest.mark.parametrize(
    ("k3", "level"),
    [(1.3e-12, "fp32 level"), (9.3e-6, "fp16 level"), (5.5e-4, "bf16 level")],
)
def test_engine_precision_level_from_its_k3(k3: float, level: str) -> None:
    v = judge(row(mismatch_kl=k3, discrepancy_kl=k3))
    assert v.level is Level.HEALTHY and level in v.text


def test_the_lag1_spike_at_step_2_is_explained_as_staleness_with_its_masking() -> None:
    # step 2 of the default demo (bf16, lag 1): what the history stored
    spike = row(
        step=2, mismatch_kl=0.508, discrepancy_kl=4.17e-4, staleness_kl=0.509,
        version_lag_max=1, mask_ratio_estr=0.144,
    )  # fmt: skip
    v = judge(spike)
    assert v.level is Level.BAD and v.cause == "staleness"
    assert v.text == (
        "off-policy (k3 0.51), staleness dominates: lag 1, the policy moved far since the "
        "engine's weights (staleness_kl 0.51 ≫ discrepancy_kl 4.2e-4); "
        "masking high: ESTR rejects 14%"
    )


def test_moderate_staleness_is_watch_and_uses_gt_below_tenfold() -> None:
    v = judge(row(mismatch_kl=6e-3, discrepancy_kl=5.3e-4, staleness_kl=5.9e-3, version_lag_max=1))
    assert v == Verdict(
        Level.WATCH, "staleness dominates: lag 1 (staleness_kl 5.9e-3 ≫ discrepancy_kl 5.3e-4)",
        "staleness",
    )  # fmt: skip
    v = judge(row(mismatch_kl=4e-3, discrepancy_kl=6.8e-4, staleness_kl=3.2e-3, version_lag_max=2))
    assert v.text == "staleness dominates: lag 2 (staleness_kl 3.2e-3 > discrepancy_kl 6.8e-4)"


def test_engine_larger_than_staleness_is_precision_even_with_lag() -> None:
    v = judge(row(mismatch_kl=2e-3, discrepancy_kl=1.4e-3, staleness_kl=5e-4, version_lag_max=1))
    assert v == Verdict(Level.WATCH, "precision: bf16 level (engine k3 1.4e-3)", "engine")


def test_staleness_without_lag_is_not_blamed() -> None:
    v = judge(row(mismatch_kl=2e-3, discrepancy_kl=1e-3, staleness_kl=1.5e-3, version_lag_max=0))
    assert v.cause == "engine"


def test_engine_worse_than_bf16_is_bad() -> None:
    v = judge(row(mismatch_kl=0.023, discrepancy_kl=0.023))
    assert v == Verdict(
        Level.BAD, "off-policy (k3 0.023), precision: worse than bf16 (engine k3 0.023)", "engine"
    )


def test_without_logp_old_the_whole_mismatch_is_the_engines() -> None:
    v = judge(row(mismatch_kl=1.4e-3, discrepancy_kl=None, staleness_kl=None, version_lag_max=3))
    assert v == Verdict(Level.WATCH, "precision: bf16 level (engine k3 1.4e-3)", "engine")


def test_kl_thresholds_at_their_edges() -> None:
    assert judge(row(mismatch_kl=KL_HEALTHY * 0.999)).level is Level.HEALTHY
    assert judge(row(mismatch_kl=KL_HEALTHY)).level is Level.WATCH
    assert judge(row(mismatch_kl=KL_OFF_POLICY * 0.999)).level is Level.WATCH
    assert judge(row(mismatch_kl=KL_OFF_POLICY)).level is Level.BAD


def test_masking_clause_above_its_threshold_only_and_raises_a_healthy_step_to_watch() -> None:
    assert judge(row(mask_ratio_estr=MASK_HIGH)).level is Level.HEALTHY
    v = judge(row(mask_ratio_estr=0.023))
    assert v.level is Level.WATCH and v.cause is None
    assert v.text == "healthy (k3 5.5e-4, engine at bf16 level); masking high: ESTR rejects 2.3%"


def test_entropy_collapse_clause() -> None:
    v = judge(row(entropy_mean=0.004))
    assert v.level is Level.WATCH and v.text.endswith("; entropy collapsed (H 4e-3)")


def test_token_id_drift_overrides_everything() -> None:
    v = judge(row(token_id_mismatch_ratio=0.031, mask_ratio_estr=0.5, mismatch_kl=0.9))
    assert v.level is Level.BAD and v.cause == "token_ids"
    assert v.text.startswith("token ids differ on 3.1% of tokens")
    assert "masking" not in v.text


def test_missing_numbers() -> None:
    assert judge({"step": 4}).level is Level.WATCH
    assert judge(row(mismatch_kl=None)).text == "no mismatch number (no tokens in this step)"


def test_worst_step_ranks_level_then_kl() -> None:
    rows = [
        row(step=0),
        row(step=1, mismatch_kl=9e-3, discrepancy_kl=9e-3),
        row(step=2, mismatch_kl=0.02, discrepancy_kl=0.02),
        row(step=3, mismatch_kl=0.5, discrepancy_kl=0.5),
        row(step=4, token_id_mismatch_ratio=0.01),
    ]
    assert worst_step(rows[:3]) == (2, judge(rows[2]))
    assert worst_step(rows[:4])[0] == 3  # type: ignore[index]
    assert worst_step(rows)[0] == 3  # type: ignore[index]  # both bad: the larger KL
    assert worst_step([]) is None


def test_advice_follows_the_most_frequent_cause_of_unhealthy_steps() -> None:
    stale = judge(row(mismatch_kl=6e-3, discrepancy_kl=5e-4, staleness_kl=6e-3, version_lag_max=1))
    engine = judge(row(mismatch_kl=2e-3, discrepancy_kl=2e-3))
    healthy = judge(row())
    assert "--lag 0" in (advice([stale, stale, engine, healthy, healthy, healthy]) or "")
    assert "--precision" in (advice([engine, engine, stale]) or "")
    assert advice([healthy, healthy]) is None


def test_num_formats_two_significant_digits() -> None:
    assert [num(x) for x in (0.0, 0.508, 0.0123, 5.9e-3, 1e-3, 4.17e-4, 1.3e-12)] == [
        "0", "0.51", "0.012", "5.9e-3", "1e-3", "4.2e-4", "1.3e-12",
    ]  # fmt: skip
