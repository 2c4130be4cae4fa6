"""Comparing two runs, and gating a run against a baseline in CI (docs/compare.md).

A layer above `timwatch.monitor.core`, `timwatch.monitor.store` and
`timwatch.monitor.diagnosis`: a percentile bootstrap of the ratio of two runs' means
(``bootstrap.py``), the side-by-side comparison and its verdict line (``comparison.py``), the
baseline file (``baseline.py``), the gate's checks (``gate.py``), a run read from a directory of
batch files (``batchdir.py``) and the gate's output formats (``formats.py``).

`load_batch_dir` is imported on first use (PEP 562): it needs the metric engine (numba) and the
store (SQLAlchemy), which a gate against a server or a baseline file never touches.
"""

from typing import Any

from .baseline import Baseline, MetricBaseline
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


def __getattr__(name: str) -> Any:
    if name == "load_batch_dir":
        from .batchdir import load_batch_dir

        return load_batch_dir
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
