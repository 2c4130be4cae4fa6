"""Runs written straight through the store for the report's tests and benchmark: one 8-token
sequence per step, KL ten times larger over the last fifth of the steps written."""

from __future__ import annotations

import numpy as np

from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.store import Store

__all__ = ["ingest_steps"]


def ingest_steps(store: Store, run: str, n: int, *, first: int = 0, seed: int = 7) -> None:
    """Steps ``first`` … ``first + n - 1`` of ``run``, each one batch (``batch_id`` None,
    ``policy_version`` step + 1, every token of the step's version), stored at 1e9 + step."""
    rng = np.random.default_rng(seed)
    for k in range(n):
        step, t = first + k, 8
        mu = -rng.random(t) * 2 - 1.0
        scale = 0.01 if k < 0.8 * n else 0.2
        batch = Batch.from_arrays(
            cu_seqlens=np.array([0, t], np.int64), logp_rollout=mu,
            logp_train=mu + rng.normal(0, scale, t), entropy=rng.random(t) + 0.05,
            loss_mask=np.ones(t, np.int64), versions=np.full(t, step, np.int64),
            step=step, batch_id=None, policy_version=step + 1,
        )  # fmt: skip
        store.record_batch(
            run, step=step, batch_id=None, acc=accumulate(batch), tokens=t,
            respond=lambda row: {}, now=1.0e9 + step,
        )  # fmt: skip
