"""Independent float64 reference for the metric row and the mask policies.

Written from docs/reference/ and docs/definitions.md only — it imports nothing from ``monitor`` and
shares no code with it. It is deliberately plain: Python loops over sequences and tokens, ``math``
per scalar (``math.expm1`` for k3), ``math.fsum`` for every sum, two-pass moments, an exact sort for
the 99th percentile. Slow and obviously right is the point; the engine is the fast one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tests.helpers.fsum_stats import mean, pearson
from tests.helpers.reference_verl import verl_extras

__all__ = [
    "HEAT_DELTA_EDGES",
    "HEAT_H_EDGES",
    "POLICY_NAMES",
    "SEQ_POLICIES",
    "TOKEN_POLICIES",
    "RefParams",
    "bernoulli_kl",
    "heat_bin",
    "k3",
    "keep_token",
    "near_boundary",
    "reference",
    "seq_keep",
    "seq_near_boundary",
]

VERL_TOKEN = ("token_k1", "token_k2", "token_k3")
VERL_SEQ = ("seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_max_k2", "seq_max_k3")
TOKEN_POLICIES = ("estr", "delta_abs", "icepop", "kpop", "tis", *VERL_TOKEN)
SEQ_POLICIES = ("seq_mis", "geo_rs", "k3_rs", *VERL_SEQ)
POLICY_NAMES = (
    "estr", "delta_abs", "icepop", "kpop", "tis", "seq_mis", "geo_rs", "k3_rs",
    *VERL_TOKEN, *VERL_SEQ,
)  # fmt: skip
HEAT_H_EDGES = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, math.inf)
HEAT_DELTA_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 1.0, math.inf)
CLAMP = 20.0
P_CLIP = 1e-8


@dataclasses.dataclass(frozen=True)
class RefParams:
    """The policies' defaults, restated here independently of
    timwatch.monitor.core.masks.PolicyParams."""

    tau: float = 1.6
    eps: float = 0.01
    delta_abs_c: float = 1.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    kpop_phi: float = 0.1
    tis_c: float = 2.0
    seq_mis_low: float = 0.5
    seq_mis_high: float = 2.0
    geo_rs_low: float = 0.999
    geo_rs_high: float = 1.001
    k3_rs_kappa: float = 0.01
    token_k1_lower: float = 0.6
    token_k1_upper: float = 1.6
    token_k2_upper: float = 2.5
    token_k3_upper: float = 2.5
    seq_sum_k2_upper: float = 2.5
    seq_sum_k3_upper: float = 2.5
    seq_mean_k2_upper: float = 0.01
    seq_max_k2_upper: float = 2.5
    seq_max_k3_upper: float = 2.5


def clamp(x: float, lim: float = CLAMP) -> float:
    return min(max(x, -lim), lim)


def k3(d: float) -> float:
    """k3 = expm1(δc) − δc on the clamped δ (definitions.md), to float64 rounding.

    Below |δ| = 1e-3 the subtraction itself would cancel (at δ = 1e-9 it keeps 7 digits), so
    there the Taylor series δ²/2! + δ³/3! + … is summed instead (truncation < 1e-20 relative).
    """
    dc = clamp(d)
    if abs(dc) >= 1e-3:
        return math.expm1(dc) - dc
    return math.fsum(dc**k / math.factorial(k) for k in range(2, 9))


def bernoulli_kl(a: float, b: float) -> float:
    return a * math.log(a / b) + (1.0 - a) * math.log((1.0 - a) / (1.0 - b))


def keep_token(policy: str, lt: float, lr: float, h: float, p: RefParams) -> bool:
    """Token policies, written literally (keep = True)."""
    d = lt - lr
    if policy == "estr":
        return d * d <= p.tau * (h + p.eps)
    if policy == "delta_abs":
        # definitions.md: |δ| ≤ √(τ·C). Compared squared so that it is *exactly* ESTR with
        # H + ε ≡ C, which is what docs/reference/policies.md says it is (the two readings
        # differ by one ulp).
        return d * d <= p.tau * p.delta_abs_c
    r = math.exp(clamp(d))
    if policy == "icepop":
        return p.icepop_low <= r <= p.icepop_high
    if policy == "tis":
        return r <= p.tis_c
    if policy == "kpop":
        pp = min(max(math.exp(lt), P_CLIP), 1.0 - P_CLIP)
        qq = min(max(math.exp(lr), P_CLIP), 1.0 - P_CLIP)
        return max(bernoulli_kl(pp, qq), bernoulli_kl(qq, pp)) <= p.kpop_phi
    if policy == "token_k1":  # verl: ln(lower) ≤ −δc ≤ ln(upper)
        return math.log(p.token_k1_lower) <= -clamp(d) <= math.log(p.token_k1_upper)
    if policy == "token_k2":
        return clamp(d) ** 2 / 2.0 <= p.token_k2_upper
    if policy == "token_k3":
        return k3(d) <= p.token_k3_upper
    raise ValueError(policy)


def near_boundary(policy: str, lt: float, lr: float, h: float, p: RefParams) -> bool:
    """Whether a token lies within float64 rounding of a policy threshold.

    There the literal float64 rule and an equally valid evaluation (in log space, via expm1)
    may disagree — at δ = 3e-59 with C = 1, e^δ rounds to 1 ≤ C while δ > ln C — and neither is
    wrong. Property tests skip such tokens; ESTR and delta_abs are compared on all tokens.
    """
    d = lt - lr
    r = math.exp(clamp(d))
    rel = 1e-12
    if policy == "icepop":
        return (
            abs(r - p.icepop_low) <= rel * p.icepop_low
            or abs(r - p.icepop_high) <= rel * p.icepop_high
        )
    if policy == "tis":
        return abs(r - p.tis_c) <= rel * p.tis_c
    if policy == "kpop":
        pp = min(max(math.exp(lt), P_CLIP), 1.0 - P_CLIP)
        qq = min(max(math.exp(lr), P_CLIP), 1.0 - P_CLIP)
        div = max(bernoulli_kl(pp, qq), bernoulli_kl(qq, pp))
        return abs(div - p.kpop_phi) <= 1e-9 * p.kpop_phi
    if policy == "token_k1":
        x = -clamp(d)
        return any(abs(x - math.log(b)) <= 1e-12 for b in (p.token_k1_lower, p.token_k1_upper))
    if policy in ("token_k2", "token_k3"):
        x = clamp(d) ** 2 / 2.0 if policy == "token_k2" else k3(d)
        t = p.token_k2_upper if policy == "token_k2" else p.token_k3_upper
        return abs(x - t) <= 1e-9 * t
    return False


def seq_near_boundary(policy: str, deltas: Sequence[float], p: RefParams) -> bool:
    """Sequence analogue of ``near_boundary`` (L_s is a sum: allow 1e-9 relative)."""
    big_l = math.fsum(deltas)
    rel = 1e-9 * (1.0 + math.fsum(abs(x) for x in deltas))
    if policy == "seq_mis":
        lo, hi, x = math.log(p.seq_mis_low), math.log(p.seq_mis_high), big_l
    elif policy == "geo_rs":
        lo, hi, x = math.log(p.geo_rs_low), math.log(p.geo_rs_high), big_l / len(deltas)
        rel /= len(deltas)
    elif policy == "k3_rs":
        m = math.fsum(k3(d) for d in deltas) / len(deltas)
        return abs(m - p.k3_rs_kappa) <= 1e-9 * p.k3_rs_kappa
    else:
        v, t = _verl_seq_stat(policy, deltas, p)
        return abs(v - t) <= 1e-9 * t
    return abs(x - lo) <= rel or abs(x - hi) <= rel


def _verl_seq_stat(policy: str, deltas: Sequence[float], p: RefParams) -> tuple[float, float]:
    """(statistic, upper bound) of one of verl's sequence modes."""
    k2s = [clamp(x) ** 2 / 2.0 for x in deltas]
    k3s = [k3(x) for x in deltas]
    return {
        "seq_sum_k2": (math.fsum(k2s), p.seq_sum_k2_upper),
        "seq_sum_k3": (math.fsum(k3s), p.seq_sum_k3_upper),
        "seq_mean_k2": (math.fsum(k2s) / len(k2s), p.seq_mean_k2_upper),
        "seq_max_k2": (max(k2s), p.seq_max_k2_upper),
        "seq_max_k3": (max(k3s), p.seq_max_k3_upper),
    }[policy]


def seq_keep(policy: str, deltas: Sequence[float], p: RefParams) -> bool:
    """Sequence policies on the masked tokens' δ of one sequence (n_s > 0)."""
    n = len(deltas)
    big_l = math.fsum(deltas)
    if policy == "seq_mis":
        v = math.exp(big_l) if big_l < 700 else math.inf
        return p.seq_mis_low <= v <= p.seq_mis_high
    if policy == "geo_rs":
        return p.geo_rs_low <= math.exp(big_l / n) <= p.geo_rs_high
    if policy == "k3_rs":
        return math.fsum(k3(d) for d in deltas) / n <= p.k3_rs_kappa
    v, t = _verl_seq_stat(policy, deltas, p)
    return v <= t


def heat_bin(value: float, edges: Sequence[float]) -> int:
    """Left-closed bin index: edges[i] <= value < edges[i+1]."""
    for i in range(len(edges) - 1):
        if edges[i] <= value < edges[i + 1]:
            return i
    raise ValueError(value)


def _pop_var(xs: Sequence[float]) -> float:
    m = math.fsum(xs) / len(xs)
    return math.fsum((x - m) ** 2 for x in xs) / len(xs)


def _scale(xs: Sequence[float], plus: float = 0.0) -> float:
    """Magnitude of a mean's terms: how large float64 summation error may legitimately be."""
    return (math.fsum(abs(x) for x in xs) / len(xs) if xs else 0.0) + plus


def reference(
    arrays: dict[str, np.ndarray],
    *,
    policy_version: int | None = None,
    params: RefParams = RefParams(),
    nonfinite_tokens: int = 0,
) -> tuple[dict[str, Any], dict[str, float]]:
    """The metric row for one batch, and per-scalar magnitudes for error tolerances.

    ``arrays`` are the packed fields (absent optionals are missing keys). Returns ``(row, scale)``
    where ``row`` has the row's names and ``scale[name]`` is the mean magnitude of the terms that
    the metric sums (so a test can allow float64 summation error on means that cancel).
    """
    cu = [int(x) for x in arrays["cu_seqlens"]]
    mu = [float(x) for x in arrays["logp_rollout"]]
    pi = [float(x) for x in arrays["logp_train"]]
    ent = [float(x) for x in arrays["entropy"]]
    lmask = [int(x) for x in arrays["loss_mask"]]
    # δ = ±∞ (one side -inf, the other finite): left out of the mask and every metric, counted
    impossible = 0
    for i, (a, b) in enumerate(zip(mu, pi, strict=True)):
        if (a == -math.inf and math.isfinite(b)) or (b == -math.inf and math.isfinite(a)):
            impossible += lmask[i]
            lmask[i] = 0
    opt = {k: arrays[k] for k in arrays if k not in ("cu_seqlens", "loss_mask")}
    eps = params.eps

    # Per-token values on T, in flat order.
    flat: list[int] = []
    seq_of: list[int] = []
    pos_of: list[int] = []
    for s in range(len(cu) - 1):
        for i in range(cu[s], cu[s + 1]):
            if lmask[i] == 1:
                flat.append(i)
                seq_of.append(s)
                pos_of.append(i - cu[s])
    n = len(flat)
    d = [pi[i] - mu[i] for i in flat]
    ad = [abs(x) for x in d]
    h = [ent[i] for i in flat]
    r = [math.exp(clamp(x)) for x in d]
    kk3 = [k3(x) for x in d]
    k2 = [x * x / 2.0 for x in d]
    dsq = [x * x for x in d]
    score = [x * x / (hh + eps) for x, hh in zip(d, h, strict=True)]
    # |e^π − e^μ| = e^μ·|expm1(δ)|, the cancellation-free form of the same number.
    pdiff = [math.exp(mu[i]) * abs(math.expm1(pi[i] - mu[i])) for i in flat]

    row: dict[str, Any] = {"tokens": n}
    sc: dict[str, float] = {}

    def put(name: str, terms: list[float], plus: float = 0.0, value: float | None = None) -> None:
        row[name] = (mean(terms) if value is None else value) if terms else None
        sc[name] = _scale(terms, plus)

    put("mismatch_kl", kk3)
    put("kl_k1", [-x for x in d])
    put("kl_k2", k2)
    put("log_ratio_mean", d)
    put("log_ratio_abs_mean", ad)
    row["log_ratio_abs_max"] = max(ad) if n else None
    if n:
        srt = sorted(ad)
        row["log_ratio_abs_p99"] = srt[(99 * n + 99) // 100 - 1]  # exact nearest rank
    else:
        row["log_ratio_abs_p99"] = None
    put("prob_abs_diff_mean", pdiff)
    row["prob_abs_diff_max"] = max(pdiff) if n else None
    put("is_ratio_mean", r)
    row["is_ratio_std"] = math.sqrt(_pop_var(r)) if n else None
    sc["is_ratio_std"] = mean([x * x for x in r]) or 0.0  # E[r²]: what Σr² − (Σr)²/N cancels
    row["is_ratio_min"] = min(r) if n else None
    row["is_ratio_max"] = max(r) if n else None
    row["is_ess"] = math.fsum(r) ** 2 / (n * math.fsum(x * x for x in r)) if n else None
    # mean r² − 1 = mean(expm1(2δc)), summed without the cancellation.
    put("chi2_token", [math.expm1(2.0 * clamp(x)) for x in d], plus=1.0)
    put("entropy_mean", h)
    row["noise_scale"] = math.fsum(dsq) / math.fsum(hh + eps for hh in h) if n else None
    sc["noise_scale"] = 1.0
    row["entropy_delta_corr"] = pearson(dsq, h)
    if row["entropy_delta_corr"] is not None:
        # Cancellation factor of moments from raw sums: E[x²]/Var x per variable.
        cx = mean([x * x for x in dsq]) / _pop_var(dsq)  # type: ignore[operator]
        cy = mean([y * y for y in h]) / _pop_var(h)  # type: ignore[operator]
        sc["entropy_delta_corr"] = cx + cy + math.sqrt(cx * cy)

    # Sequences with n_s > 0.
    seq_d: dict[int, list[float]] = {}
    seq_k3: dict[int, list[float]] = {}
    for s, x, kx in zip(seq_of, d, kk3, strict=True):
        seq_d.setdefault(s, []).append(x)
        seq_k3.setdefault(s, []).append(kx)
    seqs = sorted(seq_d)
    big_l = {s: math.fsum(seq_d[s]) for s in seqs}
    row["sequences"] = len(seqs)
    # L_s is a sum that may cancel: its legitimate rounding error scales with Σ|δ|, so the
    # scales below carry each term's sensitivity to L_s times Σ_{t∈s}|δ_t|.
    abs_sum = {s: math.fsum(abs(x) for x in seq_d[s]) for s in seqs}
    geo = {s: math.exp(clamp(big_l[s] / len(seq_d[s]))) for s in seqs}
    chi = {s: math.expm1(2.0 * clamp(big_l[s])) for s in seqs}
    put("seq_log_ratio_abs_mean", [abs(big_l[s]) for s in seqs])
    sc["seq_log_ratio_abs_mean"] = _scale([abs_sum[s] for s in seqs])
    row["seq_log_ratio_abs_max"] = max(abs(big_l[s]) for s in seqs) if seqs else None
    sc["seq_log_ratio_abs_max"] = max(abs_sum.values()) if seqs else 0.0
    put("seq_geo_ratio_mean", list(geo.values()))
    sc["seq_geo_ratio_mean"] = _scale([geo[s] * (1 + abs_sum[s] / len(seq_d[s])) for s in seqs])
    put("chi2_seq", list(chi.values()))
    sc["chi2_seq"] = _scale([(chi[s] + 1) * (1 + 2 * abs_sum[s]) for s in seqs], plus=1.0)

    # Policies (shadow evaluation of all of them).
    mask_ratio: dict[str, float | None] = {}
    seq_reject: dict[str, float | None] = {}
    for pol in TOKEN_POLICIES:
        rej = sum(1 for i in flat if not keep_token(pol, pi[i], mu[i], ent[i], params))
        mask_ratio[pol] = rej / n if n else None
    for pol in SEQ_POLICIES:
        rej_seqs = [s for s in seqs if not seq_keep(pol, seq_d[s], params)]
        mask_ratio[pol] = sum(len(seq_d[s]) for s in rej_seqs) / n if n else None
        seq_reject[pol] = len(rej_seqs) / len(seqs) if seqs else None
    row["mask_ratio"] = mask_ratio
    row["seq_reject_ratio"] = seq_reject

    # Length buckets keyed by floor(log2 n_s), n_s = masked tokens of the sequence.
    lb: dict[int, dict[str, Any]] = {}
    for s in seqs:
        b = len(seq_d[s]).bit_length() - 1
        e = lb.setdefault(b, {"sequences": 0, "tokens": 0, "_l": [], "_k3": []})
        e["sequences"] += 1
        e["tokens"] += len(seq_d[s])
        e["_l"].append(abs(big_l[s]))
        e["_k3"].extend(seq_k3[s])
    row["length_buckets"] = {
        b: {
            "sequences": e["sequences"],
            "tokens": e["tokens"],
            "seq_log_ratio_abs_mean": mean(e["_l"]),
            "mismatch_kl": mean(e["_k3"]),
        }
        for b, e in sorted(lb.items())
    }

    # Heatmap: 7 entropy rows × 6 |δ| columns, all and ESTR-rejected.
    grid_all = [[0] * 6 for _ in range(7)]
    grid_rej = [[0] * 6 for _ in range(7)]
    for i, x, hh in zip(flat, ad, h, strict=True):
        a, b = heat_bin(hh, HEAT_H_EDGES), heat_bin(x, HEAT_DELTA_EDGES)
        grid_all[a][b] += 1
        if not keep_token("estr", pi[i], mu[i], ent[i], params):
            grid_rej[a][b] += 1
    row["heatmap"] = {"all": grid_all, "estr_rejected": grid_rej}

    # Versions.
    row["version_lag_mean"] = row["version_lag_max"] = row["intra_switch_ratio"] = None
    row["lag_buckets"] = None
    if "versions" in opt:
        ver = [int(x) for x in opt["versions"]]
        if seqs:
            seen: dict[int, set[int]] = {}
            for i, s in zip(flat, seq_of, strict=True):
                seen.setdefault(s, set()).add(ver[i])
            row["intra_switch_ratio"] = sum(1 for v in seen.values() if len(v) > 1) / len(seqs)
        if policy_version is not None:
            lags = [policy_version - ver[i] for i in flat]
            row["version_lag_mean"] = mean([float(x) for x in lags])
            row["version_lag_max"] = max(lags) if lags else None
            buckets: dict[int, list[float]] = {}
            for lag, kx in zip(lags, kk3, strict=True):
                buckets.setdefault(lag, []).append(kx)
            row["lag_buckets"] = {
                lag: {"tokens": len(v), "mismatch_kl": mean(v)}
                for lag, v in sorted(buckets.items())
            }

    row["token_id_mismatch_ratio"] = None
    if "token_ids" in opt and "token_ids_train" in opt and n:
        a_ids, b_ids = opt["token_ids"], opt["token_ids_train"]
        row["token_id_mismatch_ratio"] = sum(1 for i in flat if int(a_ids[i]) != int(b_ids[i])) / n

    row["discrepancy_kl"] = row["staleness_kl"] = None
    if "logp_old" in opt:
        old = [float(opt["logp_old"][i]) for i in flat]
        put("discrepancy_kl", [k3(o - mu[i]) for o, i in zip(old, flat, strict=True)])
        put("staleness_kl", [k3(pi[i] - o) for o, i in zip(old, flat, strict=True)])

    row["teacher_soft_ratio"] = row["teacher_hard_ratio"] = None
    if "logp_teacher" in opt and n:
        pt = [math.exp(float(opt["logp_teacher"][i])) for i in flat]
        row["teacher_soft_ratio"] = sum(1 for x in pt if 0.3 <= x <= 0.7) / n
        row["teacher_hard_ratio"] = sum(1 for x in pt if x < 0.05 or x > 0.95) / n

    row["nonfinite_tokens"] = nonfinite_tokens
    row["impossible_tokens"] = impossible
    verl_extras(row, sc, params, [mu[i] for i in flat], [pi[i] for i in flat], seq_of)

    # Worst 16 by S, ties: lower flat index first.
    order = sorted(range(n), key=lambda j: (-score[j], flat[j]))[:16]
    ids = opt.get("token_ids")
    row["worst_tokens"] = [
        {
            "seq": seq_of[j],
            "pos": pos_of[j],
            "index": flat[j],
            "token_id": int(ids[flat[j]]) if ids is not None else None,
            "logp_rollout": mu[flat[j]],
            "logp_train": pi[flat[j]],
            "entropy": ent[flat[j]],
            "score": score[j],
        }
        for j in order
    ]
    return row, sc
