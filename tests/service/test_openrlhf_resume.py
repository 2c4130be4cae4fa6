"""An OpenRLHF run killed after a checkpoint and resumed, reporting through the plug-in's hooks
and a real `Tap` to a real `timwatch serve`: every actor update is in the history under
OpenRLHF's own `global_step`, with one attempt's tokens, never none and never two.

OpenRLHF's own code runs the actor update (`ActorPPOTrainer.ppo_train`, `training_step`, the
replay buffer, `Actor.forward`, `PolicyLoss`; tests/helpers/openrlhf_tiny.py). `fit` below
follows `PPOTrainer.fit` on the driver (`global_step` from the loaded checkpoint, one
`train_step` per batch of rollouts, a checkpoint every `SAVE_STEPS` steps, saved under the tag
`global_step{N}`), which cannot run without Ray, DeepSpeed and vLLM on GPUs; its checkpoint is
the tiny model's weights and DeepSpeed's `latest` tag file, in OpenRLHF's `{ckpt.path}/_actor`.

And the guard through the plug-in: with TIMWATCH_ON_PAGE=raise, the actor's `ppo_train` raises
`RunPaged` at the update after the service pages the run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if os.environ.get("CI") or os.environ.get("TIMWATCH_REQUIRE_OPENRLHF"):
    import openrlhf  # noqa: F401  # CI installs it: a missing OpenRLHF fails, it does not skip
else:
    pytest.importorskip("openrlhf")

from tests.helpers import openrlhf_tiny as ot
from tests.helpers.frameworks import guarded_env, stopped_by_page  # noqa: E402
from tests.helpers.procs import SHARED_TOKEN, ServerProc  # noqa: E402
from tests.helpers.reference import reference  # noqa: E402
from tests.helpers.wire import fresh_run  # noqa: E402
from timwatch.sidecar.integrations import openrlhf as plugin  # noqa: E402

# a real trainer package: the full suite and CI run it, the quick tier does not
pytestmark = pytest.mark.framework

SAVE_STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def _import_stand_ins() -> Iterator[None]:
    with ot.import_stand_ins():
        yield


def packed(expected: list[list[tuple[float, float, float]]]) -> dict[str, Any]:
    import numpy as np

    flat = np.array([t for seq in expected for t in seq], dtype=np.float64)
    return {
        "cu_seqlens": np.cumsum([0] + [len(s) for s in expected]),
        "logp_rollout": flat[:, 0],
        "logp_train": flat[:, 1],
        "entropy": flat[:, 2],
        "loss_mask": np.ones(len(flat), dtype=np.int8),
    }


def fit(root: Path, attempt: int, last_step: int) -> dict[int, Any]:
    """One training process: resume from the actor checkpoint if there is one."""
    model = ot.tiny_llama(0)
    actor_dir = root / "_actor"
    step = 0
    if (actor_dir / "latest").exists():
        tag = (actor_dir / "latest").read_text()
        model.load_state_dict(torch.load(actor_dir / tag / "model.pt"))
        step = int(tag.removeprefix("global_step"))
    trainer = ot.trainer(model, ot.args(ckpt_path=str(root)))
    used = {}
    while step < last_step:
        exp, expected = ot.experience(100 * attempt + step, model)
        ot.update(trainer, exp)  # PPOTrainer.train_step: the actor's fit
        step += 1
        used[step] = expected
        if step % SAVE_STEPS == 0:
            (actor_dir / f"global_step{step}").mkdir(parents=True)
            torch.save(model.state_dict(), actor_dir / f"global_step{step}" / "model.pt")
            (actor_dir / "latest").write_text(f"global_step{step}")
    return used


def test_resumed_run_keeps_every_steps_tokens_once(
    shared_server: ServerProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = fresh_run("openrlhf-resume")
    assert plugin.install()
    ot.cpu_patches(monkeypatch)
    monkeypatch.setenv("TIMWATCH_URL", shared_server.url)
    monkeypatch.setenv("TIMWATCH_RUN", run)
    monkeypatch.setenv("TIMWATCH_TOKEN", SHARED_TOKEN)
    taps = []
    expected: dict[int, Any] = {}
    for attempt, last_step in ((1, 5), (2, 7)):  # killed after step 5; resumed from step 3
        monkeypatch.setattr(plugin, "_COLLECTOR", None)  # a new process
        used = fit(tmp_path, attempt, last_step)
        collector = plugin.worker_collector()
        assert collector is not None
        taps.append(collector.tap)
        assert collector.tap.close(30, finish=False)  # type: ignore[attr-defined]
        for step, tokens in used.items():
            expected.setdefault(step, tokens)  # the monitor keeps a step's first report
    first, resumed = (t.stats() for t in taps)  # type: ignore[attr-defined]
    assert (first["sent"], first["refused"]) == (5, 0)  # steps 1..5
    # steps 4 and 5 again with other data: the same batch ids, refused as conflicts (409)
    assert (resumed["sent"], resumed["refused"]) == (2, 2)
    with shared_server.client() as c:
        res = c.get(f"/v1/runs/{run}/metrics", params={"names": "tokens,mismatch_kl"}).json()
    assert res["steps"] == [1, 2, 3, 4, 5, 6, 7]  # none renumbered, none doubled
    for i, step in enumerate(res["steps"]):
        want = reference(packed(expected[step]))[0]
        assert res["series"]["tokens"][i] == want["tokens"], step
        kl = res["series"]["mismatch_kl"][i]
        assert kl == pytest.approx(want["mismatch_kl"], rel=1e-4), step  # float32 arrays


def test_a_paged_run_stops_at_the_update_after_its_page(
    shared_server: ServerProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TIMWATCH_ON_PAGE=raise reaches the plug-in's tap, and its `RunPaged` leaves OpenRLHF's
    `ppo_train` (the plug-in logs and swallows every other tap failure): the run stops at the
    update after the page, with that update's batch kept."""
    run = fresh_run("openrlhf-guard")
    assert plugin.install()
    ot.cpu_patches(monkeypatch)
    guarded_env(monkeypatch, shared_server.url, run, SHARED_TOKEN)
    monkeypatch.setattr(plugin, "_COLLECTOR", None)  # a new process
    model = ot.tiny_llama(0)
    trainer = ot.trainer(model, ot.args(ckpt_path=str(tmp_path)))

    def step(i: int) -> None:  # PPOTrainer.train_step: the actor's fit, global step i + 1
        ot.update(trainer, ot.experience(i, model)[0])

    def tap() -> Any:
        collector = plugin.worker_collector()
        assert collector is not None
        return collector.tap

    try:
        stopped, err = stopped_by_page(shared_server.url, SHARED_TOKEN, run, step, tap)
    finally:
        assert tap().close(30, finish=False)
    assert stopped == 4 and err.run == run and err.alerts == ("TimwatchMismatchKLRising",)
    with shared_server.client() as c:
        res = c.get(f"/v1/runs/{run}/metrics", params={"names": "tokens"}).json()
    assert res["steps"] == [1, 2, 3, 4, 5]  # OpenRLHF's global steps; the stopping one kept
