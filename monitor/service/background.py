"""One daemon thread per background duty of the service, stopped with `stop` before the store
closes (the store pinger, the finish sync)."""

from __future__ import annotations

import threading
from typing import TypeVar

_T = TypeVar("_T", bound="BackgroundThread")


class BackgroundThread:
    """Runs `_loop` on a daemon thread named `name`; `_loop` returns once `_stop` is set."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self: _T) -> _T:
        self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        """Ask the loop to end; waits up to `timeout` for the pass in flight."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError
