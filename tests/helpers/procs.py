"""Processes the tests start: free ports, a generic runner that waits for readiness, and
``timwatch serve`` subprocesses (`ServerProc`) with their log, kill -9 and clients, among them the
one server a test session shares (`shared_server_proc`)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from timwatch.monitor.core.jitguard import STRICT_ENV

__all__ = [
    "REPO",
    "SHARED_MAX_BODY",
    "SHARED_READ_TOKEN",
    "SHARED_TOKEN",
    "ServerProc",
    "answers_200",
    "fake_sglang_process",
    "free_port",
    "running_process",
    "server_env",
    "sglang_proxy_process",
    "shared_server_proc",
    "sqlite_server_proc",
    "stop_process",
]

REPO = Path(__file__).resolve().parents[2]

# The shared server protects writes and reads (tokens from the environment, as deployed) and
# refuses bodies over 32 KiB: every batch the sharing tests send is below it, except the one
# the body-limit test sends on purpose.
SHARED_TOKEN = "shared-write-token"
SHARED_READ_TOKEN = "shared-read-token"
SHARED_MAX_BODY = 32 * 1024


# One client for every readiness probe: `httpx.get` builds a client, and with it an SSL context
# that loads the CA bundle, per call (about 40 ms of CPU here, against 0.3 ms for a request on a
# client), and a start polls 10-20 times while the server it waits on needs the same CPU. No
# keep-alive: each probe opens a new connection, so a server restarted on the same port is
# asked afresh.
_PROBE = httpx.Client(timeout=1.0, limits=httpx.Limits(max_keepalive_connections=0))


def answers_200(url: str) -> bool:
    """Whether a GET of ``url`` answers 200 now (False when nothing listens or it times out)."""
    try:
        return _PROBE.get(url).status_code == 200
    except httpx.HTTPError:
        return False


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 15000
_SLICES = 9  # one per pytest process: the controller (or a run without xdist), gw0 .. gw7
_ports: list[int] = []  # this process's slice, in the order it hands them out


def _port_slice() -> list[int]:
    """This process's ports: a slice of those below the kernel's ephemeral range (no outgoing
    connection is given one of them), its own per xdist worker, walked from a random start so
    that two test sessions on one host rarely meet."""
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    width = (low - _LOWEST) // _SLICES
    if width < 64:
        return []
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) % (_SLICES - 1) + 1 if worker[2:].isdigit() else 0
    first = _LOWEST + index * width
    start = random.randrange(width)
    return [first + (start + k) % width for k in range(width)]


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on, for a server the test starts next.

    A port the kernel picked (bind to port 0) is in its ephemeral range: between the pick and
    the server's bind, any outgoing connection (a scrape, a readiness probe, a database
    client) may take it as its local port, and the server fails with EADDRINUSE. Ports come
    from `_port_slice` instead, each handed out once per walk, and only if it binds now."""
    if not _ports:
        _ports.extend(_port_slice())
    for _ in range(len(_ports)):
        port = _ports.pop(0)
        _ports.append(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no slice below the ephemeral range on this host
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds; reaps it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextmanager
def running_process(args: list[str], ready_url: str) -> Iterator[subprocess.Popen[bytes]]:
    """`python ARGS` from the repo root (the repo importable), up once `ready_url` answers
    200; terminated (then killed) on exit."""
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    env[STRICT_ENV] = "1"  # a kernel the warm-up did not compile fails the request at once
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env)
    try:
        # a readiness wait, not a timing check: on a fresh clone a loaded box compiles the
        # numba scanners on first import, which took over 30 s in CI
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"{args[:2]} exited with {proc.returncode}"
            if answers_200(ready_url):
                break
            assert time.monotonic() < deadline, f"{ready_url} never came up"
            time.sleep(0.1)
        yield proc
    finally:
        stop_process(proc, grace=10)


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
            sys.executable, "-m", "timwatch", "serve",
            "--host", "127.0.0.1", "--port", str(self.port), "--db", self.db,
            "--log-level", "warning", *self.args,
        ]  # fmt: skip
        out = self.log.open("ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            if answers_200(f"{self.url}/healthz"):
                return self
            time.sleep(0.1)
        raise RuntimeError(f"server did not come up:\n{self.output()}")

    def running(self) -> ServerProc:
        """This server, started when it is not running (never started, or a test left it
        dead)."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def client(self, token: str | None = None) -> httpx.Client:
        tok = token if token is not None else self.token
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60.0)


def server_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("TIMWATCH_TOKEN", "TIMWATCH_READ_TOKEN")
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env[STRICT_ENV] = "1"  # a kernel the warm-up did not compile fails the request at once
    env.update(extra or {})
    return env


def sqlite_server_proc(
    directory: Path,
    name: str,
    *,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    token: str | None = None,
) -> ServerProc:
    """A server (not started) on ``directory/NAME.db`` on a free port, logging to
    ``directory/NAME-server.log``, with `server_env` (``ENV`` added); its `client()` carries
    ``token``."""
    return ServerProc(
        db=f"sqlite:///{directory / f'{name}.db'}",
        port=free_port(),
        args=list(args or []),
        env=server_env(env),
        log=directory / f"{name}-server.log",
        token=token,
    )


def shared_server_proc(directory: Path) -> ServerProc:
    """The session's shared server (not started): SQLite in `directory`, ``TIMWATCH_TOKEN`` =
    `SHARED_TOKEN`, ``TIMWATCH_READ_TOKEN`` = `SHARED_READ_TOKEN`, ``--max-body``
    `SHARED_MAX_BODY`. Its `client()` carries the write token, which also reads."""
    return sqlite_server_proc(
        directory,
        "shared",
        args=["--max-body", str(SHARED_MAX_BODY)],
        env={"TIMWATCH_TOKEN": SHARED_TOKEN, "TIMWATCH_READ_TOKEN": SHARED_READ_TOKEN},
        token=SHARED_TOKEN,
    )


@contextmanager
def fake_sglang_process(incremental: bool, *, fast: bool = False) -> Iterator[str]:
    """A stand-in SGLang on a free port, its URL: `tests.helpers.fake_sglang` (exact float64
    model) or, with ``fast``, `benchmarks/sglang_standin.py` (SGLang's compact orjson bytes)."""
    port = free_port()
    if fast:
        args = [str(REPO / "benchmarks" / "sglang_standin.py"), "--port", str(port)]
    else:
        args = ["-m", "tests.helpers.fake_sglang", "--port", str(port)]
    args += ["--incremental-streaming-output"] if incremental else []
    with running_process(args, f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def sglang_proxy_process(upstream: str, *extra: str) -> Iterator[str]:
    """``timwatch sidecar sglang --upstream UPSTREAM EXTRA…`` on a free port, its URL."""
    port = free_port()
    args = ["-m", "timwatch", "sidecar", "sglang"]
    args += ["--upstream", upstream, "--listen", f"127.0.0.1:{port}", *extra]
    with running_process(args, f"http://127.0.0.1:{port}/timwatch/healthz"):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def vllm_standin_process(*extra: str) -> Iterator[str]:
    """`benchmarks/vllm_standin.py` (vLLM 0.32's answer shapes, not a model) on a free port."""
    port = free_port()
    args = [str(REPO / "benchmarks" / "vllm_standin.py"), "--port", str(port), *extra]
    with running_process(args, f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def vllm_proxy_process(upstream: str, *extra: str) -> Iterator[str]:
    """``timwatch sidecar vllm --upstream UPSTREAM EXTRA…`` on a free port, its URL."""
    port = free_port()
    args = ["-m", "timwatch", "sidecar", "vllm"]
    args += ["--upstream", upstream, "--listen", f"127.0.0.1:{port}", *extra]
    with running_process(args, f"http://127.0.0.1:{port}/timwatch/healthz"):
        yield f"http://127.0.0.1:{port}"
