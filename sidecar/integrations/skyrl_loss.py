"""SkyRL plug-in, the loss side: the `estr` policy loss for SkyRL's `PolicyLossRegistry` and the
per-micro-batch entropy context it reads (the entry module is
`timwatch.sidecar.integrations.skyrl`).

SkyRL's policy-loss signature (`skyrl/backends/skyrl_train/utils/ppo_utils.py`, checked against
skyrl 0.3.0) is `(log_probs, old_log_probs, advantages, config, loss_mask=None,
rollout_logprobs=None)` returning `(loss, metrics)`: it carries π (`log_probs`, with grad), π_old
(`old_log_probs`), μ (`rollout_logprobs`, right-aligned `[batch, num_actions]` like the others)
and the loss mask, but not H. SkyRL's worker computes H in the same forward that yields
`log_probs` (`output["entropy"]`); the entry module's forward hook on the policy model sets it
here keyed by that very `log_probs` tensor, and the loss refuses an entropy set for any other
tensor (`PluginContextError`), so it can never mask one micro-batch with another's entropy.
"""

from __future__ import annotations

import contextvars
import os
from typing import Any

import torch

from ...monitor.core.errors import PluginContextError
from ...monitor.core.masks import estr_keep_mask
from ...monitor.trainer.losses import k3, ppo_clip_token_loss

__all__ = ["ESTR_LOSS_NAME", "clear_entropy", "compute_policy_loss_estr", "set_entropy"]

ESTR_LOSS_NAME = "estr"

_ENTROPY: contextvars.ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = contextvars.ContextVar(
    "timwatch_skyrl_entropy", default=None
)


def set_entropy(log_probs: torch.Tensor, entropy: torch.Tensor) -> None:
    """H of the forward that produced `log_probs` (same shape), for the next loss call."""
    _ENTROPY.set((log_probs, entropy.detach()))


def clear_entropy() -> None:
    _ENTROPY.set(None)


def _entropy_for(log_probs: torch.Tensor) -> torch.Tensor:
    ctx = _ENTROPY.get()
    if ctx is None:
        raise PluginContextError(
            "skyrl estr loss: no entropy for this micro-batch; import "
            "timwatch.sidecar.integrations.skyrl in the policy worker (the estr registration "
            "does it) so its forward hook runs"
        )
    key, entropy = ctx
    if key is not log_probs:
        raise PluginContextError(
            "skyrl estr loss: the entropy context belongs to another forward than this call's "
            "log_probs; refusing to mask the wrong tokens"
        )
    if tuple(entropy.shape) != tuple(log_probs.shape):
        raise PluginContextError(
            f"skyrl estr loss: entropy has shape {tuple(entropy.shape)}, log_probs "
            f"{tuple(log_probs.shape)}"
        )
    return entropy


def compute_policy_loss_estr(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config: Any,
    loss_mask: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SkyRL policy loss `estr`: PPO-clip (`eps_clip_low` / `eps_clip_high`) with the
    stop-gradient ESTR mask δ² ≤ τ(H + ε), δ = π_old − μ.

    Rejected tokens contribute zero to SkyRL's `reduce_loss` sum while `loss_mask` (SkyRL
    pre-scales it for its loss reduction) stays as given, so the denominator is unchanged: at
    τ = ∞ the loss equals SkyRL's `regular`. τ and ε come from TIMWATCH_ESTR_TAU /
    TIMWATCH_ESTR_EPS (1.6 / 0.01). Metrics: `clip_ratio` (SkyRL's name), `estr_mask_ratio`,
    `mismatch_kl` (k3 of δ), each a mean over the loss-mask tokens.
    """
    if rollout_logprobs is None:
        raise PluginContextError(
            "skyrl estr loss: no rollout_logprobs; the generator must return the engine's "
            "log-probs (generator.sampling_params.logprobs=0)"
        )
    entropy = _entropy_for(log_probs)
    clear_entropy()  # one forward's: consumed here
    tau = float(os.environ.get("TIMWATCH_ESTR_TAU", 1.6))
    eps = float(os.environ.get("TIMWATCH_ESTR_EPS", 0.01))
    mask = torch.ones_like(log_probs) if loss_mask is None else loss_mask
    tokens = mask != 0
    with torch.no_grad():
        pi = old_log_probs.detach().float()
        mu = rollout_logprobs.detach().float()
        keep = estr_keep_mask(pi, mu, entropy.float(), tau=tau, eps=eps)
    log_ratio = log_probs.float() - old_log_probs.detach().float()
    per_token, clip_active = ppo_clip_token_loss(
        log_ratio, advantages, float(config.eps_clip_low), float(config.eps_clip_high)
    )
    per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
    loss = (per_token * mask).sum()
    with torch.no_grad():
        n = tokens.sum().clamp(min=1).double()
        metrics = torch.stack(
            [
                (clip_active & keep & tokens).sum().double() / n,
                (~keep & tokens).sum().double() / n,
                torch.where(tokens, k3(pi - mu).double(), 0.0).sum() / n,
            ]
        ).tolist()  # one host sync
    return loss.to(log_probs.dtype), dict(
        zip(("clip_ratio", "estr_mask_ratio", "mismatch_kl"), metrics, strict=True)
    )
