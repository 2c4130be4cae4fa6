"""The scalar bridge's HTTP side: ``POST/GET /v1/runs/{run}/scalars`` in process (bad input,
idempotence, on SQLite and PostgreSQL) and `Tap.log` against a real `timwatch serve`, through a
trainer restart that sends its steps again."""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.helpers.cli import timwatch
from tests.helpers.inproc import InProcessApp
from tests.helpers.procs import SHARED_TOKEN, ServerProc
from tests.helpers.wire import fresh_run
from timwatch.monitor.core.scalars import MAX_NAMES
from timwatch.monitor.store.scalars import MAX_UNMAPPED
from timwatch.sidecar.tap import Tap


def post(c: Any, run: str, body: Any, **kw: Any) -> Any:
    return c.post(f"/v1/runs/{run}/scalars", json=body, **kw)


def test_post_maps_stores_and_a_resent_step_counts_once(
    app_factory: Callable[..., InProcessApp], db_url: str
) -> None:
    app = app_factory(db=db_url)
    with app.client() as c:
        body = {"step": 3, "source": "verl", "scalars": {"rollout_corr/k3_kl": 2e-3,
                "actor/grad_norm": 0.5, "timing/gen": 1.25}, "nonfinite": ["actor/lr"]}  # fmt: skip
        first = post(c, "r", body)
        assert first.status_code == 200, first.text
        got = first.json()
        assert got["stored"] == ["grad_norm", "learning_rate", "mismatch_kl"]
        assert got["unmapped"] == ["timing/gen"]
        assert got["nonfinite"] == ["actor/lr"]
        assert (got["new"], got["changed"], got["replayed"]) == (4, 0, False)
        again = post(c, "r", body).json()
        assert (again["new"], again["changed"], again["replayed"]) == (0, 0, True)
        body["scalars"]["actor/grad_norm"] = 0.75  # a resumed trainer recomputed the step
        changed = post(c, "r", body).json()
        assert (changed["new"], changed["changed"], changed["replayed"]) == (0, 1, False)
        post(c, "r", {"step": 5, "scalars": {"grad_norm": 1.0, "mismatch_kl": 3e-3}})
        hist = c.get("/v1/runs/r/scalars/series").json()
        assert hist["steps"] == [3, 5]
        assert hist["scalars"]["grad_norm"] == [0.75, 1.0]
        assert hist["scalars"]["mismatch_kl"] == [2e-3, 3e-3]
        assert hist["scalars"]["learning_rate"] == [None, None]
        assert "timing/gen" not in hist["scalars"]
        assert hist["sources"]["mismatch_kl"] is None  # step 5 came with canonical names
        last = c.get("/v1/runs/r/scalars/series", params={"names": "grad_norm", "last": 1}).json()
        assert (last["steps"], last["scalars"]) == ([5], {"grad_norm": [1.0]})
        runs = c.get("/v1/runs").json()
        assert [r["run"] for r in runs["runs"]] == ["r"]
        assert runs["runs"][0]["last_step"] == 5
        assert (runs["runs"][0]["steps"], runs["runs"][0]["scalar_steps"]) == (0, 2)


def test_unmapped_names_are_bounded_per_step(app: InProcessApp) -> None:
    with app.client() as c:
        names = {f"extra/{i}": float(i) for i in range(MAX_UNMAPPED + 5)}
        got = post(c, "r", {"step": 0, "scalars": names}).json()
        assert got["unmapped_dropped"] == 5
        more = post(c, "r", {"step": 0, "scalars": {"extra/new": 1.0, "extra/0": 0.0}}).json()
        assert more["unmapped_dropped"] == 1
        assert more["replayed"]


BAD = [
    ({"scalars": {"loss": 1.0}}, "step"),
    ({"step": -1, "scalars": {"loss": 1.0}}, "step"),
    ({"step": 2**63, "scalars": {"loss": 1.0}}, "step"),
    ({"step": 1.5, "scalars": {"loss": 1.0}}, "step"),
    ({"step": 1, "source": "megatron", "scalars": {"loss": 1.0}}, "source"),
    ({"step": 1, "scalars": {"loss": "1.0"}}, "scalars.loss"),
    ({"step": 1, "scalars": {"loss": None}}, "scalars.loss"),
    ({"step": 1, "scalars": [1.0]}, "scalars"),
    ({"step": 1, "scalars": {}}, "scalars"),
    ({"step": 1, "scalars": {f"n{i}": 1 for i in range(MAX_NAMES + 1)}}, "scalars"),
    ({"step": 1, "scalars": {"loss": 1.0}, "nonfinite": ["loss"]}, "nonfinite[0]"),
    ({"step": 1, "scalars": {"loss": 1.0}, "nonfinite": ["x", 3]}, "nonfinite[1]"),
    ({"step": 1, "scalars": {"loss": 1.0}, "rank": 0}, "rank"),
    ([1, 2], "body"),
]


def test_bad_input_is_a_422_naming_the_field_and_counted(app: InProcessApp) -> None:
    with app.client() as c:
        for body, field in BAD:
            res = post(c, "r", body)
            assert res.status_code == 422, (body, res.text)
            assert res.json()["field"] == field, (body, res.text)
        raw = c.post("/v1/runs/r/scalars", content=b'{"step": 1, "scalars": {"loss": NaN}}')
        assert (raw.status_code, raw.json()["field"]) == (422, "body")
        big = c.post("/v1/runs/r/scalars", content=b" " * (300 * 1024))
        assert big.status_code == 413
        bad_run = post(c, "bad run!", {"step": 1, "scalars": {"loss": 1.0}})
        assert bad_run.status_code == 422
        assert c.get("/v1/runs/r/scalars/series").status_code == 404  # nothing was stored
    counts = app.app.state.runs.scalar_rejected()
    assert counts == {"validation": len(BAD) + 2, "too_large": 1, "unauthorized": 0}


def test_writes_need_the_token(app_factory: Callable[..., InProcessApp]) -> None:
    app = app_factory(token="w")
    with app.client() as c:
        assert post(c, "r", {"step": 1, "scalars": {"loss": 1.0}}).status_code == 401
    with app.client("w") as c:
        assert post(c, "r", {"step": 1, "scalars": {"loss": 1.0}}).status_code == 200
    assert app.app.state.runs.scalar_rejected()["unauthorized"] == 1


def test_tap_log_through_a_real_server_and_a_restarted_trainer(shared_server: ServerProc) -> None:
    run = fresh_run("scalars")
    tap = Tap(shared_server.url, run, SHARED_TOKEN, finish=False)
    for step in range(3):
        tap.log(
            step,
            {"reward": torch.tensor(0.1 * step), "grad_norm": float(step),
             "sampling/sampling_logp_difference/mean": 1e-3 * (step + 1),
             "loss": math.nan if step == 2 else 0.5},
            source="trl",
        )  # fmt: skip
    assert tap.log(9, {"loss": 1.0}, source="not-a-framework") is False
    assert tap.close(30)
    assert tap.stats()["sent"] == 3
    # the trainer restarts from its step-1 checkpoint and logs steps 1 and 2 again
    resumed = Tap(shared_server.url, run, SHARED_TOKEN, finish=False)
    for step in (1, 2):
        resumed.log(
            step,
            {"reward": torch.tensor(0.1 * step), "grad_norm": float(step),
             "sampling/sampling_logp_difference/mean": 1e-3 * (step + 1),
             "loss": math.nan if step == 2 else 0.5},
            source="trl",
        )  # fmt: skip
    assert resumed.close(30)
    stats = resumed.stats()
    assert (stats["sent"], stats["refused"], stats["invalid"]) == (2, 0, 0)
    with shared_server.client() as c:
        hist = c.get(f"/v1/runs/{run}/scalars/series").json()
    assert hist["steps"] == [0, 1, 2]
    assert hist["scalars"]["log_ratio_abs_mean"] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert hist["scalars"]["reward_mean"] == pytest.approx([0.0, 0.1, 0.2])
    assert hist["scalars"]["loss"] == [0.5, 0.5, None]
    assert set(hist["sources"].values()) == {"trl"}


def test_prometheus_shows_the_latest_canonical_scalars_bounded_and_evicted(
    app_factory: Callable[..., InProcessApp],
) -> None:
    from tests.helpers.clock import FakeClock
    from tests.helpers.wire import counters
    from tests.unit.test_exporter import promtool_check

    clock = FakeClock()
    app = app_factory(clock=clock, run_ttl=600.0)
    with app.client() as c:
        post(c, "a", {"step": 1, "source": "verl", "scalars": {"rollout_corr/k3_kl": 1e-3,
             "actor/grad_norm": 0.5, "perf/throughput": 9.0}})  # fmt: skip
        post(c, "a", {"step": 2, "source": "verl", "scalars": {"rollout_corr/k3_kl": 2e-3},
                      "nonfinite": ["actor/grad_norm"]})  # fmt: skip
        post(c, "a", {"step": 1, "source": "verl", "scalars": {"rollout_corr/k3_kl": 5.0}})
        post(c, "b", {"step": 7, "scalars": {"reward_mean": 0.25}})
        post(c, "b", {"step": "x", "scalars": {}})
        text = c.get("/metrics").text
        promtool_check(text)
        got = counters(text)
        assert got["timwatch_scalar_mismatch_kl{run=a,source=verl}"] == 2e-3  # step 2 wins
        assert got["timwatch_scalar_step{run=a,source=verl}"] == 2
        assert "timwatch_scalar_grad_norm{run=a,source=verl}" not in got  # NaN at step 2
        assert got["timwatch_scalar_reward_mean{run=b,source=}"] == 0.25
        assert got["timwatch_rejected_scalar_posts_total{reason=validation}"] == 1
        assert not [k for k in got if "throughput" in k]  # unmapped names are not exported
        clock.advance(601.0)
        after = counters(c.get("/metrics").text)
        assert not [k for k in after if k.startswith("timwatch_scalar_")]


def test_a_scalars_only_run_in_timwatch_query(shared_server: ServerProc) -> None:
    import subprocess

    from tests.helpers.procs import SHARED_READ_TOKEN
    from timwatch.monitor.client import TimwatchClient

    run = fresh_run("scalars-cli")
    with TimwatchClient(shared_server.url, token=SHARED_TOKEN) as c:
        for step in range(3):
            c.post_scalars(
                run, step, {"vllm_kl": -1e-3 * step, "policy_loss": 0.5 + step},
                source="openrlhf", nonfinite=["actor_lr"] if step == 1 else (),
            )  # fmt: skip

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return timwatch(
            "query", run, *args, "--url", shared_server.url, "--token", SHARED_READ_TOKEN
        )

    csv = cli("--scalars", "-m", "kl_k1", "-m", "loss", "-m", "learning_rate", "--csv")
    assert csv.returncode == 0, csv.stderr
    assert csv.stdout.splitlines() == [
        "step,kl_k1,loss,learning_rate",
        "0,0.0,0.5,",
        "1,-0.001,1.5,",
        "2,-0.002,2.5,",
    ]
    table = cli("--scalars", "--last", "1")
    assert table.returncode == 0, table.stderr
    assert "from: openrlhf" in table.stdout and "2.5" in table.stdout
    bad = cli("--scalars", "-m", "vllm_kl")
    assert bad.returncode == 2 and "unknown scalar 'vllm_kl'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.filterwarnings("error:No artists with labels")  # an empty panel has no legend
def test_a_scalars_only_run_renders_in_the_report(app: InProcessApp) -> None:
    with app.client() as c:
        for step in range(4):
            post(c, "r", {"step": step, "source": "verl", "scalars": {
                "rollout_corr/k3_kl": 1e-3 * (step + 1), "rollout_corr/rollout_is_mean": 1.0,
                "actor/grad_norm": 0.5, "critic/score/mean": 0.1 * step}})  # fmt: skip
        res = c.get("/v1/runs/r/report.html")
        empty = c.get("/v1/runs/r/report.html", params={"from_step": 10})
    assert res.status_code == 200, res.text
    page = res.text
    assert "its metrics came from the trainer's scalars only" in page
    section = page[page.index('id="scalars"') : page.index('id="details"')]
    assert "came from the trainer's own logged scalars (source: verl)" in section
    titles = ["mismatch, from trainer scalars", "the trainer's own correction numbers",
              "reward_mean (trainer health)", "grad_norm (trainer health)"]  # fmt: skip
    for title in titles:
        assert f'alt="{html.escape(title)}"' in section, title
    assert section.count("<img") == len(titles)
    assert empty.status_code == 200 and "no trainer scalars in this range" in empty.text


def test_diagnose_says_a_run_sent_only_scalars(shared_server: ServerProc) -> None:

    from tests.helpers.procs import SHARED_READ_TOKEN
    from timwatch.monitor.client import TimwatchClient

    run = fresh_run("scalars-diag")
    with TimwatchClient(shared_server.url, token=SHARED_TOKEN) as c:
        for step in (4, 5):
            c.post_scalars(run, step, {"mismatch_kl/mean": 0.03, "entropy/mean": step / 16},
                           source="prime_rl")  # fmt: skip
        diag = c.diagnosis(run)
    assert diag["steps"] == 0 and diag["causes"] == []
    assert diag["scalars"] == {
        "steps": 2, "from_step": 4, "to_step": 5, "sources": ["prime_rl"],
        "last": {"entropy": 0.3125, "mismatch_kl": 0.03},
    }  # fmt: skip
    for n in diag["not_checked"]:
        assert "sent only its trainer's scalars (2 steps, from prime_rl)" in n["reason"]
    out = timwatch("diagnose", run, "--url", shared_server.url, "--token", SHARED_READ_TOKEN)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "trainer scalars: 2 steps (4–5) from prime_rl" in text
    assert "not read by the rules" in text


def test_migration_0007_down_and_up_keeps_batches_and_drops_only_scalars(db_url: str) -> None:
    from sqlalchemy import inspect

    from tests.service.test_identity import _alembic
    from timwatch.monitor.core.scalars import map_scalars
    from timwatch.monitor.store import Store

    store = Store(db_url)
    try:
        store.record_scalars("r", 1, None, map_scalars({"loss": 1.0}))
        _alembic(store, "0006")
        assert "step_scalars" not in inspect(store.engine).get_table_names()
        assert store.run_exists("r")  # the run itself stays
    finally:
        store.close()
    store = Store(db_url)  # upgrades to head again
    try:
        assert store.query_scalars("r")["steps"] == []
        answer = store.record_scalars("r", 1, None, map_scalars({"loss": 2.0}))
        assert answer["new"] == 1
    finally:
        store.close()


def test_tap_log_counts_a_bad_dict_as_invalid_and_sends_nothing(shared_server: ServerProc) -> None:
    run = fresh_run("scalars-bad")
    tap = Tap(shared_server.url, run, SHARED_TOKEN, finish=False)
    assert tap.log(1, {"loss": "high"}) is True  # checked on the shipper thread, not here
    assert tap.log(2, {"loss": 0.5, "weird\nname": 1.0}) is True
    assert tap.log(3, {"loss": 0.25}) is True
    assert tap.close(30)
    stats = tap.stats()
    assert (stats["invalid"], stats["sent"], stats["refused"]) == (2, 1, 0)
    with shared_server.client() as c:
        assert c.get(f"/v1/runs/{run}/scalars/series").json()["steps"] == [3]
