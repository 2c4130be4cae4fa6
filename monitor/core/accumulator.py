"""Additive accumulators: the only state timwatch keeps about the numbers.

Counts, sums, extrema, fixed histograms and a bounded top-k combine exactly by addition (or
min/max), so the partial batches of one step, the steps of a run and the streams of many
sidecars merge without loss; every row value is derived from them at the end (`core.row`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from .histograms import (
    ABS_DELTA_LAYOUT,
    ABS_LOG_RATIO_BUCKETS,
    ESTR_SCORE_BUCKETS,
    HEATMAP_ABS_DELTA_EDGES,
    HEATMAP_ENTROPY_EDGES,
    VERSION_LAG_BUCKETS,
)
from .layout import C, F, M
from .masks import POLICIES, SEQUENCE_POLICIES, PolicyParams

__all__ = ["Accumulator", "LENGTH_BUCKETS", "TOP_K"]

LENGTH_BUCKETS = 64
TOP_K = 16
I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


def _zeros_i(*shape: int) -> I64:
    return np.zeros(shape, dtype=np.int64)


def _zeros_f(*shape: int) -> F64:
    return np.zeros(shape, dtype=np.float64)


def _initial_extrema() -> F64:
    ext = np.full(M.size, -math.inf, dtype=np.float64)
    ext[list(M.ZERO_START)] = 0.0
    ext[list(M.MINIMA)] = math.inf
    return ext


@dataclass
class Accumulator:
    """Everything needed to derive a metric row, in a form that adds."""

    params: PolicyParams = field(default_factory=PolicyParams)
    batches: int = 0
    nonfinite_tokens: int = 0
    impossible_tokens: int = 0
    step: int = 0
    policy_version: int | None = None
    entropy_source: str | None = None
    fsum: F64 = field(default_factory=lambda: _zeros_f(F.size))
    fext: F64 = field(default_factory=_initial_extrema)
    cnt: I64 = field(default_factory=lambda: _zeros_i(C.size))
    hist_ad: I64 = field(default_factory=lambda: _zeros_i(ABS_DELTA_LAYOUT.bins))
    prom_ad: I64 = field(default_factory=lambda: _zeros_i(len(ABS_LOG_RATIO_BUCKETS) + 1))
    prom_s: I64 = field(default_factory=lambda: _zeros_i(len(ESTR_SCORE_BUCKETS) + 1))
    heat_all: I64 = field(
        default_factory=lambda: _zeros_i(len(HEATMAP_ENTROPY_EDGES), len(HEATMAP_ABS_DELTA_EDGES))
    )
    heat_rej: I64 = field(
        default_factory=lambda: _zeros_i(len(HEATMAP_ENTROPY_EDGES), len(HEATMAP_ABS_DELTA_EDGES))
    )
    lb_seqs: I64 = field(default_factory=lambda: _zeros_i(LENGTH_BUCKETS))
    lb_tokens: I64 = field(default_factory=lambda: _zeros_i(LENGTH_BUCKETS))
    lb_abs_l: F64 = field(default_factory=lambda: _zeros_f(LENGTH_BUCKETS))
    lb_k3: F64 = field(default_factory=lambda: _zeros_f(LENGTH_BUCKETS))
    worst: list[dict[str, Any]] = field(default_factory=list)
    lag_tokens: int = 0
    lag_sum: float = 0.0
    lag_max: int | None = None
    lag_buckets: dict[int, list[float]] = field(default_factory=dict)  # lag -> [tokens, Σk3]
    version_seqs: int = 0
    switch_seqs: int = 0
    tid_tokens: int = 0
    tid_mismatch: int = 0
    old_tokens: int = 0
    old_sum_disc: float = 0.0
    old_sum_stale: float = 0.0
    teacher_tokens: int = 0
    teacher_soft: int = 0
    teacher_hard: int = 0

    # ---- additive views the exporter reads ------------------------------------------------

    @property
    def tokens(self) -> int:
        return int(self.cnt[C.tokens])

    @property
    def sequences(self) -> int:
        return int(self.cnt[C.sequences])

    @property
    def sum_k3(self) -> float:
        return float(self.fsum[F.k3])

    @property
    def sum_log_ratio_sq(self) -> float:
        return float(self.fsum[F.d2])

    @property
    def sum_entropy(self) -> float:
        return float(self.fsum[F.h])

    @property
    def sum_abs_log_ratio(self) -> float:
        return float(self.fsum[F.ad])

    @property
    def sum_estr_score(self) -> float:
        return float(self.fsum[F.score])

    @property
    def sum_is_ratio(self) -> float:
        return float(self.fsum[F.r])

    @property
    def sum_is_ratio_sq(self) -> float:
        return float(self.fsum[F.r2])

    @property
    def masked_tokens(self) -> dict[str, int]:
        return {p: int(self.cnt[C.tok(i)]) for i, p in enumerate(POLICIES)}

    @property
    def rejected_sequences(self) -> dict[str, int]:
        return {p: int(self.cnt[C.seq(i)]) for i, p in enumerate(SEQUENCE_POLICIES)}

    @property
    def sum_tis_weight(self) -> float:
        return float(self.fsum[F.tis_w])

    @property
    def sum_prob_abs_diff(self) -> float:
        return float(self.fsum[F.pdiff])

    @property
    def sum_training_log_ppl(self) -> float:
        return float(self.fsum[F.log_ppl_train])

    @property
    def sum_rollout_log_ppl(self) -> float:
        return float(self.fsum[F.log_ppl_roll])

    @property
    def sum_log_ppl_diff(self) -> float:
        return float(self.fsum[F.lpd])

    @property
    def sum_training_ppl(self) -> float:
        return float(self.fsum[F.ppl_train])

    @property
    def sum_rollout_ppl(self) -> float:
        return float(self.fsum[F.ppl_roll])

    @property
    def sum_ppl_ratio(self) -> float:
        return float(self.fsum[F.ppl_ratio])

    @property
    def sum_seq_is_weight(self) -> float:
        return float(self.fsum[F.seq_w])

    @property
    def is_ratio_low_tokens(self) -> int:
        return int(self.cnt[C.is_low])

    @property
    def seq_is_ratio_out_of_bounds(self) -> dict[str, int]:
        """Sequences whose mean raw IS ratio is above C ("high") or below 1/C ("low")."""
        return {"high": int(self.cnt[C.seq_w_high]), "low": int(self.cnt[C.seq_w_low])}

    def abs_log_ratio_buckets(self) -> list[tuple[float, int]]:
        return _cumulative(ABS_LOG_RATIO_BUCKETS, self.prom_ad)

    def estr_score_buckets(self) -> list[tuple[float, int]]:
        return _cumulative(ESTR_SCORE_BUCKETS, self.prom_s)

    def version_lag_buckets(self) -> list[tuple[float, int]]:
        """Cumulative token counts per `VERSION_LAG_BUCKETS` upper bound (+Inf last), from
        ``lag_buckets``; the last count is ``lag_tokens``."""
        edges = (*VERSION_LAG_BUCKETS, math.inf)
        return [
            (float(e), int(sum(v[0] for lag, v in self.lag_buckets.items() if lag <= e)))
            for e in edges
        ]

    # ---- combination ----------------------------------------------------------------------

    def merge(self, other: Accumulator) -> Accumulator:
        """The accumulator of both inputs together (pure: neither operand changes)."""
        if other.params != self.params:
            raise ValueError("cannot merge accumulators computed with different policy params")
        out = Accumulator(params=self.params)
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) and f.name != "fext":
                setattr(out, f.name, a + b)
        out.fext = np.maximum(self.fext, other.fext)
        minima = list(M.MINIMA)
        out.fext[minima] = np.minimum(self.fext[minima], other.fext[minima])
        for name in (
            "batches", "nonfinite_tokens", "impossible_tokens", "lag_tokens", "lag_sum",
            "version_seqs", "switch_seqs", "tid_tokens", "tid_mismatch", "old_tokens",
            "old_sum_disc", "old_sum_stale", "teacher_tokens", "teacher_soft", "teacher_hard",
        ):  # fmt: skip
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.step = max(self.step, other.step)
        out.policy_version = _max_opt(self.policy_version, other.policy_version)
        out.lag_max = _max_opt(self.lag_max, other.lag_max)
        out.entropy_source = _merge_source(self.entropy_source, other.entropy_source)
        out.worst = sorted(self.worst + other.worst, key=lambda w: -w["score"])[:TOP_K]
        out.lag_buckets = {k: list(v) for k, v in self.lag_buckets.items()}
        for lag, (tok, k3) in other.lag_buckets.items():
            cur = out.lag_buckets.setdefault(lag, [0.0, 0.0])
            cur[0] += tok
            cur[1] += k3
        return out

    # ---- persistence ----------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """JSON-serialisable state; `from_state(to_state())` is exact (floats round-trip)."""
        state: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "params":
                state[f.name] = {k: getattr(value, k) for k in value.__dataclass_fields__}
            elif f.name == "hist_ad":
                nz = np.flatnonzero(value)
                state[f.name] = [nz.tolist(), value[nz].tolist()]
            elif f.name == "fext":
                state[f.name] = [v if math.isfinite(v) else str(v) for v in value.tolist()]
            elif isinstance(value, np.ndarray):
                state[f.name] = value.tolist()
            elif f.name == "lag_buckets":
                state[f.name] = {str(k): v for k, v in value.items()}
            else:
                state[f.name] = value
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Accumulator:
        acc = cls(params=PolicyParams(**state["params"]))
        for f in fields(acc):
            if f.name not in state or f.name == "params":
                continue
            value = state[f.name]
            current = getattr(acc, f.name)
            if f.name == "hist_ad":
                current[np.asarray(value[0], dtype=np.int64)] = value[1]
            elif f.name == "fext":  # a shorter (older layout) state keeps the initial tail
                acc.fext[: len(value)] = [float(v) for v in value]
            elif f.name in ("fsum", "cnt"):
                current[: len(value)] = value
            elif isinstance(current, np.ndarray):
                setattr(acc, f.name, np.asarray(value, dtype=current.dtype).reshape(current.shape))
            elif f.name == "lag_buckets":
                acc.lag_buckets = {int(k): list(v) for k, v in value.items()}
            else:
                setattr(acc, f.name, value)
        return acc


def _cumulative(edges: tuple[float, ...], counts: I64) -> list[tuple[float, int]]:
    cum = np.cumsum(counts).tolist()
    return [(float(e), int(c)) for e, c in zip((*edges, math.inf), cum, strict=True)]


def _max_opt(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def _merge_source(a: str | None, b: str | None) -> str | None:
    if a is None or a == b:
        return b
    if b is None:
        return a
    return "mixed"
