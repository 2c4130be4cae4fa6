"""One-line hooks into the loggers trainers already call, feeding `Tap.log`.

- `wandb_shim(tap, source)`: a ``wandb.log``-compatible callable (``shim(data, step=None,
  commit=None)``) for frameworks that log through wandb; it also calls the real ``wandb.log``
  when one is given, with the same arguments.
- `TapBackend` / `add_to_verl_tracking` / `install_verl_tracking_hook`: a backend of verl's
  ``verl.utils.tracking.Tracking`` (``trainer.logger``), which calls every backend's
  ``log(data=..., step=...)`` with verl's global step.

Invariants: only numbers reach the tap (media, tables, strings and arrays that trackers also
accept are left out, counted in ``skipped``), so a logged dict is never refused for one odd
value; a hook never raises into the trainer (`Tap.log` does not), but for the guard's
`RunPaged` when the tap was built with ``on_page="raise"`` (the stop the user asked for), and
never changes what the trainer's own loggers receive. Imports neither torch nor the frameworks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from ...monitor.core.scalars import check_source, to_float
from ..tap import Tap

__all__ = ["TapBackend", "add_to_verl_tracking", "install_verl_tracking_hook", "wandb_shim"]

#: the key our backend has in verl's ``Tracking.logger``
VERL_BACKEND = "timwatch"


class TapBackend:
    """Sends the numeric entries of each logged dict to `tap` as `source`'s names."""

    def __init__(self, tap: Tap, source: str | None) -> None:
        check_source(source)
        self.tap, self.source = tap, source
        self.skipped = 0  # entries left out because they were not numbers

    def numbers(self, data: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in data.items():
            if isinstance(key, str) and to_float(value) is not None:
                out[key] = value
            else:
                self.skipped += 1
        return out

    def log(self, data: Mapping[str, Any], step: int) -> bool:
        """verl's backend interface: ``log(data=..., step=...)``; True if queued."""
        numbers = self.numbers(data)
        return bool(numbers) and self.tap.log(int(step), numbers, source=self.source)

    def finish(self, exit_code: int = 0) -> None:
        """Tracking backends' end of run: flush what is queued (the tap's owner closes it)."""
        del exit_code
        self.tap.flush(10.0)


def wandb_shim(
    tap: Tap, source: str | None = None, wandb_log: Callable[..., Any] | None = None
) -> Callable[..., None]:
    """A ``wandb.log`` stand-in: ``shim({"vllm_kl": 0.01}, step=3)``. Without ``step`` it
    counts steps as wandb does (one per call, unless ``commit=False`` keeps adding to the
    current one). ``wandb_log``, when given, is called first with the same arguments."""
    backend = TapBackend(tap, source)
    lock = threading.Lock()
    state = {"step": 0}

    def log(
        data: Mapping[str, Any], step: int | None = None, commit: bool | None = None, **kw: Any
    ) -> None:
        if wandb_log is not None:
            wandb_log(data, step=step, commit=commit, **kw)
        with lock:
            if step is not None:
                state["step"] = int(step)
            at = state["step"]
            if commit is not False and step is None:
                state["step"] += 1
        backend.log(data, at)

    return log


def add_to_verl_tracking(tracking: Any, tap: Tap, source: str = "verl") -> TapBackend:
    """Add a `TapBackend` to one verl ``Tracking`` (``tracking.logger``); returns it."""
    backend = TapBackend(tap, source)
    tracking.logger[VERL_BACKEND] = backend
    return backend


_INSTALLED: dict[str, Any] = {}


def install_verl_tracking_hook(tap: Tap, source: str = "verl") -> None:
    """Make every ``verl.utils.tracking.Tracking`` created from now on (verl's
    ``RayPPOTrainer.fit`` makes its own) also log to `tap`. Installing again replaces the tap."""
    from verl.utils import tracking as module

    cls = module.Tracking
    _INSTALLED["tap"], _INSTALLED["source"] = tap, source
    if getattr(cls.__init__, "_timwatch", False):
        return
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        add_to_verl_tracking(self, _INSTALLED["tap"], _INSTALLED["source"])

    __init__._timwatch = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
