"""The gate's baseline file: one model on one engine, and per metric the mean of the baseline
runs, their step-to-step standard deviation and step count, the spread of the runs' means (from
two runs on), with the bounds a candidate must meet.

File format (JSON, ``"format": "timwatch-baseline/1"``)::

    {"format": ..., "model": "...", "engine": "...", "run": "...", "steps": [first, last],
     "metrics": {"mismatch_kl": {"mean": m, "sd": s, "n": n, "max_ratio": 1.5, "max_abs": 0.0,
                                 "runs": r, "run_sd": s_r}}}

``run`` names the baseline runs (comma-separated); ``runs`` and ``run_sd`` may be absent (files
written before they existed: one run, 0).

Invariants: `Baseline.load` accepts exactly what `Baseline.dump` writes and refuses anything
else with one `InputError` naming the file and the field; ``n ≥ 1``, ``1 ≤ runs ≤ n``,
``sd ≥ 0``, ``run_sd ≥ 0``, ``mean`` finite, ``max_ratio ≥ 1`` and ``max_abs ≥ 0``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import InputError

__all__ = ["FORMAT", "MAX_ABS", "MAX_RATIO", "Baseline", "MetricBaseline"]

FORMAT = "timwatch-baseline/1"
#: a candidate may be this many times the baseline's mean (before the noise tolerance) …
MAX_RATIO = 1.5
#: … or this much above it in absolute terms, whichever allows more (0: the ratio alone)
MAX_ABS = 0.0


@dataclass(frozen=True)
class MetricBaseline:
    """One metric of a baseline written from ``runs`` runs: ``mean`` is the mean of the runs'
    means, ``sd`` the step-to-step standard deviation within a run (pooled), ``n`` the steps
    of all runs, ``run_sd`` the standard deviation of the runs' means (0 for one run)."""

    mean: float
    sd: float
    n: int
    max_ratio: float = MAX_RATIO
    max_abs: float = MAX_ABS
    runs: int = 1
    run_sd: float = 0.0

    @classmethod
    def of(
        cls, values: Any, max_ratio: float = MAX_RATIO, max_abs: float = MAX_ABS
    ) -> MetricBaseline:
        """From one run's step values."""
        return cls.of_runs([values], max_ratio, max_abs)

    @classmethod
    def of_runs(
        cls, per_run: Sequence[Any], max_ratio: float = MAX_RATIO, max_abs: float = MAX_ABS
    ) -> MetricBaseline:
        """From several runs' step values (non-finite values dropped; each run needs one)."""
        runs = [x[np.isfinite(x)] for x in (np.asarray(v, dtype=np.float64) for v in per_run)]
        means = np.array([x.mean() for x in runs])
        n = sum(len(x) for x in runs)
        within = sum(float(((x - x.mean()) ** 2).sum()) for x in runs)
        sd = math.sqrt(within / (n - len(runs))) if n > len(runs) else 0.0
        run_sd = float(means.std(ddof=1)) if len(runs) > 1 else 0.0
        return cls(float(means.mean()), sd, n, max_ratio, max_abs, len(runs), run_sd)

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "sd": self.sd, "n": self.n,
                "max_ratio": self.max_ratio, "max_abs": self.max_abs,
                "runs": self.runs, "run_sd": self.run_sd}  # fmt: skip


@dataclass(frozen=True)
class Baseline:
    model: str
    engine: str
    run: str
    steps: tuple[int, int]
    metrics: dict[str, MetricBaseline]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "model": self.model, "engine": self.engine, "run": self.run,
            "steps": list(self.steps),
            "metrics": {k: v.to_dict() for k, v in self.metrics.items()},
        }  # fmt: skip

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def check_identity(self, model: str | None, engine: str | None) -> None:
        """`InputError` when the candidate names another model or engine than the baseline."""
        for what, mine, theirs in (("model", self.model, model), ("engine", self.engine, engine)):
            if theirs is not None and theirs != mine:
                raise InputError(
                    what, f"the baseline is for {what} {mine!r}, the run is {what} {theirs!r}"
                )

    @classmethod
    def load(cls, path: str | Path) -> Baseline:
        p = Path(path)
        try:
            obj = json.loads(p.read_text())
        except OSError as e:
            raise InputError("baseline", f"baseline {p}: {e.strerror or e}") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise InputError("baseline", f"baseline {p} is not JSON: {e}") from None
        return cls.from_dict(obj, str(p))

    @classmethod
    def from_dict(cls, obj: Any, where: str = "baseline") -> Baseline:
        def bad(field: str, why: str) -> InputError:
            return InputError(field, f"{where}: {field} {why}")

        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise bad("format", f"must be {FORMAT!r}")
        for key in ("model", "engine", "run"):
            if not isinstance(obj.get(key), str) or not obj[key]:
                raise bad(key, "must be a non-empty string")
        steps = obj.get("steps")
        if not (isinstance(steps, list) and len(steps) == 2 and all(type(s) is int for s in steps)):
            raise bad("steps", "must be [first, last]")
        raw = obj.get("metrics")
        if not isinstance(raw, dict) or not raw:
            raise bad("metrics", "must name at least one metric")
        metrics: dict[str, MetricBaseline] = {}
        for name, m in raw.items():
            f = f"metrics.{name}"
            if not isinstance(m, dict):
                raise bad(f, "must be an object")
            nums = {}
            for k in ("mean", "sd", "max_ratio", "max_abs", "run_sd"):
                v = m.get(k, 0.0) if k == "run_sd" else m.get(k)  # absent: a file of one run
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise bad(f"{f}.{k}", "must be a finite number")
                nums[k] = float(v)
            n, runs = m.get("n"), m.get("runs", 1)
            if type(n) is not int or n < 1:
                raise bad(f"{f}.n", "must be an integer ≥ 1")
            if type(runs) is not int or not 1 <= runs <= n:
                raise bad(f"{f}.runs", "must be an integer from 1 to n")
            if nums["run_sd"] < 0:
                raise bad(f"{f}.run_sd", "must be ≥ 0")
            if nums["sd"] < 0 or nums["max_abs"] < 0 or nums["max_ratio"] < 1:
                raise bad(f, "needs sd ≥ 0, max_abs ≥ 0 and max_ratio ≥ 1")
            metrics[name] = MetricBaseline(
                nums["mean"], nums["sd"], n, nums["max_ratio"], nums["max_abs"], runs,
                nums["run_sd"],
            )  # fmt: skip
        return cls(obj["model"], obj["engine"], obj["run"], (steps[0], steps[1]), metrics)
