"""A real TRL `GRPOTrainer` (trl 1.16.0, tests/requirements-trl.txt) with TRL's own generation
(transformers ``generate``, no engine) on the CPU, reporting through `TimwatchGRPOTrainer` to a
real ``timwatch serve``.

With its own generation TRL keeps no sampling log-probs, so there is no μ: the plug-in reports
μ = π (its recomputed log-probs) and the mismatch metrics are exactly 0 by construction, and TRL
logs no ``sampling/*`` metrics. What is checked is the rest: every optimizer step is in the
history once, under TRL's global step, with the completion tokens TRL trained on (from TRL's own
logged completion lengths) and the entropy it logged; each stored row equals the float64
reference (`tests.helpers.reference`) of the batch the tap sent; TRL's own logs, forwarded by
`TimwatchCallback` through `Tap.log`, are stored under the same steps as TRL logged them.

And the guard: a tap with ``on_page="raise"`` stops `trainer.train()` with `RunPaged` at the step
after the service pages the run, from the batch report or from the forwarded logs, while an
ordinary failure of the tap never stops training.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI") or os.environ.get("TIMWATCH_REQUIRE_TRL"):
    import trl  # noqa: F401  # CI installs it: a missing trl fails, it does not skip
else:
    pytest.importorskip("trl")

from transformers import TrainerCallback

from tests.helpers.frameworks import RaisingTap
from tests.helpers.pages import page
from tests.helpers.procs import SHARED_TOKEN, ServerProc
from tests.helpers.reference import reference
from tests.helpers.trl_run import PER_STEP, RecordingTap, build_model, train
from tests.helpers.wire import fresh_run
from timwatch.monitor.core.errors import RunPaged

# a real trainer package: the full suite and CI run it, the quick tier does not
pytestmark = pytest.mark.framework

STEPS = 3
NAMES = "tokens,sequences,mismatch_kl,log_ratio_abs_max,entropy_mean,policy_version"
#: TRL's logged names → the canonical scalar names the callback's logs are stored under
FORWARDED = {
    "reward": "reward_mean",
    "reward_std": "reward_std",
    "entropy": "entropy",
    "grad_norm": "grad_norm",
    "loss": "loss",
    "learning_rate": "learning_rate",
    "completions/mean_length": "response_length_mean",
}
SCALARS = ",".join(FORWARDED.values())


def test_trl_own_generation_reports_every_step_with_its_tokens(
    shared_server: ServerProc, tmp_path: Path
) -> None:
    run = fresh_run("trl")
    tap = RecordingTap(shared_server.url, run, SHARED_TOKEN, rank=0)
    model = build_model(tmp_path / "model")
    _, capture = train(model, tap, tmp_path / "out", steps=STEPS)
    assert tap.close(60)
    stats = tap.stats()
    # a batch and TRL's logs per step (the end-of-training summary is not forwarded)
    assert (stats["reported"], stats["sent"], stats["dropped"]) == (2 * STEPS, 2 * STEPS, 0)
    with shared_server.client() as c:
        res = c.get(f"/v1/runs/{run}/metrics", params={"names": NAMES}).json()
        scalars = c.get(f"/v1/runs/{run}/scalars/series", params={"names": SCALARS}).json()
    steps = list(range(1, STEPS + 1))
    assert res["steps"] == steps == sorted(capture.logs) == sorted(tap.sent)
    s = res["series"]
    for i, step in enumerate(steps):
        logs, sent = capture.logs[step], tap.sent[step]
        assert not any(k.startswith("sampling/") for k in logs)  # TRL logs none without μ
        trained = logs["completions/mean_length"] * PER_STEP  # TRL's own count of the tokens
        assert s["tokens"][i] == round(trained) == int(sent["loss_mask"].sum())
        assert math.isclose(trained, round(trained), abs_tol=1e-6)
        assert s["sequences"][i] == PER_STEP
        assert s["policy_version"][i] == step - 1  # the weights of the step before it trains
        assert s["mismatch_kl"][i] == 0.0 and s["log_ratio_abs_max"][i] == 0.0  # μ = π
        want, _ = reference(sent)
        assert s["entropy_mean"][i] == pytest.approx(want["entropy_mean"], rel=1e-9)
        # TRL's logged entropy is its training forward's (float32, same weights and tokens)
        assert s["entropy_mean"][i] == pytest.approx(logs["entropy"], rel=1e-5)
    # TRL's own logs, forwarded by the callback under the same steps, stored as TRL logged them
    assert scalars["steps"] == steps
    for theirs, ours in FORWARDED.items():
        assert scalars["scalars"][ours] == [capture.logs[k][theirs] for k in steps], theirs
        assert scalars["sources"][ours] == "trl"


class Pager(TrainerCallback):  # type: ignore[misc]
    """Pages `run` at the end of TRL's step `after` (once the tap's answers to that step are
    in), and waits for the tap's answers at the start of every step, so that the step after
    the page is the first whose guard check can see it (as `stopped_by_page` does)."""

    def __init__(self, url: str, run: str, tap: Any, after: int) -> None:
        self.url, self.run, self.tap, self.after = url, run, tap, after
        self.begun: list[int] = []  # TRL's global step at each step's start

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.begun.append(int(state.global_step))
        assert self.tap.flush(30)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.after:
            assert self.tap.flush(30)
            assert page(self.url, self.run, SHARED_TOKEN) == [self.run]


@pytest.mark.parametrize("report", [True, False], ids=["batch-report", "logs-only"])
def test_a_paged_run_stops_at_the_step_after_its_page(
    shared_server: ServerProc, tmp_path: Path, report: bool
) -> None:
    """Paged after step 1 (the answer to step 1's forwarded logs carries the page): with batch
    reports, step 2's `_generate_and_score_completions` raises `RunPaged` after queuing its
    batch, before step 2 trains; with TRL's logs alone, `TimwatchCallback.on_log` raises it
    after step 2, after queuing its logs. Either way it leaves `trainer.train()`."""
    run = fresh_run("trl-guard")
    tap = RecordingTap(shared_server.url, run, SHARED_TOKEN, rank=0, on_page="raise")
    pager = Pager(shared_server.url, run, tap, after=1)
    model = build_model(tmp_path / "model")
    with pytest.raises(RunPaged) as err:
        train(model, tap, tmp_path / "out", steps=4, callbacks=(pager,), report=report)
    assert tap.close(60, finish=False)
    assert err.value.run == run and err.value.alerts == ("TimwatchMismatchKLRising",)
    assert pager.begun == [0, 1]  # step 2 began; no step 3
    with shared_server.client() as c:
        batches = c.get(f"/v1/runs/{run}/metrics", params={"names": "tokens"}).json()
        scalars = c.get(f"/v1/runs/{run}/scalars/series", params={"names": "loss"}).json()
    if report:  # step 2's batch was queued before the stop, its logs never came
        assert sorted(tap.sent) == batches["steps"] == [1, 2] and scalars["steps"] == [1]
    else:  # step 2 trained and its logs were queued before the stop
        assert tap.sent == {} and batches["steps"] == [] and scalars["steps"] == [1, 2]


def test_a_failing_tap_never_stops_training(tmp_path: Path) -> None:
    """A tap whose `report` and `log` raise an ordinary error: logged, and every step runs."""
    tap = RaisingTap(OSError("monitor down"))
    model = build_model(tmp_path / "model")
    _, capture = train(model, tap, tmp_path / "out", steps=2)
    assert sorted(capture.logs) == [1, 2]
    assert tap.calls == 4  # each step's batch report and forwarded logs
