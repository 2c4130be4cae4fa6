"""Branch-free float64 math for the numba kernels: exp, log, k3 and bit-sliced bins.

libm's exp and log are calls that stop LLVM from vectorising a loop; these are inlined
polynomials (within 2 ulp of libm, checked in tests) built only from operations AVX2 has for
float64 lanes, so a loop of them runs 4 (AVX2) or 8 (AVX-512) tokens per instruction.
`error_model="numpy"` matters: Python's model inserts a zero check before every division.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .jitcache import njit

__all__ = [
    "bits_f64",
    "exp",
    "f64_bits",
    "fine_index",
    "from_order_key",
    "k3_of",
    "k3_rm1_r",
    "log",
    "order_key",
]

LOG_P_LO = math.log(1e-8)
LOG_P_HI = math.log1p(-1e-8)


@intrinsic
def f64_bits(typingctx, x):  # type: ignore[no-untyped-def]
    sig = types.uint64(types.float64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(64))

    return sig, codegen


@intrinsic
def bits_f64(typingctx, x):  # type: ignore[no-untyped-def]
    sig = types.float64(x)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.DoubleType())

    return sig, codegen


_INV_LN2 = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # fdlibm's split of ln 2: k·_LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_SQRT2 = 1.4142135623730951


@njit(inline="always", cache=True, error_model="numpy")
def exp(x):  # type: ignore[no-untyped-def]
    """exp for x in [-700, 700] (clamped), branch-free, within 2 ulp of libm.

    Range reduction x = k·ln2 + r, |r| ≤ ln2/2, then a degree-13 Taylor polynomial
    (truncation < 1e-17 relative) and 2^k assembled from bits. Unlike a libm call it vectorises:
    ~2 ns per value in an AVX2 loop here against ~10 ns for the scalar call.
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
    return p * bits_f64((np.int64(k) + 1023) << 52)


@njit(inline="always", cache=True, error_model="numpy")
def log(x):  # type: ignore[no-untyped-def]
    """log for positive normal x, branch-free: x = 2^e·m, m ∈ [√½, √2), log m = 2·atanh(s).

    s = (m − 1)/(m + 1) has |s| ≤ 0.172, so the odd series to s^23 is below 1e-17 relative,
    and m − 1 is exact, which keeps the result accurate near x = 1 (where KPop needs it).
    """
    bits = f64_bits(x)
    # unsigned shifts and the exponent as a double without an int→float conversion: AVX2 has
    # neither a 64-bit arithmetic shift nor that conversion, and either would stop vectorising
    e = bits_f64((bits >> np.uint64(52)) | np.uint64(0x4330000000000000)) - 4503599627371519.0
    m = bits_f64((bits & np.uint64(0xFFFFFFFFFFFFF)) | np.uint64(0x3FF0000000000000))
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
def k3_rm1_r(d):  # type: ignore[no-untyped-def]
    """(k3, r − 1, r) for δ, branch-free: series below |δ| = 1e-2 (where exp − 1 would cancel),
    exp of the clamped δ above."""
    ser = d * d * (0.5 + d * (1 / 6 + d * (1 / 24 + d * (1 / 120 + d * (1 / 720 + d / 5040)))))
    dc = min(max(d, -20.0), 20.0)
    r = exp(dc)
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
            out[t] = k3_rm1_r(np.float64(pi[t]) - np.float64(mu[t]))[0]
    return out


@njit(inline="always", cache=True, error_model="numpy")
def fine_index(x, biased_lo, octaves, sub_bits, last):  # type: ignore[no-untyped-def]
    """Bin of x ≥ 0 in a bit-sliced log histogram (see core.histograms), branch-free."""
    bits = f64_bits(x)
    e = np.int64(bits >> np.uint64(52))
    sub = np.int64(bits >> np.uint64(52 - sub_bits)) & ((1 << sub_bits) - 1)
    idx = 1 + (e - biased_lo) * (1 << sub_bits) + sub
    idx = last if e >= biased_lo + octaves else idx
    return 0 if e < biased_lo else idx


@njit(inline="always", cache=True, error_model="numpy")
def order_key(x):  # type: ignore[no-untyped-def]
    """An int64 that orders like the float x (negative floats get their magnitude bits flipped).

    Float min/max reductions do not vectorise in numba; integer ones do, so extrema are
    tracked on these keys. The map is its own inverse.
    """
    k = np.int64(f64_bits(x))
    return k ^ 0x7FFFFFFFFFFFFFFF if k < 0 else k


@njit(inline="always", cache=True, error_model="numpy")
def from_order_key(k):  # type: ignore[no-untyped-def]
    return bits_f64(k ^ 0x7FFFFFFFFFFFFFFF if k < 0 else k)
