"""The AReaL plug-in inside real AReaL 1.0.4 (PyPI, installed by scripts/test.sh with `--no-deps`
plus the packages its imports need, tests/requirements-areal.txt).

The actor update runs through AReaL's own `PPOActor`, `grpo_loss_fn`, `ppo_actor_loss_fn` and
data helpers on CPU; tests/helpers/areal_tiny.py says what is written here instead of AReaL's
`FSDPEngine` (the model, its optimizer and the one-process layout).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers import areal_tiny as at
from tests.helpers.frameworks import RaisingTap, RecordingTap, plugin_loader, require_package
from tests.helpers.verl_tiny import TinyModel

require_package("areal")
# the AReaL plug-in, imported (with AReaL) before the first test
plugin: Any = None
_plugin_loaded = plugin_loader("timwatch.sidecar.integrations.areal")

# a real trainer package: the full suite and CI run it, the quick tier does not
pytestmark = pytest.mark.framework


@pytest.fixture
def tap(monkeypatch: pytest.MonkeyPatch) -> RecordingTap:
    assert plugin.install()
    rec = RecordingTap()
    monkeypatch.setattr(plugin, "_COLLECTOR", plugin.AReaLCollector(rec))
    return rec


def test_hooks_are_installed_on_arealss_actor_module() -> None:
    from areal.trainer.ppo import actor as areal_actor

    assert plugin.install() and plugin.install()  # idempotent
    assert getattr(areal_actor.grpo_loss_fn, "_timwatch_hooked", False)
    assert getattr(areal_actor.PPOActor, "_timwatch_hooked", False)


def test_one_report_per_step_with_every_token_once(tap: RecordingTap) -> None:
    model = TinyModel(0)
    engine = at.TinyEngine(model, n_mbs=2, version=7)
    batch = at.rollout_batch(1, model, n=5)
    want = at.expected_tokens(batch, model)
    at.update(at.actor(engine), batch)
    assert engine.loss_calls == 2  # two micro-batches, one report
    [(step, arrays)] = tap.reports
    assert step == 7  # AReaL's global step: the engine's version during ppo_update
    assert arrays["batch_id"] == "areal-s7-dp0"
    got = at.reported_tokens(arrays)
    assert sum(map(len, got)) == sum(map(len, want)) == int(batch["loss_mask"].sum())
    # AReaL may reorder sequences between micro-batches: compare each sequence's tokens
    key = lambda seq: tuple(round(x[0], 4) for x in seq)  # noqa: E731
    for g, w in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        assert torch.allclose(torch.tensor(g), torch.tensor(w, dtype=torch.float64), atol=2e-6)
    # the packed layout is well formed: cu_seqlens covers every array
    cu = arrays["cu_seqlens"]
    assert cu.dtype == torch.int64 and int(cu[0]) == 0
    for name in ("logp_rollout", "logp_train", "entropy", "loss_mask"):
        assert arrays[name].shape == (int(cu[-1]),), name


@pytest.mark.parametrize(
    "config",
    [
        {"use_decoupled_loss": False, "recompute_logprob": True},  # AReaL overwrites logprobs
        {"use_decoupled_loss": True, "ppo_n_minibatches": 2},  # two optimizer steps
    ],
    ids=["coupled-recompute", "two-minibatches"],
)
def test_mu_is_the_rollouts_in_every_mode(tap: RecordingTap, config: dict[str, Any]) -> None:
    """With the decoupled loss off AReaL replaces `logprobs` by π_old before the loss; the
    reported μ is still the engine's. Two mini-batches: every token still reported once."""
    model = TinyModel(0)
    batch = at.rollout_batch(2, model, n=6)
    want = at.expected_tokens(batch, model)
    at.update(at.actor(at.TinyEngine(model), **config), batch)
    [(_, arrays)] = tap.reports
    got = at.reported_tokens(arrays)
    key = lambda seq: tuple(round(x[0], 4) for x in seq)  # noqa: E731
    for g, w in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        g_t, w_t = torch.tensor(g), torch.tensor(w, dtype=torch.float64)
        assert torch.allclose(g_t[:, :2], w_t[:, :2], atol=2e-6)  # μ and π_old
    assert not all(abs(m - p) < 1e-3 for seq in got for m, p, _ in seq)  # μ is not π_old


def test_steps_follow_the_engine_version(tap: RecordingTap) -> None:
    model = TinyModel(0)
    engine = at.TinyEngine(model)
    act = at.actor(engine)
    for step in range(3):  # PPOTrainer.train: ppo_update, then set_version(global_step + 1)
        at.update(act, at.rollout_batch(10 + step, model))
        engine.set_version(step + 1)
    assert [s for s, _ in tap.reports] == [0, 1, 2]


def test_no_collector_leaves_arealss_loss_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plugin.install()
    monkeypatch.setattr(plugin, "_COLLECTOR", None)
    monkeypatch.delenv("TIMWATCH_URL", raising=False)
    grads = []
    for hooked in (True, False):
        model = TinyModel(0)
        if not hooked:
            from areal.trainer.ppo import actor as areal_actor

            monkeypatch.setattr(areal_actor, "grpo_loss_fn", areal_actor.grpo_loss_fn.__wrapped__)
        at.update(at.actor(at.TinyEngine(model)), at.rollout_batch(3, TinyModel(0)))
        grads.append(model.table.detach().clone())
    assert torch.equal(grads[0], grads[1])


def _update_table(estr: bool, monkeypatch: pytest.MonkeyPatch, tau: float) -> torch.Tensor:
    monkeypatch.setenv("TIMWATCH_ESTR_TAU", str(tau))
    monkeypatch.setattr(plugin, "_COLLECTOR", plugin.AReaLCollector(RecordingTap(), estr=estr))
    model = TinyModel(0)
    at.update(at.actor(at.TinyEngine(model, n_mbs=1)), at.rollout_batch(4, TinyModel(0), n=6))
    return model.table.detach().clone()


def test_estr_zeroes_exactly_the_rejected_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """ESTR in AReaL's loss equals AReaL's loss on a batch whose rejected tokens have advantage
    0 (they add nothing, and the denominator keeps them); a huge τ rejects nothing."""
    assert plugin.install()
    batch = at.rollout_batch(4, TinyModel(0), n=6)
    want = at.expected_tokens(batch, TinyModel(0))
    tau = 0.05
    rejected = [(p - m) ** 2 > tau * (h + 0.01) for seq in want for m, p, h in seq]
    assert 0 < sum(rejected) < len(rejected)  # the case tests something
    assert torch.equal(
        _update_table(True, monkeypatch, 1e9), _update_table(False, monkeypatch, 1e9)
    )
    assert not torch.equal(
        _update_table(True, monkeypatch, tau), _update_table(False, monkeypatch, tau)
    )
    # the same update by hand: AReaL's own loss with those advantages zeroed
    from areal.trainer.ppo import actor as areal_actor

    original = areal_actor.grpo_loss_fn.__wrapped__

    def zeroing(logprobs: Any, entropy: Any, input_data: dict, **kw: Any) -> Any:
        d = (input_data["prox_logp"] - input_data[plugin.MU_KEY]).double()
        reject = (d * d > tau * (entropy.detach().double() + 0.01)) & input_data["loss_mask"].bool()
        data = dict(input_data)
        data["advantages"] = torch.where(reject, 0.0, input_data["advantages"])
        return original(logprobs, entropy, data, **kw)

    from areal.utils import stats_tracker

    stats_tracker.export_all()  # drop what earlier updates left
    estr_table = _update_table(True, monkeypatch, tau)
    ratio = stats_tracker.export_all()["ppo_actor/update/estr_mask_ratio/avg"]
    assert ratio == pytest.approx(sum(rejected) / len(rejected), abs=1e-6)

    monkeypatch.setattr(plugin, "_COLLECTOR", plugin.AReaLCollector(RecordingTap()))  # μ kept
    monkeypatch.setattr(areal_actor, "grpo_loss_fn", zeroing)
    model = TinyModel(0)
    at.update(at.actor(at.TinyEngine(model, n_mbs=1)), at.rollout_batch(4, TinyModel(0), n=6))
    assert torch.allclose(model.table, estr_table, atol=1e-6)


def test_a_failing_tap_never_breaks_the_update(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plugin.install()
    monkeypatch.setattr(plugin, "_COLLECTOR", plugin.AReaLCollector(RaisingTap(OSError("down"))))
    model = TinyModel(0)
    before = model.table.detach().clone()
    at.update(at.actor(at.TinyEngine(model)), at.rollout_batch(5, TinyModel(0)))
    assert not torch.equal(model.table, before)  # the step was taken
