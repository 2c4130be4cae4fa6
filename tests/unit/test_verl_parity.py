"""The verl-parity metrics against verl's own definitions (a transcription of its
rollout-correction code, tests/helpers/verl_transcript.py) on the same packed inputs, and
against the independent float64 reference at FP16-level mismatch to 1e-12 relative."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from tests.helpers.batches import fp16_like_batch, random_batch
from tests.helpers.reference import RefParams, reference
from tests.helpers.verl_transcript import verl_metrics
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.masks import PolicyParams
from timwatch.monitor.core.row import SCALAR_METRICS, derive_row

# verl's name → ours (row key, or (row dict, key))
PAIRS: dict[str, Any] = {
    "training_ppl": "training_ppl",
    "training_log_ppl": "training_log_ppl",
    "rollout_ppl": "rollout_ppl",
    "rollout_log_ppl": "rollout_log_ppl",
    "log_ppl_diff": "log_ppl_diff",
    "log_ppl_abs_diff": "log_ppl_abs_diff",
    "log_ppl_diff_max": "log_ppl_diff_max",
    "log_ppl_diff_min": "log_ppl_diff_min",
    "ppl_ratio": "ppl_ratio",
    "kl": "kl_k1",
    "k3_kl": "mismatch_kl",
    "chi2_token": "chi2_token",
    "chi2_seq": "chi2_seq",
    "rollout_is_mean": "tis_weight_mean",
    "rollout_is_std": "tis_weight_std",
    "rollout_is_eff_sample_size": "tis_weight_ess",
    "rollout_is_ratio_fraction_high": ("mask_ratio", "tis"),
    "rollout_is_ratio_fraction_low": "is_ratio_fraction_low",
    "rollout_is_seq_mean": "seq_is_weight_mean",
    "rollout_is_seq_std": "seq_is_weight_std",
    "rollout_is_seq_max": "seq_is_weight_max",
    "rollout_is_seq_min": "seq_is_weight_min",
    "rollout_is_seq_max_deviation": "seq_is_weight_max_deviation",
    "rollout_is_seq_fraction_high": "seq_is_ratio_fraction_high",
    "rollout_is_seq_fraction_low": "seq_is_ratio_fraction_low",
    "rollout_probs_diff_mean": "prob_abs_diff_mean",
    "rollout_probs_diff_max": "prob_abs_diff_max",
    "rollout_probs_diff_std": "prob_abs_diff_std",
    "rollout_actor_probs_pearson_corr": "prob_pearson_corr",
}
# thresholds tight enough that every mode rejects something on these batches
P = PolicyParams(
    token_k1_lower=0.9, token_k1_upper=1.1, token_k2_upper=1e-3, token_k3_upper=1e-3,
    seq_sum_k2_upper=0.05, seq_sum_k3_upper=0.05, seq_mean_k2_upper=1e-3, seq_max_k2_upper=0.01,
    seq_max_k3_upper=0.01,
)  # fmt: skip
MODES = {
    "token_k1": (P.token_k1_lower, P.token_k1_upper),
    "token_k2": (0.0, P.token_k2_upper),
    "token_k3": (0.0, P.token_k3_upper),
    "seq_sum_k2": (0.0, P.seq_sum_k2_upper),
    "seq_sum_k3": (0.0, P.seq_sum_k3_upper),
    "seq_mean_k2": (0.0, P.seq_mean_k2_upper),
    "seq_max_k2": (0.0, P.seq_max_k2_upper),
    "seq_max_k3": (0.0, P.seq_max_k3_upper),
}
for mode in MODES:
    PAIRS[f"rollout_rs_{mode}_masked_fraction"] = ("mask_ratio", mode)
    if mode.startswith("seq_"):
        PAIRS[f"rollout_rs_{mode}_seq_masked_fraction"] = ("seq_reject_ratio", mode)


def _ours(row: dict[str, Any], key: Any) -> float:
    return row[key[0]][key[1]] if isinstance(key, tuple) else row[key]


def _batch_with_live_sequences(seed: int, scale: float) -> dict[str, np.ndarray]:
    """A ragged batch where every sequence has a masked token (verl counts empty rows)."""
    rng = np.random.default_rng(seed)
    raw = random_batch(rng, n_seq=40, max_len=300, wild=0.0, extreme_masked=False)
    a = dict(raw.arrays)
    cu, mask = a["cu_seqlens"], a["loss_mask"].copy()
    keep = [s for s in range(len(cu) - 1) if mask[cu[s] : cu[s + 1]].any()]
    idx = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in keep])
    lengths = np.array([cu[s + 1] - cu[s] for s in keep])
    out = {k: v[idx] for k, v in a.items() if k != "cu_seqlens"}
    out["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)])
    d = out["logp_train"] - out["logp_rollout"]  # rescale the mismatch: all modes see rejections
    out["logp_train"] = np.minimum(out["logp_rollout"] + d * scale, 0.0)
    return {k: out[k] for k in ("cu_seqlens", "logp_rollout", "logp_train", "entropy",
                                "loss_mask")}  # fmt: skip


@pytest.mark.parametrize(("seed", "scale"), [(1, 1.0), (2, 0.3), (3, 3.0), (4, 0.1)])
def test_matches_verl_definitions(seed: int, scale: float) -> None:
    arrays = _batch_with_live_sequences(seed, scale)
    row = derive_row(accumulate(Batch.from_arrays(**arrays), params=P)).to_dict()
    cu = arrays["cu_seqlens"]
    verl = verl_metrics(
        cu, arrays["logp_train"], arrays["logp_rollout"], arrays["loss_mask"], P.tis_c, MODES
    )
    assert set(PAIRS) <= set(verl)
    for name, key in PAIRS.items():
        got, want = _ours(row, key), verl[name]
        assert got is not None, name
        if "fraction" in name:  # counts: verl's 1e-8 in the denominator only
            assert got == pytest.approx(want, rel=1e-7, abs=1e-12), name
        elif name.startswith("rollout_is_seq"):
            # verl's per-sequence means carry a length-dependent bias of up to 1e-8·w̄ (its
            # masked mean's epsilon over n_s), which shows in spreads and deviations
            assert got == pytest.approx(want, rel=2e-6, abs=2e-8), (name, got, want)
        else:
            assert got == pytest.approx(want, rel=2e-7, abs=1e-12), (name, got, want)
    split = [m for m in MODES if 0.0 < row["mask_ratio"][m] < 1.0]
    assert len(split) >= 3, row["mask_ratio"]  # modes split the batch: not a vacuous comparison


def test_fp16_regime_every_metric_to_1e12() -> None:
    """|δ| ≈ 1e-4: every scalar metric within 1e-12 relative of the float64 reference (the p99
    is a histogram reading, checked to its resolution in test_engine; new spreads compared as
    variances, to 1e-12 of E[x²]-scaled cancellation)."""
    rng = np.random.default_rng(48)
    for _ in range(3):
        raw = fp16_like_batch(rng)
        got = derive_row(accumulate(Batch.from_arrays(**raw.from_arrays_kwargs()))).to_dict()
        want, sc = reference(raw.arrays, params=RefParams())
        for name in SCALAR_METRICS:
            if name == "log_ratio_abs_p99" or name not in want:  # step, batches: metadata
                continue
            g, w = got[name], want[name]
            if w is None:
                assert g is None, name
                continue
            if name in ("tis_weight_std", "seq_is_weight_std", "prob_abs_diff_std"):
                assert abs(g * g - w * w) <= 1e-12 * (w * w) + 1e-15 * sc[name], name
            elif name == "prob_pearson_corr":
                assert abs(g - w) <= 1e-12 * abs(w) + 1e-15 * sc[name], (name, g, w)
            else:
                assert math.isclose(g, w, rel_tol=1e-12, abs_tol=1e-300), (name, g, w)
        for p in ("token_k1", "token_k2", "token_k3", "seq_sum_k2", "seq_mean_k2", "seq_max_k3"):
            assert got["mask_ratio"][p] == want["mask_ratio"][p], p


def test_policy_params_of_the_new_modes_are_honoured() -> None:
    raw = random_batch(np.random.default_rng(5), n_seq=30, max_len=200)
    tight = RefParams(token_k1_lower=0.999, token_k1_upper=1.001, token_k2_upper=1e-6,
                      token_k3_upper=1e-6, seq_sum_k2_upper=1e-4, seq_sum_k3_upper=1e-4,
                      seq_mean_k2_upper=1e-6, seq_max_k2_upper=1e-5, seq_max_k3_upper=1e-5,
                      tis_c=1.001)  # fmt: skip
    batch = Batch.from_arrays(**raw.from_arrays_kwargs())
    got = derive_row(accumulate(batch, params=PolicyParams(**dataclasses.asdict(tight))))
    want, _ = reference(raw.arrays, params=tight)
    assert got.mask_ratio == want["mask_ratio"]
    assert got.seq_reject_ratio == want["seq_reject_ratio"]
    assert all(got.mask_ratio[p] for p in MODES), got.mask_ratio
    assert got.is_ratio_fraction_low == want["is_ratio_fraction_low"]
    assert got.seq_is_ratio_fraction_high == want["seq_is_ratio_fraction_high"]
