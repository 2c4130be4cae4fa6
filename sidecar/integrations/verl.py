"""verl plug-in: the `estr` policy loss and a tracking backend that ships tokens to a timwatch tap.

verl's policy-loss signature (`verl/trainer/ppo/core_algos.py`, `PolicyLossFn`) is
`(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)`
and returns `(loss, metrics)`. It does not carry the two things the ESTR mask needs:

* μ — verl keeps the engine's log-probs as `rollout_log_probs` in the batch (present when
  `actor_rollout_ref.rollout.calculate_log_probs=True`); the FSDP actor selects it into each
  micro-batch (`DataParallelPPOActor.update_policy`) but does not pass it to the loss;
* H — the actor computes `entropys` from its own logits in `_forward_micro_batch` when
  `actor_rollout_ref.actor.calculate_entropy=True` (or `entropy_coeff != 0`), also not passed on.

So the loss reads both from a per-thread context (`estr_inputs`), which `install_actor_hooks`
fills by wrapping `DataParallelPPOActor._forward_micro_batch`: right after the forward of a
micro-batch, that micro-batch's `rollout_log_probs` and `entropys` become the context, and the
loss called next on the same micro-batch reads them (shapes are checked). Importing this module
inside verl's processes — `VERL_USE_EXTERNAL_MODULES=timwatch.sidecar.integrations.verl`, which
verl's own `__init__` honours — registers the loss and installs the hooks. Other actors
(Megatron, the new engine workers) can set the context themselves with `estr_inputs(...)`.

Per-token reporting: when `TIMWATCH_URL` is set in a worker, the hooked `update_policy` captures
each micro-batch's μ, π_old, H and response mask and reports them as one packed batch per
training step through `timwatch.sidecar.tap.Tap` (see `TimwatchTracking`).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from timwatch.monitor.core.masks import estr_keep_mask
from timwatch.monitor.trainer.losses import k3, ppo_clip_token_loss

__all__ = [
    "ESTR_LOSS_NAME",
    "EstrInputs",
    "SupportsReport",
    "TimwatchTracking",
    "compute_policy_loss_estr",
    "estr_inputs",
    "install_actor_hooks",
    "pack_padded",
    "register_with_verl",
]

log = logging.getLogger(__name__)

ESTR_LOSS_NAME = "estr"


class SupportsReport(Protocol):
    """Anything with the tap's `report(step, **packed_arrays)` (keyword signature varies)."""

    @property
    def report(self) -> Callable[..., Any]: ...


@dataclass(frozen=True)
class EstrInputs:
    """What the ESTR mask needs beyond verl's loss arguments, shaped `[batch, response_len]`."""

    rollout_log_probs: torch.Tensor
    entropy: torch.Tensor | None


_INPUTS: contextvars.ContextVar[EstrInputs | None] = contextvars.ContextVar(
    "timwatch_estr_inputs", default=None
)
_CAPTURE: contextvars.ContextVar[TimwatchTracking | None] = contextvars.ContextVar(
    "timwatch_capture", default=None
)


@contextmanager
def estr_inputs(
    rollout_log_probs: torch.Tensor, entropy: torch.Tensor | None
) -> Iterator[EstrInputs]:
    """Make μ and H available to `compute_policy_loss_estr` for the enclosed loss calls."""
    inputs = EstrInputs(rollout_log_probs.detach(), _detach(entropy))
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
        raise ValueError(f"estr_mask_logp must be 'old' or 'current', got {source!r}")
    return tau, eps, source


def _agg_loss(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str, global_info: Mapping[str, Any]
) -> torch.Tensor:
    """verl's `agg_loss` when verl is installed; otherwise the same four modes written out."""
    try:
        from verl.trainer.ppo.core_algos import agg_loss
    except ImportError:
        agg_loss = None
    if agg_loss is not None:
        return agg_loss(loss_mat=loss_mat, loss_mask=loss_mask, loss_agg_mode=mode, **global_info)
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
    inputs = _INPUTS.get()
    if inputs is None or inputs.entropy is None:
        missing = "rollout_log_probs" if inputs is None else "entropy"
        raise RuntimeError(
            f"estr policy loss: no {missing} for this micro-batch. Set "
            "actor_rollout_ref.rollout.calculate_log_probs=True and "
            "actor_rollout_ref.actor.calculate_entropy=True, and load the hooks with "
            "VERL_USE_EXTERNAL_MODULES=timwatch.sidecar.integrations.verl (or wrap the loss call "
            "in "
            "timwatch.sidecar.integrations.verl.estr_inputs(...))"
        )
    for name, t in (("rollout_log_probs", inputs.rollout_log_probs), ("entropy", inputs.entropy)):
        if tuple(t.shape) != tuple(log_prob.shape):
            raise ValueError(
                f"estr policy loss: {name} has shape {tuple(t.shape)} but log_prob has "
                f"{tuple(log_prob.shape)}; the context belongs to another micro-batch"
            )
    tau, eps, source = _settings(config)
    clip = float(_cfg(config, "clip_ratio", 0.2))
    low = float(_cfg(config, "clip_ratio_low", clip))
    high = float(_cfg(config, "clip_ratio_high", clip))
    response = response_mask.bool()
    with torch.no_grad():
        pi = (old_log_prob if source == "old" else log_prob).detach().float()
        mu = inputs.rollout_log_probs.float()
        keep_estr = estr_keep_mask(pi, mu, inputs.entropy.float(), tau=tau, eps=eps)
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
        capture.capture(
            logp_rollout=mu, logp_train=pi, entropy=inputs.entropy, loss_mask=response_mask
        )
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
    """A verl-style tracking backend (`log(data, step)`, `finish()`) reporting to a timwatch tap.

    `tap` is any object with `report(step, **packed_arrays)`, normally `Tap`, which
    returns at once and ships in the background. The `estr` loss calls `capture(...)` for each
    micro-batch while this backend is active (`active()`); `log(data, step)` then reports all
    captured micro-batches of the step as one packed batch (`logp_train` = π_old, the trainer's
    recomputation; `entropy` from the trainer's logits). verl's scalar `data` is left to verl's
    own loggers: the monitor recomputes every metric from the tokens.
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

    def log(self, data: Mapping[str, Any], step: int, *, passes: int = 1) -> None:
        """Report the captured micro-batches as one batch for `step` and clear them.

        `passes` > 1 (verl's `ppo_epochs`) keeps only the first pass, so each token once.
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
            self.tap.report(step, cu_seqlens=cu, **arrays)
        except Exception:  # the tap must never break training
            log.exception("timwatch tap.report failed at step %s", step)

    def finish(self) -> None:
        self._pending = []
        close = getattr(self.tap, "close", None)
        if callable(close):
            close()


_WORKER_BACKEND: TimwatchTracking | None = None


def _worker_backend() -> TimwatchTracking | None:
    """The per-process backend from TIMWATCH_URL / TIMWATCH_RUN / TIMWATCH_TOKEN, if set."""
    global _WORKER_BACKEND
    url = os.environ.get("TIMWATCH_URL")
    if not url:
        return None
    if _WORKER_BACKEND is None:
        from timwatch.sidecar.tap import Tap

        tap = Tap(url, os.environ.get("TIMWATCH_RUN", "verl"), os.environ.get("TIMWATCH_TOKEN"))
        _WORKER_BACKEND = TimwatchTracking(tap)
    return _WORKER_BACKEND


def install_actor_hooks(actor_cls: Any = None) -> bool:
    """Wrap verl's FSDP actor so the `estr` loss sees μ and H, and steps reach the tap.

    `_forward_micro_batch(self, micro_batch, temperature, calculate_entropy)` → after it returns,
    `micro_batch["rollout_log_probs"]` and the output's `entropys` become the `estr_inputs`
    context. `update_policy(self, data)` → runs with the worker's `TimwatchTracking` active and
    reports the step (`data.meta_info["global_steps"]` when present, else a per-process count).
    """
    if actor_cls is None:
        try:
            from verl.workers.actor import dp_actor
        except ImportError:
            return False
        actor_cls = dp_actor.DataParallelPPOActor
    if getattr(actor_cls, "_timwatch_hooked", False):
        return True
    forward = actor_cls._forward_micro_batch
    update = actor_cls.update_policy

    @functools.wraps(forward)
    def _forward_micro_batch(self: Any, micro_batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, micro_batch, *args, **kwargs)
        rollout = (
            micro_batch.get("rollout_log_probs", None) if hasattr(micro_batch, "get") else None
        )
        if rollout is not None:
            entropy = out.get("entropys") if isinstance(out, Mapping) else out[0]
            _INPUTS.set(EstrInputs(rollout.detach(), _detach(entropy)))
        return out

    steps = {"n": 0}

    @functools.wraps(update)
    def update_policy(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        steps["n"] += 1
        backend = _worker_backend()
        if backend is None:
            return update(self, data, *args, **kwargs)
        with backend.active():
            metrics = update(self, data, *args, **kwargs)
        meta = getattr(data, "meta_info", None) or {}
        step = int(meta.get("global_steps", steps["n"]))
        backend.log({}, step, passes=int(_cfg(getattr(self, "config", None), "ppo_epochs", 1)))
        return metrics

    actor_cls._forward_micro_batch = _forward_micro_batch
    actor_cls.update_policy = update_policy
    actor_cls._timwatch_hooked = True
    return True


def register_with_verl(*, hook_actor: bool = True) -> bool:
    """Register `estr` in verl's POLICY_LOSS_REGISTRY (and hook the actor); False without verl."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError:
        return False
    if ESTR_LOSS_NAME not in getattr(core_algos, "POLICY_LOSS_REGISTRY", {}):
        core_algos.register_policy_loss(ESTR_LOSS_NAME)(compute_policy_loss_estr)
    if hook_actor:
        try:
            install_actor_hooks()
        except Exception:  # an unexpected verl layout must not stop training from starting
            log.exception("timwatch: could not hook verl's DataParallelPPOActor")
    return True


if os.environ.get("TIMWATCH_VERL_AUTOREGISTER", "1") != "0":
    register_with_verl()
