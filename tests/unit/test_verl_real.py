"""The verl plug-in inside real verl 0.9.1 (PyPI, installed by scripts/test.sh with `--no-deps`
plus the packages its imports need, tests/requirements-verl.txt).

The actor update runs through verl's own driver, worker, engine and loss code on CPU with a tiny
model (tests/helpers/verl_tiny.py says exactly what is written here instead of verl's: the model,
its optimizer and the parallel layout). verl 0.9 has no `DataParallelPPOActor` any more; both of
its engines (FSDP and Megatron) call `verl.workers.utils.losses.ppo_loss`, which is what runs here.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch

if os.environ.get("CI") or os.environ.get("TIMWATCH_REQUIRE_VERL"):
    import verl  # noqa: F401  # CI installs it: a missing verl fails, it does not skip
else:
    pytest.importorskip("verl")

from tests.helpers import verl_tiny as vt
from tests.helpers.frameworks import RaisingTap, RecordingTap
from timwatch.monitor.core.errors import PluginContextError, TimwatchError
from timwatch.sidecar.integrations import verl as plugin
from timwatch.sidecar.integrations import verl_hooks

# a real trainer package: the full suite and CI run it, the quick tier does not
pytestmark = pytest.mark.framework


@pytest.fixture
def verl_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """verl with the plug-in registered and hooked, CPU device helpers, a one-process gloo group
    and a recording collector as the worker's backend."""
    assert plugin.register_with_verl()
    vt.cpu_device_patches(monkeypatch)
    tap = RecordingTap()
    monkeypatch.setenv("TIMWATCH_URL", "http://127.0.0.1:9")  # the recording tap replaces it
    monkeypatch.setattr(verl_hooks, "_WORKER_BACKEND", plugin.TimwatchTracking(tap))
    with vt.gloo_world():
        yield tap


def run_update(
    model: vt.TinyModel,
    batch: Any,
    *,
    step: int,
    loss_mode: str = "estr",
    collect: tuple[bool, ...] = (True,),
    **actor: Any,
) -> tuple[Any, list[Any]]:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    engines = [vt.tiny_engine(model, collect=c) for c in collect]
    cfg = vt.actor_config(loss_mode, **actor)
    group = vt.LocalActorGroup([vt.make_worker(e, cfg) for e in engines])
    trainer = vt.stub_trainer(vt.trainer_config(), group, step)
    return RayPPOTrainer._update_actor(trainer, batch), engines


def expected_entropy(model: vt.TinyModel, batch: Any) -> torch.Tensor:
    """H at each response token under `model` (the weights before the update), padded."""
    b = batch.batch
    out = torch.zeros(b["responses"].shape)
    for i in range(out.shape[0]):
        tokens = b["input_ids"][i][b["attention_mask"][i].bool()]
        p = int(b["attention_mask"][i, : b["prompts"].shape[1]].sum())
        r = int(b["response_mask"][i].sum())
        with torch.no_grad():
            _, h = model.token_logp_entropy(tokens, 1.0)
        out[i, :r] = h[p - 1 : p + r - 1]
    return out


def test_estr_is_in_verls_registry() -> None:
    from verl.trainer.ppo import core_algos

    assert plugin.register_with_verl()
    assert core_algos.get_policy_loss_fn("estr") is plugin.compute_policy_loss_estr


def test_update_reports_verls_step_with_the_trainers_tokens(verl_env: RecordingTap) -> None:
    model = vt.TinyModel(0)
    before = model.table.detach().clone()
    batch = vt.rollout_batch(1, model)
    h = expected_entropy(model, batch)
    out, (engine,) = run_update(model, batch, step=7)
    # entropy forced on although calculate_entropy=False and entropy_coeff=0
    assert engine.forward_calls == [True, True]
    assert not torch.equal(model.table.detach(), before)  # a real optimizer step happened
    assert len(verl_env.reports) == 1
    step, arrays = verl_env.reports[0]
    assert step == 7 and arrays.pop("batch_id") == "verl-s7-dp0"
    ref = vt.packed_reference(batch)
    for key in ("cu_seqlens", "logp_rollout", "logp_train", "loss_mask"):
        np.testing.assert_array_equal(arrays[key].numpy(), ref[key], err_msg=key)
    cu, packed_h = plugin.pack_padded(batch.batch["response_mask"], entropy=h)
    np.testing.assert_allclose(arrays["entropy"].numpy(), packed_h["entropy"].numpy(), rtol=1e-6)
    # the loss's metrics reach verl's own metrics under actor/
    from verl.utils.metric import reduce_metrics

    metrics = reduce_metrics(out.meta_info["metrics"])
    b = batch.batch
    mask = b["response_mask"].bool()
    delta = b["old_log_probs"] - b["rollout_log_probs"]
    rejected = (delta**2 > 1.6 * (h + 0.01)) & mask
    per_micro = [
        (rejected[i : i + 2].sum() / mask[i : i + 2].sum()).item() for i in (0, 2)
    ]  # micro-batches of 2, each a mean; verl averages them
    got = metrics["actor/timwatch/estr_mask_ratio"]
    assert got == pytest.approx(np.mean(per_micro), rel=1e-6)
    assert 0 < rejected.sum() < mask.sum()  # the case rejects some tokens and keeps others


def test_estr_at_infinite_tau_equals_verls_vanilla(
    verl_env: RecordingTap, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl.utils.metric import reduce_metrics

    monkeypatch.setenv("TIMWATCH_ESTR_TAU", "1e30")
    runs = {}
    for mode in ("vanilla", "estr"):
        model = vt.TinyModel(3)
        batch = vt.rollout_batch(4, model, bs=4)
        out, _ = run_update(model, batch, step=1, loss_mode=mode)
        metrics = reduce_metrics(out.meta_info["metrics"])
        runs[mode] = (model.table.detach().clone(), metrics["actor/pg_loss"])
    assert torch.equal(runs["vanilla"][0], runs["estr"][0])  # the same weights, to 0.0
    assert runs["vanilla"][1] == runs["estr"][1]


def test_one_sequence_parallel_group_reports_once(verl_env: RecordingTap) -> None:
    model = vt.TinyModel(5)
    batch = vt.rollout_batch(6, model)
    run_update(model, batch, step=2, collect=(True, False))  # sp ranks 0 and 1 of one group
    assert [s for s, _ in verl_env.reports] == [2]
    assert verl_hooks.worker_backend() is not None
    assert verl_hooks.worker_backend().pending == 0  # type: ignore[union-attr]


def test_update_without_verls_step_reports_nothing(
    verl_env: RecordingTap, caplog: pytest.LogCaptureFixture
) -> None:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    model = vt.TinyModel(7)
    batch = vt.rollout_batch(8, model)
    cfg = vt.actor_config()
    group = vt.LocalActorGroup([vt.make_worker(vt.tiny_engine(model), cfg)])
    trainer = vt.stub_trainer(vt.trainer_config(), group, 9)
    RayPPOTrainer._update_actor.__wrapped__(trainer, batch)  # verl's own, without our hook
    assert verl_env.reports == []
    assert "carries no 'global_steps'" in caplog.text


def test_missing_rollout_log_probs_fails_loudly_inside_verl(verl_env: RecordingTap) -> None:
    model = vt.TinyModel(9)
    batch = vt.rollout_batch(10, model)
    batch.batch = batch.batch.exclude("rollout_log_probs")
    with pytest.raises(PluginContextError, match="calculate_log_probs=True"):
        run_update(model, batch, step=1)


def test_context_of_another_micro_batch_is_refused() -> None:
    g = torch.Generator().manual_seed(0)
    old_a, old_b = -torch.rand(2, 5, generator=g), -torch.rand(2, 5, generator=g)
    mu, h = -torch.rand(2, 5, generator=g), torch.rand(2, 5, generator=g)
    adv, mask = torch.ones(2, 5), torch.ones(2, 5)
    cfg = vt.actor_config()
    plugin.set_estr_inputs(mu, h, old_a)
    with pytest.raises(PluginContextError, match="another micro-batch") as e:
        plugin.compute_policy_loss_estr(old_b, old_b, adv, mask, "token-mean", cfg, None)
    assert isinstance(e.value, TimwatchError)
    # a context is used once: the next call without a new one has none
    with pytest.raises(PluginContextError, match="no rollout_log_probs"):
        plugin.compute_policy_loss_estr(old_a, old_a, adv, mask, "token-mean", cfg, None)
    plugin.set_estr_inputs(mu, h, old_a)
    loss, _ = plugin.compute_policy_loss_estr(old_a, old_a, adv, mask, "token-mean", cfg, None)
    assert torch.isfinite(loss)


def test_tracking_backend_list_is_fixed_and_metrics_reach_verls_file_logger(
    verl_env: RecordingTap, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl.utils.metric import reduce_metrics
    from verl.utils.tracking import Tracking

    with pytest.raises(AssertionError, match="timwatch is not supported"):
        Tracking("p", "e", default_backend=["timwatch"])
    model = vt.TinyModel(11)
    out, _ = run_update(model, vt.rollout_batch(12, model), step=4)
    path = tmp_path / "log.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracking = Tracking("p", "e", default_backend=["file"])
    metrics = reduce_metrics(out.meta_info["metrics"])
    tracking.log(data=metrics, step=4)
    tracking.logger["file"].finish()
    line = json.loads(path.read_text().splitlines()[0])
    assert line["step"] == 4
    for key in ("actor/timwatch/estr_mask_ratio", "actor/timwatch/mismatch_kl"):
        assert line["data"][key] == pytest.approx(metrics[key])


def test_verls_external_modules_variable_loads_the_plugin_and_its_hooks() -> None:
    """What a launch with VERL_USE_EXTERNAL_MODULES does in each verl process (driver and
    workers): `import verl` imports the plug-in, which registers `estr` and installs the hooks."""
    import subprocess
    import sys

    from tests.helpers.procs import REPO

    code = (
        "import verl\n"
        "from verl.trainer.ppo import core_algos\n"
        "from verl.trainer.ppo.ray_trainer import RayPPOTrainer\n"
        "from verl.workers import engine_workers as ew\n"
        "from timwatch.sidecar.integrations.verl import compute_policy_loss_estr\n"
        "assert core_algos.get_policy_loss_fn('estr') is compute_policy_loss_estr\n"
        "assert ew.ppo_loss._timwatch_hooked and ew.TrainingWorker._timwatch_hooked\n"
        "assert RayPPOTrainer._timwatch_hooked\n"
        "print('hooked')\n"
    )
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="timwatch.sidecar.integrations.verl")
    env.pop("TIMWATCH_URL", None)
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("hooked")


def test_a_failing_tap_never_breaks_the_update(
    verl_env: RecordingTap, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = RaisingTap(OSError("monitor down"))
    monkeypatch.setattr(verl_hooks, "_WORKER_BACKEND", plugin.TimwatchTracking(failing))
    model = vt.TinyModel(0)
    before = model.table.detach().clone()
    run_update(model, vt.rollout_batch(1, model), step=3)
    assert failing.calls == 1  # reported, failed, logged
    assert not torch.equal(model.table, before)  # the update was taken
