"""Batches with a known dominant cause, for the diagnosis API and CLI tests: ``stale`` (the
policy moved since the engine's weights: staleness_kl ≫ discrepancy_kl, versions two behind)
and ``drift`` (2 % of token ids differ between engine and trainer)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["labelled_batch"]


def labelled_batch(kind: str, step: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed * 1000 + step)
    lengths = rng.integers(4, 40, 12)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    n = int(cu[-1])
    h = rng.uniform(0.05, 3.0, n)
    mu = -rng.exponential(1.5, n)
    ids = rng.integers(0, 32000, n)
    ids_train = ids.copy()
    old = mu + rng.normal(0, 1e-3, n) * np.sqrt(h)  # engine-only: bf16-size rounding
    if kind == "stale":
        pi = old + rng.normal(0, 0.1, n)  # two versions of policy movement
    elif kind == "drift":
        pi = old + rng.normal(0, 1e-3, n)
        flip = rng.random(n) < 0.02
        ids_train[flip] += 1
    else:
        raise ValueError(kind)
    clip = lambda a: np.minimum(a, 0.0)  # noqa: E731
    return {
        "step": step,
        "batch_id": f"{kind}-{seed}-{step}",
        "policy_version": step + 2,
        "cu_seqlens": cu.tolist(),
        "logp_rollout": clip(mu).tolist(),
        "logp_train": clip(pi).tolist(),
        "logp_old": clip(old).tolist(),
        "entropy": h.tolist(),
        "loss_mask": [1] * n,
        "token_ids": ids.tolist(),
        "token_ids_train": ids_train.tolist(),
        "versions": [step] * n,
    }
