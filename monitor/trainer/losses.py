"""Trainer-side policy losses: the ESTR PPO loss and decoupled PPO with a proxy old policy.

docs/reference/policies.md. Everything here takes torch tensors of any matching shape (flat packed
`[tokens]` or padded `[batch, response_len]`) on any device, computes in at least float32 (KL-type
metrics in float64), never copies to the host, and returns metrics as detached 0-d tensors so the
caller decides when to synchronise. The ESTR mask comes from `core.masks.estr_keep_mask`, the same
function the monitor uses for shadow evaluation, so what the dashboard shows as `mask_ratio{estr}`
is what the loss drops.

This module imports torch and is for trainer-side code only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..core.masks import estr_keep_mask

__all__ = [
    "DecoupledRatios",
    "EwmaOldPolicy",
    "decoupled_ppo_loss",
    "decoupled_ratios",
    "estr_ppo_loss",
    "k3",
    "ppo_clip_token_loss",
]

LOG_RATIO_CLAMP = 20.0


def _float(x: torch.Tensor) -> torch.Tensor:
    """At least float32: bf16/fp16 log-probs lose the 1e-4 differences the mask looks at."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _as_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def _check_shapes(**tensors: torch.Tensor | None) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(shapes.items()))
    for name, shape in shapes.items():
        if shape != first:
            raise ValueError(f"{name} has shape {shape} but {first_name} has shape {first}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum() / count


def k3(delta: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = expm1(δc) − δc in float64, δc = clip(δ, ±20): ≥ 0 and exact near δ = 0."""
    dc = delta.to(torch.float64).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(dc) - dc


def ppo_clip_token_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.20,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token −min(ρA, clip(ρ, 1−clip_low, 1+clip_high)A) and whether the clip was active.

    ρ = exp(clamp(log_ratio, ±20)); the clamp keeps exp finite and matches verl's.
    """
    ratio = torch.exp(_float(log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = _float(advantages)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def estr_ppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    entropy: torch.Tensor | None,
    *,
    tau: float = 1.6,
    eps: float = 0.01,
    clip_low: float = 0.20,
    clip_high: float = 0.28,
    use_mask: bool = True,
    mask_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ESTR PPO loss, token-mean over response tokens.

    L = −Σ_t M_t · min(ρ_t A_t, clip(ρ_t, 1−clip_low, 1+clip_high) A_t) / Σ_t loss_mask_t with
    ρ_t = exp(log_prob − old_log_prob) and M_t = loss_mask_t · estr_keep(π_t, μ_t, H_t) computed
    without gradient. The denominator counts every response token, rejected ones included, so
    rejecting a token removes its gradient without re-weighting the others.

    π_t in the mask is `mask_log_prob` when given, else `old_log_prob`: the trainer's recomputation
    under the weights that sampled the token, so δ = π − μ is the train–inference mismatch proper.
    In bypass set-ups where old_log_prob *is* μ, pass `mask_log_prob=log_prob.detach()`.
    `entropy` is H_t in nats (trainer-side from the logits when the engine does not return it);
    it is detached here. With `use_mask=False` the loss is plain asymmetric PPO-clip and
    `rollout_log_prob` / `entropy` may be None.

    Metrics (detached 0-d tensors): `response_tokens`, `pg_clipfrac`, `ppo_kl` (mean old − new),
    and with the mask `estr_mask_ratio` (share of response tokens rejected) and `mismatch_kl`
    (mean k3 of π − μ over response tokens).
    """
    _check_shapes(
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        loss_mask=loss_mask,
        rollout_log_prob=rollout_log_prob,
        entropy=entropy,
        mask_log_prob=mask_log_prob,
    )
    response = _as_mask(loss_mask)
    count = response.sum().to(torch.float32).clamp(min=1.0)
    log_ratio = _float(log_prob) - _float(old_log_prob).detach()
    per_token, clip_active = ppo_clip_token_loss(log_ratio, advantages, clip_low, clip_high)
    metrics: dict[str, torch.Tensor] = {"response_tokens": response.sum().detach()}
    keep = response
    if use_mask:
        if rollout_log_prob is None or entropy is None:
            raise ValueError("use_mask=True needs rollout_log_prob (μ) and entropy (H)")
        with torch.no_grad():
            pi = _float(mask_log_prob if mask_log_prob is not None else old_log_prob).detach()
            mu = _float(rollout_log_prob).detach()
            estr_keep = estr_keep_mask(pi, mu, _float(entropy).detach(), tau=tau, eps=eps)
            keep = response & estr_keep
            metrics["estr_mask_ratio"] = (response & ~estr_keep).sum().to(torch.float32) / count
            metrics["mismatch_kl"] = _masked_mean(k3(pi - mu), response, count.double())
    loss = torch.where(keep, per_token, torch.zeros_like(per_token)).sum() / count
    with torch.no_grad():
        metrics["pg_clipfrac"] = _masked_mean(clip_active.float(), keep, count)
        metrics["ppo_kl"] = _masked_mean(-log_ratio.detach(), response, count)
    return loss, metrics


@dataclass(frozen=True)
class DecoupledRatios:
    """The two ratios decoupled PPO separates (arXiv 2605.12070), all detached except staleness.

    discrepancy = e^{logp_old − μ}: engine vs trainer under the behaviour weights; an importance
    weight, masked symmetrically (kept iff 1/bound ≤ ratio ≤ bound).
    staleness = e^{π_θ − logp_old}: how far the update moved from the behaviour weights; gets the
    asymmetric PPO clip. `staleness_clipped` is its clipped value, `staleness_clip_active` where the
    clip bit. Metrics are detached 0-d tensors: `discrepancy_kl` and `staleness_kl` (mean k3 over
    response tokens, float64), `discrepancy_mask_ratio`, `staleness_clipfrac`.
    """

    discrepancy_ratio: torch.Tensor
    discrepancy_keep: torch.Tensor
    staleness_ratio: torch.Tensor
    staleness_clipped: torch.Tensor
    staleness_clip_active: torch.Tensor
    metrics: dict[str, torch.Tensor]


def decoupled_ratios(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    discrepancy_bound: float = 2.0,
    clip_low: float = 0.20,
    clip_high: float = 0.28,
) -> DecoupledRatios:
    """Split the off-policy ratio e^{π_θ − μ} into discrepancy × staleness (see DecoupledRatios).

    `discrepancy_bound` > 1 is the symmetric bound in ratio space (|logp_old − μ| ≤ log bound);
    the design leaves its value open, 2.0 keeps the same [0.5, 2] band as `seq_mis`.
    """
    if not discrepancy_bound > 1.0:
        raise ValueError(f"discrepancy_bound must be > 1, got {discrepancy_bound}")
    _check_shapes(
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        rollout_log_prob=rollout_log_prob,
        loss_mask=loss_mask,
    )
    response = _as_mask(loss_mask)
    count = response.sum().to(torch.float32).clamp(min=1.0)
    old = _float(old_log_prob).detach()
    with torch.no_grad():
        disc_delta = old - _float(rollout_log_prob)
        disc = torch.exp(disc_delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        disc_keep = disc_delta.abs() <= torch.log(torch.tensor(discrepancy_bound, dtype=old.dtype))
    stale_delta = _float(log_prob) - old
    stale = torch.exp(stale_delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    stale_clipped = stale.clamp(1.0 - clip_low, 1.0 + clip_high)
    with torch.no_grad():
        active = stale_clipped != stale
        metrics = {
            "discrepancy_kl": _masked_mean(k3(disc_delta), response, count.double()),
            "staleness_kl": _masked_mean(k3(stale_delta.detach()), response, count.double()),
            "discrepancy_mask_ratio": (response & ~disc_keep).sum().to(torch.float32) / count,
            "staleness_clipfrac": _masked_mean(active.float(), response, count),
        }
    return DecoupledRatios(disc, disc_keep, stale, stale_clipped, active, metrics)


def decoupled_ppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    discrepancy_bound: float = 2.0,
    clip_low: float = 0.20,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO: −Σ K_t w_t min(s_t A_t, clip(s_t) A_t) / Σ loss_mask, token-mean.

    w = discrepancy ratio (no gradient), K = its symmetric keep mask, s = staleness ratio.
    """
    r = decoupled_ratios(
        log_prob,
        old_log_prob,
        rollout_log_prob,
        loss_mask,
        discrepancy_bound=discrepancy_bound,
        clip_low=clip_low,
        clip_high=clip_high,
    )
    _check_shapes(log_prob=log_prob, advantages=advantages)
    response = _as_mask(loss_mask)
    count = response.sum().to(torch.float32).clamp(min=1.0)
    adv = _float(advantages)
    per_token = torch.maximum(-adv * r.staleness_ratio, -adv * r.staleness_clipped)
    keep = response & r.discrepancy_keep
    weighted = torch.where(keep, per_token * r.discrepancy_ratio, torch.zeros_like(per_token))
    return weighted.sum() / count, dict(r.metrics)


class EwmaOldPolicy:
    """An exponential moving average of a model's weights, used as the old policy π_old.

    When logp_old cannot be recomputed under the exact behaviour weights (they are gone in
    asynchronous RL), timwatch uses an EWMA with β = W/(W+2) over the version window W: its
    weights have mean age β/(1−β) = W/2 versions, the mean age of a uniform window of W versions.
    Call `update()` after each optimizer step, compute logp_old inside `with ewma.applied():`,
    and `maybe_reset(keep_ratio)` once per step with the train–inference keep ratio (1 − ESTR
    mask ratio): when it falls under `reset_threshold` the average has drifted too far from the
    policy that actually samples and is reset to the current weights.

    The shadow weights are float32 copies of the floating-point parameters on their own devices;
    buffers are not averaged.
    """

    def __init__(self, model: torch.nn.Module, window: int, *, reset_threshold: float = 0.9):
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 0.0 <= reset_threshold <= 1.0:
            raise ValueError(f"reset_threshold must be in [0, 1], got {reset_threshold}")
        self.model = model
        self.window = int(window)
        self.beta = self.window / (self.window + 2.0)
        self.reset_threshold = float(reset_threshold)
        self.resets = 0
        self._params = [p for p in model.parameters() if p.is_floating_point()]
        self._shadow = [p.detach().to(torch.float32, copy=True) for p in self._params]

    @torch.no_grad()
    def update(self) -> None:
        """shadow ← β·shadow + (1 − β)·current."""
        current = [p.detach().to(torch.float32) for p in self._params]
        torch._foreach_mul_(self._shadow, self.beta)
        torch._foreach_add_(self._shadow, current, alpha=1.0 - self.beta)

    @torch.no_grad()
    def reset(self) -> None:
        """shadow ← current weights."""
        for s, p in zip(self._shadow, self._params, strict=True):
            s.copy_(p.detach())
        self.resets += 1

    def maybe_reset(self, keep_ratio: float | torch.Tensor) -> bool:
        """Reset when the train–inference keep ratio is under the threshold; True if it did."""
        value = float(keep_ratio)
        if value < self.reset_threshold:
            self.reset()
            return True
        return False

    def shadow_parameters(self) -> list[torch.Tensor]:
        """The averaged weights (float32), in `model.parameters()` order."""
        return list(self._shadow)

    @contextmanager
    def applied(self) -> Iterator[torch.nn.Module]:
        """Temporarily load the averaged weights into the model (restored on exit)."""
        with torch.no_grad():
            backup = [p.detach().clone() for p in self._params]
            for p, s in zip(self._params, self._shadow, strict=True):
                p.copy_(s)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, b in zip(self._params, backup, strict=True):
                    p.copy_(b)
