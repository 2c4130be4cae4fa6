"""An AReaL run killed after a checkpoint and resumed, reporting through the plug-in's hooks and a
real `Tap` to a real `timwatch serve`: every step is in the history under AReaL's own
`global_step`, with one attempt's tokens, never none and never two.

AReaL's own code runs the actor (`PPOActor.compute_advantages`, `ppo_update`, `grpo_loss_fn`;
tests/helpers/areal_tiny.py). `fit` below follows the order of `PPOTrainer.train`
(`areal/trainer/rl_trainer.py`: for each `global_step` from the recovered one, the actor update,
then `set_version(global_step + 1)`, then a checkpoint every `SAVE_FREQ` steps) and of AReaL's
recovery (`areal/utils/recover.py`: load the weights, `set_version(last global_step + 1)`), which
cannot run without its launcher, rollout engine and saver; the checkpoint is the tiny model's
weights and the last step, in a folder.

And the guard through the plug-in: with TIMWATCH_ON_PAGE=raise, AReaL's `ppo_update` raises
`RunPaged` at the step after the service pages the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import areal_tiny as at
from tests.helpers.frameworks import guarded_env, plugin_loader, require_package, stopped_by_page
from tests.helpers.procs import SHARED_TOKEN, ServerProc
from tests.helpers.reference import reference
from tests.helpers.verl_tiny import TinyModel
from tests.helpers.wire import fresh_run

require_package("areal")
# the AReaL plug-in, imported (with AReaL) before the first test
plugin: Any = None
_plugin_loaded = plugin_loader("timwatch.sidecar.integrations.areal")

# a real trainer package: the full suite and CI run it, the quick tier does not
pytestmark = pytest.mark.framework


SAVE_FREQ = 3


def fit(root: Path, attempt: int, last_step: int) -> dict[int, Any]:
    """One trainer process: recover if a checkpoint exists, train through `last_step`."""
    model = TinyModel(0)
    engine = at.TinyEngine(model)
    start = 0
    if (root / "last_step.txt").exists():  # RecoverHandler.load
        last = int((root / "last_step.txt").read_text())
        model.load_state_dict(torch.load(root / "model.pt"))
        engine.set_version(last + 1)
        start = last + 1
    actor = at.actor(engine)
    used = {}
    for global_step in range(start, last_step + 1):
        used[global_step] = at.rollout_batch(100 * attempt + global_step, model)
        used[global_step]["_expected"] = at.expected_tokens(used[global_step], model)
        at.update(actor, used[global_step])
        engine.set_version(global_step + 1)
        if (global_step + 1) % SAVE_FREQ == 0:
            torch.save(model.state_dict(), root / "model.pt")
            (root / "last_step.txt").write_text(str(global_step))
    return used


def test_resumed_run_keeps_every_steps_tokens_once(
    shared_server: ServerProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = fresh_run("areal-resume")
    assert plugin.install()
    monkeypatch.setenv("TIMWATCH_URL", shared_server.url)
    monkeypatch.setenv("TIMWATCH_RUN", run)
    monkeypatch.setenv("TIMWATCH_TOKEN", SHARED_TOKEN)
    taps = []
    batches: dict[int, Any] = {}
    for attempt, last_step in ((1, 4), (2, 6)):  # killed after step 4; resumed from step 3
        monkeypatch.setattr(plugin, "_COLLECTOR", None)  # a new process
        used = fit(tmp_path, attempt, last_step)
        collector = plugin.worker_collector()
        assert collector is not None
        taps.append(collector.tap)
        assert collector.tap.close(30, finish=False)  # type: ignore[attr-defined]
        for step, batch in used.items():
            batches.setdefault(step, batch)  # the monitor keeps a step's first report
    first, resumed = (t.stats() for t in taps)  # type: ignore[attr-defined]
    assert (first["sent"], first["refused"]) == (5, 0)  # steps 0..4
    # step 3 and 4 again with other data: the same batch ids, refused as conflicts (409)
    assert (resumed["sent"], resumed["refused"]) == (2, 2)
    with shared_server.client() as c:
        res = c.get(f"/v1/runs/{run}/metrics", params={"names": "tokens,mismatch_kl"}).json()
    assert res["steps"] == [0, 1, 2, 3, 4, 5, 6]  # none renumbered, none doubled
    for i, step in enumerate(res["steps"]):
        # μ, π_old and H in float64 from the logit tables that step saw
        want = reference(at.packed_expected(batches[step]["_expected"]))[0]
        assert res["series"]["tokens"][i] == want["tokens"], step
        kl = res["series"]["mismatch_kl"][i]
        assert kl == pytest.approx(want["mismatch_kl"], rel=1e-4), step  # float32 arrays


def test_a_paged_run_stops_at_the_step_after_its_page(
    shared_server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TIMWATCH_ON_PAGE=raise reaches the plug-in's tap, and its `RunPaged` leaves AReaL's
    `ppo_update` (the plug-in logs and swallows every other tap failure): the run stops at the
    step after the page, with that step's batch kept."""
    run = fresh_run("areal-guard")
    assert plugin.install()
    guarded_env(monkeypatch, shared_server.url, run, SHARED_TOKEN)
    monkeypatch.setattr(plugin, "_COLLECTOR", None)  # a new process
    model = TinyModel(0)
    engine = at.TinyEngine(model)
    actor = at.actor(engine)

    def step(global_step: int) -> None:  # PPOTrainer.train: the actor update, then the version
        at.update(actor, at.rollout_batch(global_step, model))
        engine.set_version(global_step + 1)

    def tap() -> Any:
        collector = plugin.worker_collector()
        assert collector is not None
        return collector.tap

    try:
        stopped, err = stopped_by_page(shared_server.url, SHARED_TOKEN, run, step, tap)
    finally:
        assert tap().close(30, finish=False)
    assert stopped == 4
    assert err.run == run and err.alerts == ("TimwatchMismatchKLRising",)
    assert engine.get_version() == stopped  # stopped inside step 4's ppo_update
    with shared_server.client() as c:
        res = c.get(f"/v1/runs/{run}/metrics", params={"names": "tokens"}).json()
    assert res["steps"] == [0, 1, 2, 3, 4]  # the stopping step's batch was kept
