/* What the stream reader's C headers share. */
#ifndef TIMWATCH_COMMON_H
#define TIMWATCH_COMMON_H

#include <stdint.h>

typedef int64_t i64;
typedef uint64_t u64;

#endif
