"""The verl-parity metrics: a vectorised loop per sequence segment for their token and
per-sequence sums, the close of their per-sequence statistics; and the walk's top-k.

The fused kernel's first vector pass and scalar walk keep what they always computed (their
sums give the rows that existed at 530cb8a their bits). verl's metrics are new definitions with
no such history: their sums are reassociated here (float rounding at the 1e-16 level), in one
vectorised loop per sequence segment of a chunk (`verl_segment`, called by `kernels_walk`,
which goes sequence by sequence); `verl_close` turns a finished sequence's sums (`vacc`,
crossing chunks) into verl's statistics.
"""

from __future__ import annotations

import math

import numpy as np

from .fastmath import (
    LOG_P_HI,
    LOG_P_LO,
    bits_f64,
    f64_bits,
    from_order_key,
    order_key,
)
from .jitcache import njit
from .layout import C, F, M

__all__ = [
    "VACC",
    "kpop_maybe",
    "kpop_threshold",
    "start_segments",
    "top_k",
    "verl_close",
    "verl_segment",
]

_LN2 = math.log(2.0)
_FASTMATH = {"reassoc", "nsz", "contract"}
_BIG = 1.7976931348623157e308
_EXP_GUARD = 600.0  # perplexity exps: far from overflow even summed over 2^53 sequences
_F_PPL = F.ppl_train
_C_TOK2, _C_SEQR2, _C_WHI, _C_LOW = C.tok_reject2, C.seq_reject2, C.seq_w_high, C.is_low
_F_TIS, _F_PD2 = F.tis_m1, F.pd2
_M_LPD_MAX, _M_W_MAX, _M_W_DEV, _M_LPD_MIN, _M_W_MIN = (
    M.lpd_max, M.seq_w_max, M.seq_w_dev, M.lpd_min, M.seq_w_min,
)  # fmt: skip
#: running sums of the current sequence: n, L, Σk3, Σμ, Σπ, Σ(w−1), Σw, Σ(r−1), Σk2, max k2, max k3
VACC = 11


@njit(inline="always", cache=True, error_model="numpy")
def _log2_floor(x):  # type: ignore[no-untyped-def]
    """⌊log2 x⌋ of a positive normal float, from its exponent bits (exact, as a float)."""
    e = bits_f64((f64_bits(x) >> np.uint64(52)) | np.uint64(0x4330000000000000))
    return e - 4503599627371520.0 - 1023.0


@njit(inline="always", cache=True, error_model="numpy")
def kpop_threshold(phi):  # type: ignore[no-untyped-def]
    """The level `kpop_maybe`'s bounds must pass: φ less a margin (1e-9 relative and 1e-12
    absolute) far above the rounding of the bounds and of the exact test (terms below ~40, a
    few ulp each: ~1e-14), or −1 (every token a candidate) for φ < 1e-9."""
    return phi * (1.0 - 1e-9) - 1e-12 if phi >= 1e-9 else -1.0


@njit(inline="always", cache=True, error_model="numpy")
def kpop_maybe(p, q, lp, lq, phi_lo):  # type: ignore[no-untyped-def]
    """False only where `kpop_reject` is False for certain, without its log and division: each
    Bernoulli KL is bounded twice, and a token is a candidate only if both bounds pass
    `phi_lo` = `kpop_threshold(φ)` (φ less room for rounding):

    * χ²: D(a‖b) ≤ (a − b)²/(b(1 − b)) (tight for moderate probabilities);
    * exponents: with λ = log((1 − p)/(1 − q)) as in `kpop_reject`, log2 of each side lies in
      [e, e + 1) of its exponent e, so ±λ ≤ (±(e₁ − e₂) + 1)·ln 2 (tight near 0 and 1, where
      the χ² bound is loose), and the other term of each KL is exact already (p·(lp − lq)).

    `phi_lo` = −1 makes every token a candidate (φ too small for the bounds to help)."""
    pc = min(max(p, 1e-8), 1.0 - 1e-8)
    qc = min(max(q, 1e-8), 1.0 - 1e-8)
    lp = min(max(lp, LOG_P_LO), LOG_P_HI)
    lq = min(max(lq, LOG_P_LO), LOG_P_HI)
    g = pc - qc
    chi2 = g * g > phi_lo * min(qc * (1.0 - qc), pc * (1.0 - pc))
    de = _log2_floor(1.0 - pc) - _log2_floor(1.0 - qc)
    ub_a = pc * (lp - lq) + (1.0 - pc) * ((de + 1.0) * _LN2)
    ub_b = qc * (lq - lp) + (1.0 - qc) * ((1.0 - de) * _LN2)
    return chi2 & (max(ub_a, ub_b) > phi_lo)


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy", fastmath=_FASTMATH)
def verl_segment(  # type: ignore[no-untyped-def]
    j0, j1, x_mu, x_pi, x_on, b_d, b_rm1, b_r, b_k3, b_q, b_kp, params, vacc, fsum, cnt,
):  # fmt: skip
    """The verl-parity statistics of tokens [j0, j1) of the chunk, all of one sequence, from the
    first pass's buffers (reassociated: vectorised): their token sums and counts into fsum and
    cnt, and their sums μ, π, min(r − 1, C − 1), w·min(r, C), r − 1, k2 and maxima of k2, k3
    into the sequence's running sums `vacc` (masked-out positions carry δ = 0, k3 = 0,
    r − 1 = 0 and are weighted out); KPop's candidates (`kpop_maybe`, the first pass's e^π
    under the first pass's flags) into b_kp (e^π, −1 elsewhere); return how many of them are
    masked in.
    (Slices, read from 0: an index LLVM cannot prove non-negative keeps numba's wraparound
    test in the loop, which then does not vectorise.)"""
    on_, mu_, pi_ = x_on[j0:j1], x_mu[j0:j1], x_pi[j0:j1]
    d_, rm1_, r_, k3_, q_ = b_d[j0:j1], b_rm1[j0:j1], b_r[j0:j1], b_k3[j0:j1], b_q[j0:j1]
    kp_ = b_kp[j0:j1]
    phi_lo = kpop_threshold(params[5])
    tis_c, k1_lo, k1_hi, t_k2, t_k3 = params[6], params[12], params[13], params[14], params[15]
    c_tis, c_m1 = params[21], params[22]
    n_on = 0
    s_mu = s_pi = s_wm1 = s_w = s_rm1 = s_k2 = 0.0
    s_wm1sq = s_w2 = s_pd2 = s_p = s_q = s_p2 = s_q2 = s_pq = 0.0
    n_low = n_k1 = n_k2 = n_k3 = 0
    k_k2 = k_k3 = order_key(0.0)
    for j in range(j1 - j0):
        on = on_[j] != 0
        n_on += on
        s_mu += np.float64(mu_[j]) if on else 0.0
        s_pi += np.float64(pi_[j]) if on else 0.0
        w = 1.0 if on else 0.0
        d = d_[j]
        rm1 = rm1_[j]
        dc = min(max(d, -20.0), 20.0)
        k2 = 0.5 * dc * dc
        k3 = k3_[j]
        wm1 = min(rm1, c_m1)
        wt = min(r_[j], c_tis)
        q = q_[j]
        pp = q + q * rm1
        near = abs(d) <= 20.0
        pdiff = abs(pp - q) if near else 0.0
        p = np.float64(pi_[j]) if on else -1.0
        m = np.float64(mu_[j]) if on else -1.0
        kp_[j] = pp if near & kpop_maybe(pp, q, p, m, phi_lo) else -1.0
        wn = w if near else 0.0  # probabilities of |δ| > 20 come from the walk
        pw = wn * pp
        qw = wn * q
        s_wm1 += wm1
        s_wm1sq += wm1 * wm1
        s_w += w * wt
        s_w2 += w * (wt * wt)
        s_rm1 += rm1
        s_k2 += k2
        s_pd2 += pdiff * pdiff
        s_p += pw
        s_q += qw
        s_p2 += pw * pp
        s_q2 += qw * q
        s_pq += pw * q
        n_low += on & (dc < -tis_c)
        n_k1 += on & ((-dc < k1_lo) | (-dc > k1_hi))
        n_k2 += k2 > t_k2
        n_k3 += k3 > t_k3
        kx = order_key(k2)
        k_k2 = kx if kx > k_k2 else k_k2
        kx = order_key(k3)
        k_k3 = kx if kx > k_k3 else k_k3
    fsum[_F_TIS] += s_wm1
    fsum[_F_TIS + 1] += s_wm1sq
    fsum[_F_TIS + 2] += s_w
    fsum[_F_TIS + 3] += s_w2
    fsum[_F_PD2] += s_pd2
    fsum[_F_PD2 + 1] += s_p
    fsum[_F_PD2 + 2] += s_q
    fsum[_F_PD2 + 3] += s_p2
    fsum[_F_PD2 + 4] += s_q2
    fsum[_F_PD2 + 5] += s_pq
    cnt[_C_LOW] += n_low
    cnt[_C_TOK2 + 0] += n_k1
    cnt[_C_TOK2 + 1] += n_k2
    cnt[_C_TOK2 + 2] += n_k3
    vacc[3] += s_mu
    vacc[4] += s_pi
    vacc[5] += s_wm1
    vacc[6] += s_w
    vacc[7] += s_rm1
    vacc[8] += s_k2
    vacc[9] = max(vacc[9], from_order_key(k_k2))
    vacc[10] = max(vacc[10], from_order_key(k_k3))
    return n_on


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy")
def top_k(c0, m, x_on, b_score, worst_score, worst_index, wmin):  # type: ignore[no-untyped-def]
    """The chunk's masked tokens into the top-k by score (worst_index: their batch positions),
    in token order: a token replaces the minimal slot `wmin` (the first minimal one) when its
    score is strictly greater. The chunk's largest score is found first (vectorised); a chunk
    whose scores cannot enter is not walked. Returns the new minimal slot."""
    k_lo = order_key(-_BIG)
    k_max = k_lo
    for j in range(m):
        kx = order_key(b_score[j]) if x_on[j] != 0 else k_lo
        k_max = kx if kx > k_max else k_max
    thr = worst_score[wmin]
    if not from_order_key(k_max) > thr:
        return wmin
    for j in range(m):
        score = b_score[j]
        if x_on[j] != 0 and score > thr:
            worst_score[wmin] = score
            worst_index[wmin] = c0 + j
            for i in range(worst_score.shape[0]):
                if worst_score[i] < worst_score[wmin]:
                    wmin = i
            thr = worst_score[wmin]
    return wmin


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy")
def verl_close(vacc, fsum, fext, cnt, params):  # type: ignore[no-untyped-def]
    """verl's per-sequence statistics and its five sequence rejection modes for the sequence in
    `vacc` (n_s > 0), then reset `vacc`."""
    n_s = vacc[0]
    g = (0.0 - vacc[1]) / n_s  # log-perplexity difference mean μ − mean π (+0.0, never −0.0)
    fsum[_F_PPL + 4] += g
    fsum[_F_PPL + 5] += abs(g)
    fsum[_F_PPL + 6] += math.exp(min(max(g, -_EXP_GUARD), _EXP_GUARD))
    fext[_M_LPD_MAX] = max(fext[_M_LPD_MAX], g)
    fext[_M_LPD_MIN] = min(fext[_M_LPD_MIN], g)
    lp_train = (0.0 - vacc[4]) / n_s
    lp_roll = (0.0 - vacc[3]) / n_s
    fsum[_F_PPL + 0] += math.exp(min(lp_train, _EXP_GUARD))
    fsum[_F_PPL + 1] += lp_train
    fsum[_F_PPL + 2] += math.exp(min(lp_roll, _EXP_GUARD))
    fsum[_F_PPL + 3] += lp_roll
    u = vacc[5] / n_s  # mean truncated weight − 1 (moments); the mean itself for sum and extrema
    wbar = vacc[6] / n_s
    fsum[_F_PPL + 7] += u
    fsum[_F_PPL + 8] += u * u
    fsum[_F_PPL + 9] += wbar
    fext[_M_W_MAX] = max(fext[_M_W_MAX], wbar)
    fext[_M_W_MIN] = min(fext[_M_W_MIN], wbar)
    fext[_M_W_DEV] = max(fext[_M_W_DEV], abs(u))
    raw = vacc[7] / n_s  # mean raw weight − 1
    cnt[_C_WHI] += raw > params[22]
    cnt[_C_WHI + 1] += raw < params[23]
    s_k2, s_k3 = vacc[8], vacc[2]
    rejects = (
        s_k2 > params[16], s_k3 > params[17], s_k2 / n_s > params[18], vacc[9] > params[19],
        vacc[10] > params[20],
    )  # fmt: skip
    for i in range(5):
        if rejects[i]:
            cnt[_C_TOK2 + 3 + i] += np.int64(n_s)
            cnt[_C_SEQR2 + i] += 1
    vacc[:] = 0.0


@njit(cache=True, nogil=True, _nrt=False, error_model="numpy")
def start_segments(cu, n, vst):  # type: ignore[no-untyped-def]
    """vst = (first sequence with tokens, its end)."""
    nseq = cu.shape[0] - 1
    s = 0
    while s < nseq and cu[s + 1] == 0:
        s += 1
    vst[0] = s
    vst[1] = cu[s + 1] if s < nseq else n
