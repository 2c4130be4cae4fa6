"""The tap's guard: what a training loop does when the service says its run is paged.

The shipper thread hands every answer's headers to `Guard.observe` (the ``Timwatch-Page`` header
of `timwatch.monitor.core.page`: present while the run is paged, absent once it is not); the
training thread calls `Guard.check` at each step boundary (`Tap.report`, `Tap.check_page`), which
runs the ``on_page`` action there, once per page: a page that clears and fires again runs it
again. The action is ``"raise"`` (`RunPaged` out of `check`), a `MarkerFile`, or any callable
taking the `Page`. Only `RunPaged` ever leaves `check`: any other exception of an action is
logged and counted, never raised into training. Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

from ...monitor.core.errors import ConfigError, RunPaged
from ...monitor.core.page import PAGE_HEADER, Page, parse_page

__all__ = ["Guard", "MarkerFile", "OnPage", "on_page_from_env"]

log = logging.getLogger("timwatch.tap")

#: ``Tap(on_page=...)``: ``"raise"``, or a callable run with the run's `Page`
OnPage = Literal["raise"] | Callable[[Page], object]


class MarkerFile:
    """An ``on_page`` action that writes ``{"run", "alerts", "since", "step"}`` as JSON to
    `path` (atomically: a reader never sees half a file). The training loop, a wrapper script or
    a scheduler stops the run when the file appears."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.run = ""
        self.step: int | None = None

    def __call__(self, page: Page) -> None:
        body = {"run": self.run, "alerts": list(page.alerts), "since": page.since}
        body["step"] = self.step
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(body) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)


def on_page_from_env(value: str | None, name: str = "TIMWATCH_ON_PAGE") -> OnPage | None:
    """The ``on_page`` a setting names: unset or empty → None, ``raise``, or ``marker:PATH``
    (a `MarkerFile`); anything else is a `ConfigError` naming `name`. For plug-ins that build
    their `Tap` from the environment (verl's workers)."""
    text = (value or "").strip()
    if not text:
        return None
    if text == "raise":
        return "raise"
    if text.startswith("marker:") and text[len("marker:") :].strip():
        return MarkerFile(text[len("marker:") :].strip())
    raise ConfigError(f"{name} must be 'raise' or 'marker:PATH', got {text[:100]!r}")


class Guard:
    """The page state one tap has seen and the action it runs (see the module doc)."""

    def __init__(self, run: str, on_page: OnPage | None) -> None:
        if on_page is not None and on_page != "raise" and not callable(on_page):
            raise ValueError(f'on_page must be "raise" or a callable, got {on_page!r}')
        self.run = run
        self.on_page = on_page
        self._lock = threading.Lock()
        self._page: Page | None = None
        self._acted = False  # the action ran for the current page
        self.pages = 0  # pages acted on
        self.errors = 0  # actions that raised something other than RunPaged
        self.last_error: str | None = None

    @property
    def page(self) -> Page | None:
        """The run's page as the last answer said, or None."""
        with self._lock:
            return self._page

    def observe(self, headers: Mapping[str, str]) -> None:
        """Record one answer's page state (headers with lower-case names)."""
        page = parse_page(headers.get(PAGE_HEADER.lower()))
        with self._lock:
            if page is None:
                self._acted = False
            self._page = page

    def check(self, step: int | None = None) -> None:
        """Run the action if the run is paged and it has not run for this page yet."""
        with self._lock:
            page = self._page
            if page is None or self._acted or self.on_page is None:
                return
            self._acted = True
            self.pages += 1
        log.warning(
            "timwatch guard: run %s is paged (%s) at step %s",
            self.run, ", ".join(page.alerts), step,
        )  # fmt: skip
        if self.on_page == "raise":
            raise RunPaged(self.run, page.alerts, page.since)
        action = self.on_page
        if isinstance(action, MarkerFile):
            action.run, action.step = self.run, step
        try:
            action(page)
        except RunPaged:
            raise
        except Exception as exc:  # noqa: BLE001 - a guard's action must never break training
            self.errors += 1
            self.last_error = f"on_page: {type(exc).__name__}: {exc}"
            log.warning("timwatch guard: the on_page action failed: %s", self.last_error)
