"""Three small batches whose every metric is worked out by hand below (not via reference.py).

LN2 = ln 2. Defaults: τ = 1.6, ε = 0.01, icepop [0.5, 5], kpop φ = 0.1, tis C = 2,
seq_mis [0.5, 2], geo_rs [0.999, 1.001], k3_rs κ = 0.01. The expected values are written as the
closed forms the hand derivation gives (e.g. (1.5 − ln 2)/4); a comment shows the working.
"""

from __future__ import annotations

import math
from typing import Any

from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.row import derive_row

LN2 = math.log(2.0)
E20 = math.exp(20.0)


def row_of(obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return derive_row(accumulate(Batch.from_json(obj, **kw))).to_dict()


def approx(got: Any, want: float, rtol: float = 1e-12, atol: float = 0.0) -> bool:
    return got is not None and abs(got - want) <= rtol * abs(want) + atol


def assert_scalars(row: dict[str, Any], want: dict[str, Any], rtol: float = 1e-12) -> None:
    for name, value in want.items():
        if value is None or isinstance(value, int | bool):
            assert row[name] == value, (name, row[name], value)
        elif isinstance(value, tuple):  # (value, rtol)
            assert approx(row[name], value[0], value[1]), (name, row[name], value[0])
        else:
            assert approx(row[name], value, rtol), (name, row[name], value)


def heat(cells: dict[tuple[int, int], int]) -> list[list[int]]:
    grid = [[0] * 6 for _ in range(7)]
    for (i, j), c in cells.items():
        grid[i][j] = c
    return grid


def test_ln2_batch() -> None:
    # seq 0: t0 μ=−ln2, π=0 → δ=ln2, r=2, H=0.5 | t1 μ=π=−1 → δ=0, r=1, H=0
    # seq 1: t2 masked out (absurd values) | t3 μ=0, π=−ln2 → δ=−ln2, r=½, H=1
    #        t4 μ=−2ln2, π=−ln2 → δ=ln2, r=2, H=0.2
    obj = {
        "cu_seqlens": [0, 2, 5],
        "logp_rollout": [-LN2, -1.0, -1e300, 0.0, -2 * LN2],
        "logp_train": [0.0, -1.0, -1e-300, -LN2, -LN2],
        "entropy": [0.5, 0.0, 1e300, 1.0, 0.2],
        "loss_mask": [1, 1, 0, 1, 1],
        "token_ids": [5, 6, 7, 8, 9],
        "token_ids_train": [5, 6, 100, 99, 9],  # t2 mismatch is masked out, t3 counts
        "versions": [3, 3, 3, 2, 3],
        "policy_version": 3,
        "step": 7,
    }
    row = row_of(obj)
    a = LN2**2
    assert_scalars(
        row,
        {
            "tokens": 4,
            "sequences": 2,
            # k3 = r−1−δ: 1−ln2, 0, ln2−½, 1−ln2 → Σ = 1.5 − ln2
            "mismatch_kl": (1.5 - LN2) / 4,
            "kl_k1": -LN2 / 4,  # −(ln2 + 0 − ln2 + ln2)/4
            "kl_k2": 3 * a / 8,  # (3·ln2²/2)/4
            "log_ratio_mean": LN2 / 4,
            "log_ratio_abs_mean": 3 * LN2 / 4,
            "log_ratio_abs_max": LN2,
            # rank ceil(0.99·4) = 4 → ln2 (0.6931) in bin [10^-0.16, 10^-0.155) = [0.6918, 0.6998);
            # centre 10^-0.1575 = 0.6962 > max → clipped to ln2
            "log_ratio_abs_p99": LN2,
            "prob_abs_diff_mean": (0.5 + 0 + 0.5 + 0.25) / 4,  # |1−½|, 0, |½−1|, |½−¼|
            "prob_abs_diff_max": 0.5,
            "is_ratio_mean": 5.5 / 4,
            "is_ratio_std": 3 * math.sqrt(3) / 8,  # E r² = 9.25/4, var = 2.3125 − 1.375² = 27/64
            "is_ratio_min": 0.5,
            "is_ratio_max": 2.0,
            "is_ess": 5.5**2 / (4 * 9.25),
            "chi2_token": 9.25 / 4 - 1,
            # L_0 = ln2 (n 2), L_1 = −ln2 + ln2 = 0 (n 2)
            "seq_log_ratio_abs_mean": LN2 / 2,
            "seq_log_ratio_abs_max": LN2,
            "seq_geo_ratio_mean": (math.sqrt(2) + 1) / 2,
            "chi2_seq": (3 + 0) / 2,  # e^{2 ln2} − 1 = 3, e^0 − 1 = 0
            "entropy_mean": 1.7 / 4,
            "noise_scale": 3 * a / (1.7 + 4 * 0.01),
            # x = δ² = (a, 0, a, a), y = (.5, 0, 1, .2): cov = a(1.7/4 − ¾·0.425) = 0.10625a,
            # sd_x = a√3/4, var_y = 1.29/4 − 0.425² = 0.141875 → 0.425 / √(3·0.141875)
            "entropy_delta_corr": 0.425 / math.sqrt(3 * 0.141875),
            "version_lag_mean": 0.25,  # lags 0, 0, 1, 0
            "version_lag_max": 1,
            "intra_switch_ratio": 0.5,  # seq 1's masked tokens carry versions {2, 3}
            "token_id_mismatch_ratio": 0.25,
            "discrepancy_kl": None,
            "staleness_kl": None,
            "teacher_soft_ratio": None,
            "teacher_hard_ratio": None,
            "nonfinite_tokens": 0,
        },
    )
    assert row["step"] == 7 and row["policy_version"] == 3
    # estr: δ² = 0.4805 vs 1.6(H+.01) = .816, .016, 1.616, .336 → t4 rejected
    # kpop: t0 D(1−1e-8 ‖ ½) ≈ ln2, t3 likewise, t4 D(½‖¼) = ½ln(4/3) = 0.144 > 0.1 → 3 rejected
    # icepop keeps r = ½ and 2 (closed interval); tis keeps r = 2 (rejects only r > 2)
    # seq_mis: e^{ln2} = 2 ≤ 2 kept, e^0 kept; geo_rs: √2 rejected, 1 kept;
    # k3_rs: mean k3 (1−ln2)/2 = .153 and ½ both > 0.01 → both rejected
    assert row["mask_ratio"] == {
        "estr": 0.25,
        "delta_abs": 0.0,
        "icepop": 0.0,
        "kpop": 0.75,
        "tis": 0.0,
        "seq_mis": 0.0,
        "geo_rs": 0.5,
        "k3_rs": 1.0,
        # verl's modes: token_k1 keeps −δ ∈ [ln .6, ln 1.6] = [−.51, .47] → only t1 (δ = 0);
        # k2 = δ²/2 = .24 and k3 ≤ .31 per token, sums .24/.48 and .31/.5, all ≤ 2.5;
        # seq_mean_k2 = .12 and .24 > .01 → both sequences rejected
        "token_k1": 0.75,
        "token_k2": 0.0,
        "token_k3": 0.0,
        "seq_sum_k2": 0.0,
        "seq_sum_k3": 0.0,
        "seq_mean_k2": 1.0,
        "seq_max_k2": 0.0,
        "seq_max_k3": 0.0,
    }
    assert row["seq_reject_ratio"] == {
        "seq_mis": 0.0, "geo_rs": 0.5, "k3_rs": 1.0, "seq_sum_k2": 0.0, "seq_sum_k3": 0.0,
        "seq_mean_k2": 1.0, "seq_max_k2": 0.0, "seq_max_k3": 0.0,
    }  # fmt: skip
    # verl-parity statistics: w = min(r, 2) = (2, 1, ½, 2); sequence means 1.5 and 1.25;
    # log-ppl differences −L_s/n_s = −ln2/2 and 0
    assert_scalars(
        row,
        {
            "is_ratio_fraction_low": 0.0,  # no r below ½
            "tis_weight_mean": 5.5 / 4,
            "tis_weight_ess": 5.5**2 / (4 * 9.25),
            "seq_is_weight_mean": 1.375,
            "seq_is_weight_std": 0.25 / math.sqrt(2),  # Bessel: ((.125)²·2)/1
            "seq_is_weight_max": 1.5,
            "seq_is_weight_min": 1.25,
            "seq_is_weight_max_deviation": 0.5,
            "seq_is_ratio_fraction_high": 0.0,
            "seq_is_ratio_fraction_low": 0.0,
            "log_ppl_diff": -LN2 / 4,
            "log_ppl_abs_diff": LN2 / 4,
            "log_ppl_diff_max": 0.0,
            "log_ppl_diff_min": -LN2 / 2,
            "ppl_ratio": (2**-0.5 + 1) / 2,
        },
    )
    (key,) = row["length_buckets"]
    assert int(key) == 1  # both n_s = 2
    b = row["length_buckets"][key]
    assert (b["sequences"], b["tokens"]) == (2, 4)
    assert approx(b["seq_log_ratio_abs_mean"], LN2 / 2) and approx(
        b["mismatch_kl"], (1.5 - LN2) / 4
    )
    # rows: H .5 → 4, 0 → 0, 1 → 5, .2 → 3; columns: ln2 → 4 ([.1, 1)), 0 → 0
    assert row["heatmap"]["all"] == heat({(4, 4): 1, (0, 0): 1, (5, 4): 1, (3, 4): 1})
    assert row["heatmap"]["estr_rejected"] == heat({(3, 4): 1})
    lags = {int(k): v for k, v in row["lag_buckets"].items()}
    assert sorted(lags) == [0, 1]
    assert lags[0]["tokens"] == 3 and approx(lags[0]["mismatch_kl"], 2 * (1 - LN2) / 3)
    assert lags[1]["tokens"] == 1 and approx(lags[1]["mismatch_kl"], LN2 - 0.5)
    # S = δ²/(H+ε): t4 a/.21 = 2.29, t0 a/.51 = .94, t3 a/1.01 = .48, t1 0
    worst = [(w["seq"], w["pos"], w["index"], w["token_id"]) for w in row["worst_tokens"]]
    assert worst == [(1, 2, 4, 9), (0, 0, 0, 5), (1, 1, 3, 8), (0, 1, 1, 6)]
    scores = [w["score"] for w in row["worst_tokens"]]
    for got, want in zip(scores, [a / 0.21, a / 0.51, a / 1.01, 0.0], strict=True):
        assert approx(got, want), (got, want)
    w0 = row["worst_tokens"][0]
    assert (w0["logp_rollout"], w0["logp_train"], w0["entropy"]) == (-2 * LN2, -LN2, 0.2)


def test_fp16_sized_single_token_sequences() -> None:
    # seq 0: one token, μ = −1e-4, π = 0 → δ = +1e-4 | seq 1: empty | seq 2: two masked-out
    # tokens | seq 3: one token μ = 0, π = −1e-4 → δ = −1e-4. H = 0 for both counted tokens.
    d = 1e-4
    obj = {
        "cu_seqlens": [0, 1, 1, 3, 4],
        "logp_rollout": [-d, -1e300, -745.0, 0.0],
        "logp_train": [0.0, 0.0, -1e308, -d],
        "entropy": [0.0, 1e300, 1e6, 0.0],
        "loss_mask": [1, 0, 0, 1],
        "logp_old": [-5e-5, -1e300, -1e300, 0.0],
        "logp_teacher": [math.log(0.5), -1e300, 0.0, math.log(0.99)],
        "entropy_source": "rollout",
    }
    row = row_of(obj)

    def k3(x: float) -> float:  # e^x − 1 − x by its series, to far below float64 resolution
        return x**2 / 2 + x**3 / 6 + x**4 / 24 + x**5 / 120

    assert_scalars(
        row,
        {
            "tokens": 2,
            "sequences": 2,
            "mismatch_kl": (d**2 + d**4 / 12) / 2,  # (k3(d) + k3(−d))/2 = cosh d − 1
            "kl_k1": 0.0,
            "kl_k2": d**2 / 2,
            "log_ratio_mean": 0.0,
            "log_ratio_abs_mean": d,
            "log_ratio_abs_max": d,
            "log_ratio_abs_p99": (d, 10 ** (1 / 400) - 1),  # 1e-4 sits on a bin edge
            "prob_abs_diff_mean": (d - d**2 / 2 + d**3 / 6 - d**4 / 24, 1e-10),  # 1 − e^−d
            "prob_abs_diff_max": (d - d**2 / 2 + d**3 / 6 - d**4 / 24, 1e-10),
            "is_ratio_mean": 1 + d**2 / 2 + d**4 / 24,  # cosh d
            "is_ratio_std": (d + d**3 / 6, 1e-6),  # sinh d (six digits at this size)
            "is_ratio_min": 1 - d + d**2 / 2 - d**3 / 6,
            "is_ratio_max": 1 + d + d**2 / 2 + d**3 / 6,
            # (Σr)²/(2Σr²) = cosh²d / cosh 2d = 1 − sinh²d / cosh 2d ≈ 1 − d² + d⁴·(5/3)
            "is_ess": 1 - d**2 + 5 * d**4 / 3,
            "chi2_token": (2 * d**2 + 2 * d**4 / 3, 1e-6),  # cosh 2d − 1
            "seq_log_ratio_abs_mean": d,  # L = ±d, n_s = 1
            "seq_log_ratio_abs_max": d,
            "seq_geo_ratio_mean": 1 + d**2 / 2 + d**4 / 24,
            "chi2_seq": (2 * d**2 + 2 * d**4 / 3, 1e-6),
            "entropy_mean": 0.0,
            "noise_scale": 2 * d**2 / 0.02,
            "entropy_delta_corr": None,  # H constant (0): no correlation
            "discrepancy_kl": (k3(5e-5) + k3(0.0)) / 2,  # old − μ: 5e-5, 0
            "staleness_kl": (k3(5e-5) + k3(-d)) / 2,  # π − old: 5e-5, −1e-4
            "teacher_soft_ratio": 0.5,  # p = .5 soft, p = .99 hard
            "teacher_hard_ratio": 0.5,
            "version_lag_mean": None,
            "version_lag_max": None,
            "intra_switch_ratio": None,
            "token_id_mismatch_ratio": None,
            "nonfinite_tokens": 0,
        },
        rtol=1e-9,
    )
    assert row["entropy_source"] == "rollout"
    assert set(row["mask_ratio"].values()) == {0.0}  # every policy keeps both tokens
    assert set(row["seq_reject_ratio"].values()) == {0.0}
    (key,) = row["length_buckets"]
    assert int(key) == 0
    b = row["length_buckets"][key]
    assert (b["sequences"], b["tokens"]) == (2, 2) and approx(b["seq_log_ratio_abs_mean"], d)
    # H = 0 → row 0; |δ| = 1e-4 → column 1 (bins are left-closed)
    assert row["heatmap"]["all"] == heat({(0, 1): 2})
    assert row["heatmap"]["estr_rejected"] == heat({})
    assert not row["lag_buckets"]
    # equal scores d²/ε: the tie goes to the lower flat index
    worst = [(w["seq"], w["pos"], w["index"], w["token_id"]) for w in row["worst_tokens"]]
    assert worst == [(0, 0, 0, None), (3, 0, 3, None)]
    assert all(approx(w["score"], d**2 / 0.01, 1e-9) for w in row["worst_tokens"])


def test_clamped_deltas_constant_entropy_and_drop() -> None:
    # one sequence: t0 μ=−30, π=0 → δ=30 (r clamps to e^20) | t1 μ=0, π=−25 → δ=−25
    # (r = e^−20) | t2 δ = 0 | t3 logp_rollout NaN → dropped under nonfinite="drop"
    # H = 0.7 everywhere (constant; 0.7 is not a binary fraction, so Σ(H) and Σ(H²) round and
    # a variance formed from them is not exactly 0).
    obj = {
        "cu_seqlens": [0, 4],
        "logp_rollout": [-30.0, 0.0, -1.0, math.nan],
        "logp_train": [0.0, -25.0, -1.0, 0.0],
        "entropy": [0.7, 0.7, 0.7, 0.7],
        "loss_mask": [1, 1, 1, 1],
        "token_ids": [1, 2, 3, 4],
        "token_ids_train": [1, 2, 3, 4],
        "versions": [5, 6, 6, 6],
        "policy_version": 6,
    }
    row = row_of(obj, nonfinite="drop")
    ei = 1 / E20
    sum_r = E20 + ei + 1
    sum_r2 = E20**2 + ei**2 + 1
    assert_scalars(
        row,
        {
            "tokens": 3,
            "sequences": 1,
            "nonfinite_tokens": 1,
            # k3 on the clamped δ: (e^20 − 1 − 20) + (e^−20 − 1 + 20) + 0
            "mismatch_kl": (E20 + ei - 2) / 3,
            "kl_k1": -5 / 3,  # k1, k2 and |δ| use the raw δ
            "kl_k2": (900 + 625) / 6,
            "log_ratio_mean": 5 / 3,
            "log_ratio_abs_mean": 55 / 3,
            "log_ratio_abs_max": 30.0,
            # rank 3 → 30: bin centre 10^1.4775 = 30.03 → clipped to the max, 30
            "log_ratio_abs_p99": 30.0,
            "prob_abs_diff_mean": (2 - math.exp(-30) - math.exp(-25)) / 3,
            "prob_abs_diff_max": 1 - math.exp(-30),
            "is_ratio_mean": sum_r / 3,
            "is_ratio_std": math.sqrt(sum_r2 / 3 - (sum_r / 3) ** 2),
            "is_ratio_min": ei,
            "is_ratio_max": E20,
            "is_ess": sum_r**2 / (3 * sum_r2),
            "chi2_token": sum_r2 / 3 - 1,
            # L = 30 − 25 + 0 = 5 from the raw δ (the clamped ones would give 0)
            "seq_log_ratio_abs_mean": 5.0,
            "seq_log_ratio_abs_max": 5.0,
            "seq_geo_ratio_mean": math.exp(5 / 3),
            "chi2_seq": math.exp(10) - 1,
            "entropy_mean": 0.7,
            "noise_scale": 1525 / (3 * 0.71),
            "entropy_delta_corr": None,  # Var H = 0: Pearson undefined → null
            "version_lag_mean": 1 / 3,  # lags 1, 0, 0
            "version_lag_max": 1,
            "intra_switch_ratio": 1.0,
            "token_id_mismatch_ratio": 0.0,  # present and clean: 0, not None
        },
        rtol=1e-9,
    )
    # estr: δ² 900, 625 > 1.6·0.71 → 2 of 3; delta_abs same; icepop: e^±20 outside → 2/3;
    # kpop: p or q clipped to 1e-8 against 1 − 1e-8 → 2/3; tis: only e^20 > 2 → 1/3;
    # sequence: e^5 > 2, e^{5/3} > 1.001, mean k3 ≫ 0.01 → all rejected
    third = 1 / 3
    assert row["mask_ratio"] == {
        "estr": 2 * third,
        "delta_abs": 2 * third,
        "icepop": 2 * third,
        "kpop": 2 * third,
        "tis": third,
        "seq_mis": 1.0,
        "geo_rs": 1.0,
        "k3_rs": 1.0,
        # verl's modes on δc = 20, −20, 0: k1 = −δc outside [ln .6, ln 1.6], k2 = 200 and
        # k3 ≥ 19 above 2.5 for both clamped tokens → 2/3; the sequence fails all five
        "token_k1": 2 * third,
        "token_k2": 2 * third,
        "token_k3": 2 * third,
        "seq_sum_k2": 1.0,
        "seq_sum_k3": 1.0,
        "seq_mean_k2": 1.0,
        "seq_max_k2": 1.0,
        "seq_max_k3": 1.0,
    }
    assert row["seq_reject_ratio"] == {
        "seq_mis": 1.0, "geo_rs": 1.0, "k3_rs": 1.0, "seq_sum_k2": 1.0, "seq_sum_k3": 1.0,
        "seq_mean_k2": 1.0, "seq_max_k2": 1.0, "seq_max_k3": 1.0,
    }  # fmt: skip
    # w = min(r, 2) = (2, e^−20, 1); mean π = −26/3, mean μ = −31/3; raw mean r ≫ 2
    assert_scalars(
        row,
        {
            "is_ratio_fraction_low": third,
            "tis_weight_mean": (3 + ei) / 3,
            "seq_is_weight_mean": (3 + ei) / 3,
            "seq_is_weight_std": None,  # one sequence: no sample spread
            "seq_is_ratio_fraction_high": 1.0,
            "seq_is_ratio_fraction_low": 0.0,
            "training_log_ppl": 26 / 3,
            "rollout_log_ppl": 31 / 3,
            "training_ppl": math.exp(26 / 3),
            "rollout_ppl": math.exp(31 / 3),
            "log_ppl_diff": -5 / 3,
            "ppl_ratio": math.exp(-5 / 3),
        },
        rtol=1e-12,
    )
    # H = 0.7 → row 4 ([0.3, 1)); |δ| 30, 25 → column 5, 0 → column 0
    assert row["heatmap"]["all"] == heat({(4, 5): 2, (4, 0): 1})
    assert row["heatmap"]["estr_rejected"] == heat({(4, 5): 2})
    lags = {int(k): v for k, v in row["lag_buckets"].items()}
    assert lags[0]["tokens"] == 2 and approx(lags[0]["mismatch_kl"], (19 + ei) / 2, 1e-9)
    assert lags[1]["tokens"] == 1 and approx(lags[1]["mismatch_kl"], E20 - 21, 1e-9)
    worst = [(w["index"], w["pos"]) for w in row["worst_tokens"]]
    assert worst == [(0, 0), (1, 1), (2, 2)]  # S = 900/.71, 625/.71, 0; the NaN token is gone
