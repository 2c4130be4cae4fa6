"""timwatch's collectors: engine-side proxies (`proxy`), the trainer tap and framework
integrations (`tap`, `integrations`), and the demo (`demo`). They use the monitor's core; the
monitor never imports them. Names are imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..monitor.core.lazy import lazy_exports

if TYPE_CHECKING:
    from .proxy.capture import CaptureStore
    from .proxy.join.joiner import JoinedSample, Joiner, parse_report
    from .proxy.records import RolloutRecord
    from .tap.shipper import Tap
    from .tap.stats import TapStats

_EXPORTS = {
    "Tap": "timwatch.sidecar.tap.shipper",
    "TapStats": "timwatch.sidecar.tap.stats",
    "CaptureStore": "timwatch.sidecar.proxy.capture",
    "Joiner": "timwatch.sidecar.proxy.join.joiner",
    "JoinedSample": "timwatch.sidecar.proxy.join.joiner",
    "parse_report": "timwatch.sidecar.proxy.join.joiner",
    "RolloutRecord": "timwatch.sidecar.proxy.records",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "CaptureStore",
    "JoinedSample",
    "Joiner",
    "RolloutRecord",
    "Tap",
    "TapStats",
    "parse_report",
]


def __dir__() -> list[str]:
    return __all__
