"""The vLLM servers timwatch starts ask Linux for the AMX tile state in every one of their
processes (`timwatch.sidecar.demo.vllm_startup`): vLLM 0.32's CPU build runs AMX attention
kernels for bf16 without asking, and its worker died with SIGILL on a CPU with AMX. Real
Python processes here, as vLLM starts them: the server's own, and a worker started from it
with multiprocessing's spawn (a new ``execve``, which drops the permission)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from timwatch.sidecar.demo import vllm_startup
from timwatch.sidecar.demo.vllm_engine import VllmProcess

XTILEDATA = 1 << 18

PROBE = """
import ctypes, multiprocessing as mp, sys

def mask():
    if sys.platform != "linux":
        return 0
    v = ctypes.c_ulong(0)
    ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(v))  # ARCH_GET_XCOMP_PERM
    return v.value

def child(q):
    q.put(mask())

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(mask(), q.get(timeout=60))
    p.join()
"""


def _amx_cpu() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags and os.uname().machine == "x86_64"


def _masks(tmp_path: Path, env: dict[str, str]) -> tuple[int, int]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    own, spawned = out.stdout.split()
    return int(own), int(spawned)


def _server_env() -> dict[str, str]:
    server = VllmProcess(python=sys.executable, model_dir=Path("."), log=Path("l"), port=1)
    return server._environment()


def test_server_processes_may_use_amx_where_the_cpu_has_it(tmp_path: Path) -> None:
    plain = dict(os.environ)
    plain.pop("PYTHONPATH", None)
    own, spawned = _masks(tmp_path, _server_env())
    if _amx_cpu():
        assert own & XTILEDATA and spawned & XTILEDATA
        # without the hook a fresh process has not asked (what vLLM's worker ran into)
        assert not _masks(tmp_path, plain)[1] & XTILEDATA
    else:
        assert not own & XTILEDATA and not spawned & XTILEDATA
        assert _request_in_a_fresh_process() is False


def _request_in_a_fresh_process() -> bool:
    """`sitecustomize.request_amx` in a fresh process, as its result."""
    out = subprocess.run(
        [sys.executable, "-c", "import sitecustomize; print(sitecustomize.request_amx())"],
        env=dict(os.environ, PYTHONPATH=str(vllm_startup.FOLDER)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"


def test_the_hook_is_first_and_the_callers_path_is_kept() -> None:
    parts = _server_env()["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == str(vllm_startup.FOLDER)
    assert (vllm_startup.FOLDER / "sitecustomize.py").is_file()
    if os.environ.get("PYTHONPATH"):
        assert parts[1:] == [os.environ["PYTHONPATH"]]
    else:
        assert parts[1:] == []


def test_a_sitecustomize_further_down_the_path_still_runs(tmp_path: Path) -> None:
    other = tmp_path / "venv-site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE_RAN'] = '1'\n")
    path = os.pathsep.join([str(vllm_startup.FOLDER), str(other)])
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('OTHER_SITE_RAN'))"],
        env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
