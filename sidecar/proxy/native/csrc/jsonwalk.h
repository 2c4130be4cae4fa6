/* JSON's structure walked on its bytes: where each value starts and ends, nothing parsed.
 * Strings are followed with their escapes and containers are matched, so a span is always a
 * whole value and a key inside a string never matches; scalars are only skipped to their
 * delimiter (orjson reads them). Malformed bytes give -1, never a guessed span. */
#ifndef TIMWATCH_JSONWALK_H
#define TIMWATCH_JSONWALK_H

#include <stdint.h>
#include <string.h>

#include "common.h"

enum { W_PARENT, W_DEPTH, W_KEY_START, W_KEY_END, W_VALUE_START, W_VALUE_END, W_INDEX, W_COLS };
#define W_TOO_SHORT (-2)
#define W_MAX_DEPTH 16

static inline int is_ws(int c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

static inline i64 skip_ws(const uint8_t *b, i64 n, i64 i) {
    while (i < n && is_ws(b[i])) i++;
    return i;
}

/* b[i] is an opening quote: the index after the closing one, -1: unterminated. */
static i64 string_end(const uint8_t *b, i64 n, i64 i) {
    for (i++; i < n; i++) {
        if (b[i] == '\\') i++;
        else if (b[i] == '"') return i + 1;
    }
    return -1;
}

/* The index after the value at b[i] (no leading space), -1: not a whole value. */
static i64 skip_value(const uint8_t *b, i64 n, i64 i) {
    if (i >= n) return -1;
    int c = b[i];
    if (c == '"') return string_end(b, n, i);
    if (c != '[' && c != '{') {
        i64 j = i;
        for (; j < n; j++) {
            int d = b[j];
            if (d == ',' || d == ']' || d == '}' || is_ws(d)) break;
            if (d == '"' || d == '[' || d == '{' || d == ':') return -1;
        }
        return j > i ? j : -1;
    }
    i64 depth = 0;
    for (i64 j = i; j < n;) {
        int d = b[j];
        if (d == '"') {
            j = string_end(b, n, j);
            if (j < 0) return -1;
            continue;
        }
        if (d == '[' || d == '{') {
            depth++;
        } else if (d == ']' || d == '}') {
            if (--depth == 0) return j + 1;
        }
        j++;
    }
    return -1;
}

/* Every value of the one JSON object b holds, down to max_depth for objects and
 * max_array_depth for arrays (deeper ones get one row, their items none), into rows (cap x
 * W_COLS): its container's row (-1: the root), depth, key span without quotes (-1 in an
 * array), value span and position in its container. Returns the row count; -1: b is not one
 * JSON object; W_TOO_SHORT: more than cap rows. */
static i64 walk_json(const uint8_t *b, i64 n, i64 max_depth, i64 max_array_depth, i64 *rows,
                     i64 cap) {
    i64 st_row[W_MAX_DEPTH + 2], st_count[W_MAX_DEPTH + 2];
    int st_obj[W_MAX_DEPTH + 2];
    if (max_depth > W_MAX_DEPTH) max_depth = W_MAX_DEPTH;
    if (max_array_depth > W_MAX_DEPTH) max_array_depth = W_MAX_DEPTH;
    i64 i = skip_ws(b, n, 0);
    if (i >= n || b[i] != '{') return -1;
    if (cap < 1) return W_TOO_SHORT;
    i64 *root = rows;
    root[W_PARENT] = -1, root[W_DEPTH] = 0, root[W_KEY_START] = -1, root[W_KEY_END] = -1;
    root[W_VALUE_START] = i, root[W_VALUE_END] = -1, root[W_INDEX] = 0;
    i64 r = 1, sp = 1;
    st_row[0] = 0, st_obj[0] = 1, st_count[0] = 0;
    i = skip_ws(b, n, i + 1);
    while (sp > 0) {
        if (i >= n) return -1;
        int c = b[i], obj = st_obj[sp - 1];
        if ((obj && c == '}') || (!obj && c == ']')) {
            rows[W_COLS * st_row[sp - 1] + W_VALUE_END] = i + 1;
            sp--;
            i = skip_ws(b, n, i + 1);
            if (sp == 0) return i == n ? r : -1;
            if (i < n && b[i] == ',') i = skip_ws(b, n, i + 1);
            continue;
        }
        i64 ks = -1, ke = -1, v = i;
        if (obj) {
            if (c != '"') return -1;
            i64 k_end = string_end(b, n, i);
            if (k_end < 0) return -1;
            ks = i + 1, ke = k_end - 1;
            i64 j = skip_ws(b, n, k_end);
            if (j >= n || b[j] != ':') return -1;
            v = skip_ws(b, n, j + 1);
        }
        if (r == cap) return W_TOO_SHORT;
        i64 *row = rows + W_COLS * r;
        row[W_PARENT] = st_row[sp - 1], row[W_DEPTH] = sp, row[W_KEY_START] = ks;
        row[W_KEY_END] = ke, row[W_VALUE_START] = v, row[W_VALUE_END] = -1;
        row[W_INDEX] = st_count[sp - 1]++;
        int d = v < n ? b[v] : 0;
        if ((d == '{' && sp < max_depth) || (d == '[' && sp < max_array_depth)) {
            st_row[sp] = r, st_obj[sp] = d == '{', st_count[sp] = 0;
            sp++;
            r++;
            i = skip_ws(b, n, v + 1);
            continue;
        }
        r++;
        i64 e = skip_value(b, n, v);
        if (e < 0) return -1;
        row[W_VALUE_END] = e;
        i = skip_ws(b, n, e);
        if (i < n && b[i] == ',') i = skip_ws(b, n, i + 1);
        else if (i >= n || (b[i] != '}' && b[i] != ']')) return -1;
    }
    return -1;
}

/* For the array of objects at b[i]: each object's value of member key (m bytes, no quotes)
 * copied verbatim into out as one JSON list "[v0,v1,...]" (out: room for n - i + 2 bytes).
 * Returns the count and sets *length; -1: not an array of objects that all have that member
 * with a scalar value. */
static i64 member_values(const uint8_t *b, i64 n, i64 i, const uint8_t *key, i64 m, uint8_t *out,
                         i64 *length) {
    i64 f = 1, count = 0;
    out[0] = '[';
    *length = 0;
    if (i >= n || b[i] != '[') return -1;
    i = skip_ws(b, n, i + 1);
    if (i < n && b[i] == ']') {
        out[1] = ']';
        *length = 2;
        return 0;
    }
    for (;;) {
        if (i >= n || b[i] != '{') return -1;
        int found = 0;
        i64 j = skip_ws(b, n, i + 1);
        for (;;) {
            if (j >= n || b[j] != '"') return -1;
            i64 k_end = string_end(b, n, j);
            if (k_end < 0) return -1;
            i64 c = skip_ws(b, n, k_end);
            if (c >= n || b[c] != ':') return -1;
            i64 v = skip_ws(b, n, c + 1);
            i64 e = skip_value(b, n, v);
            if (e < 0) return -1;
            if (!found && k_end - 1 - (j + 1) == m && memcmp(b + j + 1, key, (size_t)m) == 0) {
                int d = b[v];
                if (d == '"' || d == '[' || d == '{') return -1;
                memcpy(out + f, b + v, (size_t)(e - v));
                f += e - v;
                out[f++] = ',';
                found = 1;
            }
            j = skip_ws(b, n, e);
            if (j < n && b[j] == ',') j = skip_ws(b, n, j + 1);
            else if (j < n && b[j] == '}') break;
            else return -1;
        }
        if (!found) return -1;
        count++;
        i = skip_ws(b, n, j + 1);
        if (i < n && b[i] == ',') {
            i = skip_ws(b, n, i + 1);
        } else if (i < n && b[i] == ']') {
            out[f - 1] = ']';
            *length = f;
            return count;
        } else {
            return -1;
        }
    }
}

#endif
