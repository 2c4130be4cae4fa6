"""A SkyRL run killed after a checkpoint and resumed, reporting through the plug-in's hooks and a
real `Tap` to a real `timwatch serve`: every step is in the history under SkyRL's own step
number, with one attempt's tokens, never none and never two.

SkyRL's own code runs `RayPPOTrainer.load_checkpoints` (reads `latest_ckpt_global_step.txt`,
checks the folder, loads `trainer_state.pt` and hands the policy folder to the dispatch),
`train_critic_and_policy` and the policy worker (tests/helpers/skyrl_tiny.py). `fit` below follows
the order of `RayPPOTrainer.train` (load the checkpoint, `global_step += 1`, train, save every
`ckpt_interval` steps), which cannot run without Ray workers and an inference engine; its
checkpoint is the tiny model's weights in SkyRL's folder layout.

And the guard through the plug-in: with TIMWATCH_ON_PAGE=raise, the policy worker's
`forward_backward` raises `RunPaged` at the step after the service pages the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import skyrl_tiny as st
from tests.helpers.frameworks import guarded_env, plugin_loader, require_package, stopped_by_page
from tests.helpers.procs import SHARED_TOKEN, ServerProc
from tests.helpers.reference import reference
from tests.helpers.wire import fresh_run

# a real trainer package: the full suite and CI run it, the quick tier does not
pytestmark = pytest.mark.framework

require_package("skyrl")
# the SkyRL plug-in, imported (with SkyRL) before the first test
plugin: Any = None
_plugin_loaded = plugin_loader("timwatch.sidecar.integrations.skyrl", st.import_skyrl)

SAVE_FREQ = 3


class CheckpointedDispatch(st.LocalDispatch):
    """The dispatch's checkpoint calls, on the tiny model's weights."""

    def __init__(self, workers: list[Any], model: st.TinyPolicy) -> None:
        super().__init__(workers)
        self.model = model

    def save(self, root: Path, step: int) -> None:
        folder = root / f"global_step_{step}"
        (folder / "policy").mkdir(parents=True)
        torch.save(self.model.state_dict(), folder / "policy" / "model.pt")
        torch.save({"global_step": step}, folder / "trainer_state.pt")
        (root / "latest_ckpt_global_step.txt").write_text(str(step))

    def load_checkpoint(self, model: str, path: str, **kwargs: Any) -> None:
        self.model.load_state_dict(torch.load(Path(path) / "model.pt"))


class NoDataloader:
    def load_state_dict(self, state: Any) -> None:
        raise AssertionError("no data.pt is written here")


def fit(root: Path, attempt: int, last_step: int) -> dict[int, Any]:
    """One trainer process: resume if a checkpoint exists, run to `last_step`; the batches used."""
    from skyrl.train.trainer import RayPPOTrainer
    from skyrl.train.utils.trainer_utils import ResumeMode

    model = st.TinyPolicy(0)
    cfg = st.trainer_config()
    cfg.ckpt_path = str(root)
    cfg.ckpt_interval = SAVE_FREQ
    dispatch = CheckpointedDispatch([st.make_worker(model, cfg)], model)
    trainer = st.stub_trainer(cfg, dispatch, 0)
    trainer.resume_mode = ResumeMode.LATEST
    trainer.train_dataloader = NoDataloader()
    trainer.global_step, _ = RayPPOTrainer.load_checkpoints(trainer)  # SkyRL's own
    trainer.global_step += 1
    used = {}
    while trainer.global_step <= last_step:
        step = trainer.global_step
        used[step] = st.rollout_batch(100 * attempt + step, model)
        RayPPOTrainer.train_critic_and_policy(trainer, used[step])
        if step % SAVE_FREQ == 0:
            dispatch.save(root, step)
        trainer.global_step += 1
    return used


def expected_row(batch: Any) -> dict[str, Any]:
    return reference(st.packed_reference(batch))[0]  # entropy 0: tokens and KL do not read H


def test_resumed_run_keeps_every_steps_tokens_once(
    shared_server: ServerProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = fresh_run("skyrl-resume")
    assert plugin.register_with_skyrl()
    st.cpu_device_patches(monkeypatch)
    monkeypatch.setenv("TIMWATCH_URL", shared_server.url)
    monkeypatch.setenv("TIMWATCH_RUN", run)
    monkeypatch.setenv("TIMWATCH_TOKEN", SHARED_TOKEN)
    taps, batches = [], {}
    for attempt, last_step in ((1, 5), (2, 7)):  # killed after step 5; resumed from step 3
        monkeypatch.setattr(plugin, "_TAP", None)  # a new process
        used = fit(tmp_path, attempt, last_step)
        tap = plugin.worker_tap()
        taps.append(tap)
        assert tap.close(30, finish=False)
        for step, batch in used.items():
            batches.setdefault(step, batch)  # the monitor keeps a step's first report
    first, resumed = (t.stats() for t in taps)
    assert (first["sent"], first["refused"]) == (10, 0)  # steps 1-5, two mini-batches each
    # steps 4 and 5 again, with other data: the same batch ids, refused as conflicts (409)
    assert (resumed["sent"], resumed["refused"]) == (4, 4)
    with shared_server.client() as c:
        res = c.get(f"/v1/runs/{run}/metrics", params={"names": "tokens,mismatch_kl"}).json()
    assert res["steps"] == [1, 2, 3, 4, 5, 6, 7]  # none renumbered, none doubled
    for i, step in enumerate(res["steps"]):
        want = expected_row(batches[step])
        assert res["series"]["tokens"][i] == want["tokens"], step
        assert res["series"]["mismatch_kl"][i] == pytest.approx(want["mismatch_kl"], rel=1e-9)
    assert np.all(np.diff(res["steps"]) == 1)


def test_skyrls_logged_scalars_reach_the_history_once_across_a_resume(
    shared_server: ServerProc,
) -> None:
    """SkyRL's `_fire("on_log", ...)` with the callback and a real `Tap`: the step's numbers are
    stored under SkyRL's step, mapped by the bridge's SkyRL names; a resumed trainer re-logging a
    step overwrites it, never adds to it."""
    from skyrl.train.trainer import RayPPOTrainer
    from skyrl.train.utils.callbacks import CallbackHandler, TrainingControl

    from timwatch.sidecar.tap import Tap

    run = fresh_run("skyrl-scalars")

    def trainer_with(tap: Tap) -> Any:
        trainer = object.__new__(RayPPOTrainer)
        trainer._current_epoch, trainer.train_dataloader, trainer.total_training_steps = 0, None, 9
        trainer._callback_handler = CallbackHandler([plugin.timwatch_callback(tap)])
        trainer._training_control = TrainingControl()
        return trainer

    def logs(step: int, attempt: int) -> dict[str, Any]:
        return {
            "policy/rollout_train_logprobs_abs_diff_mean": 0.01 * step + 0.005 * (attempt - 1),
            "policy/rollout_train_logprobs_abs_diff_max": torch.tensor(0.1 * step),
            "loss/avg_final_rewards": np.float64(0.5),
            "reward/avg_raw_reward": 0.25,  # before shaping: kept, unmapped
            "policy/grad_norm": 2.0 + step,
            "policy/policy_entropy": 1.5,
            "policy/policy_lr": 1e-6,
            "policy/policy_loss": -0.1,
            "policy/loss_metrics/clip_ratio": 0.02,
        }

    for attempt, steps in ((1, (1, 2, 3)), (2, (3, 4))):  # resumed from its step-2 checkpoint
        tap = Tap(shared_server.url, run, SHARED_TOKEN, finish=False)
        trainer = trainer_with(tap)
        for step in steps:
            trainer.global_step = step
            trainer._fire("on_log", logs=logs(step, attempt))
        assert tap.close(30)
        assert tap.stats()["sent"] == len(steps)
    with shared_server.client() as c:
        hist = c.get(f"/v1/runs/{run}/scalars/series").json()
    assert hist["steps"] == [1, 2, 3, 4]
    # step 3 as the resumed attempt recomputed it, step 4 only from it
    assert hist["scalars"]["log_ratio_abs_mean"] == pytest.approx([0.01, 0.02, 0.035, 0.045])
    assert hist["scalars"]["log_ratio_abs_max"] == pytest.approx([0.1, 0.2, 0.3, 0.4], rel=1e-6)
    assert hist["scalars"]["reward_mean"] == [0.5] * 4
    assert hist["scalars"]["grad_norm"] == [3.0, 4.0, 5.0, 6.0]
    assert hist["scalars"]["entropy"] == [1.5] * 4
    assert hist["scalars"]["learning_rate"] == [1e-6] * 4
    assert hist["scalars"]["loss"] == [-0.1] * 4
    assert hist["scalars"]["clip_fraction"] == [0.02] * 4
    assert set(hist["sources"].values()) == {"skyrl"}


def test_a_paged_run_stops_at_the_step_after_its_page(
    shared_server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TIMWATCH_ON_PAGE=raise reaches the plug-in's tap, and its `RunPaged` leaves SkyRL's
    `train_critic_and_policy` through the worker's `forward_backward` (the plug-in logs and
    swallows every other tap failure): the run stops at the step after the page, with that
    step's batch kept. One mini-batch per step: one report, one guard check."""
    from skyrl.train.trainer import RayPPOTrainer

    run = fresh_run("skyrl-guard")
    assert plugin.register_with_skyrl()
    st.cpu_device_patches(monkeypatch)
    guarded_env(monkeypatch, shared_server.url, run, SHARED_TOKEN)
    monkeypatch.setattr(plugin, "_TAP", None)  # a new process
    model = st.TinyPolicy(0)
    cfg = st.trainer_config()
    trainer = st.stub_trainer(cfg, st.LocalDispatch([st.make_worker(model, cfg)]), 0)

    def step(i: int) -> None:  # RayPPOTrainer.train: global_step from 1
        trainer.global_step = i + 1
        batch = st.rollout_batch(i, model, bs=2)  # one mini-batch of 2 rows
        RayPPOTrainer.train_critic_and_policy(trainer, batch)

    try:
        stopped, err = stopped_by_page(
            shared_server.url, SHARED_TOKEN, run, step, plugin.worker_tap
        )
    finally:
        assert plugin.worker_tap().close(30, finish=False)
    assert stopped == 4 and err.run == run and err.alerts == ("TimwatchMismatchKLRising",)
    with shared_server.client() as c:
        res = c.get(f"/v1/runs/{run}/metrics", params={"names": "tokens"}).json()
    assert res["steps"] == [1, 2, 3, 4, 5]  # SkyRL's global steps; the stopping one kept
