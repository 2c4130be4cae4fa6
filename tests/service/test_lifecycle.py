"""Run lifecycle (docs/reference/api.md, "Run lifecycle"): ``POST /v1/runs/{run}/finish`` and
``timwatch finish`` against a real ``timwatch serve``; the registry's TTL and finish grace on
an explicit clock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.helpers.cli import timwatch
from tests.helpers.clock import FakeClock
from tests.helpers.inproc import InProcessApp
from tests.helpers.procs import REPO, SHARED_READ_TOKEN, SHARED_TOKEN, ServerProc
from tests.helpers.wire import as_batch, counters, fresh_run, post, raw_batch
from timwatch.monitor.client import TimwatchClient
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.jsoncodec import loads
from timwatch.monitor.service.runs import RunRegistry
from timwatch.monitor.service.settings import DEFAULT_FINISH_GRACE, DEFAULT_RUN_TTL, Settings

Factory = Callable[..., ServerProc]


def exposition(c: httpx.Client) -> dict[str, float]:
    return counters(c.get("/metrics").text)


def listed(c: httpx.Client, run: str) -> dict[str, Any]:
    return next(r for r in c.get("/v1/runs").json()["runs"] if r["run"] == run)


def kinds(c: httpx.Client, run: str) -> list[str]:
    """The run's lifecycle events (``run_*``), oldest first."""
    events = reversed(c.get(f"/v1/runs/{run}/events").json()["events"])
    return [e["kind"] for e in events if e["kind"].startswith("run_")]


def test_finish_is_stored_idempotent_and_a_batch_reopens_the_run(
    server_factory: Factory, db_url: str
) -> None:
    srv = server_factory(db=db_url)  # default grace (300 s): the run stays exported
    with srv.client() as c:
        assert post(c, "life", raw_batch(1, step=1, batch_id="a")).status_code == 200
        assert exposition(c)["timwatch_run_finished{run=life}"] == 0
        first = c.post("/v1/runs/life/finish")
        second = c.post("/v1/runs/life/finish")
        expo = exposition(c)
        stored = listed(c, "life")
        events = kinds(c, "life")
        assert post(c, "life", raw_batch(2, step=2, batch_id="b")).status_code == 200
        reopened = exposition(c)
        after = listed(c, "life")
        events_after = kinds(c, "life")
    assert first.status_code == second.status_code == 200, first.text
    one, two = first.json(), second.json()
    assert set(one) == {"run", "finished_at", "already_finished"}
    assert (one["run"], one["already_finished"], two["already_finished"]) == ("life", False, True)
    assert two["finished_at"] == one["finished_at"] == stored["finished_at"]
    assert one["finished_at"] <= time.time()
    assert expo["timwatch_run_finished{run=life}"] == 1
    assert events == ["run_created", "run_finished"]  # the second finish wrote nothing
    assert reopened["timwatch_run_finished{run=life}"] == 0
    assert reopened["timwatch_batches_total{run=life}"] == 2
    assert after["finished_at"] is None and after["last_step"] == 2
    assert events_after == ["run_created", "run_finished", "run_reopened"]


def test_unknown_runs_are_404_and_count_no_rejected_batch(server: ServerProc) -> None:
    with server.client() as c:
        assert post(c, "known", raw_batch(1)).status_code == 200
        before = exposition(c)
        answers = [c.post(f"/v1/runs/{run}/finish") for run in ("nope", "a%20b", "x" * 300)]
        after = exposition(c)
    for r in answers:
        assert r.status_code == 404, r.text
        assert "not found" in r.json()["detail"]
    rejected = {k: v for k, v in after.items() if k.startswith("timwatch_rejected")}
    assert rejected == {k: v for k, v in before.items() if k.startswith("timwatch_rejected")}
    assert after["timwatch_run_finished{run=known}"] == 0


def test_a_finished_run_leaves_metrics_after_the_grace(
    app_factory: Callable[..., InProcessApp],
) -> None:
    clock = FakeClock()
    with app_factory(finish_grace=300.0, clock=clock).client() as c:
        for run in ("done", "open"):
            assert post(c, run, raw_batch(3, step=1, batch_id="a")).status_code == 200
        assert c.post("/v1/runs/done/finish").status_code == 200
        clock.advance(300.0)  # the grace exactly: still exported, as finished
        within = exposition(c)
        clock.advance(0.5)
        gone = exposition(c)
        again = c.post("/v1/runs/done/finish")  # still known to the store: idempotent
        assert post(c, "done", raw_batch(4, step=2, batch_id="b")).status_code == 200
        back = exposition(c)
    assert within["timwatch_run_finished{run=done}"] == 1
    assert gone["timwatch_step{run=open}"] == 1 and gone["timwatch_run_finished{run=open}"] == 0
    assert not any("run=done" in k for k in gone)
    assert again.status_code == 200 and again.json()["already_finished"] is True
    assert back["timwatch_run_finished{run=done}"] == 0  # re-opened by the batch
    assert back["timwatch_batches_total{run=done}"] == 1  # live counters start again


def test_finish_needs_the_write_token(shared_server: ServerProc) -> None:
    run = fresh_run("finish-auth")
    with shared_server.client() as c:
        assert post(c, run, raw_batch(5)).status_code == 200
    url = f"{shared_server.url}/v1/runs/{run}/finish"
    assert httpx.post(url).status_code == 401
    read = httpx.post(url, headers={"Authorization": f"Bearer {SHARED_READ_TOKEN}"})
    assert read.status_code == 401
    with TimwatchClient(shared_server.url, token=SHARED_TOKEN) as client:
        assert client.finish(run)["run"] == run


def timwatch_finish(*args: str) -> subprocess.CompletedProcess[str]:
    return timwatch("finish", *args)


def one_line(p: subprocess.CompletedProcess[str], *fragments: str) -> None:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_cli_finish(shared_server: ServerProc) -> None:
    run = fresh_run("cli-finish")
    with TimwatchClient(shared_server.url, token=SHARED_TOKEN) as client:
        client.ingest(run, as_batch(raw_batch(6, step=4, batch_id="x")))
    at = ["--url", shared_server.url, "--token", SHARED_TOKEN]
    first = timwatch_finish(run, *at)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(f"run {run} finished at ") and first.stdout.endswith(" UTC\n")
    second = timwatch_finish(run, *at, "--json")
    assert second.returncode == 0, second.stderr
    assert '"already_finished":true' in second.stdout.replace(" ", "")
    with shared_server.client() as c:
        assert listed(c, run)["finished_at"] is not None
    shown = timwatch("runs", "--json", *at)
    assert shown.returncode == 0, shown.stderr
    assert next(r for r in loads(shown.stdout) if r["run"] == run)["finished_at"] is not None
    one_line(timwatch_finish(fresh_run("never"), *at), "not found")
    one_line(timwatch_finish("a b", *at), "RUN 'a b'", "run id may contain only")
    read_only = ["--url", shared_server.url, "--token", SHARED_READ_TOKEN]
    one_line(timwatch_finish(run, *read_only), "refused the token", "TIMWATCH_TOKEN")
    one_line(timwatch_finish(run, "--url", "http://127.0.0.1:9"), "cannot reach timwatch")


def test_defaults_keep_idle_runs_a_day_and_finished_ones_five_minutes() -> None:
    assert Settings().run_ttl == DEFAULT_RUN_TTL == 86400
    assert Settings().finish_grace == DEFAULT_FINISH_GRACE == 300
    help_text = subprocess.run(
        [sys.executable, "-m", "timwatch", "serve", "--help"], cwd=REPO, capture_output=True,
        text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    ).stdout  # fmt: skip
    assert "86400" in help_text and "--finish-grace" in help_text


@pytest.fixture
def registry() -> tuple[RunRegistry, float]:
    runs = RunRegistry()  # the defaults
    batch = as_batch(raw_batch(7))
    runs.observe("idle", accumulate(batch), {}, 0)
    runs.observe("ended", accumulate(batch), {}, 0)
    seen = next(s.last_seen for s in runs.snapshot() if s.run == "idle")
    return runs, seen


def test_registry_keeps_an_idle_run_a_day_and_a_finished_one_for_its_grace(
    registry: tuple[RunRegistry, float],
) -> None:
    runs, seen = registry
    assert runs.finish("ended", now=seen + 10) and not runs.finish("unknown")
    assert runs.evict(now=seen + 10 + DEFAULT_FINISH_GRACE - 1) == []
    assert runs.evict(now=seen + 10 + DEFAULT_FINISH_GRACE + 1) == ["ended"]
    assert runs.evict(now=seen + 2 * 3600) == []  # the old one-hour TTL no longer drops it
    assert runs.evict(now=seen + DEFAULT_RUN_TTL + 1) == ["idle"]


def test_registry_finish_keeps_the_first_time_and_a_batch_reopens(
    registry: tuple[RunRegistry, float],
) -> None:
    runs, seen = registry
    runs.finish("ended", now=seen)
    runs.finish("ended", now=seen + 200)  # does not extend the grace
    assert runs.evict(now=seen + DEFAULT_FINISH_GRACE + 1) == ["ended"]
    runs.finish("idle", now=seen)
    runs.observe("idle", accumulate(as_batch(raw_batch(8))), {}, 1)
    assert "idle" in runs and runs.evict(now=seen + DEFAULT_FINISH_GRACE + 1) == []
    assert [s.finished_m for s in runs.snapshot()] == [None]


def test_openapi_documents_finish_conflicts_and_the_tap_header(server: ServerProc) -> None:
    spec = httpx.get(f"{server.url}/openapi.json").json()
    finish = spec["paths"]["/v1/runs/{run}/finish"]["post"]
    assert {"200", "401", "404"} <= set(finish["responses"])
    assert "example" in finish["responses"]["200"]["content"]["application/json"]
    ingest = spec["paths"]["/v1/runs/{run}/batches"]["post"]
    assert "409" in ingest["responses"]
    params = {(p["name"], p["in"]) for p in ingest["parameters"]}
    assert ("Timwatch-Tap-Dropped", "header") in params


def test_the_finish_carries_the_drops_a_tap_could_not_report_before(server: ServerProc) -> None:
    with server.client() as c:
        assert post(c, "fin-drops", raw_batch(5, step=1, batch_id="a")).status_code == 200
        bad = c.post("/v1/runs/fin-drops/finish", headers={"Timwatch-Tap-Dropped": "x"})
        ok = c.post("/v1/runs/fin-drops/finish", headers={"Timwatch-Tap-Dropped": "3"})
        after = exposition(c)
    assert bad.status_code == 422 and "Timwatch-Tap-Dropped" in bad.text
    assert ok.status_code == 200
    assert after["timwatch_tap_dropped_batches_total{run=fin-drops}"] == 3
    assert after["timwatch_run_finished{run=fin-drops}"] == 1
