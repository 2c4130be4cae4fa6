"""Importing a real trainer package (AReaL, TRL, …) inside a test, not when pytest collects it.

Every test worker collects every test file, so a trainer package imported at a test module's top
is imported by each worker (AReaL: several seconds of CPU each) even though one worker runs that
file (``--dist loadfile``). The modules that need one import it from a module-scoped fixture
with `require`. Where CI runs (``CI``, or the package's ``TIMWATCH_REQUIRE_<NAME>``) a missing
package fails; elsewhere its tests skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import pytest

from . import logs

__all__ = ["RecordingTap", "areal", "require"]


class RecordingTap:
    """Stands where a plug-in's `Tap` goes and keeps every ``report(step, **arrays)`` in order."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, dict[str, Any]]] = []

    def report(self, step: int, **arrays: Any) -> None:
        self.reports.append((step, arrays))


def require(name: str) -> ModuleType:
    """``import name``: an error under CI or ``TIMWATCH_REQUIRE_<NAME>``, a skip elsewhere."""
    if os.environ.get("CI") or os.environ.get(f"TIMWATCH_REQUIRE_{name.upper()}"):
        return importlib.import_module(name)
    return pytest.importorskip(name)


def areal() -> tuple[ModuleType, ModuleType]:
    """AReaL's test helpers (tests/helpers/areal_tiny.py) and the AReaL plug-in, AReaL imported
    (`require`) and the test process's logging put back (`logs.restore`: AReaL replaces it)."""
    require("areal")
    from tests.helpers import areal_tiny
    from timwatch.sidecar.integrations import areal as plugin

    logs.restore()
    return areal_tiny, plugin
