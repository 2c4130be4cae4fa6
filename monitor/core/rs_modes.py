"""verl's divergence rejection-sampling modes (`rollout_rs` in verl's rollout_corr_helper) as keep
masks on numpy arrays and torch tensors alike (1 = keep), beside the policies of `core.masks`.

Per token, on the clamped δc = clip(π − μ, ±20): k1 = −δc, k2 = δc²/2, k3 = e^δc − 1 − δc.
Token modes threshold the token's value; sequence modes threshold the sum, mean or max over the
sequence's masked tokens and broadcast the decision (a sequence without masked tokens is kept).
`token_k1` bounds −δc between the logs of its two ratio bounds, exactly as verl does. Decisions
match the engine's fused kernel except within float rounding of a threshold.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .mask_ops import (
    _clamp,
    _expand,
    _f64,
    _is_torch,
    _quiet,
    _seq_stats,
    _seq_sum,
    log_ratio,
    token_k3,
)

__all__ = [
    "seq_max_k2_keep_mask",
    "seq_max_k3_keep_mask",
    "seq_mean_k2_keep_mask",
    "seq_sum_k2_keep_mask",
    "seq_sum_k3_keep_mask",
    "token_k1_keep_mask",
    "token_k2_keep_mask",
    "token_k3_keep_mask",
    "verl_keep_mask",
]

Array = Any


def _k2(d: Array) -> Array:
    dc = _clamp(d)
    return 0.5 * dc * dc


@_quiet
def token_k1_keep_mask(
    logp_train: Array, logp_rollout: Array, lower: float = 0.6, upper: float = 1.6
) -> Array:
    """token_k1: keep iff ln(lower) ≤ −δc ≤ ln(upper)."""
    k1 = -_clamp(log_ratio(logp_train, logp_rollout))
    return (k1 >= math.log(lower)) & (k1 <= math.log(upper))


@_quiet
def token_k2_keep_mask(logp_train: Array, logp_rollout: Array, upper: float = 2.5) -> Array:
    """token_k2: keep iff δc²/2 ≤ upper."""
    return _k2(log_ratio(logp_train, logp_rollout)) <= upper


@_quiet
def token_k3_keep_mask(logp_train: Array, logp_rollout: Array, upper: float = 2.5) -> Array:
    """token_k3: keep iff k3 ≤ upper."""
    return token_k3(log_ratio(logp_train, logp_rollout)) <= upper


def _seq_max(values: Array, ids: Array, nseq: int, keep: Array) -> Array:
    """Max over each sequence's masked positions (−inf where a sequence has none)."""
    if _is_torch(values):
        import torch

        v = torch.where(keep, values, torch.full_like(values, -math.inf))
        out = torch.full((nseq,), -math.inf, dtype=values.dtype, device=values.device)
        return out.scatter_reduce(0, ids, v, reduce="amax")
    best = np.full(nseq, -math.inf)
    np.maximum.at(best, ids, np.where(keep, values, -math.inf))
    return best


def _seq_reduce(
    kind: str, stat: str, logp_train: Array, logp_rollout: Array, cu_seqlens: Array, mask: Array
) -> tuple[Array, Array, Array]:
    """(per-sequence value, n_s, ids) of `kind` ∈ sum/mean/max of k2 or k3."""
    _, n_s, ids, d = _seq_stats(logp_train, logp_rollout, cu_seqlens, mask)
    values = _k2(d) if stat == "k2" else token_k3(d)
    m = _f64(mask)
    if kind == "max":
        return _seq_max(values, ids, int(n_s.shape[0]), m > 0), n_s, ids
    total = _seq_sum(values * m, ids, int(n_s.shape[0]))
    if kind == "mean":
        total = total / (n_s.clamp(min=1) if _is_torch(n_s) else np.maximum(n_s, 1))
    return total, n_s, ids


def _seq_mode(kind: str, stat: str) -> Any:
    @_quiet
    def keep_mask(
        logp_train: Array, logp_rollout: Array, cu_seqlens: Array, loss_mask: Array, upper: float
    ) -> Array:
        value, n_s, ids = _seq_reduce(kind, stat, logp_train, logp_rollout, cu_seqlens, loss_mask)
        return _expand(value <= upper, n_s, ids)

    keep_mask.__name__ = f"seq_{kind}_{stat}_keep_mask"
    keep_mask.__doc__ = f"seq_{kind}_{stat}: keep a sequence iff the {kind} of its {stat} ≤ upper."
    return keep_mask


seq_sum_k2_keep_mask = _seq_mode("sum", "k2")
seq_sum_k3_keep_mask = _seq_mode("sum", "k3")
seq_mean_k2_keep_mask = _seq_mode("mean", "k2")
seq_max_k2_keep_mask = _seq_mode("max", "k2")
seq_max_k3_keep_mask = _seq_mode("max", "k3")


def verl_keep_mask(
    name: str,
    logp_train: Array,
    logp_rollout: Array,
    cu_seqlens: Array,
    loss_mask: Array,
    p: Any,
) -> Array:
    """The keep mask of one verl mode by name, with the thresholds of `p` (a PolicyParams)."""
    if name == "token_k1":
        return token_k1_keep_mask(logp_train, logp_rollout, p.token_k1_lower, p.token_k1_upper)
    if name == "token_k2":
        return token_k2_keep_mask(logp_train, logp_rollout, p.token_k2_upper)
    if name == "token_k3":
        return token_k3_keep_mask(logp_train, logp_rollout, p.token_k3_upper)
    fn = {
        "seq_sum_k2": (seq_sum_k2_keep_mask, p.seq_sum_k2_upper),
        "seq_sum_k3": (seq_sum_k3_keep_mask, p.seq_sum_k3_upper),
        "seq_mean_k2": (seq_mean_k2_keep_mask, p.seq_mean_k2_upper),
        "seq_max_k2": (seq_max_k2_keep_mask, p.seq_max_k2_upper),
        "seq_max_k3": (seq_max_k3_keep_mask, p.seq_max_k3_upper),
    }.get(name)
    if fn is None:
        raise ValueError(f"unknown verl rejection mode {name!r}")
    return fn[0](logp_train, logp_rollout, cu_seqlens, loss_mask, fn[1])
