"""timwatch's collectors: engine-side proxies (`proxy`), the trainer tap and framework
integrations (`tap`, `integrations`), and the demo (`demo`). They use the monitor's core; the
monitor never imports them. Names are imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from timwatch.monitor.core.lazy import lazy_exports

if TYPE_CHECKING:
    from timwatch.sidecar.proxy.capture import CaptureStore
    from timwatch.sidecar.proxy.join import JoinedSample, Joiner, parse_report
    from timwatch.sidecar.proxy.records import RolloutRecord
    from timwatch.sidecar.tap.shipper import Tap
    from timwatch.sidecar.tap.stats import TapStats

_EXPORTS = {
    "Tap": "timwatch.sidecar.tap.shipper",
    "TapStats": "timwatch.sidecar.tap.stats",
    "CaptureStore": "timwatch.sidecar.proxy.capture",
    "Joiner": "timwatch.sidecar.proxy.join",
    "JoinedSample": "timwatch.sidecar.proxy.join",
    "parse_report": "timwatch.sidecar.proxy.join",
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
