"""SkyRL plug-in, the entry module: registers the `estr` policy loss in SkyRL's
`PolicyLossRegistry` and hooks the policy worker so every training mini-batch's per-token μ, π_old
and H reach timwatch under SkyRL's own `global_step`. Checked against skyrl 0.3.0
(`skyrl/backends/skyrl_train/workers/worker.py`, `.../utils/ppo_utils.py`,
`skyrl/train/trainer.py`), FSDP strategy; the Megatron worker has its own loss path and is not
hooked.

Loading: importing this module registers `estr` and installs the hooks
(TIMWATCH_SKYRL_AUTOREGISTER=0 turns that off; then call `register_with_skyrl()`). With
`trainer.algorithm.policy_loss_type=estr` SkyRL's registry ships the loss to its Ray workers by
cloudpickle, which imports this module there too; with another loss, import it in the worker
processes yourself (docs/integrations.md).

Invariants:
- The step is `TrainingInputBatch.metadata["global_step"]`, which SkyRL's own
  `RayPPOTrainer.train_critic_and_policy` sets and restores on resume; a mini-batch without it
  reports nothing and logs why.
- The worker reports each distinct mini-batch of a step once, from the rank SkyRL itself collects
  from (`MeshRank.is_collection_dp_rank()`), with batch id `skyrl-s{step}-dp{dp}-m{k}` (k counts
  the step's distinct mini-batches in order): a later epoch over the same mini-batch (its π_old
  and μ unchanged) is not reported again, and a step redone after a resume is a replay or a 409
  conflict at the monitor, never extra tokens.
- Response tensors are SkyRL's right-aligned `[batch, num_actions]`: a row's sequence is its
  `response_mask` span (the last tokens), loss-mask zeros inside it stay with loss_mask 0;
  SkyRL's padding micro-batches (`is_padding_batch`) are skipped.
- The tap never breaks training: a failing report is logged, not raised. The one exception is
  the guard's `RunPaged` (TIMWATCH_ON_PAGE=raise): it leaves the policy worker's
  `forward_backward` after the mini-batch and its report (and `on_log` of `timwatch_callback`
  after the logged numbers), and stops the run.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from ...monitor.core.errors import RunPaged
from .skyrl_loss import ESTR_LOSS_NAME, clear_entropy, compute_policy_loss_estr, set_entropy

__all__ = [
    "ESTR_LOSS_NAME",
    "STEP_KEY",
    "compute_policy_loss_estr",
    "estr_policy_loss",
    "install_worker_hooks",
    "pack_right_aligned",
    "register_with_skyrl",
    "timwatch_callback",
    "worker_tap",
]

log = logging.getLogger(__name__)

#: the metadata key SkyRL's trainer puts its step under
STEP_KEY = "global_step"

_TAP: Any = None
_ACTIVE: contextvars.ContextVar[list[dict[str, torch.Tensor]] | None] = contextvars.ContextVar(
    "timwatch_skyrl_capture", default=None
)


def worker_tap() -> Any:
    """The per-process `Tap` from TIMWATCH_URL / TIMWATCH_RUN (default ``skyrl``) /
    TIMWATCH_TOKEN / TIMWATCH_ON_PAGE (`timwatch.sidecar.tap.env.tap_from_env`), if set."""
    global _TAP
    if _TAP is None:
        from ..tap.env import tap_from_env

        _TAP = tap_from_env("skyrl")
    return _TAP


def pack_right_aligned(
    response_mask: torch.Tensor, loss_mask: torch.Tensor, **arrays: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SkyRL's right-aligned `[batch, num_actions]` arrays → the packed layout
    (docs/reference/batch.md): row i keeps its last `response_mask[i].sum()` positions."""
    n = response_mask.shape[-1]
    lengths = (response_mask != 0).sum(dim=-1)
    idx = torch.arange(n, device=response_mask.device)
    inside = idx[None, :] >= (n - lengths)[:, None]
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=response_mask.device)
    torch.cumsum(lengths, dim=0, out=cu[1:])
    packed = {k: v[inside] for k, v in arrays.items()}
    packed["loss_mask"] = (loss_mask[inside] != 0).to(torch.int8)
    return cu, packed


def _digest(parts: list[dict[str, torch.Tensor]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        for key in ("logp_train", "logp_rollout"):
            h.update(p[key].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _capture(experience: Any, entropy: torch.Tensor) -> None:
    pending = _ACTIVE.get()
    if pending is None or (experience.metadata or {}).get("is_padding_batch"):
        return
    mu = experience.rollout_logprobs
    if mu is None:
        return
    loss_mask = experience.loss_mask
    response = experience.action_mask if experience.action_mask is not None else loss_mask
    cu, arrays = pack_right_aligned(
        response,
        loss_mask,
        logp_rollout=mu.detach().float(),
        logp_train=experience.action_log_probs.detach().float(),
        entropy=entropy.detach().float(),
    )
    pending.append({"cu_seqlens": cu, **arrays})


def _merge(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    pieces, offset = [parts[0]["cu_seqlens"][:1]], 0
    for p in parts:
        pieces.append(p["cu_seqlens"][1:] + offset)
        offset += int(p["cu_seqlens"][-1])
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "cu_seqlens"}
    out["cu_seqlens"] = torch.cat(pieces)
    return out


def _report(worker: Any, data: Any, parts: list[dict[str, torch.Tensor]]) -> None:
    mesh = getattr(worker, "mesh_rank", None)
    if not parts or (mesh is not None and not mesh.is_collection_dp_rank()):
        return
    step = (getattr(data, "metadata", None) or {}).get(STEP_KEY)
    if step is None:
        log.error(
            "timwatch: the policy mini-batch carries no %r in its metadata; nothing reported",
            STEP_KEY,
        )
        return
    step = int(step)
    seen: dict[str, int] = getattr(worker, "_timwatch_seen", {})
    if getattr(worker, "_timwatch_step", None) != step:
        seen = {}
    worker._timwatch_step, worker._timwatch_seen = step, seen
    digest = _digest(parts)
    if digest in seen:
        return  # a later epoch over a mini-batch already reported
    seen[digest] = k = len(seen)
    dp = 0 if mesh is None else int(mesh.dp)
    tap = worker_tap()
    try:
        tap.report(step, batch_id=f"skyrl-s{step}-dp{dp}-m{k}", **_merge(parts))
    except RunPaged:  # the guard's on_page="raise": the one stop the user asked for
        raise
    except Exception:  # the tap must never break training
        log.exception("timwatch tap.report failed at step %s", step)


def install_worker_hooks(worker_cls: Any = None) -> bool:
    """Wrap `PolicyWorkerBase._forward_backward_micro` (a forward hook on `self.model` hands the
    loss its H and keeps the micro-batch) and `forward_backward` (reports the mini-batch)."""
    if worker_cls is None:
        try:
            from skyrl.backends.skyrl_train.workers import worker
        except ImportError:
            return False
        worker_cls = worker.PolicyWorkerBase
    if getattr(worker_cls, "_timwatch_hooked", False):
        return True
    micro = worker_cls._forward_backward_micro
    mini = worker_cls.forward_backward

    @functools.wraps(micro)
    def _forward_backward_micro(self: Any, experience: Any, *args: Any, **kwargs: Any) -> Any:
        seen: list[torch.Tensor] = []
        num_actions = int(experience.num_actions)

        def hook(module: Any, inputs: Any, output: Any) -> None:
            del module, inputs
            if not (isinstance(output, tuple) and len(output) == 2):
                return
            extra = output[1]
            entropy = extra.get("entropy") if isinstance(extra, Mapping) else None
            if entropy is not None:
                h = entropy[:, -num_actions - 1 : -1]  # SkyRL's own slice of it
                set_entropy(output[0], h)
                seen.append(h.detach())

        handle = self.model.register_forward_hook(hook)
        try:
            out = micro(self, experience, *args, **kwargs)
        finally:
            handle.remove()
            clear_entropy()
        if seen:
            _capture(experience, seen[0])
        return out

    @functools.wraps(mini)
    def forward_backward(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        if worker_tap() is None:
            return mini(self, data, *args, **kwargs)
        pending: list[dict[str, torch.Tensor]] = []
        token = _ACTIVE.set(pending)
        try:
            out = mini(self, data, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)
        _report(self, data, pending)
        return out

    worker_cls._forward_backward_micro = _forward_backward_micro
    worker_cls.forward_backward = forward_backward
    worker_cls._timwatch_hooked = True
    return True


def _number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and tuple(shape) == () and hasattr(value, "item")


def timwatch_callback(tap: Any = None) -> Any:
    """A SkyRL `TrainingCallback` (pass it as `RayPPOTrainer(..., callbacks=[...])`) whose
    `on_log` hands the numbers of the dict SkyRL is about to commit to its tracker to timwatch's
    scalar bridge, `tap.log(global_step, numbers, source="skyrl")`, under SkyRL's own step; other
    values (tables, strings) stay out. `tap` defaults to the process's `worker_tap()`; with
    neither, it does nothing."""
    from skyrl.train.utils.callbacks import TrainingCallback

    class TimwatchCallback(TrainingCallback):
        def on_log(self, trainer: Any, callback_input: Any, control: Any) -> None:
            target = tap if tap is not None else worker_tap()
            logs = callback_input.logs
            if target is None or not logs:
                return
            numbers = {k: v for k, v in logs.items() if _number(v)}
            target.log(int(callback_input.global_step), numbers, source="skyrl")

    return TimwatchCallback()


def estr_policy_loss(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """`skyrl_loss.compute_policy_loss_estr`, registered from this module: SkyRL's registry ships
    it to its Ray workers by cloudpickle, which pickles it by reference, so unpickling it there
    imports this module and installs the worker hooks in that process."""
    return compute_policy_loss_estr(*args, **kwargs)


def register_with_skyrl(*, hook_worker: bool = True) -> bool:
    """Register `estr` in SkyRL's `PolicyLossRegistry` (and install the worker hooks); False
    without SkyRL."""
    try:
        from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    except ImportError:
        return False
    except Exception:  # e.g. skyrl 0.3.0 on Python 3.11: pydantic rejects its typing.TypedDict
        log.exception("timwatch: SkyRL is installed but does not import here")
        return False
    if ESTR_LOSS_NAME not in PolicyLossRegistry.list_available():
        PolicyLossRegistry.register(ESTR_LOSS_NAME, estr_policy_loss)
    if hook_worker:
        try:
            install_worker_hooks()
        except Exception:  # an unexpected SkyRL layout must not stop training from starting
            log.exception("timwatch: could not install SkyRL's worker hooks")
    return True


if os.environ.get("TIMWATCH_SKYRL_AUTOREGISTER", "1") != "0":
    register_with_skyrl()
