"""Batch → accumulator: runs the fused kernel, then the optional-input breakdowns.

`accumulate` is the single entry point the CLI, the service and the benchmarks use; `analyze`
derives the row (`derive_row`) for the common one-batch case.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import fastmath, kernels, kernels_seq, kernels_walk
from .accumulator import TOP_K, Accumulator
from .batch import Batch
from .histograms import (
    ABS_DELTA_LAYOUT,
    ENTROPY_LAYOUT,
    ESTR_SCORE_LAYOUT,
    HEATMAP_ABS_DELTA_EDGES,
    HEATMAP_ENTROPY_EDGES,
    FineLayout,
)
from .jitguard import seal_after_warm_up
from .kernels import core_kernel, k3_of
from .kernels_walk import bump_table
from .masks import PolicyParams
from .row import MetricRow, derive_row

__all__ = ["KERNEL_THREADS", "Accumulator", "MetricRow", "accumulate", "analyze", "warm_up"]


def _layout_vector(layout: FineLayout) -> np.ndarray:
    return np.array(
        [layout.biased_lo, layout.hi_exp - layout.lo_exp, layout.sub_bits, layout.bins - 1],
        dtype=np.int64,
    )


_LAYOUTS = np.concatenate(
    [_layout_vector(x) for x in (ABS_DELTA_LAYOUT, ESTR_SCORE_LAYOUT, ENTROPY_LAYOUT)]
)
_H_EDGES = np.asarray(HEATMAP_ENTROPY_EDGES, dtype=np.float64)
_HD_EDGES = np.asarray(HEATMAP_ABS_DELTA_EDGES, dtype=np.float64)
#: per fine |δ| bin, the coarse table and the edge that bumps it one coarse bin up (bump_table);
#: then the ESTR score's edges and the heatmap grids, which the walk compares with directly
BIN_TABLES = (
    ABS_DELTA_LAYOUT.coarse_table,
    bump_table(ABS_DELTA_LAYOUT.coarse_table, ABS_DELTA_LAYOUT.coarse_edges, 0),
    ESTR_SCORE_LAYOUT.coarse_edges,
    _H_EDGES,
    _HD_EDGES,
)
assert ESTR_SCORE_LAYOUT.coarse_edges.shape == (16,) and bool(
    np.all(np.diff(ESTR_SCORE_LAYOUT.coarse_edges) > 0)
), "the walk binary-searches 16 increasing score edges"
assert _H_EDGES.shape == (7,) and _HD_EDGES.shape == (6,), "the walk compares 6 and 5 inner edges"


KERNEL_THREADS = min(4, os.cpu_count() or 1)


def accumulate(
    batch: Batch, params: PolicyParams | None = None, threads: int | None = None
) -> Accumulator:
    """The additive accumulator of one validated batch (every metric, every policy).

    A large batch is split at sequence boundaries into `threads` parts (default
    `KERNEL_THREADS`) that run the kernel concurrently (it releases the GIL); their accumulators
    merge exactly, so results differ from `threads=1` only in float summation order. The
    default is the same for the service and `timwatch analyze`, so both answer identical rows.
    """
    p = params or PolicyParams()
    n_threads = KERNEL_THREADS if threads is None else threads
    parts = _split(batch, n_threads if batch.num_tokens >= _PARALLEL_MIN_TOKENS else 1)
    if len(parts) == 1:
        results = [_run_kernel(batch, p, 0, batch.num_sequences)]
    else:
        pool = _executor(len(parts))
        results = list(pool.map(lambda r: _run_kernel(batch, p, *r), parts))
    acc = results[0][0]
    for other, _, _ in results[1:]:
        acc = acc.merge(other)
    acc.batches = 1
    acc.step = batch.step
    acc.policy_version = batch.policy_version
    acc.entropy_source = batch.entropy_source
    acc.nonfinite_tokens = batch.nonfinite_tokens
    acc.impossible_tokens = batch.impossible_tokens
    score = np.concatenate([r[1] for r in results])
    index = np.concatenate([r[2] for r in results])
    best = np.lexsort((index, -score))[:TOP_K]
    acc.worst = _worst_tokens(batch, score[best], index[best])
    _optional_inputs(batch, acc)
    return acc


_PARALLEL_MIN_TOKENS = 1 << 17
_POOL: ThreadPoolExecutor | None = None


def _executor(workers: int) -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None or _POOL._max_workers < workers:
        _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="timwatch-kernel")
    return _POOL


def _split(batch: Batch, parts: int) -> list[tuple[int, int]]:
    """Sequence ranges [s0, s1) of about equal token counts (a sequence is never cut)."""
    nseq = batch.num_sequences
    if parts <= 1 or nseq < 2:
        return [(0, nseq)]
    targets = np.linspace(0, batch.num_tokens, parts + 1)[1:-1]
    cuts = np.searchsorted(batch.cu_seqlens, targets, side="left").tolist()
    bounds = sorted({0, nseq, *(min(max(c, 0), nseq) for c in cuts)})
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _kernel_floats(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The kernel reads its float inputs in place, so it sees them only as aligned contiguous
    arrays of one dtype, float32 or float64 (the specialisations whose rows the bit-identity test
    pins); anything else (mixed, float16, strided, misaligned) becomes float64, which is exact."""
    dt = arrays[0].dtype
    if dt in (np.float32, np.float64) and all(
        a.dtype == dt and a.flags.c_contiguous and a.flags.aligned for a in arrays
    ):
        return tuple(_readonly(a) for a in arrays)
    return tuple(_readonly(np.ascontiguousarray(a, dtype=np.float64)) for a in arrays)


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view of `a` (no copy). numba compiles a separate kernel for read-only arrays,
    and a safetensors body decodes into read-only ones: the kernel always gets read-only inputs,
    so every path runs the two specialisations `warm_up` compiled, never a new one mid-request."""
    view = a.view()
    view.flags.writeable = False
    return view


def _run_kernel(
    batch: Batch, params: PolicyParams, s0: int, s1: int
) -> tuple[Accumulator, np.ndarray, np.ndarray]:
    """Kernel over sequences [s0, s1); worst-token indices come back batch-global."""
    lo, hi = int(batch.cu_seqlens[s0]), int(batch.cu_seqlens[s1])
    cu = _readonly(np.asarray(batch.cu_seqlens[s0 : s1 + 1] - lo, dtype=np.int64))
    acc = Accumulator(params=params)
    worst_score = np.full(TOP_K, -1.0)
    worst_index = np.full(TOP_K, -1, dtype=np.int64)
    mu, pi, ent = _kernel_floats(
        batch.logp_rollout[lo:hi], batch.logp_train[lo:hi], batch.entropy[lo:hi]
    )
    core_kernel(
        cu, mu, pi, ent, _readonly(np.ascontiguousarray(batch.loss_mask[lo:hi], dtype=np.uint8)),
        params.kernel_vector(),
        acc.fsum, acc.fext, acc.cnt,
        acc.hist_ad, acc.prom_ad, acc.prom_s, acc.heat_all, acc.heat_rej,
        acc.lb_seqs, acc.lb_tokens, acc.lb_abs_l, acc.lb_k3,
        worst_score, worst_index, _LAYOUTS, *BIN_TABLES,
    )  # fmt: skip
    worst_index[worst_index >= 0] += lo
    return acc, worst_score, worst_index


def warm_up() -> None:
    """Compile (first run) or load (cached) the kernels on a tiny batch, so that the first real
    batch a server answers does not pay numba's seconds of compilation."""
    n = 4
    tiny = Batch.from_arrays(
        cu_seqlens=np.array([0, 2, n]),
        logp_rollout=np.full(n, -0.5, dtype=np.float32),
        logp_train=np.full(n, -0.4, dtype=np.float32),
        entropy=np.full(n, 0.3, dtype=np.float32),
        loss_mask=np.ones(n, dtype=np.uint8),
        token_ids=np.arange(n),
        token_ids_train=np.arange(n),
        versions=np.zeros(n, dtype=np.int64),
        policy_version=0,
        logp_old=np.full(n, -0.45),
    )
    for b in (tiny, Batch.from_json(tiny.to_json())):  # float32 and float64 signatures
        derive_row(accumulate(b, threads=1))
    seal_after_warm_up([fastmath, kernels, kernels_seq, kernels_walk])


def analyze(batch: Batch, params: PolicyParams | None = None) -> MetricRow:
    """The metric row of one batch."""
    return derive_row(accumulate(batch, params))


def _worst_tokens(batch: Batch, score: np.ndarray, index: np.ndarray) -> list[dict[str, object]]:
    keep = index >= 0
    idx, sc = index[keep], score[keep]
    seq = np.searchsorted(batch.cu_seqlens, idx, side="right") - 1
    out: list[dict[str, object]] = []
    for i, s, t in zip(idx.tolist(), sc.tolist(), seq.tolist(), strict=True):
        out.append(
            {
                "seq": t,
                "pos": i - int(batch.cu_seqlens[t]),
                "index": i,
                "token_id": None if batch.token_ids is None else int(batch.token_ids[i]),
                "logp_rollout": float(batch.logp_rollout[i]),
                "logp_train": float(batch.logp_train[i]),
                "entropy": float(batch.entropy[i]),
                "score": s,
                "step": batch.step,
                "batch_id": batch.batch_id,
            }
        )
    return out


def _optional_inputs(batch: Batch, acc: Accumulator) -> None:
    """Metrics of the optional inputs: absent inputs leave their counters at zero (→ null)."""
    if all(
        getattr(batch, name) is None
        for name in ("versions", "token_ids", "logp_old", "logp_teacher")
    ):
        return  # nothing to compute: skip converting the mask and μ (~2 ms per 1M tokens)
    mask = batch.loss_mask.astype(bool)
    if not mask.any():
        return
    if batch.versions is not None:
        _versions(batch, acc, mask)
    if batch.token_ids is not None and batch.token_ids_train is not None:
        acc.tid_tokens = int(mask.sum())
        acc.tid_mismatch = int(np.count_nonzero((batch.token_ids != batch.token_ids_train) & mask))
    if batch.logp_old is not None:
        mu = batch.logp_rollout[mask].astype(np.float64)
        old = batch.logp_old[mask].astype(np.float64)
        pi = batch.logp_train[mask].astype(np.float64)
        ones = np.ones(mu.shape[0], dtype=np.uint8)
        acc.old_tokens = int(mu.shape[0])
        acc.old_sum_disc = float(k3_of(mu, old, ones).sum())
        acc.old_sum_stale = float(k3_of(old, pi, ones).sum())
    if batch.logp_teacher is not None:
        p = np.exp(batch.logp_teacher[mask].astype(np.float64))
        acc.teacher_tokens = int(p.shape[0])
        acc.teacher_soft = int(np.count_nonzero((p >= 0.3) & (p <= 0.7)))
        acc.teacher_hard = int(np.count_nonzero((p < 0.05) | (p > 0.95)))


def _versions(batch: Batch, acc: Accumulator, mask: np.ndarray) -> None:
    assert batch.versions is not None
    idx = np.flatnonzero(mask)
    v = batch.versions[idx]
    seq = np.searchsorted(batch.cu_seqlens, idx, side="right") - 1
    acc.version_seqs = int(np.unique(seq).shape[0])
    change = (v[1:] != v[:-1]) & (seq[1:] == seq[:-1])
    acc.switch_seqs = int(np.unique(seq[1:][change]).shape[0])
    if batch.policy_version is None:
        return
    lag = batch.policy_version - v
    mu = batch.logp_rollout[idx].astype(np.float64)
    k3 = k3_of(mu, batch.logp_train[idx].astype(np.float64), np.ones(idx.shape[0], np.uint8))
    acc.lag_tokens = int(lag.shape[0])
    acc.lag_sum = float(lag.sum(dtype=np.float64))  # an int64 sum could wrap
    acc.lag_max = int(lag.max())
    values, inverse = np.unique(lag, return_inverse=True)
    tokens = np.bincount(inverse)
    sums = np.bincount(inverse, weights=k3)
    acc.lag_buckets = {
        int(lv): [float(t), float(s)]
        for lv, t, s in zip(values.tolist(), tokens.tolist(), sums.tolist(), strict=True)
    }
