"""The fused kernel's scalar part, per staged chunk: sequences, histogram scatters, top-k.

What it fills is exactly what the original token-by-token walk filled, in the same order where
order matters for floats:

* per-sequence L and Σk3 are sequential sums in token order (no fast-math: never reassociated).
  Masked-out positions now join the loop instead of being skipped: the vector phase staged them
  as δ = +0.0 and k3 = +0.0, and a running sum that starts at +0.0 is never −0.0 in
  round-to-nearest, so adding +0.0 leaves it unchanged, bit for bit;
* the rare |δ| > 20 tokens add to the probability sums in token order, after the chunk's vector
  sums, as before;
* histogram and heatmap cells are integer counts (any order gives the same counts); masked-out
  positions add 0 to a valid cell instead of branching;
* verl's per-sequence sums (new definitions, no earlier bits to keep) are reassociated;
* the top-k keeps the walk's exact replacement rule (strictly greater than the current minimum,
  the first minimal slot is replaced), so ties resolve as before.
"""

from __future__ import annotations

import math

import numpy as np

from .fastmath import LOG_P_HI, LOG_P_LO, log
from .jitcache import njit
from .kernels_seq import (
    kpop_maybe,
    kpop_threshold,
    top_k,
    verl_close,
    verl_segment,
)
from .layout import C, F, M

__all__ = [
    "LANES",
    "bump_table",
    "close_sequence",
    "finish_sequence",
    "fold_fine",
    "kpop_maybe",
    "kpop_reject",
    "kpop_threshold",
    "walk_chunk",
]

_C_SEQ, _C_TOK, _C_SEQR = C.sequences, C.tok_reject, C.seq_reject
_F_SEQ_ABS_L, _F_SEQ_GEO, _F_SEQ_EXP2L = F.seq_abs_l, F.seq_geo, F.seq_exp2l
_M_SEQ_ABS_L = M.seq_abs_l
_F_PD2 = F.pd2
#: copies of the score and heatmap counts (a power of two; see `walk_chunk`)
LANES = 4


def bump_table(table: np.ndarray, edges: np.ndarray, shift: int) -> np.ndarray:
    """Per fine bin b, the coarse edge a value of b must pass (`>` for the `le` buckets,
    `>=` for the left-closed heatmap) to land one coarse bin above `table[b]`: the edge
    `edges[table[b] + shift]`, or +inf where there is none, so the comparison is one load.
    """
    idx = table.astype(np.int64) + shift
    out = np.full(table.shape[0], np.inf)
    ok = idx < edges.shape[0]
    out[ok] = edges[idx[ok]]
    return out


@njit(inline="always", cache=True, error_model="numpy")
def kpop_reject(p, q, lp, lq, phi):  # type: ignore[no-untyped-def]
    """max(D_B(p‖q), D_B(q‖p)) > φ for probabilities clamped to [1e-8, 1 − 1e-8]."""
    pc = min(max(p, 1e-8), 1.0 - 1e-8)
    qc = min(max(q, 1e-8), 1.0 - 1e-8)
    lp = min(max(lp, LOG_P_LO), LOG_P_HI)
    lq = min(max(lq, LOG_P_LO), LOG_P_HI)
    lam = log((1.0 - pc) / (1.0 - qc))
    return max(pc * (lp - lq) + (1.0 - pc) * lam, qc * (lq - lp) - (1.0 - qc) * lam) > phi


@njit(
    cache=True, nogil=True, _nrt=False, error_model="numpy", fastmath={"reassoc", "nsz", "contract"}
)
def _kpop_near(rare, n_rare, b_kp, b_q, x_mu, x_pi, x_on, cnt, phi):  # type: ignore[no-untyped-def]
    """`kpop_reject` of the chunk's KPop candidates (b_kp = e^π ≥ 0, |δ| ≤ 20) with the first
    vector pass's fast-math flags: the same expression under the same flags, so the decision
    that pass used to take itself."""
    n_kpop = 0
    for i in range(n_rare):
        j = rare[i]
        pp = b_kp[j]
        if pp >= 0.0:
            on = x_on[j] != 0
            p = x_pi[j] if on else -1.0
            m = x_mu[j] if on else -1.0
            n_kpop += kpop_reject(pp, b_q[j], p, m, phi)
    cnt[_C_TOK + 3] += n_kpop


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy")
def _far(rare, n_rare, b_d, x_mu, x_pi, fsum, fext, cnt, phi):  # type: ignore[no-untyped-def]
    """The chunk's |δ| > 20 tokens, in token order: probabilities from e^π itself (the vector
    passes skipped them), added after the chunk's vector sums, as before."""
    for i in range(n_rare):
        j = rare[i]
        if abs(b_d[j]) > 20.0:
            mu = np.float64(x_mu[j])
            pi = np.float64(x_pi[j])
            q = math.exp(mu)
            ep = math.exp(pi)
            pdiff = abs(ep - q)
            fsum[10] += pdiff
            fext[1] = max(fext[1], pdiff)
            cnt[_C_TOK + 3] += kpop_reject(ep, q, pi, mu, phi)
            fsum[_F_PD2] += pdiff * pdiff
            fsum[_F_PD2 + 1] += ep
            fsum[_F_PD2 + 2] += q
            fsum[_F_PD2 + 3] += ep * ep
            fsum[_F_PD2 + 4] += q * q
            fsum[_F_PD2 + 5] += ep * q


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy")
def close_sequence(  # type: ignore[no-untyped-def]
    n_s, big_l, k3_s, fsum, fext, cnt, lb_seqs, lb_tokens, lb_abs_l, lb_k3, params,
):  # fmt: skip
    """Sequence statistics, length bucket and sequence-policy decisions of one sequence."""
    mis_lo, mis_hi, geo_lo, geo_hi, kappa = params[7], params[8], params[9], params[10], params[11]
    cnt[_C_SEQ] += 1
    abs_l = abs(big_l)
    fsum[_F_SEQ_ABS_L] += abs_l
    fext[_M_SEQ_ABS_L] = max(fext[_M_SEQ_ABS_L], abs_l)
    g = big_l / n_s
    fsum[_F_SEQ_GEO] += math.exp(min(max(g, -20.0), 20.0))
    fsum[_F_SEQ_EXP2L] += math.exp(2.0 * min(max(big_l, -20.0), 20.0))
    b = 0
    x = n_s
    while x > 1:
        x >>= 1
        b += 1
    lb_seqs[b] += 1
    lb_tokens[b] += n_s
    lb_abs_l[b] += abs_l
    lb_k3[b] += k3_s
    if big_l < mis_lo or big_l > mis_hi:
        cnt[_C_TOK + 5] += n_s
        cnt[_C_SEQR + 0] += 1
    if g < geo_lo or g > geo_hi:
        cnt[_C_TOK + 6] += n_s
        cnt[_C_SEQR + 1] += 1
    if k3_s / n_s > kappa:
        cnt[_C_TOK + 7] += n_s
        cnt[_C_SEQR + 2] += 1


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy")
def finish_sequence(  # type: ignore[no-untyped-def]
    wst, wacc, fsum, fext, cnt, lb_seqs, lb_tokens, lb_abs_l, lb_k3, params,
):  # fmt: skip
    """Close the running sequence if it has masked tokens (its original statistics, then verl's
    on the same L and Σk3), and reset the running sums."""
    if wst[2] > 0:
        close_sequence(
            wst[2], wacc[1], wacc[2], fsum, fext, cnt, lb_seqs, lb_tokens, lb_abs_l, lb_k3, params
        )  # fmt: skip
        wacc[0] = wst[2]
        verl_close(wacc, fsum, fext, cnt, params)
    wst[2] = 0
    wacc[:] = 0.0


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy")
def walk_chunk(  # type: ignore[no-untyped-def]  # noqa: C901
    cu, n, c0, c1, x_mu, x_pi, x_h, x_on, b_d, b_k3, b_score, b_fb, b_q, b_kp, params,
    b_rm1, b_r, fsum, fext, cnt, wst, wacc, lb_seqs, lb_tokens, lb_abs_l, lb_k3,
    ad2, prom4, heat2, n_cols, worst_score, worst_index, wk, cells,
    ad_bump, s_edges, h_edges, hd_edges,
):  # fmt: skip
    """Everything of the staged chunk [c0, c1) the vector passes leave: the running sequence
    sums (wst = (sequence, its end, masked tokens so far), wacc = `kernels_seq.VACC`'s running
    sums: L and Σk3 of the original statistics, and verl's), closing every sequence that ends
    inside the chunk; fine-bin and heatmap counts; the rare tokens (KPop candidates and
    |δ| > 20, finished once per chunk by `_kpop_near` and `_far`); the top-k (wk[0] is its
    minimal slot).

    ad2[2·b + u] counts the tokens of fine |δ| bin b that are (u = 1) or are not above the
    coarse edge inside that bin (`bump_table`); the ESTR score's coarse bin counts the edges the
    score is above (the `le` bucket's definition); heat2 counts heatmap cells, rejected
    by ESTR in its second half. Heatmap cells count the inner grid edges a value passes (the
    left-closed grid's definition). The score and heatmap counts are spread over `LANES` copies
    (token j counts in copy j mod `LANES`), so runs of one cell do not chain their increments
    through memory; `fold_fine` adds the copies up and turns the split counts into the
    accumulator's histograms. Cell indices are computed in loops of their own (lookups and
    compares, no scatter; the heatmap's vectorises); the scatters share the sequential loop of
    L and Σk3, whose add latency they hide; verl's per-sequence sums (new definitions, free to
    be reassociated) are a vectorised loop per sequence segment (`kernels_seq.verl_segment`).
    """
    tau, eps, phi = params[0], params[1], params[5]
    n_cells = heat2.shape[0] // (2 * LANES)
    n_prom = prom4.shape[0] // LANES
    m = c1 - c0
    k_ad = cells[0]
    k_s = cells[1]
    k_h = cells[2]
    for j in range(m):
        fb = b_fb[j]
        k_ad[j] = 2 * fb + (abs(b_d[j]) > ad_bump[np.uint64(fb)])
    # edges as scalars: compares and selects only, so this loop vectorises
    s1, s2, s3, s4, s5, s6, s7, s8 = s_edges[0:8]
    s9, s10, s11, s12, s13, s14, s15, s16 = s_edges[8:16]
    d1, d2, d3, d4, d5 = hd_edges[1], hd_edges[2], hd_edges[3], hd_edges[4], hd_edges[5]
    e1, e2, e3, e4, e5, e6 = h_edges[1], h_edges[2], h_edges[3], h_edges[4], h_edges[5], h_edges[6]
    for j in range(m):
        d = b_d[j]
        ad = abs(d)
        h = x_h[j] if x_on[j] != 0 else 0.0
        lane = j & (LANES - 1)
        hc = np.int64(ad >= d1) + (ad >= d2) + (ad >= d3) + (ad >= d4) + (ad >= d5)
        hr = np.int64(h >= e1) + (h >= e2) + (h >= e3) + (h >= e4) + (h >= e5) + (h >= e6)
        cell = hr * n_cols + hc + n_cells * (d * d > tau * (h + eps)) + lane * (2 * n_cells)
        k_h[j] = cell
        # the count of the 16 sorted edges below x, by binary search (5 compares, not 16)
        x = b_score[j]
        m1 = x > s8
        m2 = x > (s12 if m1 else s4)
        p = (s14 if m2 else s10) if m1 else (s6 if m2 else s2)
        m3 = x > p
        p_hi = (s15 if m3 else s13) if m2 else (s11 if m3 else s9)
        p_lo = (s7 if m3 else s5) if m2 else (s3 if m3 else s1)
        m4 = x > (p_hi if m1 else p_lo)
        c = 8 * np.int64(m1) + 4 * np.int64(m2) + 2 * np.int64(m3) + np.int64(m4) + (x > s16)
        k_s[j] = c + lane * n_prom
    wk[0] = top_k(c0, m, x_on, b_score, worst_score, worst_index, wk[0])
    nseq = cu.shape[0] - 1
    rare = cells[3]
    n_rare = 0
    a = c0
    while a < c1:
        end = wst[1]
        b = min(end, c1)
        wst[2] += verl_segment(
            a - c0, b - c0, x_mu, x_pi, x_on, b_d, b_rm1, b_r, b_k3, b_q, b_kp, params, wacc,
            fsum, cnt,
        )  # fmt: skip
        big_l = wacc[1]
        k3_s = wacc[2]
        j0, j1 = a - c0, b - c0
        d_, k3_, kp_, on_ = b_d[j0:j1], b_k3[j0:j1], b_kp[j0:j1], x_on[j0:j1]
        c_ad, c_s, c_h = k_ad[j0:j1], k_s[j0:j1], k_h[j0:j1]
        # indices from 0 (slices) or unsigned: numba tests a signed index for wraparound, and
        # those tests cost the scatters ~15 % of the walk
        for j in range(b - a):
            on = on_[j] != 0
            d = d_[j]
            big_l += d
            k3_s += k3_[j]
            ad2[np.uint64(c_ad[j])] += on
            prom4[np.uint64(c_s[j])] += on
            heat2[np.uint64(c_h[j])] += on
            if kp_[j] >= 0.0 or abs(d) > 20.0:  # rare: a KPop candidate, or |δ| > 20
                rare[n_rare] = j0 + j
                n_rare += 1
        wacc[1] = big_l
        wacc[2] = k3_s
        a = b
        if b == end and end < n:
            finish_sequence(wst, wacc, fsum, fext, cnt, lb_seqs, lb_tokens, lb_abs_l, lb_k3, params)
            s = wst[0] + 1
            while s < nseq and cu[s + 1] == end:
                s += 1
            wst[0] = s
            wst[1] = cu[s + 1] if s < nseq else n
    _kpop_near(rare, n_rare, b_kp, b_q, x_mu, x_pi, x_on, cnt, phi)
    _far(rare, n_rare, b_d, x_mu, x_pi, fsum, fext, cnt, phi)


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy")
def fold_fine(  # type: ignore[no-untyped-def]
    ad2, prom4, heat2, hist_ad, prom_ad, prom_s, heat_all, heat_rej, ad_table,
):  # fmt: skip
    """Add the split counts of `walk_chunk` (the copies of the score and heatmap counts summed)
    to the fine, coarse and heatmap histograms."""
    flat_all = heat_all.reshape(-1)
    flat_rej = heat_rej.reshape(-1)
    n_cells = flat_all.shape[0]
    n_prom = prom_s.shape[0]
    for lane in range(LANES):
        o = lane * 2 * n_cells
        for i in range(n_cells):
            flat_all[i] += heat2[o + i] + heat2[o + n_cells + i]
            flat_rej[i] += heat2[o + n_cells + i]
        for i in range(n_prom):
            prom_s[i] += prom4[lane * n_prom + i]
    for b in range(hist_ad.shape[0]):
        lo = ad2[2 * b]
        hi = ad2[2 * b + 1]
        hist_ad[b] += lo + hi
        prom_ad[ad_table[b]] += lo
        if hi:
            prom_ad[ad_table[b] + 1] += hi
