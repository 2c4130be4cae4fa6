"""TRL plug-in: `TimwatchGRPOTrainer` (or `TimwatchGRPOMixin` before your own `GRPOTrainer`
subclass) reports each generation batch's per-token μ, π, H and loss mask to a timwatch tap, and
`TimwatchCallback` forwards TRL's logged scalars; docs/integrations.md has the recipe. The module
imports without trl or transformers; those two classes import them when first used.

The hook is a subclass override, not a patch: `_generate_and_score_completions` is where
`GRPOTrainer` (TRL 1.16) holds, for one generation batch, the sampled token ids, the completion
mask (times the tool/env mask), the engine's per-token log-probs (``sampling_per_token_logps``,
μ, present when vLLM or a ``rollout_func`` returns them) and its own recomputed log-probs
(``old_per_token_logps``, π, present when TRL computes them: with vLLM's importance-sampling
correction, or when generation and optimizer steps are not aligned). The batch is reported once,
under the step number TRL logs for the first optimizer step that trains it
(``state.global_step + 1`` at generation time), in training only.

What is reported (the invariants):

- π (``logp_train``) and H (``entropy``) come from one no-grad forward of the training model on
  the batch: TRL's own old-log-prob forward, asked to compute the entropy too, when TRL runs
  it; else one forward run here with TRL's `_get_per_token_logps_and_entropies`.
- μ (``logp_rollout``) is ``sampling_per_token_logps`` where TRL has it. Without it (TRL's own
  transformers generation keeps no sampling log-probs) μ is set to π, so every mismatch metric
  is exactly 0 by construction: such a run reports tokens, sequences, entropy and lengths per
  step, not a mismatch.
- ``loss_mask`` is TRL's loss mask (completion mask times tool/env mask), except tokens whose
  engine log-prob is NaN (vLLM could not score them), which are masked out as TRL excludes them
  from its ``sampling/*`` metrics; μ there is set to π so the batch stays valid.
- Sequences are the completions (prompts are not sent), packed up to each one's last masked
  token, with ``token_ids`` the completion ids.

With ESTR on (``estr_tau``), rejected tokens leave TRL's loss through the mask its loss reads
(`apply_estr`), after the batch is reported: the reported ``loss_mask`` is TRL's, so the
monitor's ``mask_ratio_estr`` is the share ESTR rejects at the monitor's τ.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol

import torch

from ...monitor.core.errors import RunPaged
from ...monitor.core.masks import estr_keep_mask
from .verl_loss import pack_padded

__all__ = [
    "SupportsReport",
    "TimwatchCallback",  # noqa: F822 - built on first use (`__getattr__`)
    "TimwatchGRPOMixin",
    "TimwatchGRPOTrainer",  # noqa: F822 - built on first use (`__getattr__`)
    "TimwatchLogForwarder",
    "apply_estr",
    "pack_grpo_batch",
]

log = logging.getLogger("timwatch.trl")


class SupportsReport(Protocol):
    def report(self, step: int, **arrays: Any) -> bool: ...


def pack_grpo_batch(
    output: dict[str, Any], logp_train: torch.Tensor, entropy: torch.Tensor
) -> dict[str, Any]:
    """The packed arrays of one `_generate_and_score_completions` output (see the module doc
    for what each field holds): ``cu_seqlens``, ``logp_rollout``, ``logp_train``, ``entropy``,
    ``loss_mask``, ``token_ids``, all of one length N, float32 on the CPU."""
    mask = output["completion_mask"]
    if output.get("tool_mask") is not None:
        mask = mask * output["tool_mask"]
    pi = logp_train.detach().float()
    mu = output.get("sampling_per_token_logps")
    if mu is None:
        mu = pi
    else:
        mu = mu.detach().float()
        scored = ~torch.isnan(mu)
        mask = mask * scored
        mu = torch.where(scored, mu, pi)
    cu, packed = pack_padded(
        mask,
        logp_rollout=mu,
        logp_train=pi,
        entropy=entropy.detach().float(),
        token_ids=output["completion_ids"].long(),
    )
    return {"cu_seqlens": cu.cpu(), **{k: v.cpu() for k, v in packed.items()}}


def apply_estr(
    output: dict[str, Any], logp_train: torch.Tensor, entropy: torch.Tensor, tau: float,
    eps: float = 0.01,
) -> torch.Tensor | None:  # fmt: skip
    """ESTR in TRL's loss: tokens with δ² > τ(H + ε) (δ = π − μ, docs/reference/policies.md)
    leave the loss mask, through ``output["tool_mask"]`` (created where absent), the mask that
    `GRPOTrainer._compute_loss` multiplies into the completion mask and that nothing else
    reads for attention. Returns the keep mask, or None without engine log-probs (μ = π keeps
    every token). Tokens whose μ is NaN are kept, as TRL's own correction leaves them at ratio 1.
    π is TRL's generation-time recomputation (the first pass's π when ``num_iterations`` is 1).
    """
    mu = output.get("sampling_per_token_logps")
    if mu is None:
        return None
    keep = estr_keep_mask(logp_train.detach(), mu.detach(), entropy.detach(), tau=tau, eps=eps)
    keep = keep | torch.isnan(mu)
    mask = output.get("tool_mask")
    base = torch.ones_like(output["completion_mask"]) if mask is None else mask
    output["tool_mask"] = base * keep.to(base.dtype)
    return keep


class TimwatchGRPOMixin:
    """Put before `GRPOTrainer` in the bases; set ``timwatch_tap`` (a `Tap`) to report, and
    ``timwatch_estr`` (tau, eps) to apply ESTR in the loss (`apply_estr`).

    Overrides `_generate_and_score_completions` (to report the batch it returns) and
    `_get_per_token_logps_and_entropies` (to have TRL's own old-log-prob forward compute the
    entropy as well, so π and H cost no extra forward when TRL runs it). A failure here is
    logged once and never stops training, but for the guard's `RunPaged` (a tap with
    ``on_page="raise"``): it leaves `_generate_and_score_completions`, and so `train()`, before
    the batch is trained."""

    timwatch_tap: SupportsReport | None = None
    #: (tau, eps) to apply ESTR in TRL's loss (`apply_estr`); None: TRL's loss unchanged
    timwatch_estr: tuple[float, float] | None = None
    _timwatch_forwards: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
    _timwatch_failed = False

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: Any,
        batch_size: Any = None, compute_entropy: bool = False, *args: Any, **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        parent: Any = super()
        seen = self._timwatch_forwards
        this: Any = self
        if seen is None or torch.is_grad_enabled() or model is not this.model:  # not a ref model
            return parent._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                *args, **kwargs,
            )  # fmt: skip
        logps, entropy, aux = parent._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, True, *args, **kwargs
        )
        seen.append((logps, entropy))
        return logps, (entropy if compute_entropy else None), aux

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        parent: Any = super()
        this: Any = self
        tap, estr = self.timwatch_tap, self.timwatch_estr
        if (tap is None and estr is None) or not this.model.training:
            return parent._generate_and_score_completions(inputs)
        step = int(this.state.global_step) + 1
        self._timwatch_forwards = []
        try:
            output: dict[str, Any] = parent._generate_and_score_completions(inputs)
            forwards = self._timwatch_forwards
        finally:
            self._timwatch_forwards = None
        logp_train, entropy = self._timwatch_forward(output, forwards)
        if tap is not None:
            try:
                arrays = pack_grpo_batch(output, logp_train, entropy)
                tap.report(step, **arrays, policy_version=step - 1)
            except RunPaged:  # the guard's on_page="raise": the one stop the user asked for
                raise
            except Exception as exc:  # noqa: BLE001 - the plug-in must never break training
                if not self._timwatch_failed:
                    self._timwatch_failed = True
                    log.warning("timwatch: reporting TRL step %d failed: %s", step, exc)
        if estr is not None:
            apply_estr(output, logp_train, entropy, *estr)
        return output

    def _timwatch_forward(
        self, output: dict[str, Any], forwards: list[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """π and H of TRL's old-log-prob forward (found by identity), else of one no-grad
        forward run here."""
        old = output.get("old_per_token_logps")
        for logps, entropy in forwards:
            if logps is old and entropy is not None:
                return logps, entropy
        this: Any = self
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        parent: Any = super()
        with torch.no_grad():
            logps, got, _ = parent._get_per_token_logps_and_entropies(
                this.model, ids, attention, output["completion_ids"].size(1),
                this.args.per_device_train_batch_size, True,
            )  # fmt: skip
        assert got is not None
        return logps, got


#: the Trainer's end-of-training summary (logged under the last step), not a step's numbers
_SUMMARY = frozenset(
    ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
     "train_loss")
)  # fmt: skip


def _skipped(name: str) -> bool:
    """Evaluation logs and the training summary are not forwarded as a step's scalars."""
    return name.startswith("eval_") or name in _SUMMARY


class TimwatchLogForwarder:
    """The callback's behaviour (`TimwatchCallback` adds transformers' `TrainerCallback`):
    forwards each of TRL's training-step logs (``sampling/*``, rewards, loss, ...; not
    evaluation logs nor the end-of-training summary) on the main process to
    ``tap.log(step, logs, source="trl")`` under TRL's global step, where the tap has `log`;
    at the end of training waits up to ``flush_s`` seconds for the tap to ship what it holds.
    A failing ``tap.log`` is logged, never raised, but for the guard's `RunPaged` (a tap with
    ``on_page="raise"``), which leaves `on_log`, and so `train()`."""

    def __init__(self, tap: Any, flush_s: float = 30.0) -> None:
        self.tap = tap
        self.flush_s = flush_s

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        send = getattr(self.tap, "log", None)
        if send is None or not logs or not state.is_world_process_zero:
            return
        scalars = {
            k: float(v)
            for k, v in logs.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not _skipped(k)
        }
        if not scalars or (len(scalars) == 1 and "epoch" in scalars):
            return
        try:
            send(int(state.global_step), scalars, source="trl")
        except RunPaged:  # the guard's on_page="raise": the one stop the user asked for
            raise
        except Exception as exc:  # noqa: BLE001 - the plug-in must never break training
            log.warning("timwatch: forwarding TRL's logs failed: %s", exc)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        flush = getattr(self.tap, "flush", None)
        if flush is not None:
            flush(self.flush_s)


@functools.cache
def _callback_class() -> type:
    from transformers import TrainerCallback

    class TimwatchCallback(TimwatchLogForwarder, TrainerCallback):
        """A transformers `TrainerCallback` doing `TimwatchLogForwarder`'s work."""

    TimwatchCallback.__module__ = __name__
    TimwatchCallback.__qualname__ = "TimwatchCallback"  # pickled by name, via `__getattr__`
    return TimwatchCallback


@functools.cache
def _trainer_class() -> type:
    from trl import GRPOTrainer

    class TimwatchGRPOTrainer(TimwatchGRPOMixin, GRPOTrainer):
        """`GRPOTrainer` that reports to ``tap`` (see `TimwatchGRPOMixin`), with
        ``forward_logs`` forwards its logs through `TimwatchCallback`, and with ``estr_tau``
        applies ESTR in its loss (`apply_estr`). Other arguments are `GRPOTrainer`'s."""

        def __init__(
            self, *args: Any, tap: SupportsReport | None = None, forward_logs: bool = True,
            estr_tau: float | None = None, estr_eps: float = 0.01, **kwargs: Any,
        ) -> None:  # fmt: skip
            if tap is not None and forward_logs:
                extra = _callback_class()(tap)
                kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), extra]
            super().__init__(*args, **kwargs)
            self.timwatch_tap = tap
            self.timwatch_estr = None if estr_tau is None else (float(estr_tau), float(estr_eps))

    TimwatchGRPOTrainer.__module__ = __name__
    TimwatchGRPOTrainer.__qualname__ = "TimwatchGRPOTrainer"  # pickled by name, via `__getattr__`
    return TimwatchGRPOTrainer


def __getattr__(name: str) -> Any:
    """`TimwatchGRPOTrainer` and `TimwatchCallback`, built on first use (they import trl and
    transformers: the rest of this module imports neither)."""
    if name == "TimwatchGRPOTrainer":
        return _trainer_class()
    if name == "TimwatchCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
