"""The metric engine against the independent float64 reference, on many random ragged batches.

Tolerances: rtol 1e-9 where the value is a plain mean; counts, mask ratios, heatmap cells and
bucket sizes exactly; min/max to 1e-12; ``log_ratio_abs_p99`` within the histogram's stated
resolution (10^(1/400) − 1 ≈ 0.58 %, docs/definitions.md); standard deviation and correlation
within what moments from additive sums can deliver (the reference states each metric's term
magnitude, see ``reference.reference``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.batches import RawBatch, fp16_like_batch, random_batch, random_batches, split_at
from tests.helpers.reference import POLICY_NAMES, SEQ_POLICIES, RefParams, reference
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import Accumulator, accumulate
from timwatch.monitor.core.masks import PolicyParams
from timwatch.monitor.core.row import derive_row

P99_REL = 10 ** (1 / 400) - 1
RTOL = 1e-9
SUM_EPS = 1e-10  # allowed summation error, relative to the mean magnitude of a metric's terms

MEANS = [
    "mismatch_kl", "kl_k1", "kl_k2", "log_ratio_mean", "log_ratio_abs_mean", "prob_abs_diff_mean",
    "is_ratio_mean", "chi2_token", "entropy_mean", "noise_scale", "seq_log_ratio_abs_mean",
    "seq_geo_ratio_mean", "chi2_seq", "discrepancy_kl", "staleness_kl", "is_ess",
    "version_lag_mean", "tis_weight_mean", "tis_weight_ess", "training_ppl", "training_log_ppl",
    "rollout_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio",
    "seq_is_weight_mean",
]  # fmt: skip
EXTREMES = [
    "log_ratio_abs_max", "prob_abs_diff_max", "is_ratio_min", "is_ratio_max",
    "seq_log_ratio_abs_max", "log_ppl_diff_max", "log_ppl_diff_min", "seq_is_weight_max",
    "seq_is_weight_min", "seq_is_weight_max_deviation",
]  # fmt: skip
EXACT = [
    "tokens", "sequences", "nonfinite_tokens", "version_lag_max", "intra_switch_ratio",
    "token_id_mismatch_ratio", "teacher_soft_ratio", "teacher_hard_ratio",
    "is_ratio_fraction_low", "seq_is_ratio_fraction_high", "seq_is_ratio_fraction_low",
]  # fmt: skip
VARIANCES = ["is_ratio_std", "tis_weight_std", "prob_abs_diff_std", "seq_is_weight_std"]
CORRELATIONS = ["entropy_delta_corr", "prob_pearson_corr"]
SCALARS = MEANS + EXTREMES + EXACT + VARIANCES + CORRELATIONS + ["log_ratio_abs_p99"]


def engine_params(p: RefParams) -> PolicyParams:
    return PolicyParams(**dataclasses.asdict(p))


def close(got: Any, want: float, rtol: float, atol: float, what: str) -> None:
    assert got is not None, f"{what}: got None, want {want!r}"
    assert math.isfinite(got), f"{what}: got {got!r}, want {want!r}"
    assert abs(got - want) <= rtol * abs(want) + atol, f"{what}: got {got!r}, want {want!r}"


def check_row(
    got: dict[str, Any], ref: dict[str, Any], sc: dict[str, float], *, merged: bool = False
) -> None:
    """Assert the engine's row equals the reference row within each metric's tolerance."""
    for name in SCALARS:
        assert name in got, f"row lacks {name}"
        want = ref[name]
        if want is None:
            assert got[name] is None, f"{name}: got {got[name]!r}, want None"
            continue
        if name in MEANS:
            close(got[name], want, RTOL, SUM_EPS * sc.get(name, abs(want)), name)
        elif name in EXTREMES:
            # r may legitimately be formed as 1 + expm1(δ): absolute error ≤ ~2 ulp(1) near 0.
            atol = 4.5e-16 if name.startswith("is_ratio") else 0.0
            close(got[name], want, 1e-12, atol + SUM_EPS * sc.get(name, 0.0), name)
        elif name in EXACT:
            assert got[name] == want, f"{name}: got {got[name]!r}, want {want!r}"
        elif name in VARIANCES:
            # Var from Σx² − (Σx)²/N may lose SUM_EPS·E[x²] absolutely: compare variances.
            close(got[name] ** 2, want**2, 2 * RTOL, SUM_EPS * sc[name], name)
        elif name in CORRELATIONS:
            close(got[name], want, 0.0, RTOL + SUM_EPS * sc[name], name)
        elif name == "log_ratio_abs_p99":
            if want < 1e-12:
                assert got[name] == 0.0, f"p99: got {got[name]!r}, want 0 (underflow bin)"
            else:
                close(got[name], want, P99_REL + 1e-12, 0.0, name)
                assert got[name] <= got["log_ratio_abs_max"], "p99 above the max"

    assert got["mask_ratio"] == ref["mask_ratio"], (got["mask_ratio"], ref["mask_ratio"])
    assert set(got["mask_ratio"]) == set(POLICY_NAMES)
    assert got["seq_reject_ratio"] == ref["seq_reject_ratio"]
    assert set(got["seq_reject_ratio"]) == set(SEQ_POLICIES)

    gb = {int(k): v for k, v in got["length_buckets"].items()}
    assert sorted(gb) == sorted(ref["length_buckets"]), (sorted(gb), sorted(ref["length_buckets"]))
    for b, want in ref["length_buckets"].items():
        assert (gb[b]["sequences"], gb[b]["tokens"]) == (want["sequences"], want["tokens"]), b
        close(
            gb[b]["seq_log_ratio_abs_mean"],
            want["seq_log_ratio_abs_mean"],
            RTOL,
            SUM_EPS * sc["seq_log_ratio_abs_mean"] * ref["sequences"] / want["sequences"],
            f"length_buckets[{b}].seq_log_ratio_abs_mean",
        )
        close(gb[b]["mismatch_kl"], want["mismatch_kl"], RTOL, 0.0, f"length_buckets[{b}].kl")

    assert got["heatmap"]["all"] == ref["heatmap"]["all"]
    assert got["heatmap"]["estr_rejected"] == ref["heatmap"]["estr_rejected"]

    if not ref["lag_buckets"]:  # absent inputs, or no masked token: None or {} both fine
        assert not got["lag_buckets"], got["lag_buckets"]
    else:
        gl = {int(k): v for k, v in got["lag_buckets"].items()}
        assert sorted(gl) == sorted(ref["lag_buckets"])
        for lag, want in ref["lag_buckets"].items():
            assert gl[lag]["tokens"] == want["tokens"], lag
            close(gl[lag]["mismatch_kl"], want["mismatch_kl"], RTOL, 0.0, f"lag_buckets[{lag}]")

    gw, rw = got["worst_tokens"], ref["worst_tokens"]
    assert len(gw) == len(rw)
    keys = ("pos", "token_id", "logp_rollout", "logp_train", "entropy")
    if not merged:  # after a merge, seq/index are relative to each part
        keys = ("seq", "index", *keys)
    for i, (g, w) in enumerate(zip(gw, rw, strict=True)):
        assert {k: g[k] for k in keys} == {k: w[k] for k in keys}, (i, g, w)
        close(g["score"], w["score"], 1e-12, 0.0, f"worst_tokens[{i}].score")


DEFAULTS = RefParams()


def run_engine(raw: RawBatch, p: RefParams = DEFAULTS, **kw: Any) -> dict[str, Any]:
    batch = Batch.from_arrays(**raw.from_arrays_kwargs(), **kw)
    return derive_row(accumulate(batch, params=engine_params(p))).to_dict()


def run_reference(raw: RawBatch, p: RefParams = DEFAULTS) -> tuple[dict[str, Any], dict]:
    return reference(raw.arrays, policy_version=raw.policy_version, params=p)


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_reference(seed: int) -> None:
    for raw in random_batches(100 + seed, 8):
        got = run_engine(raw)
        ref, sc = run_reference(raw)
        check_row(got, ref, sc)
        assert (got["step"], got["policy_version"]) == (raw.step, raw.policy_version)
        assert got["entropy_source"] == raw.entropy_source and got["batches"] == 1


def test_tame_batches_match_reference() -> None:
    """No δ past the clamp: the small metrics are not drowned by e^20-sized terms."""
    for raw in random_batches(7, 12, wild=0.0, optional="all"):
        check_row(run_engine(raw), *run_reference(raw))


def test_long_sequences_match_reference() -> None:
    """8k-token sequences (length buckets up to 2^12, sums over thousands of tokens)."""
    rng = np.random.default_rng(21)
    for _ in range(3):
        raw = random_batch(rng, n_seq=6, long_prob=0.5, optional="all")
        check_row(run_engine(raw), *run_reference(raw))


@pytest.mark.parametrize(
    "p",
    [
        RefParams(tau=0.7),
        RefParams(tau=0.3, eps=0.05, delta_abs_c=0.2, icepop_low=0.8, icepop_high=1.25),
        RefParams(kpop_phi=2.0, tis_c=1.1, seq_mis_low=0.9, seq_mis_high=1.1),
        RefParams(geo_rs_low=0.99, geo_rs_high=1.01, k3_rs_kappa=1e-4),
    ],
)
def test_policy_params_are_honoured(p: RefParams) -> None:
    for raw in random_batches(31, 4, wild=0.01):
        check_row(run_engine(raw, p), *run_reference(raw, p))


def test_optional_inputs_absent_give_none() -> None:
    for raw in random_batches(41, 4, optional="none"):
        got = run_engine(raw)
        for name in (
            "version_lag_mean", "version_lag_max", "intra_switch_ratio",
            "token_id_mismatch_ratio", "discrepancy_kl", "staleness_kl",
            "teacher_soft_ratio", "teacher_hard_ratio",
        ):  # fmt: skip
            assert got[name] is None, name
        assert not got["lag_buckets"]
        assert all(w["token_id"] is None for w in got["worst_tokens"])
        check_row(got, *run_reference(raw))


def test_versions_without_policy_version() -> None:
    """intra_switch_ratio needs versions only; lag metrics need policy_version too."""
    rng = np.random.default_rng(43)
    raw = random_batch(rng, n_seq=12, optional="all")
    raw = dataclasses.replace(raw, policy_version=None)
    got = run_engine(raw)
    assert got["version_lag_mean"] is None and got["version_lag_max"] is None
    assert got["intra_switch_ratio"] is not None
    check_row(got, *run_reference(raw))


def test_fully_masked_batch() -> None:
    """Every token outside the loss mask: N = 0, every mean null, nothing divides by zero."""
    rng = np.random.default_rng(45)
    raw = random_batch(rng, n_seq=5, optional="all")
    raw.arrays["loss_mask"] = np.zeros_like(raw.arrays["loss_mask"])
    got = run_engine(raw)
    ref, sc = run_reference(raw)
    assert got["tokens"] == 0 and got["sequences"] == 0
    assert got["mismatch_kl"] is None and got["worst_tokens"] == []
    check_row(got, ref, sc)


def test_fp16_like_precision() -> None:
    """|δ| ≈ 1e-4: k3 ≈ 5e-9 must not cancel to noise (docs/definitions.md), nor the IS-ratio
    spread."""
    rng = np.random.default_rng(47)
    for _ in range(3):
        raw = fp16_like_batch(rng)
        got = run_engine(raw)
        ref, sc = run_reference(raw)
        check_row(got, ref, sc)
        for name in ("mismatch_kl", "kl_k2", "noise_scale", "log_ratio_abs_mean"):
            close(got[name], ref[name], 1e-9, 0.0, name)
        # What a user reads off the dashboard: six significant digits of the IS-ratio spread.
        close(got["is_ratio_std"], ref["is_ratio_std"], 1e-6, 0.0, "is_ratio_std")


def test_float32_and_torch_inputs() -> None:
    for raw in random_batches(49, 3, optional="all"):
        f32 = dataclasses.replace(
            raw,
            arrays={
                # clip the generator's ±1e300 masked extremes into float32 range first
                k: (np.clip(v, -3e38, 3e38).astype(np.float32) if v.dtype.kind == "f" else v)
                for k, v in raw.arrays.items()
            },
        )
        check_row(run_engine(f32), *run_reference(f32))
        t = Batch.from_arrays(
            **{k: torch.from_numpy(v) for k, v in raw.arrays.items()}, **raw.meta()
        )
        assert derive_row(accumulate(t)).to_dict() == run_engine(raw)


def test_nonfinite_drop_matches_reference_with_positions_masked() -> None:
    rng = np.random.default_rng(51)
    for _ in range(4):
        raw = random_batch(rng, optional="all")
        on = np.flatnonzero(np.asarray(raw.arrays["loss_mask"]) == 1)
        bad = rng.choice(on, size=min(3, on.size), replace=False)
        dirty = {k: v.copy() for k, v in raw.arrays.items()}
        for j, i in enumerate(bad):
            field = ("logp_rollout", "logp_train", "entropy")[j % 3]
            dirty[field][i] = (np.nan, np.inf, -np.inf)[j % 3]
        dirty_raw = dataclasses.replace(raw, arrays=dirty)
        got = run_engine(dirty_raw, nonfinite="drop")
        clean = {k: v.copy() for k, v in raw.arrays.items()}
        clean["loss_mask"] = np.asarray(clean["loss_mask"]).astype(np.int64)
        clean["loss_mask"][bad] = 0
        ref, sc = reference(clean, policy_version=raw.policy_version)
        ref["nonfinite_tokens"] = len(bad)
        check_row(got, ref, sc)


# ---- additivity -------------------------------------------------------------------------------


def _splittable(raw: RawBatch, rng: np.random.Generator) -> int | None:
    cu = raw.arrays["cu_seqlens"]
    ks = [k for k in range(1, raw.num_sequences) if 0 < cu[k] < raw.num_tokens]
    return int(rng.choice(ks)) if ks else None


def test_merge_of_halves_equals_whole() -> None:
    rng = np.random.default_rng(61)
    done = 0
    for raw in random_batches(62, 20, optional="all"):
        k = _splittable(raw, rng)
        if k is None:
            continue
        a, b = split_at(raw, k)
        acc_a = accumulate(Batch.from_arrays(**a.from_arrays_kwargs()))
        acc_b = accumulate(Batch.from_arrays(**b.from_arrays_kwargs()))
        before = derive_row(acc_a).to_dict()
        merged = derive_row(acc_a.merge(acc_b)).to_dict()
        assert derive_row(acc_a).to_dict() == before, "merge mutated its left operand"
        whole = derive_row(accumulate(Batch.from_arrays(**raw.from_arrays_kwargs()))).to_dict()
        ref, sc = run_reference(raw)
        check_row(merged, ref, sc, merged=True)
        check_row(whole, ref, sc)
        assert merged["batches"] == 2
        # Histogram-derived and count-derived values combine exactly, not approximately.
        for name in ("log_ratio_abs_p99", "log_ratio_abs_max", "tokens", "sequences"):
            assert merged[name] == whole[name], name
        assert merged["heatmap"] == whole["heatmap"]
        assert merged["mask_ratio"] == whole["mask_ratio"]
        reversed_ = derive_row(acc_b.merge(acc_a)).to_dict()
        check_row(reversed_, ref, sc, merged=True)
        done += 1
    assert done >= 10


def test_merge_of_many_parts() -> None:
    rng = np.random.default_rng(63)
    raw = random_batch(rng, n_seq=24, optional="all")
    cuts = sorted({k for k in (4, 9, 15, 20)})
    parts, rest, offset = [], raw, 0
    for k in cuts:
        left, rest = split_at(rest, k - offset)
        offset = k
        parts.append(left)
    parts.append(rest)
    accs = [
        accumulate(Batch.from_arrays(**p.from_arrays_kwargs())) for p in parts if p.num_tokens > 0
    ]
    total = accs[0]
    for acc in accs[1:]:
        total = total.merge(acc)
    check_row(derive_row(total).to_dict(), *run_reference(raw), merged=True)
    assert derive_row(total).to_dict()["batches"] == len(accs)


def test_state_round_trip() -> None:
    rng = np.random.default_rng(65)
    for raw in random_batches(66, 6, optional="random"):
        acc = accumulate(Batch.from_arrays(**raw.from_arrays_kwargs()))
        state = json.loads(json.dumps(acc.to_state()))  # must be JSON-serialisable as is
        back = Accumulator.from_state(state)
        assert derive_row(back).to_dict() == derive_row(acc).to_dict()
        other = accumulate(Batch.from_arrays(**random_batch(rng).from_arrays_kwargs()))
        assert derive_row(back.merge(other)).to_dict() == derive_row(acc.merge(other)).to_dict()
        assert Accumulator.from_state(back.to_state()).to_state() == acc.to_state()


def test_additive_fields_and_buckets() -> None:
    """The exporter's additive fields agree with the reference sums; buckets are cumulative."""
    for raw in random_batches(67, 4, wild=0.0):
        acc = accumulate(Batch.from_arrays(**raw.from_arrays_kwargs()))
        ref, _ = run_reference(raw)
        n = ref["tokens"]
        assert (acc.tokens, acc.sequences, acc.batches) == (n, ref["sequences"], 1)
        if n == 0:
            continue
        close(acc.sum_k3 / n, ref["mismatch_kl"], RTOL, 0.0, "sum_k3")
        close(acc.sum_log_ratio_sq / n, 2 * ref["kl_k2"], RTOL, 0.0, "sum_log_ratio_sq")
        close(acc.sum_entropy / n, ref["entropy_mean"], RTOL, 1e-15, "sum_entropy")
        close(acc.sum_is_ratio / n, ref["is_ratio_mean"], RTOL, 0.0, "sum_is_ratio")
        close(acc.sum_abs_log_ratio / n, ref["log_ratio_abs_mean"], RTOL, 0.0, "sum_abs")
        for pol, ratio in ref["mask_ratio"].items():
            assert acc.masked_tokens[pol] / n == ratio, pol
        for buckets in (acc.abs_log_ratio_buckets(), acc.estr_score_buckets()):
            edges = [e for e, _ in buckets]
            counts = [c for _, c in buckets]
            assert edges == sorted(edges) and math.isinf(edges[-1])
            assert counts == sorted(counts) and counts[-1] == n
        abs_d = np.abs(raw.arrays["logp_train"] - raw.arrays["logp_rollout"])
        abs_d = abs_d[np.asarray(raw.arrays["loss_mask"]) == 1]
        for edge, count in acc.abs_log_ratio_buckets():
            assert count == int(np.sum(abs_d <= edge)), edge  # Prometheus `le` semantics


@pytest.mark.parametrize("threads", [2, 3])
def test_threaded_accumulate_matches_reference(threads: int, monkeypatch: Any) -> None:
    """Splitting at sequence boundaries across threads gives the reference row too."""
    import timwatch.monitor.core.engine as engine

    monkeypatch.setattr(engine, "_PARALLEL_MIN_TOKENS", 1)
    rng = np.random.default_rng(threads)
    for _ in range(4):
        raw = random_batch(rng, n_seq=40, max_len=200, optional="all")
        batch = Batch.from_arrays(**raw.from_arrays_kwargs())
        got = derive_row(
            accumulate(batch, params=engine_params(DEFAULTS), threads=threads)
        ).to_dict()
        check_row(got, *run_reference(raw))
        single = derive_row(accumulate(batch, params=engine_params(DEFAULTS))).to_dict()
        assert got["worst_tokens"] == single["worst_tokens"]
        assert got["heatmap"] == single["heatmap"] and got["mask_ratio"] == single["mask_ratio"]


def test_rows_do_not_depend_on_array_alignment() -> None:
    """The SIMD phase reassociates sums; staging keeps the order fixed, so rows are bit-equal
    whatever the alignment of the caller's arrays (JSON, safetensors and numpy differ)."""
    raw = random_batch(np.random.default_rng(5), n_seq=30, max_len=120, optional="all")
    kw = raw.from_arrays_kwargs()
    base = derive_row(accumulate(Batch.from_arrays(**kw), threads=1)).to_dict()
    for offset in range(1, 8):
        shifted = dict(kw)
        for name in ("logp_rollout", "logp_train", "entropy"):
            a = np.asarray(kw[name], dtype=np.float64)
            buf = np.empty(a.size + 8)
            shifted[name] = buf[offset : offset + a.size]
            shifted[name][:] = a
        assert derive_row(accumulate(Batch.from_arrays(**shifted), threads=1)).to_dict() == base


def test_versions_newer_than_policy_version_show_as_negative_lag() -> None:
    """Accepted, not refused: a numbering mismatch between engine and trainer must stay visible
    (a refused batch would lose its mismatch numbers too)."""
    batch = Batch.from_arrays(
        cu_seqlens=np.array([0, 3]), logp_rollout=np.full(3, -0.5), logp_train=np.full(3, -0.4),
        entropy=np.full(3, 0.3), loss_mask=np.ones(3, dtype=np.uint8),
        versions=np.array([4, 5, 6]), policy_version=5,
    )  # fmt: skip
    row = derive_row(accumulate(batch)).to_dict()
    assert row["version_lag_max"] == 1 and row["version_lag_mean"] == pytest.approx(0.0)
    assert set(row["lag_buckets"]) == {"-1", "0", "1"}


@pytest.mark.parametrize("seed", range(6))
def test_row_to_dict_is_asdict_and_shares_nothing_with_the_row(seed: int) -> None:
    raw = random_batch(np.random.default_rng(seed), optional="all" if seed % 2 else "none")
    row = derive_row(accumulate(Batch.from_arrays(**raw.from_arrays_kwargs())))
    got = row.to_dict()
    want = dataclasses.asdict(row)
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    assert list(got) == list(want)
    got["mask_ratio"].clear()
    got["length_buckets"].clear()
    got["worst_tokens"].append({"x": 1})
    assert row.to_dict() == want
