"""Batch ids of the trainer tap and `close()` finishing the run.

Ids are checked against a real `timwatch serve`: what matters is that the monitor stores every
batch of a restarted trainer and of two processes sharing a rank (its ``batches`` per step), and
that identical content on one step is stored once. Whether close() sends the finish POST is
checked in the real server's access log and, for the exact request, with
`tests.helpers.tap_standin.StandIn` (a server that records requests, nothing more).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from tests.helpers.batches import random_batch
from tests.helpers.procs import ServerProc
from tests.helpers.tap_standin import StandIn
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.digest import batch_digest
from timwatch.sidecar.tap import Tap
from timwatch.sidecar.tap.wire import batch_id_for


def arrays_of(seed: int) -> dict[str, np.ndarray]:
    raw = random_batch(
        np.random.default_rng(seed), n_seq=4, max_len=30, optional="all", extreme_masked=False
    )
    return dict(raw.arrays)


def stored(server: ServerProc, run: str, step: int) -> dict[str, Any]:
    with server.client() as c:
        res = c.get(f"/v1/runs/{run}/steps/{step}")
    assert res.status_code == 200, res.text
    return dict(res.json())


def test_a_restarted_trainer_on_the_same_run_loses_nothing(server: ServerProc) -> None:
    first = Tap(server.url, "restart", rank=0)
    for step in range(3):
        assert first.report(step, **arrays_of(step))
    assert first.close(30, finish=False)
    again = Tap(server.url, "restart", rank=0)  # same run, rank and steps; new data
    for step in range(3):
        assert again.report(step, **arrays_of(100 + step))
    assert again.close(30)
    assert again.stats()["sent"] == first.stats()["sent"] == 3
    for step in range(3):
        row = stored(server, "restart", step)
        assert row["batches"] == 2
        masked = sum(int(arrays_of(s)["loss_mask"].sum()) for s in (step, 100 + step))
        assert row["row"]["tokens"] == masked  # both trainers' tokens are in the step


def test_two_taps_sharing_a_rank_lose_nothing(server: ServerProc) -> None:
    a = Tap(server.url, "shared-rank", rank=0)
    b = Tap(server.url, "shared-rank", rank=0)
    for step in range(3):
        assert a.report(step, **arrays_of(step))
        assert b.report(step, **arrays_of(50 + step))
    assert a.close(30, finish=False) and b.close(30, finish=False)
    assert a.stats()["refused"] == b.stats()["refused"] == 0
    assert [stored(server, "shared-rank", s)["batches"] for s in range(3)] == [2, 2, 2]


def test_identical_content_twice_on_a_step_is_stored_once(server: ServerProc) -> None:
    tap = Tap(server.url, "twice", rank=0)
    same = arrays_of(7)
    tap.report(4, **same)
    tap.report(4, **{k: v.copy() for k, v in same.items()})  # a genuine duplicate: one replay
    tap.report(4, **arrays_of(8))
    assert tap.close(30, finish=False)
    assert tap.stats()["sent"] == 3
    assert stored(server, "twice", 4)["batches"] == 2


def test_generated_ids_follow_the_content_not_the_call_count(stand_in: StandIn) -> None:
    tap = Tap(stand_in.url, "ids", rank=1)
    for step, seed in ((5, 1), (5, 2), (6, 1), (5, 1)):
        tap.report(step, **arrays_of(seed))
    tap.report(6, **arrays_of(9), batch_id="mine")
    assert tap.close(10)
    got = [r["batch"] for r in stand_in.batches()]
    ids = [b.batch_id for b in got]
    for b in got[:4]:
        plain = Batch.from_arrays(**b.arrays(), step=b.step, policy_version=b.policy_version)
        assert b.batch_id == f"tap-r1-s{b.step}-{batch_digest(plain)[:24]}"
        assert b.batch_id == batch_id_for("tap-r1", plain)
    assert len(set(ids[:3])) == 3  # new content or a new step: a new id
    assert ids[3] == ids[0]  # the same content on the same step again: the same id
    assert ids[4] == "mine"


def test_close_posts_finish_after_the_last_batch(stand_in: StandIn) -> None:
    tap = Tap(stand_in.url, "fin", token="tok", rank=0)
    tap.report(1, **arrays_of(1))
    tap.report(2, **arrays_of(2))
    assert tap.close(10)
    paths = [r["path"] for r in stand_in.requests]
    assert paths == ["/v1/runs/fin/batches"] * 2 + ["/v1/runs/fin/finish"]
    assert stand_in.requests[-1]["headers"]["Authorization"] == "Bearer tok"
    assert tap.stats()["finished"] is True


@pytest.mark.parametrize("where", ["constructor", "close"])
def test_finish_false_keeps_the_run_open(stand_in: StandIn, where: str) -> None:
    tap = Tap(stand_in.url, "open", rank=0, finish=where != "constructor")
    tap.report(1, **arrays_of(1))
    assert tap.close(10, finish=False if where == "close" else None)
    assert [r["path"] for r in stand_in.requests] == ["/v1/runs/open/batches"]
    assert tap.stats()["finished"] is None


def test_a_tap_that_never_reported_finishes_nothing(stand_in: StandIn) -> None:
    Tap(stand_in.url, "idle", rank=0).close(5)
    assert stand_in.requests == []


def test_a_refused_finish_is_logged_not_raised(
    stand_in: StandIn, caplog: pytest.LogCaptureFixture
) -> None:
    stand_in.script = [(200, {}), (404, {}, {"detail": "unknown run 'gone'"})]
    tap = Tap(stand_in.url, "gone", rank=0)
    tap.report(1, **arrays_of(1))
    with caplog.at_level(logging.WARNING, logger="timwatch.tap"):
        assert tap.close(10)
    assert tap.stats()["finished"] is False
    assert any(
        "finish run gone" in r.getMessage() and "404" in r.getMessage() for r in caplog.records
    )


def test_close_finishes_on_the_real_server_without_raising(server_factory: Any) -> None:
    srv = server_factory(args=["--log-level", "debug"])  # debug turns uvicorn's access log on
    tap = Tap(srv.url, "real-finish", rank=0)
    tap.report(1, **arrays_of(1))
    assert tap.close(30)
    assert tap.stats()["finished"] is True
    assert "POST /v1/runs/real-finish/finish" in srv.output()
    assert stored(srv, "real-finish", 1)["batches"] == 1
    assert finished_at(srv, "real-finish") is not None


def finished_at(server: ServerProc, run: str) -> float | None:
    with server.client() as c:
        runs = {r["run"]: r for r in c.get("/v1/runs").json()["runs"]}
    return runs[run]["finished_at"]  # type: ignore[no-any-return]


def test_a_with_block_ending_in_an_exception_does_not_finish(stand_in: StandIn) -> None:
    with pytest.raises(RuntimeError), Tap(stand_in.url, "crash", rank=0) as tap:
        tap.report(1, **arrays_of(1))
        raise RuntimeError("the trainer died")
    assert [r["path"] for r in stand_in.requests] == ["/v1/runs/crash/batches"]


def test_a_trainer_that_crashes_ships_its_batches_but_does_not_finish(
    server: ServerProc, tmp_path: Any
) -> None:
    """Interpreter exit after an uncaught exception flushes (atexit) without finishing, so
    the stall alert of a dead trainer still fires."""
    import subprocess
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(
        "import numpy as np\n"
        "from timwatch.sidecar.tap import Tap\n"
        f"tap = Tap({server.url!r}, 'died', rank=0)\n"
        "n = 8\n"
        "tap.report(1, cu_seqlens=np.array([0, n]), logp_rollout=-np.ones(n),"
        " logp_train=-np.ones(n), entropy=np.ones(n), loss_mask=np.ones(n, np.uint8))\n"
        "raise SystemExit('crash')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert stored(server, "died", 1)["batches"] == 1
    assert finished_at(server, "died") is None


def test_finish_against_a_monitor_that_is_down_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tap = Tap(f"http://127.0.0.1:{port}", "down", rank=0, max_retries=0)
    tap.report(1, **arrays_of(1))
    with caplog.at_level(logging.WARNING, logger="timwatch.tap"):
        tap.close(5)
    assert tap.stats()["finished"] is False
    assert any("could not finish run down" in r.getMessage() for r in caplog.records)


def test_drops_still_unreported_at_close_ride_on_the_finish(stand_in: StandIn) -> None:
    stand_in.script = [(503, {"Retry-After": "0"}), (200, {})]
    tap = Tap(stand_in.url, "fin-lost", rank=0, max_retries=0)
    tap.report(1, **arrays_of(1))  # refused once and given up: one batch the monitor never saw
    assert tap.close(10)
    last = stand_in.requests[-1]
    assert last["path"] == "/v1/runs/fin-lost/finish"
    assert last["headers"]["Timwatch-Tap-Dropped"] == "1"
    assert tap.stats()["unreported_drops"] == 0 and tap.stats()["finished"] is True
