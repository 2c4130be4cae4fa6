"""The compiled loops over bytes and tokens hold no reference-count operation.

numba wraps every array in a reference-counted structure; a loop that passes an array to an
inlined helper may increment and decrement that count, an atomic operation, on every call
(measured on byte scanners: about 3x their time, numba 0.65). The loops therefore
run in workers compiled with ``_nrt=False`` (allocation stays in thin wrappers), and this test
reads each worker's LLVM IR as compiled, not loaded from numba's cache (`tests.helpers.kernel_ir`):
a change that brings reference counting back into a loop (a worker that allocates, or loses the
option) fails here, not only in a benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest

from tests.helpers.kernel_ir import REFOP, WORKERS, complete, saved
from tests.helpers.procs import REPO


@numba.njit(inline="always")
def _byte_at(buf: np.ndarray, i: int) -> int:
    return int(buf[i]) if i < buf.shape[0] else 0


# Read in a fresh process whose code is compiled, not loaded from numba's cache: the one
# ``scripts/test.sh`` warms the cache with (its file in ``TIMWATCH_KERNEL_IR``) when it compiled
# every worker, else the last such reading of the same sources (`kernel_ir.saved`), else one
# run here with an empty cache.


@pytest.fixture(scope="module")
def probed() -> dict[str, Any]:
    shared = os.environ.get("TIMWATCH_KERNEL_IR")
    if shared and os.path.isfile(shared):
        with open(shared, encoding="utf-8") as f:
            result: dict[str, Any] = json.loads(f.read() or "{}")
        if complete(result):
            return result
    again = saved()
    if again is not None:
        return again
    with tempfile.TemporaryDirectory(prefix="timwatch-nrt-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.helpers.kernel_ir"],
            env={**os.environ, "NUMBA_CACHE_DIR": tmp},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("name", [n for _, n in WORKERS])
def test_worker_loops_hold_no_reference_counting(probed: dict[str, Any], name: str) -> None:
    worker = probed[name]
    assert worker["nrt"] is False, f"{name} is compiled with NRT"
    assert worker["ops"], f"{name} was not compiled by the warm-up"
    assert not any(worker["ops"]), f"{name}: reference-count calls per signature {worker['ops']}"


def test_the_check_sees_reference_counting_where_it_is() -> None:
    """The same reading finds the operations in a loop compiled with NRT."""

    def loop(buf: np.ndarray) -> int:
        total = 0
        for i in range(buf.shape[0]):
            total += _byte_at(buf, i)
        return total

    counted = numba.njit(loop)
    buf = np.frombuffer(b"abc", np.uint8)
    assert counted(buf) == 97 + 98 + 99
    assert REFOP.findall(counted.inspect_llvm(counted.signatures[0]))


_CACHED = """
import numba

@numba.njit(cache=True, _nrt=False)
def add(a, b):
    return a + b
"""


def test_code_from_numbas_cache_is_left_out(tmp_path: Path) -> None:
    """The reading takes a worker loaded from the cache (whose IR numba does not keep) for
    unread, not for one without operations: the first process compiles and reads it, the second
    loads it and leaves it out."""
    (tmp_path / "cached_worker.py").write_text(_CACHED)
    code = (
        "import json, cached_worker\n"
        "from tests.helpers.kernel_ir import read_ir\n"
        "cached_worker.add(1, 2)\n"
        "print(json.dumps(read_ir([('cached_worker', 'add')])))"
    )
    env = {
        **os.environ,
        "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": f"{tmp_path}:{REPO}",
    }
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.splitlines()[-1]))
    assert runs[0] == {"add": {"nrt": False, "ops": [0]}}
    assert runs[1] == {}
