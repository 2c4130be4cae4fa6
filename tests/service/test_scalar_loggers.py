"""The logger hooks (`timwatch.sidecar.integrations.loggers`) against a real `timwatch serve`:
a ``wandb.log``-compatible shim, and a backend inside the real verl 0.9.1 ``Tracking``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.procs import SHARED_TOKEN, ServerProc
from tests.helpers.wire import fresh_run
from timwatch.sidecar.integrations.loggers import (
    VERL_BACKEND,
    install_verl_tracking_hook,
    wandb_shim,
)
from timwatch.sidecar.tap import Tap


def stored(server: ServerProc, run: str) -> dict[str, Any]:
    with server.client() as c:
        res = c.get(f"/v1/runs/{run}/scalars/series")
    assert res.status_code == 200, res.text
    return dict(res.json())


def test_wandb_shim_counts_steps_like_wandb_and_sends_numbers_only(
    shared_server: ServerProc,
) -> None:
    run = fresh_run("wandb-shim")
    tap = Tap(shared_server.url, run, SHARED_TOKEN, finish=False)
    seen: list[tuple[dict[str, Any], Any, Any]] = []
    shim = wandb_shim(
        tap, "openrlhf", lambda d, step=None, commit=None: seen.append((d, step, commit))
    )
    shim({"vllm_kl": 0.01, "samples": "a table", "policy_loss": 1.0})  # step 0
    shim({"vllm_kl": 0.02}, commit=False)  # still step 1
    shim({"reward": 0.5})  # step 1, then 2
    shim({"vllm_kl": 0.03, "hist": [1, 2, 3]}, step=7)
    assert tap.close(30)
    assert tap.stats()["sent"] == 4 and tap.stats()["refused"] == 0
    assert len(seen) == 4 and seen[0][0]["samples"] == "a table"  # the real log got all of it
    got = stored(shared_server, run)
    assert got["steps"] == [0, 1, 7]
    assert got["scalars"]["kl_k1"] == [0.01, 0.02, 0.03]
    assert got["scalars"]["reward_mean"] == [None, 0.5, None]
    assert got["scalars"]["loss"] == [1.0, None, None]


def test_verl_tracking_backend_inside_real_verl(
    shared_server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl.utils.tracking import Tracking

    monkeypatch.setattr(Tracking, "__init__", Tracking.__init__)  # undone after the test
    run = fresh_run("verl-tracking")
    tap = Tap(shared_server.url, run, SHARED_TOKEN, finish=False)
    install_verl_tracking_hook(tap)
    tracking = Tracking(project_name="p", experiment_name="e", default_backend=["console"])
    assert VERL_BACKEND in tracking.logger and "console" in tracking.logger
    for step in (1, 2):
        tracking.log(
            data={"rollout_corr/k3_kl": 1e-4 * step, "actor/grad_norm": 0.1 * step,
                  "response_length/mean": 100.0 + step, "timing_s/gen": 3.0},
            step=step,
        )  # fmt: skip
    tracking.finish()
    assert tap.close(30)
    got = stored(shared_server, run)
    assert got["steps"] == [1, 2]
    assert got["scalars"]["mismatch_kl"] == pytest.approx([1e-4, 2e-4])
    assert got["scalars"]["grad_norm"] == pytest.approx([0.1, 0.2])
    assert got["scalars"]["response_length_mean"] == [101.0, 102.0]
    assert set(got["sources"].values()) == {"verl"}
