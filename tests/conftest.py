"""Fixtures for the service tests: real uvicorn server processes and a real PostgreSQL.

Servers run as ``python -m monitor.service_cli serve`` subprocesses on free 127.0.0.1 ports.
PostgreSQL comes from ``TIMWATCH_TEST_PG_URL`` (``.ci/start-postgres.sh`` prints one); each
test that asks for it gets a fresh database. In CI (``CI`` set) a missing PostgreSQL fails the
test instead of skipping it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_process(args: list[str], ready_url: str) -> Iterator[subprocess.Popen[bytes]]:
    """`python ARGS` from the repo root (repo and tests/ importable), up once `ready_url` answers
    200; terminated (then killed) on exit."""
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"{args[:2]} exited with {proc.returncode}"
            try:
                if httpx.get(ready_url, timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{ready_url} never came up"
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class ServerProc:
    """A running ``timwatch serve`` subprocess."""

    db: str
    port: int
    args: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    token: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerProc:
        cmd = [
            sys.executable, "-m", "monitor.service_cli", "serve",
            "--host", "127.0.0.1", "--port", str(self.port), "--db", self.db,
            "--log-level", "warning", *self.args,
        ]  # fmt: skip
        out = self.log.open("ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not come up:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def client(self, token: str | None = None) -> httpx.Client:
        tok = token if token is not None else self.token
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60.0)


def _server_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("TIMWATCH_TOKEN", "TIMWATCH_READ_TOKEN")
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProc]]:
    """Start servers: ``server_factory(db=None, args=[...], env={...}, token=None)``."""
    started: list[ServerProc] = []

    def make(
        db: str | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        token: str | None = None,
        start: bool = True,
    ) -> ServerProc:
        db = db or f"sqlite:///{tmp_path / f'tw-{len(started)}.db'}"
        srv = ServerProc(
            db=db,
            port=free_port(),
            args=list(args or []),
            env=_server_env(env),
            log=tmp_path / f"server-{len(started)}.log",
            token=token,
        )
        started.append(srv)
        return srv.start() if start else srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def server(server_factory: Callable[..., ServerProc]) -> ServerProc:
    """One server on a fresh SQLite file, writes open."""
    return server_factory()


def _pg_base_url() -> str | None:
    url = os.environ.get("TIMWATCH_TEST_PG_URL")
    if url:
        return url
    if os.environ.get("CI") or os.environ.get("TIMWATCH_REQUIRE_PG"):
        pytest.fail("CI is set but TIMWATCH_TEST_PG_URL is not: PostgreSQL tests must run in CI")
    pytest.skip("TIMWATCH_TEST_PG_URL not set (bash .ci/start-postgres.sh prints one)")
    return None


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test (dropped afterwards)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    base = _pg_base_url()
    assert base is not None
    name = f"tw_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each store test runs on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return str(request.getfixturevalue("pg_url"))
