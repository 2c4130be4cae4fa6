"""Comparing two runs, and gating a run against a baseline in CI (docs/compare.md).

A layer above `timwatch.monitor.core`, `timwatch.monitor.store` and
`timwatch.monitor.diagnosis`: a percentile bootstrap of the ratio of two runs' means
(``bootstrap.py``), the side-by-side comparison and its verdict line (``comparison.py``), the
baseline file (``baseline.py``), the gate's checks (``gate.py``), a run read from a directory of
batch files (``batchdir.py``) and the gate's output formats (``formats.py``).
"""

from .baseline import Baseline, MetricBaseline
from .batchdir import load_batch_dir
from .bootstrap import Interval, ratio_interval
from .comparison import HEADLINE, Comparison, compare_series
from .formats import comparison_markdown, junit_xml, markdown, markdown_html
from .gate import GateResult, gate

__all__ = [
    "HEADLINE",
    "Baseline",
    "Comparison",
    "GateResult",
    "Interval",
    "MetricBaseline",
    "compare_series",
    "comparison_markdown",
    "gate",
    "junit_xml",
    "load_batch_dir",
    "markdown",
    "markdown_html",
    "ratio_interval",
]
