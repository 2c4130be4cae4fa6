"""The SkyRL plug-in inside real skyrl 0.3.0 (PyPI, installed by scripts/test.sh with `--no-deps`
plus the packages its imports need, tests/requirements-skyrl.txt).

The policy update runs through SkyRL's own trainer, worker and loss code on CPU with a tiny model
(tests/helpers/skyrl_tiny.py says exactly what is written here instead of SkyRL's: the model, the
strategy, the Ray dispatch, and the Python 3.11 import stand-in).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import skyrl_tiny as st
from tests.helpers.frameworks import RaisingTap, RecordingTap, plugin_loader, require_package
from timwatch.monitor.core.errors import PluginContextError, RunPaged, TimwatchError
from timwatch.sidecar.integrations import skyrl_loss

# a real trainer package: the full suite and CI run it, the quick tier does not
pytestmark = pytest.mark.framework

require_package("skyrl")
# the SkyRL plug-in, imported (with SkyRL) before the first test
plugin: Any = None
_plugin_loaded = plugin_loader("timwatch.sidecar.integrations.skyrl", st.import_skyrl)


@pytest.fixture
def tap(monkeypatch: pytest.MonkeyPatch) -> RecordingTap:
    assert plugin.register_with_skyrl()
    st.cpu_device_patches(monkeypatch)
    rec = RecordingTap()
    monkeypatch.setenv("TIMWATCH_URL", "http://127.0.0.1:9")  # the recording tap replaces it
    monkeypatch.setattr(plugin, "_TAP", rec)
    return rec


def train(
    model: st.TinyPolicy, batch: Any, *, step: int, loss: str = "estr", sp: int = 1, **algo: Any
) -> tuple[dict[str, float], Any]:
    from skyrl.train.trainer import RayPPOTrainer

    epochs = algo.pop("epochs", 1)
    cfg = st.trainer_config(loss, **algo)
    cfg.update_epochs_per_batch = epochs
    workers = [st.make_worker(model, cfg, sp=r) for r in range(sp)]
    trainer = st.stub_trainer(cfg, st.LocalDispatch(workers), step)
    return RayPPOTrainer.train_critic_and_policy(trainer, batch), trainer


def rows(batch: Any, start: int, end: int) -> Any:
    part = batch[start:end]
    return part


def test_estr_is_in_skyrls_registry() -> None:
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    assert plugin.register_with_skyrl()
    assert PolicyLossRegistry.get("estr") is plugin.estr_policy_loss


def test_the_registered_loss_installs_the_hooks_where_it_is_unpickled() -> None:
    """What SkyRL's registry does for a Ray worker: the cloudpickled `estr` loss, loaded in a
    fresh process, imports the entry module there, which hooks the policy worker."""
    import subprocess
    import sys

    import cloudpickle

    from tests.helpers.procs import REPO

    blob = cloudpickle.dumps(plugin.estr_policy_loss)
    code = (
        "import pickle, sys\n"
        "from tests.helpers import skyrl_tiny\n"
        "skyrl_tiny.import_skyrl()\n"
        "from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase as W\n"
        "assert not getattr(W, '_timwatch_hooked', False)\n"
        "f = pickle.loads(sys.stdin.buffer.read())\n"
        "assert W._timwatch_hooked and f.__module__ == 'timwatch.sidecar.integrations.skyrl'\n"
        "print('hooked')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMWATCH_")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        cwd=REPO,
        env=env,
        input=blob,
        capture_output=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert out.stdout.decode().strip().endswith("hooked")


def test_update_reports_skyrls_step_with_the_trainers_tokens(tap: RecordingTap) -> None:
    model = st.TinyPolicy(0)
    before = model.table.detach().clone()
    batch = st.rollout_batch(1, model)
    h0 = st.packed_reference(rows(batch, 0, 2), model)["entropy"]  # mini-batch 0, before
    metrics, trainer = train(model, batch, step=7)
    assert not torch.equal(model.table.detach(), before)  # real optimizer steps happened
    assert [(s, a["batch_id"]) for s, a in tap.reports] == [
        (7, "skyrl-s7-dp0-m0"),
        (7, "skyrl-s7-dp0-m1"),
    ]
    for (_, arrays), (a, b) in zip(tap.reports, [(0, 2), (2, 4)], strict=True):
        ref = st.packed_reference(rows(batch, a, b))
        for key in ("cu_seqlens", "loss_mask"):
            np.testing.assert_array_equal(arrays[key].numpy(), ref[key], err_msg=key)
        for key in ("logp_rollout", "logp_train"):
            np.testing.assert_allclose(arrays[key].numpy(), ref[key], rtol=1e-6, err_msg=key)
    assert tap.reports[0][1]["loss_mask"].tolist().count(0) == 1  # the hole inside row 1
    np.testing.assert_allclose(tap.reports[0][1]["entropy"].numpy(), h0, rtol=1e-5)
    # the loss's metrics reach SkyRL's own metrics under policy/
    assert "policy/loss_metrics/estr_mask_ratio" in trainer.all_metrics
    assert metrics["loss_metrics/mismatch_kl"] > 0


def test_estr_mask_ratio_matches_a_float64_reference(tap: RecordingTap) -> None:
    model = st.TinyPolicy(2)
    batch = st.rollout_batch(3, model, bs=2, noise=2.0)  # one mini-batch, one micro-batch
    ref = st.packed_reference(batch, model)
    metrics, _ = train(model, batch, step=1)
    m = ref["loss_mask"] == 1
    delta = ref["logp_train"] - ref["logp_rollout"]
    rejected = delta**2 > 1.6 * (ref["entropy"] + 0.01)
    want = rejected[m].mean()
    assert 0 < rejected[m].sum() < m.sum()  # the case rejects some tokens and keeps others
    assert metrics["loss_metrics/estr_mask_ratio"] == pytest.approx(want, rel=1e-9)
    k3 = np.expm1(delta) - delta
    assert metrics["loss_metrics/mismatch_kl"] == pytest.approx(k3[m].mean(), rel=1e-5)


def test_estr_at_infinite_tau_equals_skyrls_regular(
    tap: RecordingTap, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIMWATCH_ESTR_TAU", "1e30")
    runs = {}
    for loss in ("regular", "estr"):
        model = st.TinyPolicy(3)
        metrics, _ = train(model, st.rollout_batch(4, model, noise=2.0), step=1, loss=loss)
        runs[loss] = (model.table.detach().clone(), metrics["policy_loss"])
    assert torch.equal(runs["regular"][0], runs["estr"][0])  # the same weights, to 0.0
    assert runs["regular"][1] == runs["estr"][1]


def test_regular_loss_still_reports_per_token(tap: RecordingTap) -> None:
    model = st.TinyPolicy(4)
    train(model, st.rollout_batch(5, model), step=3, loss="regular")
    assert [a["batch_id"] for _, a in tap.reports] == ["skyrl-s3-dp0-m0", "skyrl-s3-dp0-m1"]


def test_later_epochs_and_other_sp_ranks_report_nothing_more(tap: RecordingTap) -> None:
    model = st.TinyPolicy(5)
    train(model, st.rollout_batch(6, model), step=2, sp=2, epochs=3)
    assert [a["batch_id"] for _, a in tap.reports] == ["skyrl-s2-dp0-m0", "skyrl-s2-dp0-m1"]


def test_mini_batch_without_skyrls_step_reports_nothing(
    tap: RecordingTap, caplog: pytest.LogCaptureFixture
) -> None:
    model = st.TinyPolicy(7)
    worker = st.make_worker(model, st.trainer_config())
    with caplog.at_level(logging.ERROR):
        worker.forward_backward(rows(st.rollout_batch(8, model), 0, 2))
    assert tap.reports == []
    assert "carries no 'global_step'" in caplog.text


def test_entropy_of_another_forward_is_refused() -> None:
    g = torch.Generator().manual_seed(0)
    lp_a, lp_b = -torch.rand(2, 5, generator=g), -torch.rand(2, 5, generator=g)
    mu, h = -torch.rand(2, 5, generator=g), torch.rand(2, 5, generator=g)
    cfg = st.trainer_config().algorithm
    adv, mask = torch.ones(2, 5), torch.ones(2, 5)
    skyrl_loss.set_entropy(lp_a, h)
    with pytest.raises(PluginContextError, match="another forward") as e:
        skyrl_loss.compute_policy_loss_estr(lp_b, lp_b, adv, cfg, mask, mu)
    assert isinstance(e.value, TimwatchError)
    skyrl_loss.clear_entropy()
    with pytest.raises(PluginContextError, match="no entropy"):
        skyrl_loss.compute_policy_loss_estr(lp_a, lp_a, adv, cfg, mask, mu)
    skyrl_loss.set_entropy(lp_a, h)
    loss, _ = skyrl_loss.compute_policy_loss_estr(lp_a, lp_a, adv, cfg, mask, mu)
    assert torch.isfinite(loss)


class RecordingLog:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, Any], str | None]] = []

    def log(self, step: int, scalars: dict[str, Any], *, source: str | None = None) -> bool:
        self.logged.append((step, scalars, source))
        return True


def test_callback_sends_skyrls_logged_numbers_under_its_step() -> None:
    """SkyRL's own `_fire("on_log", logs=...)` through its `CallbackHandler`, as its training loop
    calls it before committing the step's metrics to its tracker."""
    from skyrl.train.trainer import RayPPOTrainer
    from skyrl.train.utils.callbacks import CallbackHandler, TrainingControl

    rec = RecordingLog()
    trainer = object.__new__(RayPPOTrainer)
    trainer.global_step, trainer._current_epoch = 12, 0
    trainer.train_dataloader, trainer.total_training_steps = None, 40
    trainer._callback_handler = CallbackHandler([plugin.timwatch_callback(rec)])
    trainer._training_control = TrainingControl()
    logs = {
        "policy/rollout_train_logprobs_abs_diff_mean": 0.02,
        "policy/grad_norm": torch.tensor(0.5),
        "loss/avg_final_rewards": np.float64(0.25),
        "trainer/epoch": 0,
        "generate/samples": "a table",  # not a number: stays out
        "policy/flag": True,
    }
    trainer._fire("on_log", logs=logs)
    assert len(rec.logged) == 1
    step, sent, source = rec.logged[0]
    assert (step, source) == (12, "skyrl")
    assert sorted(sent) == [
        "loss/avg_final_rewards",
        "policy/grad_norm",
        "policy/rollout_train_logprobs_abs_diff_mean",
        "trainer/epoch",
    ]


def test_a_failing_tap_never_breaks_the_update(
    tap: RecordingTap, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = RaisingTap(OSError("monitor down"))
    monkeypatch.setattr(plugin, "_TAP", failing)
    model = st.TinyPolicy(0)
    before = model.table.detach().clone()
    train(model, st.rollout_batch(1, model), step=7)
    assert failing.calls == 2  # each mini-batch reported, failed, logged
    assert not torch.equal(model.table.detach(), before)  # the update was taken


def test_callback_lets_the_guards_stop_through() -> None:
    """A tap whose guard has seen the ``Timwatch-Page`` header, with ``on_page="raise"``:
    `RunPaged` leaves SkyRL's `_fire("on_log", ...)` (after the numbers are queued)."""
    from skyrl.train.trainer import RayPPOTrainer
    from skyrl.train.utils.callbacks import CallbackHandler, TrainingControl

    from timwatch.sidecar.tap import Tap

    tap = Tap("http://127.0.0.1:9", "paged", on_page="raise", finish=False, max_retries=0)
    tap._guard.observe({"timwatch-page": "firing; alerts=TimwatchMismatchKLRising"})
    trainer = object.__new__(RayPPOTrainer)
    trainer.global_step, trainer._current_epoch = 5, 0
    trainer.train_dataloader, trainer.total_training_steps = None, 40
    trainer._callback_handler = CallbackHandler([plugin.timwatch_callback(tap)])
    trainer._training_control = TrainingControl()
    try:
        with pytest.raises(RunPaged) as err:
            trainer._fire("on_log", logs={"policy/grad_norm": 0.5})
    finally:
        tap.close(0)
    assert err.value.run == "paged" and tap.stats()["reported"] == 1
