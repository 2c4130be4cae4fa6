"""Fixtures of the stack tier: the wheel of this checkout, built once per test session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``pip wheel`` builds from this checkout (no dependencies, this environment's
    setuptools): what ``pip install .`` installs."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    (whl,) = out.glob("timwatch-*.whl")
    return whl
