"""Lab v2's verifiable reward: a graded sequence property that a policy can satisfy while keeping
its entropy.

The target class is every id ≡ 0 mod ``modulus`` (ids are ranked at random by the corpus, so
the class holds ~1/modulus of the vocabulary and of the corpus's mass). With f the share of a
response's ids in the class and d the number of distinct ids in it, the reward is
``clip(1 − |f − target| / target, 0, 1) · min(1, d / min_distinct)``. Invariants: in [0, 1];
1 exactly when f = target and d ≥ min_distinct; a response that repeats a few ids cannot score
1, so the optimum is reached with many ids in play, not by collapsing the entropy.
"""

from __future__ import annotations

import torch

__all__ = ["MIN_DISTINCT", "MODULUS", "TARGET", "class_fraction", "reward"]

MODULUS = 8
TARGET = 0.4
MIN_DISTINCT = 24


def class_fraction(tokens: torch.Tensor, modulus: int = MODULUS) -> torch.Tensor:
    """Share of each row's ids in the target class, ``[batch]``."""
    return (tokens % modulus == 0).float().mean(1)


def reward(
    tokens: torch.Tensor,
    target: float = TARGET,
    modulus: int = MODULUS,
    min_distinct: int = MIN_DISTINCT,
) -> torch.Tensor:
    """The graded reward of each response row of ``tokens`` ``[batch, len]``."""
    f = class_fraction(tokens, modulus)
    close = (1.0 - (f - target).abs() / target).clamp(0.0, 1.0)
    distinct = torch.tensor([float(len(set(r.tolist()))) for r in tokens])
    return close * (distinct / min_distinct).clamp(max=1.0)
