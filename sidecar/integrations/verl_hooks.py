"""Hooks that feed verl's `estr` loss its μ/H context and report each step once, under verl's own
step number. Checked against verl 0.9.1 (`verl/workers/engine_workers.py`,
`verl/workers/utils/losses.py`, `verl/trainer/ppo/ray_trainer.py`); the legacy FSDP actor
(`verl/workers/actor/dp_actor.py`, gone in 0.9) is hooked when it exists.

Invariants:
- The step is verl's `global_steps`. The driver hook copies `RayPPOTrainer.global_steps` into
  the update batch's `meta_info` (verl never hands it to the actor's update batch itself), it
  travels to the workers as non-tensor data, and the worker hook reads it. So it is the same
  after a resume from checkpoint (verl restores `global_steps`) and with critic warm-up (steps
  without an actor update report nothing). A worker update without it reports nothing and logs
  why, rather than inventing a number.
- One report per step and data-parallel rank, with batch id `verl-s{step}-dp{dp_rank}`: a step
  redone after a resume is a replay or a 409 conflict at the monitor, never extra tokens.
- Only the rank that verl itself collects outputs from (`engine.is_mp_src_rank_with_outputs()`:
  Ulysses sp rank 0 on FSDP; tp 0, last pp stage, cp 0 on Megatron) reports; the others of its
  group hold the same tokens.
- With `loss_mode=estr` the worker hook forces `calculate_entropy=True` on the update batch, so
  H exists whatever `entropy_coeff` is (verl adds `entropy_coeff · H` to the loss: 0 at 0).
- The tap never breaks training: a failing report is logged, not raised. The one exception is
  the guard's `RunPaged` (TIMWATCH_ON_PAGE=raise): it leaves the worker's update
  (`train_mini_batch`, or the legacy `update_policy`) after the update and its report, and
  stops the run.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

from . import verl_loss as plugin

__all__ = [
    "STEP_KEY",
    "estr_loss_wrapper",
    "install_actor_hooks",
    "install_all",
    "install_engine_hooks",
    "install_trainer_hook",
    "worker_backend",
]

log = logging.getLogger(__name__)

#: the update batch's meta_info / non-tensor key carrying verl's step
STEP_KEY = "global_steps"

_WORKER_BACKEND: plugin.TimwatchTracking | None = None


def worker_backend() -> plugin.TimwatchTracking | None:
    """The per-process collector, its tap from TIMWATCH_URL / TIMWATCH_RUN (default ``verl``) /
    TIMWATCH_TOKEN / TIMWATCH_ON_PAGE (`timwatch.sidecar.tap.env.tap_from_env`), if set."""
    global _WORKER_BACKEND
    if _WORKER_BACKEND is None:
        from ..tap.env import tap_from_env

        tap = tap_from_env("verl")
        if tap is None:
            return None
        _WORKER_BACKEND = plugin.TimwatchTracking(tap)
    return _WORKER_BACKEND


def _loss_mode(config: Any) -> str:
    policy_loss = plugin._cfg(config, "policy_loss", None)
    return str(plugin._cfg(policy_loss, "loss_mode", "vanilla"))


def estr_loss_wrapper(ppo_loss: Any) -> Any:
    """Wrap verl's `ppo_loss(config, model_output, data, dp_group)` (the loss of the FSDP and
    Megatron engines): with `loss_mode=estr`, set the micro-batch's context first, from
    `data["rollout_log_probs"]`, `model_output["entropy"]` (unpadded the way `ppo_loss` unpads
    `log_probs`) and `data["old_log_probs"]` as the key; else clear it."""
    if getattr(ppo_loss, "_timwatch_hooked", False):
        return ppo_loss

    @functools.wraps(ppo_loss)
    def wrapped(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> Any:
        if _loss_mode(config) == plugin.ESTR_LOSS_NAME:
            entropy = model_output.get("entropy", None)
            if "rollout_log_probs" in data.keys() and entropy is not None:
                from verl.workers.utils.padding import no_padding_2_padding

                padded = data.select("rollout_log_probs", "old_log_probs").to_padded_tensor()
                plugin.set_estr_inputs(
                    padded["rollout_log_probs"],
                    no_padding_2_padding(entropy, data),
                    padded["old_log_probs"],
                )
            else:
                plugin.set_estr_inputs(None, None, None)
        return ppo_loss(config, model_output, data, dp_group=dp_group)

    wrapped._timwatch_hooked = True  # type: ignore[attr-defined]
    return wrapped


def _report(
    backend: plugin.TimwatchTracking, step: Any, dp_rank: int, reporter: bool, passes: int
) -> None:
    if not reporter:
        backend.discard()
    elif step is None:
        backend.discard()
        log.error(
            "timwatch: the actor update carries no %r; nothing reported. Load the plug-in in the "
            "trainer process too (VERL_USE_EXTERNAL_MODULES in the launch environment)",
            STEP_KEY,
        )
    else:
        step = int(step)
        backend.log({}, step, passes=passes, batch_id=f"verl-s{step}-dp{dp_rank}")


def install_engine_hooks(worker_module: Any = None) -> bool:
    """Hook verl ≥ 0.9's engine workers: `ppo_loss` (as bound at `init_model`) and
    `TrainingWorker.train_mini_batch` (forces entropy for `estr`, collects, reports)."""
    if worker_module is None:
        try:
            from verl.workers import engine_workers
        except ImportError:
            return False
        worker_module = engine_workers
    from verl.utils import tensordict_utils as tu

    worker_module.ppo_loss = estr_loss_wrapper(worker_module.ppo_loss)
    cls = worker_module.TrainingWorker
    if getattr(cls, "_timwatch_hooked", False):
        return True
    train_mini_batch = cls.train_mini_batch

    @functools.wraps(train_mini_batch)
    def hooked(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        config = getattr(self.loss_fn, "keywords", {}).get("config")
        if _loss_mode(config) != plugin.ESTR_LOSS_NAME:
            return train_mini_batch(self, data, *args, **kwargs)
        tu.assign_non_tensor(data, calculate_entropy=True)
        backend = worker_backend()
        if backend is None:
            return train_mini_batch(self, data, *args, **kwargs)
        step = tu.get(data, STEP_KEY, None)
        passes = int(tu.get(data, "epochs", 1) or 1)
        with backend.active():
            out = train_mini_batch(self, data, *args, **kwargs)
        engine = self.engine
        reporter = bool(engine.is_mp_src_rank_with_outputs())
        _report(backend, step, int(engine.get_data_parallel_rank()), reporter, passes)
        return out

    cls.train_mini_batch = hooked
    cls._timwatch_hooked = True
    return True


def install_trainer_hook(trainer_cls: Any = None) -> bool:
    """Wrap `RayPPOTrainer._update_actor(batch)` to put `global_steps` into `batch.meta_info`."""
    if trainer_cls is None:
        try:
            from verl.trainer.ppo.ray_trainer import RayPPOTrainer
        except ImportError:
            return False
        trainer_cls = RayPPOTrainer
    if getattr(trainer_cls, "_timwatch_hooked", False):
        return True
    update = trainer_cls._update_actor

    @functools.wraps(update)
    def _update_actor(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        batch.meta_info[STEP_KEY] = int(self.global_steps)
        return update(self, batch, *args, **kwargs)

    trainer_cls._update_actor = _update_actor
    trainer_cls._timwatch_hooked = True
    return True


def install_actor_hooks(actor_cls: Any = None) -> bool:
    """Hook the legacy FSDP `DataParallelPPOActor` (verl < 0.9): after each
    `_forward_micro_batch`, the micro-batch's `rollout_log_probs`, `entropys` and `old_log_probs`
    (key) become the context; `update_policy(data)` collects and reports under
    `data.meta_info["global_steps"]` (one report per rank: that actor has no Ulysses filter)."""
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
        get = micro_batch.get if hasattr(micro_batch, "get") else (lambda _k, _d=None: None)
        rollout = get("rollout_log_probs", None)
        entropy = out.get("entropys") if isinstance(out, Mapping) else out[0]
        plugin.set_estr_inputs(rollout, entropy, get("old_log_probs", None))
        return out

    @functools.wraps(update)
    def update_policy(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        backend = worker_backend()
        if backend is None:
            return update(self, data, *args, **kwargs)
        with backend.active():
            metrics = update(self, data, *args, **kwargs)
        step = (getattr(data, "meta_info", None) or {}).get(STEP_KEY)
        rank = int(os.environ.get("RANK", "0"))
        passes = int(plugin._cfg(getattr(self, "config", None), "ppo_epochs", 1))
        _report(backend, step, rank, True, passes)
        return metrics

    actor_cls._forward_micro_batch = _forward_micro_batch
    actor_cls.update_policy = update_policy
    actor_cls._timwatch_hooked = True
    return True


def install_all() -> dict[str, bool]:
    """Every hook whose verl class exists here; an unexpected layout is logged, never raised."""
    done = {}
    for name, fn in (
        ("trainer", install_trainer_hook),
        ("engine", install_engine_hooks),
        ("legacy_actor", install_actor_hooks),
    ):
        try:
            done[name] = fn()
        except Exception:  # an unexpected verl layout must not stop training from starting
            log.exception("timwatch: could not install verl's %s hook", name)
            done[name] = False
    return done
