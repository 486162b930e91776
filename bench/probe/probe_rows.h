/* probe_rows.h - activation rows for the probes' output checks
 * (wgmma_probe, splitm_probe): bf16 values in [-1, 1] in steps of 1/64,
 * exact (7 bits of mantissa are enough), so a product with a dequantized
 * weight is exact and the checks compare sums, not roundings of inputs. */
#ifndef MOED_PROBE_ROWS_H
#define MOED_PROBE_ROWS_H

#include <stdint.h>
#include <string.h>

static inline void probe_exact_rows(uint16_t *hx, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const float f = (float)((int)((uint32_t)(i * 2654435761u) % 129u) - 64) / 64.0f;
        uint32_t u;
        memcpy(&u, &f, 4);
        hx[i] = (uint16_t)(u >> 16);
    }
}

#endif
