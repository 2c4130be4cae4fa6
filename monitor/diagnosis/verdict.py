"""Ranking the rules' findings into one `Diagnosis`, and `diagnose_run` over a store.

Invariants of `Diagnosis.to_dict()` (the contract the incident report and the API rely on):
``causes`` holds one entry per checked cause, scores in [0, 1], ranked best first (ties keep
`RULES` order); every cause of `RULES` appears exactly once, in ``causes`` or ``not_checked``.
``scalars`` is None or says which trainer scalars (``POST /v1/runs/{run}/scalars``) the window
holds: the rules never read them (they are the trainer's numbers, not per-token series), and a
window with scalars but no per-token steps says so in every ``not_checked`` reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .findings import Finding, NotChecked
from .rules import decode_vs_prefill, precision, staleness
from .rules_shape import (
    entropy_collapse,
    length,
    teacher_collapse,
    tokenization,
)
from .series import StepSeries, load_series

__all__ = ["CAUSES", "RULES", "Diagnosis", "diagnose", "diagnose_run", "scalar_summary"]

Rule = Callable[[StepSeries], Finding | NotChecked]
#: every rule, in tie-break order
RULES: tuple[Rule, ...] = (
    tokenization,
    precision,
    staleness,
    decode_vs_prefill,
    length,
    entropy_collapse,
    teacher_collapse,
)
CAUSES = (
    "tokenization", "precision", "staleness", "decode_vs_prefill", "length",
    "entropy_collapse", "teacher_collapse",
)  # fmt: skip


@dataclass(frozen=True)
class Diagnosis:
    run: str
    from_step: int | None
    to_step: int | None
    steps: int
    causes: list[Finding] = field(default_factory=list)
    not_checked: list[NotChecked] = field(default_factory=list)
    #: the window's trainer scalars: steps, sources, names and each name's last value
    scalars: dict[str, Any] | None = None

    @property
    def top(self) -> Finding | None:
        return self.causes[0] if self.causes else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "from_step": self.from_step,
            "to_step": self.to_step,
            "steps": self.steps,
            "causes": [c.to_dict() for c in self.causes],
            "not_checked": [n.to_dict() for n in self.not_checked],
            "scalars": self.scalars,
        }


def diagnose(
    series: StepSeries, from_step: int | None = None, to_step: int | None = None
) -> Diagnosis:
    """Every rule on ``series``; the window bounds default to its first and last step."""
    first, last = series.span()
    if not len(series):
        reason = "no steps in the window"
        return Diagnosis(
            series.run, from_step, to_step, 0, [], [NotChecked(c, reason) for c in CAUSES]
        )
    found: list[Finding] = []
    missing: list[NotChecked] = []
    for rule in RULES:
        out = rule(series)
        (found if isinstance(out, Finding) else missing).append(out)  # type: ignore[arg-type]
    order = {c: i for i, c in enumerate(CAUSES)}
    found.sort(key=lambda f: (-f.score, order.get(f.cause, len(order))))
    return Diagnosis(
        series.run,
        first if from_step is None else from_step,
        last if to_step is None else to_step,
        len(series),
        found,
        missing,
    )


def diagnose_run(
    store: Any, run: str, from_step: int | None = None, to_step: int | None = None
) -> Diagnosis:
    """`diagnose` on ``run``'s history in ``store`` (and its ``<run>-prefill-probe`` run),
    with the window's trainer scalars named (see the module docstring)."""
    diag = diagnose(load_series(store, run, from_step, to_step), from_step, to_step)
    query = getattr(store, "query_scalars", None)
    stored = query(run, from_step=from_step, to_step=to_step) if query is not None else None
    if not stored or not stored["steps"]:
        return diag
    summary = scalar_summary(stored)
    if diag.steps:
        return replace(diag, scalars=summary)
    why = (
        f"no per-token steps in the window: the run sent only its trainer's scalars "
        f"({summary['steps']} steps, from {', '.join(summary['sources'])}); the rules read "
        "per-token series"
    )
    return replace(diag, not_checked=[NotChecked(c, why) for c in CAUSES], scalars=summary)


def scalar_summary(stored: dict[str, Any]) -> dict[str, Any]:
    """Steps, sources, names and each name's last non-null value of `Store.query_scalars`."""
    last = {}
    for name, values in stored["scalars"].items():
        kept = [v for v in values if v is not None]
        last[name] = kept[-1] if kept else None
    sources = sorted({s for s in stored["sources"].values() if s}) or ["canonical names"]
    return {
        "steps": len(stored["steps"]),
        "from_step": stored["steps"][0],
        "to_step": stored["steps"][-1],
        "sources": sources,
        "last": last,
    }
