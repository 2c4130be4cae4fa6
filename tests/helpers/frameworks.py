"""What the tests inside real trainer packages (verl, OpenRLHF, AReaL, SkyRL, TRL; marked
``framework``, which the quick tier does not collect: tests/conftest.py, `pytest_ignore_collect`)
share."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers import logs
from tests.helpers.pages import page
from timwatch.monitor.core.errors import RunPaged

__all__ = ["RaisingTap", "RecordingTap", "plugin_loader", "require_package", "stopped_by_page"]


def require_package(name: str) -> None:
    """Skip the calling test module where trainer package ``name`` is not installed; under CI
    (or ``TIMWATCH_REQUIRE_<NAME>``) its absence fails instead. Looks the package up without
    importing it, so collecting the suite does not import it in every worker (`plugin_loader`
    does, once, before the module's first test)."""
    if importlib.util.find_spec(name) is not None:
        return
    if os.environ.get("CI") or os.environ.get(f"TIMWATCH_REQUIRE_{name.upper()}"):
        raise ModuleNotFoundError(f"{name} is not installed (scripts/test.sh installs it)")
    pytest.skip(f"{name} is not installed", allow_module_level=True)


def plugin_loader(plugin: str, before: Callable[[], None] | None = None) -> Any:
    """A module-scoped autouse fixture that imports ``plugin`` (a plug-in that installs itself
    into its trainer package on import, importing that package: seconds of one core each)
    before the module's first test and sets it as the module's global ``plugin``; ``before``
    runs first (e.g. `skyrl_tiny.import_skyrl`). Some packages replace the process's logging
    manager when imported (AReaL): it is put back (`tests.helpers.logs`)."""

    @pytest.fixture(scope="module", autouse=True)
    def plugin_loaded(request: pytest.FixtureRequest) -> Iterator[None]:
        if before is not None:
            before()
        request.module.plugin = importlib.import_module(plugin)
        logs.restore()
        yield

    return plugin_loaded


class RecordingTap:
    """Stands where a plug-in's `Tap` goes and keeps every ``report(step, **arrays)`` in order."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, dict[str, Any]]] = []

    def report(self, step: int, **arrays: Any) -> None:
        self.reports.append((step, arrays))


class RaisingTap:
    """Stands where a plug-in's `Tap` goes; every ``report`` (and ``log``) raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def report(self, step: int, **arrays: Any) -> None:
        self.calls += 1
        raise self.error

    def log(self, step: int, scalars: Any, **kw: Any) -> None:
        self.calls += 1
        raise self.error


def stopped_by_page(
    url: str, token: str, run: str, step: Callable[[int], object], tap: Callable[[], Any],
    *, paged_after: int = 2, steps: int = 8,
) -> tuple[int, RunPaged]:  # fmt: skip
    """Drive a plug-in's run against the service at `url`: ``step(i)`` runs training step i
    through the framework's own code for i = 0, 1, ..., then ``tap()`` (the plug-in's tap) is
    flushed, so the answers to what it reported are in; after step `paged_after` Alertmanager's
    webhook pages `run`. Returns the i whose step raised `RunPaged`, and the exception; fails
    if none did within `steps`.

    The answer to step ``paged_after + 1``'s report carries the page (that report checked the
    guard before its answer came), so a plug-in that lets the guard's `RunPaged` out stops at
    step ``paged_after + 2``, after queuing its report."""
    for i in range(steps):
        try:
            step(i)
        except RunPaged as exc:
            return i, exc
        assert tap().flush(30)
        if i == paged_after:
            assert page(url, run, token) == [run]
    raise AssertionError(f"no RunPaged out of {steps} steps: the page never stopped the run")


def guarded_env(monkeypatch: pytest.MonkeyPatch, url: str, run: str, token: str) -> None:
    """The environment a plug-in builds its tap from (`tap_from_env`), with the guard on:
    ``TIMWATCH_URL``, ``TIMWATCH_RUN``, ``TIMWATCH_TOKEN`` and ``TIMWATCH_ON_PAGE=raise``."""
    for name, value in (("URL", url), ("RUN", run), ("TOKEN", token), ("ON_PAGE", "raise")):
        monkeypatch.setenv(f"TIMWATCH_{name}", value)
