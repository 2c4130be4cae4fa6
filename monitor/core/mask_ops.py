"""Array primitives shared by the mask policies (`core.masks`) and verl's rejection modes
(`core.rs_modes`): numpy and torch alike, float64, nothing copied off a tensor's device."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = ["CLAMP", "log_ratio", "token_k3"]

CLAMP = 20.0
Array = Any  # numpy.ndarray or torch.Tensor


_F = TypeVar("_F", bound=Callable[..., Any])


def _quiet(fn: _F) -> _F:
    """Overflow to inf on extreme (masked-out) inputs is expected and decides correctly."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _f64(x: Array) -> Array:
    if _is_torch(x):
        return x.double()
    return np.asarray(x, dtype=np.float64)


def log_ratio(logp_train: Array, logp_rollout: Array) -> Array:
    """δ = π − μ in float64."""
    return _f64(logp_train) - _f64(logp_rollout)


def _clamp(d: Array) -> Array:
    return d.clamp(-CLAMP, CLAMP) if _is_torch(d) else np.clip(d, -CLAMP, CLAMP)


@_quiet
def token_k3(d: Array) -> Array:
    """k3 = expm1(δc) − δc, by series below |δ| = 1e-2 where the subtraction would cancel."""
    series = d * d * (0.5 + d * (1 / 6 + d * (1 / 24 + d * (1 / 120 + d * (1 / 720 + d / 5040)))))
    dc = _clamp(d)
    if _is_torch(d):
        import torch

        return torch.where(d.abs() < 1e-2, series, torch.expm1(dc) - dc)
    return np.where(np.abs(d) < 1e-2, series, np.expm1(dc) - dc)


def _segments(cu_seqlens: Array, n: int) -> tuple[Array, int]:
    """Sequence id of every position, and the number of sequences."""
    if _is_torch(cu_seqlens):
        import torch

        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        nseq = int(lengths.shape[0])
        ids = torch.repeat_interleave(torch.arange(nseq, device=cu_seqlens.device), lengths)
        return ids, nseq
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    return np.repeat(np.arange(cu.shape[0] - 1), np.diff(cu)), cu.shape[0] - 1


def _seq_sum(values: Array, ids: Array, nseq: int) -> Array:
    if _is_torch(values):
        import torch

        out = torch.zeros(nseq, dtype=values.dtype, device=values.device)
        return out.index_add_(0, ids, values)
    return np.bincount(ids, weights=values, minlength=nseq)


def _seq_stats(
    logp_train: Array, logp_rollout: Array, cu_seqlens: Array, loss_mask: Array
) -> tuple[Array, Array, Array, Array]:
    """(L_s, n_s, per-position sequence id, δ) over masked tokens."""
    d = log_ratio(logp_train, logp_rollout)
    ids, nseq = _segments(cu_seqlens, d.shape[0])
    m = _f64(loss_mask)
    return _seq_sum(d * m, ids, nseq), _seq_sum(m, ids, nseq), ids, d


def _expand(seq_keep: Array, n_s: Array, ids: Array) -> Array:
    """Broadcast sequence decisions to positions; sequences without masked tokens are kept."""
    keep = seq_keep | (n_s == 0)
    return keep[ids]
