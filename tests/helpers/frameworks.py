"""What the tests inside real trainer packages (verl, OpenRLHF, AReaL, SkyRL; marked
``framework``, which the quick tier does not collect: tests/conftest.py, `pytest_ignore_collect`)
share."""

from __future__ import annotations

from typing import Any

__all__ = ["RecordingTap"]


class RecordingTap:
    """Stands where a plug-in's `Tap` goes and keeps every ``report(step, **arrays)`` in order."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, dict[str, Any]]] = []

    def report(self, step: int, **arrays: Any) -> None:
        self.reports.append((step, arrays))
