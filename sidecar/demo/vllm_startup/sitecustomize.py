"""Run by Python at the start of every process of a vLLM server that timwatch starts.

Linux lets a process use the AMX tile registers only after it asked for them
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), and ``execve`` drops that
permission. vLLM 0.32's CPU build picks its AMX attention kernels for bf16 on a CPU that has
AMX, without asking: its spawned worker then dies with SIGILL ("Fatal Python error: Illegal
instruction", exit code -4) in ``cpu_attention_with_kv_cache`` on its first request. Asking
here, before vLLM starts, is harmless where there is no AMX (the call fails and is ignored).

A ``sitecustomize`` further down ``sys.path`` (a virtualenv's own) still runs, after this one.
"""

from __future__ import annotations

import os
import platform
import sys

ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86-64


def request_amx() -> bool:
    """Ask for the AMX tile state; True when the process may now use it."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
            return False
        mask = ctypes.c_ulong(0)
        libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
        return bool(mask.value >> XFEATURE_XTILEDATA & 1)
    except (OSError, AttributeError):
        return False


def _run_next_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


request_amx()
_run_next_sitecustomize()
