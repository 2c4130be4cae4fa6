"""A demo vLLM server that dies says so with its exit code and its log, not as a bare
connection error (`VllmProcess.check_alive`). Real child processes stand in for the server
here: the check reads only the process and its log file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from timwatch.sidecar.demo.vllm_engine import VllmProcess


def _server(tmp_path: Path, code: str) -> VllmProcess:
    log = tmp_path / "vllm.log"
    server = VllmProcess(python=sys.executable, model_dir=tmp_path, log=log, port=1)
    with log.open("ab") as out:
        server.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT
        )
    return server


def test_an_exited_server_raises_with_its_code_and_log(tmp_path: Path) -> None:
    server = _server(tmp_path, "print('engine core died: out of memory'); raise SystemExit(3)")
    with pytest.raises(RuntimeError, match=r"(?s)exited with 3:.*engine core died: out of memory"):
        server.check_alive()


def test_the_first_error_is_shown_before_the_end_of_the_log(tmp_path: Path) -> None:
    code = (
        "print('Traceback (most recent call last):\\n  root cause: reload failed');"
        "print('x' * 5000); print('API server: EngineDeadError'); raise SystemExit(0)"
    )
    with pytest.raises(RuntimeError) as caught:
        _server(tmp_path, code).check_alive()
    text = str(caught.value)
    assert "root cause: reload failed" in text
    assert text.index("root cause") < text.index("EngineDeadError")


def test_a_running_server_passes(tmp_path: Path) -> None:
    server = _server(tmp_path, "import time; time.sleep(30)")
    try:
        server.check_alive(grace_s=0.2)
    finally:
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()


def test_a_server_never_started_passes(tmp_path: Path) -> None:
    VllmProcess(python=sys.executable, model_dir=tmp_path, log=tmp_path / "l", port=1).check_alive()
