"""The HTTP API (docs/reference/api.md): in process on a real store (SQLite file, PostgreSQL
where the test is about it); what needs a process (bytes over a real socket, tokens from the
environment, the CLI against a URL) on the session's shared ``timwatch serve``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest

from tests.helpers.batches import split_at
from tests.helpers.cli import timwatch
from tests.helpers.inproc import InProcessApp
from tests.helpers.procs import REPO, SHARED_MAX_BODY, SHARED_READ_TOKEN, SHARED_TOKEN, ServerProc
from tests.helpers.wire import SAFETENSORS, as_batch, counters, fresh_run, norm, post, raw_batch
from timwatch.monitor.client import TimwatchClient, decode_masks
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.jsoncodec import dumps, loads
from timwatch.monitor.core.masks import POLICIES, PolicyParams, keep_masks
from timwatch.monitor.core.row import derive_row

AppFactory = Callable[..., InProcessApp]


def test_json_and_safetensors_rows_are_identical_and_equal_the_engine(app: InProcessApp) -> None:
    raw = raw_batch(1, step=7, batch_id=None)
    expected = norm(derive_row(accumulate(as_batch(raw))).to_dict())
    with app.client() as c:
        rj = post(c, "json-run", raw, "json")
        rs = post(c, "st-run", raw, "safetensors")
    assert rj.status_code == 200, rj.text
    assert rs.status_code == 200, rs.text
    aj, as_ = rj.json(), rs.json()
    assert aj["row"] == as_["row"]
    assert aj["row"] == expected
    assert aj["step_row"] == expected  # the only batch of its step
    assert (aj["run"], aj["step"], aj["replayed"]) == ("json-run", 7, False)


def test_answer_equals_timwatch_analyze_json(app: InProcessApp, tmp_path: Path) -> None:
    raw = raw_batch(2, step=3)
    path = tmp_path / "batch.safetensors"
    path.write_bytes(raw.to_safetensors_bytes())
    proc = timwatch("analyze", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    with app.client() as c:
        r = post(c, "analyze-run", raw, "safetensors")
    assert r.status_code == 200, r.text
    assert r.json()["row"] == norm(loads(proc.stdout))


def test_two_half_batches_combine_to_the_step_row(app: InProcessApp) -> None:
    raw = raw_batch(3, step=11, n_seq=16)
    cu = raw.arrays["cu_seqlens"]
    k = next(k for k in range(8, raw.num_sequences) if 0 < cu[k] < raw.num_tokens)
    a, b = split_at(raw, k)
    a = dataclasses.replace(a, step=11, batch_id="rank0")
    b = dataclasses.replace(b, step=11, batch_id="rank1")
    acc_a, acc_b = accumulate(as_batch(a)), accumulate(as_batch(b))
    merged = norm(derive_row(acc_a.merge(acc_b)).to_dict())
    whole = norm(derive_row(accumulate(as_batch(raw))).to_dict())
    with app.client() as c:
        ra = post(c, "halves", a, "safetensors")
        rb = post(c, "halves", b, "json")
        step = c.get("/v1/runs/halves/steps/11").json()
    assert ra.status_code == rb.status_code == 200
    assert ra.json()["row"] == norm(derive_row(acc_a).to_dict())
    assert rb.json()["step_row"] == merged
    assert step["row"] == merged and step["batches"] == 2
    # counts, extrema, histograms and masks combine exactly; sums agree to rounding
    for name in ("tokens", "sequences", "log_ratio_abs_max", "log_ratio_abs_p99", "mask_ratio"):
        assert merged[name] == whole[name], name
    assert merged["heatmap"] == whole["heatmap"]
    assert merged["mismatch_kl"] == pytest.approx(whole["mismatch_kl"], rel=1e-12)
    assert merged["batches"] == 2


def test_replay_is_idempotent_and_leaves_counters(app: InProcessApp) -> None:
    raw = raw_batch(4, step=2, batch_id="once")
    with app.client() as c:
        first = post(c, "replay", raw, "safetensors")
        before = counters(c.get("/metrics").text)
        again = post(c, "replay", raw, "json")
        after = counters(c.get("/metrics").text)
        step = c.get("/v1/runs/replay/steps/2").json()
    assert first.status_code == again.status_code == 200
    assert again.json()["replayed"] is True
    assert {**again.json(), "replayed": False} == first.json()
    assert step["batches"] == 1
    tokens = "timwatch_tokens_total{run=replay}"
    assert before[tokens] == after[tokens] == first.json()["row"]["tokens"]
    assert (
        before["timwatch_batches_total{run=replay}"]
        == after["timwatch_batches_total{run=replay}"]
        == 1
    )


def test_out_of_order_steps(app: InProcessApp) -> None:
    with app.client() as c:
        for step in (5, 3, 9, 4):
            assert post(c, "ooo", raw_batch(10 + step, step=step, batch_id=None)).status_code == 200
        q = c.get("/v1/runs/ooo/metrics", params={"names": "tokens,mismatch_kl"}).json()
        last2 = c.get("/v1/runs/ooo/metrics", params={"names": "tokens", "last": 2}).json()
        window = c.get(
            "/v1/runs/ooo/metrics", params={"names": "tokens", "from_step": 4, "to_step": 5}
        ).json()
        expo = counters(c.get("/metrics").text)
        runs = c.get("/v1/runs").json()["runs"]
    assert q["steps"] == [3, 4, 5, 9]
    assert last2["steps"] == [5, 9] and window["steps"] == [4, 5]
    assert expo["timwatch_step{run=ooo}"] == 9.0  # a late step never moves the gauge back
    assert [r["last_step"] for r in runs if r["run"] == "ooo"] == [9]
    assert [r["steps"] for r in runs if r["run"] == "ooo"] == [4]


def test_invalid_batch_is_refused_whole_and_server_stays_up(app: InProcessApp) -> None:
    raw = raw_batch(5, step=1)
    obj = raw.to_json_obj()
    obj["logp_rollout"][3] = float("nan")
    with app.client() as c:
        r = c.post("/v1/runs/bad/batches", content=json.dumps(obj))  # writes NaN literally
        r2 = c.post("/v1/runs/bad/batches", content=b"{not json")
        arrays = raw.arrays | {"entropy": -raw.arrays["entropy"] - 1.0}
        r3 = post(c, "bad", dataclasses.replace(raw, arrays=arrays), "safetensors")
        r4 = c.post("/v1/runs/bad/batches", content=b"x", headers={"Content-Type": "text/plain"})
        runs = c.get("/v1/runs").json()["runs"]
        expo = counters(c.get("/metrics").text)
        ok = post(c, "good", raw, "json")
    assert r.status_code == 422 and "logp_rollout" in r.json()["detail"], r.text
    assert (r.json()["field"], r.json()["index"]) == ("logp_rollout", 3)
    assert r2.status_code == 422 and "JSON" in r2.json()["detail"]
    assert r3.status_code == 422 and r3.json()["field"] == "entropy" and r3.json()["index"] == 0
    assert r4.status_code == 415
    assert "bad" not in [x["run"] for x in runs]
    assert expo["timwatch_rejected_batches_total{reason=validation}"] == 4
    assert ok.status_code == 200


TOO_LARGE = "timwatch_rejected_batches_total{reason=too_large}"


def test_body_limit_413(shared_server: ServerProc) -> None:
    """Over a real socket: refused on Content-Length and on the streamed size alike."""
    raw = raw_batch(6, n_seq=32)
    body = raw.to_safetensors_bytes()
    assert len(body) > SHARED_MAX_BODY
    big, small_run = fresh_run("big"), fresh_run("small")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the streamed size must be checked too
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    with shared_server.client() as c:
        before = counters(c.get("/metrics").text)[TOO_LARGE]  # the server outlives this test
        r1 = c.post(f"/v1/runs/{big}/batches", content=body, headers=SAFETENSORS)
        r2 = c.post(f"/v1/runs/{big}/batches", content=chunks(), headers=SAFETENSORS)
        expo = counters(c.get("/metrics").text)
        small = raw_batch(7, n_seq=1)
        r3 = post(c, small_run, small, "safetensors")
    assert r1.status_code == 413 and r2.status_code == 413
    assert expo[TOO_LARGE] - before == 2
    assert r3.status_code == 200 or len(small.to_safetensors_bytes()) > SHARED_MAX_BODY


def test_auth_on_writes_and_optional_on_reads(
    app_factory: AppFactory, shared_server: ServerProc
) -> None:
    raw = raw_batch(8)
    srv = app_factory(token="s3cret")
    with srv.client() as anon, srv.client(token="wrong") as wrong, srv.client("s3cret") as ok:
        assert post(anon, "auth", raw).status_code == 401
        assert post(wrong, "auth", raw).status_code == 401
        assert anon.post("/v1/masks", content=dumps(raw.to_json_obj())).status_code == 401
        assert post(ok, "auth", raw).status_code == 200
        assert anon.get("/v1/runs").status_code == 200
        assert anon.get("/metrics").status_code == 200
        expo = counters(anon.get("/metrics").text)
    assert expo["timwatch_rejected_batches_total{reason=unauthorized}"] == 2

    # a process: `timwatch serve` takes both tokens from TIMWATCH_TOKEN / TIMWATCH_READ_TOKEN
    run = fresh_run("auth")
    srv2 = shared_server
    with srv2.client(token="") as anon, srv2.client(token=SHARED_READ_TOKEN) as reader:
        assert anon.get("/v1/runs").status_code == 401
        assert anon.get("/metrics").status_code == 401
        assert anon.get("/healthz").status_code == 200
        assert reader.get("/v1/runs").status_code == 200
        assert reader.get("/metrics").status_code == 200
        assert post(reader, run, raw).status_code == 401  # a read token cannot write


@pytest.mark.parametrize("run", ['a"b', "a\nb", "x" * 10_000, "a b", "ü", "-lead"])
def test_hostile_run_ids_are_refused(app: InProcessApp, run: str) -> None:
    with app.client() as c:
        r = post(c, quote(run, safe=""), raw_batch(9), "json")
        expo = c.get("/metrics")
    assert r.status_code in (404, 422), r.text
    assert run not in expo.text


def test_masks_on_ingest_and_stateless_endpoint(app: InProcessApp) -> None:
    raw = raw_batch(10, step=4)
    batch = as_batch(raw)
    want = keep_masks(batch, ["estr", "icepop", "seq_mis"], PolicyParams())
    tight = keep_masks(batch, list(POLICIES), PolicyParams(tau=0.05, icepop_high=1.01))
    with app.client() as c:
        r = post(c, "masked", raw, "safetensors", masks="estr,icepop,seq_mis")
        s = c.post(
            "/v1/masks",
            content=raw.to_safetensors_bytes(),
            headers=SAFETENSORS,
            params={"policies": "all", "tau": 0.05, "icepop_high": 1.01},
        )
        bad = c.post("/v1/masks", content=dumps(raw.to_json_obj()), params={"policies": "nope"})
        runs = [x["run"] for x in c.get("/v1/runs").json()["runs"]]
    assert r.status_code == 200 and s.status_code == 200, (r.text, s.text)
    got = decode_masks(r.json()["masks"])
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    got2 = decode_masks(s.json())
    assert set(got2) == set(POLICIES)
    for name in POLICIES:
        np.testing.assert_array_equal(got2[name], tight[name])
    assert not tight["estr"].all()  # the parameters really changed something
    assert s.json()["params"]["tau"] == 0.05
    assert bad.status_code == 422
    assert runs == ["masked"]  # /v1/masks stored nothing


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"tau": -1}, "tau"),
        ({"tau": "nan"}, "tau"),
        ({"icepop_low": 5, "icepop_high": 0.5}, "icepop_low"),
        ({"geo_rs_low": 1.01}, "geo_rs_low"),
    ],
)
def test_bad_policy_parameters_answer_422_naming_them(
    app: InProcessApp, params: dict[str, Any], named: str
) -> None:
    raw = raw_batch(11)
    with app.client() as c:
        r = c.post("/v1/masks", content=dumps(raw.to_json_obj()), params=params)
        alive = c.get("/healthz")
    assert r.status_code == 422, r.text
    assert named in r.json()["detail"]
    assert alive.status_code == 200


def test_metrics_query_names_csv_and_errors(app: InProcessApp) -> None:
    raws = [raw_batch(20 + s, step=s, batch_id=f"q{s}") for s in range(5)]
    rows = [norm(derive_row(accumulate(as_batch(r))).to_dict()) for r in raws]
    with app.client() as c:
        for r in raws:
            assert post(c, "q", r, "safetensors").status_code == 200
        names = "mismatch_kl,mask_ratio.estr,seq_reject_ratio[k3_rs],tokens,policy_version"
        j = c.get("/v1/runs/q/metrics", params={"names": names}).json()
        csv = c.get("/v1/runs/q/metrics", params={"names": "step_x"})
        text = c.get("/v1/runs/q/metrics", params={"names": "mismatch_kl,tokens", "format": "csv"})
        missing = c.get("/v1/runs/nope/metrics", params={"names": "tokens"})
        step = c.get("/v1/runs/q/steps/3").json()
        nostep = c.get("/v1/runs/q/steps/99")
    assert j["steps"] == list(range(5))
    assert j["series"]["mismatch_kl"] == [r["mismatch_kl"] for r in rows]
    assert j["series"]["mask_ratio.estr"] == [r["mask_ratio"]["estr"] for r in rows]
    assert j["series"]["seq_reject_ratio[k3_rs]"] == [r["seq_reject_ratio"]["k3_rs"] for r in rows]
    assert j["series"]["tokens"] == [r["tokens"] for r in rows]
    assert j["series"]["policy_version"] == [r["policy_version"] for r in rows]
    assert csv.status_code == 422 and "step_x" in csv.json()["detail"]
    lines = text.text.strip().splitlines()
    assert lines[0] == "step,mismatch_kl,tokens"
    assert [float(x.split(",")[1]) for x in lines[1:]] == [r["mismatch_kl"] for r in rows]
    assert missing.status_code == 404 and nostep.status_code == 404
    assert step["row"] == rows[3]
    for detail in ("length_buckets", "heatmap", "worst_tokens", "lag_buckets"):
        assert step["row"][detail] == rows[3][detail]


def test_locked_sqlite_answers_503_and_writes_nothing(
    app_factory: AppFactory, tmp_path: Path
) -> None:
    import sqlite3

    path = tmp_path / "locked.db"
    srv = app_factory(db=f"sqlite:///{path}")
    raw = raw_batch(30, step=1, batch_id="locked")
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        with srv.client() as c:
            r = post(c, "lockrun", raw, "safetensors")
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) >= 1
    with srv.client() as c:
        assert c.get("/v1/runs").json()["runs"] == []
        expo = counters(c.get("/metrics").text)
        assert "timwatch_tokens_total{run=lockrun}" not in expo
        assert expo["timwatch_rejected_batches_total{reason=store_unavailable}"] == 1
        time.sleep(float(r.headers["Retry-After"]))  # as a collector does: writes right after a
        again = post(c, "lockrun", raw, "safetensors")  # failure answer it for 0.5 s
        assert again.status_code == 200 and again.json()["replayed"] is False


def test_postgres_down_answers_503_then_recovers(app_factory: AppFactory, pg_url: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    srv = app_factory(db=pg_url)
    name = make_url(pg_url).database
    admin = create_engine(make_url(pg_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    raw = raw_batch(31, step=2, batch_id="pgdown")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
                {"d": name},
            )
        with srv.client() as c:
            down = post(c, "pg", raw, "safetensors")
            health = c.get("/healthz")
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        with srv.client() as c:
            up = post(c, "pg", raw, "safetensors")
            step = c.get("/v1/runs/pg/steps/2").json()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()
    assert down.status_code == 503 and "Retry-After" in down.headers, down.text
    assert health.status_code == 503
    assert up.status_code == 200 and up.json()["replayed"] is False
    assert step["batches"] == 1


def test_openapi_documents_every_endpoint_with_examples(app: InProcessApp) -> None:
    with app.client() as c:
        spec = c.get("/openapi.json").json()
    want = {
        ("post", "/v1/runs/{run}/batches"), ("post", "/v1/masks"), ("get", "/v1/runs"),
        ("get", "/v1/runs/{run}/metrics"), ("get", "/v1/runs/{run}/steps/{step}"),
        ("get", "/v1/runs/{run}/report.html"), ("get", "/metrics"), ("get", "/healthz"),
    }  # fmt: skip
    for method, path in want:
        op = spec["paths"][path][method]
        content = op["responses"]["200"]["content"]
        assert any("example" in v for v in content.values()), (method, path)
        if method == "post":
            body = op["requestBody"]["content"]
            assert "example" in body["application/json"]
            assert "application/x-safetensors" in body


def test_cli_runs_query_show_report(shared_server: ServerProc) -> None:
    run = fresh_run("cli")
    with TimwatchClient(shared_server.url, token=SHARED_TOKEN) as c:
        for s in range(3):
            c.ingest(run, as_batch(raw_batch(40 + s, step=s, batch_id=f"c{s}")))
        series = c.metrics(run, ["mismatch_kl"])["series"]["mismatch_kl"]

    def cli(*args: str) -> str:
        p = timwatch(*args, "--url", shared_server.url, "--token", SHARED_READ_TOKEN)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    assert run in cli("runs")
    csv = cli("query", run, "--metric", "mismatch_kl", "--last", "2", "--csv")
    assert csv.splitlines()[0] == "step,mismatch_kl"
    assert [float(x.split(",")[1]) for x in csv.splitlines()[1:]] == series[1:]
    shown = loads(cli("show", run, "1", "--json"))
    assert shown["step"] == 1 and shown["row"]["mismatch_kl"] == series[1]
    rep = loads(cli("report", run, "--json"))
    assert rep["metrics"]["mismatch_kl"]["max"] == max(series)
    assert rep["metrics"]["mismatch_kl"]["steps"] == 3
    assert "mismatch_kl" in cli("report", run)


def test_serve_refuses_open_public_bind(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "timwatch", "serve", "--host", "0.0.0.0",
         "--db", f"sqlite:///{tmp_path / 'x.db'}"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "TIMWATCH_TOKEN"},
    )  # fmt: skip
    assert p.returncode == 2
    assert "--insecure" in p.stdout + p.stderr
    assert not (tmp_path / "x.db").exists()  # refused before touching the store


@pytest.mark.parametrize(("flag", "value"), [("--tau", "-1"), ("--eps", "0"), ("--tau", "nan")])
def test_serve_refuses_bad_policy_parameters_cleanly(tmp_path: Path, flag: str, value: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "timwatch", "serve", flag, value,
         "--db", f"sqlite:///{tmp_path / 'x.db'}"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2
    assert flag.lstrip("-") in p.stdout + p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "x.db").exists()


def test_history_commands_report_an_unreachable_server_in_one_line() -> None:
    for args in (["runs"], ["query", "r", "--metric", "mismatch_kl"], ["show", "r", "1"]):
        p = subprocess.run(
            [sys.executable, "-m", "timwatch", *args, "--url", "http://127.0.0.1:9"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == 2, args  # a TimwatchError: one line on stderr (CONTRIBUTING.md)
        assert "Traceback" not in p.stderr + p.stdout and not p.stdout, args
        assert len(p.stderr.splitlines()) == 1 and "http://127.0.0.1:9" in p.stderr, args
