/* JSON log-prob triples [[logprob,id,null],...] read into arrays. Every log-prob read is the
 * double Python's float() and orjson give for its token, bit for bit: a plain decimal with a
 * significand below 2**53 and at most 22 decimals is one correctly rounded division of two
 * exact doubles (Clinger's fast path); any other number is w * 10**q with w at most 19
 * digits, rounded from a 128-bit product with 5**q (Eisel-Lemire, as the fast_float library;
 * the table is passed in, [high, low] words per q in Q_MIN..Q_MAX). What that cannot decide
 * exactly is refused, never approximated: more than 19 significant digits, a subnormal or
 * infinite result, an exponent of more than 4 digits, anything that is not strict JSON, a
 * triple that is not [number,id,null]. A refusal sends the caller to orjson. */
#ifndef TIMWATCH_NUMBERS_H
#define TIMWATCH_NUMBERS_H

#include <stdint.h>
#include <string.h>

#include "common.h"

#define Q_MIN (-342)
#define Q_MAX 308
#define REFUSED (-1)

static inline int byte_at(const uint8_t *b, i64 n, i64 i) { return i < n ? b[i] : 0; }

static inline int digit_at(const uint8_t *b, i64 n, i64 i) {
    if (i < n) {
        int c = (int)b[i] - '0';
        if (c >= 0 && c <= 9) return c;
    }
    return -1;
}

/* IEEE-754 bits of +-w * 10**q, correctly rounded (nearest, ties to even), or REFUSED. */
static i64 to_bits(u64 w, int q, int neg, const u64 *table) {
    u64 sign = neg ? (u64)1 << 63 : 0;
    if (w == 0) return (i64)sign;
    if (q < Q_MIN || q > Q_MAX) return REFUSED;
    int lz = __builtin_clzll(w);
    w <<= lz;
    __uint128_t p = (__uint128_t)w * table[2 * (q - Q_MIN)];
    u64 hi = (u64)(p >> 64), lo = (u64)p;
    const u64 mask = 0x1FF;
    if ((hi & mask) == mask) {
        u64 s_hi = (u64)(((__uint128_t)w * table[2 * (q - Q_MIN) + 1]) >> 64);
        u64 lo2 = lo + s_hi;
        if (s_hi > lo2) hi += 1;
        lo = lo2;
    }
    if (lo == ~(u64)0 && (q < -27 || q > 55)) return REFUSED;
    int upper = (int)(hi >> 63);
    int shift = upper + 9;
    u64 mant = hi >> shift;
    i64 power2 = ((((i64)152170 + 65536) * q) >> 16) + 63 + upper - lz + 1023;
    if (power2 <= 0) return REFUSED;
    if (lo <= 1 && q >= -4 && q <= 23 && (mant & 3) == 1) {
        if ((mant << shift) == hi) mant &= ~(u64)1;
    }
    mant += mant & 1;
    mant >>= 1;
    if (mant >= ((u64)2 << 52)) {
        mant = (u64)1 << 52;
        power2 += 1;
    }
    mant &= ~((u64)1 << 52);
    if (power2 >= 0x7FF) return REFUSED;
    return (i64)(mant | ((u64)power2 << 52) | sign);
}

/* The digits at b[i:] appended to *w (eight at a time where eight follow); returns how many,
 * *end after them. *w wraps past 19 digits, which the caller refuses. */
static inline int digits_at(const uint8_t *b, i64 n, i64 i, u64 *w, i64 *end) {
    int count = 0;
    u64 acc = *w;
    while (i + 8 <= n) {
        u64 v;
        memcpy(&v, b + i, 8); /* the eight-digit test below reads a little-endian word */
        if ((((v + 0x4646464646464646ULL) | (v - 0x3030303030303030ULL)) & 0x8080808080808080ULL))
            break;
        v -= 0x3030303030303030ULL;
        v = v * 10 + (v >> 8);
        v = (((v & 0x000000FF000000FFULL) * 0x000F424000000064ULL) +
             (((v >> 16) & 0x000000FF000000FFULL) * 0x0000271000000001ULL)) >> 32;
        acc = acc * 100000000ULL + (v & 0xFFFFFFFFULL);
        count += 8;
        i += 8;
    }
    int d = digit_at(b, n, i);
    while (d >= 0) {
        acc = acc * 10 + (u64)d;
        count++;
        i++;
        d = digit_at(b, n, i);
    }
    *w = acc;
    *end = i;
    return count;
}

/* Bits of the JSON number at b[i] (REFUSED: not one, or not exact here). orjson reads "-0" as
 * the int 0, so +0.0; "-0.0" stays -0.0. */
static i64 number_at(const uint8_t *b, i64 n, i64 i, const u64 *table, i64 *end) {
    int neg = i < n && b[i] == '-';
    if (neg) i++;
    int d = digit_at(b, n, i);
    *end = i;
    if (d < 0) return REFUSED;
    u64 w = 0;
    int digits = 0, q = 0, is_float = 0;
    if (d == 0) {
        i++;
        if (digit_at(b, n, i) >= 0) {
            *end = i;
            return REFUSED;
        }
    } else {
        digits += digits_at(b, n, i, &w, &i);
    }
    if (i < n && b[i] == '.') {
        is_float = 1;
        i++;
        d = digit_at(b, n, i);
        if (d < 0) {
            *end = i;
            return REFUSED;
        }
        while (d == 0 && w == 0) {
            q--;
            i++;
            d = digit_at(b, n, i);
        }
        int k = digits_at(b, n, i, &w, &i);
        digits += k;
        q -= k;
    }
    if (i < n && (b[i] == 'e' || b[i] == 'E')) {
        is_float = 1;
        i++;
        int e_neg = i < n && b[i] == '-';
        if (i < n && (b[i] == '-' || b[i] == '+')) i++;
        d = digit_at(b, n, i);
        if (d < 0) {
            *end = i;
            return REFUSED;
        }
        int e = 0, e_digits = 0;
        while (d >= 0) {
            if (e_digits < 5) e = e * 10 + d;
            e_digits++;
            i++;
            d = digit_at(b, n, i);
        }
        *end = i;
        if (e_digits > 4) return REFUSED;
        q += e_neg ? -e : e;
    }
    *end = i;
    if (digits > 19) return REFUSED;
    return to_bits(w, q, neg && (is_float || w != 0), table);
}

static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                 1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* The number at b[i] as a double; *end -1: refused. */
static inline double float_at(const uint8_t *b, i64 n, i64 i, const u64 *table, i64 *end) {
    i64 j = i;
    int neg = j < n && b[j] == '-';
    j += neg;
    u64 w = 0;
    int digits = 0, frac = -1;
    i64 first = j;
    while (j < n) {
        int c = b[j];
        if (c >= '0' && c <= '9') {
            w = w * 10 + (u64)(c - '0');
            digits++;
        } else if (c == '.' && frac < 0 && digits > 0) {
            frac = digits;
        } else {
            break;
        }
        j++;
    }
    int k = digits - frac;
    int lead_ok = byte_at(b, n, first) != '0' || frac == 1;
    if (frac > 0 && k > 0 && k <= 22 && digits <= 18 && w < ((u64)1 << 53) && lead_ok) {
        int c = byte_at(b, n, j);
        if (c != 'e' && c != 'E') {
            double value = (double)w / POW10[k];
            *end = j;
            return neg ? -value : value;
        }
    }
    i64 bits = number_at(b, n, i, table, &j);
    if (bits == REFUSED) {
        *end = -1;
        return 0.0;
    }
    *end = j;
    double out;
    memcpy(&out, &bits, 8);
    return out;
}

/* The `id,null]` ending a triple (id: at most 18 digits); -1 on failure, *end after the ']'. */
static inline i64 id_null_at(const uint8_t *b, i64 n, i64 i, i64 *end) {
    i64 value = 0, j = i;
    while (j < n && b[j] >= '0' && b[j] <= '9' && j - i < 18) {
        value = value * 10 + (b[j] - '0');
        j++;
    }
    if (j == i || byte_at(b, n, j) != ',') {
        *end = i;
        return -1;
    }
    i = j + 1;
    if (!(byte_at(b, n, i) == 'n' && byte_at(b, n, i + 1) == 'u' && byte_at(b, n, i + 2) == 'l' &&
          byte_at(b, n, i + 3) == 'l' && byte_at(b, n, i + 4) == ']')) {
        *end = i;
        return -1;
    }
    *end = i + 5;
    return value;
}

/* The triples list at b[i] appended to ids and vals from count (room for every triple the bytes
 * can hold: one per 10 bytes); returns the new count, -1: refused. */
static i64 triples_into(const uint8_t *b, i64 n, i64 i, i64 *ids, double *vals, i64 count,
                        const u64 *table, i64 *end) {
    if (byte_at(b, n, i) != '[') {
        *end = i;
        return -1;
    }
    i++;
    if (byte_at(b, n, i) == ']') {
        *end = i + 1;
        return count;
    }
    for (;;) {
        if (byte_at(b, n, i) != '[') {
            *end = i;
            return -1;
        }
        double value = float_at(b, n, i + 1, table, &i);
        if (i < 0 || byte_at(b, n, i) != ',') {
            *end = i;
            return -1;
        }
        i64 tid = id_null_at(b, n, i + 1, &i);
        if (tid < 0) {
            *end = i;
            return -1;
        }
        ids[count] = tid;
        vals[count] = value;
        count++;
        int c = byte_at(b, n, i);
        if (c == ',') {
            i++;
        } else if (c == ']') {
            *end = i + 1;
            return count;
        } else {
            *end = i;
            return -1;
        }
    }
}

#endif
