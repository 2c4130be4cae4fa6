"""The guard fed by a real Alertmanager (Debian `prometheus-alertmanager`): a page alert posted to
Alertmanager's API, as Prometheus posts it, goes out through a `webhook_configs` receiver with the
write token to `timwatch serve`'s ``POST /v1/alertmanager``; the training loop's `Tap` with
``on_page="raise"`` stops at the step boundary after its next batch answer; the resolved
notification clears the page. The receiver config is the one alerts/README.md documents."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from tests.helpers.procs import ServerProc, free_port
from timwatch.monitor.core.errors import RunPaged
from timwatch.sidecar.tap import Tap

TOKEN = "guard-stack-token"


def guard_config(timwatch_url: str) -> dict[str, Any]:
    """Pages go to the guard (and, in a deployment, on to the pager: `continue`), group timers
    shortened for the test."""
    return {
        "route": {
            "receiver": "null", "group_by": ["alertname", "run"],
            "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h",
            "routes": [{
                "receiver": "timwatch-guard", "matchers": ['severity="page"'],
                "group_wait": "1s", "group_interval": "1s", "continue": True,
            }],
        },
        "receivers": [
            {"name": "null"},
            {"name": "timwatch-guard", "webhook_configs": [{
                "url": f"{timwatch_url}/v1/alertmanager", "send_resolved": True,
                "http_config": {"authorization": {"type": "Bearer", "credentials": TOKEN}},
            }]},
        ],
    }  # fmt: skip


def arrays(step: int) -> dict[str, Any]:
    logp = -np.random.default_rng(step).random(8).astype(np.float32)
    return {
        "cu_seqlens": np.array([0, 8], np.int32), "logp_rollout": logp,
        "logp_train": logp - 0.02, "entropy": np.full(8, 0.5, np.float32),
        "loss_mask": np.ones(8, np.int8),
    }  # fmt: skip


def stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_alertmanager_webhook_stops_the_training_loop(
    server_factory: Callable[..., ServerProc], tmp_path: Path
) -> None:
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    assert binary, "Alertmanager not found: install Debian prometheus-alertmanager"
    srv = server_factory(token=TOKEN, env={"TIMWATCH_TOKEN": TOKEN})
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump(guard_config(srv.url)))
    port = free_port()
    am = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.path={tmp_path / 'am'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "am.log").open("wb"),
    )  # fmt: skip
    api = f"http://127.0.0.1:{port}/api/v2"
    run = "am-guarded"
    try:
        deadline = time.monotonic() + 30
        while True:  # bounded poll of the Alertmanager process
            assert am.poll() is None, (tmp_path / "am.log").read_text()
            try:
                if httpx.get(f"{api}/status", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "Alertmanager did not come up"
            time.sleep(0.2)
        now = datetime.now(timezone.utc)
        alert = {
            "labels": {"alertname": "TimwatchMismatchKLRising", "run": run, "severity": "page"},
            "startsAt": stamp(now),
        }
        warning = {"labels": {"alertname": "TimwatchMismatchKLHigh", "run": run,
                              "severity": "warning"}}  # fmt: skip
        stopped = None
        with Tap(srv.url, run, TOKEN, rank=0, on_page="raise") as tap:
            tap.report(0, **arrays(0))
            assert tap.flush(30) and tap.page is None
            posted = httpx.post(f"{api}/alerts", json=[alert, warning], timeout=5)
            assert posted.status_code == 200
            deadline = time.monotonic() + 60
            try:
                for step in range(1, 10_000):
                    tap.report(step, **arrays(step))
                    assert tap.flush(30)
                    assert time.monotonic() < deadline, (tmp_path / "am.log").read_text()
                    time.sleep(0.2)  # pacing: Alertmanager's group_wait is 1 s
            except RunPaged as exc:
                stopped, err = step, exc
        assert stopped is not None and err.alerts == ("TimwatchMismatchKLRising",)
        assert err.since is not None and abs(err.since - now.timestamp()) < 1.0
        # the warning reached no guard: only severity="page" is routed there
        page = httpx.get(f"{srv.url}/v1/runs/{run}/page", timeout=5).json()
        assert page["paged"] is True and page["alerts"] == ["TimwatchMismatchKLRising"]
        resolved = {**alert, "endsAt": stamp(datetime.now(timezone.utc) - timedelta(seconds=1))}
        assert httpx.post(f"{api}/alerts", json=[resolved], timeout=5).status_code == 200
        deadline = time.monotonic() + 60
        while httpx.get(f"{srv.url}/v1/runs/{run}/page", timeout=5).json()["paged"]:
            assert time.monotonic() < deadline, "the resolved notification never came"
            time.sleep(0.2)
    finally:
        am.terminate()
        am.wait(timeout=10)
