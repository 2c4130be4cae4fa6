"""AReaL plug-in: per-token μ, π_old and H from AReaL's own PPO loss, reported under AReaL's
global step, and the ESTR mask applied in that loss. Checked against AReaL 1.0.4
(`areal/trainer/ppo/actor.py`, `areal/engine/fsdp_engine.py`, `areal/trainer/rl_trainer.py`).

The hook. `PPOActor._ppo_update` hands `functools.partial(grpo_loss_fn, ...)` to
`engine.train_batch`, looking `grpo_loss_fn` up in its module at every update, and the engine
calls it per micro-batch as `loss_fn(logprobs, entropy, input_data, ...)` with packed 1-D
tensors: `logprobs` and `entropy` from the trainer's logits (at `actor.temperature`), and
`input_data` holding `cu_seqlens`, the rolled `loss_mask`, `prox_logp` (π_old, recomputed) and
`logprobs` (the rollout's μ under `use_decoupled_loss`, else overwritten by π_old).
`install()` wraps three things in that module, nothing else:
- `PPOActor._compute_advantages`, to keep μ aligned the way AReaL aligns it (rolled by one,
  times the loss mask) under `input_data["timwatch_logp_rollout"]` before AReaL may overwrite
  `logprobs` with π_old; it travels through AReaL's own split and packing like every `[B, S]`
  tensor.
- `grpo_loss_fn`, which captures each micro-batch's `cu_seqlens`, μ, π_old, H and loss mask
  and, with ESTR on, zeroes the advantages of the tokens ESTR rejects (δ² > τ(H + ε), δ = π_old
  − μ): they add nothing to the loss and stay in its denominator (AReaL divides by the loss mask
  count taken before any rejection), and `ppo_actor/update/estr_mask_ratio` joins AReaL's stats.
- `PPOActor.ppo_update`, which reports the captured micro-batches as one batch for the step.

Invariants:
- The step is AReaL's `global_step`: the engine's version during `ppo_update` (the trainer sets
  it to `global_step + 1` after each step, and recovery to `last global_step + 1`), so a resumed
  run reports under the same numbers.
- One report per step and data-parallel rank, batch id `areal-s{step}-dp{rank}`: a step redone
  after a resume is a replay or a 409 conflict at the monitor, never extra tokens. Only the data
  parallel head reports (the other ranks of its group hold the same tokens).
- The tap never breaks training: a failing report is logged, not raised. The one exception is
  the guard's `RunPaged` (TIMWATCH_ON_PAGE=raise): it leaves `ppo_update` after the step's
  update and report, and stops the run.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ...monitor.core.errors import RunPaged
from ...monitor.core.masks import estr_keep_mask
from .verl_loss import SupportsReport

__all__ = ["MU_KEY", "AReaLCollector", "install", "worker_collector"]

log = logging.getLogger(__name__)

#: the `input_data` key under which the hook keeps μ, aligned as AReaL aligns its log-probs
MU_KEY = "timwatch_logp_rollout"

_COLLECTOR: AReaLCollector | None = None


class AReaLCollector:
    """Keeps one step's packed micro-batches and reports them as one batch through a tap."""

    def __init__(self, tap: SupportsReport, *, estr: bool = False) -> None:
        if not callable(getattr(tap, "report", None)):
            raise TypeError("tap must have a report(step, **arrays) method")
        self.tap = tap
        self.estr = estr
        self.tau = float(os.environ.get("TIMWATCH_ESTR_TAU", 1.6))
        self.eps = float(os.environ.get("TIMWATCH_ESTR_EPS", 0.01))
        self._pending: list[dict[str, torch.Tensor]] = []

    def capture(self, cu_seqlens: torch.Tensor, **arrays: torch.Tensor) -> None:
        self._pending.append(
            {"cu_seqlens": cu_seqlens.detach().to(torch.int64).cpu()}
            | {k: v.detach().cpu() for k, v in arrays.items()}
        )

    def discard(self) -> None:
        self._pending = []

    def report(self, step: int, rank: int) -> None:
        """Report what was captured as one batch for `step`, then forget it. A failing report
        is logged; only the guard's `RunPaged` (``on_page="raise"``) is raised."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        pieces, offset = [pending[0]["cu_seqlens"][:1]], 0
        for part in pending:
            pieces.append(part["cu_seqlens"][1:] + offset)
            offset += int(part["cu_seqlens"][-1])
        names = [k for k in pending[0] if k != "cu_seqlens"]
        arrays = {k: torch.cat([p[k] for p in pending]) for k in names}
        try:
            self.tap.report(
                step, cu_seqlens=torch.cat(pieces), batch_id=f"areal-s{step}-dp{rank}", **arrays
            )
        except RunPaged:  # the guard's on_page="raise": the one stop the user asked for
            raise
        except Exception:  # the tap must never break training
            log.exception("timwatch tap.report failed at step %s", step)


def worker_collector() -> AReaLCollector | None:
    """The per-process collector, its tap from TIMWATCH_URL / TIMWATCH_RUN (default ``areal``) /
    TIMWATCH_TOKEN / TIMWATCH_ON_PAGE (`timwatch.sidecar.tap.env.tap_from_env`), if set
    (TIMWATCH_AREAL_ESTR=1 turns the in-line ESTR mask on)."""
    global _COLLECTOR
    if _COLLECTOR is None:
        from ..tap.env import tap_from_env

        tap = tap_from_env("areal")
        if tap is None:
            return None
        _COLLECTOR = AReaLCollector(tap, estr=os.environ.get("TIMWATCH_AREAL_ESTR", "0") == "1")
    return _COLLECTOR


_WARNED = False


def _warn_no_prox() -> None:
    global _WARNED
    _WARNED = True
    log.warning(
        "timwatch: AReaL's batch has no prox_logp (π_old), so nothing is reported: use "
        "actor.recompute_logprob=true or prox_logp_method=recompute/metrics"
    )


def _estr_stat(rejected: torch.Tensor, mask: torch.Tensor) -> None:
    """`estr_mask_ratio` (rejected / loss-mask tokens) into AReaL's stats, over a denominator of
    its own so that its list of per-call tensors always pairs with this call's."""
    try:
        from areal.utils import stats_tracker

        stats_tracker.denominator(timwatch_estr_tokens=mask)
        stats_tracker.stat(estr_mask_ratio=rejected.float(), denominator="timwatch_estr_tokens")
    except Exception:  # a statistic must never break training
        log.exception("timwatch: could not record estr_mask_ratio in AReaL's stats_tracker")


def wrap_loss(grpo_loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`grpo_loss_fn` that captures the micro-batch and, with ESTR on, masks it first."""
    if getattr(grpo_loss_fn, "_timwatch_hooked", False):
        return grpo_loss_fn

    @functools.wraps(grpo_loss_fn)
    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, input_data: dict, **kw: Any) -> Any:
        collector = _COLLECTOR
        mu, pi_old = input_data.get(MU_KEY), input_data.get("prox_logp")
        if collector is not None and mu is not None and pi_old is None and not _WARNED:
            _warn_no_prox()
        if collector is None or mu is None or pi_old is None:
            return grpo_loss_fn(logprobs, entropy, input_data, **kw)
        mask = input_data["loss_mask"].bool()
        h = entropy.detach().float()
        collector.capture(
            input_data["cu_seqlens"],
            logp_rollout=mu.float(),
            logp_train=pi_old.float(),
            entropy=h,
            loss_mask=mask.to(torch.int8),
        )
        if not collector.estr:
            return grpo_loss_fn(logprobs, entropy, input_data, **kw)
        with torch.no_grad():
            keep = estr_keep_mask(pi_old.float(), mu.float(), h, collector.tau, collector.eps)
            keep = keep | ~mask
        input_data = dict(input_data)
        adv = input_data["advantages"]
        input_data["advantages"] = torch.where(keep, adv, torch.zeros_like(adv))
        _estr_stat(~keep, mask)
        return grpo_loss_fn(logprobs, entropy, input_data, **kw)

    loss_fn._timwatch_hooked = True  # type: ignore[attr-defined]
    return loss_fn


def _rank(engine: Any) -> tuple[int, bool]:
    try:
        return int(engine.data_parallel_rank), bool(engine.is_data_parallel_head())
    except Exception:  # an engine without the parallel helpers: one process
        return int(os.environ.get("RANK", "0")), True


def _reenable_loggers(manager: logging.Manager) -> None:
    """Undo what importing AReaL does to timwatch's loggers made before it: its
    ``areal.utils.logging`` runs ``logging.config.dictConfig`` with
    ``disable_existing_loggers=True`` (and swaps in a new logging manager), which silences
    every ``timwatch.*`` logger of ``manager`` (the tap's drop warnings among them). Those are
    switched back on; AReaL's own configuration stays."""
    for name, logger in list(manager.loggerDict.items()):
        if name.startswith("timwatch") and isinstance(logger, logging.Logger):
            logger.disabled = False


def install(module: Any = None) -> bool:
    """Wrap `_compute_advantages`, `grpo_loss_fn` and `ppo_update` of AReaL's PPO actor module
    (`areal.trainer.ppo.actor` by default); False without AReaL. Idempotent."""
    if module is None:
        manager = logging.Logger.manager
        try:
            module = importlib.import_module("areal.trainer.ppo.actor")
        except ImportError:
            return False
        finally:
            _reenable_loggers(manager)
    module.grpo_loss_fn = wrap_loss(module.grpo_loss_fn)
    cls = module.PPOActor
    if getattr(cls, "_timwatch_hooked", False):
        return True
    compute_advantages, ppo_update = cls._compute_advantages, cls.ppo_update

    @functools.wraps(compute_advantages)
    def _compute_advantages(self: Any, data: dict[str, Any]) -> Any:
        if worker_collector() is None:
            return compute_advantages(self, data)
        mu = torch.roll(data["logprobs"], shifts=-1, dims=-1).detach().clone()
        out = compute_advantages(self, data)
        out[MU_KEY] = mu * out["loss_mask"].to(mu.dtype)
        return out

    @functools.wraps(ppo_update)
    def hooked_ppo_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        collector = worker_collector()
        if collector is None:
            return ppo_update(self, *args, **kwargs)
        step = int(self.engine.get_version())
        collector.discard()
        out = ppo_update(self, *args, **kwargs)
        rank, head = _rank(self.engine)
        if head:
            collector.report(step, rank)
        else:
            collector.discard()
        return out

    cls._compute_advantages = _compute_advantages
    cls.ppo_update = hooked_ppo_update
    cls._timwatch_hooked = True
    return True


if os.environ.get("TIMWATCH_AREAL_AUTOINSTALL", "1") != "0":
    install()
