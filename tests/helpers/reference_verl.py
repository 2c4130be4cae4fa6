"""Independent float64 reference for the metrics that mirror verl's rollout-correction logging.

Written from docs/definitions.md only (no monitor import), in the style of ``reference.py``:
plain loops, ``math.fsum`` for every sum, two-pass moments. Per-token values are over masked
tokens; per-sequence values over sequences with at least one masked token.
"""

from __future__ import annotations

import math
from typing import Any

from tests.helpers.fsum_stats import mean, pearson

__all__ = ["verl_extras"]

CLAMP = 20.0
GUARD = 600.0


def _clamp(x: float, lim: float = CLAMP) -> float:
    return min(max(x, -lim), lim)


def _scale(xs: list[float]) -> float:
    return math.fsum(abs(x) for x in xs) / len(xs) if xs else 0.0


def _std(xs: list[float], ddof: int) -> float | None:
    if len(xs) <= ddof:
        return None
    m = math.fsum(xs) / len(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - ddof))


def verl_extras(
    row: dict[str, Any],
    sc: dict[str, float],
    params: Any,
    mu: list[float],
    pi: list[float],
    seq_of: list[int],
) -> None:
    """Add the verl-parity metrics to ``row`` (and their term magnitudes to ``sc``)."""
    n = len(mu)
    c = params.tis_c
    d = [b - a for a, b in zip(mu, pi, strict=True)]
    r = [math.exp(_clamp(x)) for x in d]
    w = [min(x, c) for x in r]
    # w − 1 without the rounding of w itself (near w = 1 that rounding is what a spread is)
    wm1 = [min(math.expm1(_clamp(x)), c - 1.0) for x in d]
    row["is_ratio_fraction_low"] = sum(1 for x in r if x < 1.0 / c) / n if n else None
    row["tis_weight_mean"] = mean(w)
    sc["tis_weight_mean"] = _scale(w)
    row["tis_weight_std"] = _std(wm1, 0)
    sc["tis_weight_std"] = mean([x * x for x in w]) or 0.0
    row["tis_weight_ess"] = math.fsum(w) ** 2 / (n * math.fsum(x * x for x in w)) if n else None
    p = [math.exp(x) for x in pi]
    q = [math.exp(x) for x in mu]
    pdiff = [qq * abs(math.expm1(x)) for qq, x in zip(q, d, strict=True)]
    row["prob_abs_diff_std"] = _std(pdiff, 1)
    sc["prob_abs_diff_std"] = mean([x * x for x in pdiff]) or 0.0
    row["prob_pearson_corr"] = pearson(p, q)
    if row["prob_pearson_corr"] is not None:
        vp = _std(p, 0) ** 2  # type: ignore[operator]
        vq = _std(q, 0) ** 2  # type: ignore[operator]
        cp = (mean([x * x for x in p]) or 0.0) / vp
        cq = (mean([x * x for x in q]) or 0.0) / vq
        sc["prob_pearson_corr"] = cp + cq + math.sqrt(cp * cq)

    seqs: dict[int, list[int]] = {}
    for j, s in enumerate(seq_of):
        seqs.setdefault(s, []).append(j)
    groups = [seqs[s] for s in sorted(seqs)]
    names = (
        "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
        "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio",
        "seq_is_weight_mean", "seq_is_weight_std", "seq_is_weight_max", "seq_is_weight_min",
        "seq_is_weight_max_deviation", "seq_is_ratio_fraction_high", "seq_is_ratio_fraction_low",
    )  # fmt: skip
    if not groups:
        for name in names:
            row[name] = None
        return
    lp_train = [-math.fsum(pi[j] for j in g) / len(g) for g in groups]
    lp_roll = [-math.fsum(mu[j] for j in g) / len(g) for g in groups]
    # mean μ − mean π of a sequence = −L_s/n_s, L_s = Σδ (the form without cancellation)
    lpd = [-math.fsum(d[j] for j in g) / len(g) for g in groups]
    abs_d = [math.fsum(abs(d[j]) for j in g) / len(g) for g in groups]
    row["training_ppl"] = mean([math.exp(min(x, GUARD)) for x in lp_train])
    row["training_log_ppl"] = mean(lp_train)
    row["rollout_ppl"] = mean([math.exp(min(x, GUARD)) for x in lp_roll])
    row["rollout_log_ppl"] = mean(lp_roll)
    sc["training_log_ppl"] = _scale(lp_train)
    sc["rollout_log_ppl"] = _scale(lp_roll)
    row["log_ppl_diff"] = mean(lpd)
    sc["log_ppl_diff"] = _scale(abs_d)
    row["log_ppl_abs_diff"] = mean([abs(x) for x in lpd])
    sc["log_ppl_abs_diff"] = _scale(abs_d)
    row["log_ppl_diff_max"] = max(lpd)
    row["log_ppl_diff_min"] = min(lpd)
    sc["log_ppl_diff_max"] = sc["log_ppl_diff_min"] = max(abs_d)
    ratio = [math.exp(_clamp(x, GUARD)) for x in lpd]
    row["ppl_ratio"] = mean(ratio)
    sc["ppl_ratio"] = _scale([x * (1 + a) for x, a in zip(ratio, abs_d, strict=True)])
    wbar = [math.fsum(w[j] for j in g) / len(g) for g in groups]
    ubar = [math.fsum(wm1[j] for j in g) / len(g) for g in groups]
    rbar = [math.fsum(r[j] for j in g) / len(g) for g in groups]
    row["seq_is_weight_mean"] = mean(wbar)
    row["seq_is_weight_std"] = _std(ubar, 1)
    sc["seq_is_weight_std"] = mean([(x - 1.0) ** 2 for x in wbar]) or 0.0
    row["seq_is_weight_max"] = max(wbar)
    row["seq_is_weight_min"] = min(wbar)
    row["seq_is_weight_max_deviation"] = max(abs(x) for x in ubar)
    row["seq_is_ratio_fraction_high"] = sum(1 for x in rbar if x > c) / len(groups)
    row["seq_is_ratio_fraction_low"] = sum(1 for x in rbar if x < 1.0 / c) / len(groups)
