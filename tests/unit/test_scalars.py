"""The scalar bridge's names (`timwatch.monitor.core.scalars`): each framework's map, written
out by hand from the names the framework's own code logs, and the mapping rules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from timwatch.monitor.core.errors import InputError
from timwatch.monitor.core.row import MetricRow
from timwatch.monitor.core.scalars import (
    CANONICAL,
    HEALTH,
    MAX_NAMES,
    SOURCES,
    map_scalars,
    to_float,
)
from timwatch.monitor.store.models import FLOAT_COLUMNS

# TRL GRPOTrainer: `_generate_and_score_completions` (sampling/*, completions/*, reward*),
# `_compute_loss` (entropy, clip_ratio/*), Trainer.log (loss, grad_norm, learning_rate)
TRL_EXPECTED = {
    "sampling/sampling_logp_difference/mean": "log_ratio_abs_mean",
    "sampling/sampling_logp_difference/max": "log_ratio_abs_max",
    "sampling/importance_sampling_ratio/min": "is_weight_min",
    "sampling/importance_sampling_ratio/mean": "is_weight_mean",
    "sampling/importance_sampling_ratio/max": "is_weight_max",
    "reward": "reward_mean",
    "reward_std": "reward_std",
    "entropy": "entropy",
    "grad_norm": "grad_norm",
    "completions/mean_length": "response_length_mean",
    "completions/max_length": "response_length_max",
    "learning_rate": "learning_rate",
    "clip_ratio/region_mean": "clip_fraction",
    "loss": "loss",
}
# verl 0.9.1: trainer/ppo/rollout_corr_helper.py (rollout_corr/*), utils/debug/metrics.py
# (training/rollout_*), trainer/ppo/metric_utils.py, core_algos.py, workers/utils/losses.py
VERL_EXPECTED = {
    "rollout_corr/kl": "kl_k1",  # mean(rollout − old) = mean(−δ)
    "rollout_corr/k3_kl": "mismatch_kl",  # mean(e^δ − δ − 1), δ = old − rollout
    "rollout_corr/chi2_token": "chi2_token",
    "rollout_corr/chi2_seq": "chi2_seq",
    "rollout_corr/training_ppl": "training_ppl",
    "rollout_corr/training_log_ppl": "training_log_ppl",
    "rollout_corr/rollout_ppl": "rollout_ppl",
    "rollout_corr/rollout_log_ppl": "rollout_log_ppl",
    "rollout_corr/log_ppl_diff": "log_ppl_diff",
    "rollout_corr/log_ppl_abs_diff": "log_ppl_abs_diff",
    "rollout_corr/log_ppl_diff_max": "log_ppl_diff_max",
    "rollout_corr/log_ppl_diff_min": "log_ppl_diff_min",
    "rollout_corr/ppl_ratio": "ppl_ratio",
    "rollout_corr/rollout_is_mean": "is_weight_mean",
    "rollout_corr/rollout_is_min": "is_weight_min",
    "rollout_corr/rollout_is_max": "is_weight_max",
    "rollout_corr/rollout_is_std": "is_weight_std",
    "rollout_corr/rollout_is_eff_sample_size": "is_weight_ess",
    "rollout_corr/rollout_rs_masked_fraction": "correction_masked_fraction",
    "rollout_corr/rollout_rs_seq_masked_fraction": "correction_seq_masked_fraction",
    "training/rollout_probs_diff_mean": "prob_abs_diff_mean",
    "training/rollout_probs_diff_max": "prob_abs_diff_max",
    "training/rollout_probs_diff_std": "prob_abs_diff_std",
    "training/rollout_actor_probs_pearson_corr": "prob_pearson_corr",
    "critic/score/mean": "reward_mean",
    "actor/grad_norm": "grad_norm",
    "actor/entropy": "entropy",
    "response_length/mean": "response_length_mean",
    "response_length/max": "response_length_max",
    "actor/lr": "learning_rate",
    "actor/pg_clipfrac": "clip_fraction",
    "actor/pg_loss": "loss",
}
# OpenRLHF: PolicyLoss returns vllm_kl = masked_mean(rollout − old); the trainer's status keys
OPENRLHF_EXPECTED = {
    "vllm_kl": "kl_k1",
    "policy_loss": "loss",
    "ppo_clip_ratio": "clip_fraction",
    "actor_lr": "learning_rate",
    "reward": "reward_mean",
    "response_length": "response_length_mean",
    "rollout/reward_std": "reward_std",
    "actor_grad_norm": "grad_norm",
    "entropy_loss": "entropy",
    "is_filter_ratio": "correction_masked_fraction",
}
# AReaL: stats_tracker keys of ppo_actor/update (decoupled PPO's behave_* statistics)
AREAL_EXPECTED = {
    "ppo_actor/update/behave_imp_weight/avg": "is_weight_mean",
    "ppo_actor/update/behave_imp_weight/min": "is_weight_min",
    "ppo_actor/update/behave_imp_weight/max": "is_weight_max",
    "ppo_actor/update/behave_approx_kl/avg": "framework_kl",
    "ppo_actor/update/actor_loss/avg": "loss",
    "ppo_actor/update/clip_ratio/avg": "clip_fraction",
    "ppo_actor/update/entropy/avg": "entropy",
}
# NeMo-RL: ClippedPGLossFn metrics (logged under train/)
NEMO_RL_EXPECTED = {
    "token_mult_prob_error": "exp_abs_log_ratio_mean",
    "gen_kl_error": "framework_kl",
    "policy_kl_error": "framework_kl_reverse",
    "js_divergence_error": "framework_js",
    "sampling_importance_ratio": "is_weight_mean",
    "reward": "reward_mean",
    "loss": "loss",
    "grad_norm": "grad_norm",
}
# SkyRL: trainer's policy/rollout_train_logprobs_abs_diff_*
SKYRL_EXPECTED = {
    "policy/rollout_train_logprobs_abs_diff_mean": "log_ratio_abs_mean",
    "policy/rollout_train_logprobs_abs_diff_max": "log_ratio_abs_max",
    "policy/rollout_train_logprobs_abs_diff_std": "log_ratio_abs_std",
    "loss/avg_final_rewards": "reward_mean",
    "policy/grad_norm": "grad_norm",
    "policy/policy_entropy": "entropy",
    "policy/policy_lr": "learning_rate",
    "policy/policy_loss": "loss",
    "policy/loss_metrics/clip_ratio": "clip_fraction",
}
# ROLL: actor worker's train/infer metrics (seq-mean-token-mean), filter pass rate
ROLL_EXPECTED = {
    "actor/train_infer_ratio_mean": "is_ratio_seq_mean",
    "actor/train_infer_ratio_mask_mean": "correction_kept_fraction",
    "actor/pg_loss": "loss",
    "actor/pg_clipfrac": "clip_fraction",
    "actor/grad_norm": "grad_norm",
}
# prime-rl: loss metrics as the trainer logs them (mismatch_kl is k3)
PRIME_RL_EXPECTED = {
    "mismatch_kl/mean": "mismatch_kl",
    "is_masked/mean": "correction_masked_fraction",
    "entropy/mean": "entropy",
}
# slime: verl's off-policy metrics under mismatch_, and its reported loss dict (under train/)
SLIME_EXPECTED = {
    "mismatch_kl": "kl_k1",
    "mismatch_k3_kl": "mismatch_kl",
    "mismatch_training_ppl": "training_ppl",
    "mismatch_training_log_ppl": "training_log_ppl",
    "mismatch_rollout_ppl": "rollout_ppl",
    "mismatch_rollout_log_ppl": "rollout_log_ppl",
    "mismatch_log_ppl_diff": "log_ppl_diff",
    "mismatch_log_ppl_abs_diff": "log_ppl_abs_diff",
    "mismatch_log_ppl_diff_max": "log_ppl_diff_max",
    "mismatch_log_ppl_diff_min": "log_ppl_diff_min",
    "mismatch_ppl_ratio": "ppl_ratio",
    "train_rollout_logprob_abs_diff": "log_ratio_abs_seq_mean",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "pg_clipfrac": "clip_fraction",
}
EXPECTED = {
    "trl": TRL_EXPECTED,
    "openrlhf": OPENRLHF_EXPECTED,
    "areal": AREAL_EXPECTED,
    "nemo_rl": NEMO_RL_EXPECTED,
    "skyrl": SKYRL_EXPECTED,
    "roll": ROLL_EXPECTED,
    "prime_rl": PRIME_RL_EXPECTED,
    "verl": VERL_EXPECTED,
    "slime": SLIME_EXPECTED,
}


@pytest.mark.parametrize("source", sorted(EXPECTED))
def test_each_framework_map_is_the_hand_written_one(source: str) -> None:
    expected = EXPECTED[source]
    assert SOURCES[source] == expected
    values = {name: float(i) + 0.5 for i, name in enumerate(expected)}
    values["some/other_metric"] = 7.0
    mapped = map_scalars(values, source)
    assert mapped.canonical == {expected[n]: v for n, v in values.items() if n in expected}
    assert mapped.unmapped == {"some/other_metric": 7.0}
    assert {mapped.origin[t]: t for t in mapped.canonical} == expected


def test_metric_kind_names_are_metric_row_series_and_the_others_are_not() -> None:
    fields = {f.name for f in MetricRow.__dataclass_fields__.values()}
    for s in CANONICAL.values():
        if s.kind == "metric":
            assert s.name in FLOAT_COLUMNS and s.name in fields, s.name
        else:
            assert s.name not in fields and s.name not in FLOAT_COLUMNS, s.name
    assert HEALTH == (
        "reward_mean", "reward_std", "grad_norm", "entropy", "response_length_mean",
        "response_length_max", "learning_rate", "clip_fraction", "loss",
    )  # fmt: skip


def test_prefixed_names_map_and_a_name_given_twice_is_refused() -> None:
    mapped = map_scalars({"train/token_mult_prob_error": 1.01, "train/loss": 0.2}, "nemo_rl")
    assert mapped.canonical == {"exp_abs_log_ratio_mean": 1.01, "loss": 0.2}
    assert map_scalars({"train/vllm_kl": 1.0}, "openrlhf").unmapped == {"train/vllm_kl": 1.0}
    with pytest.raises(InputError) as err:
        map_scalars({"loss": 1.0, "train/loss": 1.0}, "slime")
    assert err.value.field == "scalars.train/loss"


def test_every_source_maps_onto_known_names_once() -> None:
    assert set(SOURCES) == set(EXPECTED)
    for names in SOURCES.values():
        assert set(names.values()) <= set(CANONICAL)
        assert len(set(names.values())) == len(names)


def test_without_source_only_canonical_names_map() -> None:
    mapped = map_scalars({"mismatch_kl": 1e-3, "grad_norm": 2, "vllm_kl": 0.5})
    assert mapped.canonical == {"mismatch_kl": 1e-3, "grad_norm": 2.0}
    assert mapped.unmapped == {"vllm_kl": 0.5}


def test_nonfinite_values_keep_their_name_not_their_number() -> None:
    mapped = map_scalars(
        {"actor/grad_norm": math.nan, "actor/lr": math.inf, "x": -math.inf}, "verl"
    )
    assert mapped.canonical == {"grad_norm": None, "learning_rate": None}
    assert mapped.unmapped == {"x": None}
    assert mapped.nonfinite == ["actor/grad_norm", "actor/lr", "x"]


def test_numbers_of_every_kind_are_read() -> None:
    assert to_float(3) == 3.0
    assert to_float(np.float32(0.25)) == 0.25
    assert to_float(np.array(1.5)) == 1.5
    assert to_float(torch.tensor(0.125)) == 0.125
    assert to_float(torch.tensor([2.0])) == 2.0
    assert to_float(True) is None
    assert to_float("1.0") is None
    assert to_float(np.zeros(3)) is None
    assert to_float(torch.zeros(2)) is None


@pytest.mark.parametrize(
    ("values", "source", "field"),
    [
        ({"loss": "high"}, None, "scalars.loss"),
        ({"loss": [1.0]}, None, "scalars.loss"),
        ({"loss": True}, None, "scalars.loss"),
        ({"loss": 1.0}, "megatron", "source"),
        ({f"n{i}": 1.0 for i in range(MAX_NAMES + 1)}, None, "scalars"),
        ({"x" * 129: 1.0}, None, "scalars"),
        ({"a\nb": 1.0}, None, "scalars"),
        ([("loss", 1.0)], None, "scalars"),
    ],
)
def test_bad_input_names_the_field(values: object, source: str | None, field: str) -> None:
    with pytest.raises(InputError) as err:
        map_scalars(values, source)  # type: ignore[arg-type]
    assert err.value.field == field


def test_the_docs_scalars_section_names_every_name_and_source() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = text[text.index("## Scalars") :]
    for name in CANONICAL:
        assert f"`{name}`" in section, name
    for source in SOURCES:
        assert f"| `{source}` |" in section, source


_names = st.one_of(
    st.sampled_from(sorted({n for m in SOURCES.values() for n in m} | set(CANONICAL))),
    st.text(min_size=1, max_size=20).filter(str.isprintable),
)
_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**6), 10**6))


@given(
    values=st.dictionaries(_names, _values, max_size=30),
    source=st.sampled_from([None, *sorted(SOURCES)]),
)
def test_every_name_is_mapped_or_kept_never_lost(
    values: dict[str, float], source: str | None
) -> None:
    try:
        mapped = map_scalars(values, source)
    except InputError as e:
        assert e.field.startswith("scalars.")  # only a name given twice under two spellings
        return
    assert len(mapped.canonical) + len(mapped.unmapped) == len(values)
    assert set(mapped.origin.values()) | set(mapped.unmapped) == set(values)
    for target, name in mapped.origin.items():
        v = values[name]
        assert mapped.canonical[target] == (float(v) if math.isfinite(v) else None)
    assert set(mapped.nonfinite) == {n for n, v in values.items() if not math.isfinite(v)}
