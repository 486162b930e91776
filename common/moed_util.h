/* moed_util.h - the small helpers every part of the tree used to copy:
 * the monotonic clock and the splitmix64 generator (header-only, so the
 * client library, moectl, bench and tests share them without linking). */
#ifndef MOED_UTIL_H
#define MOED_UTIL_H

#include <stdint.h>
#include <time.h>

/* CLOCK_MONOTONIC in ns (the clock uv_hrtime reads too). */
static inline uint64_t moed_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* splitmix64 (Steele, Lea, Flood 2014): the next value of the stream *s. */
static inline uint64_t moed_splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#endif
