"""verl and slime plug-ins, called with tensors shaped exactly as each framework passes them.

verl itself runs in tests/unit/test_verl_real.py (verl 0.9.1 from PyPI). This file keeps what
that cannot cover: the loss against float64 references written here, and the hook of the legacy
FSDP `DataParallelPPOActor`, which verl 0.9 removed, on a stand-in that follows its call sequence
(`_forward_micro_batch` → `policy_loss_fn`, verl/workers/actor/dp_actor.py before 0.9).

slime cannot be installed here: it is not on PyPI (the PyPI package named `slime` is another
project), and it needs Megatron-LM and SGLang with CUDA. Its tests therefore call the plug-in the
way slime's `policy_loss_function` calls a `--custom-tis-function-path` function and use a
stand-in for `get_log_probs_and_entropy`'s return value, both transcribed from
slime/backends/megatron_utils/loss.py (THUDM/slime `main` at 00c2d6db, read for this test:
`policy_loss_function` → `get_log_probs_and_entropy(..., with_entropy=True)` → `tis_func(...)`).
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.frameworks import RecordingTap
from timwatch.monitor.core.errors import PluginContextError
from timwatch.monitor.trainer.losses import estr_ppo_loss
from timwatch.sidecar.integrations import slime as slime_plugin
from timwatch.sidecar.integrations import verl_hooks, verl_loss

# the names the verl plug-in re-exports, from where they live: importing the plug-in itself
# imports verl (its registration), which only the registration test below needs
from timwatch.sidecar.integrations.verl_loss import (
    TimwatchTracking,
    compute_policy_loss_estr,
    estr_inputs,
    pack_padded,
)


class ActorConfig(dict):
    """Stand-in for verl's ActorConfig: a Mapping with attribute access and `.get`."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e


def actor_config(**over: Any) -> ActorConfig:
    cfg = ActorConfig(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        global_batch_info={},
        policy_loss=ActorConfig(loss_mode="estr"),
        ppo_epochs=1,
    )
    cfg.update(over)
    return cfg


def verl_batch(seed: int, bs: int = 4, length: int = 12):
    """[bs, response_len] float32 tensors and a right-padded response_mask, as verl passes them."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(bs, length, generator=g) * 3
    log_prob = (old + torch.randn(bs, length, generator=g) * 0.2).clamp(max=0)
    rollout = (old + torch.randn(bs, length, generator=g) * 0.6).clamp(max=0)
    entropy = torch.rand(bs, length, generator=g) ** 3 * 2
    adv = torch.randn(bs, 1, generator=g).expand(bs, length).contiguous()  # GRPO: per sequence
    lengths = torch.randint(1, length + 1, (bs,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    mask[0, 1] = 0.0  # a tool-output token inside a multi-turn response
    return old, log_prob, rollout, entropy, adv, mask


def ref_loss_mat(old, lp, mu, h, adv, mask, tau=1.6, eps=0.01, low=0.2, high=0.28):
    o, l_, m_, h_, a = (np.asarray(x, np.float64) for x in (old, lp, mu, h, adv))
    rho = np.exp(np.clip(l_ - o, -20, 20))
    per = np.maximum(-a * rho, -a * np.clip(rho, 1 - low, 1 + high))
    keep = ((o - m_) ** 2 <= tau * (h_ + eps)) & (np.asarray(mask) != 0)
    return np.where(keep, per, 0.0), keep


def test_verl_loss_token_mean_matches_reference_and_monitor_loss() -> None:
    old, lp, mu, h, adv, mask = verl_batch(0)
    x = lp.clone().requires_grad_()
    with estr_inputs(mu, h):
        loss, metrics = compute_policy_loss_estr(
            old_log_prob=old,
            log_prob=x,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="token-mean",
            config=actor_config(),
            rollout_is_weights=None,
        )
    mat, keep = ref_loss_mat(old, lp, mu, h, adv, mask)
    n = mask.sum().item()
    assert loss.item() == pytest.approx(mat.sum() / n, rel=1e-5)
    monitor_loss, _ = estr_ppo_loss(lp, old, adv, mask, mu, h)
    assert loss.item() == pytest.approx(monitor_loss.item(), rel=1e-6)
    assert set(metrics) == {
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "timwatch/estr_mask_ratio",
        "timwatch/mismatch_kl",
    }
    assert all(isinstance(v, float) for v in metrics.values())
    response = mask.numpy() != 0
    assert metrics["timwatch/estr_mask_ratio"] == pytest.approx((response & ~keep).sum() / n)
    d = (old - mu).double().numpy()
    assert metrics["timwatch/mismatch_kl"] == pytest.approx(
        (np.expm1(d) - d)[response].sum() / n, rel=1e-6
    )
    loss.backward()
    assert x.grad is not None and bool((x.grad[torch.from_numpy(~keep)] == 0).all())
    assert 0 < (~keep & response).sum() < response.sum()  # the case rejects some, keeps some


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_verl_sequence_aggregation_modes(mode: str) -> None:
    old, lp, mu, h, adv, mask = verl_batch(1)
    with estr_inputs(mu, h):
        loss, _ = compute_policy_loss_estr(old, lp, adv, mask, mode, actor_config(), None)
    mat, _ = ref_loss_mat(old, lp, mu, h, adv, mask)
    per_seq_tokens = mask.sum(-1).numpy()
    seq = mat.sum(-1) if mode.endswith("sum") else mat.sum(-1) / (per_seq_tokens + 1e-8)
    assert loss.item() == pytest.approx(seq[per_seq_tokens > 0].mean(), rel=1e-5)


def test_verl_global_batch_info_and_is_weights() -> None:
    old, lp, mu, h, adv, mask = verl_batch(2)
    w = torch.rand(old.shape, generator=torch.Generator().manual_seed(9)) + 0.5
    cfg = actor_config(global_batch_info={"dp_size": 2, "batch_num_tokens": 100})
    with estr_inputs(mu, h):
        loss, _ = compute_policy_loss_estr(old, lp, adv, mask, "token-mean", cfg, w)
    mat, _ = ref_loss_mat(old, lp, mu, h, adv, mask)
    assert loss.item() == pytest.approx((mat * w.numpy()).sum() / 100 * 2, rel=1e-5)


def test_verl_settings_from_config_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    old, lp, mu, h, adv, mask = verl_batch(3)
    n = mask.sum().item()
    for tau in (0.1, 5.0):
        cfg = actor_config(policy_loss=ActorConfig(loss_mode="estr", estr_tau=tau))
        with estr_inputs(mu, h):
            _, m = compute_policy_loss_estr(old, lp, adv, mask, "token-mean", cfg, None)
        _, keep = ref_loss_mat(old, lp, mu, h, adv, mask, tau=tau)
        assert m["timwatch/estr_mask_ratio"] == pytest.approx(
            ((mask != 0).numpy() & ~keep).sum() / n
        )
    monkeypatch.setenv("TIMWATCH_ESTR_MASK_LOGP", "current")
    with estr_inputs(mu, h):
        _, m = compute_policy_loss_estr(mu, lp, adv, mask, "token-mean", actor_config(), None)
    _, keep = ref_loss_mat(lp, lp, mu, h, adv, mask)  # mask from log_prob vs μ (bypass mode)
    assert m["timwatch/estr_mask_ratio"] == pytest.approx(((mask != 0).numpy() & ~keep).sum() / n)


def test_verl_loss_without_context_or_with_wrong_shapes_says_what_to_set() -> None:
    old, lp, mu, h, adv, mask = verl_batch(4)
    verl_loss._INPUTS.set(None)  # an earlier hooked forward may have left a context
    with pytest.raises(PluginContextError, match="calculate_log_probs=True"):
        compute_policy_loss_estr(old, lp, adv, mask, "token-mean", actor_config(), None)
    with estr_inputs(mu, None), pytest.raises(PluginContextError, match="no entropy"):
        compute_policy_loss_estr(old, lp, adv, mask, "token-mean", actor_config(), None)
    with estr_inputs(mu[:2], h[:2]), pytest.raises(PluginContextError, match="another micro-bat"):
        compute_policy_loss_estr(old, lp, adv, mask, "token-mean", actor_config(), None)
    # same shapes, keyed to another micro-batch's old_log_probs
    with estr_inputs(mu, h, old + 0.5), pytest.raises(PluginContextError, match="another micro"):
        compute_policy_loss_estr(old, lp, adv, mask, "token-mean", actor_config(), None)


def test_pack_padded_hand_case() -> None:
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    cu, packed = pack_padded(mask, logp_train=values)
    assert cu.tolist() == [0, 3, 3, 7]
    assert packed["logp_train"].tolist() == [0, 1, 2, 8, 9, 10, 11]
    assert packed["loss_mask"].tolist() == [1, 0, 1, 1, 1, 1, 1]


class DataProto:
    """Stand-in for verl's DataProto: `.batch` tensors and `.meta_info`."""

    def __init__(self, batch: dict[str, torch.Tensor], meta_info: dict[str, Any]) -> None:
        self.batch, self.meta_info = batch, meta_info


class StandInActor:
    """Follows DataParallelPPOActor.update_policy's call sequence (epochs → micro-batches →
    `_forward_micro_batch(model_inputs, temperature=…, calculate_entropy=…)` →
    `policy_loss_fn(old_log_prob=…, log_prob=…, …)`)."""

    def __init__(self, config: ActorConfig, micro: int) -> None:
        self.config, self.micro = config, micro

    def _forward_micro_batch(
        self, micro_batch: dict[str, torch.Tensor], temperature: float, calculate_entropy=False
    ) -> dict[str, torch.Tensor]:
        return {"log_probs": micro_batch["log_probs_now"], "entropys": micro_batch["entropy_now"]}

    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        metrics: dict[str, list[float]] = {}
        bs = data.batch["old_log_probs"].shape[0]
        for _ in range(self.config.ppo_epochs):
            for start in range(0, bs, self.micro):
                mb = {k: v[start : start + self.micro] for k, v in data.batch.items()}
                out = self._forward_micro_batch(mb, temperature=1.0, calculate_entropy=True)
                _, pg_metrics = compute_policy_loss_estr(
                    old_log_prob=mb["old_log_probs"],
                    log_prob=out["log_probs"],
                    advantages=mb["advantages"],
                    response_mask=mb["response_mask"],
                    loss_agg_mode="token-mean",
                    config=self.config,
                    rollout_is_weights=None,
                )
                for k, v in pg_metrics.items():
                    metrics.setdefault(k, []).append(v)
        return metrics


@pytest.mark.parametrize("epochs", [1, 2])
def test_actor_hooks_feed_the_loss_and_report_each_step_once(
    monkeypatch: pytest.MonkeyPatch, epochs: int
) -> None:
    cls = type("Actor", (StandInActor,), {})
    assert verl_hooks.install_actor_hooks(cls)
    tap = RecordingTap()
    monkeypatch.setenv("TIMWATCH_URL", "http://127.0.0.1:9")
    monkeypatch.setattr(verl_hooks, "_WORKER_BACKEND", TimwatchTracking(tap))
    old, lp, mu, h, adv, mask = verl_batch(5, bs=6, length=10)
    data = DataProto(
        {
            "old_log_probs": old,
            "log_probs_now": lp,
            "entropy_now": h,
            "rollout_log_probs": mu,
            "advantages": adv,
            "response_mask": mask,
        },
        {"global_steps": 17},
    )
    actor = cls(actor_config(ppo_epochs=epochs), micro=4)
    metrics = actor.update_policy(data)
    assert len(metrics["timwatch/estr_mask_ratio"]) == 2 * epochs
    assert len(tap.reports) == 1
    step, arrays = tap.reports[0]
    assert step == 17 and arrays.pop("batch_id") == "verl-s17-dp0"
    cu_ref, ref = pack_padded(mask, logp_rollout=mu, logp_train=old, entropy=h)
    assert arrays["cu_seqlens"].tolist() == cu_ref.tolist()
    for key in ("logp_rollout", "logp_train", "entropy", "loss_mask"):
        assert torch.equal(arrays[key], ref[key]), key
    # a process without TIMWATCH_URL: the hooks still feed the loss, nothing is reported
    monkeypatch.delenv("TIMWATCH_URL")
    monkeypatch.setattr(verl_hooks, "_WORKER_BACKEND", None)
    actor.update_policy(data)
    assert len(tap.reports) == 1


def test_register_with_verl_uses_verls_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    registry: dict[str, Any] = {}

    def register_policy_loss(name: str):
        def decorator(func):
            registry[name] = func
            return func

        return decorator

    core_algos = types.ModuleType("verl.trainer.ppo.core_algos")
    core_algos.POLICY_LOSS_REGISTRY = registry  # type: ignore[attr-defined]
    core_algos.register_policy_loss = register_policy_loss  # type: ignore[attr-defined]
    for name in ("verl", "verl.trainer", "verl.trainer.ppo"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(sys.modules["verl.trainer.ppo"], "core_algos", core_algos, raising=False)
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.core_algos", core_algos)
    monkeypatch.setenv("TIMWATCH_VERL_AUTOREGISTER", "0")  # imported first here: no side effect
    from timwatch.sidecar.integrations import verl as verl_plugin

    assert verl_plugin.register_with_verl(hook_actor=False)
    assert registry["estr"] is compute_policy_loss_estr


# ---------------------------------------------------------------- slime


def slime_micro_batch(seed: int, lengths: tuple[int, ...] = (5, 1, 9, 3)):
    """Per-sample 1-D tensors as slime's policy_loss_function hands them to the TIS function."""
    g = torch.Generator().manual_seed(seed)
    old = [-torch.rand(n, generator=g) * 3 for n in lengths]
    mu = [(o + torch.randn(o.shape, generator=g) * 0.6).clamp(max=0) for o in old]
    ent = [torch.rand(n, generator=g) ** 3 * 2 for n in lengths]
    masks = [(torch.rand(n, generator=g) > 0.2).to(torch.int32) for n in lengths]
    pg_loss = torch.randn(sum(lengths), generator=g).requires_grad_()
    return old, mu, ent, masks, pg_loss, list(lengths)


def fake_slime_loss_module(entropy: list[torch.Tensor]) -> types.ModuleType:
    module = types.ModuleType("slime.backends.megatron_utils.loss")

    def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, **kw):
        return torch.empty((0,)), {"log_probs": [e * 0 for e in entropy], "entropy": entropy}

    module.get_log_probs_and_entropy = get_log_probs_and_entropy  # type: ignore[attr-defined]
    return module


def test_slime_tis_function_applies_estr() -> None:
    old, mu, ent, masks, pg_loss, lengths = slime_micro_batch(0)
    module = fake_slime_loss_module(ent)
    assert slime_plugin.install_entropy_hook(None, module)
    assert slime_plugin.install_entropy_hook(None, module)  # idempotent
    slime_plugin.set_entropy(None)
    module.get_log_probs_and_entropy(
        torch.zeros(1, 18, 7), args=None, unconcat_tokens=[], total_lengths=[]
    )
    args = types.SimpleNamespace(context_parallel_size=1)
    out, new_masks, metrics = slime_plugin.estr_tis_function(
        args,
        pg_loss=pg_loss,
        train_log_probs=old,
        rollout_log_probs=mu,
        loss_masks=masks,
        total_lengths=[n + 7 for n in lengths],
        response_lengths=lengths,
    )
    o, m_, h = (torch.cat(x).double().numpy() for x in (old, mu, ent))
    keep = (o - m_) ** 2 <= 1.6 * (h + 0.01)
    assert 0 < keep.sum() < keep.size
    np.testing.assert_array_equal(out.detach().numpy(), np.where(keep, pg_loss.detach(), 0.0))
    assert [len(m) for m in new_masks] == lengths
    assert all(m.dtype == torch.int32 for m in new_masks)
    np.testing.assert_array_equal(torch.cat(new_masks).numpy(), torch.cat(masks).numpy() * keep)
    assert set(metrics) == {"estr_mask_ratio", "estr_score", "mismatch_kl", "tis"}
    assert all(v.shape == (sum(lengths),) and v.dtype == torch.float32 for v in metrics.values())
    np.testing.assert_array_equal(metrics["estr_mask_ratio"].numpy(), (~keep).astype(np.float32))
    np.testing.assert_allclose(
        metrics["mismatch_kl"].numpy(), np.expm1(o - m_) - (o - m_), rtol=1e-5
    )
    out.sum().backward()
    assert pg_loss.grad is not None
    np.testing.assert_array_equal(pg_loss.grad.numpy(), keep.astype(np.float32))


def test_slime_tau_from_args_and_errors() -> None:
    old, mu, ent, masks, pg_loss, lengths = slime_micro_batch(1)
    kwargs: dict[str, Any] = dict(
        pg_loss=pg_loss,
        train_log_probs=old,
        rollout_log_probs=mu,
        loss_masks=masks,
        total_lengths=lengths,
        response_lengths=lengths,
    )
    slime_plugin.set_entropy(ent)
    _, _, loose = slime_plugin.estr_tis_function(types.SimpleNamespace(estr_tau=1e6), **kwargs)
    assert loose["estr_mask_ratio"].sum().item() == 0.0
    slime_plugin.set_entropy(ent)
    _, _, tight = slime_plugin.estr_tis_function(types.SimpleNamespace(estr_tau=1e-9), **kwargs)
    assert tight["estr_mask_ratio"].sum().item() > 0
    # the entropies were consumed: a second call on them (a stale context) refuses
    with pytest.raises(PluginContextError, match="no entropy.*install_entropy_hook"):
        slime_plugin.estr_tis_function(types.SimpleNamespace(), **kwargs)
    slime_plugin.set_entropy(ent)
    cp_kwargs = dict(kwargs, train_log_probs=[t[: math.ceil(len(t) / 2)] for t in old])
    with pytest.raises(PluginContextError, match=r"train_log_probs\[0\] has 3 tok.*context para"):
        slime_plugin.estr_tis_function(types.SimpleNamespace(context_parallel_size=2), **cp_kwargs)
    # another micro-batch's entropies (other lengths) are refused too
    slime_plugin.set_entropy(slime_micro_batch(2, lengths=(4, 2, 9, 3))[2])
    with pytest.raises(PluginContextError, match=r"entropy\[0\] has 4 tokens"):
        slime_plugin.estr_tis_function(types.SimpleNamespace(), **kwargs)
