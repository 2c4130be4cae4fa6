"""Mask policies (docs/reference/policies.md) on numpy arrays and torch tensors alike (1 = keep).

Each policy is a small function that takes the arrays of one framework and answers a boolean
array of the same framework on the same device: torch tensors are never copied to the host, so
a trainer can apply a mask inside its loss. All comparisons are made in float64 and in log space
(δ against log-thresholds rather than r against thresholds), which is exact, cannot overflow, and
gives numpy and torch bit-identical decisions. The engine's fused kernel applies the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .mask_ops import (  # CLAMP: re-exported for core.row
    CLAMP,
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
from .rs_modes import verl_keep_mask

if TYPE_CHECKING:
    from .batch import Batch

__all__ = [
    "CLAMP",
    "POLICIES",
    "SEQUENCE_POLICIES",
    "TOKEN_POLICIES",
    "VERL_SEQUENCE_POLICIES",
    "VERL_TOKEN_POLICIES",
    "PolicyParams",
    "delta_abs_keep_mask",
    "estr_keep_mask",
    "geo_rs_keep_mask",
    "icepop_keep_mask",
    "k3_rs_keep_mask",
    "keep_masks",
    "kpop_keep_mask",
    "log_ratio",
    "seq_mis_keep_mask",
    "tis_keep_mask",
    "tis_weights",
    "token_k3",
]

#: verl's rejection-sampling modes (rollout_corr_helper) that the original eight do not cover
VERL_TOKEN_POLICIES = ("token_k1", "token_k2", "token_k3")
VERL_SEQUENCE_POLICIES = ("seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_max_k2", "seq_max_k3")
TOKEN_POLICIES = ("estr", "delta_abs", "icepop", "kpop", "tis", *VERL_TOKEN_POLICIES)
SEQUENCE_POLICIES = ("seq_mis", "geo_rs", "k3_rs", *VERL_SEQUENCE_POLICIES)
#: the original eight first (their accumulator slots and store columns never move), then verl's
POLICIES = (
    "estr", "delta_abs", "icepop", "kpop", "tis", "seq_mis", "geo_rs", "k3_rs",
    *VERL_TOKEN_POLICIES, *VERL_SEQUENCE_POLICIES,
)  # fmt: skip
P_MIN, P_MAX = 1e-8, 1.0 - 1e-8
#: the smallest ESTR ε: with every accepted δ (|δ| ≤ 1e5) and H = 0 the score δ²/(H + ε) stays
#: ≤ 1e19, so its sum over 2^31 tokens cannot overflow
EPS_MIN = 1e-9
Array = Any  # numpy.ndarray or torch.Tensor


def _param(default: float, policy: str, help_: str) -> Any:
    """A `PolicyParams` field: its default, the policy it belongs to and a one-line help. The
    CLI options, the API's query parameters and the reference docs are all made from these."""
    return field(default=default, metadata={"policy": policy, "help": help_})


@dataclass(frozen=True)
class PolicyParams:
    """Every policy's parameters with the defaults of docs/reference/policies.md (ESTR's τ is the
    math default)."""

    tau: float = _param(1.6, "estr", "ESTR τ: keep iff δ² ≤ τ(H + ε) (1.6 math, 0.7 agentic)")
    eps: float = _param(0.01, "estr", "ESTR ε added to the entropy")
    delta_abs_c: float = _param(1.0, "delta_abs", "delta_abs C: keep iff |δ| ≤ √(τC)")
    icepop_low: float = _param(0.5, "icepop", "IcePop α: keep iff α ≤ r")
    icepop_high: float = _param(5.0, "icepop", "IcePop β: keep iff r ≤ β")
    kpop_phi: float = _param(0.1, "kpop", "KPop φ: keep iff both Bernoulli KLs ≤ φ")
    tis_c: float = _param(2.0, "tis", "TIS C: weights truncated at C")
    seq_mis_low: float = _param(0.5, "seq_mis", "sequence MIS lower bound on e^L")
    seq_mis_high: float = _param(2.0, "seq_mis", "sequence MIS upper bound on e^L")
    geo_rs_low: float = _param(0.999, "geo_rs", "Geo-RS lower bound on e^(L/n)")
    geo_rs_high: float = _param(1.001, "geo_rs", "Geo-RS upper bound on e^(L/n)")
    k3_rs_kappa: float = _param(0.01, "k3_rs", "K3-RS κ: keep iff the sequence's mean k3 ≤ κ")
    token_k1_lower: float = _param(
        0.6, "token_k1", "token_k1 lower ratio bound: keep iff ln lo ≤ −δc"
    )
    token_k1_upper: float = _param(
        1.6, "token_k1", "token_k1 upper ratio bound: keep iff −δc ≤ ln hi"
    )
    token_k2_upper: float = _param(2.5, "token_k2", "token_k2: keep iff δc²/2 ≤ this")
    token_k3_upper: float = _param(2.5, "token_k3", "token_k3: keep iff k3 ≤ this")
    seq_sum_k2_upper: float = _param(2.5, "seq_sum_k2", "seq_sum_k2: keep iff Σ_s δc²/2 ≤ this")
    seq_sum_k3_upper: float = _param(2.5, "seq_sum_k3", "seq_sum_k3: keep iff Σ_s k3 ≤ this")
    seq_mean_k2_upper: float = _param(
        0.01, "seq_mean_k2", "seq_mean_k2: keep iff mean_s δc²/2 ≤ this"
    )
    seq_max_k2_upper: float = _param(2.5, "seq_max_k2", "seq_max_k2: keep iff max_s δc²/2 ≤ this")
    seq_max_k3_upper: float = _param(2.5, "seq_max_k3", "seq_max_k3: keep iff max_s k3 ≤ this")

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"policy parameter {name} must be a positive number, got {value}")
        if self.eps < EPS_MIN:
            raise ValueError(f"policy parameter eps must be ≥ {EPS_MIN:g}, got {self.eps}")
        for lo, hi in (
            ("icepop_low", "icepop_high"),
            ("seq_mis_low", "seq_mis_high"),
            ("token_k1_lower", "token_k1_upper"),
        ):
            if getattr(self, lo) >= getattr(self, hi):
                raise ValueError(f"{lo} must be below {hi}")
        if self.geo_rs_low >= self.geo_rs_high:
            raise ValueError("geo_rs_low must be below geo_rs_high")

    def kernel_vector(self) -> np.ndarray:
        """Thresholds as the fused kernel reads them (log space where the rule is on r)."""
        return np.array(
            [
                self.tau,
                self.eps,
                self.tau * self.delta_abs_c,
                math.log(self.icepop_low),
                math.log(self.icepop_high),
                self.kpop_phi,
                math.log(self.tis_c),
                math.log(self.seq_mis_low),
                math.log(self.seq_mis_high),
                math.log(self.geo_rs_low),
                math.log(self.geo_rs_high),
                self.k3_rs_kappa,
                math.log(self.token_k1_lower),
                math.log(self.token_k1_upper),
                self.token_k2_upper,
                self.token_k3_upper,
                self.seq_sum_k2_upper,
                self.seq_sum_k3_upper,
                self.seq_mean_k2_upper,
                self.seq_max_k2_upper,
                self.seq_max_k3_upper,
                self.tis_c,
                self.tis_c - 1.0,
                1.0 / self.tis_c - 1.0,
            ],
            dtype=np.float64,
        )


@_quiet
def estr_keep_mask(
    logp_train: Array, logp_rollout: Array, entropy: Array, tau: float = 1.6, eps: float = 0.01
) -> Array:
    """ESTR: keep iff δ² ≤ τ(H + ε) — the trust region widens with the token's entropy."""
    d = log_ratio(logp_train, logp_rollout)
    return d * d <= tau * (_f64(entropy) + eps)


@_quiet
def delta_abs_keep_mask(
    logp_train: Array, logp_rollout: Array, tau: float = 1.6, C: float = 1.0
) -> Array:
    """Fixed threshold |δ| ≤ √(τC), evaluated as δ² ≤ τC: exactly ESTR with H + ε ≡ C."""
    d = log_ratio(logp_train, logp_rollout)
    return d * d <= tau * C


@_quiet
def icepop_keep_mask(
    logp_train: Array, logp_rollout: Array, low: float = 0.5, high: float = 5.0
) -> Array:
    """IcePop: keep iff low ≤ r ≤ high, r = exp(clamp(δ))."""
    dc = _clamp(log_ratio(logp_train, logp_rollout))
    return (dc >= math.log(low)) & (dc <= math.log(high))


@_quiet
def tis_keep_mask(logp_train: Array, logp_rollout: Array, c: float = 2.0) -> Array:
    """TIS never drops a token; "rejected" here means truncated (r > C)."""
    return _clamp(log_ratio(logp_train, logp_rollout)) <= math.log(c)


@_quiet
def tis_weights(logp_train: Array, logp_rollout: Array, c: float = 2.0) -> Array:
    """Truncated importance weights min(r, C)."""
    dc = _clamp(log_ratio(logp_train, logp_rollout))
    r = dc.exp() if _is_torch(dc) else np.exp(dc)
    return r.clamp(max=c) if _is_torch(r) else np.minimum(r, c)


@_quiet
def kpop_keep_mask(logp_train: Array, logp_rollout: Array, phi: float = 0.1) -> Array:
    """KPop: keep iff the larger Bernoulli KL between p = e^π and q = e^μ is ≤ φ."""
    lt, lr = _f64(logp_train), _f64(logp_rollout)
    if _is_torch(lt):
        p, q = lt.exp().clamp(P_MIN, P_MAX), lr.exp().clamp(P_MIN, P_MAX)
        lp, lq = p.log(), q.log()
        lam = ((1.0 - p) / (1.0 - q)).log()
    else:
        p, q = np.clip(np.exp(lt), P_MIN, P_MAX), np.clip(np.exp(lr), P_MIN, P_MAX)
        lp, lq = np.log(p), np.log(q)
        lam = np.log((1.0 - p) / (1.0 - q))
    d_pq = p * (lp - lq) + (1.0 - p) * lam
    d_qp = q * (lq - lp) - (1.0 - q) * lam
    return (d_pq <= phi) & (d_qp <= phi)


@_quiet
def seq_mis_keep_mask(
    logp_train: Array,
    logp_rollout: Array,
    cu_seqlens: Array,
    loss_mask: Array,
    low: float = 0.5,
    high: float = 2.0,
) -> Array:
    """Sequence MIS: keep a sequence iff low ≤ exp(L_s) ≤ high."""
    big_l, n_s, ids, _ = _seq_stats(logp_train, logp_rollout, cu_seqlens, loss_mask)
    return _expand((big_l >= math.log(low)) & (big_l <= math.log(high)), n_s, ids)


@_quiet
def geo_rs_keep_mask(
    logp_train: Array,
    logp_rollout: Array,
    cu_seqlens: Array,
    loss_mask: Array,
    low: float = 0.999,
    high: float = 1.001,
) -> Array:
    """Geometric-mean rejection sampling: keep iff low ≤ exp(L_s / n_s) ≤ high."""
    big_l, n_s, ids, _ = _seq_stats(logp_train, logp_rollout, cu_seqlens, loss_mask)
    g = big_l / (n_s.clamp(min=1) if _is_torch(n_s) else np.maximum(n_s, 1))
    return _expand((g >= math.log(low)) & (g <= math.log(high)), n_s, ids)


@_quiet
def k3_rs_keep_mask(
    logp_train: Array,
    logp_rollout: Array,
    cu_seqlens: Array,
    loss_mask: Array,
    kappa: float = 0.01,
) -> Array:
    """K3 rejection sampling: keep iff the sequence's mean k3 ≤ κ."""
    _, n_s, ids, d = _seq_stats(logp_train, logp_rollout, cu_seqlens, loss_mask)
    k3_sum = _seq_sum(token_k3(d) * _f64(loss_mask), ids, n_s.shape[0])
    mean = k3_sum / (n_s.clamp(min=1) if _is_torch(n_s) else np.maximum(n_s, 1))
    return _expand(mean <= kappa, n_s, ids)


def keep_masks(
    batch: Batch, policies: Sequence[str] = POLICIES, params: PolicyParams | None = None
) -> dict[str, np.ndarray]:
    """Keep masks (bool per position) of the named policies for a validated batch."""
    p = params or PolicyParams()
    lt, lr = batch.logp_train, batch.logp_rollout
    seq_args = (lt, lr, batch.cu_seqlens, batch.loss_mask)
    out: dict[str, np.ndarray] = {}
    for name in policies:
        if name == "estr":
            out[name] = estr_keep_mask(lt, lr, batch.entropy, p.tau, p.eps)
        elif name == "delta_abs":
            out[name] = delta_abs_keep_mask(lt, lr, p.tau, p.delta_abs_c)
        elif name == "icepop":
            out[name] = icepop_keep_mask(lt, lr, p.icepop_low, p.icepop_high)
        elif name == "kpop":
            out[name] = kpop_keep_mask(lt, lr, p.kpop_phi)
        elif name == "tis":
            out[name] = tis_keep_mask(lt, lr, p.tis_c)
        elif name == "seq_mis":
            out[name] = seq_mis_keep_mask(*seq_args, p.seq_mis_low, p.seq_mis_high)
        elif name == "geo_rs":
            out[name] = geo_rs_keep_mask(*seq_args, p.geo_rs_low, p.geo_rs_high)
        elif name == "k3_rs":
            out[name] = k3_rs_keep_mask(*seq_args, p.k3_rs_kappa)
        elif name in VERL_TOKEN_POLICIES or name in VERL_SEQUENCE_POLICIES:
            out[name] = verl_keep_mask(name, lt, lr, batch.cu_seqlens, batch.loss_mask, p)
        else:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return out
