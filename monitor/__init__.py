"""timwatch's monitor: the numeric core (batch model, metric engine, masks), the trainer-side
losses, the HTTP service, the history store and its client.

Everything users import is named here and imported on first use, so ``import
timwatch.monitor`` loads neither numba, FastAPI nor torch. Layers, lowest first:
`core` ← `trainer` (torch), `store`, `client` ← `service` ← `cli`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .core.errors import (
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
from .core.lazy import lazy_exports

if TYPE_CHECKING:
    from .client import TimwatchClient, decode_masks
    from .core.accumulator import Accumulator
    from .core.batch import Batch
    from .core.engine import accumulate, analyze
    from .core.masks import (
        POLICIES,
        PolicyParams,
        delta_abs_keep_mask,
        estr_keep_mask,
        geo_rs_keep_mask,
        icepop_keep_mask,
        k3_rs_keep_mask,
        keep_masks,
        kpop_keep_mask,
        seq_mis_keep_mask,
        tis_keep_mask,
        tis_weights,
    )
    from .core.row import MetricRow, derive_row
    from .core.version import __version__
    from .service.app import create_app
    from .service.settings import Settings
    from .store.repo import Store
    from .trainer.logprobs import logprobs_and_entropy_from_logits
    from .trainer.losses import (
        EwmaOldPolicy,
        decoupled_ppo_loss,
        decoupled_ratios,
        estr_ppo_loss,
    )

_MASKS = "timwatch.monitor.core.masks"
_LOSSES = "timwatch.monitor.trainer.losses"
_EXPORTS = {
    "__version__": "timwatch.monitor.core.version",
    "Accumulator": "timwatch.monitor.core.accumulator",
    "Batch": "timwatch.monitor.core.batch",
    "accumulate": "timwatch.monitor.core.engine",
    "analyze": "timwatch.monitor.core.engine",
    "MetricRow": "timwatch.monitor.core.row",
    "derive_row": "timwatch.monitor.core.row",
    **dict.fromkeys(
        [
            "POLICIES",
            "PolicyParams",
            "delta_abs_keep_mask",
            "estr_keep_mask",
            "geo_rs_keep_mask",
            "icepop_keep_mask",
            "k3_rs_keep_mask",
            "keep_masks",
            "kpop_keep_mask",
            "seq_mis_keep_mask",
            "tis_keep_mask",
            "tis_weights",
        ],
        _MASKS,
    ),
    "TimwatchClient": "timwatch.monitor.client",
    "decode_masks": "timwatch.monitor.client",
    "create_app": "timwatch.monitor.service.app",
    "Settings": "timwatch.monitor.service.settings",
    "Store": "timwatch.monitor.store.repo",
    "logprobs_and_entropy_from_logits": "timwatch.monitor.trainer.logprobs",
    **dict.fromkeys(
        ["EwmaOldPolicy", "decoupled_ppo_loss", "decoupled_ratios", "estr_ppo_loss"], _LOSSES
    ),
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "POLICIES",
    "Accumulator",
    "ApiError",
    "Batch",
    "BatchError",
    "EwmaOldPolicy",
    "InputError",
    "InsecureBindError",
    "JoinError",
    "MetricRow",
    "PolicyParams",
    "SeriesMismatch",
    "Settings",
    "Store",
    "StoreUnavailable",
    "TimwatchClient",
    "TimwatchError",
    "TimwatchHTTPError",
    "WireError",
    "__version__",
    "accumulate",
    "analyze",
    "create_app",
    "decode_masks",
    "decoupled_ppo_loss",
    "decoupled_ratios",
    "delta_abs_keep_mask",
    "derive_row",
    "estr_keep_mask",
    "estr_ppo_loss",
    "geo_rs_keep_mask",
    "icepop_keep_mask",
    "k3_rs_keep_mask",
    "keep_masks",
    "kpop_keep_mask",
    "logprobs_and_entropy_from_logits",
    "seq_mis_keep_mask",
    "tis_keep_mask",
    "tis_weights",
]


def __dir__() -> list[str]:
    return sorted(__all__)
