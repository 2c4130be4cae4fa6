"""The diagnosis rules on synthetic step series: each rule fires on its own pattern and stays
quiet on a healthy series, a missing input lands in ``not_checked`` with its reason, and the
ranking and the ``to_dict`` contract hold (every cause once, scores in [0, 1], best first)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from timwatch.monitor.cli.diagnose import FIRES as CLI_FIRES
from timwatch.monitor.diagnosis import CAUSES, FIRES, StepSeries, diagnose
from timwatch.monitor.diagnosis import thresholds as th

N = 24


def flat(v: float | None, n: int = N) -> list[float | None]:
    return [v] * n


def line(a: float, b: float, n: int = N) -> list[float]:
    return list(np.linspace(a, b, n))


def length_buckets(k3s: dict[int, float], tokens: int = 400) -> dict[str, Any]:
    return {str(b): {"sequences": 10, "tokens": tokens, "mismatch_kl": k, "seq_log_ratio_abs_mean":
                     0.1} for b, k in k3s.items()}  # fmt: skip


def lag_buckets(k3s: dict[int, float], tokens: int = 400) -> dict[str, Any]:
    return {str(lag): {"tokens": tokens, "mismatch_kl": k} for lag, k in k3s.items()}


def healthy_columns() -> dict[str, list[float | None]]:
    return {
        "tokens": flat(4096),
        "mismatch_kl": flat(1e-12),  # an fp32 engine's floor (docs/diagnosis.md)
        "discrepancy_kl": flat(1e-12),
        "staleness_kl": flat(0.0),
        "entropy_mean": flat(1.5),
        "entropy_delta_corr": flat(0.01),
        "noise_scale": flat(2e-12),
        "version_lag_mean": flat(0.0),
        "version_lag_max": flat(0.0),
        "intra_switch_ratio": flat(0.0),
        "token_id_mismatch_ratio": flat(0.0),
        "seq_log_ratio_abs_mean": flat(0.01),
        "mask_ratio_estr": flat(0.0),
        "mask_ratio_delta_abs": flat(0.0),
    }


def healthy_details(n: int = N) -> dict[int, dict[str, Any]]:
    return {
        s: {
            "length_buckets": length_buckets({2: 1e-12, 3: 1e-12, 4: 1e-12}),
            "lag_buckets": lag_buckets({0: 1e-12}),
            "worst_tokens": [{"logp_rollout": -0.5}] * 4,
        }
        for s in range(n)
    }


def make(
    cols: dict[str, Any] | None = None, details: dict[int, dict[str, Any]] | None = None,
    probe: StepSeries | None = None, **over: Any,
) -> StepSeries:  # fmt: skip
    base = healthy_columns() if cols is None else cols
    base = {**base, **over}
    return StepSeries.build(
        "r", list(range(N)), base, healthy_details() if details is None else details, probe
    )


def scores(series: StepSeries) -> dict[str, float]:
    return {c["cause"]: c["score"] for c in diagnose(series).to_dict()["causes"]}


def top(series: StepSeries) -> str:
    return diagnose(series).to_dict()["causes"][0]["cause"]


def test_healthy_series_fires_nothing() -> None:
    s = scores(make())
    assert set(s) == {c for c in CAUSES if c not in ("decode_vs_prefill", "teacher_collapse")}
    assert max(s.values()) < FIRES, s


def test_precision_fires_on_an_engine_only_gap_that_scales_with_entropy() -> None:
    s = make(discrepancy_kl=flat(3e-3), mismatch_kl=flat(3e-3), entropy_delta_corr=flat(0.3),
             noise_scale=flat(th.NOISE_BF16))  # fmt: skip
    d = diagnose(s).to_dict()
    first = d["causes"][0]
    assert first["cause"] == "precision" and first["score"] >= FIRES
    assert "0.003" in first["verdict"] and "bf16" in first["verdict"]
    assert "actor_rollout_ref.rollout.dtype" in first["action"]
    assert {e["metric"] for e in first["evidence"]} >= {"discrepancy_kl", "noise_scale"}
    # without the entropy correlation the same gap scores lower
    weaker = scores(make(discrepancy_kl=flat(3e-3), mismatch_kl=flat(3e-3),
                         entropy_delta_corr=flat(0.0)))["precision"]  # fmt: skip
    assert weaker < first["score"]


def test_precision_fires_at_the_fp16_rounding_level_and_says_so() -> None:
    s = make(discrepancy_kl=flat(7e-6), mismatch_kl=flat(7e-6), noise_scale=flat(1.5e-5))
    first = diagnose(s).to_dict()["causes"][0]
    assert first["cause"] == "precision" and first["score"] >= FIRES
    assert "nearest fp16" in first["verdict"]
    assert first["action"].startswith("The gap sits at FP16's rounding level")
    # the fp32 floor is no gap; the ramp is on a log scale between the two
    assert scores(make(discrepancy_kl=flat(1e-12), mismatch_kl=flat(1e-12)))["precision"] == 0
    mid = scores(make(discrepancy_kl=flat(1e-7), mismatch_kl=flat(1e-7)))["precision"]
    assert 0 < mid < first["score"]


def test_precision_yields_to_a_localized_cause() -> None:
    bf16 = {"discrepancy_kl": flat(7e-4), "mismatch_kl": flat(7e-4),
            "noise_scale": flat(th.NOISE_BF16)}  # fmt: skip
    alone = scores(make(**bf16))["precision"]
    rising = healthy_details()
    for d in rising.values():
        d["length_buckets"] = length_buckets({2: 1e-4, 3: 4e-4, 4: 1.6e-3})
    d = diagnose(make(details=rising, **bf16)).to_dict()
    assert d["causes"][0]["cause"] == "length"
    prec = next(c for c in d["causes"] if c["cause"] == "precision")
    assert prec["score"] == pytest.approx(alone * (1 - th.LOCALIZED_SHARE), abs=1e-3)
    assert "grows ×4 per doubling of length" in prec["verdict"]
    probe = StepSeries.build("r-prefill-probe", list(range(N)), {"mismatch_kl": flat(7e-4)})
    d = diagnose(make(probe=probe, **bf16)).to_dict()
    assert d["causes"][0]["cause"] == "decode_vs_prefill"
    prec = next(c for c in d["causes"] if c["cause"] == "precision")
    assert "the decode path holds it" in prec["verdict"] and prec["score"] < alone


def test_precision_uses_the_lag0_bucket_without_logp_old() -> None:
    cols = healthy_columns()
    del cols["discrepancy_kl"], cols["staleness_kl"]
    details = healthy_details()
    for d in details.values():
        d["lag_buckets"] = lag_buckets({0: 3e-3, 1: 3e-3})
    f = diagnose(make(cols, details)).to_dict()["causes"]
    prec = next(c for c in f if c["cause"] == "precision")
    assert prec["score"] >= FIRES
    assert prec["evidence"][0]["metric"] == "lag_buckets[0].mismatch_kl"


def test_staleness_fires_when_staleness_dominates() -> None:
    s = make(staleness_kl=flat(5e-3), discrepancy_kl=flat(1e-5), mismatch_kl=flat(5e-3),
             version_lag_mean=flat(3.0), version_lag_max=flat(3.0))  # fmt: skip
    d = diagnose(s).to_dict()
    assert d["causes"][0]["cause"] == "staleness"
    assert d["causes"][0]["score"] >= FIRES
    assert "500x discrepancy_kl" in d["causes"][0]["verdict"]
    assert scores(s)["precision"] < FIRES


def test_staleness_fires_from_lag_buckets_alone() -> None:
    cols = healthy_columns()
    del cols["discrepancy_kl"], cols["staleness_kl"]
    details = healthy_details()
    for d in details.values():
        d["lag_buckets"] = lag_buckets({0: 1e-5, 1: 1e-4, 2: 1e-3})
    s = make(cols, details, version_lag_mean=flat(1.0), version_lag_max=flat(2.0))
    f = next(c for c in diagnose(s).to_dict()["causes"] if c["cause"] == "staleness")
    assert f["score"] >= FIRES and "from lag 0 to 2" in f["verdict"]


def test_length_fires_when_k3_per_token_rises_with_length() -> None:
    details = healthy_details()
    for d in details.values():
        d["length_buckets"] = length_buckets({2: 1e-4, 3: 4e-4, 4: 1.6e-3})
    s = make(details=details, mismatch_kl=flat(1e-3))
    f = next(c for c in diagnose(s).to_dict()["causes"] if c["cause"] == "length")
    assert f["score"] >= FIRES and "×4 per doubling" in f["verdict"]
    assert "rollout_rs=geometric" in f["action"]


def test_tokenization_fires_on_any_differing_id_and_ranks_first() -> None:
    ratio = flat(0.0)
    ratio[10] = 0.02
    s = make(token_id_mismatch_ratio=ratio, discrepancy_kl=flat(3e-3), mismatch_kl=flat(3e-3),
             entropy_delta_corr=flat(0.3))  # fmt: skip
    d = diagnose(s).to_dict()
    assert d["causes"][0]["cause"] == "tokenization"
    assert "1 of 24 steps" in d["causes"][0]["verdict"]
    assert "first at step 10" in d["causes"][0]["evidence"][0]["detail"]


def test_decode_vs_prefill_reads_the_probe_run() -> None:
    def with_probe(kl: float) -> StepSeries:
        probe = StepSeries.build("r-prefill-probe", list(range(N)), {"mismatch_kl": flat(kl)})
        return make(discrepancy_kl=flat(2e-3), mismatch_kl=flat(2e-3), probe=probe)

    high = next(c for c in diagnose(with_probe(2e-3)).to_dict()["causes"]
                if c["cause"] == "decode_vs_prefill")  # fmt: skip
    assert high["score"] >= FIRES and "decode path" in high["verdict"]
    low = scores(with_probe(1e-5))["decode_vs_prefill"]
    assert low < FIRES
    nc = {n["cause"]: n["reason"] for n in diagnose(make()).to_dict()["not_checked"]}
    assert "r-prefill-probe" in nc["decode_vs_prefill"]


def test_entropy_collapse_fires_on_falling_entropy_and_low_mu_worst_tokens() -> None:
    details = healthy_details()
    for d in details.values():
        d["worst_tokens"] = [{"logp_rollout": -4.0}] * 8
    s = make(details=details, entropy_mean=line(2.0, 0.2), mismatch_kl=flat(1e-3),
             noise_scale=line(1e-3, 4e-3))  # fmt: skip
    assert top(s) == "entropy_collapse"
    assert scores(s)["entropy_collapse"] >= FIRES
    # the same fall with a negligible mismatch is no cause of it
    quiet = make(details=details, entropy_mean=line(2.0, 0.2), mismatch_kl=flat(1e-9))
    assert scores(quiet)["entropy_collapse"] < FIRES


def test_teacher_collapse_fires_when_the_soft_share_vanishes() -> None:
    s = make(teacher_hard_ratio=line(0.7, 1.0), teacher_soft_ratio=line(0.2, 0.0))
    f = next(c for c in diagnose(s).to_dict()["causes"] if c["cause"] == "teacher_collapse")
    assert f["score"] >= FIRES and "→" in f["verdict"]
    # early third ≈ 0.74, late ≈ 0.96: the soft share shrank ×6 or more
    assert f["evidence"][0]["detail"].startswith("first third 0.74")
    assert scores(make(teacher_hard_ratio=flat(0.7)))["teacher_collapse"] == 0
    # a ×1.5 rise that still leaves soft targets (a student drifting from a steady teacher,
    # measured 0.55 → 0.85) is no collapse
    assert scores(make(teacher_hard_ratio=line(0.55, 0.85)))["teacher_collapse"] < FIRES


def test_missing_inputs_are_not_checked_with_their_reason() -> None:
    s = StepSeries.build("bare", list(range(N)), {"mismatch_kl": flat(1e-3)})
    d = diagnose(s).to_dict()
    reasons = {n["cause"]: n["reason"] for n in d["not_checked"]}
    assert set(reasons) == {"staleness", "tokenization", "decode_vs_prefill", "length",
                            "entropy_collapse", "teacher_collapse"}  # fmt: skip
    assert "logp_old" in reasons["staleness"] and "versions" in reasons["staleness"]
    assert "entropy" in reasons["entropy_collapse"]
    assert "logp_teacher" in reasons["teacher_collapse"]
    (prec,) = d["causes"]
    assert prec["cause"] == "precision" and "no versions" in prec["evidence"][0]["detail"]


def test_stale_tokens_without_logp_old_leave_precision_unchecked() -> None:
    s = StepSeries.build("stale", list(range(N)), {
        "mismatch_kl": flat(1e-3), "version_lag_max": flat(2.0), "version_lag_mean": flat(2.0),
    })  # fmt: skip
    reasons = {n["cause"]: n["reason"] for n in diagnose(s).to_dict()["not_checked"]}
    assert "discrepancy_kl" in reasons["precision"]


def test_contract_ranking_and_json() -> None:
    series = make(staleness_kl=flat(2e-4), discrepancy_kl=flat(5e-4), mismatch_kl=flat(7e-4),
                  entropy_delta_corr=flat(0.1), noise_scale=[math.nan] * N)  # fmt: skip
    d = diagnose(series).to_dict()
    assert set(d) == {"run", "from_step", "to_step", "steps", "causes", "not_checked", "scalars"}
    assert (d["run"], d["from_step"], d["to_step"], d["steps"]) == ("r", 0, N - 1, N)
    got = [c["cause"] for c in d["causes"]] + [n["cause"] for n in d["not_checked"]]
    assert sorted(got) == sorted(CAUSES)
    ranked = [c["score"] for c in d["causes"]]
    assert ranked == sorted(ranked, reverse=True)
    for c in d["causes"]:
        assert set(c) == {"cause", "score", "verdict", "action", "evidence"}
        assert 0.0 <= c["score"] <= 1.0 and c["verdict"] and c["action"]
        for e in c["evidence"]:
            assert set(e) == {"metric", "steps", "value", "trend", "detail"}
            assert len(e["steps"]) == 2
    json.dumps(d, allow_nan=False)  # NaN never reaches the JSON


def test_empty_window_checks_nothing() -> None:
    d = diagnose(StepSeries.build("e", [], {}), 5, 9).to_dict()
    assert d["steps"] == 0 and d["causes"] == [] and (d["from_step"], d["to_step"]) == (5, 9)
    assert {n["cause"] for n in d["not_checked"]} == set(CAUSES)


def test_build_refuses_ragged_columns() -> None:
    with pytest.raises(ValueError, match="mismatch_kl"):
        StepSeries.build("x", [0, 1], {"mismatch_kl": [1.0]})


def test_cli_threshold_is_the_rules_threshold() -> None:
    assert CLI_FIRES == FIRES
