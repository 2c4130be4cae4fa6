"""One verdict per demo step, derived only from that step's stored metric row.

The rules, in the order they are read (thresholds are the module constants below; the KL ones are
those of ``docs/runbook.md`` and the README's "healthy" column, the others those of the alert rules
in ``alerts/timwatch.rules.yml``):

1. **token ids differ** (``token_id_mismatch_ratio > 0``): engine and trainer scored different
   sequences, so no other number means anything — always *bad*.
2. **the mismatch** ``mismatch_kl`` (mean k3 of μ vs π) sets the level: below `KL_HEALTHY`
   *healthy*, below `KL_OFF_POLICY` *watch*, above it *bad* (the step is effectively off-policy).
   When it is not healthy its cause is named from the two parts the demo separates:
   ``staleness_kl`` (π vs logp_old: the policy moved since the weights the engine sampled with)
   and ``discrepancy_kl`` (logp_old vs μ: the engine's own numeric error). Staleness is the cause
   when the step has a version lag and ``staleness_kl > discrepancy_kl`` ("≫" when at least
   `DOMINANCE` times larger); otherwise the engine's precision is, and its level is named from its
   k3 by `PRECISION_LEVELS` (measured in the demo: fp32 ~1e-12, fp16 ~1e-5, bf16 ~5e-4).
3. **masking high** (``mask_ratio_estr > MASK_HIGH``): ESTR would reject that share of the tokens;
   at least *watch*.
4. **entropy collapsed** (``entropy_mean < ENTROPY_COLLAPSED``): the policy became deterministic;
   at least *watch*.

A verdict is one line: the headline of rule 1 or 2, then the clauses of rules 3 and 4 that apply.
`judge` is pure: the same row always gives the same verdict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

__all__ = [
    "DOMINANCE",
    "ENTROPY_COLLAPSED",
    "KL_HEALTHY",
    "KL_OFF_POLICY",
    "MASK_HIGH",
    "NEEDS",
    "PRECISION_LEVELS",
    "Level",
    "Verdict",
    "advice",
    "judge",
    "worst_step",
]

#: mean k3 below which a step is healthy (a bf16 engine sits near or under it)
KL_HEALTHY = 1e-3
#: mean k3 above which a step is effectively off-policy (TimwatchMismatchKLHigh)
KL_OFF_POLICY = 1e-2
#: one part of the mismatch is "≫" the other when it is at least this many times larger
DOMINANCE = 10.0
#: ESTR mask ratio above which masking is high (TimwatchMaskRatioHigh for token policies)
MASK_HIGH = 0.02
#: mean entropy below which the policy has collapsed (TimwatchEntropyCollapse's floor)
ENTROPY_COLLAPSED = 0.02
#: (upper k3 bound, name) of the engine's precision level, the first bound above its k3 wins
PRECISION_LEVELS: tuple[tuple[float, str], ...] = (
    (1e-8, "fp32 level"),
    (1e-4, "fp16 level"),
    (KL_OFF_POLICY, "bf16 level"),
    (float("inf"), "worse than bf16"),
)
#: the history columns `judge` reads
NEEDS = (
    "mismatch_kl",
    "discrepancy_kl",
    "staleness_kl",
    "version_lag_max",
    "mask_ratio_estr",
    "entropy_mean",
    "token_id_mismatch_ratio",
)


class Level(IntEnum):
    """How a step reads; larger is worse, so ``max`` picks the worst."""

    HEALTHY = 0
    WATCH = 1
    BAD = 2


@dataclass(frozen=True)
class Verdict:
    """``text`` is the whole one-line verdict; ``cause`` is ``"staleness"``, ``"engine"``,
    ``"token_ids"`` or None (healthy, or no mismatch number)."""

    level: Level
    text: str
    cause: str | None = None


def num(x: float) -> str:
    """Two significant digits, exponent form below 0.01: 0.51, 0.012, 5.9e-3, 1e-3."""
    if x == 0:
        return "0"
    if abs(x) < 1e-2:
        mant, exp = f"{x:.1e}".split("e")
        return f"{mant.removesuffix('.0')}e{int(exp)}"
    return f"{x:.2g}"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x < 0.1 else f"{100 * x:.0f}%"


def _float(row: Mapping[str, Any], key: str) -> float | None:
    v = row.get(key)
    return None if v is None else float(v)


def precision_level(k3: float) -> str:
    return next(name for bound, name in PRECISION_LEVELS if k3 < bound)


def _headline(row: Mapping[str, Any]) -> Verdict:
    ids = _float(row, "token_id_mismatch_ratio")
    if ids is not None and ids > 0:
        return Verdict(
            Level.BAD,
            f"token ids differ on {pct(ids)} of tokens: engine and trainer scored different "
            "sequences, fix that first",
            "token_ids",
        )
    kl = _float(row, "mismatch_kl")
    if kl is None:
        return Verdict(Level.WATCH, "no mismatch number (no tokens in this step)")
    engine = _float(row, "discrepancy_kl")
    engine = kl if engine is None else engine
    stale = _float(row, "staleness_kl")
    lag = int(row.get("version_lag_max") or 0)
    if kl < KL_HEALTHY:
        text = f"healthy (k3 {num(kl)}, engine at {precision_level(engine)})"
        return Verdict(Level.HEALTHY, text)
    level = Level.BAD if kl >= KL_OFF_POLICY else Level.WATCH
    lead = f"off-policy (k3 {num(kl)}), " if level is Level.BAD else ""
    if stale is not None and lag >= 1 and stale > engine:
        rel = "≫" if stale >= DOMINANCE * engine else ">"
        why = ", the policy moved far since the engine's weights" if level is Level.BAD else ""
        return Verdict(
            level,
            f"{lead}staleness dominates: lag {lag}{why} "
            f"(staleness_kl {num(stale)} {rel} discrepancy_kl {num(engine)})",
            "staleness",
        )
    return Verdict(
        level, f"{lead}precision: {precision_level(engine)} (engine k3 {num(engine)})", "engine"
    )


def judge(row: Mapping[str, Any]) -> Verdict:
    """The verdict of one step's row (history column names, see `NEEDS`; missing = unknown)."""
    head = _headline(row)
    if head.cause == "token_ids":
        return head
    clauses, level = [head.text], head.level
    estr = _float(row, "mask_ratio_estr")
    if estr is not None and estr > MASK_HIGH:
        clauses.append(f"masking high: ESTR rejects {pct(estr)}")
        level = max(level, Level.WATCH)
    h = _float(row, "entropy_mean")
    if h is not None and h < ENTROPY_COLLAPSED:
        clauses.append(f"entropy collapsed (H {num(h)})")
        level = max(level, Level.WATCH)
    return Verdict(level, "; ".join(clauses), head.cause)


def worst_step(rows: Sequence[Mapping[str, Any]]) -> tuple[int, Verdict] | None:
    """The step whose verdict is worst, ties broken by the larger ``mismatch_kl``."""
    if not rows:
        return None

    def key(r: Mapping[str, Any]) -> tuple[int, float]:
        return int(judge(r).level), float(r.get("mismatch_kl") or 0.0)

    row = max(rows, key=key)
    return int(row["step"]), judge(row)


def advice(verdicts: Iterable[Verdict]) -> str | None:
    """What to try next in the demo, from the most frequent cause of unhealthy steps."""
    causes = [v.cause for v in verdicts if v.level > Level.HEALTHY and v.cause]
    if not causes:
        return None
    top = max(set(causes), key=causes.count)
    if top == "staleness":
        return "staleness caused most of it: --lag 0 shows the engine's mismatch alone"
    if top == "engine":
        return "the engine's precision caused most of it: --precision fp16 or fp32 lowers it"
    return None
