"""Index layout of the accumulator vectors the fused kernel fills and the row reads.

Plain constants, no numba: the accumulator, the row and the store read these without loading
the kernel. New entries are only ever appended, so a stored accumulator state of an older
layout reads back by padding (see `Accumulator.from_state`).
"""

from __future__ import annotations

__all__ = ["C", "F", "M"]


class F:
    """Indices of the float64 sum vector."""

    d, ad, d2, k3, rm1, rm1sq, h, h2, d2h, d4, pdiff, score = range(12)
    seq_abs_l, seq_geo, seq_exp2l = range(12, 15)
    r, r2 = 15, 16  # raw Σr, Σr² beside the shifted Σ(r−1), Σ(r−1)²: each is exact in one regime
    # truncated weights w = min(r, C): shifted Σ(w−1), Σ(w−1)² and raw Σw, Σw²
    tis_m1, tis_m1sq, tis_w, tis_w2 = range(17, 21)
    # probabilities p = e^π, q = e^μ: Σ|p−q|², Σp, Σq, Σp², Σq², Σpq
    pd2, p, q, p2, q2, pq = range(21, 27)
    # per-sequence sums over sequences with n_s > 0 (g_s = −L_s/n_s, u_s = mean_s(w) − 1)
    ppl_train, log_ppl_train, ppl_roll, log_ppl_roll = range(27, 31)
    lpd, lpd_abs, ppl_ratio, seq_w_m1, seq_w_m1sq, seq_w = range(31, 37)
    size = 37


class M:
    """Indices of the extrema vector: maxima, then minima (MINIMA)."""

    ad, pdiff, d_max, seq_abs_l, h_max, d2_max = range(6)
    d_min, h_min, d2_min = range(6, 9)
    lpd_max, seq_w_max, seq_w_dev = range(9, 12)  # seq_w_*: mean truncated weight itself
    lpd_min, seq_w_min = range(12, 14)
    MINIMA = (6, 7, 8, 12, 13)
    ZERO_START = (0, 1, 3, 11)  # maxima of non-negative values start at 0, not −inf
    size = 14


class C:
    """Indices of the int64 count vector.

    Policy i of `masks.POLICIES` counts its rejected tokens at `tok(i)`; sequence policy j of
    `masks.SEQUENCE_POLICIES` its rejected sequences at `seq(j)`. The first eight policies (and
    first three sequence policies) keep their original slots.
    """

    tokens, sequences = 0, 1
    tok_reject = 2  # + policy index, the original 8 policies
    seq_reject = 10  # + 0 seq_mis, 1 geo_rs, 2 k3_rs
    is_low = 13  # tokens with r < 1/C (C = TIS bound)
    tok_reject2 = 14  # + policy index − 8, the 8 verl rejection modes
    seq_reject2 = 22  # + sequence-policy index − 3, the 5 sequence verl modes
    seq_w_high, seq_w_low = 27, 28  # sequences whose mean raw r is above C / below 1/C
    size = 29

    @staticmethod
    def tok(i: int) -> int:
        return C.tok_reject + i if i < 8 else C.tok_reject2 + i - 8

    @staticmethod
    def seq(j: int) -> int:
        return C.seq_reject + j if j < 3 else C.seq_reject2 + j - 3
