"""Per-sequence statistics of the verl-parity metrics, vectorised over sequence segments.

The fused kernel's scalar walk keeps what it always computed (its sequential per-sequence sums
give the original rows their bits). verl's per-sequence statistics are new definitions with
no such history, so they are summed here instead: each chunk is cut at sequence boundaries and
every segment is one vectorised reduction over the chunk's staged buffers (reassociated sums,
float rounding at the 1e-16 level); the running sums of a sequence cross chunks in `vacc`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from timwatch.monitor.core.fastmath import bits_f64, f64_bits
from timwatch.monitor.core.layout import C, F, M

__all__ = ["VACC", "close_segments", "segment_pass", "start_segments"]

_FASTMATH = {"reassoc", "nsz", "contract"}
_EXP_GUARD = 600.0  # perplexity exps: far from overflow even summed over 2^53 sequences
_F_PPL = F.ppl_train
_C_TOK2, _C_SEQR2, _C_WHI = C.tok_reject2, C.seq_reject2, C.seq_w_high
_M_LPD_MAX, _M_W_MAX, _M_W_DEV, _M_LPD_MIN, _M_W_MIN = (
    M.lpd_max, M.seq_w_max, M.seq_w_dev, M.lpd_min, M.seq_w_min,
)  # fmt: skip
#: running sums of the current sequence: n, L, Σk3, Σμ, Σπ, Σ(w−1), Σw, Σ(r−1), Σk2, max k2, max k3
VACC = 11


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_FASTMATH)
def _segment(  # type: ignore[no-untyped-def]
    j0, j1, x_on, x_mu, x_pi, b_d, b_k3, b_rm1, b_w, c_m1, vacc,
):  # fmt: skip
    """Add local positions [j0, j1) of the staged chunk to `vacc` (masked-out positions carry
    δ = 0, k3 = 0, r − 1 = 0 and are weighted out of the rest)."""
    n = 0
    s_l = s_k3 = s_mu = s_pi = s_wm1 = s_w = s_rm1 = s_k2 = 0.0
    k_k2 = k_k3 = np.int64(0)  # maxima of non-negative floats on their bits (ordered alike)
    for j in range(j0, j1):
        on = x_on[j] != 0
        w = 1.0 if on else 0.0
        d = b_d[j]
        k3 = b_k3[j]
        rm1 = b_rm1[j]
        dc = min(max(d, -20.0), 20.0)
        k2 = 0.5 * dc * dc
        n += on
        s_l += d
        s_k3 += k3
        s_mu += w * x_mu[j]
        s_pi += w * x_pi[j]
        s_wm1 += min(rm1, c_m1)
        s_w += w * b_w[j]
        s_rm1 += rm1
        s_k2 += k2
        kx = np.int64(f64_bits(k2))
        k_k2 = kx if kx > k_k2 else k_k2
        kx = np.int64(f64_bits(k3))
        k_k3 = kx if kx > k_k3 else k_k3
    vacc[0] += n
    vacc[1] += s_l
    vacc[2] += s_k3
    vacc[3] += s_mu
    vacc[4] += s_pi
    vacc[5] += s_wm1
    vacc[6] += s_w
    vacc[7] += s_rm1
    vacc[8] += s_k2
    vacc[9] = max(vacc[9], bits_f64(k_k2))
    vacc[10] = max(vacc[10], bits_f64(k_k3))


@njit(cache=True, nogil=True, error_model="numpy")
def _close(vacc, fsum, fext, cnt, params):  # type: ignore[no-untyped-def]
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


@njit(cache=True, nogil=True, error_model="numpy")
def start_segments(cu, n, vst):  # type: ignore[no-untyped-def]
    """vst = (first sequence with tokens, its end)."""
    nseq = cu.shape[0] - 1
    s = 0
    while s < nseq and cu[s + 1] == 0:
        s += 1
    vst[0] = s
    vst[1] = cu[s + 1] if s < nseq else n


@njit(cache=True, nogil=True, error_model="numpy")
def segment_pass(  # type: ignore[no-untyped-def]
    cu, n, c0, c1, vst, vacc, x_on, x_mu, x_pi, b_d, b_k3, b_rm1, b_w, params, fsum, fext, cnt,
):  # fmt: skip
    """Fold the staged chunk [c0, c1) into the per-sequence sums, closing every sequence that
    ends inside it."""
    nseq = cu.shape[0] - 1
    c_m1 = params[22]
    a = c0
    while a < c1:
        end = vst[1]
        b = min(end, c1)
        if b > a:
            _segment(a - c0, b - c0, x_on, x_mu, x_pi, b_d, b_k3, b_rm1, b_w, c_m1, vacc)
        a = b
        if b == end and end < n:
            if vacc[0] > 0:
                _close(vacc, fsum, fext, cnt, params)
            s = vst[0] + 1
            while s < nseq and cu[s + 1] == end:
                s += 1
            vst[0] = s
            vst[1] = cu[s + 1] if s < nseq else n


@njit(cache=True, nogil=True, error_model="numpy")
def close_segments(vacc, fsum, fext, cnt, params):  # type: ignore[no-untyped-def]
    """Close the last sequence after the final chunk."""
    if vacc[0] > 0:
        _close(vacc, fsum, fext, cnt, params)
