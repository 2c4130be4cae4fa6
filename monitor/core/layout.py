"""Index layout of the accumulator vectors the fused kernel fills and the row reads.

Plain constants, no numba: the accumulator, the row and the store read these without loading
the kernel.
"""

from __future__ import annotations

__all__ = ["C", "F", "M"]


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
