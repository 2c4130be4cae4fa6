"""verl plug-in, the loss side: the `estr` policy loss, its per-micro-batch context and the
per-token collector that ships μ, π_old and H (the entry module is
`timwatch.sidecar.integrations.verl`).

verl's policy-loss signature (`verl/trainer/ppo/core_algos.py`, `PolicyLossFn`) is
`(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)`
and returns `(loss, metrics)`. It does not carry the two things the ESTR mask needs: μ (verl's
`rollout_log_probs`, in the batch when `actor_rollout_ref.rollout.calculate_log_probs=True`) and
H (the `entropy` the engine computes from the trainer's logits when asked to). So the loss reads
both from a per-thread context (`EstrInputs`) that belongs to one micro-batch: the hooks
(`timwatch.sidecar.integrations.verl_hooks`) set it right before verl's loss function runs on a
micro-batch, keyed by that micro-batch's `old_log_probs`, and the loss consumes it. A missing
context, or one whose key differs from the loss's `old_log_prob` (another micro-batch, even of
the same shape), raises `PluginContextError`.
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...monitor.core.errors import ConfigError, PluginContextError, RunPaged
from ...monitor.core.masks import estr_keep_mask
from ...monitor.trainer.losses import k3, ppo_clip_token_loss

__all__ = [
    "ESTR_LOSS_NAME",
    "EstrInputs",
    "SupportsReport",
    "TimwatchTracking",
    "compute_policy_loss_estr",
    "estr_inputs",
    "pack_padded",
    "set_estr_inputs",
]

log = logging.getLogger(__name__)

ESTR_LOSS_NAME = "estr"


class SupportsReport(Protocol):
    """Anything with the tap's `report(step, **packed_arrays)` (keyword signature varies)."""

    @property
    def report(self) -> Callable[..., Any]: ...


@dataclass(frozen=True)
class EstrInputs:
    """What the ESTR mask needs beyond verl's loss arguments, shaped `[batch, response_len]`.

    `key`: the micro-batch's `old_log_probs`; when set, the loss refuses a call whose
    `old_log_prob` differs (another micro-batch). `once`: the first loss call consumes it.
    """

    rollout_log_probs: torch.Tensor
    entropy: torch.Tensor | None
    key: torch.Tensor | None = None
    once: bool = False


_INPUTS: contextvars.ContextVar[EstrInputs | None] = contextvars.ContextVar(
    "timwatch_estr_inputs", default=None
)
_CAPTURE: contextvars.ContextVar[TimwatchTracking | None] = contextvars.ContextVar(
    "timwatch_capture", default=None
)


def set_estr_inputs(
    rollout_log_probs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    old_log_probs: torch.Tensor | None,
) -> None:
    """The context for the next loss call only, keyed by the micro-batch's `old_log_probs`.

    `rollout_log_probs=None` clears it (the loss then says what is missing)."""
    _INPUTS.set(
        None
        if rollout_log_probs is None
        else EstrInputs(rollout_log_probs.detach(), _detach(entropy), _detach(old_log_probs), True)
    )


@contextmanager
def estr_inputs(
    rollout_log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    old_log_probs: torch.Tensor | None = None,
) -> Iterator[EstrInputs]:
    """Make μ and H available to `compute_policy_loss_estr` for the enclosed loss calls
    (keyed by `old_log_probs` when given)."""
    inputs = EstrInputs(rollout_log_probs.detach(), _detach(entropy), _detach(old_log_probs))
    token = _INPUTS.set(inputs)
    try:
        yield inputs
    finally:
        _INPUTS.reset(token)


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _cfg(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(key, None) if hasattr(config, "get") else getattr(config, key, None)
    return default if value is None else value


def _settings(config: Any) -> tuple[float, float, str]:
    """tau, eps, mask source: `config.policy_loss.estr_*` if present, else TIMWATCH_ESTR_* env."""
    policy_loss = _cfg(config, "policy_loss", None)
    tau = float(_cfg(policy_loss, "estr_tau", os.environ.get("TIMWATCH_ESTR_TAU", 1.6)))
    eps = float(_cfg(policy_loss, "estr_eps", os.environ.get("TIMWATCH_ESTR_EPS", 0.01)))
    source = str(
        _cfg(policy_loss, "estr_mask_logp", os.environ.get("TIMWATCH_ESTR_MASK_LOGP", "old"))
    )
    if source not in ("old", "current"):
        raise ConfigError(f"estr_mask_logp must be 'old' or 'current', got {source!r}")
    return tau, eps, source


def _agg_loss(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str, global_info: Mapping[str, Any]
) -> torch.Tensor:
    """verl's `agg_loss` when verl is installed; otherwise the same four modes written out."""
    try:
        from verl.trainer.ppo.core_algos import agg_loss
    except ImportError:
        pass
    else:
        loss: torch.Tensor = agg_loss(
            loss_mat=loss_mat, loss_mask=loss_mask, loss_agg_mode=mode, **global_info
        )
        return loss
    mask = loss_mask.to(loss_mat.dtype)
    dp = global_info.get("dp_size", 1) or 1
    if mode == "token-mean":
        n = global_info.get("batch_num_tokens") or mask.sum()
        return (loss_mat * mask).sum() / n * dp
    seq_tokens = mask.sum(dim=-1)
    if mode == "seq-mean-token-sum-norm":
        scale = global_info.get("loss_scale_factor") or mask.shape[-1]
        return (loss_mat * mask).sum() / scale
    if mode == "seq-mean-token-sum":
        seq_loss = (loss_mat * mask).sum(dim=-1)
    elif mode == "seq-mean-token-mean":
        seq_loss = (loss_mat * mask).sum(dim=-1) / (seq_tokens + 1e-8)
    else:
        raise ValueError(f"Invalid loss_agg_mode: {mode}")
    seqs = (seq_tokens > 0).to(loss_mat.dtype)
    n_seq = global_info.get("global_batch_size") or seqs.sum()
    return (seq_loss * seqs).sum() / n_seq * dp


def _check_inputs(
    inputs: EstrInputs | None, old_log_prob: torch.Tensor, log_prob: torch.Tensor
) -> EstrInputs:
    """The context of this micro-batch, consumed if single-use; raises if absent or foreign."""
    if inputs is not None and inputs.once:
        _INPUTS.set(None)
    if inputs is None or inputs.entropy is None:
        missing = "rollout_log_probs" if inputs is None else "entropy"
        raise PluginContextError(
            f"estr policy loss: no {missing} for this micro-batch. Set "
            "actor_rollout_ref.rollout.calculate_log_probs=True (and, without timwatch's hooks, "
            "actor_rollout_ref.actor.calculate_entropy=True), and load the hooks with "
            "VERL_USE_EXTERNAL_MODULES=timwatch.sidecar.integrations.verl (or wrap the loss call "
            "in timwatch.sidecar.integrations.verl.estr_inputs(...))"
        )
    for name, t in (("rollout_log_probs", inputs.rollout_log_probs), ("entropy", inputs.entropy)):
        if tuple(t.shape) != tuple(log_prob.shape):
            raise PluginContextError(
                f"estr policy loss: {name} has shape {tuple(t.shape)} but log_prob has "
                f"{tuple(log_prob.shape)}; the context belongs to another micro-batch"
            )
    key = inputs.key
    if key is not None and not (
        key.shape == old_log_prob.shape and torch.equal(key, old_log_prob.detach().to(key.dtype))
    ):
        raise PluginContextError(
            "estr policy loss: the rollout_log_probs/entropy context was set for another "
            "micro-batch (its old_log_probs differ from this call's); refusing to mask the wrong "
            "tokens"
        )
    return inputs


def compute_policy_loss_estr(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss `estr`: asymmetric PPO-clip with the stop-gradient ESTR token mask.

    Clip range from the actor config (`clip_ratio_low`, `clip_ratio_high`, falling back to
    `clip_ratio`; ESTR uses 0.20 / 0.28). Rejected tokens contribute zero but stay in the
    aggregation's denominator. No dual-clip. `rollout_is_weights`, when verl passes them,
    multiply the per-token loss as in verl's `vanilla`. μ and H come from `estr_inputs`.
    """
    inputs = _check_inputs(_INPUTS.get(), old_log_prob, log_prob)
    tau, eps, source = _settings(config)
    clip = float(_cfg(config, "clip_ratio", 0.2))
    low = float(_cfg(config, "clip_ratio_low", clip))
    high = float(_cfg(config, "clip_ratio_high", clip))
    response = response_mask.bool()
    with torch.no_grad():
        pi = (old_log_prob if source == "old" else log_prob).detach().float()
        mu = inputs.rollout_log_probs.float()
        entropy = inputs.entropy
        assert entropy is not None  # _check_inputs
        keep_estr = estr_keep_mask(pi, mu, entropy.float(), tau=tau, eps=eps)
        keep = response & keep_estr
    log_ratio = log_prob.float() - old_log_prob.detach().float()
    per_token, clip_active = ppo_clip_token_loss(log_ratio, advantages, low, high)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights
    loss_mat = torch.where(keep, per_token, torch.zeros_like(per_token))
    global_info = _cfg(config, "global_batch_info", {}) or {}
    loss = _agg_loss(loss_mat, response_mask, loss_agg_mode, global_info)
    with torch.no_grad():
        n = response.sum().clamp(min=1).float()
        zero = torch.zeros_like(log_ratio)
        metrics = {
            "actor/pg_clipfrac": (clip_active & keep).sum().float() / n,
            "actor/ppo_kl": torch.where(response, -log_ratio, zero).sum() / n,
            "timwatch/estr_mask_ratio": (response & ~keep_estr).sum().float() / n,
            "timwatch/mismatch_kl": torch.where(response, k3(pi - mu), zero.double()).sum() / n,
        }
    capture = _CAPTURE.get()
    if capture is not None:
        capture.capture(logp_rollout=mu, logp_train=pi, entropy=entropy, loss_mask=response_mask)
    values = torch.stack([v.double() for v in metrics.values()]).tolist()  # one host sync
    return loss, dict(zip(metrics, values, strict=True))


def pack_padded(
    mask: torch.Tensor, **arrays: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Padded `[batch, L]` arrays → the packed layout (docs/reference/batch.md).

    A row's sequence runs up to its last masked token (verl pads on the right; interior zeros,
    e.g. tool-output tokens in multi-turn rollouts, stay in the sequence with loss_mask 0).
    Returns `cu_seqlens` (int64) and the flat arrays, `loss_mask` among them.
    """
    m = mask != 0
    idx = torch.arange(m.shape[-1], device=m.device)
    lengths = torch.where(m, idx + 1, torch.zeros_like(idx)).amax(dim=-1)
    inside = idx[None, :] < lengths[:, None]
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=m.device)
    torch.cumsum(lengths, dim=0, out=cu[1:])
    packed = {k: v[inside] for k, v in arrays.items()}
    packed["loss_mask"] = m[inside].to(torch.int8)
    return cu, packed


class TimwatchTracking:
    """Collects each micro-batch's μ, π_old, H and mask during one actor update and reports them
    to a timwatch tap as one packed batch for the step.

    Not a verl `Tracking` backend: verl's `Tracking` accepts only its fixed `supported_backend`
    list and has no way to add one. The hooks drive it (`active()` around verl's update, then
    `log(...)`), and timwatch's scalar metrics reach verl's own loggers as the `estr` loss's
    metrics (docs/integrations.md). `tap` is any object with `report(step, **packed_arrays)`,
    normally `timwatch.sidecar.tap.Tap`, which returns at once and ships in the background.
    """

    def __init__(self, tap: SupportsReport) -> None:
        if not callable(getattr(tap, "report", None)):
            raise TypeError("tap must have a report(step, **arrays) method")
        self.tap = tap
        self._pending: list[dict[str, torch.Tensor]] = []

    @contextmanager
    def active(self) -> Iterator[TimwatchTracking]:
        token = _CAPTURE.set(self)
        try:
            yield self
        finally:
            _CAPTURE.reset(token)

    def capture(
        self,
        *,
        logp_rollout: torch.Tensor,
        logp_train: torch.Tensor,
        entropy: torch.Tensor,
        loss_mask: torch.Tensor,
    ) -> None:
        """Keep one padded `[batch, L]` micro-batch (detached, still on its device)."""
        self._pending.append(
            {
                "logp_rollout": logp_rollout.detach(),
                "logp_train": logp_train.detach(),
                "entropy": entropy.detach(),
                "mask": loss_mask.detach(),
            }
        )

    @property
    def pending(self) -> int:
        return len(self._pending)

    def discard(self) -> None:
        """Forget what was captured (a rank that does not report: another of its group does)."""
        self._pending = []

    def log(
        self, data: Mapping[str, Any], step: int, *, passes: int = 1, batch_id: str | None = None
    ) -> None:
        """Report the captured micro-batches as one batch for `step` and clear them.

        `passes` > 1 (verl's `ppo_epochs`) keeps only the first pass, so each token once.
        `batch_id` (the hooks use `verl-s{step}-dp{dp_rank}`) makes a second report of the same
        step and rank a replay or a conflict at the monitor, never extra tokens.

        A failing report is logged, never raised, but for the guard's `RunPaged` (the tap's
        ``on_page="raise"``), which leaves here after the batch is queued.
        """
        del data
        pending, self._pending = self._pending, []
        if passes > 1:
            pending = pending[: len(pending) // passes]
        if not pending:
            return
        parts = [pack_padded(p.pop("mask"), **p) for p in pending]
        pieces, offset = [parts[0][0][:1]], 0
        for part_cu, _ in parts:
            pieces.append(part_cu[1:] + offset)
            offset += int(part_cu[-1])
        cu = torch.cat(pieces)
        arrays = {k: torch.cat([p[k] for _, p in parts]) for k in parts[0][1]}
        try:
            if batch_id is None:
                self.tap.report(step, cu_seqlens=cu, **arrays)
            else:
                self.tap.report(step, cu_seqlens=cu, batch_id=batch_id, **arrays)
        except RunPaged:  # the guard's on_page="raise": the one stop the user asked for
            raise
        except Exception:  # the tap must never break training
            log.exception("timwatch tap.report failed at step %s", step)

    def finish(self) -> None:
        self._pending = []
        close = getattr(self.tap, "close", None)
        if callable(close):
            close()
