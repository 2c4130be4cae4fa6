"""verl's rollout-correction statistics, transcribed (not imported) for the parity tests.

Restated from verl's `verl/trainer/ppo/rollout_corr_helper.py` (compute_offpolicy_metrics,
compute_is_metrics for token-level TIS, compute_rollout_rejection_mask) and its debug metrics
(rollout_probs_diff_*, rollout_actor_probs_pearson_corr), on verl's padded layout: one row per
sequence, `response_mask` 0 on padding. verl's masked mean divides by Σmask + 1e-8, which is kept
here, so comparisons allow ~1e-8 relative. Inputs are float64 tensors.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["pad", "verl_metrics"]

BOUND = 20.0


def pad(cu: np.ndarray, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Packed arrays → [n_seq, max_len] float64 tensors (zeros on padding)."""
    lengths = np.diff(cu)
    width = int(lengths.max())
    out = []
    for a in arrays:
        t = torch.zeros(len(lengths), width, dtype=torch.float64)
        for s, (lo, n) in enumerate(zip(cu[:-1], lengths, strict=True)):
            t[s, :n] = torch.from_numpy(np.asarray(a[lo : lo + n], dtype=np.float64))
        out.append(t)
    return out


def _mmean(x: torch.Tensor, m: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * m).sum() / (m.sum() + 1e-8)
    return (x * m).sum(dim) / (m.sum(dim) + 1e-8)


def _offpolicy(old: torch.Tensor, roll: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    mlp_train = _mmean(old, m, -1)
    mlp_roll = _mmean(roll, m, -1)
    diff = mlp_roll - mlp_train
    lr = old - roll
    lrc = lr.clamp(-BOUND, BOUND)
    seq_l = (lr * m).sum(-1).clamp(-BOUND, BOUND)
    return {
        "training_ppl": torch.exp(-mlp_train).mean().item(),
        "training_log_ppl": (-mlp_train).mean().item(),
        "rollout_ppl": torch.exp(-mlp_roll).mean().item(),
        "rollout_log_ppl": (-mlp_roll).mean().item(),
        "log_ppl_diff": diff.mean().item(),
        "log_ppl_abs_diff": diff.abs().mean().item(),
        "log_ppl_diff_max": diff.max().item(),
        "log_ppl_diff_min": diff.min().item(),
        "ppl_ratio": torch.exp(diff).mean().item(),
        "kl": _mmean(roll - old, m).item(),
        "k3_kl": _mmean(torch.exp(lr) - lr - 1, m).item(),
        "chi2_token": (_mmean(torch.exp(lrc) ** 2, m) - 1.0).item(),
        "chi2_seq": (torch.exp(2.0 * seq_l).mean() - 1.0).item(),
    }


def _token_is(lr: torch.Tensor, m: torch.Tensor, c: float) -> dict[str, float]:
    raw = torch.exp(lr.clamp(-BOUND, BOUND)) * m
    w = raw.clamp(max=c)
    out = {
        "rollout_is_mean": _mmean(w, m).item(),
        "rollout_is_ratio_fraction_high": _mmean((raw > c).double(), m).item(),
        "rollout_is_ratio_fraction_low": _mmean((raw < 1.0 / c).double(), m).item(),
    }
    wc = w.clamp(min=0.0, max=c)
    mean = _mmean(wc, m)
    out["rollout_is_std"] = math.sqrt(max((_mmean(wc**2, m) - mean**2).item(), 0.0))
    out["rollout_is_eff_sample_size"] = 1.0 / _mmean((wc / (mean + 1e-8)) ** 2, m).item()
    seq_w = _mmean(w, m, -1)
    seq_raw = _mmean(raw, m, -1)
    out["rollout_is_seq_mean"] = seq_w.mean().item()
    out["rollout_is_seq_std"] = seq_w.std().item()  # Bessel-corrected, as torch's default
    out["rollout_is_seq_max"] = seq_w.max().item()
    out["rollout_is_seq_min"] = seq_w.min().item()
    out["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max().item()
    out["rollout_is_seq_fraction_high"] = (seq_raw > c).double().mean().item()
    out["rollout_is_seq_fraction_low"] = (seq_raw < 1.0 / c).double().mean().item()
    return out


def _rs(
    lr: torch.Tensor, m: torch.Tensor, modes: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Masked fractions (token and sequence) of each rejection mode; bounds (lo, hi) are ratio
    bounds for k1 and (0, upper) otherwise."""
    lrc = lr.clamp(-BOUND, BOUND)
    per_token = {"k1": -lrc, "k2": 0.5 * lrc**2, "k3": torch.exp(lrc) - 1.0 - lrc}
    on = m.bool()
    out: dict[str, float] = {}
    for mode, (lo, hi) in modes.items():
        level, _, stat = mode.rpartition("_")
        v = per_token[stat]
        if level == "token" and stat == "k1":
            keep = (v >= math.log(lo)) & (v <= math.log(hi))
        elif level == "token":
            keep = v <= hi
        else:
            if level == "seq_sum":
                sv = (v * m).sum(-1)
            elif level == "seq_mean":
                sv = _mmean(v, m, -1)
            else:
                sv = v.masked_fill(~on, -math.inf).max(-1).values
            keep = (sv <= hi).unsqueeze(-1).expand_as(on)
        out[f"rollout_rs_{mode}_masked_fraction"] = _mmean(1.0 - keep.double(), m).item()
        rejected_seq = ((~keep) & on).any(-1).double()
        out[f"rollout_rs_{mode}_seq_masked_fraction"] = rejected_seq.mean().item()
    return out


def _debug(old: torch.Tensor, roll: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    on = m.bool()
    p, q = torch.exp(old)[on], torch.exp(roll)[on]
    d = (p - q).abs()
    pc, qc = p - p.mean(), q - q.mean()
    corr = (pc * qc).sum() / torch.sqrt((pc**2).sum() * (qc**2).sum())
    return {
        "rollout_probs_diff_mean": d.mean().item(),
        "rollout_probs_diff_max": d.max().item(),
        "rollout_probs_diff_std": d.std().item(),
        "rollout_actor_probs_pearson_corr": corr.item(),
    }


def verl_metrics(
    cu: np.ndarray,
    logp_train: np.ndarray,
    logp_rollout: np.ndarray,
    mask: np.ndarray,
    tis_c: float,
    modes: dict[str, tuple[float, float]],
) -> dict[str, float]:
    """Every statistic above for one packed batch (every sequence needs a masked token)."""
    old, roll, m = pad(cu, logp_train, logp_rollout, mask)
    return (
        _offpolicy(old, roll, m)
        | _token_is(old - roll, m, tis_c)
        | _rs(old - roll, m, modes)
        | _debug(old, roll, m)
    )
