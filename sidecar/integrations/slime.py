"""slime plug-in: ESTR as a `--custom-tis-function-path` function.

slime's `policy_loss_function` (`slime/backends/megatron_utils/loss.py`) calls the TIS function as
`f(args, pg_loss=…, train_log_probs=…, rollout_log_probs=…, loss_masks=…, total_lengths=…,
response_lengths=…)` where `pg_loss` is the flat per-token loss of the micro-batch (all samples
concatenated, not yet reduced), the three `*_log_probs`/`loss_masks` are lists with one 1-D tensor
per sample (`train_log_probs` is π_old, `batch["log_probs"]`, or the current log-probs detached
when slime has none), and expects `(pg_loss, modified_loss_masks, metrics)` back: the per-token
loss with rejected tokens zeroed, per-sample masks with rejected tokens set to 0 (slime rebuilds
its reducer from them for the numerator and keeps the original per-rollout token totals as the
denominator, exactly ESTR's Σ|o|), and a dict of flat per-token metric tensors that slime averages
with the original masks.

Entropy: slime computes H from the trainer's logits in the same `policy_loss_function`
(`get_log_probs_and_entropy(..., with_entropy=True)`, after `--rollout-temperature` scaling) but
does not pass it to the TIS function. `install_entropy_hook` (use it as
`--custom-megatron-init-path timwatch.sidecar.integrations.slime.install_entropy_hook`) wraps that
function so its per-sample entropies are kept for the TIS call that follows on the same
micro-batch; the TIS function consumes them, so a call that no forward preceded (a stale
context) raises `PluginContextError` instead of masking with another micro-batch's entropy, and
so do per-sample entropies whose lengths differ from the call's. τ and ε come from
`args.estr_tau` / `args.estr_eps` (set them in the YAML of `--custom-config-path`), else
TIMWATCH_ESTR_TAU / TIMWATCH_ESTR_EPS, else 1.6 / 0.01.

Context parallelism is not supported yet: with `--context-parallel-size` > 1 the per-sample
tensors are CP shards while `loss_masks` are whole, and the function says so instead of guessing.
"""

from __future__ import annotations

import contextvars
import functools
import os
from typing import Any

import torch

from ...monitor.core.errors import PluginContextError
from ...monitor.core.masks import estr_keep_mask
from ...monitor.trainer.losses import k3

__all__ = ["estr_tis_function", "install_entropy_hook", "set_entropy"]

_ENTROPY: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "timwatch_slime_entropy", default=None
)


def set_entropy(entropy: list[torch.Tensor] | None) -> None:
    """Hand the per-sample entropies of the current micro-batch to `estr_tis_function`."""
    _ENTROPY.set(None if entropy is None else [e.detach() for e in entropy])


def install_entropy_hook(args: Any = None, module: Any = None) -> bool:
    """Wrap slime's `get_log_probs_and_entropy` so the entropies it computes are kept.

    Signature `f(args)` fits `--custom-megatron-init-path`. `module` defaults to
    `slime.backends.megatron_utils.loss`; returns False when slime is not importable.
    """
    del args
    if module is None:
        try:
            from slime.backends.megatron_utils import loss as slime_loss
        except ImportError:
            return False
        module = slime_loss
    original = module.get_log_probs_and_entropy
    if getattr(original, "_timwatch_hooked", False):
        return True

    @functools.wraps(original)
    def get_log_probs_and_entropy(*a: Any, **kw: Any) -> Any:
        out = original(*a, **kw)
        result = out[1] if isinstance(out, tuple) else out
        entropy = result.get("entropy") if isinstance(result, dict) else None
        if entropy is not None:
            set_entropy(list(entropy))
        return out

    get_log_probs_and_entropy._timwatch_hooked = True  # type: ignore[attr-defined]
    module.get_log_probs_and_entropy = get_log_probs_and_entropy
    return True


def _param(args: Any, name: str, env: str, default: float) -> float:
    value = getattr(args, name, None)
    if value is not None:
        return float(value)
    return float(os.environ.get(env, default))


def estr_tis_function(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Apply the ESTR mask δ² ≤ τ(H + ε), δ = π_old − μ, to slime's per-token policy loss.

    Metrics (flat per-token float32, averaged by slime): `estr_mask_ratio` (1 where rejected),
    `estr_score` (δ²/(H+ε)), `mismatch_kl` (k3 of δ), `tis` (e^δ, slime's own name for it).
    """
    del kwargs, total_lengths
    entropy = _ENTROPY.get()
    _ENTROPY.set(None)  # one micro-batch's: consumed here
    if entropy is None:
        raise PluginContextError(
            "estr_tis_function: no entropy for this micro-batch; add "
            "--custom-megatron-init-path timwatch.sidecar.integrations.slime.install_entropy_hook"
        )
    n = len(loss_masks)
    for name, seq in (
        ("train_log_probs", train_log_probs),
        ("rollout_log_probs", rollout_log_probs),
        ("entropy", entropy),
    ):
        if len(seq) != n:
            raise PluginContextError(f"estr_tis_function: {len(seq)} {name} for {n} loss_masks")
        for i, (t, m) in enumerate(zip(seq, loss_masks, strict=True)):
            if t.numel() != m.numel():
                cp = getattr(args, "context_parallel_size", 1) or 1
                hint = " (context parallelism is not supported yet)" if cp > 1 else ""
                raise PluginContextError(
                    f"estr_tis_function: {name}[{i}] has {t.numel()} tokens, loss_masks[{i}] "
                    f"has {m.numel()} (response_lengths[{i}] = {response_lengths[i]}){hint}"
                )
    tau = _param(args, "estr_tau", "TIMWATCH_ESTR_TAU", 1.6)
    eps = _param(args, "estr_eps", "TIMWATCH_ESTR_EPS", 0.01)
    with torch.no_grad():
        pi = torch.cat([t.detach() for t in train_log_probs]).float()
        mu = torch.cat(list(rollout_log_probs)).float()
        h = torch.cat(entropy).float()
        if pi.numel() != pg_loss.numel():
            raise ValueError(
                f"estr_tis_function: pg_loss has {pg_loss.numel()} tokens, the samples {pi.numel()}"
            )
        keep = estr_keep_mask(pi, mu, h, tau=tau, eps=eps)
        delta = pi - mu
        metrics = {
            "estr_mask_ratio": (~keep).float(),
            "estr_score": (delta * delta / (h + eps)).float(),
            "mismatch_kl": k3(delta).float(),
            "tis": torch.exp(delta.clamp(-20.0, 20.0)),
        }
    pg_loss = torch.where(keep.reshape(pg_loss.shape), pg_loss, torch.zeros_like(pg_loss))
    sizes = [m.numel() for m in loss_masks]
    masks = [
        m * k.reshape(m.shape).to(m.dtype)
        for m, k in zip(loss_masks, keep.split(sizes), strict=True)
    ]
    return pg_loss, masks, metrics
