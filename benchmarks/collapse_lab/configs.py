"""Lab configurations (mismatch source × correction) and the collapse definition.

Collapse (fixed before any run): after a warm-up of `WARMUP` steps, the first step from which the
5-step mean reward stays below 50 % of its running maximum for `HOLD` consecutive steps, or the
first step whose gradient norm exceeds 100× the median of the gradient norms before it and
`GRAD_FLOOR` (a converged policy's gradients shrink towards 0, and an ordinary one after them is
not an explosion), or the first step with a non-finite reward or gradient norm. The onset is that
step; a run without one did not collapse.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

__all__ = ["CONFIGS", "GRAD_FACTOR", "GRAD_FLOOR", "HOLD", "LabConfig", "WARMUP", "collapse_onset"]

WARMUP = 20
HOLD = 10
REWARD_FRACTION = 0.5
GRAD_FACTOR = 100.0
GRAD_FLOOR = 10.0


@dataclass(frozen=True)
class LabConfig:
    """One lab configuration. ``engine``: fp32 (matched control), bf16 (KV-cache decode in bf16),
    fp8 (bf16 engine whose weight copy is rounded to float8 e4m3 with a per-tensor scale, as FP8
    rollouts do), e5m2 (the same with float8 e5m2, 2 mantissa bits), int4 (symmetric per-tensor
    int4 rounding of the weight copy: 15 levels, then bf16) or topk (bf16 engine). Any engine
    with ``top_k`` > 0 or ``top_p`` < 1 samples the top-k/top-p processed distribution and
    reports its log-probs. ``lag``: rollout weights this many versions old. ``correction``:
    none, tis (truncated IS weight min(π_old/μ, 2)), icepop (drop tokens with π_old/μ outside
    [0.5, 5]) or estr (drop tokens with δ² > τ(H + 0.01)), all on decoupled PPO-clip:
    ρ = π/π_old with π_old the fp32 recomputation under the current weights before the update,
    and the correction on π_old/μ, which holds both the engine mismatch and the staleness.
    ``proximal="behaviour"`` instead recomputes π_old under the rollout's weights (verl's
    default recompute): ρ then carries the staleness and the corrections see the engine
    mismatch alone."""

    name: str
    engine: str = "bf16"
    lag: int = 0
    correction: str = "none"
    tau: float = 1.6
    top_k: int = 0
    top_p: float = 1.0
    steps: int = 160
    prompts: int = 16
    group: int = 8
    vocab: int = 16
    prompt_len: int = 3
    lr: float = 1e-3
    updates: int = 2
    proximal: str = "current"


def _family(source: str, base: LabConfig) -> dict[str, LabConfig]:
    out = {
        f"{source}-none": replace(base, name=f"{source}-none"),
        f"{source}-tis": replace(base, name=f"{source}-tis", correction="tis"),
        f"{source}-icepop": replace(base, name=f"{source}-icepop", correction="icepop"),
        f"{source}-estr": replace(base, name=f"{source}-estr", correction="estr"),
        f"{source}-estr-tuned": replace(
            base, name=f"{source}-estr-tuned", correction="estr", tau=0.4
        ),
    }
    return out


CONFIGS: dict[str, LabConfig] = {
    "control": LabConfig("control", engine="fp32"),
    "control-lag2": LabConfig("control-lag2", engine="fp32", lag=2),
    **_family("bf16", LabConfig("bf16", engine="bf16")),
    **_family("fp8", LabConfig("fp8", engine="fp8")),
    **_family("lag2", LabConfig("lag2", engine="bf16", lag=2)),
    # lag 2 with π_old under the rollout's weights: the corrections see only the bf16 mismatch
    "lag2b-none": LabConfig("lag2b-none", engine="bf16", lag=2, proximal="behaviour"),
    "lag2b-estr": LabConfig(
        "lag2b-estr", engine="bf16", lag=2, proximal="behaviour", correction="estr"
    ),
    **_family("topk", LabConfig("topk", engine="topk", top_k=8, top_p=0.9)),
    # pushed sources (docs/early-warning.md: how far they had to be pushed): int4-style
    # per-tensor rounding of the engine's weights at 3x the learning rate, with the matched
    # fp32 engine at the same learning rate as control
    **_family("int4lr3", LabConfig("int4lr3", engine="int4", lr=3e-3)),
    "control-lr3": LabConfig("control-lr3", engine="fp32", lr=3e-3),
    # lag 2 with π_old under the rollout's weights (as lag2b) at 3x the learning rate, and its
    # matched control: the same lag and learning rate with an fp32 engine
    **_family("lag2blr3", LabConfig("lag2blr3", lag=2, proximal="behaviour", lr=3e-3)),
    "control-lag2blr3": LabConfig(
        "control-lag2blr3", engine="fp32", lag=2, proximal="behaviour", lr=3e-3
    ),
    # the CI miniature: short enough for a ≤ 60 s stack test, long enough for the rules
    "mini": LabConfig("mini", engine="fp8", steps=40, prompts=4, group=4),
}


def collapse_onset(rewards: list[float], grad_norms: list[float]) -> int | None:
    """The collapse onset step under the module's definition (the earliest criterion), or None."""
    n = len(rewards)
    hits: list[int] = []
    for s in range(n):
        if not (math.isfinite(rewards[s]) and math.isfinite(grad_norms[s])):
            hits.append(s)
            break
        if s >= WARMUP:
            med = statistics.median(grad_norms[:s])
            if grad_norms[s] > max(GRAD_FACTOR * med, GRAD_FLOOR):
                hits.append(s)
                break
    smooth = [sum(rewards[max(0, i - 4) : i + 1]) / (i + 1 - max(0, i - 4)) for i in range(n)]
    best, below = -math.inf, 0
    for s in range(n):
        best = max(best, smooth[s])
        if s >= WARMUP and best > 0 and smooth[s] < REWARD_FRACTION * best:
            below += 1
            if below >= HOLD:
                hits.append(s - HOLD + 1)
                break
        else:
            below = 0
    return min(hits) if hits else None
