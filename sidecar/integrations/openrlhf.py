"""OpenRLHF plug-in: per-token μ, π_old and H from OpenRLHF's PPO actor, reported under
OpenRLHF's global step, and the ESTR mask in its policy loss. Checked against OpenRLHF 0.11.2
(`openrlhf/trainer/ray/ppo_actor.py`, `openrlhf/models/loss.py`, `openrlhf/models/actor.py`,
`openrlhf/trainer/ppo_trainer.py`).

The hooks, installed by `install()` in the actor worker process (all on classes OpenRLHF's
actor worker uses, none on its files):
- `ActorPPOTrainer.training_step(experience, …)`: marks the micro-batch being trained, so the
  two hooks below act only there (the reference and critic forwards are left alone).
- `Actor.forward`: inside a training step, asks for the entropy OpenRLHF computes from the
  trainer's logits (`return_entropy`, which OpenRLHF otherwise sets only with
  `--actor.entropy_coef`; the loss reads it only then) and keeps its action part.
- `PolicyLoss.forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs,
  …)`: captures μ = `rollout_log_probs` (vLLM's), π_old = `old_log_probs` and H with the action
  mask; with ESTR on, zeroes the advantages of the tokens ESTR rejects first (no contribution,
  still in the denominator) and puts `estr_mask_ratio` into the micro-batch's `info`, which
  OpenRLHF logs with its own metrics.
- `ActorPPOTrainer.ppo_train(kl_ctl)`: one report per actor update.

Invariants:
- The step is OpenRLHF's `global_step` as its driver logs it. The actor worker is never told it,
  so the plug-in derives it from what OpenRLHF itself resumes from: the step of the actor
  checkpoint it loaded (`global_step{N}` in DeepSpeed's `latest` tag under
  `{ckpt.path}/_actor`, loaded when `ckpt.load_enable`) and the critic warm-up
  (`critic.freezing_steps`: the driver skips the actor while `global_step ≤ freezing_steps`):
  the k-th update of this process is step max(freezing_steps + 1, N) + k.
- One report per step and rank, batch id `openrlhf-s{step}-r{rank}`: a step redone after a
  resume is a replay or a 409 conflict at the monitor, never extra tokens. With
  `train.max_epochs` > 1 only the first epoch's micro-batches are reported (each token once).
- Ring attention and DeepSpeed tensor parallelism (ranks that share tokens) and sample packing
  are not supported: the plug-in reports nothing then and says so once.
- The tap never breaks training: a failing report is logged, not raised. The one exception is
  the guard's `RunPaged` (TIMWATCH_ON_PAGE=raise): it leaves `ppo_train` after the update and
  its report, and stops the run.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from ...monitor.core.masks import estr_keep_mask
from .verl_loss import TimwatchTracking

__all__ = ["install", "resume_step", "worker_collector"]

log = logging.getLogger(__name__)

_COLLECTOR: TimwatchTracking | None = None
_ESTR = False
_EXPERIENCE: contextvars.ContextVar[Any] = contextvars.ContextVar("timwatch_orl_exp", default=None)
_ENTROPY: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "timwatch_orl_entropy", default=None
)
_WARNED: set[str] = set()


def worker_collector() -> TimwatchTracking | None:
    """The per-process collector, its tap from TIMWATCH_URL / TIMWATCH_RUN (default
    ``openrlhf``) / TIMWATCH_TOKEN / TIMWATCH_ON_PAGE (`timwatch.sidecar.tap.env.tap_from_env`),
    if set (TIMWATCH_OPENRLHF_ESTR=1 turns the in-line ESTR mask on)."""
    global _COLLECTOR, _ESTR
    if _COLLECTOR is None:
        from ..tap.env import tap_from_env

        tap = tap_from_env("openrlhf")
        if tap is None:
            return None
        _COLLECTOR = TimwatchTracking(tap)
        _ESTR = os.environ.get("TIMWATCH_OPENRLHF_ESTR", "0") == "1"
    return _COLLECTOR


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("timwatch: %s", msg)


def _get(obj: Any, *path: str, default: Any = None) -> Any:
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return default
    return obj


def resume_step(args: Any) -> int:
    """The global step of the actor checkpoint OpenRLHF loads at start (0 without one)."""
    if not _get(args, "ckpt", "load_enable", default=False):
        return 0
    latest = Path(str(_get(args, "ckpt", "path", default=""))) / "_actor" / "latest"
    if not latest.is_file():
        return 0
    found = re.search(r"global_step(\d+)", latest.read_text())
    return int(found.group(1)) if found else 0


def _unsupported(trainer: Any) -> str | None:
    args = trainer.args
    if getattr(trainer.strategy, "ring_attn_group", None) is not None:
        return "ring attention"
    if (_get(args, "ds", "tensor_parallel_size", default=1) or 1) > 1:
        return "DeepSpeed tensor parallelism"
    if _get(args, "ds", "packing_samples", default=False):
        return "sample packing"
    return None


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return int(os.environ.get("RANK", "0"))


def _wrap_forward(forward: Any) -> Any:
    @functools.wraps(forward)
    def hooked(self: Any, sequences: Any, action_mask: Any = None, *a: Any, **kw: Any) -> Any:
        if _EXPERIENCE.get() is None or action_mask is None or not kw.get("return_output"):
            return forward(self, sequences, action_mask, *a, **kw)
        kw["return_entropy"] = True
        out = forward(self, sequences, action_mask, *a, **kw)
        entropy = getattr(out[1], "entropy", None) if isinstance(out, tuple) else None
        if entropy is not None:
            _ENTROPY.set(entropy[:, -action_mask.shape[1] :].detach())
        return out

    return hooked


def _wrap_loss(loss_forward: Any) -> Any:
    @functools.wraps(loss_forward)
    def hooked(
        self: Any,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        **kw: Any,
    ) -> Any:
        experience, entropy, collector = _EXPERIENCE.get(), _ENTROPY.get(), _COLLECTOR
        _ENTROPY.set(None)  # this micro-batch's: consumed here
        if experience is None or collector is None or action_mask is None:
            return loss_forward(
                self, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, **kw
            )
        if rollout_log_probs is None or entropy is None:
            _warn_once(
                "inputs",
                "OpenRLHF's micro-batch has no rollout_log_probs (vLLM's log-probs) or no "
                "entropy; nothing is reported for it",
            )
            return loss_forward(
                self, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, **kw
            )
        mask = action_mask.bool()
        collector.capture(
            logp_rollout=rollout_log_probs.float(),
            logp_train=old_log_probs.float(),
            entropy=entropy.float(),
            loss_mask=mask,
        )
        if _ESTR:
            tau = float(os.environ.get("TIMWATCH_ESTR_TAU", 1.6))
            eps = float(os.environ.get("TIMWATCH_ESTR_EPS", 0.01))
            with torch.no_grad():
                keep = estr_keep_mask(
                    old_log_probs.float(), rollout_log_probs.float(), entropy.float(), tau, eps
                )
                rejected = mask & ~keep
                n = mask.sum().clamp(min=1)
                experience.info["estr_mask_ratio"] = rejected.sum().float() / n
            advantages = torch.where(rejected, torch.zeros_like(advantages), advantages)
        return loss_forward(
            self, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, **kw
        )

    return hooked


def _wrap_training_step(training_step: Any) -> Any:
    @functools.wraps(training_step)
    def hooked(self: Any, experience: Any, *a: Any, **kw: Any) -> Any:
        token = _EXPERIENCE.set(experience)
        try:
            return training_step(self, experience, *a, **kw)
        finally:
            _EXPERIENCE.reset(token)
            _ENTROPY.set(None)

    return hooked


def _wrap_ppo_train(ppo_train: Any) -> Any:
    @functools.wraps(ppo_train)
    def hooked(self: Any, *a: Any, **kw: Any) -> Any:
        collector = worker_collector()
        reason = _unsupported(self) if collector is not None else None
        if collector is None or reason is not None:
            if reason is not None:
                _warn_once("layout", f"{reason} is not supported; nothing is reported")
            return ppo_train(self, *a, **kw)
        if not hasattr(self, "_timwatch_updates"):
            freezing = int(_get(self.args, "critic", "freezing_steps", default=-1))
            self._timwatch_base = max(freezing + 1, resume_step(self.args))
            self._timwatch_updates = 0
        self._timwatch_updates += 1
        step = self._timwatch_base + self._timwatch_updates
        collector.discard()
        with collector.active():
            status = ppo_train(self, *a, **kw)
        passes = int(_get(self.args, "train", "max_epochs", default=1) or 1)
        collector.log({}, step, passes=passes, batch_id=f"openrlhf-s{step}-r{_rank()}")
        return status

    return hooked


def install() -> bool:
    """Install the hooks on OpenRLHF's actor classes; False without OpenRLHF. Idempotent."""
    try:
        ppo_actor = importlib.import_module("openrlhf.trainer.ray.ppo_actor")
        actor_mod = importlib.import_module("openrlhf.models.actor")
        loss_mod = importlib.import_module("openrlhf.models.loss")
    except ImportError:
        return False
    trainer_cls = ppo_actor.ActorPPOTrainer
    if getattr(trainer_cls, "_timwatch_hooked", False):
        return True
    actor_mod.Actor.forward = _wrap_forward(actor_mod.Actor.forward)
    loss_mod.PolicyLoss.forward = _wrap_loss(loss_mod.PolicyLoss.forward)
    trainer_cls.training_step = _wrap_training_step(trainer_cls.training_step)
    trainer_cls.ppo_train = _wrap_ppo_train(trainer_cls.ppo_train)
    trainer_cls._timwatch_hooked = True
    return True
