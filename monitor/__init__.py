"""timwatch's core: the validated batch model, the metric engine and the mask policies.

The public surface is re-exported here; the service (`monitor.api`), the store and the
exporter are imported from their own modules. Nothing here imports torch.
"""

from monitor.accumulator import Accumulator
from monitor.batch import Batch, BatchError
from monitor.engine import accumulate, analyze
from monitor.masks import (
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
from monitor.row import MetricRow

__all__ = [
    "POLICIES",
    "Accumulator",
    "Batch",
    "BatchError",
    "MetricRow",
    "PolicyParams",
    "accumulate",
    "analyze",
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
]
__version__ = "0.1.0"
