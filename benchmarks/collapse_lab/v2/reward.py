"""Lab v2's verifiable rewards: graded sequence properties that a policy can satisfy while
keeping its entropy. `reward` (``class``, the pre-registered protocol's) and `pattern_reward`
(``pattern``, a longer learning curve); `REWARDS` maps the names a configuration gives.

The target class is every id ≡ 0 mod ``modulus`` (ids are ranked at random by the corpus, so
the class holds ~1/modulus of the vocabulary and of the corpus's mass). With f the share of a
response's ids in the class and d the number of distinct ids in it, the reward is
``clip(1 − |f − target| / target, 0, 1) · min(1, d / min_distinct)``. Invariants: in [0, 1];
1 exactly when f = target and d ≥ min_distinct; a response that repeats a few ids cannot score
1, so the optimum is reached with many ids in play, not by collapsing the entropy.
"""

from __future__ import annotations

import torch

__all__ = [
    "MIN_DISTINCT", "MODULUS", "PERIOD", "REWARDS", "TARGET", "class_fraction", "distinct_factor",
    "pattern_reward", "reward",
]  # fmt: skip

MODULUS = 8
TARGET = 0.4
MIN_DISTINCT = 24
PERIOD = 4


def class_fraction(tokens: torch.Tensor, modulus: int = MODULUS) -> torch.Tensor:
    """Share of each row's ids in the target class, ``[batch]``."""
    return (tokens % modulus == 0).float().mean(1)


def distinct_factor(tokens: torch.Tensor, min_distinct: int = MIN_DISTINCT) -> torch.Tensor:
    """``min(1, d / min_distinct)`` per row, d its number of distinct ids, ``[batch]``."""
    distinct = torch.tensor([float(len(set(r.tolist()))) for r in tokens])
    return (distinct / min_distinct).clamp(max=1.0)


def reward(
    tokens: torch.Tensor,
    target: float = TARGET,
    modulus: int = MODULUS,
    min_distinct: int = MIN_DISTINCT,
) -> torch.Tensor:
    """The graded reward of each response row of ``tokens`` ``[batch, len]``."""
    f = class_fraction(tokens, modulus)
    close = (1.0 - (f - target).abs() / target).clamp(0.0, 1.0)
    return close * distinct_factor(tokens, min_distinct)


def pattern_reward(
    tokens: torch.Tensor,
    period: int = PERIOD,
    modulus: int = MODULUS,
    min_distinct: int = MIN_DISTINCT,
) -> torch.Tensor:
    """A positional property: response positions ``i ≡ 0 mod period`` want an id of the target
    class (≡ 0 mod ``modulus``), every other position an id outside it. With ``hit`` the share
    of the wanted positions holding a class id and ``miss`` the share of the others holding
    one, the reward is ``max(0, hit − miss) · min(1, d / min_distinct)``. Invariants: in
    [0, 1]; 1 exactly when the pattern holds everywhere and d ≥ min_distinct; ``hit − miss``
    has mean 0 for ids drawn independently of their position (the pretrained policy scores
    near 0, so losing what was learned reads as a collapse); the class holds ~1/modulus of
    the vocabulary, so every position keeps hundreds of ids to choose from."""
    n = tokens.shape[1]
    want = torch.arange(n) % period == 0
    cls = (tokens % modulus == 0).float()
    hit = cls[:, want].mean(1)
    miss = cls[:, ~want].mean(1) if (~want).any() else torch.zeros(tokens.shape[0])
    return (hit - miss).clamp(min=0.0) * distinct_factor(tokens, min_distinct)


REWARDS = {"class": reward, "pattern": pattern_reward}
