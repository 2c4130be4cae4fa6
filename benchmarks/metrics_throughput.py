"""Masked tokens per second for the full catalog (every metric and every policy).

One command: `python benchmarks/metrics_throughput.py`. Batches of 1M tokens in 2,000 ragged
sequences with a realistic entropy mix (most tokens near-zero entropy, a long tail) and masked
tool spans. Baselines are measured in the same run, on the same batch, on one thread:

  (a) a straightforward numpy implementation computing each metric in its own pass;
  (b) a fused subset of 16 of the catalog's metrics compiled by `torch.compile` (float64,
      packed): what a compiler makes of the easy part of the work;
  (c) the read floor: one numpy pass that only reads the input arrays.

Older engines are timed on the same batch in the same run (`engine_at_rev.py`: a `git archive`
of the revision, run in a subprocess): by default the engine when issue 11 was filed (530cb8a,
the "today" of its ≥ 2× goal) and the full catalog just before the speed work (e8c9d4d).

It prints tokens/s, the ratios (the read floor's among them), and where the engine's time goes
(the first vector pass, which reads the inputs in place; the walk: cells, the verl-parity sums
per sequence segment, the sequential L and Σk3, scatters, top-k and the rare KPop candidates;
the fold; work outside the kernel). Times are the minimum over N repetitions of the calling
thread's CPU time (`time.thread_time`), which other processes on a loaded machine disturb far
less than wall time; `--wall` measures wall time instead.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_json  # noqa: E402
import numpy as np  # noqa: E402
from engine_at_rev import measure  # noqa: E402
from metrics_batch import make_batch  # noqa: E402
from numba import njit  # noqa: E402

from timwatch.monitor.core import kernels as K  # noqa: E402
from timwatch.monitor.core import kernels_seq as KS  # noqa: E402
from timwatch.monitor.core import kernels_walk as KW  # noqa: E402
from timwatch.monitor.core.accumulator import Accumulator  # noqa: E402
from timwatch.monitor.core.batch import Batch  # noqa: E402
from timwatch.monitor.core.engine import accumulate  # noqa: E402
from timwatch.monitor.core.masks import PolicyParams  # noqa: E402
from timwatch.monitor.core.row import SCALAR_METRICS, derive_row  # noqa: E402


def numpy_baseline(b: Batch, p: PolicyParams) -> dict[str, float]:
    """Each metric in its own pass, as one would write it first."""
    m = b.loss_mask.astype(bool)
    mu = b.logp_rollout[m].astype(np.float64)
    pi = b.logp_train[m].astype(np.float64)
    h = b.entropy[m].astype(np.float64)
    seq = (np.searchsorted(b.cu_seqlens, np.flatnonzero(m), side="right") - 1).astype(np.int64)
    n = mu.shape[0]
    out: dict[str, float] = {}
    d = pi - mu
    dc = np.clip(d, -20, 20)
    r = np.exp(dc)
    k3 = np.expm1(dc) - dc
    out["mismatch_kl"] = k3.mean()
    out["kl_k1"] = (-d).mean()
    out["kl_k2"] = (d**2 / 2).mean()
    out["log_ratio_mean"] = d.mean()
    out["log_ratio_abs_mean"] = np.abs(d).mean()
    out["log_ratio_abs_max"] = np.abs(d).max()
    out["log_ratio_abs_p99"] = np.quantile(np.abs(d), 0.99)
    pd = np.abs(np.exp(pi) - np.exp(mu))
    out["prob_abs_diff_mean"], out["prob_abs_diff_max"] = pd.mean(), pd.max()
    out["is_ratio_mean"], out["is_ratio_std"] = r.mean(), r.std()
    out["is_ratio_min"], out["is_ratio_max"] = r.min(), r.max()
    out["is_ess"] = r.sum() ** 2 / (n * (r**2).sum())
    out["chi2_token"] = (r**2).mean() - 1
    nseq = b.num_sequences
    n_s = np.bincount(seq, minlength=nseq)
    big_l = np.bincount(seq, weights=d, minlength=nseq)
    live = n_s > 0
    out["seq_log_ratio_abs_mean"] = np.abs(big_l[live]).mean()
    out["seq_log_ratio_abs_max"] = np.abs(big_l[live]).max()
    out["seq_geo_ratio_mean"] = np.exp(np.clip(big_l[live] / n_s[live], -20, 20)).mean()
    out["chi2_seq"] = (np.exp(2 * np.clip(big_l[live], -20, 20)) - 1).mean()
    out["entropy_mean"] = h.mean()
    out["noise_scale"] = (d**2).sum() / (h + p.eps).sum()
    out["entropy_delta_corr"] = np.corrcoef(d**2, h)[0, 1]
    rej = {
        "estr": d**2 > p.tau * (h + p.eps),
        "delta_abs": np.abs(d) > math.sqrt(p.tau * p.delta_abs_c),
        "icepop": (r < p.icepop_low) | (r > p.icepop_high),
        "tis": r > p.tis_c,
    }
    pp, qq = np.clip(np.exp(pi), 1e-8, 1 - 1e-8), np.clip(np.exp(mu), 1e-8, 1 - 1e-8)
    d1 = pp * np.log(pp / qq) + (1 - pp) * np.log((1 - pp) / (1 - qq))
    d2 = qq * np.log(qq / pp) + (1 - qq) * np.log((1 - qq) / (1 - pp))
    rej["kpop"] = np.maximum(d1, d2) > p.kpop_phi
    seq_rej = {
        "seq_mis": (np.exp(big_l) < p.seq_mis_low) | (np.exp(big_l) > p.seq_mis_high),
        "geo_rs": (np.exp(big_l / np.maximum(n_s, 1)) < p.geo_rs_low)
        | (np.exp(big_l / np.maximum(n_s, 1)) > p.geo_rs_high),
        "k3_rs": np.bincount(seq, weights=k3, minlength=nseq) / np.maximum(n_s, 1) > p.k3_rs_kappa,
    }
    for name, bad in rej.items():
        out[f"mask_{name}"] = bad.mean()
    for name, bad in seq_rej.items():
        out[f"mask_{name}"] = bad[seq].mean()
    bucket = np.floor(np.log2(np.maximum(n_s, 1))).astype(np.int64)
    for b_ in np.unique(bucket[live]):
        sel = live & (bucket == b_)
        out[f"lb{b_}"] = np.abs(big_l[sel]).mean() + k3[np.isin(seq, np.flatnonzero(sel))].mean()
    he = np.digitize(h, [0.01, 0.03, 0.1, 0.3, 1, 3])
    de = np.digitize(np.abs(d), [1e-4, 1e-3, 1e-2, 0.1, 1])
    out["heat"] = float(np.bincount(he * 6 + de, minlength=42).sum())
    out["heat_rej"] = float(np.bincount((he * 6 + de)[rej["estr"]], minlength=42).sum())
    score = d**2 / (h + p.eps)
    out["worst"] = float(np.argsort(-score)[:16].sum())
    out["hist_abs"] = float(np.histogram(np.abs(d), bins=np.logspace(-9, 3, 100))[0].sum())
    out["hist_score"] = float(np.histogram(score, bins=np.logspace(-9, 6, 100))[0].sum())
    return out


def torch_subset(b: Batch, p: PolicyParams) -> Callable[[], object]:
    """16 catalog metrics in one `torch.compile`d float64 function over the packed tensors."""
    import torch

    torch.set_num_threads(1)
    m = torch.from_numpy(b.loss_mask.astype(bool))
    mu = torch.from_numpy(b.logp_rollout).double()
    pi = torch.from_numpy(b.logp_train).double()
    h = torch.from_numpy(b.entropy).double()
    tau, eps = p.tau, p.eps

    def subset(mu: Any, pi: Any, h: Any, m: Any) -> Any:
        w = m.double()
        n = w.sum()
        d = (pi - mu) * w
        dc = d.clamp(-20.0, 20.0)
        r = torch.exp(dc)
        k3 = torch.expm1(dc) - dc
        pd = (torch.exp(pi) - torch.exp(mu)).abs() * w
        hw = h * w
        big = torch.finfo(torch.float64).max
        return torch.stack([
            (k3 * w).sum() / n, -d.sum() / n, (d * d).sum() / (2 * n), d.sum() / n,
            d.abs().sum() / n, d.abs().max(), pd.sum() / n, pd.max(), (r * w).sum() / n,
            torch.sqrt(((r * r) * w).sum() / n - ((r * w).sum() / n) ** 2),
            torch.where(m, r, big).min(), torch.where(m, r, -big).max(),
            ((r * r) * w).sum() / n - 1.0, hw.sum() / n, (d * d).sum() / (hw.sum() + n * eps),
            ((d * d > tau * (h + eps)) & m).double().sum() / n,
        ])  # fmt: skip

    compiled = torch.compile(subset, dynamic=False)
    compiled(mu, pi, h, m)  # compile outside the timing
    return lambda: compiled(mu, pi, h, m)


@njit(cache=True, nogil=True)
def _kernel_prefix(  # type: ignore[no-untyped-def]
    cu, mu, pi, ent, mask, params, fsum, fext, cnt, layouts, stop,
    hist_ad, prom_ad, prom_s, heat_all, heat_rej, lb_seqs, lb_tokens, lb_abs_l, lb_k3,
    worst_score, worst_index,
    ad_table, ad_bump, s_edges, h_edges, hd_edges,
):  # fmt: skip
    """The kernel's chunk loop up to `stop`: 0 the loop alone (inputs are read in place), 1 + the
    first vector pass, 2 + the walk: scatter cells, the verl-parity sums per sequence segment,
    L and Σk3, scatters, top-k, rare tokens (the whole kernel but the final fold of the split
    counts and the last sequence; the benchmark's chunks are all full)."""
    chunk = K._CHUNK
    f = [K._aligned_f64(chunk) for _ in range(10)]
    g = [K._aligned_i64(chunk)]
    ad2 = np.zeros(2 * hist_ad.shape[0], dtype=np.int64)
    prom4 = np.zeros(KW.LANES * prom_s.shape[0], dtype=np.int64)
    heat2 = np.zeros(KW.LANES * 2 * heat_all.size, dtype=np.int64)
    cells = np.empty((4, chunk), dtype=np.int64)
    wk = np.zeros(1, dtype=np.int64)
    wst = np.zeros(3, dtype=np.int64)
    wacc = np.zeros(KS.VACC, dtype=np.float64)
    n = mu.shape[0]
    KS.start_segments(cu, n, wst)
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        x_mu, x_pi, x_h, x_on = mu[c0:c1], pi[c0:c1], ent[c0:c1], mask[c0:c1]
        if stop >= 1:
            K._vector_phase(
                x_mu, x_pi, x_h, x_on, c1 - c0, params, fsum, fext, cnt,
                f[0], f[1], f[2], f[3], f[4], f[5], g[0], layouts,
            )  # fmt: skip
        if stop >= 2:
            KW.walk_chunk(
                cu, n, c0, c1, x_mu, x_pi, x_h, x_on, f[0], f[1], f[5], g[0], f[4], f[9], params,
                f[2], f[3], fsum, fext, cnt, wst, wacc, lb_seqs, lb_tokens, lb_abs_l,
                lb_k3, ad2, prom4, heat2, heat_all.shape[1], worst_score, worst_index, wk, cells,
                ad_bump, s_edges, h_edges, hd_edges,
            )  # fmt: skip


def breakdown(
    b: Batch, p: PolicyParams, repeat: int, clock: Callable[[], float], passes: int
) -> None:
    """Where the engine's single-thread time goes: the kernel's parts run alone."""
    from timwatch.monitor.core.engine import _LAYOUTS, BIN_TABLES, _optional_inputs, _run_kernel

    acc = accumulate(b, p, threads=1)
    pv = p.kernel_vector()
    s = Accumulator(params=p)
    arrays = (b.cu_seqlens, b.logp_rollout, b.logp_train, b.entropy, b.loss_mask)
    ws, wi = np.full(16, -1.0), np.full(16, -1, dtype=np.int64)

    def parts(stop: int) -> None:
        _kernel_prefix(
            *arrays, pv, s.fsum, s.fext, s.cnt, _LAYOUTS, stop, s.hist_ad, s.prom_ad, s.prom_s,
            s.heat_all, s.heat_rej, s.lb_seqs, s.lb_tokens, s.lb_abs_l, s.lb_k3, ws, wi,
            *BIN_TABLES,
        )  # fmt: skip

    steps: list[Callable[[], object]] = [lambda k=k: parts(k) for k in range(3)]  # type: ignore[misc]
    steps.append(lambda: _run_kernel(b, p, 0, b.num_sequences))
    steps.append(lambda: derive_row(accumulate(b, p, threads=1)))
    t = [math.inf] * len(steps)
    for _ in range(passes):  # interleaved: the differences of minima are what is printed
        t = [min(old, best_of(fn, repeat, clock)) for old, fn in zip(t, steps, strict=True)]
    t_kernel, t_full = t[3], t[4]
    t_opt = best_of(lambda: _optional_inputs(b, acc), repeat, clock)
    rows = (
        ("chunk loop alone (inputs read in place)", t[0]),
        ("first vector pass (original catalog, reads the inputs)", t[1] - t[0]),
        ("walk: cells, verl's sums, L and Σk3, scatters, top-k", t[2] - t[1]),
        ("fold of the split counts, rest of the kernel", t_kernel - t[2]),
        ("outside the kernel (split, top-k, optional, row)", t_full - t_kernel),
    )
    print("where the time goes (one thread, parts measured alone):")
    for name, dt in rows:
        print(f"  {name:52s} {dt * 1e3:7.2f} ms")
    print(f"  {'of which optional inputs (none in this batch)':52s} {t_opt * 1e3:7.2f} ms")


def memory_floor(b: Batch) -> float:
    """One pass that only reads the inputs."""
    return float(
        b.logp_rollout.sum(dtype=np.float64)
        + b.logp_train.sum(dtype=np.float64)
        + b.entropy.sum(dtype=np.float64)
        + b.loss_mask.sum(dtype=np.int64)
    )


def best_of(fn: Callable[[], object], repeat: int, clock: Callable[[], float]) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times)


FILED = "530cb8a"  # the engine when issue 11 was filed (32 ms per batch then)
BEFORE = "e8c9d4d"  # the full catalog before the speed work (its rows are the bit-identity fixture)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--sequences", type=int, default=2_000)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--wall", action="store_true", help="wall time instead of thread CPU time")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument(
        "--revs",
        default=f"{FILED}:at filing,{BEFORE}:before the speed work",
        help="older engines to time on the same batch, REV:LABEL,… ('' for none)",
    )
    ap.add_argument(
        "--passes",
        type=int,
        default=3,
        help="interleaved passes over this engine and the older ones, each keeping its minimum\n"
        "(a shared machine's load drifts over the minutes the comparison takes)",
    )
    bench_json.add_argument(ap)
    args = ap.parse_args()
    clock = time.perf_counter if args.wall else time.thread_time
    b = make_batch(args.tokens, args.sequences)
    params = PolicyParams()
    masked = int(b.loss_mask.sum())
    rep = args.repeat
    revs = [item.partition(":") for item in filter(None, args.revs.split(","))]
    olds = {f"engine at {rev} ({label or rev})": math.inf for rev, _, label in revs}
    t_engine = math.inf
    for _ in range(max(1, args.passes)):
        t_engine = min(
            t_engine, best_of(lambda: derive_row(accumulate(b, params, threads=1)), rep, clock)
        )
        for (rev, _, _), name in zip(revs, olds, strict=True):
            old = measure(rev, args.tokens, args.sequences, rep, args.wall)
            olds[name] = min(olds[name], old["seconds"])
    t_numpy = best_of(lambda: numpy_baseline(b, params), max(3, rep // 3), clock)
    t_torch = None if args.no_torch else best_of(torch_subset(b, params), rep, clock)
    t_floor = best_of(lambda: memory_floor(b), rep, clock)
    print(f"batch: {args.tokens:,} tokens, {masked:,} masked, {args.sequences:,} sequences")
    print(
        f"clock: {'wall' if args.wall else 'thread CPU'} time, minimum of {rep} rounds"
        f" (engines: of {max(1, args.passes)} interleaved passes of {rep})"
    )
    rows = [
        ("engine (full catalog)", t_engine),
        *olds.items(),
        ("(a) numpy, pass per metric", t_numpy),
    ]
    if t_torch is not None:
        rows.append(("(b) torch.compile, 16 metrics", t_torch))
    rows.append(("(c) read floor", t_floor))
    for name, t in rows:
        print(f"{name:42s} {t * 1e3:8.2f} ms  {masked / t / 1e6:8.1f} M masked tokens/s")
    for name, t in olds.items():
        print(f"engine vs {name}: {t / t_engine:5.2f}x its throughput")
    print(f"engine vs (a): {t_numpy / t_engine:5.1f}x faster")
    if t_torch is not None:
        print(
            f"engine vs (b): {t_engine / t_torch:5.2f}x the fused subset's time "
            f"(for {len(SCALAR_METRICS)} scalars + 16 policies + histograms vs 16 scalars)"
        )
    print(f"engine vs (c): {t_engine / t_floor:5.1f}x the floor's time")
    breakdown(b, params, rep, clock, max(1, args.passes))
    ratios = {f"{name} time / engine time": t / t_engine for name, t in olds.items()}
    ratios["(a) numpy time / engine time"] = t_numpy / t_engine
    if t_torch is not None:
        ratios["engine time / (b) torch.compile subset time"] = t_engine / t_torch
    ratios["engine time / (c) read floor time"] = t_engine / t_floor
    bench_json.write(
        args.json, "metrics_throughput",
        {f"engine, ms per {args.tokens:,} tokens": t_engine * 1e3},
        ratios,
        [{"engine or baseline": name, "ms": t * 1e3, "masked tokens/s": masked / t}
         for name, t in rows],
        note=f"{'wall' if args.wall else 'thread CPU'} time, minimum of {rep} rounds, "
        f"{max(1, args.passes)} interleaved passes",
    )  # fmt: skip


if __name__ == "__main__":
    main()
