"""The guard end to end on a real `timwatch serve` process: Alertmanager's webhook payload
(version 4, as Alertmanager sends it; a real Alertmanager in tests/stack/test_guard_alertmanager.py)
pages a run, the tap learns it from its next batch answer, and a training loop with
``on_page="raise"`` stops at the step boundary after that, with every reported batch kept."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers.pages import webhook
from tests.helpers.procs import ServerProc, sqlite_server_proc
from timwatch.monitor.core.errors import RunPaged
from timwatch.sidecar.tap import MarkerFile, Page, Tap

TOKEN = "guard-write-token"


def arrays(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    logp = -rng.random(12).astype(np.float32)
    return {
        "cu_seqlens": np.array([0, 5, 12], np.int32),
        "logp_rollout": logp,
        "logp_train": logp - 0.01,
        "entropy": rng.random(12).astype(np.float32),
        "loss_mask": np.ones(12, np.int8),
    }


def post_webhook(srv: ServerProc, body: Any, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{srv.url}/v1/alertmanager", json=body, headers=headers, timeout=10)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """The module's server, writes protected by `TOKEN`: its tests page runs of their own."""
    tmp = tmp_path_factory.mktemp("guard")
    srv = sqlite_server_proc(tmp, "guard", env={"TIMWATCH_TOKEN": TOKEN}, token=TOKEN)
    yield srv.start()
    srv.stop()


def test_training_loop_stops_at_the_step_after_the_page(srv: ServerProc) -> None:
    run, paged_after = "guarded", 3
    stopped = None
    with Tap(srv.url, run, TOKEN, rank=0, on_page="raise") as tap:
        try:
            for step in range(10):
                tap.report(step, **arrays(step))
                assert tap.flush(30)
                if step == paged_after:
                    assert post_webhook(srv, webhook(run)).json()["paged"] == [run]
        except RunPaged as exc:
            stopped, err = step, exc
    # the answer to step 4's batch carried the page; step 5's report raised after queuing
    assert stopped == paged_after + 2
    assert err.run == run and err.alerts == ("TimwatchMismatchKLRising",)
    assert err.since == pytest.approx(1796504400.5)
    assert tap.stats()["pages"] == 1 and tap.stats()["sent"] == stopped + 1
    got = httpx.get(f"{srv.url}/v1/runs/{run}/metrics", timeout=10).json()
    assert got["steps"] == list(range(stopped + 1))  # the stopping step's batch was kept


def test_a_scalars_only_loop_is_stopped_too(srv: ServerProc) -> None:
    """A trainer that sends only its logged scalars (`Tap.log`: TRL's callback, the scalar
    bridge) learns the page from the scalars answer and stops the same way."""
    run, paged_after = "guarded-scalars", 2
    stopped = None
    with Tap(srv.url, run, TOKEN, rank=0, on_page="raise") as tap:
        try:
            for step in range(10):
                assert tap.log(step, {"loss": 1.0 / (step + 1), "grad_norm": 0.5}) in (True,)
                assert tap.flush(30)
                if step == paged_after:
                    assert post_webhook(srv, webhook(run)).json()["paged"] == [run]
        except RunPaged as exc:
            stopped, err = step, exc
    assert stopped == paged_after + 2 and err.run == run
    got = httpx.get(f"{srv.url}/v1/runs/{run}/scalars/series", timeout=10).json()
    assert got["steps"] == list(range(stopped + 1))  # the stopping step's scalars were kept


def test_resolved_clears_the_page_and_a_marker_file_is_written_once(
    srv: ServerProc, tmp_path: Path
) -> None:
    run, marker = "marked", tmp_path / "STOP"
    page_url = f"{srv.url}/v1/runs/{run}/page"
    with Tap(srv.url, run, TOKEN, rank=0, on_page=MarkerFile(marker)) as tap:
        tap.report(0, **arrays(0))
        assert tap.flush(30) and tap.page is None
        assert post_webhook(srv, webhook(run)).status_code == 200
        answer = httpx.get(page_url, timeout=10)
        assert answer.json()["paged"] is True
        assert answer.headers["Timwatch-Page"].startswith("firing; alerts=TimwatchMismatchKLRising")
        for step in (1, 2, 3):
            tap.report(step, **arrays(step))
            assert tap.flush(30)
        assert tap.page == Page(("TimwatchMismatchKLRising",), 1796504400.5)
        assert json.loads(marker.read_text())["step"] == 2  # once: at the first boundary after
        marker.unlink()
        tap.report(4, **arrays(4))
        assert tap.flush(30) and not marker.exists()
        assert post_webhook(srv, webhook(run, "resolved")).json()["paged"] == []
        assert httpx.get(page_url, timeout=10).json() == {
            "run": run, "paged": False, "alerts": [], "since": None
        }  # fmt: skip
        tap.report(5, **arrays(5))
        assert tap.flush(30) and tap.page is None
        assert "Timwatch-Page" not in httpx.get(page_url, timeout=10).headers
        assert tap.stats()["pages"] == 1 and tap.stats()["page_errors"] == 0


def test_webhook_is_authenticated_and_refuses_bad_payloads_whole(srv: ServerProc) -> None:
    assert post_webhook(srv, webhook("r"), token=None).status_code == 401
    assert post_webhook(srv, webhook("r"), token="wrong").status_code == 401
    body = webhook("r")
    body["alerts"].append({"status": "pending", "labels": {"run": "r"}})
    bad = post_webhook(srv, body)
    assert bad.status_code == 422 and bad.json()["field"] == "alerts[1].status"
    raw = httpx.post(
        f"{srv.url}/v1/alertmanager", content=b"{not json",
        headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10,
    )  # fmt: skip
    assert raw.status_code == 422 and raw.json()["detail"].startswith("body: not JSON")
    assert httpx.get(f"{srv.url}/v1/runs/r/page", timeout=10).json()["paged"] is False
    assert httpx.get(f"{srv.url}/v1/runs/bad%20id/page", timeout=10).status_code == 422
