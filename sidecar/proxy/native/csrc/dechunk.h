/* HTTP/1.1 chunked coding undone, read by read. */
#ifndef TIMWATCH_DECHUNK_H
#define TIMWATCH_DECHUNK_H

#include <stdint.h>
#include <string.h>

#include "common.h"

enum { SIZE, EXT, SIZE_LF, DATA, DATA_CR, DATA_LF, TRAILER, FIELD, FIELD_LF, END_LF, DONE };
#define ERR (-1)

static inline int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 87;
    if (c >= 'A' && c <= 'F') return c - 55;
    return -1;
}

/* The body bytes of buf[:n] appended to out (room for n); returns their count. state is
 * (phase, bytes left in the chunk or the size so far, size digits seen, where the current
 * chunk-size line starts relative to the next read, and how many bytes of buf may be relayed
 * as they are: all but the last chunk's size line, trailer and end, and a size line that may
 * still be the last chunk's). Hex sizes of at most 15 digits, extensions after the size,
 * trailer fields; anything else, or a byte after the end, sets phase ERR. */
static i64 dechunk(const uint8_t *buf, i64 n, uint8_t *out, i64 *state) {
    i64 phase = state[0], left = state[1], digits = state[2], line = state[3];
    i64 i = 0, o = 0;
    while (i < n) {
        if (phase == DATA) {
            i64 take = left < n - i ? left : n - i;
            memcpy(out + o, buf + i, (size_t)take);
            o += take;
            i += take;
            left -= take;
            if (left == 0) {
                phase = DATA_CR;
                if (i + 1 < n && buf[i] == '\r' && buf[i + 1] == '\n') {
                    i += 2;
                    phase = SIZE, left = 0, digits = 0, line = i;
                    while (i < n) {
                        int h = hexval(buf[i]);
                        if (h < 0 || digits == 15) break;
                        left = left * 16 + h;
                        digits++;
                        i++;
                    }
                    if (digits && i + 1 < n && buf[i] == '\r' && buf[i + 1] == '\n') {
                        i += 2;
                        phase = left ? DATA : TRAILER;
                    }
                }
            }
            continue;
        }
        int c = buf[i++];
        switch (phase) {
        case SIZE: {
            int h = hexval(c);
            if (h >= 0 && digits < 15) {
                left = left * 16 + h;
                digits++;
            } else if (digits == 0) {
                phase = ERR;
            } else if (c == '\r') {
                phase = SIZE_LF;
            } else if (c == ';' || c == ' ' || c == '\t') {
                phase = EXT;
            } else {
                phase = ERR;
            }
            break;
        }
        case EXT:
            if (c == '\r') phase = SIZE_LF;
            else if (c == '\n') phase = ERR;
            break;
        case SIZE_LF:
            phase = c != '\n' ? ERR : left == 0 ? TRAILER : DATA;
            break;
        case DATA_CR:
            phase = c == '\r' ? DATA_LF : ERR;
            break;
        case DATA_LF:
            if (c == '\n') phase = SIZE, left = 0, digits = 0, line = i;
            else phase = ERR;
            break;
        case TRAILER:
            phase = c == '\r' ? END_LF : FIELD;
            break;
        case FIELD:
            if (c == '\r') phase = FIELD_LF;
            break;
        case FIELD_LF:
            phase = c == '\n' ? TRAILER : ERR;
            break;
        case END_LF:
            phase = c == '\n' ? DONE : ERR;
            break;
        default:
            phase = ERR;
        }
        if (phase == ERR) break;
    }
    i64 safe;
    if (phase == SIZE || phase == EXT || phase == SIZE_LF) safe = left == 0 ? line : n;
    else if (phase >= TRAILER) safe = line;
    else safe = n;
    state[0] = phase, state[1] = left, state[2] = digits, state[3] = line - n, state[4] = safe;
    return o;
}

#endif
