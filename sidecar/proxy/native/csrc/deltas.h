/* A run of one sample's small unfinished delta frames (an incremental stream), read without
 * searching each frame for its keys.
 *
 * SGLang writes every delta of a sample with the same keys in the same order, so:
 * - a frame's end is the first "\n\n" after its start (compact JSON holds no raw newline),
 *   searched from a little before where the previous frame's length puts it;
 * - "output_token_logprobs_length": is looked for where the previous frame had it, counted
 *   from the frame's end; the list's key is the first ':' before it (a list of triples holds
 *   none), and "finish_reason": where the previous frame had it, counted back from the list's
 *   key. Each is checked byte for byte; a frame where one is not there is searched (`learn`)
 *   and teaches the positions to the next;
 * - one vectorised pass then counts every newline and every quote followed by "fi", "ind" or
 *   "output_t" over the frames read. Each holds at least five (its finish, list and total
 *   keys, its "\n\n"), so exactly five per frame prove there is no other: no "index", no
 *   "output_top_logprobs", no key twice, no frame end skipped. Where a string starts like one
 *   (a token's text "fi..."), the keys themselves are counted (`exact_marks`).
 * The scan stops at the first frame that is not such a delta (longer than `small`, not
 * "data: {", finished, a list that does not read exactly) and declines the whole read when the
 * count does not add up: a declined read costs the caller a frame-by-frame read, never a wrong
 * row. */
#ifndef TIMWATCH_DELTAS_H
#define TIMWATCH_DELTAS_H

#include <stdint.h>
#include <string.h>

#include "common.h"
#include "numbers.h"

static const char P_DATA[] = "data: {";
static const char P_FINISH[] = "\"finish_reason\":";
static const char P_LIST[] = "\"output_token_logprobs\":";
static const char P_TOTAL[] = "\"output_token_logprobs_length\":";
static const char P_TOP[] = "\"output_top_logprobs\":";
static const char P_INDEX[] = "\"index\":";
#define LEN(p) ((i64)sizeof(p) - 1)
#define SLACK 128

static inline int matches(const uint8_t *b, i64 i, i64 hi, const char *pat, i64 m) {
    return i + m <= hi && memcmp(b + i, pat, (size_t)m) == 0;
}

/* The index after the first "\n\n" at or after i; -1: none. */
static inline i64 frame_end(const uint8_t *b, i64 n, i64 i) {
    while (i < n) {
        const uint8_t *p = memchr(b + i, '\n', (size_t)(n - i));
        if (p == NULL) return -1;
        i64 k = p - b;
        if (k + 1 >= n) return -1;
        if (b[k + 1] == '\n') return k + 2;
        i = k + 1;
    }
    return -1;
}

static inline i64 int_at(const uint8_t *b, i64 i, i64 hi) {
    i64 value = 0, j = i;
    while (j < hi && b[j] >= '0' && b[j] <= '9' && j - i < 18) {
        value = value * 10 + (b[j] - '0');
        j++;
    }
    return j > i ? value : -1;
}

/* The first finish, list and total keys in b[fs:end] (-1 where absent). */
static void learn(const uint8_t *b, i64 fs, i64 end, i64 *kf, i64 *kl, i64 *kt) {
    *kf = *kl = *kt = -1;
    for (i64 i = fs; i < end; i++) {
        const uint8_t *p = memchr(b + i, '"', (size_t)(end - i));
        if (p == NULL) break;
        i = p - b;
        int c = b[i + 1];
        if (c == 'f' && *kf < 0 && matches(b, i, end, P_FINISH, LEN(P_FINISH))) {
            *kf = i;
        } else if (c == 'o') {
            if (*kt < 0 && matches(b, i, end, P_TOTAL, LEN(P_TOTAL))) *kt = i;
            else if (*kl < 0 && matches(b, i, end, P_LIST, LEN(P_LIST))) *kl = i;
        }
    }
}

/* Newlines, and quotes followed by `fi`, `ind` or `output_t`, in
 * b[:hi]. 32 positions at a time in the compiler's portable vectors (SSE2, AVX2 where the CPU
 * has it, NEON), each position's flag summed in its byte lane for up to 255 rounds. */
typedef signed char v32 __attribute__((vector_size(32)));

static inline v32 load32(const uint8_t *p) {
    v32 v;
    memcpy(&v, p, 32);
    return v;
}

static inline v32 flags32(const uint8_t *q) {
    v32 c0 = load32(q), c1 = load32(q + 1), c2 = load32(q + 2), c3 = load32(q + 3);
    v32 ot = (c1 == 'o') & (c2 == 'u') & (c3 == 't') & (load32(q + 7) == '_') &
             (load32(q + 8) == 't');
    v32 key = ((c1 == 'f') & (c2 == 'i')) | ((c1 == 'i') & (c2 == 'n') & (c3 == 'd'));
    return (c0 == '\n') | ((c0 == '"') & (key | ot)); /* -1 where flagged, else 0 */
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
__attribute__((target_clones("avx2", "default")))
#endif
static i64 marks(const uint8_t *b, i64 n, i64 hi) {
    i64 top = hi - 8 > 0 ? hi - 8 : 0;
    u64 total = 0;
    i64 p = 0;
    while (p + 32 <= top) {
        v32 acc = {0};
        for (int round = 0; round < 255 && p + 32 <= top; round++, p += 32) acc -= flags32(b + p);
        for (int lane = 0; lane < 32; lane++) total += (unsigned char)acc[lane];
    }
    for (; p < top; p++) {
        int c0 = b[p], c1 = b[p + 1], c2 = b[p + 2], c3 = b[p + 3];
        int ot = c1 == 'o' && c2 == 'u' && c3 == 't' && b[p + 7] == '_' && b[p + 8] == 't';
        int key = (c1 == 'f' && c2 == 'i') || (c1 == 'i' && c2 == 'n' && c3 == 'd');
        total += c0 == '\n' || (c0 == '"' && (key || ot));
    }
    i64 count = (i64)total;
    for (i64 k = top; k < hi; k++) {
        int c0 = b[k], c1 = byte_at(b, n, k + 1), c2 = byte_at(b, n, k + 2), c3 = byte_at(b, n, k + 3);
        if (c0 == '\n') count++;
        else if (c0 == '"' && ((c1 == 'f' && c2 == 'i') || (c1 == 'i' && c2 == 'n' && c3 == 'd')))
            count++;
        else if (c0 == '"' && c1 == 'o' && c2 == 'u' && c3 == 't' && k + 8 < hi)
            count += b[k + 7] == '_' && b[k + 8] == 't';
    }
    return count;
}

/* Newlines and the five keys themselves in b[:hi]. */
static i64 exact_marks(const uint8_t *b, i64 hi) {
    static const char *keys[5] = {P_FINISH, P_LIST, P_TOTAL, P_TOP, P_INDEX};
    static const i64 lens[5] = {LEN(P_FINISH), LEN(P_LIST), LEN(P_TOTAL), LEN(P_TOP), LEN(P_INDEX)};
    i64 count = 0;
    for (i64 k = 0; k < hi; k++) {
        if (b[k] == '\n') {
            count++;
        } else if (b[k] == '"') {
            for (int t = 0; t < 5; t++) {
                if (matches(b, k, hi, keys[t], lens[t])) {
                    count++;
                    break;
                }
            }
        }
    }
    return count;
}

typedef struct {
    i64 r, start, count, frames;
    int stopped;
} Walk;

/* The delta frames b starts with, into rows (cap x 7: start, end, kind 1, index 0, total,
 * count, at; consecutive frames of one row), ids and vals. */
static Walk walk(const uint8_t *b, i64 n, i64 small, i64 *rows, i64 cap, i64 *ids, double *vals,
                 const u64 *table) {
    Walk out = {0, 0, 0, 0, 0};
    i64 count = 0, start = 0, r = 0, frames = 0, length = 0;
    i64 lt = -1, lf = -1;
    while (start < n - 1) {
        i64 fs = start;
        i64 from = length - SLACK > 7 ? length - SLACK : 7;
        i64 end = frame_end(b, n, fs + from);
        if (end < 0 && length - SLACK > 7) end = frame_end(b, n, fs + 7);
        if (end < 0) break;
        length = end - fs;
        if (end - fs > small || !matches(b, fs, end, P_DATA, LEN(P_DATA))) {
            out.stopped = 1;
            break;
        }
        i64 kt = end - lt, kl = -1, kf;
        int ok = lt > 0 && kt > fs && matches(b, kt, end, P_TOTAL, LEN(P_TOTAL));
        if (ok) {
            i64 j = kt - 2;
            while (j > fs && b[j] != ':' && kt - j < 80) j--;
            kl = j + 1 - LEN(P_LIST);
            ok = b[kt - 1] == ',' && kl > fs && matches(b, kl, end, P_LIST, LEN(P_LIST));
        }
        kf = kl - lf;
        if (ok) ok = lf > 0 && kf > fs && matches(b, kf, end, P_FINISH, LEN(P_FINISH));
        if (!ok) {
            learn(b, fs, end, &kf, &kl, &kt);
            if (kf < 0 || kl < 0 || kt < 0) {
                out.stopped = 1;
                break;
            }
            lt = end - kt, lf = kl - kf;
        }
        if (b[kf + LEN(P_FINISH)] != 'n') {
            out.stopped = 1;
            break;
        }
        i64 total = int_at(b, kt + LEN(P_TOTAL), end), e;
        i64 got = triples_into(b, n, kl + LEN(P_LIST), ids, vals, count, table, &e);
        if (total < 0 || got < 0 || e != kt - 1) {
            out.stopped = 1;
            break;
        }
        i64 *prev = r > 0 ? rows + 7 * (r - 1) : NULL;
        if (prev && prev[4] + got - count == total && prev[1] == fs) {
            prev[1] = end, prev[4] = total, prev[5] += got - count;
        } else {
            if (r == cap) {
                out.stopped = 1;
                break;
            }
            i64 *row = rows + 7 * r;
            row[0] = fs, row[1] = end, row[2] = 1, row[3] = 0;
            row[4] = total, row[5] = got - count, row[6] = count;
            r++;
        }
        frames++;
        count = got;
        start = end;
    }
    out.r = r, out.start = start, out.count = count, out.frames = frames;
    return out;
}

#endif
