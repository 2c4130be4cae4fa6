"""Serving under a stuck or full store, and under load: real ``timwatch serve`` subprocesses.

* A held store lock (SQLite ``BEGIN IMMEDIATE`` from another connection; PostgreSQL
  ``LOCK TABLE … ACCESS EXCLUSIVE`` or a row lock from another connection) gives every writer
  503 + ``Retry-After`` while ``/metrics`` (auth enforced) and ``/healthz`` keep answering; after
  the release writes succeed. The clients time out after 10 s: before writers failed fast, 16
  queued writers took 16 × 5 s to drain, so that bound is what catches a regression (the tests
  assert answers, never durations).
* A real full disk: a 2 MiB tmpfs (we run as root in CI; without root the test is skipped)
  filled by a file makes SQLite fail with SQLITE_FULL. ``/healthz`` says degraded until a write
  succeeds again; starting on it is one line and exit 2.
* The in-flight byte budget (``--max-inflight``) refuses what does not fit with 503 before the
  body is read; a chunked body over ``--max-body`` is cut off with 413 (uvicorn then reads and
  drops the rest of the upload: the budget is back to 0 and the server keeps serving).
"""

from __future__ import annotations

import errno
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.batches import RawBatch
from tests.helpers.procs import ServerProc, free_port, server_env
from tests.helpers.wire import SAFETENSORS, counters, post, raw_batch

Factory = Callable[..., ServerProc]
WRITE, READ = "w-token", "r-token"
TOKENS = {"TIMWATCH_TOKEN": WRITE, "TIMWATCH_READ_TOKEN": READ}


def _client(srv: ServerProc, token: str | None = WRITE) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=srv.url, headers=headers, timeout=10.0)


def _concurrent_posts(srv: ServerProc, run: str, n: int, step: int) -> list[httpx.Response]:
    def one(i: int) -> httpx.Response:
        with _client(srv) as c:
            return post(c, run, raw_batch(100 + i, step=step, batch_id=f"c{i}"), "safetensors")

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _assert_serving_while_locked(srv: ServerProc) -> None:
    """/metrics answers with the read or the write token (401 without), /healthz answers."""
    with _client(srv, READ) as c:
        m = c.get("/metrics")
        assert m.status_code == 200 and 'timwatch_tokens_total{run="warm"}' in m.text
    with _client(srv, None) as c:
        assert c.get("/metrics").status_code == 401
        health = c.get("/healthz")
    with _client(srv, WRITE) as c:
        assert c.get("/metrics").status_code == 200
    assert health.status_code == 503, health.text
    body = health.json()
    assert body["status"] == "degraded" and body["write_error"], body
    assert body["consecutive_write_failures"] >= 1


def _assert_all_refused(answers: list[httpx.Response]) -> None:
    for r in answers:
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1


def _post_as_a_collector(c: httpx.Client, run: str, raw: RawBatch) -> httpx.Response:
    """POST, and once more after ``Retry-After`` if refused: for `WRITE_LOCK_TIMEOUT_S` after a
    failed write new writers answer 503 at once, so the first try may still be refused."""
    r = post(c, run, raw, "safetensors")
    if r.status_code == 503:
        time.sleep(float(r.headers["Retry-After"]))
        r = post(c, run, raw, "safetensors")
    return r


def _refusals(srv: ServerProc) -> float:
    with _client(srv) as c:
        expo = counters(c.get("/metrics").text)
    return sum(
        expo[f"timwatch_rejected_batches_total{{reason={r}}}"]
        for r in ("store_unavailable", "overloaded")
    )


def test_locked_sqlite_fails_writers_fast_and_metrics_healthz_answer(
    server_factory: Factory, tmp_path: Path
) -> None:
    path = tmp_path / "locked.db"
    srv = server_factory(db=f"sqlite:///{path}", env=TOKENS, token=WRITE)
    with _client(srv) as c:
        assert (
            post(c, "warm", raw_batch(1, step=0, batch_id="w0"), "safetensors").status_code == 200
        )
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    try:
        answers = _concurrent_posts(srv, "locked", 16, step=1)
        _assert_serving_while_locked(srv)
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    _assert_all_refused(answers)
    assert _refusals(srv) == 16
    with _client(srv) as c:
        ok = _post_as_a_collector(c, "locked", raw_batch(100, step=1, batch_id="c0"))
        assert ok.status_code == 200 and ok.json()["replayed"] is False, ok.text
        health = c.get("/healthz")
    assert health.status_code == 200 and health.json()["write_error"] is None, health.text


def test_postgres_table_and_row_locks_fail_writers_fast(
    server_factory: Factory, pg_url: str
) -> None:
    from sqlalchemy import create_engine, text

    srv = server_factory(db=pg_url, env=TOKENS, token=WRITE)
    with _client(srv) as c:
        assert (
            post(c, "warm", raw_batch(1, step=0, batch_id="w0"), "safetensors").status_code == 200
        )
    other = create_engine(pg_url)
    try:
        with other.connect() as conn, conn.begin():
            conn.execute(text("LOCK TABLE steps IN ACCESS EXCLUSIVE MODE"))
            table_locked = _concurrent_posts(srv, "pglock", 8, step=1)
            _assert_serving_while_locked(srv)
        with other.connect() as conn, conn.begin():
            conn.execute(
                text("SELECT state FROM step_details WHERE run_id = 'warm' AND step = 0 FOR UPDATE")
            )
            with _client(srv) as c:
                row_locked = post(c, "warm", raw_batch(2, step=0, batch_id="w1"), "safetensors")
    finally:
        other.dispose()
    _assert_all_refused([*table_locked, row_locked])
    with _client(srv) as c:
        assert (
            post(c, "pglock", raw_batch(100, step=1, batch_id="c0"), "safetensors").status_code
            == 200
        )
        assert (
            post(c, "warm", raw_batch(2, step=0, batch_id="w1"), "safetensors").status_code == 200
        )
        assert c.get("/healthz").status_code == 200


@contextmanager
def _tmpfs(where: Path, size: str = "2m") -> Iterator[Path]:
    where.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)  # fmt: skip
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {p.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(directory: Path) -> Path:
    """A file taking every free byte of `directory`'s file system."""
    fill = directory / "fill"
    # unbuffered: a write the disk took only part of leaves nothing for close() to flush
    with fill.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return fill


def test_full_disk_degrades_healthz_until_a_write_succeeds(
    server_factory: Factory, tmp_path: Path
) -> None:
    """A real full disk (tmpfs), not a simulation: SQLite's own SQLITE_FULL error."""
    with _tmpfs(tmp_path / "disk") as disk:
        srv = server_factory(db=f"sqlite:///{disk / 'tw.db'}", token=None)
        try:
            with httpx.Client(base_url=srv.url, timeout=10.0) as c:
                assert post(c, "disk", raw_batch(1, step=0), "safetensors").status_code == 200
                assert c.get("/healthz").json()["status"] == "ok"
                fill = _fill(disk)
                refused: dict[str, Any] | None = None
                for i in range(40):  # the WAL may absorb a few writes in pages it already has
                    r = post(c, "disk", raw_batch(10 + i, step=1 + i, batch_id=None), "safetensors")
                    if r.status_code != 200:
                        assert r.status_code == 503 and "Retry-After" in r.headers, r.text
                        refused = r.json()
                        break
                assert refused is not None, "the full disk never refused a write"
                health = c.get("/healthz")
                assert health.status_code == 503, health.text
                body = health.json()
                assert body["status"] == "degraded" and body["write_error"], body
                assert body["write_error"] in refused["detail"]
                assert c.get("/metrics").status_code == 200
                fill.unlink()
                again = _post_as_a_collector(c, "disk", raw_batch(99, step=99, batch_id="after"))
                assert again.status_code == 200 and again.json()["replayed"] is False, again.text
                health = c.get("/healthz")
                assert health.status_code == 200 and health.json()["status"] == "ok", health.text
                assert body["write_error"] in health.json()["last_write_error"]
        finally:
            srv.stop()


def _serve(db: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "timwatch", "serve", "--port", str(free_port()), "--db", db]
    env = server_env({"TIMWATCH_DEBUG": ""})
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def _one_line(p: subprocess.CompletedProcess[str], *fragments: str) -> None:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and lines[0].startswith("timwatch serve: "), lines
    assert all(f in lines[0] for f in fragments), (fragments, lines[0])


def test_startup_errors_are_one_line_and_exit_2(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "full", size="256k") as disk:
        _fill(disk)
        _one_line(_serve(f"sqlite:///{disk / 'tw.db'}", cwd=tmp_path), "cannot open", "tw.db")
    _one_line(_serve("postgresql+psycopg://u:p@127.0.0.1:1/x", cwd=tmp_path), "cannot connect")
    _one_line(_serve("sqlite:////proc/x.db", cwd=tmp_path), "cannot open", "/proc/x.db")
    db = f"sqlite:///{tmp_path / 'ok.db'}"
    _one_line(_serve(db, "--max-body", "1000", "--max-inflight", "999", cwd=tmp_path),
              "--max-inflight")  # fmt: skip


def test_inflight_budget_refuses_what_does_not_fit_then_both_succeed(
    server_factory: Factory,
) -> None:
    big = raw_batch(7, step=1, batch_id="big-a", n_seq=700).to_safetensors_bytes()
    other = raw_batch(8, step=1, batch_id="big-b", n_seq=700).to_safetensors_bytes()
    budget = len(big) + len(big) // 2  # room for one of them, not two
    srv = server_factory(args=["--max-body", str(len(big) + 4096), "--max-inflight", str(budget)])
    proceed = threading.Event()

    def slow() -> Iterator[bytes]:  # declares its length, then holds the rest back
        yield big[: len(big) // 2]
        assert proceed.wait(30)
        yield big[len(big) // 2 :]

    def first() -> httpx.Response:
        with httpx.Client(base_url=srv.url, timeout=30.0) as c:
            headers = {**SAFETENSORS, "Content-Length": str(len(big))}
            return c.post("/v1/runs/budget/batches", content=slow(), headers=headers)

    def chunked(n: int) -> Iterator[bytes]:
        for i in range(0, len(other), n):
            yield other[i : i + n]

    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=srv.url, timeout=30.0) as c:
        held = pool.submit(first)
        for _ in range(300):
            if c.get("/healthz").json()["inflight_bytes"] == len(big):
                break
            threading.Event().wait(0.05)
        assert c.get("/healthz").json()["inflight_bytes"] == len(big)
        refused = c.post("/v1/runs/budget/batches", content=other, headers=SAFETENSORS)
        streamed = c.post("/v1/runs/budget/batches", content=chunked(65536), headers=SAFETENSORS)
        proceed.set()
        done = held.result(timeout=60)
        assert c.get("/healthz").json()["inflight_bytes"] == 0
        again = c.post("/v1/runs/budget/batches", content=other, headers=SAFETENSORS)
        expo = counters(c.get("/metrics").text)
    for r in (refused, streamed):
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
        assert "--max-inflight" in r.json()["detail"]
    assert done.status_code == 200 and again.status_code == 200, (done.text, again.text)
    assert expo["timwatch_rejected_batches_total{reason=overloaded}"] == 2
    assert expo["timwatch_batches_total{run=budget}"] == 2


def test_chunked_body_over_max_body_is_cut_off_with_413(server_factory: Factory) -> None:
    limit = 256 * 1024
    srv = server_factory(args=["--max-body", str(limit)])
    sent = 0

    def endless() -> Iterator[bytes]:
        nonlocal sent
        while sent < 16 * 1024 * 1024:  # bounded: 64 × the limit
            sent += 65536
            yield b"\0" * 65536

    with httpx.Client(base_url=srv.url, timeout=30.0) as c:
        r = c.post("/v1/runs/chunky/batches", content=endless(), headers=SAFETENSORS)
        assert r.status_code == 413 and str(limit) in r.json()["detail"], r.text
        health = c.get("/healthz")
        expo = counters(c.get("/metrics").text)
    assert health.status_code == 200 and health.json()["inflight_bytes"] == 0
    assert expo["timwatch_rejected_batches_total{reason=too_large}"] == 1


def test_a_client_that_disconnects_mid_upload_gives_its_bytes_back(server_factory: Factory) -> None:
    srv = server_factory(args=["--max-body", "1000000", "--max-inflight", "1000000"])
    head = (
        b"POST /v1/runs/gone/batches HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/x-safetensors\r\nContent-Length: 900000\r\n\r\n"
    )
    with httpx.Client(base_url=srv.url, timeout=10.0) as c:
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(head + b"\0" * 1000)
            for _ in range(200):
                if c.get("/healthz").json()["inflight_bytes"] == 900000:
                    break
                threading.Event().wait(0.05)
            assert c.get("/healthz").json()["inflight_bytes"] == 900000
        for _ in range(200):  # the disconnect reaches the server's body read
            if c.get("/healthz").json()["inflight_bytes"] == 0:
                break
            threading.Event().wait(0.05)
        assert c.get("/healthz").json()["inflight_bytes"] == 0
        ok = post(c, "gone", raw_batch(3, step=1), "safetensors")
    assert ok.status_code == 200, ok.text
