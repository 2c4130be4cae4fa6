"""The alert thresholds the report draws, one table kept equal to ``alerts/timwatch.rules.yml``.

The rules file is not part of the installed package, so the numbers live here;
``tests/unit/test_report.py`` parses every alert expression of the rules file and fails when a
number here differs from the one there (or an alert's threshold has no entry).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["MASK_POLICY_THRESHOLDS", "SERIES_THRESHOLDS", "Threshold"]


class Threshold(NamedTuple):
    """A horizontal line on a plot: the ``value`` above which ``alert`` fires (``label`` says
    which comparison of that alert it is)."""

    value: float
    alert: str
    label: str


#: series name → the thresholds of the alerts that read it (by the same quantity)
SERIES_THRESHOLDS: dict[str, tuple[Threshold, ...]] = {
    "mismatch_kl": (
        Threshold(0.02, "TimwatchMismatchKLHigh", "KL high (10 min mean > 0.02)"),
        Threshold(0.002, "TimwatchMismatchKLRising", "KL rising: floor 0.002 (with 2x growth)"),
    ),
    "is_ratio_std": (Threshold(0.3, "TimwatchISRatioStdHigh", "IS-ratio std > 0.3"),),
    "entropy_mean": (Threshold(0.02, "TimwatchEntropyCollapse", "entropy < 0.02 nats"),),
    "version_lag_max": (Threshold(4.0, "TimwatchStalenessHigh", "version lag > 4"),),
}

#: mask policy → the share of rejected tokens above which TimwatchMaskRatioHigh fires (None:
#: the policy's ratio is plotted, no alert reads it; the sequence policies since the collapse lab)
MASK_POLICY_THRESHOLDS: dict[str, float | None] = {
    "estr": 0.2,
    "delta_abs": 0.2,
    "icepop": 0.2,
    "kpop": 0.2,
    "tis": 0.2,
    "seq_mis": None,
    "k3_rs": None,
    "geo_rs": None,
}
