"""The fused numba kernel: one pass over a packed batch fills every additive accumulator.

The full catalog needs ~30 reductions, 8 policies, histograms, a heatmap, length buckets and a
top-k. In numpy each is a pass over memory plus temporaries; here the batch is walked once, in
chunks of `_CHUNK` tokens that stay in L1:

1. `_vector_phase` (SIMD), reading the inputs in place: every per-token value — k3, r,
   probabilities, the ESTR score, |δ|'s fine bin — and every
   sum, extremum and token-policy count.
   Masked-out positions are replaced by a neutral token (δ = 0, H = 0) and weighted out, so the
   loop has no branches and vectorises; sums are reassociated across lanes (float rounding
   differs from a sequential sum at the 1e-16 level, nothing more).
2. `kernels_walk.walk_chunk`: what the first pass leaves. Histogram and heatmap cells are
   computed in a loop of their own (vectorised); then, per sequence segment of the chunk, a
   vectorised loop for the verl-parity token and per-sequence sums (`kernels_seq.verl_segment`,
   reassociated) and one sequential loop for L and Σk3 in token order (the bits of the original
   token-by-token walk), which also scatters the cells into split counts that `fold_fine` turns
   into the histograms once per call; the top-k walks only chunks whose largest score can enter,
   and KPop's exact test runs on the few candidates that `kpop_maybe` (in the per-segment loop,
   under the first pass's flags) cannot clear.

Indices in the hot loops are either loop counters from 0 (over slices) or unsigned: numba tests
a signed index that LLVM cannot prove non-negative for wraparound, which keeps a loop from
vectorising (the per-segment loop ran 10× slower) and costs a scatter several instructions.

Exact alternatives replace transcendentals where they exist: exp(δ) is a series for
|δ| < 1e-2, thresholds on r compare δ against log-thresholds, bins come from the float's bits.
"""

from __future__ import annotations

import numpy as np

from .fastmath import (
    exp,
    fine_index,
    from_order_key,
    k3_of,
    k3_rm1_r,
    order_key,
)
from .jitcache import njit
from .kernels_seq import VACC, start_segments
from .kernels_walk import (
    LANES,
    finish_sequence,
    fold_fine,
    walk_chunk,
)
from .layout import C, F, M

__all__ = ["F", "M", "C", "core_kernel", "k3_of"]


_CHUNK = 1024
#: chunks of at least this many tokens are read in place (float32 or float64, any mask dtype);
#: a shorter last chunk is staged into float64/int64 buffers: LLVM enters the first pass's
#: 8-lane loop from 8 tokens for the staged types but only from 16 for some direct ones, and
#: the lanes' sums must not depend on which (rows keep their bits)
_DIRECT = 16
_BIG = 1.7976931348623157e308
_FASTMATH = {"reassoc", "nsz", "contract"}  # vectorised reductions; no NaN/inf assumptions
_C_TOKENS, _C_TOK = C.tokens, C.tok_reject


@njit(cache=True, error_model="numpy")
def _aligned_f64(n):  # type: ignore[no-untyped-def]
    raw = np.empty(n + 8, dtype=np.float64)
    off = ((64 - raw.ctypes.data % 64) % 64) // 8
    return raw[off : off + n]


@njit(cache=True, error_model="numpy")
def _aligned_i64(n):  # type: ignore[no-untyped-def]
    raw = np.empty(n + 8, dtype=np.int64)
    off = ((64 - raw.ctypes.data % 64) % 64) // 8
    return raw[off : off + n]


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy", fastmath=_FASTMATH)
def _vector_phase(  # type: ignore[no-untyped-def]
    x_mu, x_pi, x_h, x_on, n, params, fsum, fext, cnt,
    b_d, b_k3, b_rm1, b_r, b_q, b_score, b_fb, layouts,
):  # fmt: skip
    """Only what feeds this pass's sums, extrema and counts, or the walk's buffers, is computed
    here: KPop's pre-test (`kpop_maybe`), which feeds none of them, runs in
    `kernels_seq.verl_segment` with the same expression under the same flags, leaving this
    loop's registers to its ~30 accumulators.

    Its float sums are in the order LLVM's vectorisation gives this loop (read from
    `inspect_llvm`): 8 lanes, one accumulator each, lane l summing the chunk's tokens l, l + 8,
    … in order; then ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)); then the remaining
    n mod 8 tokens one by one; then added to the accumulator. Inputs are read in place (float32
    or float64 arrays, see `engine._kernel_floats`) or, for a short last chunk, staged: both
    give that order (`_DIRECT`), so rows are identical for JSON, safetensors and in-memory
    batches, and the bit-identity test pins them."""
    tau, eps, dabs, ice_lo, ice_hi = params[0], params[1], params[2], params[3], params[4]
    tis_c = params[6]
    ad_lo, ad_oct, ad_sub, ad_last = layouts[0], layouts[1], layouts[2], layouts[3]
    s_d = s_ad = s_d2 = s_k3 = s_rm1 = s_rm1sq = s_h = s_h2 = s_d2h = s_d4 = 0.0
    s_pd = s_sc = s_r = s_r2 = 0.0
    k_lo, k_hi = order_key(-_BIG), order_key(_BIG)
    k_ad = k_pd = k_hmax = k_d2max = order_key(0.0)
    k_dmax = k_lo
    k_dmin = k_hmin = k_d2min = k_hi
    n_on = n_estr = n_dabs = n_ice = n_tis = 0
    for j in range(n):
        on = x_on[j] != 0
        m0 = x_mu[j]
        p0 = x_pi[j]
        h0 = x_h[j]
        m = m0 if on else -1.0
        p = p0 if on else -1.0
        h = h0 if on else 0.0
        w = 1.0 if on else 0.0
        d = p - m
        ad = abs(d)
        d2 = d * d
        k3, rm1, r = k3_rm1_r(d)
        q = exp(m)
        pp = q + q * rm1  # e^π without a second exp; the walk redoes the rare |δ| > 20
        near = ad <= 20.0
        pdiff = abs(pp - q) if near else 0.0
        score = d2 / (h + eps)
        dc = min(max(d, -20.0), 20.0)
        n_on += on
        s_d += d
        s_ad += ad
        s_d2 += d2
        s_k3 += k3
        s_rm1 += rm1
        s_rm1sq += rm1 * rm1
        s_r += w * r
        s_r2 += w * (r * r)
        s_h += h
        s_h2 += h * h
        s_d2h += d2 * h
        s_d4 += d2 * d2
        s_pd += pdiff
        s_sc += score
        kx = order_key(ad)
        k_ad = kx if kx > k_ad else k_ad
        kx = order_key(pdiff)
        k_pd = kx if kx > k_pd else k_pd
        kd = order_key(d)
        kx = kd if on else k_lo
        k_dmax = kx if kx > k_dmax else k_dmax
        kx = kd if on else k_hi
        k_dmin = kx if kx < k_dmin else k_dmin
        kh = order_key(h)
        k_hmax = kh if kh > k_hmax else k_hmax
        kx = kh if on else k_hi
        k_hmin = kx if kx < k_hmin else k_hmin
        kd2 = order_key(d2)
        k_d2max = kd2 if kd2 > k_d2max else k_d2max
        kx = kd2 if on else k_hi
        k_d2min = kx if kx < k_d2min else k_d2min
        n_estr += d2 > tau * (h + eps)
        n_dabs += d2 > dabs
        n_ice += (dc < ice_lo) | (dc > ice_hi)
        n_tis += dc > tis_c
        b_d[j] = d
        b_k3[j] = k3
        b_rm1[j] = rm1
        b_r[j] = r
        b_q[j] = q
        b_score[j] = score
        b_fb[j] = fine_index(ad, ad_lo, ad_oct, ad_sub, ad_last)
    fsum[0] += s_d
    fsum[1] += s_ad
    fsum[2] += s_d2
    fsum[3] += s_k3
    fsum[4] += s_rm1
    fsum[5] += s_rm1sq
    fsum[6] += s_h
    fsum[7] += s_h2
    fsum[8] += s_d2h
    fsum[9] += s_d4
    fsum[10] += s_pd
    fsum[11] += s_sc
    fsum[15] += s_r
    fsum[16] += s_r2
    fext[0] = max(fext[0], from_order_key(k_ad))
    fext[1] = max(fext[1], from_order_key(k_pd))
    fext[2] = max(fext[2], from_order_key(k_dmax))
    fext[4] = max(fext[4], from_order_key(k_hmax))
    fext[5] = max(fext[5], from_order_key(k_d2max))
    fext[6] = min(fext[6], from_order_key(k_dmin))
    fext[7] = min(fext[7], from_order_key(k_hmin))
    fext[8] = min(fext[8], from_order_key(k_d2min))
    cnt[_C_TOKENS] += n_on
    cnt[_C_TOK + 0] += n_estr
    cnt[_C_TOK + 1] += n_dabs
    cnt[_C_TOK + 2] += n_ice
    cnt[_C_TOK + 4] += n_tis


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy")
def _chunk(  # type: ignore[no-untyped-def]
    x_mu, x_pi, x_h, x_on, cu, n, c0, c1, params, fsum, fext, cnt,
    b_d, b_k3, b_rm1, b_r, b_q, b_score, b_fb, b_kp, layouts,
    wst, wacc, lb_seqs, lb_tokens, lb_abs_l, lb_k3, ad2, prom4, heat2, n_cols,
    worst_score, worst_index, wk, cells, ad_bump, s_edges, h_edges, hd_edges,
):  # fmt: skip
    """The two passes over one chunk [c0, c1) of the inputs (x_* hold its tokens)."""
    _vector_phase(
        x_mu, x_pi, x_h, x_on, c1 - c0, params, fsum, fext, cnt,
        b_d, b_k3, b_rm1, b_r, b_q, b_score, b_fb, layouts,
    )  # fmt: skip
    walk_chunk(
        cu, n, c0, c1, x_mu, x_pi, x_h, x_on, b_d, b_k3, b_score, b_fb, b_q, b_kp, params,
        b_rm1, b_r, fsum, fext, cnt, wst, wacc, lb_seqs, lb_tokens, lb_abs_l,
        lb_k3, ad2, prom4, heat2, n_cols, worst_score, worst_index, wk, cells,
        ad_bump, s_edges, h_edges, hd_edges,
    )  # fmt: skip


@njit(cache=True, nogil=True, error_model="numpy")
def core_kernel(  # type: ignore[no-untyped-def]  # noqa: C901
    cu, mu, pi, ent, mask, params,
    fsum, fext, cnt,
    hist_ad, prom_ad, prom_s, heat_all, heat_rej,
    lb_seqs, lb_tokens, lb_abs_l, lb_k3,
    worst_score, worst_index,
    layouts, ad_table, ad_bump, s_edges, h_edges, hd_edges,
):  # fmt: skip
    """Fill the accumulators from one packed batch (see core.accumulator for the layout)."""
    b_d = _aligned_f64(_CHUNK)
    b_k3 = _aligned_f64(_CHUNK)
    b_rm1 = _aligned_f64(_CHUNK)
    b_r = _aligned_f64(_CHUNK)
    b_kp = _aligned_f64(_CHUNK)
    b_q = _aligned_f64(_CHUNK)
    b_score = _aligned_f64(_CHUNK)
    b_fb = _aligned_i64(_CHUNK)
    ad2 = np.zeros(2 * hist_ad.shape[0], dtype=np.int64)
    prom4 = np.zeros(LANES * prom_s.shape[0], dtype=np.int64)
    heat2 = np.zeros(LANES * 2 * heat_all.size, dtype=np.int64)
    cells = np.empty((4, _CHUNK), dtype=np.int64)
    wk = np.zeros(1, dtype=np.int64)
    for i in range(worst_score.shape[0]):
        if worst_score[i] < worst_score[wk[0]]:
            wk[0] = i
    n = mu.shape[0]
    wst = np.zeros(3, dtype=np.int64)
    wacc = np.zeros(VACC, dtype=np.float64)
    start_segments(cu, n, wst)
    x_mu = _aligned_f64(_DIRECT)
    x_pi = _aligned_f64(_DIRECT)
    x_h = _aligned_f64(_DIRECT)
    x_on = _aligned_i64(_DIRECT)
    for c0 in range(0, n, _CHUNK):
        c1 = min(c0 + _CHUNK, n)
        if c1 - c0 >= _DIRECT:
            _chunk(
                mu[c0:c1], pi[c0:c1], ent[c0:c1], mask[c0:c1], cu, n, c0, c1, params, fsum, fext,
                cnt, b_d, b_k3, b_rm1, b_r, b_q, b_score, b_fb, b_kp, layouts,
                wst, wacc, lb_seqs, lb_tokens, lb_abs_l, lb_k3, ad2, prom4, heat2,
                heat_all.shape[1], worst_score, worst_index, wk, cells, ad_bump, s_edges, h_edges,
                hd_edges,
            )  # fmt: skip
        else:  # a short last chunk: staged, see _DIRECT
            for j in range(c1 - c0):
                x_mu[j] = mu[c0 + j]
                x_pi[j] = pi[c0 + j]
                x_h[j] = ent[c0 + j]
                x_on[j] = mask[c0 + j]
            _chunk(
                x_mu, x_pi, x_h, x_on, cu, n, c0, c1, params, fsum, fext,
                cnt, b_d, b_k3, b_rm1, b_r, b_q, b_score, b_fb, b_kp, layouts,
                wst, wacc, lb_seqs, lb_tokens, lb_abs_l, lb_k3, ad2, prom4, heat2,
                heat_all.shape[1], worst_score, worst_index, wk, cells, ad_bump, s_edges, h_edges,
                hd_edges,
            )  # fmt: skip
    finish_sequence(wst, wacc, fsum, fext, cnt, lb_seqs, lb_tokens, lb_abs_l, lb_k3, params)
    fold_fine(ad2, prom4, heat2, hist_ad, prom_ad, prom_s, heat_all, heat_rej, ad_table)
