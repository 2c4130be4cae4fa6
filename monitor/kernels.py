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
    size = 15


class M:
    """Indices of the extrema vector (max unless named min)."""

    ad, pdiff, r, r_min, seq_abs_l = range(5)
    size = 5


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


@njit(inline="always", cache=True)
def _k3_rm1(d):  # type: ignore[no-untyped-def]
    """(k3, r − 1) for δ: series below 1e-2 (no cancellation), expm1 of the clamped δ above."""
    if abs(d) < 1e-2:
        k3 = d * d * (0.5 + d * (1 / 6 + d * (1 / 24 + d * (1 / 120 + d * (1 / 720 + d / 5040)))))
        return k3, d + k3
    dc = min(max(d, -20.0), 20.0)
    rm1 = math.expm1(dc)
    return rm1 - dc, rm1


@njit(cache=True)
def k3_of(mu, pi, mask):  # type: ignore[no-untyped-def]
    """Per-token k3 (zero where masked out): used by the optional per-version breakdowns."""
    out = np.zeros(mu.shape[0], dtype=np.float64)
    for t in range(mu.shape[0]):
        if mask[t]:
            out[t] = _k3_rm1(float(pi[t]) - float(mu[t]))[0]
    return out


@njit(inline="always", cache=True)
def _fine_index(x, biased_lo, octaves, sub_bits, last):  # type: ignore[no-untyped-def]
    if not x > 0.0:
        return 0
    bits = _f64_bits(x)
    e = np.int64(bits >> np.uint64(52))
    if e < biased_lo:
        return 0
    if e >= biased_lo + octaves:
        return last
    sub = np.int64((bits >> np.uint64(52 - sub_bits)) & np.uint64((1 << sub_bits) - 1))
    return 1 + (e - biased_lo) * (1 << sub_bits) + sub


_C_TOKENS, _C_SEQ, _C_TOK, _C_SEQR = C.tokens, C.sequences, C.tok_reject, C.seq_reject
_F_SEQ_ABS_L, _F_SEQ_GEO, _F_SEQ_EXP2L = F.seq_abs_l, F.seq_geo, F.seq_exp2l
_M_SEQ_ABS_L = M.seq_abs_l


@njit(cache=True, nogil=True)
def core_kernel(  # type: ignore[no-untyped-def]  # noqa: C901
    cu, mu, pi, ent, mask, params,
    fsum, fext, cnt,
    hist_ad, prom_ad, prom_s, heat_all, heat_rej,
    lb_seqs, lb_tokens, lb_abs_l, lb_k3,
    worst_score, worst_index,
    ad_layout, ad_table, ad_edges, s_layout, s_table, s_edges, h_edges, hd_edges,
):  # fmt: skip
    tau, eps, dabs_c = params[0], params[1], params[2]
    ice_lo, ice_hi, phi, tis_c = params[3], params[4], params[5], params[6]
    mis_lo, mis_hi, geo_lo, geo_hi, kappa = params[7], params[8], params[9], params[10], params[11]
    ad_lo, ad_oct, ad_sub, ad_last = ad_layout[0], ad_layout[1], ad_layout[2], ad_layout[3]
    s_lo, s_oct, s_sub, s_last = s_layout[0], s_layout[1], s_layout[2], s_layout[3]
    n_ad_edges = ad_edges.shape[0]
    n_s_edges = s_edges.shape[0]
    n_h = h_edges.shape[0]
    n_hd = hd_edges.shape[0]
    wmin = 0
    for i in range(worst_score.shape[0]):
        if worst_score[i] < worst_score[wmin]:
            wmin = i
    s_d = s_ad = s_d2 = s_k3 = s_rm1 = s_rm1sq = s_h = s_h2 = s_d2h = s_d4 = s_pd = s_sc = 0.0
    m_ad, m_pd, m_r, m_rmin = fext[0], fext[1], fext[2], fext[3]
    r_estr = r_dabs = r_ice = r_kpop = r_tis = 0
    n_tok = 0
    for s in range(cu.shape[0] - 1):
        n_s = 0
        big_l = 0.0
        k3_s = 0.0
        for t in range(cu[s], cu[s + 1]):
            if mask[t] == 0:
                continue
            m = float(mu[t])
            p = float(pi[t])
            h = float(ent[t])
            d = p - m
            ad = abs(d)
            d2 = d * d
            k3, rm1 = _k3_rm1(d)
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
            r = 1.0 + rm1
            m_ad = max(m_ad, ad)
            m_r = max(m_r, r)
            m_rmin = min(m_rmin, r)
            # probabilities: p − q = q (r − 1) while δ is unclamped, saving one exp
            q = math.exp(m)
            pp = q + q * rm1 if ad <= 20.0 else math.exp(p)
            pdiff = abs(pp - q)
            s_pd += pdiff
            m_pd = max(m_pd, pdiff)
            # token policies
            hp = h + eps
            if d2 > tau * hp:
                r_estr += 1
                estr_rej = True
            else:
                estr_rej = False
            if ad > dabs_c:
                r_dabs += 1
            dc = min(max(d, -20.0), 20.0)
            if dc < ice_lo or dc > ice_hi:
                r_ice += 1
            if dc > tis_c:
                r_tis += 1
            pc = min(max(pp, 1e-8), 1.0 - 1e-8)
            qc = min(max(q, 1e-8), 1.0 - 1e-8)
            diff = pc - qc
            if diff * diff > phi * min(qc * (1.0 - qc), pc * (1.0 - pc)):  # KL ≤ χ² undecided
                lp = min(max(p, _LOG_P_LO), _LOG_P_HI)
                lq = min(max(m, _LOG_P_LO), _LOG_P_HI)
                lam = math.log1p(-diff / (1.0 - qc))
                d_pq = pc * (lp - lq) + (1.0 - pc) * lam
                d_qp = qc * (lq - lp) - (1.0 - qc) * lam
                if max(d_pq, d_qp) > phi:
                    r_kpop += 1
            # histograms and heatmap
            fb = _fine_index(ad, ad_lo, ad_oct, ad_sub, ad_last)
            hist_ad[fb] += 1
            c = ad_table[fb]
            if c < n_ad_edges and ad > ad_edges[c]:
                c += 1
            prom_ad[c] += 1
            score = d2 / hp
            s_sc += score
            sb = _fine_index(score, s_lo, s_oct, s_sub, s_last)
            c = s_table[sb]
            if c < n_s_edges and score > s_edges[c]:
                c += 1
            prom_s[c] += 1
            hr = 0
            while hr + 1 < n_h and h >= h_edges[hr + 1]:
                hr += 1
            hc = 0
            while hc + 1 < n_hd and ad >= hd_edges[hc + 1]:
                hc += 1
            heat_all[hr, hc] += 1
            if estr_rej:
                heat_rej[hr, hc] += 1
            if score > worst_score[wmin]:
                worst_score[wmin] = score
                worst_index[wmin] = t
                for i in range(worst_score.shape[0]):
                    if worst_score[i] < worst_score[wmin]:
                        wmin = i
        if n_s == 0:
            continue
        n_tok += n_s
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
    cnt[_C_TOKENS] += n_tok
    cnt[_C_TOK + 0] += r_estr
    cnt[_C_TOK + 1] += r_dabs
    cnt[_C_TOK + 2] += r_ice
    cnt[_C_TOK + 3] += r_kpop
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
    fext[0] = m_ad
    fext[1] = m_pd
    fext[2] = m_r
    fext[3] = m_rmin
