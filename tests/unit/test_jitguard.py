"""`jitguard.seal_after_warm_up`: with the variable set, a kernel the warm-up did not compile
raises instead of compiling; without it, numba compiles as usual. In fresh interpreters, so the
dispatchers start with no signatures."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.procs import REPO
from timwatch.monitor.core.jitguard import STRICT_ENV

_CODE = r"""
import numpy as np
from timwatch.monitor.core import engine, kernels
engine.warm_up()
mu = np.full(3, -1.0, np.float32)  # k3_of's warm-up types are float64, float64, uint8
try:
    kernels.k3_of(mu, mu, np.ones(3, np.uint8))
except TypeError as exc:
    print("refused", "No matching definition" in str(exc))
else:
    print("compiled", len(kernels.k3_of.signatures))
"""


def _run(strict: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != STRICT_ENV}
    if strict is not None:
        env[STRICT_ENV] = strict
    out = subprocess.run(
        [sys.executable, "-c", _CODE], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_sealed_kernels_refuse_types_the_warm_up_did_not_compile() -> None:
    assert _run("1") == "refused True"


def test_unsealed_kernels_compile_new_types_as_numba_does() -> None:
    assert _run(None) == "compiled 2"
    assert _run("0") == "compiled 2"
