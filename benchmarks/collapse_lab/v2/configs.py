"""Lab v2 configurations (engine × lag × correction) and the collapse definition.

The collapse definition is lab v1's, unchanged (`benchmarks.collapse_lab.configs.collapse_onset`:
after 20 warm-up steps, the 5-step mean reward below 50 % of its running maximum for 10 steps, a
gradient norm over both 100× the median before it and 10, or a non-finite value), fixed in
PROTOCOL.md before any v2 grid was run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from benchmarks.collapse_lab.configs import collapse_onset

__all__ = ["CONFIGS", "CORRECTIONS", "V2Config", "collapse_onset"]

CORRECTIONS = ("none", "tis", "icepop", "estr")


@dataclass(frozen=True)
class V2Config:
    """One configuration. ``engine``: an `engines.KINDS` kind; ``top_k``/``top_p``: the engine
    samples the processed distribution and reports its log-probs; ``lag``: rollouts use the
    weights of that many versions ago; ``proximal``: ``current`` (decoupled PPO, π_old the fp32
    recomputation under the current weights; the corrections on π_old/μ then see engine
    mismatch and staleness) or ``behaviour`` (π_old under the rollout's weights, verl's
    recompute: ρ carries the staleness, the corrections the engine mismatch alone) or
    ``rollout`` (no recompute: π_old is the engine's μ, as a trainer that reuses the rollout's
    log-probs has it, so ρ = π/μ carries the engine mismatch; the corrections compare the fp32
    recomputation under the rollout's weights with μ).
    ``correction`` on π_old/μ: none, tis (weight min(r, 2)), icepop (drop r outside [0.5, 5]),
    estr (drop δ² > τ(H + 0.01)), all from `timwatch.monitor.core.masks`. ``reward``: a
    `reward.REWARDS` name (``class``: the protocol's)."""

    name: str
    engine: str = "bf16"
    lag: int = 0
    correction: str = "none"
    tau: float = 1.6
    top_k: int = 0
    top_p: float = 1.0
    steps: int = 150
    prompts: int = 4
    group: int = 8
    prompt_len: int = 16
    response: int = 64
    lr: float = 1e-4
    updates: int = 2
    grad_clip: float = 1.0
    proximal: str = "current"
    reward: str = "class"


def _family(source: str, base: V2Config) -> dict[str, V2Config]:
    return {f"{source}-{c}": replace(base, name=f"{source}-{c}", correction=c) for c in CORRECTIONS}


CONFIGS: dict[str, V2Config] = {
    "control": V2Config("control", engine="fp32"),
    "control-lag2": V2Config("control-lag2", engine="fp32", lag=2),
    **_family("order", V2Config("order", engine="order")),
    **_family("bf16", V2Config("bf16", engine="bf16")),
    **_family("fp8", V2Config("fp8", engine="fp8")),
    **_family("int4", V2Config("int4", engine="int4")),
    **_family("topk", V2Config("topk", engine="bf16", top_k=50, top_p=0.9)),
    **_family("lag2", V2Config("lag2", engine="bf16", lag=2)),
    **_family("lag4", V2Config("lag4", engine="bf16", lag=4)),
    "control-lag4": V2Config("control-lag4", engine="fp32", lag=4),
    # int4 weights one version behind, against the fp32 engine at the same lag
    **_family("int4lag1", V2Config("int4lag1", engine="int4", lag=1)),
    "control-lag1": V2Config("control-lag1", engine="fp32", lag=1),
    # int4 with one scale per tensor (lab v1's): a larger engine mismatch than grouped int4
    **_family("int4t", V2Config("int4t", engine="int4t")),
    # π_old = μ (no recompute): the engine mismatch inside the PPO ratio
    **_family("int4roll", V2Config("int4roll", engine="int4", proximal="rollout")),
    **_family("int4troll", V2Config("int4troll", engine="int4t", proximal="rollout")),
    **_family(
        "topkroll", V2Config("topkroll", engine="bf16", top_k=50, top_p=0.9, proximal="rollout")
    ),
    **_family("bf16roll", V2Config("bf16roll", engine="bf16", proximal="rollout")),
    "control-roll": V2Config("control-roll", engine="fp32", proximal="rollout"),
    # the test's miniature: a few steps of a few short sequences
    "mini": V2Config("mini", engine="int4", lag=1, steps=3, prompts=2, group=2, response=8),
}
