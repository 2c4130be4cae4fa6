"""timwatch: train–inference mismatch monitoring for LLM reinforcement learning.

The one installed import name. Its parts are `timwatch.monitor` (core, trainer losses, service,
store, client), `timwatch.sidecar` (engine proxies, trainer tap, integrations, demo) and
`timwatch.dashboards`; the names users reach for most are re-exported here and imported on first
use, so ``import timwatch`` is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .monitor.core.errors import (
    ApiError,
    BatchError,
    InputError,
    InsecureBindError,
    JoinError,
    SeriesMismatch,
    StoreUnavailable,
    TimwatchError,
    TimwatchHTTPError,
    WireError,
)
from .monitor.core.lazy import lazy_exports

if TYPE_CHECKING:
    from .monitor import (
        Batch,
        PolicyParams,
        Settings,
        TimwatchClient,
        accumulate,
        analyze,
        create_app,
        estr_keep_mask,
        estr_ppo_loss,
        keep_masks,
    )
    from .monitor.core.version import __version__
    from .sidecar.tap import Tap

_EXPORTS = {
    "__version__": "timwatch.monitor.core.version",
    **dict.fromkeys(
        [
            "Batch",
            "PolicyParams",
            "Settings",
            "TimwatchClient",
            "accumulate",
            "analyze",
            "create_app",
            "estr_keep_mask",
            "estr_ppo_loss",
            "keep_masks",
        ],
        "timwatch.monitor",
    ),
    "Tap": "timwatch.sidecar.tap",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "ApiError",
    "Batch",
    "BatchError",
    "InputError",
    "InsecureBindError",
    "JoinError",
    "PolicyParams",
    "SeriesMismatch",
    "Settings",
    "StoreUnavailable",
    "Tap",
    "TimwatchClient",
    "TimwatchError",
    "TimwatchHTTPError",
    "WireError",
    "__version__",
    "accumulate",
    "analyze",
    "create_app",
    "estr_keep_mask",
    "estr_ppo_loss",
    "keep_masks",
]


def __dir__() -> list[str]:
    return sorted(__all__)
