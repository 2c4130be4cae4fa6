"""The fused numba kernel: one pass over a packed batch fills every additive accumulator.

Why one hand-written loop instead of numpy expressions: the full catalog needs ~40 reductions,
8 policies, 4 histograms, a heatmap, length buckets and a top-k. In numpy each is a pass over
memory plus temporaries; here each token is loaded once and every statistic is updated from
registers. Transcendentals are the cost that remains, so the loop avoids them where exact
alternatives exist: exp(δ) is a 7-term series for |δ| < 1e-2 (where it is also more accurate
than exp − 1), policy thresholds on r compare δ against log-thresholds, histogram bins come from
the float's bits, and KPop only evaluates its logarithm when a χ² bound cannot decide.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["F", "M", "C", "N_POLICIES", "core_kernel", "k3_of"]


class F:
    """Indices of the float64 sum vector."""

    d, ad, d2, k3, rm1, rm1sq, h, h2, d2h, d4, pdiff, score = range(12)
    seq_abs_l, seq_geo, seq_exp2l = range(12, 15)
    r, r2 = 15, 16  # raw Σr, Σr² beside the shifted Σ(r−1), Σ(r−1)²: each is exact in one regime
    size = 17


class M:
    """Indices of the extrema vector: maxima, then minima (MINIMA)."""

    ad, pdiff, d_max, seq_abs_l, h_max, d2_max = range(6)
    d_min, h_min, d2_min = range(6, 9)
    MINIMA = (6, 7, 8)
    size = 9


class C:
    """Indices of the int64 count vector: tokens, sequences, rejected tokens, rejected seqs."""

    tokens, sequences = 0, 1
    tok_reject = 2  # + policy index, 8 policies
    seq_reject = 10  # + 0 seq_mis, 1 geo_rs, 2 k3_rs
    size = 13


N_POLICIES = 8
_LOG_P_LO = math.log(1e-8)
_LOG_P_HI = math.log1p(-1e-8)


@intrinsic
def _f64_bits(typingctx, x):  # type: ignore[no-untyped-def]
    sig = types.uint64(types.float64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(64))

    return sig, codegen


@intrinsic
def _bits_f64(typingctx, x):  # type: ignore[no-untyped-def]
    sig = types.float64(x)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.DoubleType())

    return sig, codegen


_INV_LN2 = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # fdlibm's split of ln 2: k·_LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_SQRT2 = 1.4142135623730951


@njit(inline="always", cache=True, error_model="numpy")
def _exp(x):  # type: ignore[no-untyped-def]
    """exp for x in [-700, 700] (clamped), branch-free, within 2 ulp of libm.

    Range reduction x = k·ln2 + r, |r| ≤ ln2/2, then a degree-13 Taylor polynomial
    (truncation < 1e-17 relative) and 2^k assembled from bits. Inlined into the loop it costs a
    quarter of a libm call, which is the difference between ~25 and ~80 M tokens/s.
    """
    x = min(max(x, -700.0), 700.0)
    k = math.floor(x * _INV_LN2 + 0.5)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = 1.0 + r * (
        1.0
        + r
        * (
            1 / 2
            + r
            * (
                1 / 6
                + r
                * (
                    1 / 24
                    + r
                    * (
                        1 / 120
                        + r
                        * (
                            1 / 720
                            + r
                            * (
                                1 / 5040
                                + r
                                * (
                                    1 / 40320
                                    + r
                                    * (
                                        1 / 362880
                                        + r
                                        * (
                                            1 / 3628800
                                            + r
                                            * (1 / 39916800 + r * (1 / 479001600 + r / 6227020800))
                                        )
                                    )
                                )
                            )
                        )
                    )
                )
            )
        )
    )
    return p * _bits_f64((np.int64(k) + 1023) << 52)


@njit(inline="always", cache=True, error_model="numpy")
def _log(x):  # type: ignore[no-untyped-def]
    """log for positive normal x, branch-free: x = 2^e·m, m ∈ [√½, √2), log m = 2·atanh(s).

    s = (m − 1)/(m + 1) has |s| ≤ 0.172, so the odd series to s^23 is below 1e-17 relative,
    and m − 1 is exact, which keeps the result accurate near x = 1 (where KPop needs it).
    """
    bits = _f64_bits(x)
    # unsigned shifts and the exponent as a double without an int→float conversion: AVX2 has
    # neither a 64-bit arithmetic shift nor that conversion, and either would stop vectorising
    e = _bits_f64((bits >> np.uint64(52)) | np.uint64(0x4330000000000000)) - 4503599627371519.0
    m = _bits_f64((bits & np.uint64(0xFFFFFFFFFFFFF)) | np.uint64(0x3FF0000000000000))
    big = np.float64(m > _SQRT2)
    m = m * (1.0 - 0.5 * big)
    e = e + big
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    poly = 1.0 + z * (
        1 / 3
        + z
        * (
            1 / 5
            + z
            * (
                1 / 7
                + z
                * (
                    1 / 9
                    + z
                    * (
                        1 / 11
                        + z
                        * (
                            1 / 13
                            + z * (1 / 15 + z * (1 / 17 + z * (1 / 19 + z * (1 / 21 + z / 23))))
                        )
                    )
                )
            )
        )
    )
    return (e * _LN2_HI + 2.0 * s * poly) + e * _LN2_LO


@njit(inline="always", cache=True, error_model="numpy")
def _k3_rm1(d):  # type: ignore[no-untyped-def]
    """(k3, r − 1, r) for δ, branch-free: series below |δ| = 1e-2 (where exp − 1 would cancel),
    exp of the clamped δ above."""
    ser = d * d * (0.5 + d * (1 / 6 + d * (1 / 24 + d * (1 / 120 + d * (1 / 720 + d / 5040)))))
    dc = min(max(d, -20.0), 20.0)
    r = _exp(dc)
    em1 = r - 1.0
    small = abs(d) < 1e-2
    return (
        (ser if small else em1 - dc),
        (d + ser if small else em1),
        (1.0 + (d + ser) if small else r),
    )


@njit(cache=True, error_model="numpy")
def k3_of(mu, pi, mask):  # type: ignore[no-untyped-def]
    """Per-token k3 (zero where masked out): used by the optional per-version breakdowns."""
    out = np.zeros(mu.shape[0], dtype=np.float64)
    for t in range(mu.shape[0]):
        if mask[t]:
            out[t] = _k3_rm1(np.float64(pi[t]) - np.float64(mu[t]))[0]
    return out


@njit(inline="always", cache=True, error_model="numpy")
def _fine_index(x, biased_lo, octaves, sub_bits, last):  # type: ignore[no-untyped-def]
    """Bin of x ≥ 0 in a bit-sliced log histogram (see monitor.histograms), branch-free."""
    bits = _f64_bits(x)
    e = np.int64(bits >> np.uint64(52))
    sub = np.int64(bits >> np.uint64(52 - sub_bits)) & ((1 << sub_bits) - 1)
    idx = 1 + (e - biased_lo) * (1 << sub_bits) + sub
    idx = last if e >= biased_lo + octaves else idx
    return 0 if e < biased_lo else idx


_C_TOKENS, _C_SEQ, _C_TOK, _C_SEQR = C.tokens, C.sequences, C.tok_reject, C.seq_reject
_F_SEQ_ABS_L, _F_SEQ_GEO, _F_SEQ_EXP2L = F.seq_abs_l, F.seq_geo, F.seq_exp2l
_M_SEQ_ABS_L = M.seq_abs_l
M_AD, M_PD, M_DMAX, M_DMIN = M.ad, M.pdiff, M.d_max, M.d_min
M_HMAX, M_HMIN, M_D2MAX, M_D2MIN = M.h_max, M.h_min, M.d2_max, M.d2_min


_CHUNK = 512


@njit(cache=True, nogil=True, error_model="numpy")
def _token_phase(mu, pi, ent, c0, c1, params, b_k3, b_rm1, b_r, b_pdiff, b_kpop, b_score):  # type: ignore[no-untyped-def]
    """Vectorisable part: every transcendental of the chunk [c0, c1), masked or not."""
    eps, phi = params[1], params[5]
    for i in range(c0, c1):
        j = i - c0
        m = np.float64(mu[i])
        p = np.float64(pi[i])
        d = p - m
        k3, rm1, r = _k3_rm1(d)
        q = _exp(m)
        ep = _exp(p)
        pp = q + q * rm1 if abs(d) <= 20.0 else ep
        pc = min(max(pp, 1e-8), 1.0 - 1e-8)
        qc = min(max(q, 1e-8), 1.0 - 1e-8)
        lp = min(max(p, _LOG_P_LO), _LOG_P_HI)
        lq = min(max(m, _LOG_P_LO), _LOG_P_HI)
        lam = _log((1.0 - pc) / (1.0 - qc))
        d_pq = pc * (lp - lq) + (1.0 - pc) * lam
        d_qp = qc * (lq - lp) - (1.0 - qc) * lam
        b_k3[j] = k3
        b_rm1[j] = rm1
        b_r[j] = r
        b_pdiff[j] = abs(pp - q)
        b_kpop[j] = np.float64(max(d_pq, d_qp) > phi)
        b_score[j] = d * d / (np.float64(ent[i]) + eps)


@njit(cache=True, nogil=True, error_model="numpy")
def core_kernel(  # type: ignore[no-untyped-def]  # noqa: C901
    cu, mu, pi, ent, mask, params,
    fsum, fext, cnt,
    hist_ad, prom_ad, prom_s, heat_all, heat_rej,
    lb_seqs, lb_tokens, lb_abs_l, lb_k3,
    worst_score, worst_index,
    ad_layout, ad_table, ad_edges, s_layout, s_table, s_edges,
    h_layout, h_table, h_edges, hd_table, hd_edges,
):  # fmt: skip
    """Fill the accumulators from one packed batch (see monitor.accumulator for the layout).

    Works in chunks of `_CHUNK` tokens: `_token_phase` computes the transcendental per-token
    values into L1-resident buffers with SIMD, then this loop walks the chunk once, masked
    tokens only, updating sums, extrema, histograms, the heatmap, the top-k and, at each
    sequence boundary, the sequence statistics.
    """
    tau, eps, dabs_c = params[0], params[1], params[2]
    ice_lo, ice_hi, tis_c = params[3], params[4], params[6]
    mis_lo, mis_hi, geo_lo, geo_hi, kappa = params[7], params[8], params[9], params[10], params[11]
    ad_lo, ad_oct, ad_sub, ad_last = ad_layout[0], ad_layout[1], ad_layout[2], ad_layout[3]
    s_lo, s_oct, s_sub, s_last = s_layout[0], s_layout[1], s_layout[2], s_layout[3]
    h_lo, h_oct, h_sub, h_last = h_layout[0], h_layout[1], h_layout[2], h_layout[3]
    n_ad_edges = ad_edges.shape[0]
    n_s_edges = s_edges.shape[0]
    n_h = h_edges.shape[0]
    n_hd = hd_edges.shape[0]
    b_k3 = np.empty(_CHUNK)
    b_rm1 = np.empty(_CHUNK)
    b_r = np.empty(_CHUNK)
    b_pdiff = np.empty(_CHUNK)
    b_kpop = np.empty(_CHUNK)
    b_score = np.empty(_CHUNK)
    wmin = 0
    for i in range(worst_score.shape[0]):
        if worst_score[i] < worst_score[wmin]:
            wmin = i
    s_d = s_ad = s_d2 = s_k3 = s_rm1 = s_rm1sq = s_h = s_h2 = s_d2h = s_d4 = s_pd = s_sc = 0.0
    s_r = s_r2 = 0.0
    m_ad, m_pd, m_dmax, m_dmin = fext[M_AD], fext[M_PD], fext[M_DMAX], fext[M_DMIN]
    m_hmax, m_hmin, m_d2max, m_d2min = fext[M_HMAX], fext[M_HMIN], fext[M_D2MAX], fext[M_D2MIN]
    r_estr = r_dabs = r_ice = r_tis = 0
    r_kpop = 0.0
    n_tok = 0
    n = mu.shape[0]
    nseq = cu.shape[0] - 1
    s = 0
    while s < nseq and cu[s + 1] == 0:
        s += 1
    seq_end = cu[s + 1] if s < nseq else n
    n_s = 0
    big_l = 0.0
    k3_s = 0.0
    for c0 in range(0, n, _CHUNK):
        c1 = min(c0 + _CHUNK, n)
        _token_phase(mu, pi, ent, c0, c1, params, b_k3, b_rm1, b_r, b_pdiff, b_kpop, b_score)
        for t in range(c0, c1):
            if t == seq_end:
                if n_s > 0:
                    _close_sequence(
                        n_s, big_l, k3_s, fsum, fext, cnt, lb_seqs, lb_tokens, lb_abs_l, lb_k3,
                        mis_lo, mis_hi, geo_lo, geo_hi, kappa,
                    )  # fmt: skip
                    n_tok += n_s
                n_s = 0
                big_l = 0.0
                k3_s = 0.0
                s += 1
                while cu[s + 1] == t:
                    s += 1
                seq_end = cu[s + 1]
            if mask[t] == 0:
                continue
            j = t - c0
            h = np.float64(ent[t])
            d = np.float64(pi[t]) - np.float64(mu[t])
            ad = abs(d)
            d2 = d * d
            k3 = b_k3[j]
            rm1 = b_rm1[j]
            n_s += 1
            big_l += d
            k3_s += k3
            s_d += d
            s_ad += ad
            s_d2 += d2
            s_k3 += k3
            s_rm1 += rm1
            s_rm1sq += rm1 * rm1
            s_h += h
            s_h2 += h * h
            s_d2h += d2 * h
            s_d4 += d2 * d2
            r = b_r[j]
            s_r += r
            s_r2 += r * r
            m_ad = max(m_ad, ad)
            m_dmax = max(m_dmax, d)
            m_dmin = min(m_dmin, d)
            m_hmax = max(m_hmax, h)
            m_hmin = min(m_hmin, h)
            m_d2max = max(m_d2max, d2)
            m_d2min = min(m_d2min, d2)
            pdiff = b_pdiff[j]
            s_pd += pdiff
            m_pd = max(m_pd, pdiff)
            r_kpop += b_kpop[j]
            estr_rej = d2 > tau * (h + eps)
            r_estr += estr_rej
            r_dabs += d2 > dabs_c
            dc = min(max(d, -20.0), 20.0)
            r_ice += (dc < ice_lo) | (dc > ice_hi)
            r_tis += dc > tis_c
            fb = _fine_index(ad, ad_lo, ad_oct, ad_sub, ad_last)
            hist_ad[fb] += 1
            c = ad_table[fb]
            c += c < n_ad_edges and ad > ad_edges[c]
            prom_ad[c] += 1
            score = b_score[j]
            s_sc += score
            sb = _fine_index(score, s_lo, s_oct, s_sub, s_last)
            c = s_table[sb]
            c += c < n_s_edges and score > s_edges[c]
            prom_s[c] += 1
            hc = hd_table[fb]
            hc += hc + 1 < n_hd and ad >= hd_edges[hc + 1]
            hr = h_table[_fine_index(h, h_lo, h_oct, h_sub, h_last)]
            hr += hr + 1 < n_h and h >= h_edges[hr + 1]
            heat_all[hr, hc] += 1
            if estr_rej:  # rare: a predictable branch beats an unconditional read-modify-write
                heat_rej[hr, hc] += 1
            if score > worst_score[wmin]:
                worst_score[wmin] = score
                worst_index[wmin] = t
                for i in range(worst_score.shape[0]):
                    if worst_score[i] < worst_score[wmin]:
                        wmin = i
    if n_s > 0:
        _close_sequence(
            n_s, big_l, k3_s, fsum, fext, cnt, lb_seqs, lb_tokens, lb_abs_l, lb_k3,
            mis_lo, mis_hi, geo_lo, geo_hi, kappa,
        )  # fmt: skip
        n_tok += n_s
    cnt[_C_TOKENS] += n_tok
    cnt[_C_TOK + 0] += r_estr
    cnt[_C_TOK + 1] += r_dabs
    cnt[_C_TOK + 2] += r_ice
    cnt[_C_TOK + 3] += np.int64(r_kpop)
    cnt[_C_TOK + 4] += r_tis
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
    fext[M_AD] = m_ad
    fext[M_PD] = m_pd
    fext[M_DMAX] = m_dmax
    fext[M_DMIN] = m_dmin
    fext[M_HMAX] = m_hmax
    fext[M_HMIN] = m_hmin
    fext[M_D2MAX] = m_d2max
    fext[M_D2MIN] = m_d2min


@njit(cache=True, nogil=True, error_model="numpy")
def _close_sequence(  # type: ignore[no-untyped-def]
    n_s, big_l, k3_s, fsum, fext, cnt, lb_seqs, lb_tokens, lb_abs_l, lb_k3,
    mis_lo, mis_hi, geo_lo, geo_hi, kappa,
):  # fmt: skip
    """Sequence statistics, length bucket and sequence-policy decisions of one sequence."""
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
