"""`VllmProcess` with ``port`` 0 chooses its port, and chooses again when vLLM finds it taken.

vLLM binds its port only after ten seconds or more of imports, so a port free when chosen can be
taken by then (any outgoing connection may get it as its local port). A stand-in server takes
vLLM's place here: a real vLLM start costs half a minute, and making its bind fail on cue needs
the same port trick as below anyway. The stand-in is a ``vllm.entrypoints.openai.api_server``
module found first on the ``PYTHONPATH``; like vLLM 0.32 (``launcher.create_server_socket``)
it binds ``--port`` before anything else and, when that fails, dies with the traceback whose
last line real vLLM printed here against a busy port: ``OSError: [Errno 98] Address already
in use``. Otherwise it answers ``/health`` and lists ``--model`` at ``/v1/models``. The real
engine tier starts every vLLM server with ``port`` 0 too (`tests.helpers.vllm.vllm_server`).
"""

from __future__ import annotations

import fcntl
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from timwatch.sidecar.demo import vllm_engine
from timwatch.sidecar.demo.vllm_engine import PORT_TRIES, VllmProcess

STAND_IN = """
import argparse, json, socket
from http.server import BaseHTTPRequestHandler, HTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--model")
ap.add_argument("--host")
ap.add_argument("--port", type=int)
args, _ = ap.parse_known_args()
sock = socket.socket()
sock.bind((args.host, args.port))  # as vLLM does, before the engine starts


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"{}" if self.path == "/health" else json.dumps(
            {"data": [{"id": args.model}]}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


server = HTTPServer((args.host, args.port), Handler, bind_and_activate=False)
server.socket.close()
server.socket = sock
sock.listen()
server.serve_forever()
"""


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in's folder (to put on ``PYTHONPATH``); this test's own machine-wide lock."""
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(STAND_IN)
    monkeypatch.setattr(vllm_engine, "LOCK", tmp_path / "vllm.lock")
    return tmp_path / "fake"


@pytest.fixture
def busy() -> Iterator[list[socket.socket]]:
    """Listening sockets on ports a test hands out as taken; closed after it."""
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def _server(stand_in: Path, tmp_path: Path, port: int = 0) -> VllmProcess:
    return VllmProcess(
        sys.executable, tmp_path / "model", tmp_path / "vllm.log", port,
        env={"PYTHONPATH": str(stand_in)},
    )  # fmt: skip


def _hand_out(monkeypatch: pytest.MonkeyPatch, ports: list[int]) -> list[int]:
    """`vllm_engine.free_port` gives ``ports`` in order; the list shrinks as they are taken."""
    monkeypatch.setattr(vllm_engine, "free_port", lambda: ports.pop(0))
    return ports


def _lock_is_free(path: Path) -> bool:
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_a_port_taken_before_the_bind_is_chosen_again(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy: list[socket.socket]
) -> None:
    busy.append(_listening())
    taken = busy[0].getsockname()[1]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    left = _hand_out(monkeypatch, [taken, free])
    server = _server(stand_in, tmp_path)
    try:
        server.start(timeout=60)
        assert (server.port, left) == (free, [])
        assert server.url == f"http://127.0.0.1:{free}"
        assert server.output().count("OSError: [Errno 98] Address already in use") == 1
        server.check_alive(grace_s=0.1)  # the second launch is the one running
    finally:
        server.stop(grace=5)
    assert _lock_is_free(vllm_engine.LOCK)


def test_it_gives_up_after_its_tries_with_the_error_and_frees_the_lock(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy: list[socket.socket]
) -> None:
    busy.extend(_listening() for _ in range(PORT_TRIES + 1))
    left = _hand_out(monkeypatch, [s.getsockname()[1] for s in busy])
    server = _server(stand_in, tmp_path)
    with pytest.raises(RuntimeError, match=r"(?s)exited with 1 while starting.*Errno 98"):
        server.start(timeout=60)
    assert len(left) == 1  # PORT_TRIES ports tried, no more
    assert server.output().count("Address already in use") == PORT_TRIES
    assert server.proc is not None and server.proc.returncode == 1
    assert _lock_is_free(vllm_engine.LOCK)


def test_a_port_given_is_tried_once(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy: list[socket.socket]
) -> None:
    busy.append(_listening())
    given = busy[0].getsockname()[1]
    left = _hand_out(monkeypatch, [1])
    server = _server(stand_in, tmp_path, port=given)
    with pytest.raises(RuntimeError, match="Address already in use"):
        server.start(timeout=60)
    assert (server.port, left) == (given, [1])
    assert server.output().count("Address already in use") == 1


def test_another_failure_is_not_retried(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = stand_in / "vllm" / "entrypoints" / "openai" / "api_server.py"
    api.write_text("raise OSError(12, 'Cannot allocate memory')\n")
    left = _hand_out(monkeypatch, [2, 3, 4])
    server = _server(stand_in, tmp_path)
    with pytest.raises(RuntimeError, match="Cannot allocate memory"):
        server.start(timeout=60)
    assert left == [3, 4]  # one port taken from the list: no second launch
