"""The gate's baseline file: one model on one engine, and per metric the baseline run's mean,
its step-to-step standard deviation and step count, with the bounds a candidate must meet.

File format (JSON, ``"format": "timwatch-baseline/1"``)::

    {"format": ..., "model": "...", "engine": "...", "run": "...", "steps": [first, last],
     "metrics": {"mismatch_kl": {"mean": m, "sd": s, "n": n, "max_ratio": 1.5, "max_abs": 0.0}}}

Invariants: `Baseline.load` accepts exactly what `Baseline.dump` writes and refuses anything
else with one `InputError` naming the file and the field; ``n ≥ 1``, ``sd ≥ 0``, ``mean``
finite, ``max_ratio ≥ 1`` and ``max_abs ≥ 0``.
"""

from __future__ import annotations

import json
import math
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
    mean: float
    sd: float
    n: int
    max_ratio: float = MAX_RATIO
    max_abs: float = MAX_ABS

    @classmethod
    def of(
        cls, values: Any, max_ratio: float = MAX_RATIO, max_abs: float = MAX_ABS
    ) -> MetricBaseline:
        x = np.asarray(values, dtype=np.float64)
        x = x[np.isfinite(x)]
        sd = float(x.std(ddof=1)) if len(x) > 1 else 0.0
        return cls(float(x.mean()), sd, int(len(x)), max_ratio, max_abs)

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "sd": self.sd, "n": self.n,
                "max_ratio": self.max_ratio, "max_abs": self.max_abs}  # fmt: skip


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
            for k in ("mean", "sd", "max_ratio", "max_abs"):
                v = m.get(k)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise bad(f"{f}.{k}", "must be a finite number")
                nums[k] = float(v)
            n = m.get("n")
            if type(n) is not int or n < 1:
                raise bad(f"{f}.n", "must be an integer ≥ 1")
            if nums["sd"] < 0 or nums["max_abs"] < 0 or nums["max_ratio"] < 1:
                raise bad(f, "needs sd ≥ 0, max_abs ≥ 0 and max_ratio ≥ 1")
            metrics[name] = MetricBaseline(
                nums["mean"], nums["sd"], n, nums["max_ratio"], nums["max_abs"]
            )
        return cls(obj["model"], obj["engine"], obj["run"], (steps[0], steps[1]), metrics)
