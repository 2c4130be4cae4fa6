"""Per-step buckets merged over a window: the ``length_buckets`` / ``lag_buckets`` of the steps
whose details were read, token-weighted (each bucket's ``mismatch_kl`` is a mean k3 over its
tokens, so tokens × k3 adds exactly)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .series import StepSeries

__all__ = ["Bucket", "LengthGrowth", "detail_span", "length_growth", "merge_buckets", "worst_mu"]


@dataclass(frozen=True)
class Bucket:
    key: int
    tokens: int
    mismatch_kl: float


def merge_buckets(series: StepSeries, name: str, min_tokens: int = 1) -> list[Bucket]:
    """Buckets of detail ``name`` summed over the steps read, by ascending key; buckets with
    fewer than ``min_tokens`` tokens or no finite k3 are left out."""
    tokens: dict[int, int] = {}
    k3: dict[int, float] = {}
    for d in series.details.values():
        found = d.get(name) or {}
        if not isinstance(found, dict):
            continue
        for key, b in found.items():
            try:
                k, n, kl = int(key), int(b.get("tokens") or 0), b.get("mismatch_kl")
            except (TypeError, ValueError, AttributeError):
                continue
            if n <= 0 or kl is None or not math.isfinite(float(kl)):
                continue
            tokens[k] = tokens.get(k, 0) + n
            k3[k] = k3.get(k, 0.0) + n * float(kl)
    return [
        Bucket(k, tokens[k], k3[k] / tokens[k]) for k in sorted(tokens) if tokens[k] >= min_tokens
    ]


def detail_span(series: StepSeries) -> tuple[int | None, int | None]:
    """First and last step whose details were read."""
    if not series.details:
        return None, None
    keys = sorted(series.details)
    return keys[0], keys[-1]


def worst_mu(series: StepSeries) -> list[float]:
    """μ = e^logp_rollout of every stored worst token (top ESTR scores) of the steps read."""
    out: list[float] = []
    for d in series.details.values():
        tokens: Iterable[Any] = d.get("worst_tokens") or ()
        for t in tokens:
            lp = t.get("logp_rollout") if isinstance(t, dict) else None
            if lp is not None and math.isfinite(float(lp)):
                out.append(math.exp(min(0.0, float(lp))))
    return out


@dataclass(frozen=True)
class LengthGrowth:
    """k3 per token ×``per_doubling`` per doubling of the response length, fitted over
    ``buckets`` (ascending log2 length, each with ≥ ``min_tokens`` tokens and k3 > 0)."""

    per_doubling: float
    buckets: list[Bucket]


def length_growth(series: StepSeries, min_tokens: int) -> LengthGrowth | None:
    """The token-weighted least-squares slope of log k3 against the log2 length bucket, as a
    factor per doubling; None with fewer than 2 usable buckets."""
    buckets = [b for b in merge_buckets(series, "length_buckets", min_tokens) if b.mismatch_kl > 0]
    if len(buckets) < 2:
        return None
    x = np.array([b.key for b in buckets], dtype=np.float64)
    y = np.log([b.mismatch_kl for b in buckets])
    w = np.array([b.tokens for b in buckets], dtype=np.float64)
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    var = float(np.average((x - xm) ** 2, weights=w))
    slope = float(np.average((x - xm) * (y - ym), weights=w)) / var if var > 0 else 0.0
    return LengthGrowth(math.exp(slope), buckets)
