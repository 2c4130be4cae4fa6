"""A verl run with critic warm-up, killed after a checkpoint and resumed, reporting through the
plug-in's hooks and a real `Tap` to a real `timwatch serve`: every actor step is in the history
under verl's own step number, with one attempt's tokens, never none and never two.

verl's own code runs the driver's `_update_actor` and `_load_checkpoint` (which reads the
checkpoint tracker file and sets `global_steps`), the worker, engine and loss
(tests/helpers/verl_tiny.py). `fit` below follows the order of `RayPPOTrainer.fit` (load the
checkpoint, `global_steps += 1`, skip the actor while `critic_warmup > global_steps`, save every
`save_freq` steps), which cannot run without Ray workers and a rollout engine; its checkpoint is
the tiny model's weights in verl's folder layout (`global_step_{n}/actor`, tracker file
`latest_checkpointed_iteration.txt`).

And the guard through the plug-in: with TIMWATCH_ON_PAGE=raise, the worker's update raises
`RunPaged` out of the driver's `_update_actor` at the step after the service pages the run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

if os.environ.get("CI") or os.environ.get("TIMWATCH_REQUIRE_VERL"):
    import verl  # noqa: F401  # CI installs it: a missing verl fails, it does not skip
else:
    pytest.importorskip("verl")

from tests.helpers import verl_tiny as vt
from tests.helpers.frameworks import guarded_env, stopped_by_page
from tests.helpers.procs import SHARED_TOKEN, ServerProc
from tests.helpers.reference import reference
from tests.helpers.wire import fresh_run
from timwatch.sidecar.integrations import verl as plugin
from timwatch.sidecar.integrations import verl_hooks

# a real trainer package: the full suite and CI run it, the quick tier does not
pytestmark = pytest.mark.framework

CRITIC_WARMUP, SAVE_FREQ = 2, 3


class CheckpointedGroup(vt.LocalActorGroup):
    """The actor worker group's checkpoint calls, on the tiny model's weights."""

    def __init__(self, workers: list[Any], model: vt.TinyModel) -> None:
        super().__init__(workers)
        self.model = model

    def save(self, root: Path, step: int) -> None:
        actor = root / f"global_step_{step}" / "actor"
        actor.mkdir(parents=True)
        torch.save(self.model.state_dict(), actor / "model.pt")
        (root / "latest_checkpointed_iteration.txt").write_text(str(step))

    def load_checkpoint(self, path: str, del_local_after_load: bool = False) -> None:
        self.model.load_state_dict(torch.load(Path(path) / "model.pt"))


def fit(root: Path, attempt: int, last_step: int) -> dict[int, Any]:
    """One trainer process: resume if a checkpoint exists, run to `last_step`; the batches used."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    model = vt.TinyModel(0)
    group = CheckpointedGroup([vt.make_worker(vt.tiny_engine(model), vt.actor_config())], model)
    config = vt.trainer_config()
    config.trainer = OmegaConf.create(
        {
            "resume_mode": "auto",
            "default_hdfs_dir": None,
            "default_local_dir": str(root),
            "del_local_ckpt_after_load": False,
        }
    )
    trainer = vt.stub_trainer(config, group, 0)
    trainer.use_critic = False
    RayPPOTrainer._load_checkpoint(trainer)  # verl's: global_steps from the checkpoint
    trainer.global_steps += 1
    used = {}
    while trainer.global_steps <= last_step:
        step = trainer.global_steps
        if not CRITIC_WARMUP > step:
            used[step] = vt.rollout_batch(100 * attempt + step, model)
            RayPPOTrainer._update_actor(trainer, used[step])
        if step % SAVE_FREQ == 0:
            group.save(root, step)
        trainer.global_steps += 1
    return used


def expected_row(batch: Any) -> dict[str, Any]:
    arrays = vt.packed_reference(batch)
    arrays["entropy"] = np.zeros_like(arrays["logp_train"])  # tokens and KL do not read H
    return reference(arrays)[0]


def test_resumed_run_keeps_every_steps_tokens_once(
    shared_server: ServerProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = fresh_run("verl-resume")
    assert plugin.register_with_verl()
    vt.cpu_device_patches(monkeypatch)
    monkeypatch.setenv("TIMWATCH_URL", shared_server.url)
    monkeypatch.setenv("TIMWATCH_RUN", run)
    monkeypatch.setenv("TIMWATCH_TOKEN", SHARED_TOKEN)
    taps = []
    with vt.gloo_world():
        batches: dict[int, Any] = {}
        for attempt, last_step in ((1, 5), (2, 7)):  # killed after step 5; resumed from step 3
            monkeypatch.setattr(verl_hooks, "_WORKER_BACKEND", None)  # a new process
            used = fit(tmp_path, attempt, last_step)
            backend = verl_hooks.worker_backend()
            assert backend is not None
            taps.append(backend.tap)
            assert backend.tap.close(30, finish=False)  # type: ignore[attr-defined]
            for step, batch in used.items():
                batches.setdefault(step, batch)  # the monitor keeps a step's first report
    first, resumed = (t.stats() for t in taps)  # type: ignore[attr-defined]
    # verl skips the actor while critic_warmup > global_steps: step 1 only
    assert (first["sent"], first["refused"]) == (4, 0)  # steps 2, 3, 4, 5
    # steps 4 and 5 again, with other data: the same batch ids, refused as conflicts (409)
    assert (resumed["sent"], resumed["refused"]) == (2, 2)
    with shared_server.client() as c:
        res = c.get(f"/v1/runs/{run}/metrics", params={"names": "tokens,mismatch_kl"}).json()
    assert res["steps"] == [2, 3, 4, 5, 6, 7]  # no warm-up step, none renumbered, none doubled
    for i, step in enumerate(res["steps"]):
        want = expected_row(batches[step])
        assert res["series"]["tokens"][i] == want["tokens"], step
        assert res["series"]["mismatch_kl"][i] == pytest.approx(want["mismatch_kl"], rel=1e-9)


def test_a_paged_run_stops_at_the_step_after_its_page(
    shared_server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TIMWATCH_ON_PAGE=raise reaches the workers' tap, and its `RunPaged` leaves the worker's
    `train_mini_batch` and the driver's `_update_actor` (the plug-in logs and swallows every
    other tap failure): the run stops at the step after the page, with that step's batch
    kept."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    run = fresh_run("verl-guard")
    assert plugin.register_with_verl()
    vt.cpu_device_patches(monkeypatch)
    guarded_env(monkeypatch, shared_server.url, run, SHARED_TOKEN)
    monkeypatch.setattr(verl_hooks, "_WORKER_BACKEND", None)  # a new process
    model = vt.TinyModel(0)
    group = vt.LocalActorGroup([vt.make_worker(vt.tiny_engine(model), vt.actor_config())])
    trainer = vt.stub_trainer(vt.trainer_config(), group, 0)

    def step(i: int) -> None:  # RayPPOTrainer.fit: global_steps from 1
        trainer.global_steps = i + 1
        RayPPOTrainer._update_actor(trainer, vt.rollout_batch(i, model))

    def tap() -> Any:
        backend = verl_hooks.worker_backend()
        assert backend is not None
        return backend.tap

    with vt.gloo_world():
        try:
            stopped, err = stopped_by_page(shared_server.url, SHARED_TOKEN, run, step, tap)
        finally:
            assert tap().close(30, finish=False)
    assert stopped == 4 and err.run == run and err.alerts == ("TimwatchMismatchKLRising",)
    with shared_server.client() as c:
        res = c.get(f"/v1/runs/{run}/metrics", params={"names": "tokens"}).json()
    assert res["steps"] == [1, 2, 3, 4, 5]  # verl's global steps; the stopping one kept
