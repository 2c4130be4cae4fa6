"""Ranked causes of a train–inference mismatch, with the evidence behind each (docs/diagnosis.md).

A layer above `timwatch.monitor.core` and `timwatch.monitor.store`: pure rules over a
`StepSeries` (``rules.py``, ``rules_shape.py``), ranked into a `Diagnosis` (``verdict.py``);
`diagnose_run` reads one run's history from a `Store`. The service and the CLI import it.
"""

from .findings import Evidence, Finding, NotChecked
from .series import PROBE_SUFFIX, StepSeries, load_series
from .thresholds import FIRES
from .verdict import CAUSES, RULES, Diagnosis, diagnose, diagnose_run

__all__ = [
    "CAUSES",
    "FIRES",
    "PROBE_SUFFIX",
    "RULES",
    "Diagnosis",
    "Evidence",
    "Finding",
    "NotChecked",
    "StepSeries",
    "diagnose",
    "diagnose_run",
    "load_series",
]
