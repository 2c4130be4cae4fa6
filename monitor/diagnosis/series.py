"""The input of the diagnosis rules: one run's step series as float arrays, plus details.

`StepSeries` is plain data (numpy arrays keyed by the store's column names, NaN for null), so
every rule is a pure function of it and unit-tests on synthetic series. `load_series` builds one
from a `Store`; `diagnose_run` (``verdict.py``) is the only caller that touches the store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "DETAIL_STEPS",
    "PROBE_SUFFIX",
    "SERIES_COLUMNS",
    "StepSeries",
    "Summary",
    "load_series",
    "summarize",
]

#: the run the SGLang proxy's prefill probes go to (``sidecar/proxy/sglang/probe_forward.py``)
PROBE_SUFFIX = "-prefill-probe"
#: at most this many steps' details are read (evenly spread over the window, last step kept)
DETAIL_STEPS = 64
#: every column a rule reads (real names of ``monitor/store/models.py`` METRIC_COLUMNS)
SERIES_COLUMNS = (
    "tokens",
    "mismatch_kl",
    "discrepancy_kl",
    "staleness_kl",
    "entropy_mean",
    "entropy_delta_corr",
    "noise_scale",
    "version_lag_mean",
    "version_lag_max",
    "intra_switch_ratio",
    "token_id_mismatch_ratio",
    "teacher_hard_ratio",
    "teacher_soft_ratio",
    "seq_log_ratio_abs_mean",
    "mask_ratio_estr",
    "mask_ratio_delta_abs",
)


@dataclass(frozen=True)
class StepSeries:
    """Steps (ascending int64) and named float64 columns of equal length (NaN = null).

    ``details`` maps a step to its stored row's bulky parts (``length_buckets``,
    ``lag_buckets``, ``heatmap``, ``worst_tokens``, ``entropy_source``) for the steps read;
    ``probe`` is the run's ``<run>-prefill-probe`` series over the same window, if it exists.
    """

    run: str
    steps: np.ndarray[Any, Any]
    columns: Mapping[str, np.ndarray[Any, Any]]
    details: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    probe: StepSeries | None = None

    @classmethod
    def build(
        cls,
        run: str,
        steps: Sequence[int],
        columns: Mapping[str, Sequence[float | None]],
        details: Mapping[int, Mapping[str, Any]] | None = None,
        probe: StepSeries | None = None,
    ) -> StepSeries:
        """From plain lists (``None`` = null); lengths must match ``steps``."""
        s = np.asarray(steps, dtype=np.int64)
        cols: dict[str, np.ndarray[Any, Any]] = {}
        for name, values in columns.items():
            arr = np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)
            if len(arr) != len(s):
                raise ValueError(f"column {name!r} has {len(arr)} values for {len(s)} steps")
            cols[name] = arr
        return cls(run, s, cols, dict(details or {}), probe)

    def __len__(self) -> int:
        return len(self.steps)

    def col(self, name: str) -> np.ndarray[Any, Any]:
        """The column, or all-NaN if it was not read."""
        found = self.columns.get(name)
        return np.full(len(self.steps), np.nan) if found is None else found

    def has(self, name: str) -> bool:
        """Whether any step has a value of ``name``."""
        return bool(np.isfinite(self.col(name)).any())

    def span(self) -> tuple[int | None, int | None]:
        if not len(self.steps):
            return None, None
        return int(self.steps[0]), int(self.steps[-1])


@dataclass(frozen=True)
class Summary:
    """A column over the window: the steps with values, their mean, and the late/early ratio
    (mean of the last third over mean of the first third; None with < 3 values or an early
    mean ≤ 0)."""

    first: int | None
    last: int | None
    n: int
    mean: float | None
    trend: float | None

    @property
    def steps(self) -> list[int | None]:
        return [self.first, self.last]


def summarize(series: StepSeries, name: str) -> Summary:
    values = series.col(name)
    ok = np.isfinite(values)
    if not ok.any():
        return Summary(None, None, 0, None, None)
    steps, xs = series.steps[ok], values[ok]
    trend = None
    if len(xs) >= 3:
        k = max(1, len(xs) // 3)
        early, late = float(np.mean(xs[:k])), float(np.mean(xs[-k:]))
        if early > 0 and math.isfinite(late):
            trend = late / early
    return Summary(int(steps[0]), int(steps[-1]), int(len(xs)), float(np.mean(xs)), trend)


def _pick(steps: np.ndarray[Any, Any], k: int) -> list[int]:
    if len(steps) <= k:
        return [int(s) for s in steps]
    idx = np.unique(np.linspace(0, len(steps) - 1, k).round().astype(int))
    return [int(steps[i]) for i in idx]


def _floats(values: Any) -> np.ndarray[Any, Any]:
    """A store series as float64 with NaN for null (float arrays as they are, int arrays cast,
    lists with ``None`` element by element)."""
    if isinstance(values, np.ndarray):
        return values.astype(np.float64)
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)


_DETAIL_KEYS = ("length_buckets", "lag_buckets", "heatmap", "worst_tokens", "entropy_source")


def load_series(
    store: Any, run: str, from_step: int | None = None, to_step: int | None = None,
    *, with_probe: bool = True,
) -> StepSeries:  # fmt: skip
    """``run``'s series from ``store`` (`Store.query_series` for the columns, `Store.get_step`
    for the details of at most `DETAIL_STEPS` steps) and its probe run's, if stored."""
    steps, raw = store.query_series(run, SERIES_COLUMNS, from_step=from_step, to_step=to_step)
    step_arr = np.asarray(steps, dtype=np.int64)
    cols = {n: _floats(raw[n]) for n in SERIES_COLUMNS}
    details: dict[int, dict[str, Any]] = {}
    for s in _pick(step_arr, DETAIL_STEPS):
        found = store.get_step(run, s)
        if found is not None:
            row = found.get("row") or {}
            details[s] = {k: row.get(k) for k in _DETAIL_KEYS}
    probe = None
    if with_probe and store.run_exists(run + PROBE_SUFFIX):
        probe = load_series(store, run + PROBE_SUFFIX, from_step, to_step, with_probe=False)
    return StepSeries(run, step_arr, cols, details, probe)
