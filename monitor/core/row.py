"""Accumulator → metric row: every metric of docs/reference/metrics.md, derived at the end from
additive state.

`MetricRow` is a plain dataclass (the numbers) kept apart from any exporter or store; absent
inputs and means over zero tokens are `None`, never 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .accumulator import Accumulator
from .histograms import (
    HEATMAP_ABS_DELTA_EDGES,
    HEATMAP_ENTROPY_EDGES,
    fine_quantile,
)
from .layout import C, F, M
from .masks import CLAMP

__all__ = ["MetricRow", "SCALAR_METRICS", "derive_row"]


@dataclass
class MetricRow:
    """One metric row (docs/reference/metrics.md): a batch, a step (several batches) or any
    merged set of them."""

    step: int = 0
    batches: int = 0
    policy_version: int | None = None
    entropy_source: str | None = None
    tokens: int = 0
    sequences: int = 0
    mismatch_kl: float | None = None
    kl_k1: float | None = None
    kl_k2: float | None = None
    log_ratio_mean: float | None = None
    log_ratio_abs_mean: float | None = None
    log_ratio_abs_max: float | None = None
    log_ratio_abs_p99: float | None = None
    prob_abs_diff_mean: float | None = None
    prob_abs_diff_max: float | None = None
    is_ratio_mean: float | None = None
    is_ratio_std: float | None = None
    is_ratio_min: float | None = None
    is_ratio_max: float | None = None
    is_ess: float | None = None
    chi2_token: float | None = None
    seq_log_ratio_abs_mean: float | None = None
    seq_log_ratio_abs_max: float | None = None
    seq_geo_ratio_mean: float | None = None
    chi2_seq: float | None = None
    entropy_mean: float | None = None
    noise_scale: float | None = None
    entropy_delta_corr: float | None = None
    version_lag_mean: float | None = None
    version_lag_max: int | None = None
    intra_switch_ratio: float | None = None
    token_id_mismatch_ratio: float | None = None
    discrepancy_kl: float | None = None
    staleness_kl: float | None = None
    teacher_soft_ratio: float | None = None
    teacher_hard_ratio: float | None = None
    nonfinite_tokens: int = 0
    impossible_tokens: int = 0
    is_ratio_fraction_low: float | None = None
    tis_weight_mean: float | None = None
    tis_weight_std: float | None = None
    tis_weight_ess: float | None = None
    prob_abs_diff_std: float | None = None
    prob_pearson_corr: float | None = None
    training_ppl: float | None = None
    training_log_ppl: float | None = None
    rollout_ppl: float | None = None
    rollout_log_ppl: float | None = None
    log_ppl_diff: float | None = None
    log_ppl_abs_diff: float | None = None
    log_ppl_diff_max: float | None = None
    log_ppl_diff_min: float | None = None
    ppl_ratio: float | None = None
    seq_is_weight_mean: float | None = None
    seq_is_weight_std: float | None = None
    seq_is_weight_max: float | None = None
    seq_is_weight_min: float | None = None
    seq_is_weight_max_deviation: float | None = None
    seq_is_ratio_fraction_high: float | None = None
    seq_is_ratio_fraction_low: float | None = None
    mask_ratio: dict[str, float | None] = field(default_factory=dict)
    seq_reject_ratio: dict[str, float | None] = field(default_factory=dict)
    length_buckets: dict[str, dict[str, Any]] = field(default_factory=dict)
    heatmap: dict[str, Any] = field(default_factory=dict)
    lag_buckets: dict[str, dict[str, Any]] | None = None
    worst_tokens: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Every field, nested dicts and lists copied (what ``dataclasses.asdict`` gives, at a
        fraction of its cost: the row holds only plain values, dicts and lists)."""
        return {name: _copied(getattr(self, name)) for name in _FIELD_NAMES}

    def scalars(self) -> dict[str, float | int | None]:
        """The flat numeric values (what the store keeps as columns)."""
        return {name: getattr(self, name) for name in SCALAR_METRICS}


_FIELD_NAMES = tuple(f.name for f in fields(MetricRow))


def _copied(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


_STRUCTURED = {
    "mask_ratio",
    "seq_reject_ratio",
    "length_buckets",
    "heatmap",
    "lag_buckets",
    "worst_tokens",
    "entropy_source",
}
SCALAR_METRICS: tuple[str, ...] = tuple(
    f.name for f in fields(MetricRow) if f.name not in _STRUCTURED
)


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def derive_row(acc: Accumulator) -> MetricRow:
    s, e, n = acc.fsum, acc.fext, acc.tokens
    row = MetricRow(
        step=acc.step,
        batches=acc.batches,
        policy_version=acc.policy_version,
        entropy_source=acc.entropy_source,
        tokens=n,
        sequences=acc.sequences,
        nonfinite_tokens=acc.nonfinite_tokens,
        impossible_tokens=acc.impossible_tokens,
    )
    if n:
        rm1, rm1sq = s[F.rm1] / n, s[F.rm1sq] / n
        row.mismatch_kl = s[F.k3] / n
        row.kl_k1 = -s[F.d] / n
        row.kl_k2 = 0.5 * s[F.d2] / n
        row.log_ratio_mean = s[F.d] / n
        row.log_ratio_abs_mean = s[F.ad] / n
        row.log_ratio_abs_max = float(e[M.ad])
        p99 = fine_quantile(acc.hist_ad, 0.99)
        row.log_ratio_abs_p99 = None if p99 is None else min(p99, float(e[M.ad]))
        row.prob_abs_diff_mean = s[F.pdiff] / n
        row.prob_abs_diff_max = float(e[M.pdiff])
        row.is_ratio_mean = acc.sum_is_ratio / n
        row.is_ratio_std = math.sqrt(max(rm1sq - rm1 * rm1, 0.0))
        row.is_ratio_min = math.exp(min(max(float(e[M.d_min]), -CLAMP), CLAMP))
        row.is_ratio_max = math.exp(min(max(float(e[M.d_max]), -CLAMP), CLAMP))
        row.is_ess = acc.sum_is_ratio**2 / (n * acc.sum_is_ratio_sq)  # r ≥ e^-20 > 0
        row.chi2_token = 2.0 * rm1 + rm1sq
        row.entropy_mean = s[F.h] / n
        row.noise_scale = s[F.d2] / (s[F.h] + n * acc.params.eps)
        constant = e[M.h_min] == e[M.h_max] or e[M.d2_min] == e[M.d2_max]
        row.entropy_delta_corr = (
            None if constant else _pearson(n, s[F.d2], s[F.h], s[F.d4], s[F.h2], s[F.d2h])
        )
    _verl_token_stats(acc, row)
    if acc.sequences:
        ns = acc.sequences
        row.seq_log_ratio_abs_mean = s[F.seq_abs_l] / ns
        row.seq_log_ratio_abs_max = float(e[M.seq_abs_l])
        row.seq_geo_ratio_mean = s[F.seq_geo] / ns
        row.chi2_seq = s[F.seq_exp2l] / ns - 1.0
        _verl_sequence_stats(acc, row)
    row.mask_ratio = {p: _div(c, n) for p, c in acc.masked_tokens.items()}
    row.seq_reject_ratio = {p: _div(c, acc.sequences) for p, c in acc.rejected_sequences.items()}
    row.length_buckets = {
        str(b): {
            "sequences": int(acc.lb_seqs[b]),
            "tokens": int(acc.lb_tokens[b]),
            "seq_log_ratio_abs_mean": float(acc.lb_abs_l[b] / acc.lb_seqs[b]),
            "mismatch_kl": float(acc.lb_k3[b] / acc.lb_tokens[b]),
        }
        for b in np.flatnonzero(acc.lb_seqs).tolist()
    }
    row.heatmap = {
        "entropy_edges": list(HEATMAP_ENTROPY_EDGES),  # last bin open-ended
        "abs_log_ratio_edges": list(HEATMAP_ABS_DELTA_EDGES),
        "all": acc.heat_all.tolist(),
        "estr_rejected": acc.heat_rej.tolist(),
    }
    _optional(acc, row)
    row.worst_tokens = [dict(w) for w in acc.worst]
    return row


def _optional(acc: Accumulator, row: MetricRow) -> None:
    if acc.lag_tokens:
        row.version_lag_mean = acc.lag_sum / acc.lag_tokens
        row.version_lag_max = acc.lag_max
        row.lag_buckets = {
            str(lag): {"tokens": int(tok), "mismatch_kl": k3 / tok}
            for lag, (tok, k3) in sorted(acc.lag_buckets.items())
        }
    row.intra_switch_ratio = _div(acc.switch_seqs, acc.version_seqs)
    row.token_id_mismatch_ratio = _div(acc.tid_mismatch, acc.tid_tokens)
    row.discrepancy_kl = _div(acc.old_sum_disc, acc.old_tokens)
    row.staleness_kl = _div(acc.old_sum_stale, acc.old_tokens)
    row.teacher_soft_ratio = _div(acc.teacher_soft, acc.teacher_tokens)
    row.teacher_hard_ratio = _div(acc.teacher_hard, acc.teacher_tokens)


def _verl_token_stats(acc: Accumulator, row: MetricRow) -> None:
    """Token statistics verl also logs: truncated weights w = min(r, C), probabilities."""
    s, n = acc.fsum, acc.tokens
    if not n:
        return
    row.is_ratio_fraction_low = int(acc.cnt[C.is_low]) / n
    m1 = s[F.tis_m1] / n
    row.tis_weight_mean = s[F.tis_w] / n
    row.tis_weight_std = math.sqrt(max(s[F.tis_m1sq] / n - m1 * m1, 0.0))
    row.tis_weight_ess = s[F.tis_w] ** 2 / (n * s[F.tis_w2])  # w ≥ e^-20 > 0
    if n > 1:
        mean = s[F.pdiff] / n
        row.prob_abs_diff_std = math.sqrt(max((s[F.pd2] - n * mean * mean) / (n - 1), 0.0))
    row.prob_pearson_corr = _pearson(n, s[F.p], s[F.q], s[F.p2], s[F.q2], s[F.pq])


def _verl_sequence_stats(acc: Accumulator, row: MetricRow) -> None:
    """Per-sequence statistics verl logs, over sequences with n_s > 0 (acc.sequences ≥ 1)."""
    s, e, ns = acc.fsum, acc.fext, acc.sequences
    row.training_ppl = s[F.ppl_train] / ns
    row.training_log_ppl = s[F.log_ppl_train] / ns
    row.rollout_ppl = s[F.ppl_roll] / ns
    row.rollout_log_ppl = s[F.log_ppl_roll] / ns
    row.log_ppl_diff = s[F.lpd] / ns
    row.log_ppl_abs_diff = s[F.lpd_abs] / ns
    row.log_ppl_diff_max = float(e[M.lpd_max])
    row.log_ppl_diff_min = float(e[M.lpd_min])
    row.ppl_ratio = s[F.ppl_ratio] / ns
    u = s[F.seq_w_m1] / ns
    row.seq_is_weight_mean = s[F.seq_w] / ns
    if ns > 1:
        var = (s[F.seq_w_m1sq] - ns * u * u) / (ns - 1)
        row.seq_is_weight_std = math.sqrt(max(var, 0.0))
    row.seq_is_weight_max = float(e[M.seq_w_max])
    row.seq_is_weight_min = float(e[M.seq_w_min])
    row.seq_is_weight_max_deviation = float(e[M.seq_w_dev])
    row.seq_is_ratio_fraction_high = int(acc.cnt[C.seq_w_high]) / ns
    row.seq_is_ratio_fraction_low = int(acc.cnt[C.seq_w_low]) / ns


def _pearson(n: int, sx: float, sy: float, sxx: float, syy: float, sxy: float) -> float | None:
    if n < 2:
        return None
    mx, my = sx / n, sy / n
    vx, vy = sxx / n - mx * mx, syy / n - my * my
    if vx <= 0.0 or vy <= 0.0:
        return None
    return max(-1.0, min(1.0, (sxy / n - mx * my) / math.sqrt(vx * vy)))
