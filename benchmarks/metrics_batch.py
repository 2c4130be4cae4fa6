"""The metric-engine benchmark's batch (benchmarks/metrics_throughput.py).

Kept apart, importing nothing of timwatch but `Batch` (which every revision has at the same
path), so `engine_at_rev.py` can build the same batch for an older engine.
"""

from __future__ import annotations

import numpy as np

from timwatch.monitor.core.batch import Batch

__all__ = ["make_batch"]


def make_batch(n_tokens: int, n_seq: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=0.0, sigma=0.8, size=n_seq)
    lengths = np.maximum(1, np.round(lengths / lengths.sum() * n_tokens)).astype(np.int64)
    lengths[-1] += n_tokens - lengths.sum()
    cu = np.concatenate([[0], np.cumsum(lengths)])
    low = rng.random(n_tokens) < 0.7  # most tokens are near-deterministic
    entropy = np.where(low, rng.exponential(0.003, n_tokens), rng.lognormal(-0.5, 1.0, n_tokens))
    logp_rollout = -np.abs(rng.normal(0.0, 1.0, n_tokens)) * np.minimum(entropy, 4.0) - 1e-5
    sigma = np.sqrt(2e-3 * (entropy + 0.01))  # ESTR law: E[δ²] ≈ σ²H, bf16-like σ²
    logp_train = np.minimum(logp_rollout + rng.normal(0.0, 1.0, n_tokens) * sigma, 0.0)
    mask = np.ones(n_tokens, dtype=np.uint8)
    for s in np.flatnonzero(lengths > 64)[::3]:  # tool-output spans the policy did not generate
        a = cu[s] + rng.integers(0, lengths[s] - 32)
        mask[a : a + 32] = 0
    return Batch.from_arrays(
        cu_seqlens=cu,
        logp_rollout=logp_rollout.astype(np.float32),
        logp_train=logp_train.astype(np.float32),
        entropy=entropy.astype(np.float32),
        loss_mask=mask,
    )
