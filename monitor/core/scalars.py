"""Per-step scalars from a trainer's own logs: timwatch's canonical names and each framework's.

A trainer that cannot hand timwatch its per-token μ, π and H can still send the numbers it
already logs (``Tap.log(step, {...}, source="verl")``, ``POST /v1/runs/{run}/scalars``). This
module is the one place that says what those names mean to timwatch (stdlib only: the tap
imports it).

Invariants:
- Every canonical name is one of three kinds (`KINDS`): ``metric`` names a `MetricRow` series
  column (docs/reference/metrics.md) and is only ever the target of a framework name whose
  formula is that column's formula; ``correction`` names a quantity a framework computes that
  timwatch does not (its applied, truncated or masked importance weight, the share of tokens its
  own correction rejected, ...), never a `MetricRow` column; ``health`` is the trainer's own
  health, named one way for every framework (`HEALTH`).
- `SOURCES` maps each supported framework's logged names onto canonical names (a name may
  carry one of the source's `PREFIXES`); a name maps to at most one canonical name, within one
  source no two names map to the same one, and one step's dict that names a canonical scalar
  twice (``loss`` and ``train/loss``) is refused.
- `map_scalars` never drops or renames silently: every input name ends up either in
  ``canonical`` (under its canonical name) or in ``unmapped`` (under its own name), or is
  refused with an `InputError` naming it. Values are Python floats, or None for a non-finite
  one (listed in ``nonfinite``: a NaN gradient norm is news, but not a number to store).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import InputError

__all__ = [
    "CANONICAL",
    "HEALTH",
    "KINDS",
    "MAX_NAME_CHARS",
    "MAX_NAMES",
    "MAX_STEP",
    "SOURCES",
    "PREFIXES",
    "MappedScalars",
    "ScalarName",
    "check_source",
    "check_step",
    "map_scalars",
    "to_float",
]

#: the kinds of canonical scalar (see the module docstring)
KINDS = ("metric", "correction", "health")
#: most names one post (or one `Tap.log` call) may carry
MAX_NAMES = 256
#: longest accepted name, in characters
MAX_NAME_CHARS = 128
#: steps are BigInteger columns, like a batch's step
MAX_STEP = 2**63 - 1


@dataclass(frozen=True)
class ScalarName:
    """One canonical scalar: its name, kind and what it means."""

    name: str
    kind: str
    help: str


def _metric(name: str, help: str) -> ScalarName:
    return ScalarName(name, "metric", help)


def _correction(name: str, help: str) -> ScalarName:
    return ScalarName(name, "correction", help)


def _health(name: str, help: str) -> ScalarName:
    return ScalarName(name, "health", help)


_ALL = (
    # -- the MetricRow columns a framework's number can be (same formula, see metrics.md) ------
    _metric("mismatch_kl", "mean k3 = e^δ − 1 − δ over masked tokens (δ = π − μ)"),
    _metric("kl_k1", "mean k1 = mean(μ − π)"),
    _metric("kl_k2", "mean k2 = mean δ²/2"),
    _metric("log_ratio_mean", "mean δ"),
    _metric("log_ratio_abs_mean", "mean |δ|"),
    _metric("log_ratio_abs_max", "max |δ|"),
    _metric("prob_abs_diff_mean", "mean |e^π − e^μ|"),
    _metric("prob_abs_diff_max", "max |e^π − e^μ|"),
    _metric("prob_abs_diff_std", "population std of |e^π − e^μ|"),
    _metric("prob_pearson_corr", "Pearson(e^π, e^μ)"),
    _metric("is_ratio_mean", "mean raw r = e^δ"),
    _metric("is_ratio_min", "min raw r"),
    _metric("is_ratio_max", "max raw r"),
    _metric("chi2_token", "mean r² − 1"),
    _metric("chi2_seq", "mean over sequences of e^{2 L_s} − 1"),
    _metric("training_ppl", "mean over sequences of exp(−mean_s π)"),
    _metric("training_log_ppl", "mean over sequences of −mean_s π"),
    _metric("rollout_ppl", "mean over sequences of exp(−mean_s μ)"),
    _metric("rollout_log_ppl", "mean over sequences of −mean_s μ"),
    _metric("log_ppl_diff", "mean over sequences of mean_s μ − mean_s π"),
    _metric("log_ppl_abs_diff", "mean over sequences of |mean_s μ − mean_s π|"),
    _metric("log_ppl_diff_max", "max over sequences of mean_s μ − mean_s π"),
    _metric("log_ppl_diff_min", "min over sequences of mean_s μ − mean_s π"),
    _metric("ppl_ratio", "mean over sequences of exp(mean_s μ − mean_s π)"),
    # -- what a framework computes and timwatch does not --------------------------------------
    _correction("log_ratio_abs_std", "std of |δ| over masked tokens (no MetricRow equivalent)"),
    _correction(
        "exp_abs_log_ratio_mean",
        "mean e^|δ| over masked tokens (NeMo-RL's token_mult_prob_error)",
    ),
    _correction(
        "is_weight_mean",
        "mean of the importance weight the framework applied (after its own truncation or "
        "masking, at its own bound): not timwatch's raw is_ratio_* nor tis_weight_*",
    ),
    _correction("is_weight_min", "min of the importance weight the framework applied"),
    _correction("is_weight_max", "max of the importance weight the framework applied"),
    _correction("is_weight_std", "std of the importance weight the framework applied"),
    _correction("is_weight_ess", "effective sample size of the weight the framework applied"),
    _correction(
        "correction_masked_fraction",
        "share of tokens the framework's own correction masked or rejected",
    ),
    _correction(
        "correction_seq_masked_fraction",
        "share of sequences the framework's own correction masked or rejected",
    ),
    _correction(
        "log_ratio_abs_seq_mean",
        "mean over sequences of each sequence's mean |δ| (timwatch's log_ratio_abs_mean is "
        "over tokens)",
    ),
    _correction(
        "is_ratio_seq_mean",
        "mean over sequences of each sequence's mean raw r (timwatch's is_ratio_mean is over "
        "tokens)",
    ),
    _correction(
        "correction_kept_fraction",
        "share of tokens the framework's own correction kept (its filter's pass rate)",
    ),
    _correction(
        "framework_kl_reverse",
        "the framework's own KL(train‖rollout) estimate (NeMo-RL's policy_kl_error)",
    ),
    _correction(
        "framework_js",
        "the framework's own Jensen-Shannon divergence between rollout and train "
        "(NeMo-RL's js_divergence_error)",
    ),
    _correction(
        "framework_kl",
        "the framework's own KL(rollout‖train) estimate whose estimator is not one of timwatch's "
        "k1/k2/k3 (or not documented as one)",
    ),
    # -- the trainer's health, one name for every framework ------------------------------------
    _health("reward_mean", "mean reward of the step's samples"),
    _health("reward_std", "standard deviation of the step's rewards"),
    _health("grad_norm", "gradient norm (before clipping, as the framework logs it)"),
    _health("entropy", "policy entropy as the framework aggregates it (nats)"),
    _health("response_length_mean", "mean response length, tokens"),
    _health("response_length_max", "max response length, tokens"),
    _health("learning_rate", "the actor's learning rate"),
    _health("clip_fraction", "share of tokens the PPO ratio clip was active on"),
    _health("loss", "the actor's (policy) loss"),
)

#: every canonical scalar by name, in a fixed order
CANONICAL: dict[str, ScalarName] = {s.name: s for s in _ALL}
#: the health scalars, in their documented order
HEALTH = tuple(s.name for s in _ALL if s.kind == "health")

_TRL = {
    "sampling/sampling_logp_difference/mean": "log_ratio_abs_mean",
    "sampling/sampling_logp_difference/max": "log_ratio_abs_max",
    "sampling/importance_sampling_ratio/min": "is_weight_min",
    "sampling/importance_sampling_ratio/mean": "is_weight_mean",
    "sampling/importance_sampling_ratio/max": "is_weight_max",
    "reward": "reward_mean",
    "reward_std": "reward_std",
    "entropy": "entropy",
    "grad_norm": "grad_norm",
    "completions/mean_length": "response_length_mean",
    "completions/max_length": "response_length_max",
    "learning_rate": "learning_rate",
    "clip_ratio/region_mean": "clip_fraction",
    "loss": "loss",
}

_VERL = {
    "rollout_corr/kl": "kl_k1",
    "rollout_corr/k3_kl": "mismatch_kl",
    "rollout_corr/chi2_token": "chi2_token",
    "rollout_corr/chi2_seq": "chi2_seq",
    "rollout_corr/training_ppl": "training_ppl",
    "rollout_corr/training_log_ppl": "training_log_ppl",
    "rollout_corr/rollout_ppl": "rollout_ppl",
    "rollout_corr/rollout_log_ppl": "rollout_log_ppl",
    "rollout_corr/log_ppl_diff": "log_ppl_diff",
    "rollout_corr/log_ppl_abs_diff": "log_ppl_abs_diff",
    "rollout_corr/log_ppl_diff_max": "log_ppl_diff_max",
    "rollout_corr/log_ppl_diff_min": "log_ppl_diff_min",
    "rollout_corr/ppl_ratio": "ppl_ratio",
    "rollout_corr/rollout_is_mean": "is_weight_mean",
    "rollout_corr/rollout_is_min": "is_weight_min",
    "rollout_corr/rollout_is_max": "is_weight_max",
    "rollout_corr/rollout_is_std": "is_weight_std",
    "rollout_corr/rollout_is_eff_sample_size": "is_weight_ess",
    "rollout_corr/rollout_rs_masked_fraction": "correction_masked_fraction",
    "rollout_corr/rollout_rs_seq_masked_fraction": "correction_seq_masked_fraction",
    "training/rollout_probs_diff_mean": "prob_abs_diff_mean",
    "training/rollout_probs_diff_max": "prob_abs_diff_max",
    "training/rollout_probs_diff_std": "prob_abs_diff_std",
    "training/rollout_actor_probs_pearson_corr": "prob_pearson_corr",
    "critic/score/mean": "reward_mean",
    "actor/grad_norm": "grad_norm",
    "actor/entropy": "entropy",
    "response_length/mean": "response_length_mean",
    "response_length/max": "response_length_max",
    "actor/lr": "learning_rate",
    "actor/pg_clipfrac": "clip_fraction",
    "actor/pg_loss": "loss",
}

# OpenRLHF PolicyLoss: vllm_kl = masked_mean(rollout − old) = mean(−δ); the trainer's status
_OPENRLHF = {
    "vllm_kl": "kl_k1",
    "policy_loss": "loss",
    "ppo_clip_ratio": "clip_fraction",
    "actor_lr": "learning_rate",
    "reward": "reward_mean",
    "response_length": "response_length_mean",
    "rollout/reward_std": "reward_std",
    "actor_grad_norm": "grad_norm",
    "entropy_loss": "entropy",
    "is_filter_ratio": "correction_masked_fraction",
}

# AReaL decoupled PPO (stats_tracker under ppo_actor/update): behave_imp_weight = e^(prox − μ)
# capped, averaged over the tokens it kept; behave_approx_kl = prox − μ over those tokens
_AREAL = {
    "ppo_actor/update/behave_imp_weight/avg": "is_weight_mean",
    "ppo_actor/update/behave_imp_weight/min": "is_weight_min",
    "ppo_actor/update/behave_imp_weight/max": "is_weight_max",
    "ppo_actor/update/behave_approx_kl/avg": "framework_kl",
    "ppo_actor/update/actor_loss/avg": "loss",
    "ppo_actor/update/clip_ratio/avg": "clip_fraction",
    "ppo_actor/update/entropy/avg": "entropy",
}

# NeMo-RL ClippedPGLossFn: token_mult_prob_error = masked mean of e^|μ − π|
_NEMO_RL = {
    "token_mult_prob_error": "exp_abs_log_ratio_mean",
    "gen_kl_error": "framework_kl",
    "policy_kl_error": "framework_kl_reverse",
    "js_divergence_error": "framework_js",
    "sampling_importance_ratio": "is_weight_mean",
    "reward": "reward_mean",
    "loss": "loss",
    "grad_norm": "grad_norm",
}

# SkyRL trainer: |rollout_logprobs − action_log_probs| over loss_mask tokens (std: torch's,
# with Bessel's correction); the policy worker's status under policy/ (skyrl 0.3.0
# trainer.py, workers/worker.py). reward/avg_raw_reward (before shaping) stays unmapped: the
# same step also logs loss/avg_final_rewards, the reward the advantages were computed from
_SKYRL = {
    "policy/rollout_train_logprobs_abs_diff_mean": "log_ratio_abs_mean",
    "policy/rollout_train_logprobs_abs_diff_max": "log_ratio_abs_max",
    "policy/rollout_train_logprobs_abs_diff_std": "log_ratio_abs_std",
    "loss/avg_final_rewards": "reward_mean",
    "policy/grad_norm": "grad_norm",
    "policy/policy_entropy": "entropy",
    "policy/policy_lr": "learning_rate",
    "policy/policy_loss": "loss",
    "policy/loss_metrics/clip_ratio": "clip_fraction",
}

# ROLL actor worker: seq-mean-token-mean of the train/infer ratio; the filter's pass rate
_ROLL = {
    "actor/train_infer_ratio_mean": "is_ratio_seq_mean",
    "actor/train_infer_ratio_mask_mean": "correction_kept_fraction",
    "actor/pg_loss": "loss",
    "actor/pg_clipfrac": "clip_fraction",
    "actor/grad_norm": "grad_norm",
}

# prime-rl loss: mismatch_kl = r − log r − 1 (k3), is_masked = its probability-difference mask
_PRIME_RL = {
    "mismatch_kl/mean": "mismatch_kl",
    "is_masked/mean": "correction_masked_fraction",
    "entropy/mean": "entropy",
}

# slime: verl's mismatch metrics under a mismatch_ prefix, and its loss report
# (train_rollout_logprob_abs_diff = mean over samples of each sample's mean |old − rollout|)
_SLIME = {
    "mismatch_kl": "kl_k1",
    "mismatch_k3_kl": "mismatch_kl",
    "mismatch_training_ppl": "training_ppl",
    "mismatch_training_log_ppl": "training_log_ppl",
    "mismatch_rollout_ppl": "rollout_ppl",
    "mismatch_rollout_log_ppl": "rollout_log_ppl",
    "mismatch_log_ppl_diff": "log_ppl_diff",
    "mismatch_log_ppl_abs_diff": "log_ppl_abs_diff",
    "mismatch_log_ppl_diff_max": "log_ppl_diff_max",
    "mismatch_log_ppl_diff_min": "log_ppl_diff_min",
    "mismatch_ppl_ratio": "ppl_ratio",
    "train_rollout_logprob_abs_diff": "log_ratio_abs_seq_mean",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "pg_clipfrac": "clip_fraction",
}

#: framework name → {its logged name: canonical name}; see docs/integrations.md ("Scalars")
SOURCES: dict[str, dict[str, str]] = {
    "trl": _TRL,
    "openrlhf": _OPENRLHF,
    "areal": _AREAL,
    "nemo_rl": _NEMO_RL,
    "skyrl": _SKYRL,
    "roll": _ROLL,
    "prime_rl": _PRIME_RL,
    "verl": _VERL,
    "slime": _SLIME,
}
#: prefixes a source's logger puts before the names above (``train/loss`` is slime's ``loss``)
PREFIXES: dict[str, tuple[str, ...]] = {"nemo_rl": ("train/",), "slime": ("train/",)}


@dataclass
class MappedScalars:
    """What `map_scalars` makes of one step's dict (see the module docstring). A value of None
    stands for a non-finite one (NaN or ±inf): the name is kept, the number is not."""

    canonical: dict[str, float | None] = field(default_factory=dict)
    unmapped: dict[str, float | None] = field(default_factory=dict)
    #: input names (as given) whose value was NaN or ±inf
    nonfinite: list[str] = field(default_factory=list)
    #: canonical name → the input name it came from
    origin: dict[str, str] = field(default_factory=dict)


def check_source(source: str | None) -> dict[str, str] | None:
    """The name map of `source` (None: names are canonical already); `InputError` on
    ``source`` for an unknown framework."""
    if source is None:
        return None
    if not isinstance(source, str) or source not in SOURCES:
        known = ", ".join(sorted(SOURCES))
        raise InputError("source", f"source must be one of {known} or absent, got {source!r:.60}")
    return SOURCES[source]


def check_step(step: Any) -> int:
    """`step` as an int in [0, `MAX_STEP`]; `InputError` on ``step`` otherwise."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InputError("step", f"step must be an integer in [0, 2^63 − 1], got {step!r:.60}")
    return step


def to_float(value: Any) -> float | None:
    """A Python number, numpy scalar or 0-d array, or torch 0-d tensor as a float; None if it
    is not one of those (bools are not numbers here). Never imports torch."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    shape = getattr(value, "shape", None)
    if item is not None and shape is not None and tuple(shape) in ((), (1,)):
        try:
            out = item()
        except Exception:  # noqa: BLE001 - anything that cannot give a number is not one
            return None
        if isinstance(out, bool) or not isinstance(out, (int, float)):
            return None
        return float(out)
    return None


def map_scalars(values: Mapping[str, Any], source: str | None = None) -> MappedScalars:
    """Map one step's ``{name: number}`` from `source`'s names (None: canonical names) onto
    canonical scalars. `InputError` naming ``scalars`` (not a mapping, empty, more than
    `MAX_NAMES`), ``scalars.<name>`` (a name that is not a string of 1-`MAX_NAME_CHARS`
    characters, or a value that is not a number) or ``source``."""
    names = check_source(source)
    if not isinstance(values, Mapping):
        raise InputError("scalars", "scalars must be an object of name: number")
    if len(values) > MAX_NAMES:
        raise InputError("scalars", f"at most {MAX_NAMES} names per step, got {len(values)}")
    out = MappedScalars()
    for name, raw in values.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise InputError(
                "scalars", f"names must be strings of 1-{MAX_NAME_CHARS} characters: {name!r:.60}"
            )
        if not name.isprintable():
            raise InputError("scalars", f"name {name!r:.60} has control characters")
        value = to_float(raw)
        if value is None:
            raise InputError(
                f"scalars.{name}", f"scalars.{name} must be a number, got {type(raw).__name__}"
            )
        kept: float | None = value
        if not math.isfinite(value):
            out.nonfinite.append(name)
            kept = None
        target = _lookup(name, names, PREFIXES.get(source or "", ()))
        if target is None:
            out.unmapped[name] = kept
            continue
        if target in out.origin:
            raise InputError(
                f"scalars.{name}",
                f"scalars.{name} and scalars.{out.origin[target]} both map to {target}",
            )
        out.canonical[target] = kept
        out.origin[target] = name
    return out


def _lookup(name: str, names: dict[str, str] | None, prefixes: tuple[str, ...]) -> str | None:
    if names is None:
        return name if name in CANONICAL else None
    if name in names:
        return names[name]
    for prefix in prefixes:
        if name.startswith(prefix) and name[len(prefix) :] in names:
            return names[name[len(prefix) :]]
    return None


def _check_maps() -> None:
    for source, names in SOURCES.items():
        targets = list(names.values())
        bad = [t for t in targets if t not in CANONICAL]
        assert not bad, f"{source} maps onto unknown names {bad}"
        assert len(set(targets)) == len(targets), f"{source} maps two names onto one"


_check_maps()
