"""numba's cache of the core kernels is keyed to their sources (`jitcache`): after a helper
module is edited, the kernel that uses it runs the new code, with no cache to purge.

Each step runs in a fresh interpreter on a copy of ``monitor/core`` (real numba, its cache in
the copy's ``__pycache__``): a probe kernel in its own module calls an inlined helper appended
to ``fastmath.py``; the helper's result changes, the probe's module does not. The control runs
the same steps under numba's stock locator, which keeps returning the old result.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numba
import pytest

ROOT = Path(__file__).resolve().parents[2]

HELPER = """

@njit(inline="always", cache=True, error_model="numpy")
def _probe_helper() -> float:
    return 1.0
"""
PROBE = """from .fastmath import _probe_helper
from .jitcache import njit


@njit(cache=True, error_model="numpy")
def probe() -> float:
    return _probe_helper()
"""


def _package(tmp: Path) -> Path:
    """A copy of monitor/core as the top-level package ``twcore``, with the probe added."""
    pkg = tmp / "twcore"
    shutil.copytree(ROOT / "monitor" / "core", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    with (pkg / "fastmath.py").open("a", encoding="utf-8") as f:
        f.write(HELPER)
    (pkg / "probe.py").write_text(PROBE, encoding="utf-8")
    return pkg


def _run(tmp: Path, **env: str) -> tuple[float, str]:
    """The probe's result in a fresh interpreter, and numba's cache log. Python writes no
    bytecode there: the edit keeps the file's size and may land in the second of the last run,
    which Python's own ``.pyc`` check (mtime in whole seconds and size) cannot tell apart."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    base.update(PYTHONPATH=str(tmp), PYTHONDONTWRITEBYTECODE="1", NUMBA_DEBUG_CACHE="1")
    done = subprocess.run(
        [sys.executable, "-c", "from twcore.probe import probe; print(probe())"],
        cwd=tmp,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    *log, result = done.stdout.strip().splitlines()
    return float(result), "\n".join(log)


def _edit_helper(pkg: Path) -> None:
    src = pkg / "fastmath.py"
    text = src.read_text(encoding="utf-8")
    src.write_text(text.replace("    return 1.0\n", "    return 2.0\n"), encoding="utf-8")


def test_an_edited_helper_runs_its_new_code(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    value, log = _run(tmp_path)
    assert value == 1.0 and "[cache] data saved to" in log
    assert list((pkg / "__pycache__").glob("probe.probe-*.nbi"))
    value, log = _run(tmp_path)  # unchanged sources: the compiled probe comes from the cache
    assert value == 1.0 and "[cache] data loaded from" in log
    _edit_helper(pkg)
    value, log = _run(tmp_path)
    assert value == 2.0 and "[cache] data saved to" in log
    value, log = _run(tmp_path)
    assert value == 2.0 and "[cache] data loaded from" in log


@pytest.mark.skipif(
    not hasattr(numba.config, "CACHE_LOCATOR_CLASSES"),
    reason="this numba has no NUMBA_CACHE_LOCATOR_CLASSES to run the stock locator with",
)
def test_the_stock_locator_runs_stale_code(tmp_path: Path) -> None:
    """The control: what the test above guards against happens without the keyed locator."""
    pkg = _package(tmp_path)
    stock = {"NUMBA_CACHE_LOCATOR_CLASSES": "InTreeCacheLocator"}
    assert _run(tmp_path, **stock)[0] == 1.0
    _edit_helper(pkg)
    value, log = _run(tmp_path, **stock)
    assert value == 1.0 and "[cache] data loaded from" in log
