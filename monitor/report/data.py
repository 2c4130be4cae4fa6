"""What the incident report shows, gathered from the store: series, merged step details and the
diagnosis.

Invariants: every plotted series holds at most `MAX_POINTS` points whatever the run's length
(a min/max envelope per bucket of steps, so a one-step spike survives downsampling); the step
details are those of the last `DETAIL_STEPS` steps of the chosen range, merged exactly where the
quantity is additive (counts add, means are weighted by their counts, the worst tokens are the
top `WORST_TOKENS` by score of the union).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import StoreUnavailable
from ..diagnosis import diagnose_run
from ..store import Store
from .thresholds import MASK_POLICY_THRESHOLDS, SERIES_THRESHOLDS

log = logging.getLogger("timwatch.report")

__all__ = [
    "DETAIL_STEPS",
    "MAX_POINTS",
    "PLOT_SERIES",
    "WORST_TOKENS",
    "ReportData",
    "downsample",
    "gather",
    "merge_details",
]

#: the most points a plotted series keeps (pairs of a bucket's min and max)
MAX_POINTS = 1200
#: the step details of at most this many steps (the last of the range) are merged
DETAIL_STEPS = 256
#: worst tokens listed
WORST_TOKENS = 16
PLOT_SERIES: tuple[str, ...] = (
    *SERIES_THRESHOLDS,
    *(f"mask_ratio_{p}" for p in MASK_POLICY_THRESHOLDS),
)


@dataclass
class ReportData:
    """One report's content; ``series`` and ``steps`` are already downsampled."""

    run: str
    info: dict[str, Any]
    from_step: int | None
    to_step: int | None
    total_steps: int
    #: first and last step of the range (empty without steps)
    span: tuple[int, int] | None
    #: name → (steps, values), downsampled; NaN where the step has no value
    series: dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]
    detail_steps: list[int] = field(default_factory=list)
    heatmap: dict[str, Any] | None = None
    length_buckets: dict[str, dict[str, Any]] = field(default_factory=dict)
    lag_buckets: dict[str, dict[str, Any]] | None = None
    worst_tokens: list[dict[str, Any]] = field(default_factory=list)
    diagnosis: dict[str, Any] | None = None
    diagnosis_note: str | None = None
    #: the trainer's own scalars (``POST /v1/runs/{run}/scalars``) by canonical name:
    #: (steps, values), downsampled like ``series``; and the source each came from
    scalars: dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = field(
        default_factory=dict
    )
    scalar_sources: dict[str, str | None] = field(default_factory=dict)


def _floats(values: Any) -> np.ndarray[Any, Any]:
    if isinstance(values, np.ndarray):
        return values.astype(np.float64)
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)


def downsample(
    steps: np.ndarray[Any, Any], ys: np.ndarray[Any, Any], max_points: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """At most `max_points` points of the series ``(steps, ys)``: the steps are cut into
    ``max_points // 2`` buckets and each bucket keeps its minimum and its maximum, at their own
    steps and in step order (a bucket of NaNs keeps one NaN twice). Shorter input comes back
    unchanged."""
    n = len(steps)
    if n <= max_points:
        return steps, ys
    buckets = max(1, max_points // 2)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    idx = np.empty(2 * buckets, dtype=np.int64)
    for b in range(buckets):
        a, z = int(edges[b]), int(edges[b + 1])
        chunk = ys[a:z]
        if np.isnan(chunk).all():
            lo = hi = a
        else:
            lo, hi = a + int(np.nanargmin(chunk)), a + int(np.nanargmax(chunk))
        idx[2 * b], idx[2 * b + 1] = min(lo, hi), max(lo, hi)
    return steps[idx], ys[idx]


def _weighted(items: list[tuple[float | None, float]]) -> float | None:
    num = sum(v * w for v, w in items if v is not None and w > 0)
    den = sum(w for v, w in items if v is not None and w > 0)
    return num / den if den > 0 else None


def merge_details(details: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the detail columns of several steps (`Store.step_details` rows)."""
    heat: dict[str, Any] | None = None
    lengths: dict[str, list[dict[str, Any]]] = {}
    lags: dict[str, list[dict[str, Any]]] = {}
    any_lags = False
    worst: list[dict[str, Any]] = []
    for d in details:
        h = d.get("heatmap")
        if h:
            if heat is None:
                heat = {k: (np.array(v) if k in ("all", "estr_rejected") else v)
                        for k, v in h.items()}  # fmt: skip
            elif h["entropy_edges"] == heat["entropy_edges"] and (
                h["abs_log_ratio_edges"] == heat["abs_log_ratio_edges"]
            ):
                heat["all"] = heat["all"] + np.array(h["all"])
                heat["estr_rejected"] = heat["estr_rejected"] + np.array(h["estr_rejected"])
        for k, b in (d.get("length_buckets") or {}).items():
            lengths.setdefault(k, []).append(b)
        if d.get("lag_buckets") is not None:
            any_lags = True
            for k, b in d["lag_buckets"].items():
                lags.setdefault(k, []).append(b)
        worst += list(d.get("worst_tokens") or [])
    if heat is not None:
        heat = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in heat.items()}
    length_out = {
        k: {
            "sequences": sum(b["sequences"] for b in bs),
            "tokens": sum(b["tokens"] for b in bs),
            "seq_log_ratio_abs_mean": _weighted(
                [(b.get("seq_log_ratio_abs_mean"), b["sequences"]) for b in bs]
            ),
            "mismatch_kl": _weighted([(b.get("mismatch_kl"), b["tokens"]) for b in bs]),
        }
        for k, bs in sorted(lengths.items(), key=lambda kv: int(kv[0]))
    }
    lag_out = {
        k: {
            "tokens": sum(b["tokens"] for b in bs),
            "mismatch_kl": _weighted([(b.get("mismatch_kl"), b["tokens"]) for b in bs]),
        }
        for k, bs in sorted(lags.items(), key=lambda kv: int(kv[0]))
    }
    worst.sort(key=lambda t: -float(t.get("score") or 0.0))
    return {
        "heatmap": heat,
        "length_buckets": length_out,
        "lag_buckets": lag_out if any_lags else None,
        "worst_tokens": worst[:WORST_TOKENS],
    }


def diagnose(
    store: Store, run: str, from_step: int | None, to_step: int | None
) -> tuple[dict[str, Any] | None, str | None]:
    """``(diagnosis dict, None)``, or ``(None, why not)`` when the diagnosis failed: the rest of
    the report is still worth having then (a store outage is raised, not reported)."""
    try:
        diag = diagnose_run(store, run, from_step=from_step, to_step=to_step)
        return dict(diag.to_dict()), None
    except StoreUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - logged with its traceback, named on the page
        log.exception("diagnosis of run %s failed", run)
        return None, f"diagnosis failed: {type(exc).__name__}: {exc}"


def gather(
    store: Store,
    run: str,
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    with_diagnosis: bool = True,
) -> ReportData:
    """Everything the report of ``run`` shows over the inclusive step range; `LookupError` for
    an unknown run."""
    info = next((r for r in store.list_runs() if r["run"] == run), None)
    if info is None:
        raise LookupError(f"run {run[:200]!r} not found")
    steps_raw, raw = store.query_series(
        run, list(PLOT_SERIES), from_step=from_step, to_step=to_step
    )
    steps = np.asarray(steps_raw, dtype=np.int64)
    series = {name: downsample(steps, _floats(raw[name]), MAX_POINTS) for name in PLOT_SERIES}
    details = store.step_details(run, from_step=from_step, to_step=to_step, last=DETAIL_STEPS)
    merged = merge_details(details)
    stored = store.query_scalars(run, from_step=from_step, to_step=to_step)
    scalar_steps = np.asarray(stored["steps"], dtype=np.int64)
    scalars = {
        name: downsample(scalar_steps, _floats(values), MAX_POINTS)
        for name, values in stored["scalars"].items()
    }
    diagnosis, note = (
        diagnose(store, run, from_step, to_step) if with_diagnosis else (None, "not requested")
    )
    return ReportData(
        run=run,
        info=info,
        from_step=from_step,
        to_step=to_step,
        total_steps=len(steps),
        span=(int(steps[0]), int(steps[-1])) if len(steps) else None,
        series=series,
        detail_steps=[int(d["step"]) for d in details],
        diagnosis=diagnosis,
        diagnosis_note=note,
        scalars=scalars,
        scalar_sources=dict(stored["sources"]),
        **merged,
    )
